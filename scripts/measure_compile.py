"""memscale under torch.compile, measured on the 12-layer benchmark models.

For each model (default: gpt2-12l and llama-12l, ``memscale/benchmarks/models.py``)
and each variant (``memscale/benchmarks/runner.py``: the eager ones and
their ``torch.compile`` counterparts, inductor on CPU):

* agreement with the compiled unwrapped model (``unoptimized-compiled``):
  loss and every gradient after one forward/backward from the same weights,
  batch and seed, as the largest relative difference (``max|g - g_ref| /
  max|g_ref|`` over the tensors);
* compile time: the first training step's wall time (dynamo, AOT autograd,
  inductor), and the graphs and graph breaks dynamo reports for it
  (``torch._dynamo.utils.counters``);
* the peak of a steady training step (forward, loss, backward, AdamW step)
  from the c10 allocator's events (``torch.profiler`` with
  ``profile_memory=True``, ``memscale._measure.measure_peak``): compiled
  kernels allocate through the same allocator, outside the dispatcher;
* step time: every variant alive, timed round-robin, the median of
  ``--repeats`` steps each and its ratio to the eager unoptimized model.

Usage::

    OMP_NUM_THREADS=1 python scripts/measure_compile.py \\
        --out benchmarks/compile-12l.json

Each variant is built and compiled once and kept for the timing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Compile times from scratch: no graph or kernel cached on disk by an
# earlier variant or run.
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402
import torch._dynamo.utils as dynamo_utils  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import memscale  # noqa: E402
from memscale._measure import measure_peak  # noqa: E402
from memscale.benchmarks.models import BENCHMARK_MODELS  # noqa: E402
from memscale.benchmarks.runner import prepare  # noqa: E402

VARIANTS = (
    "unoptimized",
    "conservative",
    "torch-checkpoint",
    "unoptimized-compiled",
    "conservative-compiled",
    "torch-checkpoint-compiled",
    "compile-memory-budget",
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale else diff


def _grads(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _counts() -> tuple[int, int]:
    graphs = int(dynamo_utils.counters["stats"]["unique_graphs"])
    breaks = int(sum(dynamo_utils.counters["graph_break"].values()))
    return graphs, breaks


def measure(model_name: str, variants: list[str], repeats: int, save: Any = None) -> dict[str, Any]:
    entry = BENCHMARK_MODELS[model_name]
    rows: dict[str, dict[str, Any]] = {}
    ref: tuple[float, list[torch.Tensor | None]] | None = None
    live: dict[str, Any] = {}
    for name in variants:
        print(f"{model_name}: {name}", flush=True)
        dynamo_utils.counters.clear()
        prepared = prepare(entry, name)
        start = time.perf_counter()
        loss = prepared.forward_backward(seed=1234).item()
        first = time.perf_counter() - start
        graphs, breaks = _counts()
        grads = _grads(prepared.model)
        row: dict[str, Any] = {
            "first_step_s": first,
            "graphs": graphs if prepared.compiled else None,
            "graph_breaks": breaks if prepared.compiled else None,
            "loss": loss,
            "plan_hash": prepared.plan_hash,
        }
        executor = getattr(prepared.model, "_memscale_executor", None)
        if executor is not None:
            row["compile_fallbacks"] = [f._asdict() for f in executor.compile_fallbacks]
        if name == "unoptimized-compiled":
            ref = (loss, grads)
        rows[name] = row
        row["_grads"] = grads
        report = measure_peak(
            prepared.step,
            model=prepared.model,
            inputs=(prepared.batch.args, prepared.batch.kwargs, prepared.optimizer.state),
            warmup=1,
        )
        row["peak_bytes"] = report.peak_bytes
        if save is not None:  # what is measured so far, in case a later variant fails
            save(
                {
                    "model": model_name,
                    "partial": True,
                    "variants": {
                        k: {x: y for x, y in v.items() if x != "_grads"} for k, v in rows.items()
                    },
                }
            )
        print(f"  {json.dumps({k: v for k, v in row.items() if k != '_grads'})}", flush=True)
        live[name] = prepared  # timed below, compiled once
    for row in rows.values():
        grads = row.pop("_grads")
        if ref is not None:
            rel = [_rel(g, r) for g, r in zip(grads, ref[1]) if g is not None and r is not None]
            row["loss_rel_diff_vs_compiled"] = abs(row["loss"] - ref[0]) / abs(ref[0])
            row["grad_max_rel_diff_vs_compiled"] = max(rel) if rel else None

    # Step time: all alive, round-robin, after two untimed steps each.
    print(f"{model_name}: step time", flush=True)
    for _ in range(2):
        for prepared in live.values():
            prepared.step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, prepared in live.items():
            start = time.perf_counter()
            prepared.step()
            times[name].append(time.perf_counter() - start)
    for prepared in live.values():
        prepared.close()
    del live, prepared
    gc.collect()
    torch._dynamo.reset()
    base = "unoptimized" if "unoptimized" in times else variants[0]
    for name in variants:
        ratios = [t / b for t, b in zip(times[name], times[base])]
        rows[name]["step_median_s"] = statistics.median(times[name])
        rows[name]["time_ratio"] = statistics.median(ratios)
        rows[name]["time_ratio_spread"] = (min(ratios), max(ratios))
    return {"model": model_name, "description": entry.description, "variants": rows}


def table(results: dict[str, Any]) -> str:
    """The results as a Markdown table (what docs/compile.md shows)."""
    lines = [
        "| model | variant | first step (compile) | graphs / breaks | peak "
        "| loss, grads vs compiled unwrapped (rel.) | step | time ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model in results["models"]:
        for name, row in model["variants"].items():
            graphs = (
                "-" if row.get("graphs") is None else f"{row['graphs']} / {row['graph_breaks']}"
            )
            agree = (
                f"{row['loss_rel_diff_vs_compiled']:.1g}, {row['grad_max_rel_diff_vs_compiled']:.1g}"
                if "loss_rel_diff_vs_compiled" in row and row.get("graphs") is not None
                else "-"  # eager: dropout draws other random numbers than compiled code
            )
            timing = (
                (
                    f"{row['step_median_s']:.1f} s",
                    f"{row['time_ratio']:.2f}x ({row['time_ratio_spread'][0]:.2f}-"
                    f"{row['time_ratio_spread'][1]:.2f})",
                )
                if "step_median_s" in row
                else ("-", "-")
            )
            lines.append(
                f"| {model['model']} | {name} | {row['first_step_s']:.0f} s | {graphs} "
                f"| {row['peak_bytes'] / 2**20:.1f} MiB | {agree} | {timing[0]} | {timing[1]} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2-12l", "llama-12l"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--table", nargs="+", type=Path, metavar="JSON", help="print these results as a table"
    )
    args = parser.parse_args()
    if args.table:
        for path in args.table:
            print(table(json.loads(path.read_text())))
        return
    torch.manual_seed(0)
    results = {
        "command": "OMP_NUM_THREADS=1 python scripts/measure_compile.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, Python {platform.python_version()}, "
        f"torch {torch.__version__}, memscale {memscale.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "peak": "allocator events of a steady training step (torch.profiler, profile_memory=True)",
        "models": [],
    }

    def save(partial: dict[str, Any] | None = None) -> str:
        models = results["models"] + ([partial] if partial is not None else [])
        text = json.dumps({**results, "models": models}, indent=2)
        if args.out is not None:
            args.out.write_text(text + "\n")
        return text

    for name in args.models:
        results["models"].append(measure(name, args.variants, args.repeats, save))
        save()
    print(save())


if __name__ == "__main__":
    main()
