"""The modes in order: the exact peak of a training step under each mode.

For each benchmark model, the unoptimized step is measured first (its exact
peak and the bytes it starts from: parameters, gradients, AdamW state,
batch; the difference is its activation memory A).  Then each mode,
CONSERVATIVE, BALANCED and AGGRESSIVE, is measured wrapped with
``force_optimize=True`` and, with ``--budget F``, under a budget of
start + F x A.  Every figure is the exact peak of one step (zero_grad,
forward, loss, backward, AdamW step) after a warm-up step
(``memscale._measure.measure_peak``), with the plan's techniques and the
largest gradient difference from the unoptimized model after one
forward/backward from the same weights and batch (0 is bit for bit).

    .venv/bin/python scripts/mode_order.py                    # quick models
    .venv/bin/python scripts/mode_order.py --models gpt2-12l llama-12l bert-12l
    .venv/bin/python scripts/mode_order.py --models gpt2-12l --no-dropout

``--no-dropout`` sets every dropout probability of the model to 0 (the
benchmark's GPT-2 and BERT have dropout 0.1, which keeps their blocks from
being tiled), so AGGRESSIVE may tile.  The "in order" row says whether the
modes are in order: forced, AGGRESSIVE <= BALANCED <= CONSERVATIVE in
measured peak; under a budget, every mode's measured peak within the
budget and a heavier mode's predicted slowdown no higher than a lighter
one's (the planner may spend memory, within the budget, to recompute
less).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import warnings
from typing import Any

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import memscale  # noqa: E402
from memscale._format import format_bytes  # noqa: E402
from memscale._measure import measure_peak  # noqa: E402
from memscale.benchmarks.models import BENCHMARK_MODELS, Batch, BenchmarkModel  # noqa: E402
from memscale.config import GIB  # noqa: E402

MODES = ("conservative", "balanced", "aggressive")
QUICK = [name for name, m in BENCHMARK_MODELS.items() if m.size == "quick"]


def build(entry: BenchmarkModel, no_dropout: bool) -> tuple[nn.Module, Batch]:
    model, batch = entry.build(seed=0)
    if no_dropout:
        for m in model.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                m.p = 0.0
        cfg = getattr(model, "config", None)
        for name in ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob"):
            if cfg is not None and hasattr(cfg, name):
                setattr(cfg, name, 0.0)
    return model, batch


def grads(model: nn.Module, batch: Batch) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    batch.loss_fn(model(*batch.args, **batch.kwargs)).backward()
    out = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out


def measure(
    entry: BenchmarkModel, no_dropout: bool, config: memscale.Config | None, ref: list | None
) -> dict[str, Any]:
    model, batch = build(entry, no_dropout)
    plan = None
    if config is not None:
        try:
            memscale.wrap(model, config, sample_input=batch.sample_input, loss_fn=batch.loss_fn)
        except memscale.MemoryBudgetError as exc:
            return {"peak": None, "plan": f"no plan (least {format_bytes(exc.min_budget_bytes)})"}
        plan = model._memscale_executor.plan  # type: ignore[union-attr]
    model.train()
    diff = None
    if ref is not None:
        mine = grads(model, batch)
        diff = max(float((a - b).abs().max()) for a, b in zip(mine, ref))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        batch.loss_fn(model(*batch.args, **batch.kwargs)).backward()
        optimizer.step()

    step()
    report = measure_peak(
        step, model=model, inputs=(batch.args, batch.kwargs, optimizer.state), warmup=1
    )
    result: dict[str, Any] = {"peak": report.peak_bytes, "report": report, "diff": diff}
    if plan is not None:
        counts = {k: v for k, v in plan.technique_counts.items() if v}
        tiles = [layer.tiles for layer in plan.layers if layer.tiles > 1]
        result["plan"] = ", ".join(f"{k} {v}" for k, v in counts.items()) or "nothing"
        if tiles:
            result["plan"] += f" (tiles {tiles})"
        result["predicted"] = plan.peak_projected_bytes
        result["slowdown"] = plan.predicted_slowdown
        result["plan"] += f"; predicted slowdown {plan.predicted_slowdown:.3f}"
        memscale.detach(model)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=QUICK, choices=sorted(BENCHMARK_MODELS))
    ap.add_argument(
        "--budget",
        type=float,
        nargs="*",
        default=[0.5],
        help="budgets as shares of the activation memory (none: forced only)",
    )
    ap.add_argument("--no-dropout", action="store_true")
    args = ap.parse_args(argv)
    logging.getLogger("memscale").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    print("| model | setting | mode | measured peak | plan | largest gradient difference |")
    print("| --- | --- | --- | --- | --- | --- |")
    bad = 0
    for name in args.models:
        entry = BENCHMARK_MODELS[name]
        model, batch = build(entry, args.no_dropout)
        ref = grads(model, batch)
        del model, batch
        base = measure(entry, args.no_dropout, None, None)
        report = base["report"]
        label = name + (" (dropout 0)" if args.no_dropout else "")
        print(
            f"| {label} | - | unoptimized | {format_bytes(base['peak'])} ({base['peak']:,} B) | - | - |",
            flush=True,
        )
        settings: list[tuple[str, dict[str, Any]]] = [("force_optimize", {"force_optimize": True})]
        for share in args.budget:
            budget = report.start_bytes + int(share * report.peak_delta_bytes)
            settings.append(
                (
                    f"budget {format_bytes(budget)} ({share:.0%} of activations)",
                    {"memory_budget_gb": budget / GIB},
                )
            )
        for setting, kwargs in settings:
            peaks = []
            slowdowns = []
            budget_bytes = kwargs.get("memory_budget_gb")
            for mode in MODES:
                config = memscale.Config(mode=mode, enable_logging=False, **kwargs)
                r = measure(entry, args.no_dropout, config, ref)
                peaks.append(r["peak"])
                slowdowns.append(r.get("slowdown"))
                peak = "-" if r["peak"] is None else f"{format_bytes(r['peak'])} ({r['peak']:,} B)"
                diff = "-" if r.get("diff") is None else f"{r['diff']:.2g}"
                print(
                    f"| {label} | {setting} | {mode} | {peak} | {r['plan']} | {diff} |", flush=True
                )
            known = [p for p in peaks if p is not None]
            if budget_bytes is None:
                # Forced: a heavier mode's peak is no higher.
                ordered = all(a >= b for a, b in itertools.pairwise(known))
            else:
                # Under a budget: every mode fits it, and a heavier mode
                # (every choice of a lighter one, and more) pays no more
                # recompute; its peak may be higher while it fits.
                limit = int(budget_bytes * GIB)
                paid = [x for x in slowdowns if x is not None]
                ordered = (
                    len(known) == len(MODES)
                    and all(p <= limit for p in known)
                    and all(a + 1e-9 >= b for a, b in itertools.pairwise(paid))
                )
            bad += not ordered
            print(
                f"| {label} | {setting} | in order | {'yes' if ordered else 'NO'} | | |", flush=True
            )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
