"""Selective checkpointing chosen by the planner, measured.

    OMP_NUM_THREADS=1 python scripts/selective_bench.py [--json PATH]
        [--models gpt2-12l,llama-12l] [--fractions 0.5,0.6,0.7,0.8] [--conservative]

For each model (memscale.benchmarks.models) the unoptimized training step
is measured (exact peak from allocator events, and the bytes it starts
from); at budgets of start + 50/60/70/80% of its activation memory:

* memscale BALANCED with ``enable_offloading=False`` (the budget sweep's
  "memscale" row): the planner with selective checkpointing inside a
  layer, each layer at one of its levels (saved-op sets), besides
  checkpoints and segments;
* with ``--conservative``, memscale CONSERVATIVE too: whole-layer
  checkpointing and segments only (the planner without selective);
* the peers, measured once: torch.utils.checkpoint on every block, and
  torch's selective checkpointing on every block (save-matmuls policy).

Each row: the exact peak of a whole step (AdamW), whether it fits, the
step's FLOPs over the unoptimized step's (FlopCounterMode: forward,
backward, recompute, optimizer; deterministic) with the plan's prediction
of it (``1 + Plan.recompute_ratio / 3``), the plan's predicted peak
and what it chose (selective layers per level), and wrap's wall time.  No
time ratios: FLOPs are the judge here.  After the table, one line per
budget: for each peer that fits it, whether memscale fits and recomputes
no more FLOPs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any

import torch

import memscale
from memscale._format import format_bytes
from memscale.benchmarks.runner import lookup, selective_context, step_flops
from memscale.benchmarks.sweep import _measure, _prepared
from memscale.config import GIB

FRACTIONS = (0.5, 0.6, 0.7, 0.8)
BALANCED = "memscale BALANCED, no offload"


def _summary(plan: Any) -> str:
    counts = plan.technique_counts
    segs: dict[int, int] = {}
    for layer in plan.layers:
        if layer.segment >= 0:
            segs[layer.segment] = segs.get(layer.segment, 0) + 1
    lengths = ",".join(str(n) for n in sorted(segs.values(), reverse=True))
    levels = sorted(
        layer.selective_level for layer in plan.layers if "selective" in layer.techniques
    )
    at = " (levels " + ",".join(str(k) for k in levels) + ")" if levels else ""
    return (
        f"{counts['selective']} selective{at}, {counts['checkpoint']} checkpointed "
        f"in {len(segs)} segments [{lengths}], "
        f"{sum(1 for layer in plan.layers if not layer.techniques)} kept"
    )


def run(
    name: str, log: Any, fractions: tuple[float, ...] = FRACTIONS, conservative: bool = False
) -> dict[str, Any]:
    entry = lookup(name)
    base_model, base_batch, base_step, (_, base_opt) = _prepared(entry, lambda m, b: None)
    base = _measure(base_step, base_model, base_batch, base_opt)
    base_flops = step_flops(base_step)
    start, activations = base.start_bytes, base.peak_delta_bytes
    del base_model, base_batch, base_step, base_opt
    log(f"{name}: unoptimized peak {format_bytes(base.peak_bytes)}")
    rows: list[dict[str, Any]] = []
    peers = {
        "checkpoint every block": lambda m, b: m.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        ),
        "selective every block": lambda m, b: m.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": selective_context}
        ),
    }
    for method, setup in peers.items():
        model, batch, step, (_, opt) = _prepared(entry, setup)
        report = _measure(step, model, batch, opt)
        rows.append(
            {
                "method": method,
                "fraction": None,
                "budget_bytes": None,
                "peak_bytes": report.peak_bytes,
                "flops_ratio": step_flops(step) / base_flops,
            }
        )
        log(f"{name}: {method}: {format_bytes(report.peak_bytes)}")
        del model, batch, step, opt
    variants: dict[str, dict[str, Any]] = {BALANCED: dict(mode="balanced", enable_offloading=False)}
    if conservative:
        variants["memscale CONSERVATIVE (no selective)"] = dict(mode="conservative")
    for fraction in fractions:
        budget = start + int(fraction * activations)
        for method, kw in variants.items():
            config = memscale.Config(memory_budget_gb=budget / GIB, enable_logging=False, **kw)
            took: dict[str, float] = {}

            def setup(m: Any, b: Any, config: Any = config, took: Any = took) -> Any:
                t = time.perf_counter()
                try:
                    memscale.wrap(m, config, sample_input=b.sample_input)
                except memscale.MemoryBudgetError as exc:
                    return exc
                finally:
                    took["wrap_s"] = time.perf_counter() - t
                return m._memscale_executor.plan

            model, batch, step, (plan, opt) = _prepared(entry, setup)
            row: dict[str, Any] = {
                "method": method,
                "fraction": fraction,
                "budget_bytes": budget,
                "wrap_s": round(took["wrap_s"], 1),
            }
            if isinstance(plan, memscale.MemoryBudgetError):
                row.update(peak_bytes=None, min_budget_bytes=plan.min_budget_bytes)
            else:
                report = _measure(step, model, batch, opt)
                row.update(
                    peak_bytes=report.peak_bytes,
                    fits=report.peak_bytes <= budget,
                    flops_ratio=step_flops(step) / base_flops,
                    predicted_peak_bytes=plan.peak_projected_bytes,
                    predicted_flops_ratio=1.0 + plan.recompute_ratio / 3.0,
                    plan=_summary(plan),
                )
                memscale.detach(model)
            rows.append(row)
            log(f"{name}: {fraction:.0%} {method}: {row}")
            del model, batch, step, opt
    return {
        "model": name,
        "start_bytes": start,
        "activation_bytes": activations,
        "unoptimized_peak_bytes": base.peak_bytes,
        "rows": rows,
    }


def table(results: list[dict[str, Any]]) -> str:
    out = [
        "| model | budget (% of activations) | method | measured peak | fits | FLOPs ratio "
        "| predicted peak | plan | wrap |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for res in results:
        for r in res["rows"]:
            budget = (
                f"{format_bytes(r['budget_bytes'])} ({r['fraction']:.0%})"
                if r["budget_bytes"]
                else "(no budget)"
            )
            if r["peak_bytes"] is None:
                peak = f"no plan (least {format_bytes(r['min_budget_bytes'])})"
            else:
                peak = format_bytes(r["peak_bytes"])
            fits = {True: "yes", False: "no", None: "-"}[r.get("fits")]
            fl = f"{r['flops_ratio']:.3f}x" if r.get("flops_ratio") else "-"
            if r.get("predicted_flops_ratio"):
                fl += f" (pred {r['predicted_flops_ratio']:.3f}x)"
            pp = format_bytes(r["predicted_peak_bytes"]) if r.get("predicted_peak_bytes") else "-"
            wrap = f"{r['wrap_s']} s" if "wrap_s" in r else "-"
            out.append(
                f"| {res['model']} | {budget} | {r['method']} | {peak} | {fits} | {fl} "
                f"| {pp} | {r.get('plan') or ''} | {wrap} |"
            )
    return "\n".join(out)


def verdicts(results: list[dict[str, Any]]) -> str:
    """Per model and budget: for each peer whose peak fits the budget,
    whether memscale's plan fits it too and recomputes no more FLOPs."""
    out = []
    for res in results:
        peers = [r for r in res["rows"] if r["budget_bytes"] is None]
        for r in res["rows"]:
            if r["method"] != BALANCED:
                continue
            for peer in peers:
                if peer["peak_bytes"] > r["budget_bytes"]:
                    continue
                fits = bool(r.get("fits"))
                ok = fits and r["flops_ratio"] <= peer["flops_ratio"] + 1e-9
                mine = f"{r['flops_ratio']:.4f}x" if fits else "does not fit"
                out.append(
                    f"{res['model']} {r['fraction']:.0%}: {peer['method']} fits "
                    f"({peer['flops_ratio']:.4f}x); memscale {mine}: "
                    f"{'ok' if ok else 'BEHIND'}"
                )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--models", default="gpt2-12l,llama-12l")
    ap.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    ap.add_argument("--conservative", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    fractions = tuple(float(f) for f in args.fractions.split(","))
    results = [run(name, log, fractions, args.conservative) for name in args.models.split(",")]
    text = table(results) + "\n\n" + verdicts(results)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": "OMP_NUM_THREADS=1 python scripts/selective_bench.py "
                    f"--json {args.json}"
                    + (f" --models {args.models}" if args.models != "gpt2-12l,llama-12l" else "")
                    + (f" --fractions {args.fractions}" if fractions != FRACTIONS else "")
                    + (" --conservative" if args.conservative else ""),
                    "machine": f"{platform.machine()} {platform.system()}, "
                    f"Python {platform.python_version()}, torch {torch.__version__}",
                    "date": time.strftime("%Y-%m-%d"),
                    "results": results,
                    "table": text,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
