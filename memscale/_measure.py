"""Measure the memory and time of a training step on CPU.

This module is how memscale measures itself: the benchmark suite, the README
figures and the tests all go through it. It imports only torch and the
standard library.

Peak tensor memory (:func:`measure_peak`)
    The step runs under ``torch.profiler.profile(activities=[CPU],
    profile_memory=True)``. With ``profile_memory`` the c10 allocator reports
    every allocation and every free to the profiler as a ``"[memory]"`` event
    whose ``nbytes()`` is the size asked of the allocator (positive for an
    allocation, negative for a free). The warm-up calls run first in the same
    session; the measured call runs inside a ``record_function`` range. We
    read the raw kineto events (``prof.profiler.kineto_results.events()``),
    keep the ``"[memory]"`` ones that fall inside that range, order them by
    ``start_ns()`` (a stable sort: ties keep the profiler's own order) and
    take the running sum. Its maximum is ``peak_delta_bytes`` (never below 0,
    the level before the first event), its final value is
    ``end_delta_bytes``.

    Why this way: it is exact and deterministic. The figure is the sum of the
    requested sizes of the allocations alive at the worst moment, with no
    sampling, no allocator rounding (a tensor of 1001 bytes counts as 1001,
    checked in the tests for 1 B to 3 MiB and for overlapping lifetimes) and
    no noise from the process (Python objects, the allocator's free lists,
    the page cache). The same step gives the same bytes run after run, which
    is what a test or a before/after comparison needs. It needs no extra
    dependency and sees allocations made inside C++ (autograd, ATen kernels,
    intra-op threads) that a Python-level tracker would miss. The profiler's
    own bookkeeping is not made of tensors and is not counted, and the
    function events that ``torch.profiler`` can build from the results are
    never built, so their post-processing cost is not paid.

    The one trap, and why the warm-up runs inside the session: the CPU
    allocator learns the size of a block only when the block is allocated
    while memory profiling is on (c10 ``ProfiledCPUMemoryReporter``). The free
    of a block allocated earlier produces no event at all (torch logs "Memory
    block of unknown size was allocated before the profiling started"), and
    a block allocated under profiling but freed outside it leaves a stale
    size that a later block at the same address inherits. Both were observed
    in torch 2.13. A steady-state step frees what the previous step
    allocated (``.grad`` under ``zero_grad(set_to_none=True)``, activations,
    optimizer temporaries), so with ``warmup >= 1`` everything it frees was
    allocated under this session and the figure is exact. With ``warmup=0``
    a step that frees tensors counted in ``start_bytes`` triggers a
    ``UserWarning``, because the figure may then be overstated.

    What it does not see: memory that does not come from the torch allocator
    (numpy arrays before ``torch.from_numpy``, Python objects, the
    interpreter), and allocations of threads the profiler does not follow
    (Python threads that were already running). On CUDA use
    ``torch.cuda.max_memory_allocated`` instead; the events of every device
    are summed here, so this function is meant for CPU steps.

Start bytes (:func:`live_storage_bytes`)
    Allocator events only give the change during the step. The level it
    starts from is counted from the tensors themselves: every unique storage
    reachable from the model's parameters, buffers, the parameters' ``.grad``
    and the given inputs, keyed by storage (device and ``data_ptr``) so that
    views and tied weights count once, each counted with
    ``untyped_storage().nbytes()``. Meta and fake tensors hold no memory and
    are skipped. ``MemoryReport.peak_bytes = start_bytes + peak_delta_bytes``.

Peak RSS (:func:`peak_rss_subprocess`)
    A second opinion that sees everything (interpreter, libraries, allocator
    overhead): the peak resident set size of a fresh ``python -c`` child,
    reported by the child itself from ``getrusage(RUSAGE_SELF)``.

Time (:func:`time_ratio`)
    ``time.perf_counter`` around each call, baseline and variant interleaved
    in the same process after warm-up calls, compared by medians.

Profiler chatter: whatever the profiler prints through Python's
``sys.stdout`` / ``sys.stderr`` or emits as a Python warning while starting
and stopping is captured and sent to this module's logger at DEBUG level.
Kineto's native log lines (e.g. ``USDT: ... profiler_start``) are written by
C++ straight to file descriptor 2 and cannot be captured without redirecting
the descriptor for the whole process, which we do not do; the caller may set
``KINETO_LOG_LEVEL`` in the environment before torch starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import logging
import math
import numbers
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

try:  # Weak storage references, used only to warn about unseen frees.
    from torch.multiprocessing.reductions import (
        StorageWeakRef as _StorageWeakRef,
    )
except ImportError:  # pragma: no cover - every supported torch has it
    _StorageWeakRef = None  # type: ignore[misc, assignment]

__all__ = [
    "MemoryReport",
    "TimeReport",
    "live_storage_bytes",
    "measure_peak",
    "peak_rss_subprocess",
    "time_ratio",
]

logger = logging.getLogger(__name__)

# Name the profiler gives to allocator events.
_MEMORY_EVENT_NAME = "[memory]"
# record_function range around the measured call.
_WINDOW_NAME = "memscale::measured_step"
# Last line printed by the child of peak_rss_subprocess.
_RSS_SENTINEL = "__MEMSCALE_PEAK_RSS__="
# How much of a failed child's stderr goes into the error message.
_STDERR_TAIL_CHARS = 4000


# --------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------


def _check_int(name: str, value: object, *, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Tensor memory of one step, in bytes (see the module docstring)."""

    # Bytes of the unique storages reachable from the model (parameters,
    # buffers, parameter grads) and the inputs when the measured step starts.
    start_bytes: int
    # Highest running sum of allocator bytes above the start during the step
    # (0 when the step never rises above where it started).
    peak_delta_bytes: int
    # Running sum at the end of the step; negative when the step freed more
    # than it allocated (e.g. zero_grad(set_to_none=True)).
    end_delta_bytes: int

    def __post_init__(self) -> None:
        _check_int("start_bytes", self.start_bytes, minimum=0)
        _check_int("peak_delta_bytes", self.peak_delta_bytes, minimum=0)
        _check_int("end_delta_bytes", self.end_delta_bytes)

    @property
    def peak_bytes(self) -> int:
        """Peak tensor bytes during the step: ``start + peak delta``."""
        return self.start_bytes + self.peak_delta_bytes


