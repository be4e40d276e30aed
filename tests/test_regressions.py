"""Regression tests for bugs found in review of the C core."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from conftest import FORCE, assert_same_grads, hook_count, mlp, saved_tensor_hooks, twins
from torch import nn

import memscale
from memscale import _core


def _force_plan(names):
    return _core.build_plan(
        [(n, "L", 0, 100, 1, 1.0, 0) for n in names],
        mode="conservative",
        allowed=_core.TECH_CHECKPOINT,
        force=True,
        budget_bytes=1,
        fixed_bytes=0,
        activation_bytes=100 * len(names),
        total_flops=1.0,
        device="cpu",
        device_count=1,
        capacity_bytes=1,
    )


class GradInForward(nn.Module):
    """Takes a derivative inside its forward (gradient penalty style)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        (g,) = torch.autograd.grad(h.sum(), x, create_graph=True)
        return torch.tanh(self.l2(h * g)).sin()


def test_backward_inside_a_checkpointed_forward_is_an_error_not_a_crash():
    torch.manual_seed(0)
    model = nn.Sequential(GradInForward(), GradInForward())
    ex = _core.Executor(model, [("0", model[0]), ("1", model[1])])
    ex.apply(_force_plan(["0", "1"]))
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError):
        model(x).sum().backward()
    ex.detach()


@pytest.mark.parametrize("static", [False, True], ids=["warmup", "first-forward"])
def test_detach_during_an_interrupted_warmup_pass_removes_every_hook(static):
    model = mlp()
    # Real steps measured, or the first forward planned (the interrupt then
    # comes in the planning's fake-tensor pass: memscale detaches itself).
    memscale.wrap(model, FORCE)
    if not static:
        model._memscale_executor.measure_real_steps()
    original = model[2].fc2.forward
    model[2].fc2.forward = lambda x: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 32, requires_grad=True))
    model[2].fc2.forward = original
    if static:
        assert "_memscale_executor" not in model.__dict__ and hook_count(model) == 0
    else:
        memscale.detach(model)
    assert saved_tensor_hooks() is None
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_profiler_detach_ends_a_running_pass():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    prof = _core.Profiler([model[0], model[1]], list(model.parameters()))
    prof.attach()
    prof.begin_pass()
    prof.detach()
    assert not prof.in_pass and prof.passes == 0
    assert saved_tensor_hooks() is None


class Evil:
    def __init__(self, victim: list) -> None:
        self.victim = victim

    def __index__(self) -> int:
        self.victim.clear()
        return 1


def test_build_plan_survives_a_list_mutated_while_parsed():
    layers: list = []
    layers.extend([("a", "L", 0, Evil(layers), 0, 1.0, 0)] + [("b", "L", 0, 1, 0, 1.0, 0)] * 3)
    plan = _core.build_plan(
        layers,
        mode="conservative",
        allowed=1,
        force=False,
        budget_bytes=1,
        fixed_bytes=0,
        activation_bytes=0,
        total_flops=1.0,
        device="cpu",
        device_count=1,
        capacity_bytes=1,
    )
    assert len(plan) == 4


@pytest.mark.parametrize(
    "units,error,match",
    [
        # A unit as a list, not a tuple.
        ([["0", None]], TypeError, r"units must be \(name, module\) tuples, got list"),
        # One module as two units.
        ([("0", None), ("0b", None)], ValueError, "appears twice among the units"),
    ],
    ids=["list", "twice"],
)
def test_executor_units_are_checked(units, error, match):
    model = nn.Sequential(nn.Linear(2, 2))
    units = [
        (n, model[0]) if isinstance(u, tuple) else [n, model[0]]
        for n, u in ((u[0], u) for u in units)
    ]
    with pytest.raises(error, match=match):
        _core.Executor(model, units)


class PairBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, pair):
        x, y = pair
        return torch.tanh(self.lin(x) * y)


class PairModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([PairBlock(), PairBlock()])

    def forward(self, x, y):
        h = self.blocks[0]((x, y))
        y.mul_(3)  # changes an input block 0 saved, nested in a tuple
        return self.blocks[1]((h, y.clone())).sum()


def test_in_place_change_of_a_nested_input_is_detected():
    torch.manual_seed(0)
    model = PairModel().train()
    ex = _core.Executor(model, [("blocks.0", model.blocks[0]), ("blocks.1", model.blocks[1])])
    ex.apply(_force_plan(["blocks.0", "blocks.1"]))
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="modified in place"):
        model(x, y).backward()
    ex.detach()


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.lin = nn.Linear(4, 4)
        self.frames_seen = []

    def forward(self, x):
        h = self.lin(x)
        try:
            h = self.inner(h)
        except ValueError:
            pass
        self.frames_seen.append(self.executor.stats["active_frames"])
        return h.tanh()


