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
        self.first_live: int | None = None  # before the first call (after zero_grad)
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
        cuda = DEV.type == "cuda"  # else (a try on the CPU): the tensors' bytes
        if self.first_live is None and not str(func).startswith("profiler."):
            self.first_live = self.live  # zero_grad's record_function comes first
        before = torch.cuda.memory_allocated() if cuda else self.live
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        inside = torch.cuda.max_memory_allocated() if cuda else self.live
        after = torch.cuda.memory_allocated() if cuda else self.live
        self.rows.append(
            (str(func), threading.get_ident() == self.main, before, inside, after, self.live)
        )
        return out


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _tensors(*objs: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(objs) if isinstance(t, torch.Tensor)]


def _watched_step(model, batch, optimizer, keep_rows: bool = False) -> dict[str, Any]:
    marks: list[int] = []

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        batch.loss_fn(model(*batch.args, **batch.kwargs)).backward()
        marks.append(len(watch.rows) if watch is not None else 0)
        optimizer.step()

    watch = None

    step()
    step()
    gc.collect()
    _sync()
    start = torch.cuda.memory_allocated() if DEV.type == "cuda" else None
    # (The lists are not kept: zero_grad must free the gradients.)
    watch = Watch(
        [*model.parameters()]
        + [p.grad for p in model.parameters() if p.grad is not None]
        + _tensors(dict(optimizer.state), batch.args, batch.kwargs)
    )
    if start is None:
        start = watch.start_live
    else:
        torch.cuda.reset_peak_memory_stats()
    with watch:
        step()
    _sync()
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

    extra = (
        {"rows": rows, "optimizer_at": marks[-1], "first_live": watch.first_live}
        if keep_rows
        else {}
    )
    return {
        **extra,
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
    _sync()
    model, batch = entry.build(seed=0, device=dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    memscale.wrap(model, config, sample_input=batch.sample_input, optimizer=optimizer)
    result["conservative"] = _watched_step(model, batch, optimizer)
    memscale.detach(model)
    return result


def _sweep_row(name: str, share: float) -> tuple[Any, Any, Any, int]:
    """The budget sweep's memscale row: the unoptimized step measured, then
    a fresh model wrapped BALANCED without offload (and without the
    optimizer) at ``start + share x activations``; (model, batch, config,
    budget)."""
    from memscale.config import GIB

    entry = BENCHMARK_MODELS[name]
    model, batch = entry.build(seed=0, device=DEV)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    base = _watched_step(model, batch, optimizer)
    del model, batch, optimizer
    gc.collect()
    _sync()
    budget = base["start_allocated"] + int(share * (base["peak"] - base["start_allocated"]))
    model, batch = entry.build(seed=0, device=DEV)
    config = memscale.Config(
        mode="balanced",
        enable_offloading=False,
        memory_budget_gb=budget / GIB,
        enable_logging=False,
    )
    memscale.wrap(model, config, sample_input=batch.sample_input)
    return model, batch, config, budget


def budget_run(name: str, share: float) -> dict[str, Any]:
    """As the budget sweep's memscale row: BALANCED without offload at
    ``start + share x activations`` (the unoptimized step measured first),
    wrapped without the optimizer; then the fake pass's per-layer profile
    against a real forward's (empirical profiling), layer by layer."""
    from memscale import _model, _planning

    model, batch, _, budget = _sweep_row(name, share)
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


class _Recorded:
    """While entered, every simulated step's tracker records its calls in
    forward and backward: (event index, op name) in ``tracker.calls``."""

    def __enter__(self) -> None:
        from memscale.predictor import _tracker

        self.cls = _tracker.StorageTracker
        self.original = original = self.cls.__torch_dispatch__

        def recording(self, func, types, args=(), kwargs=None):
            out = original(self, func, types, args, kwargs)
            noise = str(func).startswith(("prim.", "profiler."))
            if self.active and self.phase in ("forward", "backward") and not noise:
                self.__dict__.setdefault("calls", []).append((len(self.events), str(func)))
            return out

        self.cls.__torch_dispatch__ = recording

    def __exit__(self, *exc: Any) -> None:
        self.cls.__torch_dispatch__ = self.original


def _sim_ops(session: Any, plan: Any, config: Any) -> tuple[list[str], list[int], int]:
    """The simulated step under ``plan``, op by op: each call's name and
    the bytes alive (with its kernel's scratch) when it returns, above
    those alive when the forward starts; and where backward starts."""
    _, trace = session._steps._trace(plan, config)
    tracker = trace.tracker
    levels = tracker.levels(session._steps._workspace)
    backward = next(at for at, phase in tracker.phase_marks if phase == "backward")
    forward = next(at for at, phase in tracker.phase_marks if phase == "forward")
    start = tracker.levels(session._steps._workspace, scratch=False)[forward]
    ops, after, start_bw = [], [], 0
    for at, name in tracker.__dict__.get("calls", []):
        if at >= backward and not start_bw:
            start_bw = len(ops)
        ops.append(name)
        after.append(levels[at] - start)
    return ops, after, start_bw


def compare(name: str, share: float) -> dict[str, Any]:
    """The step simulated under wrap()'s plan against the real step under
    it, op by op: the two op sequences aligned (difflib), the bytes alive
    above the step's start on each side where they match, and where the
    simulation's surplus grows.  The real step is the sweep row's (no
    optimizer passed to wrap; AdamW built after)."""
    import difflib

    from memscale._planner import PredictionSession

    model, batch, config, budget = _sweep_row(name, share)
    plan = model._memscale_executor.plan
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    real = _watched_step(model, batch, optimizer, keep_rows=True)
    memscale.detach(model)
    del optimizer
    gc.collect()
    with (
        _Recorded(),
        PredictionSession(
            model, batch.sample_input, None, loss_fn=batch.loss_fn, config=config
        ) as session,
    ):
        again = session.plan(config)
        sim_ops, sim_after, sim_bw = _sim_ops(session, plan, config)
        library = session._steps.library_bytes
        sim_peak = session._steps.simulated_peak(plan, config)
    rows = real.pop("rows")
    rows = [r for r in rows[: real["optimizer_at"]] if not r[0].startswith(("prim.", "profiler."))]
    real_ops = [r[0] for r in rows]
    real_live = [r[5] - real["first_live"] for r in rows]
    real_inside = [r[3] - rows[0][2] for r in rows]  # the allocator's, scratch and all
    matcher = difflib.SequenceMatcher(None, sim_ops, real_ops, autojunk=False)
    pairs = [
        (i, j)
        for a, b, n in matcher.get_matching_blocks()
        for i, j in zip(range(a, a + n), range(b, b + n))
    ]
    # Both above the bytes alive when the forward starts (after zero_grad).
    diff = [(i, j, sim_after[i] - real_live[j]) for i, j in pairs]
    diff_alloc = [(i, j, sim_after[i] - real_inside[j]) for i, j in pairs]
    jumps = sorted(range(1, len(diff)), key=lambda k: diff[k][2] - diff[k - 1][2], reverse=True)[
        :15
    ]
    unmatched = []
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag != "equal":
            unmatched.append(
                {
                    "tag": tag,
                    "sim": (a0, a1, sorted(set(sim_ops[a0:a1]))[:6]),
                    "real": (b0, b1, sorted(set(real_ops[b0:b1]))[:6]),
                }
            )
    sim_top = max(range(len(sim_after)), key=sim_after.__getitem__)
    out = {
        "model": name,
        "budget": budget,
        "plan": plan.hash,
        "plan_again": again.hash,
        "predicted": plan.peak_projected_bytes,
        "simulated_peak": sim_peak,
        "library_bytes": library,
        "measured": real["peak"],
        "real_start_tensors": real["start_tensors"],
        "real_tensor_peak": real["tensor_peak"],
        "sim_calls": len(sim_ops),
        "real_calls": len(real_ops),
        "matched": len(pairs),
        "sim_backward_at": sim_bw,
        "sim_peak_at": [sim_top, sim_ops[sim_top], sim_after[sim_top]],
        "sim_window": [
            (k, sim_ops[k], sim_after[k])
            for k in range(max(0, sim_top - 8), sim_top + 3)
            if k < len(sim_ops)
        ],
        "diff_max": max(diff, key=lambda x: x[2]) if diff else None,
        "diff_min": min(diff, key=lambda x: x[2]) if diff else None,
        "diff_alloc_max": max(diff_alloc, key=lambda x: x[2]) if diff else None,
        "diff_alloc_min": min(diff_alloc, key=lambda x: x[2]) if diff else None,
        "real_inside_peak": max(real_inside) if real_inside else None,
        "sim_level_peak": max(sim_after) if sim_after else None,
        "jumps": [
            {
                "sim": diff[k][0],
                "real": diff[k][1],
                "op": sim_ops[diff[k][0]],
                "before": diff[k - 1][2],
                "after": diff[k][2],
            }
            for k in jumps
        ],
        "real_excess_jumps": real["excess_jumps"],
        "real_at_peak": real["at_peak"],
        "unmatched": unmatched[:40],
        "unmatched_blocks": len(unmatched),
    }
    print(
        f"== compare {name} at {share:.0%}: plan {plan.hash} (again {again.hash}), "
        f"predicted {plan.peak_projected_bytes / MIB:.2f} MiB, simulated {sim_peak / MIB:.2f}, "
        f"measured {real['peak'] / MIB:.2f}; calls sim {len(sim_ops)} real {len(real_ops)} "
        f"matched {len(pairs)}"
    )
    print(
        f"   sim peak at {out['sim_peak_at']}; surplus max {out['diff_max']} min {out['diff_min']}"
    )
    print(
        f"   above the forward's start: sim peak {out['sim_level_peak']}, real allocator "
        f"{out['real_inside_peak']}; sim - allocator max {out['diff_alloc_max']} "
        f"min {out['diff_alloc_min']}"
    )
    for jump in out["jumps"][:10]:
        print(f"   surplus jump: {jump}")
    for jump in real["excess_jumps"][:8]:
        print(f"   real excess jump: {jump}")
    for row in out["sim_window"]:
        print(f"   sim near its peak: {row}")
    for row in real["window_at_peak"]:
        print(f"   real near its peak: {row}")
    for block in unmatched[:12]:
        print(f"   unmatched: {block}")
    return out


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
    parser.add_argument(
        "--compare",
        type=float,
        metavar="F",
        help="instead: the step simulated under the plan of the sweep's memscale row at "
        "this share against the real step under it, op by op",
    )
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to try it here")
    args = parser.parse_args(argv)
    global DEV
    DEV = torch.device(args.device)
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("gpu_step_memory: no CUDA device here", file=sys.stderr)
        return 3
    results = []
    for name in args.models:
        if args.compare is not None:
            results.append(compare(name, args.compare))
            continue
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