@dataclasses.dataclass(frozen=True)
class TimeReport:
    """Interleaved wall-clock samples of a baseline and a variant, in s."""

    # One perf_counter duration per measured baseline call, in call order.
    baseline_s: tuple[float, ...]
    # One perf_counter duration per measured variant call, in call order.
    variant_s: tuple[float, ...]

    def __post_init__(self) -> None:
        for name in ("baseline_s", "variant_s"):
            samples = getattr(self, name)
            if not isinstance(samples, tuple):
                raise TypeError(f"{name} must be a tuple of floats, got {type(samples).__name__}")
            if not samples:
                raise ValueError(f"{name} must hold at least one sample")

    @property
    def baseline_median(self) -> float:
        """Median baseline duration in seconds."""
        return float(statistics.median(self.baseline_s))

    @property
    def variant_median(self) -> float:
        """Median variant duration in seconds."""
        return float(statistics.median(self.variant_s))

    @property
    def ratio(self) -> float:
        """``variant_median / baseline_median`` (> 1 means the variant is
        slower); ``inf`` if the baseline median is 0 and the variant's not."""
        base = self.baseline_median
        variant = self.variant_median
        if base == 0.0:
            return math.nan if variant == 0.0 else math.inf
        return variant / base


# --------------------------------------------------------------------------
# Start bytes
# --------------------------------------------------------------------------


