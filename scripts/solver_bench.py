"""The budget planner's solve time on long chains, through the engine's one
entry point (``memscale._solve.solve``, which calls
``memscale._core.build_plan``: parsing the layers, the C solver, building
the Plan object).

Transformer-like chains: layers of 20 to 28 MiB saved and 2 MiB input,
8e9 to 1.2e10 forward FLOPs each, every one a tiling candidate with a
selective profile of 8 levels (the most a layer has: from 6 to 10 MiB
kept and 8e8 to 1.2e9 FLOPs recomputed up to 14 to 18 MiB kept and 2e7
to 4e7 FLOPs); the
budget is the fixed bytes plus 20, 40, 60 or 80% of the activations; all
techniques allowed (AGGRESSIVE), CPU cost constants.  Median of 5 runs.

    .venv/bin/python scripts/solver_bench.py
    .venv/bin/python scripts/solver_bench.py --selective-cost

``--selective-cost`` times the same chains with and without their
selective profiles (and the technique), interleaved in one process, so
that what the larger choice set costs is seen apart from the machine's
load.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from memscale import Config, _core, _hardware, _planning
from memscale._solve import OffloadInputs, PlanProblem, solve

GIB = 1 << 30


def chain(n: int, seed: int) -> tuple[_core.LayerStats, ...]:
    rng = random.Random(seed)
    return tuple(
        _core.LayerStats(
            (
                f"h.{i}",
                "Block",
                1 << 20,
                rng.randint(20, 28) << 20,
                2 << 20,
                rng.randint(8, 12) * 1e9,
                _core.LAYER_TILEABLE,
            ),
            {"selective_levels": _levels(rng)},
        )
        for i in range(n)
    )


def _levels(rng: random.Random) -> tuple[tuple[float, int, float], ...]:
    """8 nested levels: each keeps 1 MiB more and recomputes less."""
    kept = rng.randint(6, 10) << 20
    last = rng.randint(2, 4) * 1e7
    return tuple(
        (float(64 >> k), kept + (k << 20), last + (7 - k) * 1.5e8)
        for k in range(8)
    )


def _problem(layers: tuple[_core.LayerStats, ...], frac: float, allowed: int) -> PlanProblem:
    hardware = _hardware.assumed("cpu", 0, 1 << 50)
    config = Config(mode="aggressive", async_offload=True)
    acts = sum(layer.saved_bytes for layer in layers)
    offload_in = OffloadInputs(
        min_offload_bytes=1 << 20, host_tier=False, host_cap_bytes=-1, disk_tier=True
    )
    return PlanProblem(
        layers=layers,
        mode="aggressive",
        allowed=allowed,
        force=False,
        budget_bytes=4 * GIB + int(frac * acts),
        fixed_bytes=4 * GIB,
        activation_bytes=acts,
        total_flops=sum(layer.flops for layer in layers),
        device="cpu",
        device_count=1,
        capacity_bytes=1 << 50,
        peak_offset_bytes=0,
        offload=offload_in,
        solver=_planning.solver_inputs(config, hardware, offload_in),
    )


def selective_cost() -> None:
    print("| layers | budget | without selective (median of 5) | with selective | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for n in (1_000, 10_000):
        layers = chain(n, seed=n)
        plain = tuple(_core.LayerStats(tuple(layer)) for layer in layers)
        for frac in (0.2, 0.6):
            problems = {
                "without": _problem(plain, frac, 7),
                "with": _problem(layers, frac, _planning.IMPLEMENTED),
            }
            times: dict[str, list[float]] = {"without": [], "with": []}
            for _ in range(5):
                for name, problem in problems.items():
                    t0 = time.perf_counter()
                    solve(problem)
                    times[name].append(time.perf_counter() - t0)
            a, b = (statistics.median(times[k]) for k in ("without", "with"))
            print(f"| {n:,} | {frac:.0%} | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | {b / a:.2f}x |")


def main() -> None:
    if "--selective-cost" in sys.argv[1:]:
        selective_cost()
        return
    hardware = _hardware.assumed("cpu", 0, 1 << 50)
    config = Config(mode="aggressive", async_offload=True)
    print(
        "| layers | budget (% of activations) | solve time (median of 5) | plan fits "
        "| segments | selective | predicted slowdown |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in (1_000, 10_000):
        layers = chain(n, seed=n)
        acts = sum(layer.saved_bytes for layer in layers)
        fixed = 4 * GIB
        for frac in (0.2, 0.4, 0.6, 0.8):
            offload_in = OffloadInputs(
                min_offload_bytes=1 << 20, host_tier=False, host_cap_bytes=-1, disk_tier=True
            )
            problem = PlanProblem(
                layers=layers,
                mode="aggressive",
                allowed=_planning.IMPLEMENTED,
                force=False,
                budget_bytes=fixed + int(frac * acts),
                fixed_bytes=fixed,
                activation_bytes=acts,
                total_flops=sum(layer.flops for layer in layers),
                device="cpu",
                device_count=1,
                capacity_bytes=1 << 50,
                peak_offset_bytes=0,
                offload=offload_in,
                solver=_planning.solver_inputs(config, hardware, offload_in),
            )
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                plan = solve(problem)
                times.append(time.perf_counter() - t0)
            segments = len({lp.segment for lp in plan.layers if lp.segment >= 0})
            print(
                f"| {n:,} | {frac:.0%} | {statistics.median(times) * 1e3:.1f} ms | "
                f"{plan.fits} | {segments} | {plan.technique_counts['selective']} | "
                f"{plan.predicted_slowdown:.3f}x |"
            )


if __name__ == "__main__":
    main()
