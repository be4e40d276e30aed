"""Nested checkpoint segments: below the least budget of two levels, a
segment whose recompute keeps only its units' inputs (a first pass), then
recomputes each unit alone from its input as backward reaches it
(csrc/solver.c, csrc/frame.c FrameNest, docs/planning.md)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from conftest import LossChain, assert_same_step, hook_count
from test_segments import (
    Chain,
    W,
    X,
    chain_loss,
    counters,
    draw,
    rng_states,
    same_buffers,
    segments,
)
from torch.utils._python_dispatch import TorchDispatchMode

import memscale
from memscale import _core, _format, _planner, _planning
from memscale._measure import measure_peak
from memscale._solve import solve

QUIET = memscale.Config(mode="conservative", enable_logging=False)


def nested_problem(model, sample, share=20):
    """Wrap ``model``; its executor and a problem whose layers save
    ``share`` times their input (no backward term, no fixed bytes), at a
    budget of 1 byte."""
    memscale.wrap(model, memscale.Config(enable_logging=False), sample_input=sample)
    ex = model.__dict__["_memscale_executor"]
    problem = _planning.plan_problem(ex.profile, ex.config, ex.hardware, 0)
    rows = [(n, k, pb, sb, sb // share, fl, fg) for (n, k, pb, sb, _, fl, fg) in problem.layers]
    problem = problem.replace(
        layers=tuple(_core.LayerStats(row) for row in rows),
        fixed_bytes=0,
        activation_bytes=sum(row[3] for row in rows),
        peak_offset_bytes=0,
        plan_offset_bytes=0,
        budget_bytes=1,
    )
    return ex, problem


def nested_plan(model, sample):
    """The executor and the plan at the least budget of ``model``'s
    nested problem."""
    ex, problem = nested_problem(model, sample)
    least = solve(problem).min_budget_bytes
    plan = solve(problem.replace(budget_bytes=least))
    assert plan.fits
    return ex, plan


def test_least_budget_falls_below_two_levels():
    """Six equal units, each saving S from an input of I = S // 20: two
    levels need five inputs held beside a unit's saved tensors (every unit
    checkpointed alone, the last one's recompute); nested segments of 3, 2
    and 1 units need two: the least budget falls by 3 I, and the plan
    there nests."""
    _, problem = nested_problem(Chain(depth=6).train(), X)
    saved, inputs = problem.layers[0].saved_bytes, problem.layers[0].input_bytes
    assert all(x.saved_bytes == saved and x.input_bytes == inputs for x in problem.layers)
    rest = problem.activation_bytes - 6 * saved  # outside the units: none
    assert rest == 0
    least = solve(problem).min_budget_bytes
    assert least == saved + 2 * inputs  # two levels: saved + 5 * inputs
    plan = solve(problem.replace(budget_bytes=least))
    assert plan.fits and plan.peak_projected_bytes <= least
    nested = [x.index for x in plan.layers if x.nested]
    assert nested and all("checkpoint" in plan.layers[i].techniques for i in nested)
    assert '"nested":1' in plan.to_json()
    assert "blocks.0 (nested)" in _format.plan_table(plan)
    # At the least budget of two levels, the plan is two levels' (none
    # nested, and the JSON has no "nested" key).
    two = solve(problem.replace(budget_bytes=saved + 5 * inputs))
    assert two.fits and not any(x.nested for x in two.layers)
    assert '"nested"' not in two.to_json()


@pytest.mark.parametrize("glue, states", [(None, 2), (draw, 5)])
@pytest.mark.parametrize("retain", [False, True])
def test_gradients_bitwise_with_dropout(glue, states, retain):
    """Dropout in every unit: the first pass replays the forward's RNG
    from the segment's start (and each later unit's recorded state where
    the parent drew between units), keeps each unit's state with its
    input, and each unit's own recompute starts from it: loss and
    gradients are the unwrapped model's, bit for bit.  retain: a second
    backward runs the first pass again."""
    model = Chain(depth=6, glue=glue).train()
    ref = copy.deepcopy(model)
    ex, plan = nested_plan(model, X)
    assert segments(plan) == [0, 0, 0, 3, 3, -1]
    assert [x.nested for x in plan.layers] == [1, 1, 1, 1, 1, 0]
    ex.apply(plan)
    before, kept = counters(ex), rng_states(ex)
    for seed in (0, 1):
        assert_same_step(model, ref, X, seed, loss_fn=chain_loss(), retain_graph=retain)
    # Two frames per step; each unit recomputed alone (per backward).
    assert counters(ex, before) == (4, (20 if retain else 10))
    assert rng_states(ex, kept) == 2 * states  # per step
    assert ex.stats["active_frames"] == 0


def test_detach_leaves_nothing():
    model = Chain(depth=6).train()
    ref = copy.deepcopy(model)
    ex, plan = nested_plan(model, X)
    ex.apply(plan)
    assert_same_step(model, ref, X, loss_fn=chain_loss())
    memscale.detach(model)
    assert "_memscale_executor" not in model.__dict__
    assert hook_count(model) == 0
    assert_same_step(model, ref, X, seed=3, loss_fn=chain_loss())
    dead = weakref.ref(model)
    del model, ex
    gc.collect()
    assert dead() is None


def _kept_inputs() -> list[list[tuple[int, ...] | None]]:
    """Per live frame holding kept inputs (a list of (input, rng, cuda)
    tuples), the shapes of those it holds."""
    out = []
    for o in gc.get_objects():
        if type(o).__name__ != "_Frame":
            continue
        for r in gc.get_referents(o):
            if isinstance(r, list) and any(
                isinstance(t, tuple) and len(t) == 3 and isinstance(t[0], torch.Tensor) for t in r
            ):
                out.append([None if t is None else tuple(t[0].shape) for t in r])
    return out


def test_a_unit_that_saves_nothing_leaves_no_kept_input():
    """The first pass keeps the inputs of the units before the one backward
    needs; each is dropped when backward is done with it.  A unit that
    saves no tensor is never recomputed alone: its kept input was held as
    long as the graph lived (retain_graph) until the unit before it was
    recomputed drops every kept input from there on.  Gradients stay the
    unwrapped model's."""
    model = Chain(depth=6).train()
    ref = copy.deepcopy(model)
    ex, plan = nested_plan(model, X)
    assert segments(plan) == [0, 0, 0, 3, 3, -1]
    ex.apply(plan)
    for m in (model, ref):
        m.blocks[1].forward = lambda x, mask=None: x * 2.0  # saves no tensor
    assert_same_step(model, ref, X, loss_fn=chain_loss(), retain_graph=True)
    torch.manual_seed(0)
    loss = chain_loss()(model, X)
    loss.backward(retain_graph=True)
    assert _kept_inputs() == []
    del loss
    assert ex.stats["active_frames"] == 0


