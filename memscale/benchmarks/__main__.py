"""python -m memscale.benchmarks: the reproducible benchmark suite.

Quick by default (small models, a few minutes on a laptop CPU); ``--full``
runs the published reference sizes this machine has memory for.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import traceback
import warnings
from typing import Any

import torch

import memscale
from memscale import _hardware

from .._format import format_bytes
from .models import select
from .runner import (
    DEFAULT_VARIANTS,
    RSS_ENV,
    VARIANT_HELP,
    VARIANTS,
    VariantResult,
    rss_env,
    run_model,
)

# Peak RSS over peak live tensor bytes assumed when deciding whether a full
# row fits (GPT-2 Medium 4x512 measured 17.4 GiB over 15.26 GiB: 1.14).
RSS_OVER_PEAK = 1.2


def machine(device: torch.device | None = None) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover
        tf_version = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_bytes": _hardware.detect("cpu").capacity_bytes,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "transformers": tf_version,
        "memscale": memscale.__version__,
        "platform": platform.platform(),
        **(_accelerator(device) if device is not None and device.type != "cpu" else {}),
    }


def _accelerator(device: torch.device) -> dict[str, Any]:
    """The device the suite ran on, when it is not the host CPU."""
    hardware = _hardware.detect(device.type, device.index or 0)
    return {
        "device": str(device),
        "device_name": hardware.name,
        "device_capacity_bytes": hardware.capacity_bytes,
        "cuda": torch.version.cuda,
    }


def check_device(name: str) -> torch.device:
    """The ``--device`` the suite can run on here; ``ValueError`` saying
    why not otherwise."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {name}: no CUDA device here (torch.cuda.is_available() is "
            f"False; torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda or 'none'})"
        )
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(
            f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return device


def _ratio(r: VariantResult) -> str:
    low, high = r.time_ratio_spread
    return f"{r.time_ratio:.2f}x ({low:.2f}-{high:.2f})"


def _flops(r: VariantResult) -> str:
    if r.recompute_overhead is None:
        return "-"  # compiled: its kernels are not seen by FlopCounterMode
    text = f"{r.recompute_overhead:.3f}x"
    if r.predicted_recompute_overhead is not None:
        text += f" (pred {r.predicted_recompute_overhead:.3f}x)"
    return text


def row_line(r: VariantResult, base: VariantResult) -> str:
    """One finished row, for a log (stdout not a terminal)."""
    return (
        f"{r.model} {r.variant}: peak {format_bytes(r.peak_bytes)} "
        f"({r.peak_bytes / base.peak_bytes:.0%} of unoptimized), FLOPs "
        f"{_flops(r)}, time ratio {_ratio(r)}, loss diff {r.loss_abs_diff:.2g}, grad diff "
        f"{r.grad_max_abs_diff:.2g}"
        + ("" if r.wrap_cpu_seconds is None else f", wrap {r.wrap_cpu_seconds:.2f} CPU-s")
    )


def _wrap_cpu(r: VariantResult) -> str:
    return "-" if r.wrap_cpu_seconds is None else f"{r.wrap_cpu_seconds:.2f}"


def table(results: list[VariantResult]) -> str:
    head = (
        "model",
        "variant",
        "peak",
        "reduction",
        "RSS peak",
        "FLOPs ratio",
        "time ratio",
        "loss diff",
        "grad diff",
        "wrap CPU-s",
    )
    rows = [head]
    base: dict[str, VariantResult] = {}
    for r in results:
        if r.variant == "unoptimized":
            base[r.model] = r
        b = base[r.model]
        reduction = 1 - r.peak_bytes / b.peak_bytes
        rows.append(
            (
                r.model,
                r.variant,
                format_bytes(r.peak_bytes),
                "-" if r is b else f"{reduction:+.1%}".replace("+", ""),
                "-" if r.rss_peak_bytes is None else format_bytes(r.rss_peak_bytes),
                _flops(r),
                _ratio(r),
                f"{r.loss_abs_diff:.2g}",
                f"{r.grad_max_abs_diff:.2g}",
                _wrap_cpu(r),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(results: list[VariantResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    base = {r.model: r for r in results if r.variant == "unoptimized"}
    models = list(base)
    # A marker per variant and a colour per model; models in the legend as
    # colour patches (no marker of their own).  Points are half transparent,
    # larger variants drawn first, so one that lies on another shows through.
    markers = dict(zip(VARIANTS, "o^sDvPXh<>*p"))
    sizes = {v: 150 - 12 * i for i, v in enumerate(VARIANTS)}
    # Left: the exact judge (FLOPs); right: the noisy one (time).
    fig, (by_flops, by_time) = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for r in sorted(results, key=lambda r: -sizes.get(r.variant, 50)):
        color = colors[models.index(r.model) % len(colors)]
        y = 100 * r.peak_bytes / base[r.model].peak_bytes
        low, high = r.time_ratio_spread
        by_time.errorbar(
            r.time_ratio,
            y,
            xerr=[[r.time_ratio - low], [high - r.time_ratio]],
            fmt="none",
            ecolor=color,
            alpha=0.5,
            linewidth=1,
        )
        style = {
            "marker": markers.get(r.variant, "x"),
            "color": color,
            "s": sizes.get(r.variant, 50),
            "alpha": 0.6,
            "edgecolors": "black",
            "linewidths": 0.5,
        }
        by_time.scatter(r.time_ratio, y, **style)
        if r.recompute_overhead is not None:
            by_flops.scatter(r.recompute_overhead, y, **style)
    handles: list[Artist] = [
        Patch(color=colors[i % len(colors)], label=name) for i, name in enumerate(models)
    ]
    handles += [
        Line2D(
            [],
            [],
            linestyle="none",
            marker=marker,
            color="gray",
            markeredgecolor="black",
            label=variant,
        )
        for variant, marker in markers.items()
        if any(r.variant == variant for r in results)
    ]
    by_flops.set_xlabel("step FLOPs / unoptimized step FLOPs (FlopCounterMode; exact)")
    by_flops.set_ylabel("peak training-step memory, % of unoptimized")
    by_flops.set_title("memory against recompute (lower left is better)")
    by_time.set_xlabel("step time / unoptimized step time (median; bars: least to greatest round)")
    by_time.set_title("memory against slowdown (noisy on a shared machine)")
    for ax in (by_flops, by_time):
        ax.grid(alpha=0.3)
    by_time.legend(handles=handles, fontsize=8, ncol=2, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m memscale.benchmarks",
        description="memscale benchmark suite: peak training-step memory, "
        "step-time ratio and agreement, against the unoptimized "
        "model and torch's own checkpointing.",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="run the published reference sizes (where this "
        "machine has the memory) instead of the quick ones",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        metavar="NAME",
        help="benchmark models to run (default: every quick, or every full, one)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        metavar="NAME",
        choices=VARIANTS,
        default=list(DEFAULT_VARIANTS),
        help="variants to run (default: all but the compiled ones): "
        + ", ".join(f"{k} ({v})" for k, v in VARIANT_HELP.items()),
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed steps per variant (median reported)"
    )
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    parser.add_argument(
        "--device",
        default="cpu",
        metavar="DEVICE",
        choices=["cpu", "cuda"] + [f"cuda:{i}" for i in range(16)],
        help="where to train: cpu (default; the peak is the exact live tensor "
        "bytes) or cuda (the peak is the device's own, "
        "torch.cuda.max_memory_allocated after reset_peak_memory_stats; no RSS)",
    )
    parser.add_argument("--json", metavar="PATH", help="write every raw figure here")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG of memory "
        "against time ratio here (default with --json: the JSON "
        "path with .png; needs matplotlib, the [bench] extra)",
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="when a model fails, say so and go on with the next one (exit status 1 at the end)",
    )
    parser.add_argument(
        "--no-plot",
        action="store_true",
        help="write no PNG beside --json (for a machine without matplotlib)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="the budget sweep instead: budgets at 20 to 80%% of "
        "the unoptimized activation memory, memscale's budget "
        "planner against checkpointing every block, selective "
        "checkpointing every block, sqrt(n) segments and torch.compile's "
        "min-cut partition under activation_memory_budget (default models: "
        "gpt2-12l, llama-12l and bert-12l); a summary of every claim it "
        "checks follows the table",
    )
    parser.add_argument(
        "--sweep-inductor",
        metavar="FRACTIONS",
        default="",
        help="with --sweep: also compile with inductor's kernels at these "
        "budget fractions (comma-separated, of 0.2..0.8, e.g. 0.5); each "
        "compile takes minutes on a small CPU",
    )
    parser.add_argument(
        "--sweep-fractions",
        metavar="FRACTIONS",
        default="",
        help="with --sweep: only these budget fractions (comma-separated, of "
        "0.2..0.8, e.g. 0.3,0.5; default: all seven)",
    )
    parser.add_argument(
        "--sweep-no-compile",
        action="store_true",
        help="with --sweep: leave out the compile min-cut peer",
    )
    parser.add_argument(
        "--sweep-check",
        metavar="JSON",
        nargs="+",
        help="print the table and summary of one or more sweeps' --json files "
        "(recomputed from their rows; several files: one run per model, "
        "joined) instead of running anything; with --json and --plot, write "
        "the joined figures and their plot; exit status 1 if the summary "
        "lists a violation",
    )
    args = parser.parse_args(argv)
    if args.sweep_check:
        return _sweep_check(args.sweep_check, args, parser)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    try:
        device = check_device(args.device)
    except ValueError as exc:
        parser.error(str(exc))
    if device.type != "cpu":
        args.no_rss = True  # host RSS says nothing of device memory
    if args.no_plot and args.plot:
        parser.error("--plot and --no-plot: choose one")
    if args.json and not args.plot and not args.no_plot:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    # Say so now, not after a run of many minutes.
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not os.path.isdir(folder):
            parser.error(f"{flag} {path}: the folder {folder} does not exist; create it first")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(
                "--plot (and --json, which writes a PNG beside it) needs "
                "matplotlib: pip install -e '.[bench]'"
            )

    warnings.filterwarnings("ignore", module="transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.sweep:
        return _sweep_main(args, parser)
    try:
        entries = select(args.models, args.full)
    except ValueError as exc:
        parser.error(str(exc))

    ram = _hardware.detect(device.type, device.index or 0).capacity_bytes
    results: list[VariantResult] = []
    skipped: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    from tqdm import tqdm

    bar = tqdm(entries, unit="model", disable=not sys.stderr.isatty(), file=sys.stderr)
    for entry in bar:
        reason = None
        if entry.size == "full":
            need = entry.estimated_training_bytes()
            if need > 0.6 * ram:
                reason = (
                    f"needs at least {format_bytes(need)} for weights, "
                    f"gradients and Adam state; this machine has "
                    f"{format_bytes(ram)}"
                )
            else:
                # The process holds more than the live tensors (allocator,
                # libraries, the profiler's records): GPT-2 Medium's RSS was
                # 1.14x its peak, and GPT-2 Large, at 18.7 GiB predicted, was
                # OOM-killed on a 23.5 GiB machine.
                predicted = entry.predicted_peak_bytes()
                if predicted * RSS_OVER_PEAK > 0.9 * ram:
                    reason = (
                        f"its unoptimized step is predicted to peak at "
                        f"{format_bytes(predicted)} of live tensors "
                        f"(memscale.predict_peak); with the process around "
                        f"them (x{RSS_OVER_PEAK}) that is more than 90% of "
                        f"this machine's {format_bytes(ram)}"
                    )
        if reason is not None:
            skipped.append({"model": entry.name, "reason": reason})
            print(f"skipping {entry.name}: {reason}", file=sys.stderr)
            continue
        try:
            rows = run_model(
                entry,
                args.variants,
                repeats=args.repeats,
                rss=not args.no_rss,
                progress=lambda m: bar.set_description(m),
                device=device,
            )
        except Exception as exc:
            if not args.keep_going:
                raise
            failed.append({"model": entry.name, "error": f"{type(exc).__name__}: {exc}"})
            print(f"FAILED {entry.name}: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
            continue
        results.extend(rows)
        if bar.disable:  # no terminal: a line per finished row instead of the bar
            for r in rows:
                print(row_line(r, rows[0]), flush=True)

    print(table(results))
    for r in results:
        if r.offload and "bytes_to_host" in r.offload:
            print(
                f"offload {r.model} {r.variant}: "
                f"{format_bytes(r.offload['bytes_to_host'])} per step to host memory, "
                f"{format_bytes(r.offload['bytes_written'])} on to disk"
            )
        elif r.offload:
            o = r.offload
            print(
                f"offload {r.model} {r.variant}: {format_bytes(o['bytes_written'])} "
                f"per step to disk; I/O {o['io_seconds'] * 1e3:.1f} ms, training "
                f"thread waited {o['wait_seconds'] * 1e3:.1f} ms"
            )
    for s in skipped:
        print(f"skipped {s['model']}: {s['reason']}")
    if device.type != "cpu":
        print(
            f"\npeak: {device}'s own, torch.cuda.max_memory_allocated during one "
            "training step (after one warm-up step and reset_peak_memory_stats): "
            "every tensor there and the libraries' workspaces, in the allocator's "
            "512-byte blocks; time ratio: median step time (the device synchronized "
            f"after each step) over the unoptimized median ({args.repeats} steps per "
            "variant), in brackets the least and greatest ratio of one round."
        )
    else:
        print(
            "\npeak: live tensor bytes at the highest point of a training step "
            "(allocator events, exact); RSS: peak resident memory of a fresh "
            "process training the variant (glibc MALLOC_MMAP_THRESHOLD_=65536 "
            "unless set: freed tensors go back to the system); time ratio: median step time over "
            f"the unoptimized median ({args.repeats} steps per variant, all "
            "variants of a model timed round-robin in one process when they "
            "fit in memory together), in brackets the least and greatest ratio "
            "of one round."
        )
    if args.json:
        payload = {
            "schema": "memscale-benchmarks/1",
            "machine": machine(device),
            "settings": {
                "device": str(device),
                "full": args.full,
                "repeats": args.repeats,
                "variants": args.variants,
                "rss": not args.no_rss,
                "rss_env": {k: v for k, v in rss_env().items() if k in RSS_ENV},
            },
            "variants": VARIANT_HELP,
            "results": [r.to_dict() for r in results],
            "skipped": skipped,
            **({"failed": failed} if failed else {}),
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1)
    if args.plot and results:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    for failure in failed:
        print(f"failed {failure['model']}: {failure['error']}")
    return 1 if failed else 0


def _sweep_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import sweep

    names = args.models or list(sweep.SWEEP_MODELS)
    try:
        entries = select(names, False)
    except ValueError as exc:
        parser.error(str(exc))

    def fractions(flag: str, text: str) -> tuple[float, ...]:
        try:
            chosen = tuple(float(x) for x in text.split(",") if x.strip())
        except ValueError:
            parser.error(f"{flag} {text!r}: give fractions like 0.5,0.8")
        for x in chosen:
            if not any(math.isclose(x, g) for g in sweep.FRACTIONS):
                parser.error(
                    f"{flag} {x:g}: not a sweep budget; choose from "
                    + ", ".join(f"{g:g}" for g in sweep.FRACTIONS)
                )
        return chosen

    inductor = fractions("--sweep-inductor", args.sweep_inductor)
    budgets = tuple(sorted(set(fractions("--sweep-fractions", args.sweep_fractions)))) or (
        sweep.FRACTIONS
    )
    for x in inductor:
        if not any(math.isclose(x, b) for b in budgets):
            parser.error(f"--sweep-inductor {x:g}: not among --sweep-fractions")
    if not args.sweep_no_compile or inductor:
        from .runner import compile_budget_unavailable

        reason = compile_budget_unavailable()
        if reason is not None:
            print(f"the compile min-cut peer is skipped: {reason}", file=sys.stderr)
    from tqdm import tqdm

    bar = tqdm(entries, unit="model", disable=not sys.stderr.isatty(), file=sys.stderr)

    def progress(message: str) -> None:
        if bar.disable:  # no terminal: a line per step of the sweep instead
            print(message, file=sys.stderr, flush=True)
        else:
            bar.set_description(message)

    results = [
        sweep.run_sweep(
            e,
            repeats=args.repeats,
            progress=progress,
            compile_peer=not args.sweep_no_compile,
            inductor_fractions=inductor,
            device=args.device,
            fractions=budgets,
        )
        for e in bar
    ]
    print(sweep.table(results))
    print("\n" + sweep.ROCKMATE)
    print("\n" + sweep.NOTES.format(repeats=args.repeats))
    print("\n" + sweep.summary_text(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "schema": "memscale-sweep/2",
                    "machine": machine(),
                    "settings": {
                        "repeats": args.repeats,
                        "compile_peer": not args.sweep_no_compile,
                        "inductor_fractions": list(inductor),
                        "fractions": list(budgets),
                        "device": args.device,
                    },
                    "notes": sweep.NOTES.format(repeats=args.repeats),
                    "rockmate": sweep.ROCKMATE,
                    "results": results,
                },
                f,
                indent=1,
            )
    if args.plot:
        sweep.plot(results, args.plot)
    return 0


def _sweep_check(
    paths: list[str], args: argparse.Namespace, parser: argparse.ArgumentParser
) -> int:
    from . import sweep

    payloads = []
    results: list[dict[str, Any]] = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                payload = json.load(f)
            found = payload["results"]
            for res in found:
                res["summary"] = sweep.summarize(res)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parser.error(
                f"--sweep-check {path}: not a sweep's --json file ({type(exc).__name__}: {exc})"
            )
        payloads.append(payload)
        results.extend(found)
    models = [res["model"] for res in results]
    repeated = sorted({m for m in models if models.count(m) > 1})
    if repeated:
        parser.error(f"--sweep-check: model(s) {', '.join(repeated)} in more than one file")
    if len(paths) > 1:
        print(sweep.table(results))
    print(sweep.summary_text(results))
    if args.json:
        first = payloads[0]
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    **{k: v for k, v in first.items() if k != "results"},
                    "joined_from": [
                        {"file": os.path.basename(p), "models": [r["model"] for r in q["results"]]}
                        for p, q in zip(paths, payloads)
                    ],
                    "results": results,
                },
                f,
                indent=1,
            )
    if args.plot:
        sweep.plot(results, args.plot)
    return 1 if any(res["summary"]["violations"] for res in results) else 0


if __name__ == "__main__":
    sys.exit(main())
