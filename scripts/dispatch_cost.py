"""What one simulated operator call costs, against what torch's dispatch to
a Python mode costs at all.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/dispatch_cost.py [--repeats 3]

On ``scripts/wrap_time.py``'s chain of 1,000 blocks (batch 64 x 16), one
forward and backward (CPU seconds, the least of ``--repeats`` runs):

* ``real``: on real CPU tensors, no dispatch mode;
* ``real, no-op mode``: the same under a dispatch mode that only calls the
  operator (guarded as memscale's modes are, ``_torch_compat.guard_dispatch``):
  torch's cost of handing every call to a Python mode;
* ``fake, FakeCaller``: on the simulation's fake tensors, every call
  through ``predictor._tracker.FakeCaller`` and the fake-call memo
  (``csrc/fake_calls.c``), tracking nothing;
* ``fake, tracked``: the unoptimized step the OOM predictor simulates
  (``_Simulation.unoptimized``: the same under the storage tracker, with
  its zero_grad and its optimizer phase replayed).

It also prints the calls each pass hands to a dispatch mode: operators,
and ``prim.device`` queries (a fake tensor's device, asked by torch's C++
code; real tensors answer it without a mode); and, under the table, the
fake-call memo's own time on a repeated ``add`` of two 64 x 16 fake
tensors (called directly, with only the fake mode on the stack, as the
tracker calls it), in full and its key alone.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

import wrap_time  # noqa: E402  (this directory's script)

from memscale import _planner, _torch_compat  # noqa: E402
from memscale.predictor import _tracker  # noqa: E402


@_torch_compat.guard_dispatch
class _NoOp(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls["prim.device" if func is torch.ops.prim.device.default else "operators"] += 1
        return func(*args, **(kwargs or {}))


def _tracked_calls(run: Any) -> dict[str, int]:
    """The calls the storage tracker is handed in one ``run()`` (counted
    at its ``__torch_dispatch__``, which is put back after)."""
    calls: collections.Counter[str] = collections.Counter()
    guarded = _tracker.StorageTracker.__dict__["__torch_dispatch__"]

    def counting(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        calls["prim.device" if func is torch.ops.prim.device.default else "operators"] += 1
        return guarded.__get__(self)(func, types, args, kwargs)

    _tracker.StorageTracker.__torch_dispatch__ = counting  # type: ignore[method-assign]
    try:
        run()
    finally:
        _tracker.StorageTracker.__torch_dispatch__ = guarded  # type: ignore[method-assign]
    return dict(calls)


def _memo_alone(world: Any, repeats: int, n: int = 20000) -> tuple[float, float]:
    """Microseconds of one call of the fake-call memo on a repeated add,
    and of its key alone (the least of ``repeats`` runs of ``n``)."""
    from torch.utils._python_dispatch import _pop_mode_temporarily

    calls = world.calls
    add = torch.ops.aten.add.Tensor
    with world.mode:
        t = torch.empty(64, 16)
    args: tuple[Any, ...] = (t, t)
    # The tracker's place: its own mode popped, the fake mode alone below.
    with _tracker.FakeCaller(calls, world.small), _pop_mode_temporarily():
        calls(add, args, {})  # its first call: the memo learns it

        def full() -> None:
            for _ in range(n):
                calls(add, args, {})

        def key() -> None:
            for _ in range(n):
                calls.key(add, args, {})

        return _least(full, repeats) / n * 1e6, _least(key, repeats) / n * 1e6


def _least(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, sample, loss_fn = wrap_time._chain()
    x = sample[0]

    def real() -> None:
        with torch.enable_grad():
            model(x).backward()

    def real_mode() -> None:
        with _NoOp():
            real()

    counted = _Count()
    with counted:
        real()
    rows = [
        ("real", _least(real, args.repeats), dict(counted.calls)),
        ("real, no-op mode", _least(real_mode, args.repeats), dict(counted.calls)),
    ]
    with _planner.PredictionSession(model, sample, None, loss_fn=loss_fn) as session:
        sim = session._steps._sim
        step = sim.step

        def fake(inside: Any = None) -> None:
            with _tracker.FakeCaller(sim.world.calls, sim.world.small):
                with inside if inside is not None else contextlib.nullcontext():
                    with torch.enable_grad():
                        loss = step._loss(sim.world.model(*step.args, **step.kwargs))
                        loss.backward()

        counted = _Count()  # above the caller: it sees every call first
        fake(counted)
        rows.append(("fake, FakeCaller", _least(fake, args.repeats), dict(counted.calls)))
        tracked_calls = _tracked_calls(sim.unoptimized)
        rows.append(("fake, tracked", _least(sim.unoptimized, args.repeats), tracked_calls))
        memo = _memo_alone(sim.world, args.repeats)
    print("| pass | CPU s | operator calls | prim.device | microseconds per operator call |")
    print("| --- | --- | --- | --- | --- |")
    for name, seconds, calls in rows:
        ops, device = calls.get("operators", 0), calls.get("prim.device", 0)
        print(f"| {name} | {seconds:.3f} | {ops} | {device} | {seconds / max(1, ops) * 1e6:.1f} |")

    print(
        f"the memo alone, a repeated add: {memo[0]:.1f} microseconds a call, "
        f"{memo[1]:.1f} of them its key"
    )


if __name__ == "__main__":
    main()
