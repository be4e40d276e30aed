"""How long ``memscale.wrap`` takes with a budget that makes the planner run.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/wrap_time.py [--share 0.5]
        [--models gpt2-12l llama-12l] [--profile llama-12l [--sort tottime]]

For every quick benchmark model, gpt2-12l, llama-12l, bert-12l and a chain
of 1,000 tiny blocks (``chain-1000``), it builds the model, measures the
unoptimized training step's exact peak once (as the budget sweep does:
``start + share x activations``, ``memscale.benchmarks.sweep``), then wraps a
fresh copy with ``Config(mode="conservative", memory_budget_gb=...)`` and
``sample_input`` and prints wrap's CPU seconds (``time.process_time``),
its wall seconds, the simulated steps the planner ran, the plan hash and
whether the plan is every layer checkpointed alone (the fallback).
``--profile NAME`` prints the top of a cProfile of that model's wrap,
sorted by ``--sort`` (cumulative time unless told).  ``--phases`` prints,
under each model's row, the CPU seconds of each phase of its wrap (a timer
around each): the fake world's entry, the first optimizer update, each
simulated step (the first, which is the profile's pass and the
unoptimized step with Adam or AdamW, then one per plan simulated) and
the rest (see ``_Phases``).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import logging
import pstats
import time
from typing import Any

import torch
from torch import nn

import memscale
from memscale import _planner
from memscale.benchmarks import models, runner
from memscale.benchmarks.measure import measure_peak
from memscale.config import GIB


class _Tiny(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x


class _Chain(nn.Module):
    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[_Tiny(width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x).pow(2).mean()


def _chain(seed: int = 0) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(seed)
    x = torch.randn(64, 16)
    return _Chain(1000, 16), (x,), lambda out: out


def _build(name: str) -> tuple[nn.Module, Any, Any]:
    if name == "chain-1000":
        return _chain()
    model, batch = runner.lookup(name).build(seed=0)
    return model, batch.sample_input, batch.loss_fn


def _call(model: nn.Module, sample: Any) -> Any:
    if isinstance(sample, dict):
        return model(**sample)
    return model(*sample)


def unoptimized(name: str) -> tuple[int, int]:
    """(start bytes, activation bytes) of the unoptimized step of ``name``
    with AdamW, measured (the other scripts here plan against it)."""
    model, sample, loss_fn = _build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(_call(model, sample)).backward()
        opt.step()

    report = measure_peak(step, model=model, inputs=(sample, opt.state), warmup=1)
    return int(report.start_bytes), int(report.peak_delta_bytes)


def _budget(name: str, share: float) -> int:
    start, activations = unoptimized(name)
    return int(start + share * activations)


class _Phases:
    """CPU seconds of each phase of a wrap while installed: a timer around
    the simulation's methods.  With Adam or AdamW the first step, tracked,
    is the profile and the unoptimized step ("first step"; its first
    optimizer update, recorded, timed on its own); with another optimizer
    "warm-up less its update" is the untracked warm-up step (its profiled
    forward, the loss, the gradients it makes) and the update prints n/a.
    Each simulated step after is one "step"; "rest" is the wrap's time
    outside them (making the steady step from the first, planning,
    solving, reading the traces, installing the plan)."""

    _TIMED = (
        ("world", "memscale.predictor._fake", "FakeWorld", "__enter__"),
        ("warm-up", "memscale.predictor._step", "Step", "warm_up"),
        ("first update", "memscale.predictor._step", "Step", "_first_update_recorded"),
        ("step", "memscale.predictor._step", "Step", "tracked"),
        ("first step", "memscale.predictor._step", "Step", "first_tracked"),
    )

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self._orig: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> _Phases:
        import importlib

        try:
            for label, module, cls_name, name in self._TIMED:
                cls = getattr(importlib.import_module(module), cls_name)
                orig = cls.__dict__[name]
                self._orig.append((cls, name, orig))
                setattr(cls, name, self._timed(label, orig))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _timed(self, label: str, orig: Any) -> Any:
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.process_time()
            try:
                return orig(*args, **kwargs)
            finally:
                seconds.setdefault(label, []).append(time.process_time() - t0)

        return timed

    def __exit__(self, *exc: Any) -> None:
        for cls, name, orig in reversed(self._orig):
            setattr(cls, name, orig)
        self._orig.clear()

    def line(self, total: float) -> str:
        s = self.seconds
        update = sum(s.get("first update", []))
        steps = s.get("step", [])
        parts = [("world", sum(s.get("world", [])))]
        if "warm-up" in s:
            # (the first update is timed inside the warm-up's step)
            parts.append(("warm-up less its update", sum(s["warm-up"]) - update))
        labels = [f"step {i + 1}" for i in range(len(steps))]
        if "first step" in s and labels:
            labels[0] = "first step (profile and unoptimized step)"
        parts += list(zip(labels, steps))
        rest = total - update - sum(t for _, t in parts)
        shown = [f"{n} {t:.2f}" for n, t in parts]
        shown.insert(
            len(shown) - len(steps),
            f"first update {update:.2f}" if "first update" in s else "first update n/a",
        )
        shown.append(f"rest {rest:.2f}")
        return "  phases of wrap (CPU s): " + ", ".join(shown)


class _Counter:
    """Counts the simulated steps under a plan (the planner's verification
    simulations) while it is installed."""

    def __init__(self) -> None:
        self.count = 0
        self._orig = _planner.predictor.SimulationSession.simulated_peak

    def __enter__(self) -> _Counter:
        orig = self._orig

        def counted(session: Any, plan: Any, config: Any) -> int:
            self.count += 1
            return int(orig(session, plan, config))

        _planner.predictor.SimulationSession.simulated_peak = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        _planner.predictor.SimulationSession.simulated_peak = self._orig  # type: ignore[method-assign]


def time_wrap(
    name: str,
    share: float,
    profile: bool = False,
    sort: str = "cumulative",
    phases: bool = False,
) -> dict[str, Any]:
    budget = _budget(name, share)
    gc.collect()
    model, sample, _ = _build(name)
    config = memscale.Config(
        mode="conservative", memory_budget_gb=budget / GIB, enable_logging=False
    )
    prof = cProfile.Profile() if profile else None
    timers = _Phases() if phases else contextlib.nullcontext()
    wrapped = 0.0  # CPU seconds of wrap itself (the row's also has detach)
    with _Counter() as counter, timers:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if prof is not None:
            prof.enable()
        try:
            memscale.wrap(model, config, sample_input=sample)
            wrapped = time.process_time() - cpu0
            plan = model._memscale_executor.plan
            result = plan.hash
            counts = plan.technique_counts
            ckpt = [layer for layer in plan.layers if layer.techniques]
            every = len(ckpt) == len(plan.layers) and all(
                layer.segment == layer.index for layer in ckpt
            )
            memscale.detach(model)
        except memscale.MemoryBudgetError as exc:
            result = f"MemoryBudgetError(least={exc.min_budget_bytes})"
            counts, every = {}, False
        finally:
            if prof is not None:
                prof.disable()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if prof is not None:
        pstats.Stats(prof).sort_stats(sort).print_stats(30)
    return {
        "model": name,
        "budget": budget,
        "cpu_s": cpu,
        "wall_s": wall,
        "simulations": counter.count,
        "plan": result,
        "checkpoint": counts.get("checkpoint", 0),
        "every_block": every,
        "phases": timers.line(wrapped) if isinstance(timers, _Phases) and wrapped else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    quick = [m.name for m in models.BENCHMARK_MODELS.values() if m.size == "quick"]
    parser.add_argument(
        "--models",
        nargs="*",
        default=[*quick, "gpt2-12l", "llama-12l", "bert-12l", "chain-1000"],
    )
    parser.add_argument("--share", type=float, default=0.5, help="budget: share of activations")
    parser.add_argument("--profile", default=None, help="cProfile this model's wrap")
    parser.add_argument(
        "--phases", action="store_true", help="print the CPU seconds of each phase of each wrap"
    )
    parser.add_argument(
        "--sort", default="cumulative", help="the profile's order (pstats: cumulative, tottime)"
    )
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    print("| model | budget | wrap CPU s | wrap wall s | simulations | plan | ckpt | every block |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        r = time_wrap(
            name, args.share, profile=name == args.profile, sort=args.sort, phases=args.phases
        )
        print(
            f"| {r['model']} | {r['budget']} | {r['cpu_s']:.2f} | {r['wall_s']:.2f} | "
            f"{r['simulations']} | {r['plan']} | {r['checkpoint']} | {r['every_block']} |",
            flush=True,
        )
        if r["phases"] is not None:
            print(r["phases"], flush=True)
        gc.collect()


if __name__ == "__main__":
    main()
