"""The typed boundary to the C planner: the planning problem as one value
(``memscale._solve.PlanProblem``) and its one solver call (that no other
module calls ``_core.build_plan`` is checked in tests/test_imports.py)."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import mlp

import memscale
from memscale import _core, _hardware, _model, _planning
from memscale._solve import OffloadInputs, PlanProblem, SolverInputs, solve

LAYERS = tuple(
    _core.LayerStats((f"h.{i}", "Block", 1000, 40_000, 4_000, 1e6 * (i + 1), 0)) for i in range(4)
)
PROBLEM = PlanProblem(
    layers=LAYERS,
    mode="balanced",
    allowed=_core.TECH_CHECKPOINT | _core.TECH_OFFLOAD,
    force=False,
    budget_bytes=120_000,
    fixed_bytes=10_000,
    activation_bytes=170_000,
    total_flops=1e7,
    device="cpu",
    device_count=1,
    capacity_bytes=1 << 30,
)
SOLVER = SolverInputs(
    flop_rate=5e10,
    offload_bandwidth=7e8,
    async_offload=False,
    tile_overhead=3e-5,
    max_segment=64,
    resolution=512,
)
KEYWORDS = dict(
    mode="balanced",
    allowed=_core.TECH_CHECKPOINT | _core.TECH_OFFLOAD,
    force=False,
    budget_bytes=120_000,
    fixed_bytes=10_000,
    activation_bytes=170_000,
    total_flops=1e7,
    device="cpu",
    device_count=1,
    capacity_bytes=1 << 30,
)


def test_solve_is_build_plan_with_the_problem_as_keywords():
    assert solve(PROBLEM).to_json() == _core.build_plan(LAYERS, **KEYWORDS).to_json()
    offload = OffloadInputs(min_offload_bytes=1, host_tier=True, host_cap_bytes=50_000)
    with_all = PROBLEM.replace(
        peak_offset_bytes=-5, plan_offset_bytes=7, offload=offload, solver=SOLVER
    )
    expected = _core.build_plan(
        list(LAYERS),
        **KEYWORDS,
        peak_offset_bytes=-5,
        plan_offset_bytes=7,
        min_offload_bytes=1,
        host_tier=True,
        host_cap_bytes=50_000,
        disk_tier=True,
        solver=True,
        flop_rate=5e10,
        offload_bandwidth=7e8,
        async_offload=False,
        tile_overhead=3e-5,
        max_segment=64,
        resolution=512,
    )
    plan = solve(with_all)
    assert plan.to_json() == expected.to_json()
    assert plan.layers[0].rule == "solver"
    assert (plan.peak_offset_bytes, plan.plan_offset_bytes) == (-5, 7)


def test_a_problem_is_a_frozen_picklable_value():
    problem = PROBLEM.replace(solver=SOLVER, offload=OffloadInputs(host_tier=True))
    again = pickle.loads(pickle.dumps(problem))
    assert again == problem and hash(again) == hash(problem)
    assert all(type(layer) is _core.LayerStats for layer in again.layers)
    with pytest.raises(AttributeError):
        problem.budget_bytes = 1  # type: ignore[misc]
    assert PROBLEM.replace(budget_bytes=5).budget_bytes == 5
    assert PROBLEM.budget_bytes == 120_000


def test_problem_variants():
    flagged = PROBLEM.with_layer_flags([1, 3], _core.LAYER_UNREPEATABLE)
    assert [layer.flags for layer in flagged.layers] == [0, 8, 0, 8]
    assert flagged.layers[1][:6] == LAYERS[1][:6]
    assert [layer.rule for layer in solve(flagged.replace(force=True)).layers] == [
        "force-all",
        "ineligible:unrepeatable",
        "force-all",
        "ineligible:unrepeatable",
    ]
    half = PROBLEM.scaled_activations(0.5)
    assert [(lay.saved_bytes, lay.input_bytes) for lay in half.layers] == [(20_000, 2_000)] * 4
    assert half.activation_bytes == 85_000
    assert [lay.flops for lay in half.layers] == [lay.flops for lay in LAYERS]


def test_the_problem_wrap_plans_from():
    model = mlp()
    x = torch.randn(4, 32)
    config = memscale.Config(enable_logging=False, force_optimize=True)
    memscale.wrap(model, config, sample_input=x)
    try:
        ex = model._memscale_executor
        problem = _planning.plan_problem(
            ex.profile,
            ex.config,
            ex.hardware,
            _model.fixed_bytes(model, None),
            ex.plan.peak_offset_bytes,
            ex.plan.plan_offset_bytes,
        )
        assert problem.layers == ex.profile.layers
        assert problem.device == "cpu" and problem.capacity_bytes == ex.hardware.capacity_bytes
        assert problem.offload == OffloadInputs(
            min_offload_bytes=problem.offload.min_offload_bytes, host_tier=False
        )
        assert problem.solver is not None and problem.solver.flop_rate == 5e10
        assert solve(problem).hash == ex.plan.hash
        assert ex.hardware == _hardware.detect("cpu")
    finally:
        memscale.detach(model)