def _tensor_parts(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The strided tensors that hold the memory of ``t``."""
    layout = t.layout
    if layout == torch.sparse_coo:
        yield t._indices()
        yield t._values()
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        yield t.crow_indices()
        yield t.col_indices()
        yield t.values()
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        yield t.ccol_indices()
        yield t.row_indices()
        yield t.values()
    else:
        yield t


def _iter_tensors(obj: Any, seen: set[int]) -> Iterator[torch.Tensor]:
    """Tensors reachable from modules, tensors and nested containers."""
    if id(obj) in seen:
        return
    if isinstance(obj, torch.Tensor):
        seen.add(id(obj))
        yield obj
        # .grad of a non-leaf warns and is always None; only leaves have one.
        if obj.is_leaf and obj.grad is not None:
            yield from _iter_tensors(obj.grad, seen)
    elif isinstance(obj, torch.nn.Module):
        seen.add(id(obj))
        for param in obj.parameters():
            yield from _iter_tensors(param, seen)
        for buf in obj.buffers():
            yield from _iter_tensors(buf, seen)
    elif isinstance(obj, Mapping):
        seen.add(id(obj))
        for value in obj.values():
            yield from _iter_tensors(value, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        seen.add(id(obj))
        for item in obj:
            yield from _iter_tensors(item, seen)
    # Anything else (None, numbers, strings, ...) holds no tensor memory.


def live_storage_bytes(*objs: Any) -> int:
    """Bytes of the unique tensor storages reachable from ``objs``.

    ``objs`` may be modules (their parameters, buffers and parameter
    ``.grad``), tensors (and a leaf tensor's ``.grad``), and tuples, lists,
    sets and mappings of these, nested. Each storage counts once, keyed by
    device and ``untyped_storage().data_ptr()``, with
    ``untyped_storage().nbytes()`` bytes, so views, tied weights and a tensor
    passed twice are not double counted. Meta and fake tensors, and empty
    storages, count 0. Sparse tensors count their index and value tensors.
    """
    sizes: dict[tuple[str, int, int], int] = {}
    seen: set[int] = set()
    for top in objs:
        for tensor in _iter_tensors(top, seen):
            for part in _tensor_parts(tensor):
                if part.is_meta:
                    continue
                try:
                    storage = part.untyped_storage()
                    # Fake tensors report a real device but own a meta
                    # storage; asking it for a data pointer warns.
                    if storage.device.type == "meta":
                        continue
                    nbytes = storage.nbytes()
                    if nbytes == 0:
                        continue
                    device = storage.device
                    key = (
                        device.type,
                        -1 if device.index is None else device.index,
                        storage.data_ptr(),
                    )
                except (RuntimeError, NotImplementedError) as exc:
                    # E.g. a wrapper subclass without a storage of its own.
                    logger.debug(
                        "skipping a %s tensor without a storage: %s",
                        type(part).__name__,
                        exc,
                    )
                    continue
                # Two storages over the same memory (from_blob, numpy) can
                # share a pointer with different lengths: keep the largest.
                if nbytes > sizes.get(key, 0):
                    sizes[key] = nbytes
    return sum(sizes.values())


# --------------------------------------------------------------------------
# Peak of allocator events
# --------------------------------------------------------------------------


def profiler_active() -> bool:
    """Whether a torch profiler (any kind) is running in this process."""
    # The C++ state covers every way of starting a profiler; the Python flag
    # is a second, cheap check kept for older releases.
    c_enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    if c_enabled is not None and c_enabled():
        return True
    flag = getattr(torch.autograd.profiler, "_is_profiler_enabled", False)
    return bool(flag)


# What the profiler's C++ side (kineto) writes to file descriptor 2 when a
# session starts or stops, e.g. "USDT:2026-01-01 12:00:00 1:1
# SyncActivityProfilerHandler.cpp:52] profiler_start", or "STAGE:... Completed
# Stage: Warm Up" in CUDA builds.
_FD2_LOCK = threading.RLock()
_KINETO_LINE = re.compile(r"^(USDT|STAGE|INFO|WARNING|ERROR):?\S*.*\.(cpp|h):\d+\]")


@contextlib.contextmanager
def _fd2_captured(what: str) -> Iterator[None]:
    """Point file descriptor 2 at a temporary file for the block, then put
    it back: the torch profiler's C++ side writes its start and stop lines
    there, not through Python, and a library must not write to the user's
    terminal.  Lines the profiler wrote go to the log at DEBUG; anything
    else captured (another thread's output in that window) is written back
    to the real stderr, so nothing of the user's is lost."""
    # fd 2 is the process's: one capture at a time.
    with _FD2_LOCK, contextlib.ExitStack() as stack:
        try:
            sys.stderr.flush()
        except (AttributeError, OSError, ValueError):
            pass
        try:
            saved = os.dup(2)
            stack.callback(os.close, saved)
            sink = stack.enter_context(tempfile.TemporaryFile())
        except OSError:  # no fd 2, or no temp file: run uncaptured
            stack.close()
            yield
            return
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
        sink.seek(0)
        text = sink.read().decode("utf-8", "replace")
    other = []
    for line in text.splitlines(keepends=True):
        if _KINETO_LINE.match(line):
            logger.debug("profiler output during %s: %s", what, line.rstrip())
        else:
            other.append(line)
    data = "".join(other).encode("utf-8", "replace")
    while data:
        try:
            data = data[os.write(2, data) :]
        except OSError:
            break


@contextlib.contextmanager
def quiet_profiler(what: str) -> Iterator[None]:
    """Capture Python-level output and warnings, log them at DEBUG; the
    profiler's own C++ lines on file descriptor 2 too."""
    out = io.StringIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with contextlib.redirect_stdout(out):
                with contextlib.redirect_stderr(out):
                    with _fd2_captured(what):
                        yield
        finally:
            text = out.getvalue().strip()
            if text:
                logger.debug("profiler output during %s: %s", what, text)
            for item in caught:
                logger.debug(
                    "profiler warning during %s: %s: %s",
                    what,
                    item.category.__name__,
                    item.message,
                )


def _start_storage_refs(model: Any, inputs: Any) -> list[tuple[Any, int]]:
    """Weak references to the storages counted in ``start_bytes``."""
    if _StorageWeakRef is None:
        return []
    refs: list[tuple[Any, int]] = []
    seen: set[int] = set()
    for tensor in _iter_tensors((model, inputs), seen):
        for part in _tensor_parts(tensor):
            try:
                storage = part.untyped_storage()
                if storage.device.type == "meta" or storage.nbytes() == 0:
                    continue
                refs.append((_StorageWeakRef(storage), storage.nbytes()))
            except (RuntimeError, NotImplementedError, TypeError):
                continue
    return refs


def _profiled_step(
    step_fn: Callable[[], object],
    warmup: int,
    count_start: Callable[[], int],
) -> tuple[int, list[tuple[int, int]]]:
    """Run the warm-up calls and the measured call in one memory-profiling
    session; return ``count_start()`` (taken just before the measured call)
    and ``(start_ns, nbytes)`` of the measured call's allocator events, in
    the profiler's order."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_profiler("profiler start"):
        prof.start()
    try:
        for _ in range(warmup):
            step_fn()
        # Free cyclic garbage now, so that a collection during the step does
        # not show up as frees that belong to earlier work.
        gc.collect()
        start = count_start()
        with record_function(_WINDOW_NAME):
            step_fn()
    finally:
        with quiet_profiler("profiler stop"):
            prof.stop()
    try:
        raw = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    except AttributeError as exc:
        raise RuntimeError(
            "measure_peak reads the raw kineto events "
            "(profile().profiler.kineto_results.events()), which torch "
            f"{torch.__version__} does not provide; it needs a torch whose "
            "CPU profiler is built with kineto"
        ) from exc
    windows = [(event.start_ns(), event.end_ns()) for event in raw if event.name() == _WINDOW_NAME]
    if len(windows) != 1:
        raise RuntimeError(
            f"measure_peak expected one {_WINDOW_NAME!r} range in the profile,"
            f" found {len(windows)}; did step_fn start or stop a profiler?"
        )
    begin, finish = windows[0]
    events = [
        (event.start_ns(), event.nbytes())  # type: ignore[union-attr]
        for event in raw
        if event.name() == _MEMORY_EVENT_NAME and begin <= event.start_ns() <= finish
    ]
    return start, events


def running_peak(events: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """``(peak, end)`` of the running sum of ``nbytes`` in time order."""
    # sorted() is stable: events with equal timestamps keep their order.
    ordered = sorted(events, key=lambda event: event[0])
    level = 0
    peak = 0
    for _, nbytes in ordered:
        level += nbytes
        if level > peak:
            peak = level
    return peak, level


def measure_peak(
    step_fn: Callable[[], object],
    *,
    model: torch.nn.Module | None = None,
    inputs: Any = (),
    warmup: int = 0,
) -> MemoryReport:
    """Peak tensor memory of one call of ``step_fn``.

    A memory-profiling session (``torch.profiler.profile`` with
    ``profile_memory=True``) is opened; ``step_fn`` is called ``warmup``
    times, the garbage collector runs, ``start_bytes`` is counted with
    ``live_storage_bytes(model, inputs)``, and ``step_fn`` is called once
    more inside a ``record_function`` range. The allocator events inside
    that range give ``peak_delta_bytes`` and ``end_delta_bytes`` exactly
    (see the module docstring); the warm-up calls are not counted. The
    return value of ``step_fn`` is dropped inside the range, so it counts
    as freed.

    Use ``warmup >= 1`` when the step frees what an earlier step allocated
    (``zero_grad(set_to_none=True)``, replaced optimizer state, caches): the
    profiler reports the free of a block only if the block was allocated
    while memory profiling was on, and the warm-up calls run under the same
    session for that reason. With ``warmup=0``, a ``UserWarning`` says when
    tensors counted in ``start_bytes`` were freed by the step.

    ``model`` and ``inputs`` only serve to count ``start_bytes``: pass what
    the step reads and keeps (e.g. ``inputs=(batch, optimizer.state)``), so
    that ``peak_bytes`` is the whole working set. An
    exception raised by ``step_fn`` stops the profiler and propagates.

    Raises:
        RuntimeError: a torch profiler is already active (the two would
            corrupt each other's results; stop the other one first).
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
    _check_int("warmup", warmup, minimum=0)
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(
            "model must be a torch.nn.Module or None, got "
            f"{type(model).__name__}; pass other tensors as inputs="
        )
    if profiler_active():
        raise RuntimeError(
            "measure_peak cannot run while another torch profiler is active: "
            "two profilers in one process corrupt each other's results. "
            "Call measure_peak outside the other profiler's context (or stop "
            "it first)."
        )

    refs: list[tuple[Any, int]] = []

    def count_start() -> int:
        if warmup == 0:
            refs.extend(_start_storage_refs(model, inputs))
        return live_storage_bytes(model, inputs)

    start, events = _profiled_step(step_fn, warmup, count_start)
    peak, end = running_peak(events)
    freed = sum(nbytes for ref, nbytes in refs if ref.expired())
    if freed:
        warnings.warn(
            f"measure_peak: the step freed {freed} bytes of tensors that "
            "existed before it (e.g. .grad under "
            "zero_grad(set_to_none=True)). The profiler reports the free of "
            "a block only if the block was allocated while memory profiling "
            "was on, so peak_delta_bytes and end_delta_bytes may be "
            "overstated by up to that much; pass warmup=1 or more.",
            UserWarning,
            stacklevel=2,
        )
    logger.debug(
        "measure_peak: %d memory events, start %d B, peak delta %d B, end delta %d B",
        len(events),
        start,
        peak,
        end,
    )
    return MemoryReport(start_bytes=start, peak_delta_bytes=peak, end_delta_bytes=end)


# --------------------------------------------------------------------------
# Peak RSS of a fresh process
# --------------------------------------------------------------------------

# Runs the user's code as __main__, then prints the child's own peak RSS.
# ru_maxrss is in KiB on Linux and the BSDs, in bytes on macOS.
_RSS_WRAPPER = """\
import resource as _memscale_resource
import sys as _memscale_sys

def _memscale_report():
    # Linux carries ru_maxrss across exec(), so a child of a large parent
    # would report the parent's size; VmHWM is this process's own peak.
    _memscale_sys.stdout.flush()
    _rss = None
    try:
        with open("/proc/self/status") as _f:
            for _line in _f:
                if _line.startswith("VmHWM:"):
                    _rss = int(_line.split()[1]) * 1024
    except OSError:
        pass
    if _rss is None:
        _rss = _memscale_resource.getrusage(
            _memscale_resource.RUSAGE_SELF).ru_maxrss
        if _memscale_sys.platform != "darwin":
            _rss *= 1024
    print("\\n{sentinel}%d" % _rss, flush=True)

try:
    exec(compile({code!r}, "<memscale-child>", "exec"),
         {{"__name__": "__main__", "__builtins__": __builtins__}})
except SystemExit as _exit:
    if _exit.code not in (None, 0):
        raise
_memscale_report()
"""


def _tail(text: str | bytes | None) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    text = text.strip()
    if len(text) > _STDERR_TAIL_CHARS:
        text = "..." + text[-_STDERR_TAIL_CHARS:]
    return text


def peak_rss_subprocess(
    code: str,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> int:
    """Peak resident set size, in bytes, of ``sys.executable -c code``.

    The code runs in a fresh interpreter as ``__main__`` (exiting through
    ``sys.exit(0)`` counts as success); afterwards the child prints
    its own peak RSS (VmHWM; ru_maxrss where /proc is missing) in bytes
    on a sentinel line, which
    is parsed here. The figure covers everything the process held at its
    worst moment: interpreter, imported libraries, allocator overhead.

    ``env`` is the child's whole environment, as for :mod:`subprocess`
    (``None``: inherit this process's). The child runs in the current
    directory.

    Raises:
        RuntimeError: the child failed, timed out, or printed no figure; the
            message carries the tail of its stderr.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if os.name != "posix":
        raise RuntimeError("peak_rss_subprocess needs the resource module (POSIX only)")
    script = _RSS_WRAPPER.format(sentinel=_RSS_SENTINEL, code=code)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script],
            env=None if env is None else dict(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(
            "peak_rss_subprocess: the child did not finish within "
            f"{timeout} s; stderr tail:\n{_tail(exc.stderr)}"
        ) from exc
    if proc.returncode != 0:
        raise RuntimeError(
            "peak_rss_subprocess: the child exited with code "
            f"{proc.returncode}; stderr tail:\n{_tail(proc.stderr)}"
        )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_RSS_SENTINEL):
            try:
                return int(line[len(_RSS_SENTINEL) :])
            except ValueError:
                break
    raise RuntimeError(
        "peak_rss_subprocess: the child printed no "
        f"{_RSS_SENTINEL}<bytes> line; stderr tail:\n{_tail(proc.stderr)}"
    )


# --------------------------------------------------------------------------
# Time
# --------------------------------------------------------------------------


def time_ratio(
    baseline_fn: Callable[[], object],
    variant_fn: Callable[[], object],
    *,
    repeats: int = 5,
    warmup: int = 1,
) -> TimeReport:
    """Time ``baseline_fn`` and ``variant_fn`` interleaved.

    Each is called ``warmup`` times unmeasured (alternating), then they run
    baseline, variant, baseline, variant, ... ``repeats`` times each, every
    call timed with ``time.perf_counter``. Interleaving spreads drifts of the
    machine (frequency, other load, caches) over both sides alike; compare
    with the medians, e.g. ``TimeReport.ratio``.
    """
    for name, fn in (("baseline_fn", baseline_fn), ("variant_fn", variant_fn)):
        if not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    _check_int("repeats", repeats, minimum=1)
    _check_int("warmup", warmup, minimum=0)

    for _ in range(warmup):
        baseline_fn()
        variant_fn()
    baseline: list[float] = []
    variant: list[float] = []
    clock = time.perf_counter
    for _ in range(repeats):
        t0 = clock()
        baseline_fn()
        t1 = clock()
        variant_fn()
        t2 = clock()
        baseline.append(t1 - t0)
        variant.append(t2 - t1)
    report = TimeReport(baseline_s=tuple(baseline), variant_s=tuple(variant))
    logger.debug(
        "time_ratio: baseline median %.6f s, variant median %.6f s, ratio %.4f over %d repeats",
        report.baseline_median,
        report.variant_median,
        report.ratio,
        repeats,
    )
    return report
