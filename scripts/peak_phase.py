"""Where a training step's memory peaks: in forward or backward, under which
operator, and how much is held when backward starts.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python scripts/peak_phase.py \
        [--model gpt2-12l] [--fraction 0.3] [--methods memscale compile]

For one benchmark model and one budget of the budget sweep (``start +
fraction x activations``, as ``memscale.benchmarks.sweep``), it builds
memscale's plan (the sweep's ``memscale`` row: BALANCED, no offloading)
and the compile min-cut peer (``activation_memory_budget = fraction``,
eager kernels), runs each one's training step once more under the memory
profiler after a warm-up step, and prints per method, from the allocator
events of that step (exact on the CPU):

* the peak above the step's start, and the innermost operator running at it;
* the highest level in forward and in backward (backward starts at the
  first ``autograd::engine::evaluate_function`` event);
* the level when backward starts: what the forward left held for it.

A peak in backward under the loss's own nodes (``LogSoftmaxBackward0``)
rather than a block's says that a block's recompute transient is not what
sets the step's peak: only the bytes held through backward are.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
from typing import Any, cast

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import memscale
from memscale.benchmarks import runner, sweep
from memscale.config import GIB

MIB = float(1 << 20)
_BACKWARD = "autograd::engine::evaluate_function"
_WINDOW = "## peak_phase: measured step ##"


def phases(step: Any) -> dict[str, Any]:
    """Run ``step`` twice under the memory profiler (a warm-up, so that the
    frees of what it made show, as ``memscale.measure_peak`` does); the
    second call's levels (bytes above its start) and the operator at its
    peak."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        gc.collect()
        with record_function(_WINDOW):
            step()
    events = prof.profiler.kineto_results.events()
    (window,) = [e for e in events if e.name() == _WINDOW]
    begin, end = window.start_ns(), window.start_ns() + window.duration_ns()
    memory = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and begin <= e.start_ns() <= end
    )
    ops = [
        (e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
        for e in events
        if e.name() not in ("[memory]", _WINDOW) and begin <= e.start_ns() <= end
    ]
    starts = [start for start, _, name in ops if name.startswith(_BACKWARD)]
    backward = min(starts) if starts else None
    level = peak = forward_max = backward_max = 0
    at = held = None
    for time, nbytes in memory:
        if backward is not None and held is None and time >= backward:
            held = level
        level += nbytes
        if backward is None or time < backward:
            forward_max = max(forward_max, level)
        else:
            backward_max = max(backward_max, level)
        if level > peak:
            peak, at = level, time
    inside = sorted(
        (op for op in ops if at is not None and op[0] <= at <= op[1]),
        key=lambda op: op[1] - op[0],
    )
    return {
        "peak": peak,
        "forward_max": forward_max,
        "backward_max": backward_max,
        "held": held,
        "at": [name for _, _, name in inside[:3]],
    }


def _memscale_step(entry: Any, budget: int) -> Any:
    config = memscale.Config(
        memory_budget_gb=budget / GIB, enable_logging=False, **sweep.MEMSCALE["memscale"]
    )

    def setup(model: torch.nn.Module, batch: Any) -> Any:
        memscale.wrap(model, config, sample_input=batch.sample_input)
        return sweep._plan_summary(model._memscale_executor.plan)  # type: ignore[union-attr]

    _, _, step, (summary, _) = sweep._prepared(entry, setup)
    return step, summary


def _saving_backend(fraction: float, saved: list[tuple[str, tuple[int, ...], str, int]]) -> Any:
    """The compile peer's partition (``aot_eager_decomp_partition``: inductor's
    decompositions, the min-cut, eager kernels) under the budget, which
    also lists each backward graph's saved activations (its inputs other
    than parameters, graph inputs and incoming gradients) into ``saved``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import get_nop_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import select_decomp_table

    nop = get_nop_func()  # the backend's own: boxed, so each input is freed after its last use

    def forward(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        return nop(gm, inputs)

    def backward(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        for node in gm.graph.find_nodes(op="placeholder"):
            value = node.meta.get("val")
            if node.name.startswith(("primals_", "tangents_")) or not isinstance(
                value, torch.Tensor
            ):
                continue
            nbytes = value.untyped_storage().nbytes()
            saved.append((node.name, tuple(value.shape), str(value.dtype), nbytes))
        return nop(gm, inputs)

    inner = aot_autograd(
        fw_compiler=forward,
        bw_compiler=backward,
        decompositions=select_decomp_table(),
        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
    )

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        # As torch's aot_eager_decomp_partition backend sets them.
        with torch._functorch.config.patch(
            activation_memory_budget=fraction, unlift_effect_tokens=True
        ):
            return inner(gm, inputs)

    return backend


def _compile_step(entry: Any, fraction: float, saved: list[Any] | None = None) -> Any:
    torch._dynamo.reset()
    model, batch = entry.build(seed=0)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if saved is None:
        backend = runner.memory_budget_backend(fraction, "eager")
    else:
        backend = _saving_backend(fraction, saved)
    compiled = cast(torch.nn.Module, torch.compile(model, backend=backend))
    step = sweep._step_fn(compiled, batch, optimizer, torch.device("cpu"))
    step()
    return step, f"activation_memory_budget={fraction:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-12l")
    parser.add_argument("--fraction", type=float, default=0.3)
    parser.add_argument(
        "--methods", nargs="+", default=["memscale", "compile"], choices=["memscale", "compile"]
    )
    parser.add_argument(
        "--saved",
        action="store_true",
        help="list the compile peer's saved activations (its backward graphs' inputs), by shape",
    )
    args = parser.parse_args()
    logging.getLogger("memscale").setLevel(logging.ERROR)
    entry = runner.lookup(args.model)
    # The budget as the sweep sets it: start + fraction x activations.
    start, activations = sweep_budget_terms(entry)
    print(f"{args.model}, unoptimized step: peak {activations / MIB:.2f} MiB above its start")
    budget = int(start + args.fraction * activations)
    print(
        f"budget {budget / MIB:.2f} MiB ({args.fraction:.0%} of activations; start {start / MIB:.2f} MiB)"
    )
    print()
    print(
        "| method | plan | peak above start | forward max | held when backward starts | backward max | at the peak |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    saved: list[Any] | None = [] if args.saved else None
    for method in args.methods:
        if method == "memscale":
            step, summary = _memscale_step(entry, budget)
        else:
            step, summary = _compile_step(entry, args.fraction, saved)
        r = phases(step)
        held = "-" if r["held"] is None else f"{r['held'] / MIB:.2f} MiB"
        print(
            f"| {method} | {summary} | {r['peak'] / MIB:.2f} MiB | {r['forward_max'] / MIB:.2f} MiB "
            f"| {held} | {r['backward_max'] / MIB:.2f} MiB | {' < '.join(r['at'])} |"
        )
        del step
        torch._dynamo.reset()
    if saved:
        print()
        print("compile peer's saved activations, by shape and dtype (storage bytes):")
        groups: dict[tuple[Any, str], list[str]] = {}
        sizes: dict[tuple[Any, str], int] = {}
        for name, shape, dtype, nbytes in saved:
            groups.setdefault((shape, dtype), []).append(name)
            sizes[(shape, dtype)] = nbytes
        for (shape, dtype), names in sorted(groups.items(), key=lambda kv: -sizes[kv[0]]):
            each = sizes[(shape, dtype)] / MIB
            print(f"  {shape} {dtype}: {len(names)} x {each:.2f} MiB  ({', '.join(names)})")
        print(f"  total {sum(n for *_, n in saved) / MIB:.2f} MiB in {len(saved)} tensors")


def sweep_budget_terms(entry: Any) -> tuple[int, int]:
    """(start bytes, activation bytes) of the unoptimized step, measured as
    the budget sweep measures them."""
    model, batch, step, (_, optimizer) = sweep._prepared(entry, lambda m, b: None)
    report = sweep._measure(step, model, batch, optimizer)
    return int(report.start_bytes), int(report.peak_delta_bytes)


if __name__ == "__main__":
    main()
