"""wrap writes nothing to stderr outside memscale's logger (issue 20, item
9): the OOM predictor's torch profiler session printed kineto's
``USDT:... profiler_start`` / ``profiler_stop`` lines from C++ straight to
file descriptor 2.  Each case runs in a fresh interpreter, whose stderr is
the file descriptor itself."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """
import logging, os, sys
sys.path.insert(0, os.path.join({root!r}, "tests"))
import torch
import memscale
from conftest import CNN
"""


def run(code: str) -> subprocess.CompletedProcess:
    source = PRELUDE.format(root=ROOT) + textwrap.dedent(code)
    env = dict(os.environ, PYTHONPATH=ROOT)
    for key in ("TORCH_CPP_LOG_LEVEL", "KINETO_LOG_LEVEL"):
        env.pop(key, None)  # torch's defaults, as a user has them
    proc = subprocess.run(
        [sys.executable, "-c", source],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.slow
def test_wrap_with_sample_input_writes_nothing_to_stderr():
    """A CNN's convolutions are probed for scratch memory under the torch
    profiler at wrap time; with memscale's logging off, stderr stays empty."""
    proc = run("""
        model = CNN()
        config = memscale.Config(enable_logging=False, force_optimize=True)
        memscale.wrap(model, config, sample_input=torch.randn(2, 3, 8, 8))
        model(torch.randn(2, 3, 8, 8)).sum().backward()
        memscale.detach(model)
        print(memscale.predict_peak(CNN(), torch.randn(2, 3, 8, 8)).optimized.peak_bytes > 0)
    """)
    assert proc.stderr == ""
    assert proc.stdout.strip().endswith("True")


@pytest.mark.slow
def test_profiler_lines_go_to_the_log_at_debug():
    """With memscale's logger at DEBUG on stderr, the profiler's lines appear
    there as log records, and only so."""
    proc = run("""
        logging.basicConfig(level=logging.DEBUG, format="LOG %(name)s: %(message)s",
                            stream=sys.stderr)
        for name in ("torch", "urllib3", "filelock"):
            logging.getLogger(name).setLevel(logging.WARNING)
        model = CNN()
        config = memscale.Config(enable_logging=False, force_optimize=True)
        memscale.wrap(model, config, sample_input=torch.randn(2, 3, 8, 8))
        memscale.detach(model)
    """)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert any("profiler_start" in line for line in lines)
    assert all(line.startswith(("LOG ", "  ")) for line in lines), lines


@pytest.mark.slow
def test_other_output_in_the_window_is_kept():
    """Anything else written to fd 2 while it is captured (another thread's
    output) reaches the real stderr afterwards; the profiler's lines do not."""
    proc = run("""
        from memscale import _measure
        with _measure._fd2_captured("test"):
            os.write(2, b"the user's own line\\n")
            os.write(2, b"USDT:2026-01-01 00:00:00 1:1 X.cpp:52] profiler_start\\n")
        os.write(2, b"after\\n")
    """)
    assert proc.stderr == "the user's own line\nafter\n"


@pytest.mark.slow
def test_log_lines_do_not_land_inside_the_trainers_progress_bar():
    """Issue 21: the plan line, logged inside the Trainer's first step, and
    the summary at train end were appended to tqdm's bar line.  Each now
    stands on a line of its own (the bar cleared before it, drawn again
    after it)."""
    proc = run("""
        import warnings
        warnings.filterwarnings("ignore")
        from conftest import TokenDataset, hf_training_args, tiny_gpt2, token_batch
        from transformers import Trainer
        from memscale.integrations.hf import MemScaleCallback
        import tempfile
        with tempfile.TemporaryDirectory() as out:
            args = hf_training_args(out, per_device_train_batch_size=2, max_steps=2,
                                    logging_strategy="no", disable_tqdm=False)
            config = memscale.Config(force_optimize=True)
            trainer = Trainer(model=tiny_gpt2(0.0), args=args,
                              train_dataset=TokenDataset(token_batch(batch=4, seq=32)),
                              callbacks=[MemScaleCallback(config)])
            trainer.train()
    """)
    out = proc.stderr
    assert "%|" in out  # the bar was drawn on this stream
    ours = [line for line in out.split("\n") if "INFO memscale" in line]
    assert any(": plan " in line for line in ours)
    assert any("training ended" in line for line in ours)
    for line in ours:  # the record starts its line, after the bar is cleared
        assert line.split("\r")[-1].startswith("INFO memscale"), repr(line)
