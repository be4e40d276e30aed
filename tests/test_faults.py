"""Faults injected at every hook point memscale owns.

A ``KeyboardInterrupt`` (Ctrl-C) or an ordinary exception raised inside
memscale's pre-forward and post-forward hooks (per layer and on the root),
its saved-tensor pack and unpack hooks, the recompute, the offload write
and read, and the 8-bit optimizer's step.  After each: the process is as it
was (no saved-tensor hooks, autocast off), an unrelated unwrapped model's
training step is bitwise what it is in a clean process, the wrapped model
trains on exactly, and ``detach`` leaves nothing behind (no hooks, no call
guard, no threads, no spill files or descriptors, no spill directory).

Hooks are faulted where memscale installs them: the executor's hook
methods are looked up by name when the hooks are registered, the
saved-tensor hooks go through ``torch._C._autograd``'s push, the spill
store reads each tensor's ``data_ptr()``, and the optimizer calls
``memscale._core.adamw8bit_step``.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from conftest import (
    assert_same_grads,
    hook_count,
    mlp,
    saved_tensor_hooks,
    spill_fds,
    train_step,
    twins,
)
from torch import nn

import memscale
from memscale import _core
from memscale._executor import Executor

FAULTS = {"interrupt": KeyboardInterrupt, "error": RuntimeError}


class Injected(Exception):
    """Marks the ordinary exception as ours."""


def _raise(kind: str) -> None:
    if kind == "interrupt":
        raise KeyboardInterrupt("injected")
    raise Injected("injected")


def assert_process_clean() -> None:
    assert saved_tensor_hooks() is None, "a saved-tensor hook is still installed"
    assert not torch.is_autocast_enabled("cpu"), "autocast is still on"
    assert torch.is_grad_enabled()


class Unrelated(nn.Module):
    """A model memscale never sees."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def unrelated_step() -> tuple[torch.Tensor, list[torch.Tensor], torch.dtype]:
    model = Unrelated()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    out = model(x)
    loss = out.pow(2).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], out.dtype


REFERENCE = unrelated_step()  # computed at import, before any fault


def assert_unrelated_exact() -> None:
    loss, grads, dtype = unrelated_step()
    assert dtype == torch.float32
    assert torch.equal(loss, REFERENCE[0])
    for g, ref in zip(grads, REFERENCE[1]):
        assert torch.equal(g, ref)


def assert_detach_leaves_nothing(
    model: nn.Module, threads: set[str], spill_dir: str | None
) -> None:
    memscale.detach(model)
    assert hook_count(model) == 0
    assert "_compiled_call_impl" not in model.__dict__
    assert "_memscale_executor" not in model.__dict__
    assert_process_clean()
    now = {t.name for t in threading.enumerate()}
    assert now <= threads, f"threads left: {now - threads}"
    if spill_dir is not None:
        assert not os.path.exists(spill_dir)
        assert spill_fds(spill_dir, directory=True) == []


@pytest.fixture(autouse=True)
def _isolated():
    """A failing case must not fail the next ones: whatever it left
    process-wide is cleared after it (a passing case leaves nothing)."""
    yield
    while saved_tensor_hooks() is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
    torch.set_autocast_enabled("cpu", False)
    torch.set_grad_enabled(True)


# ------------------------------------------------------------ injection


