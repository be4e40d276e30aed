"""What the CUDA tests (tests/gpu) share: the device, determinism, figures.

Every test in tests/gpu is marked ``cuda``; tests/conftest.py skips them,
each with the reason, where torch.cuda.is_available() is False.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from memscale.benchmarks.device import CudaMemory, measure_device_peak

# cuBLAS gives the same bits run after run only with a fixed workspace
# configuration, read when its handle is created (the first CUDA matmul of
# the process); scripts/gpu-check.sh sets it for the whole run too.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

DEV = torch.device("cuda")
# scripts/gpu-check.sh points this at a JSON file in its output folder.
FIGURES_ENV = "MEMSCALE_GPU_FIGURES"


def record(name: str, value: Any) -> None:
    """Print a figure the check measured, and keep it in the JSON file named
    by $MEMSCALE_GPU_FIGURES (one key per figure) when that is set."""
    print(f"figure {name}: {json.dumps(value, sort_keys=True)}")
    path = os.environ.get(FIGURES_ENV)
    if not path:
        return
    figures: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            figures = json.load(f)
    figures[name] = value
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(figures, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """torch.use_deterministic_algorithms(True) and deterministic cuDNN for
    the block: an operator without a deterministic CUDA kernel raises
    instead of making a bitwise comparison flaky."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic = before[2]
        torch.backends.cudnn.benchmark = before[3]


def grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b)
    )


def device_peak(step: Callable[[], object], warmup: int = 1) -> int:
    """torch.cuda.max_memory_allocated during one call of ``step`` (after
    ``warmup`` calls and reset_peak_memory_stats)."""
    return measure_device_peak(step, CudaMemory(DEV), warmup=warmup).peak_bytes


def fresh_device() -> None:
    """Free what earlier tests left in the caching allocator, so that one
    test's peak is not another's."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
