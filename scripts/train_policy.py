#!/usr/bin/env python
"""Train memscale's Stage 1 strategy tree and compare it with the rule policy.

    python scripts/train_policy.py [--out memscale/policy/artifacts/strategy_tree.json]
                                   [--cache measurements.json] [--quick]

1. **Data.**  Small models of five families (MLP, CNN, GPT-2, BERT,
   Llama, built from code and configs; nothing is downloaded) are profiled
   by memscale.  For every model, a sweep of budgets (predicted memory
   pressure 0.60 to 2.00) and every strategy of ``memscale.policy.STRATEGIES``
   is planned by memscale's engine (``memscale._core.build_plan``, through
   ``_planner.make_plan``, exactly as ``wrap`` plans on a GPU).  The peak of
   each distinct plan is then *measured*: one real training step (zero_grad,
   forward, loss, backward, AdamW step) of the wrapped model, counted exactly
   with ``memscale.benchmarks.measure.measure_peak`` after a warm-up step.
   A case "fits" when the measured peak is at most the budget.  The slowdown
   of a plan is predicted from FLOPs: ``1 + recompute_ratio / 3`` (a training
   step costs about three forwards).
2. **Training.**  A cost-minimizing decision tree in pure Python: every leaf
   picks the strategy with the least total cost over its cases, where a
   case's cost is its predicted slowdown plus ``MISS_COST`` when the
   strategy's measured peak does not fit.  Splits are exhaustive over the
   features of ``memscale.policy.FEATURES`` (midpoints), with ties broken by
   feature order then threshold, so the same data gives the same tree.
3. **Evaluation.**  Models are split by name (every fourth model, in sorted
   order, is held out, so no held-out model is seen in training).  On the
   held-out cases the trained tree and ``memscale.policy.RulePolicy`` are
   compared: the share of cases whose pick fits the budget (measured), and
   the mean predicted slowdown of the picks.  Both are printed side by side,
   with the oracle and the fixed strategies for reference.

The measurements take a few minutes on 2 CPU cores; ``--cache PATH`` keeps
them for the next run.  The figures are CPU measurements: a GPU's caching
allocator and library workspaces move the real peak differently.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import memscale  # noqa: E402
from memscale import _core, _model, _planner, _planning  # noqa: E402
from memscale._hardware import Hardware  # noqa: E402
from memscale.benchmarks.measure import measure_peak  # noqa: E402
from memscale.benchmarks.models import BenchmarkModel  # noqa: E402
from memscale.policy import (  # noqa: E402
    ARTIFACT_FORMAT,
    FEATURES,
    STRATEGIES,
    RulePolicy,
    StrategyContext,
    StrategyDecision,
    TrainedPolicy,
)

GIB = 1 << 30


def _gpu(capacity_bytes: int) -> Hardware:
    """The one GPU the sweep plans for."""
    return Hardware(
        device="cuda",
        index=0,
        count=1,
        capacity_bytes=capacity_bytes,
        bf16=True,
        name="policy sweep",
    )


MISS_COST = 1.0  # a pick that does not fit costs as much as a 2x slowdown
MAX_DEPTH = 3
MIN_LEAF = 12
PRESSURES = [round(0.60 + 0.05 * i, 2) for i in range(29)]  # 0.60 .. 2.00
ORDER = list(STRATEGIES)  # conservative, balanced, aggressive: tie order

# (name, family, params): small enough to measure in a second or two.
MODELS: list[tuple[str, str, dict[str, int]]] = [
    ("mlp-w128-d4-b512", "mlp", dict(width=128, depth=4, batch=512)),
    ("mlp-w128-d8-b1024", "mlp", dict(width=128, depth=8, batch=1024)),
    ("mlp-w256-d4-b256", "mlp", dict(width=256, depth=4, batch=256)),
    ("mlp-w256-d6-b1024", "mlp", dict(width=256, depth=6, batch=1024)),
    ("mlp-w64-d12-b2048", "mlp", dict(width=64, depth=12, batch=2048)),
    ("cnn-c16-d4-b8", "cnn", dict(channels=16, depth=4, image=32, batch=8)),
    ("cnn-c32-d4-b16", "cnn", dict(channels=32, depth=4, image=32, batch=16)),
    ("cnn-c16-d6-b16", "cnn", dict(channels=16, depth=6, image=32, batch=16)),
    ("cnn-c32-d6-i16-b32", "cnn", dict(channels=32, depth=6, image=16, batch=32)),
    (
        "gpt2-l4-h128-v2k-s64-b4",
        "gpt2",
        dict(layers=4, hidden=128, heads=4, vocab=2048, seq=64, batch=4),
    ),
    (
        "gpt2-l6-h128-v4k-s128-b2",
        "gpt2",
        dict(layers=6, hidden=128, heads=4, vocab=4096, seq=128, batch=2),
    ),
    (
        "gpt2-l4-h64-v8k-s64-b4",
        "gpt2",
        dict(layers=4, hidden=64, heads=4, vocab=8192, seq=64, batch=4),
    ),
    (
        "gpt2-l8-h64-v1k-s128-b4",
        "gpt2",
        dict(layers=8, hidden=64, heads=4, vocab=1024, seq=128, batch=4),
    ),
    (
        "bert-l4-h128-v2k-s64-b4",
        "bert",
        dict(layers=4, hidden=128, heads=4, vocab=2048, seq=64, batch=4),
    ),
    (
        "bert-l6-h64-v4k-s128-b4",
        "bert",
        dict(layers=6, hidden=64, heads=4, vocab=4096, seq=128, batch=4),
    ),
    (
        "bert-l3-h128-v1k-s128-b8",
        "bert",
        dict(layers=3, hidden=128, heads=4, vocab=1024, seq=128, batch=8),
    ),
    (
        "llama-l4-h128-v2k-s64-b4",
        "llama",
        dict(layers=4, hidden=128, heads=4, vocab=2048, seq=64, batch=4),
    ),
    (
        "llama-l6-h64-v4k-s128-b2",
        "llama",
        dict(layers=6, hidden=64, heads=4, vocab=4096, seq=128, batch=2),
    ),
    (
        "llama-l3-h128-v1k-s128-b8",
        "llama",
        dict(layers=3, hidden=128, heads=4, vocab=1024, seq=128, batch=8),
    ),
]


# --------------------------------------------------------------------------
# Data: plans predicted by the engine, peaks measured.


@dataclass
class Case:
    model: str
    family: str
    pressure: float
    features: dict[str, float]
    # strategy -> (fits (measured), measured peak, predicted peak, slowdown)
    outcomes: dict[str, tuple[bool, int, int, float]]
    context: StrategyContext

    def cost(self, strategy: str) -> float:
        fits, _, _, slowdown = self.outcomes[strategy]
        return slowdown + (0.0 if fits else MISS_COST)


def _checkpointed(plan: Any) -> tuple[int, ...]:
    return tuple(layer.index for layer in plan.layers if "checkpoint" in layer.techniques)


def _measure(
    entry: BenchmarkModel,
    profile: Any,
    plan_config: memscale.Config,
    fixed: int,
    budget: int,
    expected: tuple[int, ...],
) -> int:
    """Measured peak bytes of one training step with the checkpoint set
    ``expected`` applied (memscale.wrap with the same budget on the CPU)."""
    model, batch = entry.build(seed=0)
    config = plan_config.replace(
        memory_budget_gb=budget / GIB, enable_logging=False, auto_policy=False
    )
    if expected:
        memscale.wrap(model, config, sample_input=batch.sample_input)
        got = _checkpointed(model._memscale_executor.plan)
        if got != expected:
            memscale.detach(model)
            raise RuntimeError(f"{entry.name}: wrap planned {got}, the sweep {expected}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(model: Any = model, optimizer: Any = optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        batch.loss_fn(model(*batch.args, **batch.kwargs)).backward()
        optimizer.step()

    try:
        report = measure_peak(
            step, model=model, inputs=(batch.args, batch.kwargs, optimizer.state), warmup=1
        )
    finally:
        if "_memscale_executor" in model.__dict__:
            memscale.detach(model)
    del step, model, optimizer
    gc.collect()
    return int(report.peak_bytes)


def generate(
    models: list[tuple[str, str, dict[str, int]]],
    pressures: list[float],
    cache: dict[str, int],
    save: Any,
) -> list[Case]:
    cases: list[Case] = []
    for name, family, params in models:
        t0 = time.monotonic()
        entry = BenchmarkModel(
            name, family, "policy", name, params, hf=family in ("gpt2", "bert", "llama")
        )
        model, batch = entry.build(seed=0)
        units = _core.find_units(model)
        base = memscale.Config(enable_logging=False, auto_policy=True)
        profile = _planning.profile_upfront(model, units, batch.sample_input, base)
        fixed = _model.fixed_bytes(model, None)
        del model
        probe = StrategyContext.build(base, _gpu(GIB), profile, fixed)
        unoptimized = probe.peak_unoptimized_bytes
        measured_here = 0
        for pressure in pressures:
            budget = int(unoptimized / pressure)
            # A GPU whose usable memory (capacity x 0.85) is this budget.
            hardware = _gpu(int(budget / 0.85) + 1)
            context = StrategyContext.build(base, hardware, profile, fixed)
            outcomes = {}
            for strategy in ORDER:
                decision = StrategyDecision.from_strategy(strategy, base, "ml", "sweep", None)
                effective = decision.effective_config(base)
                plan = _planner.make_plan(profile, effective, hardware, fixed)
                ckpt = _checkpointed(plan)
                key = f"{name}|{','.join(map(str, ckpt))}"
                if key not in cache:
                    cache[key] = _measure(entry, profile, effective, fixed, plan.budget_bytes, ckpt)
                    measured_here += 1
                    save()
                peak = cache[key]
                slowdown = 1.0 + plan.recompute_ratio / 3.0
                outcomes[strategy] = (
                    peak <= context.budget_bytes,
                    peak,
                    int(plan.peak_projected_bytes),
                    slowdown,
                )
            cases.append(Case(name, family, pressure, context.features(), outcomes, context))
        print(
            f"  {name:28s} {len(units):2d} units, {measured_here:2d} plans measured, "
            f"{time.monotonic() - t0:5.1f} s",
            flush=True,
        )
    return cases


# --------------------------------------------------------------------------
# A cost-minimizing decision tree, in pure Python.


def _leaf(cases: list[Case]) -> dict[str, Any]:
    totals = {s: sum(c.cost(s) for c in cases) for s in ORDER}
    best = min(ORDER, key=lambda s: (round(totals[s], 9), ORDER.index(s)))
    counts = {s: sum(1 for c in cases if _oracle(c) == s) for s in ORDER}
    return {"leaf": best, "counts": counts, "cost": round(totals[best], 6)}


def _split(cases: list[Case]) -> tuple[float, str, float] | None:
    """The best (cost, feature, threshold), or None."""
    best = None
    for feature in FEATURES:
        ordered = sorted(cases, key=lambda c: c.features[feature])
        n = len(ordered)
        right = {s: sum(c.cost(s) for c in ordered) for s in ORDER}
        left = dict.fromkeys(ORDER, 0.0)
        for i in range(n - 1):
            for s in ORDER:
                cost = ordered[i].cost(s)
                left[s] += cost
                right[s] -= cost
            a, b = ordered[i].features[feature], ordered[i + 1].features[feature]
            if a == b or i + 1 < MIN_LEAF or n - i - 1 < MIN_LEAF:
                continue
            total = min(left.values()) + min(right.values())
            threshold = round((a + b) / 2, 6)
            if best is None or round(total, 9) < round(best[0], 9):
                best = (total, feature, threshold)
    return best


def grow(cases: list[Case], depth: int = 0) -> dict[str, Any]:
    leaf = _leaf(cases)
    if depth >= MAX_DEPTH or len(cases) < 2 * MIN_LEAF:
        return leaf
    split = _split(cases)
    if split is None or split[0] >= leaf["cost"] - 1e-6:
        return leaf
    _, feature, threshold = split
    le = grow([c for c in cases if c.features[feature] <= threshold], depth + 1)
    gt = grow([c for c in cases if c.features[feature] > threshold], depth + 1)
    if "leaf" in le and "leaf" in gt and le["leaf"] == gt["leaf"]:
        return leaf  # the split changes no pick
    return {"feature": feature, "threshold": threshold, "le": le, "gt": gt}


def _oracle(case: Case) -> str:
    return min(ORDER, key=lambda s: (case.cost(s), ORDER.index(s)))


# --------------------------------------------------------------------------
# Evaluation.


def evaluate(name: str, pick: Any, cases: list[Case]) -> dict[str, Any]:
    picks = [pick(c) for c in cases]
    fits = [c.outcomes[p][0] for c, p in zip(cases, picks)]
    predicted_fits = [c.outcomes[p][2] <= c.context.budget_bytes for c, p in zip(cases, picks)]
    slow = [c.outcomes[p][3] for c, p in zip(cases, picks)]
    return {
        "policy": name,
        "cases": len(cases),
        "fits_share": sum(fits) / len(cases),
        "engine_predicted_fits_share": sum(predicted_fits) / len(cases),
        "mean_predicted_slowdown": sum(slow) / len(cases),
        "picks": {s: picks.count(s) for s in ORDER},
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"  {'policy':22s} {'fits (measured)':>16s} {'mean slowdown':>14s} "
        f"{'fits (engine)':>14s}  picks (cons/bal/aggr)"
    )
    for r in rows:
        picks = "/".join(str(r["picks"][s]) for s in ORDER)
        print(
            f"  {r['policy']:22s} {r['fits_share']:16.1%} "
            f"{r['mean_predicted_slowdown']:13.3f}x {r['engine_predicted_fits_share']:14.1%}"
            f"  {picks}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        default=str(ROOT / "memscale/policy/artifacts/strategy_tree.json"),
        help="where to write the tree (default: the shipped artifact)",
    )
    parser.add_argument(
        "--cache", default=None, help="JSON file of measured peaks, read and extended"
    )
    parser.add_argument(
        "--quick", action="store_true", help="every other model and pressure (a smoke run)"
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    models = MODELS[::2] if args.quick else MODELS
    pressures = PRESSURES[::2] if args.quick else PRESSURES
    cache: dict[str, int] = {}
    cache_path = Path(args.cache) if args.cache else None
    if cache_path is not None and cache_path.exists():
        cache = json.loads(cache_path.read_text())

    def save() -> None:
        if cache_path is not None:
            cache_path.write_text(json.dumps(cache, indent=0, sort_keys=True))

    print(
        f"memscale {memscale.__version__}, torch {torch.__version__}: {len(models)} "
        f"models x {len(pressures)} budgets x {len(ORDER)} strategies"
    )
    t0 = time.monotonic()
    cases = generate(models, pressures, cache, save)
    names = sorted({c.model for c in cases})
    held_out = set(names[3::4])
    train = [c for c in cases if c.model not in held_out]
    test = [c for c in cases if c.model in held_out]
    print(
        f"{len(cases)} cases ({len(train)} train, {len(test)} held out: "
        f"{', '.join(sorted(held_out))}); data in {time.monotonic() - t0:.0f} s"
    )

    tree = grow(train)
    artifact = {
        "format": ARTIFACT_FORMAT,
        "features": list(FEATURES),
        "classes": ORDER,
        "tree": tree,
        "training": {},
    }
    trained = TrainedPolicy(json.loads(json.dumps(artifact)))
    rules = RulePolicy()
    rows = [
        evaluate("trained tree", lambda c: trained.choose(c.context)[0], test),
        evaluate("rule policy", lambda c: rules.choose(c.context)[0], test),
        evaluate("oracle (measured)", _oracle, test),
    ] + [evaluate(f"always {s}", lambda c, s=s: s, test) for s in ORDER]
    train_rows = [
        evaluate("trained tree", lambda c: trained.choose(c.context)[0], train),
        evaluate("rule policy", lambda c: rules.choose(c.context)[0], train),
    ]
    print("\nheld-out cases (the shipped tree):")
    print_table(rows)
    print("\ntraining cases:")
    print_table(train_rows)

    # Cross-validation by model: four folds, every model held out once (each
    # fold's tree is trained on the other three; the shipped tree is fold 4's).
    cv_tree, cv_rule = [], []
    for k in range(4):
        fold = set(names[k::4])
        fold_tree = TrainedPolicy(
            {
                "format": ARTIFACT_FORMAT,
                "features": list(FEATURES),
                "tree": grow([c for c in cases if c.model not in fold]),
            }
        )
        fold_cases = [c for c in cases if c.model in fold]
        cv_tree += [(c, fold_tree.choose(c.context)[0]) for c in fold_cases]
        cv_rule += [(c, rules.choose(c.context)[0]) for c in fold_cases]
    cv_rows = []
    for name, picks in (("trained trees (CV)", cv_tree), ("rule policy", cv_rule)):
        chosen = {id(c): p for c, p in picks}
        cv_rows.append(
            evaluate(name, lambda c, chosen=chosen: chosen[id(c)], [c for c, _ in picks])
        )
    print("\n4-fold cross-validation by model (every case held out once):")
    print_table(cv_rows)

    artifact["training"] = {
        "generated_by": "scripts/train_policy.py" + (" --quick" if args.quick else ""),
        "memscale_version": memscale.__version__,
        "torch_version": torch.__version__,
        "miss_cost": MISS_COST,
        "max_depth": MAX_DEPTH,
        "min_leaf": MIN_LEAF,
        "pressures": [pressures[0], pressures[-1], len(pressures)],
        "models": names,
        "held_out_models": sorted(held_out),
        "cases": {"train": len(train), "held_out": len(test)},
        "held_out": {
            r["policy"]: {
                k: (round(v, 4) if isinstance(v, float) else v)
                for k, v in r.items()
                if k != "policy"
            }
            for r in rows[:2]
        },
        "cross_validation_by_model": {
            r["policy"]: {
                k: (round(v, 4) if isinstance(v, float) else v)
                for k, v in r.items()
                if k != "policy"
            }
            for r in cv_rows
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(artifact, indent=1, sort_keys=False) + "\n")
    TrainedPolicy.load(out)  # the artifact loads
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
