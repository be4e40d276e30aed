"""memscale under DDP with two real ranks on NCCL, one GPU each: the same
losses and gradients as without memscale, one plan.  Skipped on a machine
with fewer than two GPUs (tests/test_distributed.py runs the same worker
on gloo and the CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import free_port

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.device_count() < 2,
        reason=f"two-rank NCCL needs two GPUs; this machine has {torch.cuda.device_count()}",
    ),
]

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ddp_on_nccl_same_gradients_and_one_plan(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(TESTS, "dist_worker.py"),
            "ddp",
            str(free_port()),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(TESTS),
        timeout=300,
        env=dict(os.environ, MEMSCALE_DIST_BACKEND="nccl"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        plain, ours = r["plain"], r["memscale"]
        assert ours["losses"] == plain["losses"]
        assert all(torch.equal(a, b) for a, b in zip(ours["grads"], plain["grads"]))
        assert ours["recomputes"] == 2 * ours["techniques"]["checkpoint"] > 0
        assert ours["techniques"]["offload"] > 0 and ours["spilled"] > 0
    a, b = ranks[0]["memscale"], ranks[1]["memscale"]
    assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
    assert a["hash"] == b["hash"]
