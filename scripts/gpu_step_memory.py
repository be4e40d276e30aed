"""Where a CUDA training step's memory goes, call by call: the device
allocator's count against the bytes of the tensors alive, beside memscale's
prediction of the same step (a diagnostic for the predictor, docs/gpu.md).

For each model it predicts one training step (``memscale.predict_peak``,
AdamW), then runs it for real (after a warm-up step) unwrapped and under
the CONSERVATIVE plan, under a dispatch mode that, around every operator
call (forward, backward on autograd's device thread, optimizer), reads
``torch.cuda.memory_allocated``, the allocator's peak inside the call, and
the bytes of the tensor storages alive (those the step starts with and
every one an operator returns, freed through weak references: what the
predictor's tracker counts).  Printed per step: the predicted and measured
peaks, the call at the allocator's peak and at the tensors' peak, the
allocator's bytes above the tensors' there, and the calls after which that
excess grew the most.

    python scripts/gpu_step_memory.py [--models gpt2-12l llama-12l] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import memscale  # noqa: E402
from memscale.benchmarks.models import BENCHMARK_MODELS  # noqa: E402

MIB = 1 << 20
DEV = torch.device("cuda")


class Watch(TorchDispatchMode):
    """Per operator call: (name, on the calling thread, allocator bytes
    before, the allocator's peak inside, after, tensor bytes after)."""

    def __init__(self, start_tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.known: dict[int, tuple[weakref.ref, int]] = {}
        self.live = 0
        self.rows: list[tuple[str, bool, int, int, int, int]] = []
        self.main = threading.get_ident()
        for t in start_tensors:
            self.track(t)
        self.start_live = self.live

    def track(self, t: torch.Tensor) -> None:
        if t.device.type != DEV.type:
            return
        st = t.untyped_storage()
        key = id(st)
        entry = self.known.get(key)
        if entry is not None and entry[0]() is st:
            return
        nbytes = st.nbytes()
        self.live += nbytes

        def freed(ref: weakref.ref, key: int = key, nbytes: int = nbytes) -> None:
            if self.known.get(key, (None,))[0] is ref:
                del self.known[key]
            self.live -= nbytes

        self.known[key] = (weakref.ref(st, freed), nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        inside = torch.cuda.max_memory_allocated()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        after = torch.cuda.memory_allocated()
        self.rows.append(
            (str(func), threading.get_ident() == self.main, before, inside, after, self.live)
        )
        return out


def _tensors(*objs: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(objs) if isinstance(t, torch.Tensor)]


def _watched_step(model, batch, optimizer) -> dict[str, Any]:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        batch.loss_fn(model(*batch.args, **batch.kwargs)).backward()
        optimizer.step()

    step()
    step()
    gc.collect()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    # (The lists are not kept: zero_grad must free the gradients.)
    watch = Watch(
        [*model.parameters()]
        + [p.grad for p in model.parameters() if p.grad is not None]
        + _tensors(dict(optimizer.state), batch.args, batch.kwargs)
    )
    torch.cuda.reset_peak_memory_stats()
    with watch:
        step()
    torch.cuda.synchronize()
    rows = watch.rows
    peak_at = max(range(len(rows)), key=lambda i: rows[i][3])
    live_at = max(range(len(rows)), key=lambda i: rows[i][5])
    excess = [r[4] - r[5] for r in rows]
    jumps = sorted(range(1, len(rows)), key=lambda i: excess[i] - excess[i - 1], reverse=True)[:12]

    def row(i: int) -> dict[str, Any]:
        name, main, before, inside, after, live = rows[i]
        return {
            "index": i,
            "op": name,
            "thread": "caller" if main else "autograd",
            "before": before,
            "inside": inside,
            "after": after,
            "tensors": live,
            "excess": after - live,
        }

    return {
        "start_allocated": start,
        "start_tensors": watch.start_live,
        "calls": len(rows),
        "peak": rows[peak_at][3],
        "at_peak": row(peak_at),
        "tensor_peak": rows[live_at][5],
        "at_tensor_peak": row(live_at),
        "excess_jumps": [{**row(i), "jump": excess[i] - excess[i - 1]} for i in jumps],
        "window_at_peak": [row(i) for i in range(max(0, peak_at - 6), min(len(rows), peak_at + 3))],
    }


def run(name: str) -> dict[str, Any]:
    dev = DEV
    entry = BENCHMARK_MODELS[name]
    config = memscale.Config(mode="conservative", force_optimize=True, enable_logging=False)
    result: dict[str, Any] = {"model": name}
    model, batch = entry.build(seed=0, device=dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pred = memscale.predict_peak(
        model, batch.sample_input, config, optimizer, loss_fn=batch.loss_fn
    )
    result["predicted"] = {
        "unoptimized": pred.unoptimized.peak_bytes,
        "unoptimized_breakdown": pred.unoptimized.to_dict(),
        "conservative": pred.optimized.peak_bytes,
        "conservative_breakdown": pred.optimized.to_dict(),
        "library_workspace_bytes": pred.library_workspace_bytes,
        "unprobed_calls": pred.unprobed_calls,
    }
    result["unoptimized"] = _watched_step(model, batch, optimizer)
    del model, batch, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    model, batch = entry.build(seed=0, device=dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    memscale.wrap(model, config, sample_input=batch.sample_input, optimizer=optimizer)
    result["conservative"] = _watched_step(model, batch, optimizer)
    memscale.detach(model)
    return result


def budget_run(name: str, share: float) -> dict[str, Any]:
    """As the budget sweep's memscale row: BALANCED without offload at
    ``start + share x activations`` (the unoptimized step measured first),
    wrapped without the optimizer; then the fake pass's per-layer profile
    against a real forward's (empirical profiling), layer by layer."""
    from memscale import _model, _planning
    from memscale.config import GIB

    dev = DEV
    entry = BENCHMARK_MODELS[name]
    model, batch = entry.build(seed=0, device=dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    base = _watched_step(model, batch, optimizer)
    del model, batch, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    budget = base["start_allocated"] + int(share * (base["peak"] - base["start_allocated"]))
    model, batch = entry.build(seed=0, device=dev)
    config = memscale.Config(
        mode="balanced",
        enable_offloading=False,
        memory_budget_gb=budget / GIB,
        enable_logging=False,
    )
    memscale.wrap(model, config, sample_input=batch.sample_input)
    executor = model._memscale_executor
    plan = executor.plan
    names = list(executor.layer_names)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    watched = _watched_step(model, batch, optimizer)
    result = {
        "model": name,
        "budget": budget,
        "predicted": plan.peak_projected_bytes,
        "plan": [(layer.name, list(layer.techniques), layer.segment) for layer in plan.layers],
        "watched": watched,
    }
    memscale.detach(model)
    units = [(n, model.get_submodule(n)) for n in names]
    args, kwargs = _model.split_input(batch.sample_input)
    static = _planning.profile_from(
        *_planning._profile_static(model, units, args, kwargs)[:1], units, "static"
    )
    real = _planning.profile_from(
        *_planning._profile_empirical(model, units, args, kwargs)[:1], units, "empirical"
    )
    result["layers"] = [
        {
            "name": n,
            "saved_fake": a.saved_bytes,
            "saved_real": b.saved_bytes,
            "input_fake": a.input_bytes,
            "input_real": b.input_bytes,
        }
        for n, a, b in zip(names, static.layers, real.layers)
    ]
    print(
        f"== {name} at {share:.0%}: budget {budget / MIB:.2f} MiB, predicted {plan.peak_projected_bytes / MIB:.2f}, "
        f"measured {watched['peak'] / MIB:.2f} MiB (tensors {watched['tensor_peak'] / MIB:.2f}); "
        f"peak at {watched['at_peak']['index']} {watched['at_peak']['op']} ({watched['at_peak']['thread']})"
    )
    print("   plan:", [(n[-12:], t, s) for n, t, s in result["plan"]])
    for row in result["layers"][:3]:
        print("   layer:", row)
    return result


def _say(res: dict[str, Any]) -> None:
    p = res["predicted"]
    print(
        f"== {res['model']}: unprobed calls {p['unprobed_calls']}, libraries {p['library_workspace_bytes']:,} B"
    )
    for variant in ("unoptimized", "conservative"):
        m = res[variant]
        at, tat = m["at_peak"], m["at_tensor_peak"]
        print(
            f"  {variant}: predicted {p[variant] / MIB:.2f} MiB, measured {m['peak'] / MIB:.2f} MiB "
            f"(start {m['start_allocated'] / MIB:.2f}, tensors at start {m['start_tensors'] / MIB:.2f}); "
            f"tensor peak {m['tensor_peak'] / MIB:.2f} MiB"
        )
        print(f"    breakdown predicted: {p[variant + '_breakdown']}")
        print(
            f"    allocator peak at call {at['index']} {at['op']} ({at['thread']}), "
            f"excess there {at['excess'] / MIB:.2f} MiB; tensor peak at call "
            f"{tat['index']} {tat['op']} ({tat['thread']}), excess {tat['excess'] / MIB:.2f} MiB"
        )
        for j in m["excess_jumps"][:8]:
            print(
                f"    excess +{j['jump'] / MIB:.2f} MiB after {j['index']} {j['op']} ({j['thread']}),"
                f" now {j['excess'] / MIB:.2f} MiB"
            )
        for w in m["window_at_peak"]:
            print(
                f"    near peak: {w['index']} {w['op']} ({w['thread']}) inside "
                f"{w['inside'] / MIB:.2f} after {w['after'] / MIB:.2f} tensors {w['tensors'] / MIB:.2f}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2-12l", "llama-12l"])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--budget-share",
        type=float,
        metavar="F",
        help="instead: the budget sweep's memscale row at this share of the activations, "
        "and the fake pass's per-layer profile against a real forward's",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_step_memory: no CUDA device here", file=sys.stderr)
        return 3
    results = []
    for name in args.models:
        if args.budget_share is not None:
            results.append(budget_run(name, args.budget_share))
            continue
        res = run(name)
        _say(res)
        results.append(res)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
