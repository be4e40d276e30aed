"""The early stop: a recompute stops once every tensor backward needs from
its layer exists again, so the ops after the layer's last saved tensor
(its tail, ``LayerStats.tail_flops``) are not rerun.  The profile measures
the tail, the planner charges a layer checkpointed alone its recompute less
its tail and a segment its layers' recomputes less its last layer's tail,
and the plan's predicted recompute is the one FlopCounterMode counts."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import FORCE, assert_same_step, loss_of, tiny_gpt2, tiny_llama, token_batch
from torch.utils.flop_counter import FlopCounterMode

import memscale
from memscale import _planning, _selective
from memscale._solve import layer_stats, solve

# tiny_llama's sizes and token_batch's: 2 x 16 tokens.
HIDDEN, INTER, TOKENS = 64, 128, 2 * 16


def _step_flops(model, ids, seed=0):
    """FLOPs of one training step (forward, backward and any recompute)."""
    counter = FlopCounterMode(display=False)
    with counter:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss_of(model, ids).backward()
    return counter.get_total_flops()


def _recomputed(model, ref, ids):
    """What the wrapped model's step counts beyond its unwrapped twin's:
    the recompute (a step runs first, so that the first step's recompute
    check is not counted)."""
    assert_same_step(model, ref, ids, seed=0)  # gradients bitwise equal
    return _step_flops(model, ids, 1) - _step_flops(ref, ids, 1)


def test_llama_block_tail_is_its_down_projection():
    """A Llama block ends with down_proj (a matmul whose inputs autograd
    saves before it runs) and the residual add (which saves nothing): a
    recompute stops before both."""
    model = tiny_llama()
    memscale.wrap(model, FORCE, sample_input={"input_ids": token_batch()})
    layers = model._memscale_executor.profile.layers
    assert len(layers) == 2
    for layer in layers:
        assert layer.tail_flops == 2 * TOKENS * INTER * HIDDEN
        assert layer.tail_cost is None  # the default costs: tail_flops
    memscale.detach(model)


def test_gpt2_block_saves_to_its_end():
    """A GPT-2 block with dropout saves the residual dropout's mask after
    its last matmul: only the residual add (no FLOPs) is left unrun."""
    model = tiny_gpt2(dropout=0.1)
    memscale.wrap(model, FORCE, sample_input={"input_ids": token_batch()})
    assert all(layer.tail_flops is None for layer in model._memscale_executor.profile.layers)
    memscale.detach(model)


def test_predicted_recompute_of_single_layers_is_counted():
    """Every block checkpointed alone: the plan's recompute (its ratio of
    the forward's FLOPs) is what FlopCounterMode counts in the step."""
    model = tiny_llama()
    ref = copy.deepcopy(model)
    ids = token_batch()
    memscale.wrap(model, FORCE, sample_input={"input_ids": ids})
    ex = model._memscale_executor
    plan = ex.plan
    assert [layer.segment for layer in plan.layers] == [0, 1]
    layers = ex.profile.layers
    predicted = plan.recompute_ratio * plan.total_flops
    assert predicted == pytest.approx(sum(x.flops - x.tail_flops for x in layers), rel=1e-12)
    assert _recomputed(model, ref, ids) == pytest.approx(predicted, rel=1e-12)
    memscale.detach(model)


