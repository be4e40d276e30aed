"""The least budget memscale accepts on a model, against the lowest peak of
the sqrt(n) segments peer, and whether the planner's least plan passed its
verification.

    OMP_NUM_THREADS=1 PYTHONPATH=.:scripts .venv/bin/python scripts/least_budget.py \
        [--models llama-12l chain-1000] [--modes memscale conservative]

Per model it measures the unoptimized training step's exact peak once
(``start + activations``, as ``memscale.benchmarks.sweep``), then per mode
(the budget sweep's memscale rows, as ``scripts/calibration_sweep.py``):

* ``wrap`` at ``start`` (no room for any activation), where no plan fits: the
  least budget ``MemoryBudgetError`` reports, the planner's own least
  (``Plan.min_budget_bytes`` with the calibrated per-layer terms) and what
  the one verification made of it (``PredictionSession._verified_least``:
  whether the planner's least plan, simulated, fits there, or how far
  above it the least reported is: the plan's simulated peak, or a
  fallback's);
* ``wrap`` at that least budget: the plan, its predicted peak, its
  simulated peak (the verification's) and the exact peak of a real step
  under it (allocator events, ``measure_peak``).

For a benchmark model with a block list it also measures the sqrt(n)
segments peer (``memscale.benchmarks.sweep.checkpoint_segments``: one
``torch.utils.checkpoint`` per segment, as ``checkpoint_sequential``); for
chain-1000, ``checkpoint_sequential`` itself with 32 segments.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import gc
import logging
from typing import Any

import calibration_sweep  # scripts/, beside this file
import torch
import wrap_time
from torch.utils.checkpoint import checkpoint_sequential

import memscale
from memscale import _planner
from memscale.benchmarks import runner, sweep
from memscale.benchmarks.measure import measure_peak
from memscale.config import GIB


def _chain_peer() -> int:
    """chain-1000 under ``torch.utils.checkpoint.checkpoint_sequential``
    with sqrt(n) segments (32 of its 1,000 blocks), measured as the
    unoptimized step is."""
    model, sample, _ = wrap_time._build("chain-1000")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    segments = round(len(model.blocks) ** 0.5)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = checkpoint_sequential(model.blocks, segments, sample[0], use_reentrant=False)
        out.pow(2).mean().backward()
        opt.step()

    report = measure_peak(step, model=model, inputs=(sample, opt.state), warmup=1)
    return int(report.peak_bytes)


def _peer(name: str) -> int | None:
    """The sqrt(n) segments peer's exact peak, or None (not a benchmark
    model with a block list, nor chain-1000)."""
    if name == "chain-1000":
        return _chain_peer()
    try:
        entry = runner.lookup(name)
    except (KeyError, ValueError):
        return None
    model, batch, step, (_, opt) = sweep._prepared(entry, lambda m, b: sweep.checkpoint_segments(m))
    return int(sweep._measure(step, model, batch, opt).peak_bytes)


def _least(name: str, mode: str, budget: int) -> tuple[int, int | None, str]:
    """wrap below every plan: (least reported, the planner's least, how the
    verification judged it)."""
    model, sample, _ = wrap_time._build(name)
    config = memscale.Config(
        **calibration_sweep.MODES[mode], memory_budget_gb=budget / GIB, enable_logging=False
    )
    seen: list[tuple[int, int]] = []
    original = _planner.PredictionSession._verified_least

    def record(self: Any, *args: Any) -> int:
        out = int(original(self, *args))
        seen.append((int(args[-2]), out))
        return out

    _planner.PredictionSession._verified_least = record  # type: ignore[method-assign]
    try:
        memscale.wrap(model, config, sample_input=sample)
    except memscale.MemoryBudgetError as exc:
        least = int(exc.min_budget_bytes)
    else:
        raise SystemExit(f"{name}: a plan fits {budget} bytes; pick a lower budget")
    finally:
        _planner.PredictionSession._verified_least = original  # type: ignore[method-assign]
    if not seen:
        return least, None, "not verified"
    planner, verified = seen[-1]
    if verified == planner:
        return least, planner, "its plan fits there when simulated"
    return least, planner, f"failed: reported {verified - planner:+d} bytes over it"


def _at(name: str, mode: str, budget: int) -> tuple[str, int, str, int]:
    """wrap at ``budget``: (plan, predicted, simulated, measured)."""
    model, sample, loss_fn = wrap_time._build(name)
    config = memscale.Config(
        **calibration_sweep.MODES[mode], memory_budget_gb=budget / GIB, enable_logging=False
    )
    seen: dict[Any, int] = {}
    simulated_peak = _planner.predictor.SimulationSession.simulated_peak

    def record(session: Any, plan: Any, config: Any) -> int:
        peak = int(simulated_peak(session, plan, config))
        seen[calibration_sweep._choices(plan)] = peak
        return peak

    _planner.predictor.SimulationSession.simulated_peak = record  # type: ignore[method-assign]
    try:
        memscale.wrap(model, config, sample_input=sample)
    finally:
        _planner.predictor.SimulationSession.simulated_peak = simulated_peak  # type: ignore[method-assign]
    plan = model._memscale_executor.plan
    simulated = seen.get(calibration_sweep._choices(plan))
    measured = calibration_sweep._measured(model, sample, loss_fn)
    memscale.detach(model)
    return (
        calibration_sweep._segments(plan),
        int(plan.peak_projected_bytes),
        str(simulated) if simulated is not None else "-",
        measured,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["llama-12l", "chain-1000"])
    parser.add_argument(
        "--modes",
        nargs="*",
        choices=sorted(calibration_sweep.MODES),
        default=list(calibration_sweep.MODES),
    )
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    print(
        "| model | mode | least reported | planner's least | verification | plan at the least "
        "| predicted | simulated | measured | measured <= least | sqrt(n) peer peak "
        "| least <= peer |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        start, _ = wrap_time.unoptimized(name)
        peer = _peer(name)
        gc.collect()
        for mode in args.modes:
            least, planner, how = _least(name, mode, start)
            gc.collect()
            plan, predicted, simulated, measured = _at(name, mode, least)
            gc.collect()
            print(
                f"| {name} | {mode} | {least} | {planner if planner is not None else '-'} "
                f"| {how} | {plan} | {predicted} | {simulated} | {measured} "
                f"| {'yes' if measured <= least else 'NO'} "
                f"| {peer if peer is not None else '-'} "
                f"| {'-' if peer is None else ('yes' if least <= peer else 'NO')} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