def test_error_in_the_first_pass():
    """A unit that raises in the first pass: the error reaches backward,
    and the caller's RNG state, the executor's frames and the kept inputs
    are as before (none is left held); the next step is exact."""
    model = Chain(depth=6).train()
    ref = copy.deepcopy(model)
    ex, plan = nested_plan(model, X)
    ex.apply(plan)
    torch.manual_seed(0)
    loss = chain_loss()(model, X)
    model.blocks[1].boom = True
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="boom"):
        loss.backward(retain_graph=True)
    assert torch.equal(torch.get_rng_state(), state)
    assert _kept_inputs() == []
    del loss
    model.blocks[1].boom = False
    model.zero_grad(set_to_none=True)
    assert_same_step(model, ref, X, seed=5, loss_fn=chain_loss())
    assert ex.stats["active_frames"] == 0


class _Wide(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 256)
        self.down = torch.nn.Linear(256, 64)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


def test_least_plan_nests_and_its_peak_is_simulated_exactly():
    """12 blocks saving 12 times their input: wrap's least budget is a
    nested plan's (below two levels': 18,517,768 bytes on this chain
    before nesting); the simulated step under it (the kept RNG states
    counted, csrc/frame.c nest_keep) is the real step's exact peak, and
    within the least budget."""
    torch.manual_seed(0)
    model, x = LossChain(_Wide, 12).train(), torch.randn(2048, 64)
    with pytest.raises(memscale.MemoryBudgetError) as info:
        memscale.wrap(model, QUIET.replace(memory_budget_gb=1 / (1 << 30)), sample_input=(x,))
    least = info.value.min_budget_bytes
    simulated: dict[str, int] = {}
    peak_of = _planner.predictor.SimulationSession.simulated_peak

    def record(session, plan, config):
        simulated[plan.hash] = peak = int(peak_of(session, plan, config))
        return peak

    _planner.predictor.SimulationSession.simulated_peak = record
    try:
        memscale.wrap(model, QUIET.replace(memory_budget_gb=least / (1 << 30)), sample_input=(x,))
    finally:
        _planner.predictor.SimulationSession.simulated_peak = peak_of
    try:
        plan = model._memscale_executor.plan
        assert sum(x.nested for x in plan.layers) >= 6
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            model(x).backward()
            opt.step()

        report = measure_peak(step, model=model, inputs=(x, opt.state), warmup=1)
        assert report.peak_bytes == simulated[plan.hash]
        assert report.peak_bytes <= least < 18_517_768
    finally:
        memscale.detach(model)


