"""How much nested recomputation would gain over memscale's two levels.

memscale's budget planner (csrc/solver.c) recomputes on two levels: a
layer is kept, or belongs to a checkpoint segment whose recompute holds
the saved tensors of all of its layers at once.  Rotor's recursive
schedule (Beaumont et al., "Optimal checkpointing for heterogeneous
chains") also lets a segment's recompute checkpoint again inside itself.
This script computes, for the benchmark models and under memscale's own
memory model (csrc/memory.h), the optimum of both at every budget:

    .venv/bin/python scripts/nested_bound.py [--models gpt2-12l llama-12l bert-12l]

* The layers are the model's planning units, as memscale profiles them
  (saved bytes, input bytes, forward FLOPs of each).  Only activation
  memory above what a step always holds is budgeted (``M`` below).
* Two levels: the memory model the solver plans with.  A kept layer holds
  its saved tensors; a segment [a..b] holds the input of a; when backward
  reaches the segment its recompute adds the saved tensors of a..b.
* Nested: the same, except that a segment's recompute may itself (a) keep
  the first layer's saved tensors and go on with the rest, or (b) run
  a..k-1 without saving, treat k..b first (from the input of k, while the
  input of a stays held), then a..k-1 - recursively, as rotor does.
* Both optima are exact (dynamic programs over the chain with exact
  bytes).  The two-level optimum is checked against memscale's C solver at
  each budget (same recompute FLOPs, same peak).

Printed per model: the least M each reaches, and for M from the two-level
least to "everything kept" in 1% steps of the activation memory, the
largest gap in recompute overhead (recomputed FLOPs over the unoptimized
step's FLOPs, taken as 3 forwards as ``Plan.predicted_slowdown`` does).
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import memscale
from memscale import _core, _model, _planning
from memscale._hardware import detect
from memscale._solve import solve
from memscale.benchmarks import runner
from memscale.config import GIB

INF = math.inf


@dataclass(frozen=True)
class Chain:
    saved: tuple[int, ...]  # s_i: bytes a kept layer holds until backward
    inputs: tuple[int, ...]  # x_i: bytes of layer i's input (a checkpoint)
    flops: tuple[float, ...]  # f_i: forward FLOPs
    step_flops: float  # the unoptimized step's FLOPs (3 x forward)
    base: int  # activations outside the planning units (in every term)
    fixed: int  # parameters, gradients, optimizer state (Adam assumed)


def chain_of(name: str) -> tuple[Chain, object]:
    entry = runner.lookup(name)
    model, batch = entry.build(seed=0)
    units = _core.find_units(model)
    config = memscale.Config(mode="conservative")
    profile = _planning.profile_upfront(model, units, batch.sample_input, config)
    layers = [layer for layer in profile.layers if not layer.flags & _INELIGIBLE]
    if len(layers) != len(profile.layers):
        raise SystemExit(f"{name}: ineligible planning units; this script assumes none")
    saved = tuple(int(layer.saved_bytes) for layer in layers)
    base = int(profile.activation_bytes) - sum(saved)
    chain = Chain(
        saved=saved,
        inputs=tuple(int(layer.input_bytes) for layer in layers),
        flops=tuple(float(layer.flops) for layer in layers),
        step_flops=3.0 * float(profile.total_flops),
        base=base,
        fixed=_model.fixed_bytes(model, None),
    )
    return chain, profile


# Every flag but "tileable" makes a layer ineligible for checkpointing.
_INELIGIBLE = ~_core.LAYER_TILEABLE


def optimum(chain: Chain, budget: int, nested: bool, one_level: bool = False) -> float:
    """The least recomputed FLOPs of a plan whose terms fit ``budget``
    bytes of activation memory (INF when none does).  ``one_level``: two
    levels, plus the one extra level memscale builds (a segment whose
    recompute keeps only its layers' inputs, then recomputes each layer
    alone from its input as backward reaches it; csrc/solver.c)."""
    s, x, f = chain.saved, chain.inputs, chain.flops
    n = len(s)
    prefix = [0.0]
    for v in f:
        prefix.append(prefix[-1] + v)

    @functools.cache
    def recompute(a: int, b: int, m: int) -> float:
        # Backward through a..b from its input, within m bytes.  As in
        # csrc/memory.c, a segment's own input is not counted apart from
        # the saved tensors of its first layer (which hold it); the inputs
        # of the segments before it are.
        if m < 0:
            return INF
        best = prefix[b + 1] - prefix[a] if sum(s[a : b + 1]) <= m else INF
        if one_level and a < b:
            # The inputs of a..k-1 held (a's stays until a's backward) while layer
            # k is recomputed alone; the first pass runs a..b-1 once.
            worst = max(sum(x[a:k]) + s[k] for k in range(a, b + 1))
            if worst <= m:
                best = min(best, prefix[b] - prefix[a] + prefix[b + 1] - prefix[a])
        if not nested or a == b:
            return best
        # (a) keep layer a's saved tensors while a+1..b is treated.
        if s[a] <= m:
            best = min(best, f[a] + recompute(a + 1, b, m - s[a]))
        # (b) run a..k-1 unsaved, treat k..b from its input while the input
        # of a stays held (it is needed again for a..k-1), then a..k-1.
        for k in range(a + 1, b + 1):
            tail = recompute(k, b, m - x[a])
            if tail < INF:
                best = min(best, prefix[k] - prefix[a] + tail + recompute(a, k - 1, m))
        return best

    @functools.cache
    def top(i: int, held: int) -> float:
        if held > budget:
            return INF
        if i == n:
            return 0.0
        best = top(i + 1, held + s[i])  # kept
        for j in range(i, n):  # a segment i..j, its input held
            cost = recompute(i, j, budget - held)
            if cost < INF:
                best = min(best, cost + top(j + 1, held + x[i]))
        return best

    result = top(0, 0)
    recompute.cache_clear()
    top.cache_clear()
    return result


def least(chain: Chain, nested: bool, one_level: bool = False) -> int:
    """The least budget (bytes) at which a plan exists."""
    lo, hi = 0, sum(chain.saved)
    while lo < hi:
        mid = (lo + hi) // 2
        if optimum(chain, mid, nested, one_level) < INF:
            hi = mid
        else:
            lo = mid + 1
    return lo


def solver_flops(profile: object, chain: Chain, budget: int) -> tuple[float, int] | None:
    """memscale's C solver at ``budget`` bytes of activation memory:
    (recomputed FLOPs, projected activation bytes), or None if it finds
    no plan."""
    hardware = detect("cpu")
    total = chain.base + budget
    config = memscale.Config(mode="conservative", memory_budget_gb=total / GIB)
    problem = _planning.plan_problem(profile, config, hardware, 0)  # type: ignore[arg-type]
    # The solver budgets the whole step: plan with fixed = 0, so that the
    # budget is the activation memory alone (base included).
    plan = solve(problem)
    if not plan.fits:
        return None
    flops = sum(layer.flops for layer in plan.layers if "checkpoint" in layer.techniques)
    return flops, int(plan.peak_projected_bytes) - chain.base


def mib(v: float) -> str:
    return f"{v / 2**20:.1f} MiB"


def report(name: str) -> None:
    chain, profile = chain_of(name)
    activations = sum(chain.saved)
    low2 = least(chain, nested=False)
    lown = least(chain, nested=True)
    low1 = least(chain, nested=False, one_level=True)
    print(f"## {name}: {len(chain.saved)} units")
    print(
        f"per unit: saved {mib(max(chain.saved))}, input {mib(max(chain.inputs))}; "
        f"unit activations {mib(activations)}; other activations {mib(chain.base)}; "
        f"parameters, gradients, Adam state {mib(chain.fixed)}"
    )
    whole = chain.fixed + chain.base + low2
    print(
        f"least activation budget: two levels {mib(low2)}, nested {mib(lown)}: "
        f"{mib(low2 - lown)} lower, {100 * (low2 - lown) / whole:.1f}% of the two-level "
        f"least step peak ({mib(whole)} predicted)"
    )
    print(
        f"one extra level (memscale's nested segments): least {mib(low1)}, "
        f"{100 * (low2 - low1) / max(low2 - lown, 1):.0f}% of the way from two levels "
        f"to nested; overhead there {optimum(chain, low1, False, True) / chain.step_flops:.3f} "
        f"(nested {optimum(chain, low1, True) / chain.step_flops:.3f})"
    )
    below = []
    for pct in (0, 25, 50, 75):
        budget = lown + (low2 - lown) * pct // 100
        below.append(f"{mib(budget)}: {optimum(chain, budget, True) / chain.step_flops:.3f}")
    print(
        "nested only, below the two-level least (budget: recompute overhead): " + "; ".join(below)
    )
    worst = (0.0, 0)
    mismatches = 0
    rows = []
    for pct in range(101):
        budget = low2 + (activations - low2) * pct // 100
        two = optimum(chain, budget, nested=False)
        nest = optimum(chain, budget, nested=True)
        gap = (two - nest) / chain.step_flops
        if gap > worst[0]:
            worst = (gap, budget)
        c = solver_flops(profile, chain, budget)
        if c is None or abs(c[0] - two) > 1e-6 * max(two, 1.0):
            mismatches += 1
        if pct % 10 == 0:
            rows.append(
                f"| {mib(budget)} | {two / chain.step_flops:.4f} | {nest / chain.step_flops:.4f} "
                f"| {'-' if c is None else f'{c[0] / chain.step_flops:.4f}'} |"
            )
    print("| activation budget | two levels | nested | memscale's solver |")
    print("| --- | --- | --- | --- |")
    print("\n".join(rows))
    print(
        "largest gap over 101 budgets from the two-level least to all kept: "
        + (
            f"{100 * worst[0]:.3f}% of the step's FLOPs (at {mib(worst[1])}); "
            if worst[0]
            else "none; "
        )
        + f"solver disagrees with the two-level optimum at {mismatches} of 101 budgets"
    )
    print()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2-12l", "llama-12l", "bert-12l"])
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    for name in args.models:
        report(name)


if __name__ == "__main__":
    main()
