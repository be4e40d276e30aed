"""Plan hashes and exact peaks of the benchmark models: a fingerprint of
memscale's behaviour, for refactors that must not change it.

    .venv/bin/python scripts/plan_fingerprint.py > before.txt
    ... change the code ...
    .venv/bin/python scripts/plan_fingerprint.py > after.txt
    diff before.txt after.txt     # empty: same plans, same bytes

For every quick benchmark model (and, with --budget, the 12-layer GPT-2 and
Llama at a budget that makes the planner and its calibration run) it prints
one line per variant: the plan hash, the technique counts and the exact
peak of a steady training step (the suite's measure, in bytes).
"""

from __future__ import annotations

import argparse
import gc
import logging

import torch

import memscale
from memscale.benchmarks import models, runner
from memscale.benchmarks.measure import measure_peak

VARIANTS = ("conservative", "balanced", "balanced-async", "aggressive")


def _peak(prepared: runner.Prepared) -> int:
    report = measure_peak(
        prepared.step,
        model=prepared.model,
        inputs=(prepared.batch.args, prepared.batch.kwargs, prepared.optimizer.state),
        warmup=1,
    )
    return int(report.peak_bytes)


def forced(names: list[str]) -> None:
    for name in names:
        entry = runner.lookup(name)
        for variant in VARIANTS:
            prepared = runner.prepare(entry, variant)
            counts = {k: v for k, v in sorted(prepared.techniques.items()) if v}
            print(
                f"{name:10s} {variant:15s} {prepared.plan_hash} peak={_peak(prepared)} {counts}",
                flush=True,
            )
            prepared.close()
            del prepared
            gc.collect()


def budgeted(runs: list[tuple[str, float]]) -> None:
    """Plan at start + share x activations, the budget sweep's budgets."""
    for name, share in runs:
        entry = runner.lookup(name)
        base = runner.prepare(entry, "unoptimized")
        report = measure_peak(
            base.step,
            model=base.model,
            inputs=(base.batch.args, base.batch.kwargs, base.optimizer.state),
            warmup=1,
        )
        del base
        gc.collect()
        budget = report.start_bytes + int(share * report.peak_delta_bytes)
        model, batch = entry.build(seed=0)
        config = memscale.Config(
            mode="conservative", memory_budget_gb=budget / (1 << 30), enable_logging=False
        )
        try:
            memscale.wrap(model, config, sample_input=batch.sample_input)
        except memscale.MemoryBudgetError as exc:
            print(
                f"{name:10s} {share:.0%} budget={budget} MemoryBudgetError "
                f"min={exc.min_budget_bytes}",
                flush=True,
            )
            continue
        plan = model._memscale_executor.plan
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        prepared = runner.Prepared(model, batch, optimizer, plan.hash, plan.technique_counts, plan)
        counts = {k: v for k, v in sorted(plan.technique_counts.items()) if v}
        print(
            f"{name:10s} {share:.0%} budget={budget} {plan.hash} "
            f"offset={plan.plan_offset_bytes} peak={_peak(prepared)} {counts}",
            flush=True,
        )
        prepared.close()
        del prepared, model
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget", action="store_true", help="also plan gpt2-12l and llama-12l at a budget"
    )
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    quick = [m.name for m in models.BENCHMARK_MODELS.values() if m.size == "quick"]
    forced(quick)
    if args.budget:
        budgeted([("gpt2-12l", 0.4), ("gpt2-12l", 0.7), ("llama-12l", 0.6)])


if __name__ == "__main__":
    main()
