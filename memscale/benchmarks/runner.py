"""Running one benchmark: every variant of one model, measured the same way.

Per variant the suite reports:

* peak live tensor bytes of a training step (zero_grad, forward, loss,
  backward, AdamW step), counted exactly from allocator events
  (``measure.measure_peak``, after one warm-up step so optimizer state and
  gradients exist) plus the bytes alive at the step's start;
* peak RSS of a fresh subprocess that builds the variant and trains two
  steps, as a second opinion (it includes the interpreter and libraries);
* the step-time ratio to the unoptimized variant: all variants of a model
  timed round-robin in one process, the median of several steps each, and
  its spread (the least and the greatest ratio of one round's step to the
  same round's unoptimized step; against the unoptimized median when the
  variants are timed one after the other);
* agreement with the unoptimized variant: loss and the largest absolute
  gradient difference after one forward/backward from identical weights,
  inputs and RNG state;
* the deterministic judge of compute: the FLOPs of one training step
  (forward, backward, any recompute, optimizer step) counted by
  ``torch.utils.flop_counter.FlopCounterMode``, and the recompute overhead,
  that count over the unoptimized variant's.  It counts the ops torch has a
  FLOP formula for (matmuls, convolutions, attention): the ops that set the
  step's time, and what a recompute repeats.  Unlike time ratios it is
  exact and the same on every run, so two variants' compute can be compared
  on a noisy machine.  memscale's variants also carry the planner's own
  prediction of it, ``1 + recompute_ratio / 3`` (backward costs about two
  forwards);
* for memscale's variants, the CPU seconds ``memscale.wrap`` took
  (``time.process_time`` around it: profiling, the simulated steps and the
  plan), ``wrap_cpu_seconds``.

memscale's variants are wrapped with the batch's own loss
(``wrap(..., loss_fn=batch.loss_fn)``), so their simulated steps run the
step that is measured (the MLP's and the CNN's losses are not the
predictor's stand-in).
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import FlopCounterMode

import memscale
from memscale import _core, _hardware

from .. import _torch_compat
from .._measure import peak_rss_subprocess
from .device import measure_step_peak, synchronizer
from .models import BENCHMARK_MODELS, Batch, BenchmarkModel

MODES = {
    "conservative": memscale.OptimizationMode.CONSERVATIVE,
    "balanced": memscale.OptimizationMode.BALANCED,
    "balanced-async": memscale.OptimizationMode.BALANCED,
    "aggressive": memscale.OptimizationMode.AGGRESSIVE,
}

# Untimed steps before timing: the first steps fault in fresh memory pages
# and build optimizer state, and are slower by a varying amount.
WARMUP_ROUNDS = 2

VARIANTS = (
    "unoptimized",
    "conservative",
    "balanced",
    "balanced-async",
    "aggressive",
    "torch-checkpoint",
    "torch-selective",
    "checkpoint-sequential",
    # Compiled with torch.compile (inductor): not run unless asked for
    # (--variants), as compiling takes minutes on a small CPU host.
    "unoptimized-compiled",
    "conservative-compiled",
    "torch-checkpoint-compiled",
    "compile-memory-budget",
)

COMPILED_VARIANTS = {
    "unoptimized-compiled": "unoptimized",
    "conservative-compiled": "conservative",
    "torch-checkpoint-compiled": "torch-checkpoint",
    "compile-memory-budget": "unoptimized",
}

# What `python -m memscale.benchmarks` runs unless --variants says otherwise.
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v not in COMPILED_VARIANTS)

# The compile peer's torch._functorch.config.activation_memory_budget: 0,
# the least activation memory AOT autograd's partitioner can reach by
# recomputing (1 is its default, memory-unaware partition).
ACTIVATION_MEMORY_BUDGET = 0.0

VARIANT_HELP = {
    "unoptimized": "the model as is",
    "conservative": "memscale.wrap, CONSERVATIVE, force_optimize=True",
    "balanced": "memscale.wrap, BALANCED (checkpointing + offload: to disk "
    "on a CPU host, to pinned host memory from a GPU), force_optimize=True",
    "balanced-async": "as balanced, with async_offload=True (C I/O thread, prefetch in backward)",
    "aggressive": "memscale.wrap, AGGRESSIVE, force_optimize=True",
    "torch-checkpoint": "torch.utils.checkpoint (non-reentrant) on every layer; "
    "Hugging Face: gradient_checkpointing_enable()",
    "torch-selective": "torch selective activation checkpointing on every layer: "
    "the outputs of matmuls, convolutions and attention saved, every other "
    "op recomputed in backward",
    "checkpoint-sequential": "torch.utils.checkpoint.checkpoint_sequential, "
    "sqrt(n) segments (sequential models only)",
    "unoptimized-compiled": "the model as is, torch.compile (inductor)",
    "conservative-compiled": "memscale.wrap, CONSERVATIVE, force_optimize=True, then "
    "torch.compile (inductor): the plan as checkpoint regions in the graph",
    "torch-checkpoint-compiled": "torch-checkpoint, then torch.compile (inductor)",
    "compile-memory-budget": "torch.compile (inductor) with "
    f"torch._functorch.config.activation_memory_budget={ACTIVATION_MEMORY_BUDGET}: "
    "the partitioner recomputes to the least activation memory",
}


# The ops whose outputs torch-selective saves: those with a FLOP formula
# that dominate a layer's compute.  Everything else (pointwise ops,
# normalisations, softmax outside fused attention) is recomputed.
_SAVED_OPS = frozenset(
    op
    for op in (
        getattr(torch.ops.aten, name, None)
        for name in (
            "mm",
            "addmm",
            "bmm",
            "baddbmm",
            "convolution",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_cudnn_attention",
        )
    )
    if op is not None
)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    packet = getattr(op, "overloadpacket", op)
    if packet in _SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Any:
    """The ``context_fn`` of the torch-selective peer."""
    return create_selective_checkpoint_contexts(_save_matmuls)


class CheckpointEach(nn.Module):
    """Runs a module under torch.utils.checkpoint (the peer we compare to),
    selective when ``selective`` (the save-matmuls policy above)."""

    def __init__(self, inner: nn.Module, selective: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.selective = selective

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.selective:
            return checkpoint(
                self.inner, *args, use_reentrant=False, context_fn=selective_context, **kwargs
            )
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


class CheckpointSequential(nn.Module):
    def __init__(self, inner: nn.Sequential) -> None:
        super().__init__()
        self.inner = inner
        self.segments = max(1, round(math.sqrt(len(inner))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.inner, self.segments, x, use_reentrant=False)


def memory_budget_backend(budget: float, kernels: str = "inductor") -> Callable[..., Any]:
    """A torch.compile backend partitioning forward and backward under
    ``torch._functorch.config.activation_memory_budget = budget`` (a
    backend of its own, so that no graph compiled without the budget is
    reused): inductor, or with ``kernels="eager"`` the same decompositions
    and min-cut partition run with eager kernels (PARTITION_BACKEND).
    ``backend.graphs`` counts the graphs it compiled (Dynamo's graph breaks
    split the partition into regions)."""
    inner: Callable[..., Any]
    if kernels == "eager":
        inner = torch._dynamo.lookup_backend(PARTITION_BACKEND)
    elif kernels == "inductor":
        from torch._inductor.compile_fx import compile_fx

        inner = compile_fx
    else:
        raise ValueError(f"kernels must be 'eager' or 'inductor', got {kernels!r}")

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        backend.graphs += 1  # type: ignore[attr-defined]
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return inner(gm, example_inputs)

    backend.graphs = 0  # type: ignore[attr-defined]
    return backend


def applies(entry: BenchmarkModel, variant: str) -> bool:
    return variant != "checkpoint-sequential" or entry.sequential


def _checkpoint_every_unit(model: nn.Module, selective: bool = False) -> None:
    for name, _ in _core.find_units(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        child_module = parent._modules[child]
        assert child_module is not None
        parent._modules[child] = CheckpointEach(child_module, selective)


def _no_sync() -> None:
    return None


@dataclass
class Prepared:
    model: nn.Module
    batch: Batch
    optimizer: torch.optim.Optimizer
    plan_hash: str | None
    techniques: dict[str, int] | None
    plan: Any = None  # the memscale Plan applied, if any
    # Drains the device's queue (CUDA) before a clock is read; a no-op on
    # the CPU.
    sync: Callable[[], None] = field(default=_no_sync)
    # CPU seconds memscale.wrap took (time.process_time), None unwrapped.
    wrap_cpu_seconds: float | None = None

    def step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.batch.loss_fn(self.model(*self.batch.args, **self.batch.kwargs))
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def forward_backward(self, seed: int) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = self.batch.loss_fn(self.model(*self.batch.args, **self.batch.kwargs))
        loss.backward()
        return loss.detach()

    @property
    def compiled(self) -> bool:
        """Whether the model runs compiled (inductor kernels allocate
        outside the dispatcher: FlopCounterMode cannot count them)."""
        return hasattr(self.model, "_orig_mod")

    def close(self) -> None:
        if _wrapped(self.model):
            memscale.detach(self.model)


def _wrapped(model: nn.Module) -> bool:
    inner = getattr(model, "_orig_mod", model)
    return "_memscale_executor" in inner.__dict__


def prepare(entry: BenchmarkModel, variant: str, device: torch.device | str = "cpu") -> Prepared:
    """Build ``entry`` (seed 0: identical weights and batch) as ``variant``,
    on ``device``."""
    if variant in COMPILED_VARIANTS:
        prepared = prepare(entry, COMPILED_VARIANTS[variant], device)
        backend = (
            memory_budget_backend(ACTIVATION_MEMORY_BUDGET)
            if variant == "compile-memory-budget"
            else "inductor"
        )
        prepared.model = cast(nn.Module, torch.compile(prepared.model, backend=backend))
        return prepared
    device = torch.device(device)
    model, batch = entry.build(seed=0, device=device)
    plan_hash: str | None = None
    techniques: dict[str, int] | None = None
    plan: Any = None
    wrap_cpu: float | None = None
    if variant in MODES:
        config = memscale.Config(mode=MODES[variant], force_optimize=True, enable_logging=False)
        cpu = time.process_time()
        memscale.wrap(
            model,
            config,
            sample_input=batch.sample_input,
            loss_fn=batch.loss_fn,
            async_offload=variant == "balanced-async",
        )
        wrap_cpu = time.process_time() - cpu
        plan = model.__dict__["_memscale_executor"].plan
        plan_hash, techniques = plan.hash, plan.technique_counts
    elif variant in ("torch-checkpoint", "torch-selective"):
        selective = variant == "torch-selective"
        if entry.hf:
            kwargs: dict[str, Any] = {"use_reentrant": False}
            if selective:
                kwargs["context_fn"] = selective_context
            model.gradient_checkpointing_enable(  # type: ignore[operator]
                gradient_checkpointing_kwargs=kwargs
            )
        else:
            _checkpoint_every_unit(model, selective)
    elif variant == "checkpoint-sequential":
        if not isinstance(model, nn.Sequential):
            raise ValueError(f"{entry.name} is not an nn.Sequential")
        model = CheckpointSequential(model)
    elif variant != "unoptimized":
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return Prepared(
        model,
        batch,
        optimizer,
        plan_hash,
        techniques,
        plan,
        synchronizer(device),
        wrap_cpu_seconds=wrap_cpu,
    )


@dataclass
class VariantResult:
    model: str
    variant: str
    description: str
    peak_bytes: int
    start_bytes: int
    peak_delta_bytes: int
    rss_peak_bytes: int | None
    step_seconds: list[float]
    step_median_s: float
    time_ratio: float
    # The least and greatest per-round ratio (see the module docstring).
    time_ratio_spread: tuple[float, float]
    loss: float
    loss_abs_diff: float
    grad_max_abs_diff: float
    plan_hash: str | None
    techniques: dict[str, int] | None
    timing: str  # "interleaved" (round-robin in one process) or "sequential"
    # The judge: FLOPs of one training step (FlopCounterMode), their ratio
    # to the unoptimized step's, and memscale's prediction of that ratio.
    # (None for compiled variants: their kernels run outside the dispatcher.)
    step_flops: int | None = 0
    recompute_overhead: float | None = 1.0
    predicted_recompute_overhead: float | None = None
    # Offload per timed step (variants with a disk tier, else None):
    # bytes_written, io_seconds (time the I/O took, on the C thread when
    # async) and wait_seconds (time the training thread spent on it).
    offload: dict[str, float] | None = None
    # CPU seconds memscale.wrap took (time.process_time around it: the
    # profile, the simulated steps and the plan); None for the others.
    wrap_cpu_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _CompiledFlopCounter(FlopCounterMode):
    """FlopCounterMode that lets torch.compile run.  Under a plain
    FlopCounterMode Dynamo skips every frame (a dispatch mode is active) and
    the step runs eagerly, so a compiled step's own FLOPs (its partition's
    recompute) went uncounted.  This mode sets ``ignore_compile_internals``:
    off while Dynamo and AOT autograd trace, on while the compiled graphs
    run, so it counts the aten ops of graphs run with eager kernels
    (``aot_eager``-style backends) and, as before, every eager op.  It
    counts the total only: the per-module breakdown's global module hooks
    would make Dynamo recompile the model and trace the hooks."""

    def __enter__(self) -> _CompiledFlopCounter:
        from torch.utils.flop_counter import _FlopCounterMode

        class _Mode(_FlopCounterMode):
            @classmethod
            def ignore_compile_internals(cls) -> bool:
                return True

        self.flop_counts.clear()
        self.mode = _Mode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args: Any) -> Any:
        mode, self.mode = self.mode, None
        assert mode is not None
        return mode.__exit__(*args)


def step_flops(step: Callable[[], Any]) -> int:
    """FLOPs of one call of ``step`` (a whole training step), counted by
    ``FlopCounterMode``: a recompute in backward runs under the same mode
    and is counted with the rest, and so do the graphs of a step compiled
    with eager kernels (not inductor's: they run outside the dispatcher)."""
    counter = _CompiledFlopCounter(display=False, custom_mapping=_torch_compat.flop_mapping())
    with counter:
        step()
    return int(counter.get_total_flops())


# The compile peer of the budget sweep: AOT autograd's min-cut partition
# under activation_memory_budget, with inductor's decompositions, run with
# eager kernels (torch's debugging backend of that name); "inductor" for
# inductor's own kernels.
PARTITION_BACKEND = "aot_eager_decomp_partition"


def compile_budget_unavailable() -> str | None:
    """Why this torch cannot run the compile peer, or None."""
    from torch.utils import _python_dispatch, flop_counter

    missing = [
        what
        for what, ok in (
            (
                "torch._functorch.config.activation_memory_budget",
                hasattr(torch._functorch.config, "activation_memory_budget"),
            ),
            (
                "TorchDispatchMode.ignore_compile_internals",
                hasattr(_python_dispatch.TorchDispatchMode, "ignore_compile_internals"),
            ),
            (
                "torch.utils.flop_counter._FlopCounterMode",
                hasattr(flop_counter, "_FlopCounterMode"),
            ),
        )
        if not ok
    ]
    if not missing:
        try:
            torch._dynamo.lookup_backend(PARTITION_BACKEND)
        except Exception as exc:  # torch raises InvalidBackend
            missing.append(f"the {PARTITION_BACKEND!r} backend ({type(exc).__name__})")
    if not missing:
        return None
    return f"torch {torch.__version__} lacks " + ", ".join(missing)


def predicted_overhead(plan: Any) -> float | None:
    """The planner's recompute overhead of a step: forward + backward cost
    about three forwards, and the plan recomputes ``recompute_ratio`` of
    one forward."""
    return None if plan is None else 1.0 + plan.recompute_ratio / 3.0


def _overhead(flops: int | None, base: int | None) -> float | None:
    if flops is None:
        return None
    return flops / base if base else 1.0


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _max_diff(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    if len(a) != len(b):
        return math.inf
    worst = 0.0
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return math.inf
        if x is not None:
            worst = max(worst, (x - y).abs().max().item())  # type: ignore[operator]
    return worst


# glibc's malloc raises its mmap threshold as large blocks are freed, after
# which freed tensors stay in the heap: peak RSS then depends on the order
# of frees and varied by +-50 MiB between identical runs of the GPT-2
# benchmark here.  A fixed threshold makes every tensor over 64 KiB its own
# mapping, returned to the system when freed, so the RSS peak follows the
# memory actually in use and repeats to within a MiB.  (Set
# MALLOC_MMAP_THRESHOLD_ yourself to measure another setting.)
RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def rss_env() -> dict[str, str]:
    env = dict(os.environ)
    for key, value in RSS_ENV.items():
        env.setdefault(key, value)
    return env


RSS_CODE = """
import warnings; warnings.filterwarnings("ignore")
from memscale.benchmarks.runner import prepare
from memscale.benchmarks.models import BENCHMARK_MODELS
p = prepare(BENCHMARK_MODELS[{model!r}], {variant!r})
for _ in range(2):
    p.step()
"""


def run_model(
    entry: BenchmarkModel,
    variants: list[str],
    *,
    repeats: int = 5,
    rss: bool = True,
    progress: Callable[[str], None] | None = None,
    device: torch.device | str = "cpu",
) -> list[VariantResult]:
    """Measure every applicable variant of ``entry`` on ``device``; the
    first result is always the unoptimized baseline.  On the CPU the peak
    is the exact live tensor bytes (allocator events); on CUDA the
    device's own (``max_memory_allocated``), and there is no RSS figure
    (``rss`` must be False: a host process's RSS says nothing of it)."""
    device = torch.device(device)
    if rss and device.type != "cpu":
        raise ValueError(f"rss=True measures the host process; on {device} pass rss=False")
    names = ["unoptimized"] + [v for v in variants if v != "unoptimized" and applies(entry, v)]
    note = progress or (lambda _msg: None)

    # RSS first, while this process is small: its own high-water mark from
    # the phases below would otherwise add to the children's memory.
    # Each child's VmHWM is its own, so quick models' children run side by
    # side, one per core (the phase is mostly importing torch and building
    # the model); full-size ones one at a time, as they need the memory.
    rss_peaks: dict[str, int | None] = dict.fromkeys(names)
    if rss:
        note(f"{entry.name}: RSS of {len(names)} variants")
        env = rss_env()
        workers = min(len(names), os.cpu_count() or 1) if entry.size == "quick" else 1
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            futures = {
                name: pool.submit(
                    peak_rss_subprocess, RSS_CODE.format(model=entry.name, variant=name), env=env
                )
                for name in names
            }
            for name in names:
                rss_peaks[name] = futures[name].result()

    # Agreement and memory, one variant alive at a time.  Agreement: one
    # forward/backward from the identical initial state and RNG seed.
    # Memory: the exact allocator peak of a steady-state training step.
    reference_loss = 0.0
    reference_grads: list[torch.Tensor | None] | None = None
    agreement: dict[str, tuple[float, float, float]] = {}
    memory: dict[str, Any] = {}
    meta: dict[str, tuple[str | None, dict[str, int] | None]] = {}
    flops: dict[str, int | None] = {}
    predicted: dict[str, float | None] = {}
    wrap_cpu: dict[str, float | None] = {}
    for name in names:
        note(f"{entry.name}: agreement and memory of {name}")
        prepared = prepare(entry, name, device)
        loss = prepared.forward_backward(seed=1234).item()
        grads = _grads(prepared.model)
        if reference_grads is None:
            reference_loss, reference_grads = loss, grads
        agreement[name] = (loss, abs(loss - reference_loss), _max_diff(grads, reference_grads))
        del grads
        memory[name] = measure_step_peak(
            prepared.step,
            device,
            model=prepared.model,
            inputs=(prepared.batch.args, prepared.batch.kwargs, prepared.optimizer.state),
            warmup=1,
        )
        flops[name] = None if prepared.compiled else step_flops(prepared.step)
        meta[name] = (prepared.plan_hash, prepared.techniques)
        predicted[name] = predicted_overhead(prepared.plan)
        wrap_cpu[name] = prepared.wrap_cpu_seconds
        prepared.close()
        del prepared
        gc.collect()
    del reference_grads

    # Time: all variants alive and timed round-robin (median per variant)
    # when they fit in memory together; otherwise one after the other.
    note(f"{entry.name}: step time")
    capacity = _hardware.detect(device.type, device.index or 0).capacity_bytes
    interleaved = entry.estimated_training_bytes() * len(names) < 0.5 * capacity
    times, offload = (
        _time_interleaved(entry, names, repeats, device)
        if interleaved
        else _time_sequential(entry, names, repeats, device)
    )

    base_median = statistics.median(times["unoptimized"])
    results = []
    for name in names:
        report = memory[name]
        median = statistics.median(times[name])
        if interleaved:
            rounds = [t / b for t, b in zip(times[name], times["unoptimized"])]
        else:
            rounds = [t / base_median for t in times[name]]
        loss, loss_diff, grad_diff = agreement[name]
        results.append(
            VariantResult(
                model=entry.name,
                variant=name,
                description=VARIANT_HELP[name],
                peak_bytes=report.peak_bytes,
                start_bytes=report.start_bytes,
                peak_delta_bytes=report.peak_delta_bytes,
                rss_peak_bytes=rss_peaks[name],
                step_seconds=times[name],
                step_median_s=median,
                time_ratio=median / base_median,
                time_ratio_spread=(min(rounds), max(rounds)),
                loss=loss,
                loss_abs_diff=loss_diff,
                grad_max_abs_diff=grad_diff,
                plan_hash=meta[name][0],
                techniques=meta[name][1],
                timing="interleaved" if interleaved else "sequential",
                offload=offload.get(name),
                step_flops=flops[name],
                recompute_overhead=_overhead(flops[name], flops["unoptimized"]),
                predicted_recompute_overhead=predicted[name],
                wrap_cpu_seconds=wrap_cpu[name],
            )
        )
    return results


OFFLOAD_FIGURES = ("bytes_written", "io_seconds", "wait_seconds")


def _offload_counters(prepared: Prepared) -> dict[str, float] | None:
    executor = prepared.model.__dict__.get("_memscale_executor")
    store = getattr(executor, "offload_store", None)
    if store is None:
        return None
    stats = store.stats
    counters = {key: float(stats[key]) for key in OFFLOAD_FIGURES}
    host = getattr(executor, "offload_host", None)
    if host is not None:  # a GPU's host tier: bytes copied to host memory
        counters["bytes_to_host"] = float(host.bytes_to_host)
    return counters


def _per_step(
    before: dict[str, float] | None, after: dict[str, float] | None, steps: int
) -> dict[str, float] | None:
    if before is None or after is None or steps <= 0:
        return None
    return {key: (after[key] - before[key]) / steps for key in before}


Timings = tuple[dict[str, list[float]], dict[str, dict[str, float] | None]]


def _time_interleaved(
    entry: BenchmarkModel, names: list[str], repeats: int, device: torch.device
) -> Timings:
    live = {name: prepare(entry, name, device) for name in names}
    for _ in range(WARMUP_ROUNDS):  # optimizer state, allocator, page cache
        for prepared in live.values():
            prepared.step()
            prepared.sync()
    times: dict[str, list[float]] = {name: [] for name in names}
    offload: dict[str, dict[str, float] | None] = {}
    before = {name: _offload_counters(p) for name, p in live.items()}
    for _ in range(repeats):
        for name in names:
            start = time.perf_counter()
            live[name].step()
            live[name].sync()
            times[name].append(time.perf_counter() - start)
    for name, prepared in live.items():
        offload[name] = _per_step(before[name], _offload_counters(prepared), repeats)
    for prepared in live.values():
        prepared.close()
    del live
    gc.collect()
    return times, offload


def _time_sequential(
    entry: BenchmarkModel, names: list[str], repeats: int, device: torch.device
) -> Timings:
    times: dict[str, list[float]] = {}
    offload: dict[str, dict[str, float] | None] = {}
    for name in names:
        prepared = prepare(entry, name, device)
        for _ in range(WARMUP_ROUNDS):
            prepared.step()
        prepared.sync()
        times[name] = []
        before = _offload_counters(prepared)
        for _ in range(repeats):
            start = time.perf_counter()
            prepared.step()
            prepared.sync()
            times[name].append(time.perf_counter() - start)
        offload[name] = _per_step(before, _offload_counters(prepared), repeats)
        prepared.close()
        del prepared
        gc.collect()
    return times, offload


def lookup(name: str) -> BenchmarkModel:
    return BENCHMARK_MODELS[name]
