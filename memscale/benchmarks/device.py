"""The benchmark suite on an accelerator: measuring what the device holds.

On the host CPU the suite counts live tensor bytes from allocator events
(``measure.measure_peak``).  On CUDA the device's caching allocator keeps
its own figures, and those are what a run out of memory is judged by:

* :func:`measure_device_peak` runs warm-up steps, synchronizes, reads
  ``memory_allocated`` (the step's start), calls
  ``reset_peak_memory_stats``, runs the measured step, synchronizes and
  reads ``max_memory_allocated``.  The result is a ``MemoryReport`` whose
  ``start_bytes`` is the device's allocated bytes at the start (every
  tensor the process holds there, and the libraries' workspaces, such as
  cuBLAS's) and whose ``peak_bytes`` is the device's own peak.  The
  allocator rounds each block up (to 512 bytes), so the figures are a
  little above the sum of the tensors' sizes.
* :func:`overlap_fraction` is the share of device-to-host copy time that
  ran while a kernel was running, from the intervals a CUDA profiler
  trace gives (:func:`traced_overlap`): the figure of the async offload
  path, whose copies run on a side stream.

Only the thin parts (``CudaMemory``, ``traced_overlap``) touch
``torch.cuda``; the rest works on plain numbers and is tested on the CPU
with a stand-in allocator (``tests/test_gpu_support.py``).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from .._measure import MemoryReport, measure_peak

__all__ = [
    "CudaMemory",
    "DeviceMemory",
    "device_memory",
    "measure_device_peak",
    "measure_step_peak",
    "overlap_fraction",
    "synchronizer",
    "traced_overlap",
]


class DeviceMemory(Protocol):
    """What :func:`measure_device_peak` reads from a device's allocator."""

    def synchronize(self) -> None: ...

    def allocated(self) -> int: ...

    def reset_peak(self) -> None: ...

    def max_allocated(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class CudaMemory:
    """A CUDA device's caching allocator, through ``torch.cuda``."""

    device: torch.device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def max_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))


def device_memory(device: torch.device) -> DeviceMemory | None:
    """The allocator figures of ``device``; None for the host CPU, which
    is measured from allocator events instead."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        return CudaMemory(device)
    raise ValueError(f"the benchmark suite measures 'cpu' and 'cuda' devices, not {device.type!r}")


def _no_sync() -> None:
    return None


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What to call after a step before reading a clock: the device's
    queue drained (CUDA runs kernels asynchronously); nothing on the CPU."""
    memory = device_memory(device)
    return _no_sync if memory is None else memory.synchronize


def measure_device_peak(
    step_fn: Callable[[], object], memory: DeviceMemory, *, warmup: int = 1
) -> MemoryReport:
    """The device's own peak during one call of ``step_fn``, after
    ``warmup`` calls (optimizer state and gradients exist, the libraries
    have made their workspaces).  See the module docstring."""
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    for _ in range(warmup):
        step_fn()
    gc.collect()
    memory.synchronize()
    start = memory.allocated()
    memory.reset_peak()
    step_fn()  # its result is dropped here: it counts as freed
    memory.synchronize()
    peak = memory.max_allocated()
    end = memory.allocated()
    return MemoryReport(
        start_bytes=start,
        peak_delta_bytes=max(0, peak - start),
        end_delta_bytes=end - start,
    )


def measure_step_peak(
    step_fn: Callable[[], object],
    device: torch.device,
    *,
    model: torch.nn.Module | None = None,
    inputs: Any = (),
    warmup: int = 1,
) -> MemoryReport:
    """The suite's one memory figure of a step on ``device``: allocator
    events on the CPU (``measure_peak``, exactly as before devices were
    added), the device's own peak elsewhere."""
    memory = device_memory(device)
    if memory is None:
        return measure_peak(step_fn, model=model, inputs=inputs, warmup=warmup)
    return measure_device_peak(step_fn, memory, warmup=warmup)


Interval = tuple[int, int]


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def overlap_fraction(copies: Iterable[Interval], kernels: Iterable[Interval]) -> float | None:
    """The share of the copies' time during which a kernel ran: 0 when
    every copy ran alone, 1 when every copy was hidden behind compute;
    None when there was no copy.  Intervals are (start, end) in one clock;
    overlapping copies count once."""
    busy = _union(kernels)
    total = 0
    hidden = 0
    for start, end in _union(copies):
        total += end - start
        for k_start, k_end in busy:
            if k_start >= end:
                break
            low, high = max(start, k_start), min(end, k_end)
            if high > low:
                hidden += high - low
    return None if total == 0 else hidden / total


def device_intervals(events: Iterable[Any]) -> tuple[list[Interval], list[Interval]]:
    """(device-to-host copies, kernels) of a profiler trace's CUDA events:
    objects with ``name()``, ``start_ns()``, ``end_ns()`` and
    ``device_type()`` (torch's raw kineto events)."""
    copies: list[Interval] = []
    kernels: list[Interval] = []
    for event in events:
        if event.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name()
        span = (int(event.start_ns()), int(event.end_ns()))
        if name.startswith("Memcpy DtoH"):
            copies.append(span)
        elif not name.startswith(("Memcpy", "Memset")):
            kernels.append(span)
    return copies, kernels


def traced_overlap(fn: Callable[[], object]) -> dict[str, Any]:
    """Run ``fn`` under a CUDA profiler trace; the copy/compute overlap of
    its device-to-host copies (:func:`overlap_fraction`), the copy time
    and the number of copies and kernels seen.  CUDA only."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    copies, kernels = device_intervals(prof.profiler.kineto_results.events())
    return {
        "overlap": overlap_fraction(copies, kernels),
        "copies": len(copies),
        "copy_ms": sum(end - start for start, end in _union(copies)) / 1e6,
        "kernels": len(kernels),
    }