class Injector:
    """Arms one fault at one hook point; counts the calls it saw there."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, point: str, kind: str) -> None:
        self.point, self.kind = point, kind
        self.armed = False
        self.fired = False
        self.calls = 0
        # Not the first call, where there are several: mid-way.
        self.nth = 1 if point.startswith("root") else 2
        mp = monkeypatch
        if point in ("pre", "post", "root_pre", "root_post"):
            name = "_" + point
            real = getattr(_core.Executor, name)
            before = point in ("post", "root_post")  # before ours: worst case

            def hooked(ex, *args):
                if before:
                    self._maybe()
                result = real(ex, *args)
                if not before:
                    self._maybe()
                return result

            mp.setattr(Executor, name, hooked)
        elif point in ("pack", "unpack", "recompute"):
            push = torch._C._autograd._push_saved_tensors_default_hooks
            which = {"pack": "_pack", "unpack": "_unpack", "recompute": "_rpack"}[point]

            def wrap_hook(fn):
                if getattr(fn, "__name__", None) != which:
                    return fn

                def faulty(arg):
                    self._maybe()
                    return fn(arg)

                return faulty

            def patched_push(pack, unpack):
                return push(wrap_hook(pack), wrap_hook(unpack))

            mp.setattr(torch._C._autograd, "_push_saved_tensors_default_hooks", patched_push)
        elif point in ("offload_write", "offload_read"):
            real_ptr = torch.Tensor.data_ptr

            def data_ptr(t):
                self._maybe()
                return real_ptr(t)

            mp.setattr(torch.Tensor, "data_ptr", data_ptr)
        elif point == "optimizer_step":
            real_step = _core.adamw8bit_step

            def step(*args, **kwargs):
                self._maybe()
                return real_step(*args, **kwargs)

            mp.setattr(_core, "adamw8bit_step", step)
        else:  # pragma: no cover
            raise AssertionError(point)

    def _maybe(self) -> None:
        if not self.armed:
            return
        self.calls += 1
        if self.calls == self.nth and not self.fired:
            self.fired = True
            self.armed = False
            _raise(self.kind)


POINTS = [
    "pre",
    "post",
    "root_pre",
    "root_post",
    "pack",
    "unpack",
    "recompute",
    "offload_write",
    "offload_read",
    "optimizer_step",
]
IN_BACKWARD = {"unpack", "recompute", "offload_read"}


def config_for(point: str, amp: bool) -> memscale.Config:
    offload = point.startswith("offload")
    return memscale.Config(
        mode="balanced" if offload else "conservative",
        force_optimize=True,
        enable_logging=False,
        use_mixed_precision=amp,
        use_8bit_optimizer=point == "optimizer_step",
        async_config=memscale.AsyncOffloadConfig(min_offload_bytes=0),
    )


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", sorted(FAULTS))
@pytest.mark.parametrize("point", POINTS)
def test_fault_at_every_hook_point(monkeypatch, point, kind, amp):
    if point == "optimizer_step" and amp:
        pytest.skip("the optimizer step does not depend on mixed precision")
    threads = {t.name for t in threading.enumerate()}
    inj = Injector(monkeypatch, point, kind)
    model, ref = twins(lambda: mlp(depth=4, width=32))
    x = torch.randn(4, 8, 32)
    opt = None
    if point == "optimizer_step":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    memscale.wrap(model, config_for(point, amp), sample_input=x, optimizer=opt)
    ex = model._memscale_executor
    store = ex.offload_store
    spill_dir = store.path if store is not None else None
    if point.startswith("offload"):
        assert store is not None and "disk" in {lay.tier for lay in ex.plan.layers}
    opt = ex.optimizer

    # The faulted step.
    model.zero_grad(set_to_none=True)
    if point not in IN_BACKWARD and point != "optimizer_step":
        inj.armed = True
    with pytest.raises(FAULTS[kind] if kind == "interrupt" else Injected):
        loss = model(x).float().pow(2).mean()
        if point in IN_BACKWARD:
            inj.armed = True
        loss.backward()
        inj.armed = False
        if point == "optimizer_step":
            inj.armed = True
            opt.step()
    inj.armed = False
    assert inj.fired, f"the fault at {point} never fired"
    loss = None  # the interrupted graph goes

    assert_process_clean()
    assert ex.stats["active_frames"] == 0
    assert_unrelated_exact()

    # The wrapped model trains on, exactly (from the same weights).
    if point != "optimizer_step":
        if amp:
            ref_amp = memscale.Config(use_mixed_precision=True, enable_logging=False)
            memscale.wrap(ref, ref_amp, sample_input=x)  # autocast alone
        a = train_step(model, x, seed=1)
        b = train_step(ref, x, seed=1)
        assert torch.equal(a, b)
        assert_same_grads(model, ref)
        if amp:
            memscale.detach(ref)
    else:
        train_step(model, x, seed=1)
        opt.step()  # the optimizer works after a faulted step
    assert_process_clean()
    assert_unrelated_exact()
    assert_detach_leaves_nothing(model, threads, spill_dir)


@pytest.mark.parametrize("point", ["offload_write", "offload_read"])
def test_the_offload_injection_hits_the_spill_store(monkeypatch, point):
    """The data_ptr() calls the offload points fault are the store's: one
    per tensor written in the forward, one per tensor read in backward."""
    inj = Injector(monkeypatch, point, "error")
    model = mlp(depth=4, width=32)
    x = torch.randn(4, 8, 32)
    memscale.wrap(model, config_for(point, False), sample_input=x)
    store = model._memscale_executor.offload_store
    inj.calls, inj.fired = 0, True  # count, never fire
    inj.armed = point == "offload_write"
    loss = model(x).pow(2).mean()
    written = inj.calls
    inj.calls, inj.armed = 0, point == "offload_read"
    loss.backward()
    read = inj.calls
    inj.armed = False
    stats = store.stats
    assert stats["tensors_written"] > 1
    if point == "offload_write":
        assert written == stats["tensors_written"]
    else:
        assert read == stats["tensors_read"] > 1
    memscale.detach(model)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_ctrl_c_in_a_checkpointed_layer_leaves_the_process_as_it_was(amp):
    """Issue 20, item 2: a KeyboardInterrupt inside a checkpointed layer
    left memscale's saved-tensor hooks installed (and, with mixed
    precision, autocast on) until the next forward or detach: an unrelated
    model's step then failed (or ran in bf16)."""
    threads = {t.name for t in threading.enumerate()}
    model, ref = twins(lambda: mlp(depth=4, width=32))
    x = torch.randn(4, 8, 32)
    config = memscale.Config(
        mode="conservative", force_optimize=True, enable_logging=False, use_mixed_precision=amp
    )
    memscale.wrap(model, config, sample_input=x)
    original = model[2].fc2.forward

    def interrupted(t):
        raise KeyboardInterrupt

    model[2].fc2.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        model(x)
    del model[2].fc2.forward
    assert model[2].fc2.forward == original
    assert_process_clean()
    assert_unrelated_exact()
    if amp:
        memscale.wrap(
            ref, memscale.Config(use_mixed_precision=True, enable_logging=False), sample_input=x
        )
    a = train_step(model, x, seed=2)
    b = train_step(ref, x, seed=2)
    assert torch.equal(a, b)
    assert_same_grads(model, ref)
    if amp:
        memscale.detach(ref)
    assert_detach_leaves_nothing(model, threads, None)


def test_the_call_guard_keeps_a_compiled_call_and_detach_restores_it():
    model = mlp(depth=2, width=32)
    x = torch.randn(2, 32)
    seen = []

    def compiled(*args, **kwargs):
        seen.append(1)
        return model._call_impl(*args, **kwargs)

    model._compiled_call_impl = compiled
    memscale.wrap(model, memscale.Config(force_optimize=True, enable_logging=False), sample_input=x)
    model(x).sum().backward()
    assert seen
    memscale.detach(model)
    assert model.__dict__["_compiled_call_impl"] is compiled