@pytest.mark.parametrize("unit", [2, 1])
def test_error_in_a_units_own_recompute(unit):
    """A unit that raises in its own recompute (after the first pass kept
    the inputs of the units before the segment's last): unit 2, the last
    of the nested segment [0, 1, 2], which the first pass does not run;
    unit 1, which runs in the first pass and raises on its call after it.
    The error reaches backward; the caller's RNG state is as before, no
    kept input stays held, no frame stays open, and the next step is
    exact."""
    model = Chain(depth=6).train()
    ref = copy.deepcopy(model)
    ex, plan = nested_plan(model, X)
    assert segments(plan) == [0, 0, 0, 3, 3, -1]
    ex.apply(plan)
    block = model.blocks[unit]
    forward = block.forward
    calls = []

    def failing(x, mask=None):
        calls.append(unit)
        # Unit 2: its call after the forward (its own recompute); unit 1:
        # after the forward and the first pass.
        if len(calls) == (2 if unit == 2 else 3):
            raise ValueError("boom")
        return forward(x, mask)

    block.forward = failing
    torch.manual_seed(0)
    loss = chain_loss()(model, X)
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="boom"):
        loss.backward(retain_graph=True)
    assert len(calls) == (2 if unit == 2 else 3)  # it failed where meant to
    assert torch.equal(torch.get_rng_state(), state)
    assert _kept_inputs() == []
    del loss
    block.forward = forward
    model.zero_grad(set_to_none=True)
    assert_same_step(model, ref, X, seed=5, loss_fn=chain_loss())
    assert ex.stats["active_frames"] == 0


class _NormChain(torch.nn.Module):
    """Six blocks of Linear, BatchNorm and ReLU (buffers each recompute
    updates) between a stem and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = torch.nn.Linear(W, W)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(W, W), torch.nn.BatchNorm1d(W), torch.nn.ReLU())
            for _ in range(6)
        )
        self.head = torch.nn.Linear(W, W)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _Clones(TorchDispatchMode):
    """Counts the clones of the given tensors (the executor's snapshots of
    buffers before a recompute)."""

    def __init__(self, tensors) -> None:
        super().__init__()
        self.ids = {id(t) for t in tensors}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.clone.default and id(args[0]) in self.ids:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_nested_recompute_snapshots_only_the_units_it_runs():
    """BatchNorm in every unit: a recompute snapshots the buffers of the
    units it runs, to put back the statistics it updates (a nested
    segment's recompute runs one unit, its first pass a few), not every
    unit of the segment each time; gradients and statistics stay the
    unwrapped model's."""
    model = _NormChain().train()
    ref = copy.deepcopy(model)
    ex, plan = nested_plan(model, X)
    assert any(x.nested for x in plan.layers)
    ex.apply(plan)
    runs = []
    handles = [
        block.register_forward_pre_hook(lambda m, a, i=i: runs.append(i))
        for i, block in enumerate(model.blocks)
    ]
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    assert_same_step(model, ref, X, loss_fn=loss_fn)
    same_buffers(model, ref)
    torch.manual_seed(1)
    loss = loss_fn(model, X)
    runs.clear()
    clones = _Clones(list(model.buffers()))
    with clones:
        loss.backward()
    for h in handles:
        h.remove()
    per_block = len(list(model.blocks[0].buffers()))  # mean, var, count
    assert runs and clones.count == per_block * len(runs)