def test_a_failing_foreign_pre_hook_does_not_pop_our_frame():
    torch.manual_seed(0)
    root = nn.Sequential(Outer())
    outer = root[0]

    def reject(module, args):
        raise ValueError("someone else's pre-hook")

    outer.inner.register_forward_pre_hook(reject)  # runs before ours
    ex = _core.Executor(root, [("0", outer), ("0.inner", outer.inner)])
    outer.executor = ex
    ex.apply(_force_plan(["0", "0.inner"]))
    root(torch.randn(2, 4, requires_grad=True)).sum().backward()
    # The outer frame stayed open in forward (the recompute runs with none).
    assert outer.frames_seen == [1, 0]
    assert ex.stats["active_frames"] == 0 and ex.stats["recomputes"] == 1
    ex.detach()


def test_stale_frames_are_cleaned_even_when_warnings_are_errors():
    model = mlp()
    x = torch.randn(2, 32)
    memscale.wrap(model, FORCE, sample_input=x)
    ex = model._memscale_executor
    original = model[1].fc2.forward
    model[1].fc2.forward = lambda t: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        model[1](x)  # a layer on its own: no call guard, the frame stays
    model[1].fc2.forward = original
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning):
            model(x)
    assert ex.stats["active_frames"] == 0
    model(x).sum().backward()  # and training goes on
    memscale.detach(model)


def test_warmup_counts_clean_forwards_run_inside_an_except_block():
    model = mlp()
    memscale.wrap(model, FORCE)
    ex = model._memscale_executor
    x = torch.randn(2, 32)
    for _ in range(3):
        try:
            raise RuntimeError("an OOM-retry loop, say")
        except RuntimeError:
            model(x).sum().backward()
    assert ex.state == "applied"
    memscale.detach(model)


def test_type_errors_name_the_type():
    with pytest.raises(TypeError, match="int"):
        _core.find_units(3)


def test_double_backward_matches_unwrapped():
    model, ref = twins(lambda: mlp(depth=3))
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE, sample_input=x)

    def penalty(m):
        xi = x.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(m(xi).pow(2).sum(), xi, create_graph=True)
        m.zero_grad()
        g.pow(2).sum().backward()

    penalty(model)
    penalty(ref)
    assert_same_grads(model, ref)
    memscale.detach(model)


@pytest.mark.parametrize("measured_under", [False, True], ids=["unoptimized", "under-a-plan"])
def test_interrupted_warmup_pass_is_dropped_not_merged(measured_under):
    model = mlp()
    # Real steps measured unoptimized, or under the plan the first forward
    # made (use_static_profiling=False; that forward is the first measured).
    config = FORCE.replace(warmup_steps=1 + measured_under, use_static_profiling=not measured_under)
    memscale.wrap(model, config)
    ex = model._memscale_executor
    if measured_under:
        model(torch.randn(2, 32)).sum().backward()
        assert ex.plan is not None
    else:
        ex.measure_real_steps()
    original = model[1].fc2.forward
    model[1].fc2.forward = lambda t: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 32))
    model[1].fc2.forward = original
    assert ex.state == "profiling"
    assert saved_tensor_hooks() is None  # dropped by the call guard at once
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing stale is found
        model(torch.randn(2, 32)).sum().backward()
    assert ex.state == "applied"
    assert saved_tensor_hooks() is None
    # The plan comes from the clean pass only: each block measured once.
    assert all(d["calls"] == 1 for d in ex.profile.details)
    memscale.detach(model)


def test_empirical_profiling_keeps_no_activation_alive():
    """The profiler's pack hook handed back the tensor itself: an output
    saved by its own grad_fn then formed a cycle through autograd that
    nothing collects, so a forward-only profiling pass kept its whole graph
    (1.1 GiB for the GPT-2 benchmark model) alive for good."""
    import gc
    import weakref

    import memscale

    refs = []

    class Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 32)

        def forward(self, x):
            y = torch.tanh(self.lin(x))  # tanh saves its own output
            refs.append(weakref.ref(y))
            return y

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Spy() for _ in range(3)])
    memscale.wrap(
        model,
        memscale.Config(use_static_profiling=False, force_optimize=True, enable_logging=False),
        sample_input=torch.randn(4, 32),
    )
    gc.collect()
    assert refs and all(r() is None for r in refs)
    memscale.detach(model)