def _segment_plan(ex):
    """A plan of ``ex``'s profile (three blocks) that checkpoints the first
    two as one segment: the blocks' inputs taken as 90% of what they save
    (so keeping one input for two pays), the budget 75% of what they save
    (the segment holds 0.9 + 1 (the third block, kept) and recomputes 2;
    two single blocks would hold 0.9 + 0.9 + 1)."""
    problem = _planning.plan_problem(ex.profile, ex.config, ex.hardware, 0)
    layers = tuple(
        layer_stats((*x[:4], x.saved_bytes * 9 // 10, x.flops, x.flags), x, backward_bytes=0)
        for x in problem.layers
    )
    total = sum(x.saved_bytes for x in layers)
    problem = problem.replace(
        layers=layers,
        force=False,  # (FORCE's rules checkpoint each block alone)
        fixed_bytes=0,
        activation_bytes=total,
        peak_offset_bytes=0,
        plan_offset_bytes=0,
        budget_bytes=int(total * 0.75),
    )
    return solve(problem)


def test_predicted_recompute_of_a_segment_is_counted():
    """Two blocks in one segment: the recompute replays the first block
    whole and stops early in the second only, as the plan predicts."""
    model = tiny_llama(num_hidden_layers=3)
    ref = copy.deepcopy(model)
    ids = token_batch()
    memscale.wrap(model, FORCE, sample_input={"input_ids": ids})
    ex = model._memscale_executor
    plan = _segment_plan(ex)
    assert plan.fits and [layer.segment for layer in plan.layers] == [0, 0, -1]
    ex.apply(plan)
    first, last, _ = ex.profile.layers
    assert last.tail_flops > 0
    predicted = plan.recompute_ratio * plan.total_flops
    assert predicted == pytest.approx(first.flops + last.flops - last.tail_flops, rel=1e-12)
    assert _recomputed(model, ref, ids) == pytest.approx(predicted, rel=1e-12)
    memscale.detach(model)


def test_selective_recompute_stops_early_too():
    """torch's checkpoint stops a selective recompute at the same point:
    a layer whose last op is a matmul that saves its inputs, kept by no
    level, is not run again (its level's cost leaves it out)."""
    torch.manual_seed(0)
    w1 = torch.randn(16, 32, requires_grad=True)
    w2 = torch.randn(32, 16, requires_grad=True)

    def block(x):
        return (x @ w1).relu() @ w2  # the last mm saves its inputs first

    x = torch.randn(8, 16, requires_grad=True)
    plain = FlopCounterMode(display=False)
    with plain:
        block(x).sum().backward()
    # A threshold no op reaches: every op is recomputed, but the last mm.
    out = _selective.run(block, float("inf"), (x,), {})
    counter = FlopCounterMode(display=False)
    with counter:
        out.sum().backward()
    first_mm = 2 * 8 * 16 * 32
    backward = plain.get_total_flops() - 2 * first_mm  # (both mms: same FLOPs)
    assert counter.get_total_flops() == backward + first_mm


def test_tail_is_left_out_of_selective_levels():
    """A level's recompute cost counts no op of the tail; the tail's own
    figures: counted FLOPs, and the cost as recompute_cost weighs it."""
    # (FLOPs, bytes written, elements, random) per call: a costly op, a
    # cheap one, then the tail: a matmul and an op without a formula.
    calls = [
        (100.0, 10, 5, False),
        (0.0, 40, 10, False),
        (50.0, 10, 5, False),
        (0.0, 40, 10, False),
    ]
    ops = _selective.LayerOps(list(calls), tail={2, 3})
    # Keep op 0 (10 FLOPs/byte): recompute op 1's 10 elements (not the
    # tail's 50 + 10); keep ops 0 and 2: the same recompute.
    ten, five = _selective.rate(100.0, 10), _selective.rate(50.0, 10)  # 10 and 5 FLOPs/byte
    assert _selective.layer_profile(ops, 150.0, 200) == ((ten, 10, 10.0), (five, 20, 10.0))
    whole = _selective.layer_profile(_selective.LayerOps(list(calls)), 150.0, 200)
    assert whole == ((ten, 10, 70.0), (five, 20, 20.0))
    assert _selective.tail(ops, 150.0) == (50.0, 50.0)
    weights = (1.0, 1.0, 3.0)  # an element costs 3 matmul FLOPs
    assert _selective.recompute_cost(ops, 150.0, weights) == 190.0
    assert _selective.tail(ops, 150.0, weights) == (50.0, 70.0)
    assert _selective.tail(_selective.LayerOps(list(calls)), 150.0) == (0.0, 0.0)
