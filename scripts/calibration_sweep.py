"""Predicted, simulated and measured peaks of memscale's plans across the
budget sweep's budgets: how well the per-layer calibrated memory model
holds.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/calibration_sweep.py \
        [--models gpt2-12l llama-12l bert-12l] [--shares 0.2 0.3 ... 0.8] \
        [--modes memscale conservative]

Per model it measures the unoptimized training step's exact peak once
(budgets ``start + share x activations``, as ``memscale.benchmarks.sweep``),
then per budget and mode: the plan ``wrap`` makes (the budget sweep's
rows: ``memscale`` is ``Config(mode="balanced", enable_offloading=False,
memory_budget_gb=...)``: whole layers, segments and selective;
``conservative`` is ``Config(mode="conservative", ...)``), the engine's predicted peak, the OOM predictor's
simulated peak of that plan (fake tensors; the one ``wrap`` ran to verify
it, "-" when it ran none), the exact peak of a real
training step under it (allocator events, ``measure_peak``) and whether
the plan is the every-layer fallback.  Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import gc
import logging
from typing import Any

import torch
import wrap_time  # scripts/, beside this file

import memscale
from memscale import _planner
from memscale.benchmarks.measure import measure_peak
from memscale.config import GIB


def _measured(model: Any, sample: Any, loss_fn: Any) -> int:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(wrap_time._call(model, sample)).backward()
        opt.step()

    report = measure_peak(step, model=model, inputs=(sample, opt.state), warmup=1)
    return int(report.peak_bytes)


def _choices(plan: Any) -> tuple[Any, ...]:
    return tuple((x.techniques, x.segment, x.nested, x.tiles) for x in plan.layers)


def _segments(plan: Any) -> str:
    seg: list[int] = []
    kept = selective = nested = 0
    for layer in plan.layers:
        if "selective" in layer.techniques:
            selective += 1
        elif not layer.techniques:
            kept += 1
        elif layer.segment == layer.index:
            seg.append(1)
            nested += layer.nested
        else:
            seg[-1] += 1
    out = f"{len(seg)} segments {seg}, {kept} kept"
    out += f", {nested} nested" if nested else ""
    return out + (f", {selective} selective" if selective else "")


MODES = {
    "memscale": {"mode": "balanced", "enable_offloading": False},
    "conservative": {"mode": "conservative"},
}


def _row(name: str, mode: str, share: float, start: int, activations: int) -> str:
    budget = int(start + share * activations)
    config = memscale.Config(**MODES[mode], memory_budget_gb=budget / GIB, enable_logging=False)
    model, sample, loss_fn = wrap_time._build(name)
    seen: dict[Any, int] = {}
    offsets: list[Any] = []
    simulated_peak = _planner.predictor.SimulationSession.simulated_peak
    predicted_offsets = _planner.predicted_offsets

    def record(session: Any, plan: Any, config: Any) -> int:
        peak = int(simulated_peak(session, plan, config))
        seen[_choices(plan)] = peak
        return peak

    def keep(*args: Any, **kwargs: Any) -> Any:
        offsets.append(predicted_offsets(*args, **kwargs))
        return offsets[-1]

    _planner.predictor.SimulationSession.simulated_peak = record  # type: ignore[method-assign]
    _planner.predicted_offsets = keep
    try:
        memscale.wrap(model, config, sample_input=sample)
    except memscale.MemoryBudgetError as exc:
        return (
            f"| {name} | {mode} | {share:.0%} | {budget} | no plan (least "
            f"{exc.min_budget_bytes}) | - | - | - | - | - | - |"
        )
    finally:
        _planner.predictor.SimulationSession.simulated_peak = simulated_peak  # type: ignore[method-assign]
        _planner.predicted_offsets = predicted_offsets
    plan = model._memscale_executor.plan
    fallback = bool(offsets and offsets[-1].fallback)
    simulated = seen.get(_choices(plan))
    measured = _measured(model, sample, loss_fn)
    memscale.detach(model)
    predicted = int(plan.peak_projected_bytes)
    err = (predicted - measured) / measured
    return (
        f"| {name} | {mode} | {share:.0%} | {budget} | {_segments(plan)} | {predicted} | "
        f"{simulated if simulated is not None else '-'} | {measured} | {err:+.2%} | "
        f"{'yes' if fallback else 'no'} | {'yes' if measured <= budget else 'NO'} |"
    )


def sweep(name: str, shares: list[float], modes: list[str]) -> None:
    start, activations = wrap_time.unoptimized(name)
    for share in shares:
        for mode in modes:
            print(_row(name, mode, share, start, activations), flush=True)
            gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["gpt2-12l", "llama-12l", "bert-12l"])
    parser.add_argument(
        "--shares", nargs="*", type=float, default=[0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    )
    parser.add_argument("--modes", nargs="*", choices=sorted(MODES), default=list(MODES))
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    print(
        "| model | mode | budget share | budget bytes | plan | predicted | simulated | measured "
        "| predicted vs measured | fallback | fits |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        sweep(name, args.shares, args.modes)


if __name__ == "__main__":
    main()
