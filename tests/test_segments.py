"""Checkpoint segments: several consecutive units in one checkpoint frame,
recomputed together from the first unit's inputs (csrc/segment.c:
ms_segment_continue / ms_segment_finish / ms_segment_replay)."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from conftest import CNN, Block, assert_same_step, hook_count, mlp, tiny_gpt2, token_batch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memscale
from memscale import _core, _planning
from memscale._solve import solve

W = 32


class MBlock(Block):
    """A Block with a keyword mask (multiplied in) and a switch to fail."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__(W, p)
        self.boom = False

    @staticmethod
    def boom_glue(x):
        raise ValueError("boom")

    def forward(self, x, mask=None):
        if self.boom:
            raise ValueError("boom")
        out = super().forward(x)
        return out if mask is None else out * mask


class Chain(nn.Module):
    """stem -> blocks (the units, each with its own mask) -> head, with
    optional glue code between the blocks."""

    def __init__(self, depth: int = 4, glue=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(W, W)
        self.blocks = nn.ModuleList([MBlock() for _ in range(depth)])
        self.head = nn.Linear(W, W)
        self.glue = glue

    def forward(self, x, masks=None):
        x = self.stem(x)
        for i, block in enumerate(self.blocks):
            x = block(x, mask=None if masks is None else masks[i])
            if self.glue is not None:
                x = self.glue(x)
        return self.head(x)


def segment_plan(model, sample, frac=0.9, inflate=9, config=None, layers=None, **extra):
    """Wrap ``model``; return its executor and a plan (not yet applied)
    made from its profile with inflated input sizes, so that the budget
    planner makes segments."""
    memscale.wrap(model, config or memscale.Config(enable_logging=False), sample_input=sample)
    ex = model.__dict__["_memscale_executor"]
    problem = _planning.plan_problem(ex.profile, ex.config, ex.hardware, 0)
    rows = [
        (n, k, pb, sb, sb * inflate // 10, fl, fg) for (n, k, pb, sb, ib, fl, fg) in problem.layers
    ]
    rows = layers(rows) if layers is not None else rows
    tot = sum(row[3] for row in rows)
    offload = {k: extra.pop(k) for k in list(extra) if hasattr(problem.offload, k)}
    problem = problem.replace(
        layers=tuple(_core.LayerStats(row) for row in rows),
        fixed_bytes=0,
        activation_bytes=tot,
        peak_offset_bytes=0,
        budget_bytes=int(tot * frac),
        offload=dataclasses.replace(problem.offload, **offload),
        **extra,
    )
    plan = solve(problem)
    assert plan.fits
    return ex, plan


def segments(plan):
    return [layer.segment for layer in plan.layers]


def counters(ex, before=(0, 0)):
    """(frames opened, recomputes run) since ``before``."""
    return (ex.stats["checkpoint_frames"] - before[0], ex.stats["recomputes"] - before[1])


def same_buffers(a, b):
    for (name, x), (_, y) in zip(a.named_buffers(), b.named_buffers()):
        assert torch.equal(x, y), name


def chain_loss(masks=None):
    """The loss of a Chain, whose forward takes the masks beside the input."""
    return lambda m, x: m(x, masks).square().mean()


X = torch.randn(8, W, generator=torch.Generator().manual_seed(3))
IMG = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))


def test_gpt2_segment_two_steps():
    model = tiny_gpt2(dropout=0.1).train()
    ref = copy.deepcopy(model)
    ids = token_batch()
    ex, plan = segment_plan(model, ids, frac=0.7)
    assert segments(plan) == [0, 0, -1]
    ex.apply(plan)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    before = counters(ex)

    for seed in (1, 2):
        assert_same_step(model, ref, ids, seed)
        for opt in opts:
            opt.step()
    assert counters(ex, before) == (2, 2)  # one frame, one recompute per step
    assert ex.stats["active_frames"] == 0


def test_segment_covers_every_block_of_mlp():
    # The planner never puts the last unit in a segment (it cannot lower the
    # peak), so a head unit follows the four blocks; it claims large saved
    # bytes so that the planner keeps it and checkpoints 0..3 as one.
    model = nn.Sequential(*mlp(depth=4, p=0.1), nn.Linear(W, W)).train()
    ref = copy.deepcopy(model)

    def layers(rows):
        s = rows[0][3]
        rows = [(n, k, pb, s, 2 * s, fl, fg) for (n, k, pb, _, _, fl, fg) in rows]
        n, k, pb, _, ib, fl, fg = rows[-1]
        return rows[:-1] + [(n, k, pb, 6 * s, ib, fl, fg)]

    ex, plan = segment_plan(model, X, frac=0.85, layers=layers)
    assert segments(plan) == [0, 0, 0, 0, -1]
    ex.apply(plan)
    before = counters(ex)
    assert_same_step(model, ref, X)
    assert counters(ex, before) == (1, 1)


@pytest.mark.parametrize(
    "glue, frac, inflate, expected, frames",
    [
        (None, 0.9, 20, [0, 0, 0, -1], 1),  # the chain holds: one frame
        (None, 0.6, 5, [0, 0, 2, -1], 2),  # two segments back to back
        (lambda x: x * 1.0, 0.9, 20, [0, 0, 0, -1], 3),  # a new tensor: split
        (lambda x: x + 0.5, 0.9, 20, [0, 0, 0, -1], 3),
    ],
)
def test_glue_between_units_splits_segment(glue, frac, inflate, expected, frames):
    model = Chain(glue=glue).train()
    ref = copy.deepcopy(model)
    ex, plan = segment_plan(model, X, frac=frac, inflate=inflate)
    assert segments(plan) == expected
    ex.apply(plan)
    before = counters(ex)
    assert_same_step(model, ref, X, loss_fn=chain_loss())
    assert counters(ex, before) == (frames, frames)


def test_inplace_glue_between_units():
    """An in-place change of a unit's output between two units keeps the
    tensor object: the segment ends there (its version changed), since the
    replay would feed the next unit the unchanged output (found by review:
    silently wrong gradients before the version check)."""

    def glue(x):
        return x.add_(0.5)

    model = Chain(glue=glue).train()
    ref = copy.deepcopy(model)
    ex, plan = segment_plan(model, X, frac=0.9, inflate=20)
    assert segments(plan) == [0, 0, 0, -1]
    ex.apply(plan)
    before = counters(ex)
    assert_same_step(model, ref, X, loss_fn=chain_loss())
    # Each in-place glue ends the segment: the three units get a frame each.
    assert counters(ex, before) == (3, 3)


@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("factory, x, inflate", [(CNN, IMG, 9), (Chain, X, 20)])
def test_batchnorm_stats_and_retain_graph(factory, x, inflate, retain):
    # CNN: BatchNorm in every unit; the recompute must not count a batch
    # twice.  retain: a second backward recomputes the segment again.
    model = factory().train()
    ref = copy.deepcopy(model)
    ex, plan = segment_plan(model, x, frac=0.9, inflate=inflate)
    assert segments(plan)[:3] == [0, 0, -1 if factory is CNN else 0]
    ex.apply(plan)
    before = counters(ex)
    for seed in (0, 1):
        assert_same_step(model, ref, x, seed, retain_graph=retain)
    assert counters(ex, before) == (2, 4 if retain else 2)
    same_buffers(model, ref)


@pytest.mark.parametrize("where", ["unit", "glue"])
def test_exception_in_second_unit(where):
    model = Chain().train()
    ref = copy.deepcopy(model)
    ex, plan = segment_plan(model, X, frac=0.9, inflate=20)
    ex.apply(plan)
    if where == "unit":
        model.blocks[1].boom = True
    else:
        model.glue = MBlock.boom_glue  # after unit 0, the segment open
    with pytest.raises(ValueError, match="boom"):
        torch.manual_seed(0)
        model(X)
    assert ex.stats["active_frames"] == 0
    model.blocks[1].boom = False
    model.glue = None
    before = counters(ex)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "interrupted forward" clean-up
        assert_same_step(model, ref, X, seed=5, loss_fn=chain_loss())
    assert counters(ex, before) == (1, 1)
    assert ex.stats["active_frames"] == 0


@pytest.mark.parametrize("how", ["eval", "no_grad"])
def test_eval_and_no_grad_open_no_frames(how):
    model = Chain().train()
    ref = copy.deepcopy(model)
    ex, plan = segment_plan(model, X, frac=0.9, inflate=20)
    ex.apply(plan)
    before, outs = counters(ex), []
    for m in (model, ref):
        if how == "eval":
            m.eval()
        torch.manual_seed(0)
        with torch.no_grad():
            outs.append(m(X))
    assert torch.equal(*outs)
    assert counters(ex, before) == (0, 0)
    assert ex.stats["active_frames"] == 0


def test_detach_after_segmented_step():
    model = tiny_gpt2(dropout=0.1).train()
    ref = copy.deepcopy(model)
    ids = token_batch()
    ex, plan = segment_plan(model, ids, frac=0.7)
    ex.apply(plan)

    assert_same_step(model, ref, ids)
    memscale.detach(model)
    assert "_memscale_executor" not in model.__dict__
    assert hook_count(model) == 0
    for block in model.transformer.h:
        assert not block._forward_hooks and not block._forward_pre_hooks
    assert_same_step(model, ref, ids, seed=3)


@pytest.mark.parametrize("changed", [0, 1, "shared"])
def test_masks_stored_and_checked(changed):
    # Masks are stored inputs that are not chained: the first unit's by its
    # frame, later units' by continue_segment; "shared": one mask to the
    # segment's units (unit 3, not checkpointed, would make autograd fail).
    model = Chain().train()
    ref = copy.deepcopy(model)
    ex, plan = segment_plan(model, X, frac=0.9, inflate=20)
    ex.apply(plan)
    if changed == "shared":
        masks = [torch.full((W,), 0.5)] * 3 + [None]  # units 0..2 only
    else:
        masks = [torch.full((W,), 0.5 + i / 8) for i in range(4)]
    before = counters(ex)
    assert_same_step(model, ref, X, loss_fn=chain_loss(masks))
    assert counters(ex, before) == (1, 1)
    torch.manual_seed(0)
    loss = model(X, masks).square().mean()
    masks[0 if changed == "shared" else changed].mul_(2.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


@pytest.mark.parametrize("async_io", [False, True])
def test_segment_input_offloaded_to_disk(tmp_path, async_io):
    model = Chain().train()
    ref = copy.deepcopy(model)
    config = memscale.Config(
        enable_logging=False,
        mode="balanced",
        async_offload=async_io,
        async_config=memscale.AsyncOffloadConfig(min_offload_bytes=0, spill_dir=str(tmp_path)),
    )
    # A budget of 60% of the activations makes the planner offload the
    # first segment's input (at 70% checkpointing alone fits).
    ex, plan = segment_plan(
        model,
        X,
        frac=0.6,
        config=config,
        mode="balanced",
        disk_tier=True,
        min_offload_bytes=0,
        allowed=_core.TECH_CHECKPOINT | _core.TECH_OFFLOAD,
    )
    offloaded = [lay.index for lay in plan.layers if lay.tier == "disk"]
    assert offloaded == [0], [(lay.segment, lay.tier) for lay in plan.layers]
    assert all(plan.layers[i].segment == i for i in offloaded)  # segment starts
    n_segments = len({lay.segment for lay in plan.layers if lay.segment >= 0})
    memscale._offload.attach(ex, ex.config, plan)
    ex.apply(plan)
    store = ex.offload_store
    assert store is not None
    before = counters(ex)
    for seed in (0, 1):
        assert_same_step(model, ref, X, seed, loss_fn=chain_loss())
    assert counters(ex, before) == (2 * n_segments, 2 * n_segments)
    # Only the offloaded segments' first inputs (8 x 32 float32) went to
    # disk, each step.
    assert store.stats["tensors_written"] == 2 * len(offloaded)
    assert store.stats["tensors_read"] == 2 * len(offloaded)
    assert store.stats["bytes_written"] == 2 * len(offloaded) * X.numel() * 4
    memscale.detach(model)


def rng_states(ex, before=0):
    """CPU RNG states the executor's checkpoints recorded since ``before``."""
    return ex.stats["rng_states"] - before


def draw(x):
    """Glue that draws from the CPU generator and hands the unit's output on
    unchanged: the segment holds, but the next unit starts from another RNG
    state than the one the unit before it ended with."""
    torch.rand(3)
    return x


class _Equals(TorchDispatchMode):
    """Counts the ``aten.equal`` calls on RNG states (byte tensors of the
    CPU generator's state's size) dispatched while entered."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.size = torch.get_rng_state().numel()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.equal.default and all(
            a.dtype == torch.uint8 and a.numel() == self.size for a in args
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("glue, states", [(None, 1), (draw, 3)])
def test_segment_records_rng_state_only_where_generator_moved(glue, states):
    """Dropout in every unit of one segment (units 0..2).  Nothing drawn
    between the units: the segment records one RNG state, its first unit's,
    and the replay of each later unit starts where the previous unit's
    recompute left the generator.  A draw in the parent's forward between
    the units: each later unit records the state it started from, and the
    replay sets it (without, its dropout masks would differ from the
    forward's and so would the gradients)."""
    model = Chain(glue=glue).train()
    ref = copy.deepcopy(model)
    ex, plan = segment_plan(model, X, frac=0.9, inflate=20)
    assert segments(plan) == [0, 0, 0, -1]
    ex.apply(plan)
    before, kept = counters(ex), rng_states(ex)
    with _Equals() as equals:
        for seed in (0, 1):
            assert_same_step(model, ref, X, seed, loss_fn=chain_loss())
    assert counters(ex, before) == (2, 2)  # one frame, one recompute per step
    assert rng_states(ex, kept) == 2 * states
    # The states are compared byte for byte in place: no torch.equal
    # dispatched (under a fake-tensor mode each would make fake twins).
    assert equals.count == 0


def _segment_head(blocks):
    """blocks[0:3] under one torch.utils.checkpoint, as checkpoint_sequential
    runs a segment, the other two replaced by pass-throughs."""
    from memscale.benchmarks.sweep import _Passthrough, _SegmentHead

    return nn.ModuleList(
        [_SegmentHead(list(blocks[:3])), _Passthrough(), _Passthrough(), blocks[3]]
    )


def _forward_bytes(model, x):
    """Bytes a training forward leaves alive for backward (the loss and its
    graph kept), measured exactly from the allocator's events."""
    from memscale.benchmarks.measure import measure_peak

    kept = []

    def forward():
        torch.manual_seed(0)
        kept.append(model(x).square().mean())

    report = measure_peak(forward, model=model, inputs=(x,))
    kept.clear()
    return report.end_delta_bytes


@pytest.mark.parametrize("glue", [None, draw])
def test_segment_keeps_one_rng_state(glue):
    """What a segment of three units keeps for backward, measured: what
    torch's checkpoint of the same three blocks keeps (their first input and
    one RNG state), and one RNG state more for each unit that starts after
    a draw from the generator."""
    model = Chain(glue=glue).train()
    ref = copy.deepcopy(model)
    ref.blocks = _segment_head(ref.blocks)
    ex, plan = segment_plan(model, X, frac=0.9, inflate=20)
    assert segments(plan) == [0, 0, 0, -1]
    ex.apply(plan)
    state = torch.get_rng_state().untyped_storage().nbytes()
    extra = 2 if glue is draw else 0
    assert _forward_bytes(model, X) == _forward_bytes(ref, X) + extra * state


class ModeChain(Chain):
    """A Chain whose second block runs under another grad or autocast mode
    than the others (a frozen block under no_grad, a block under bf16
    autocast)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.active = False  # as a Chain while it is profiled and planned

    def forward(self, x, masks=None):
        x = self.stem(x)
        for i, block in enumerate(self.blocks):
            if i != 1 or not self.active:
                x = block(x)
            elif self.mode == "no_grad":
                with torch.no_grad():
                    x = block(x)
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    x = block(x).float()
        return self.head(x)


@pytest.mark.parametrize("mode, frames, recomputes", [("no_grad", 2, 1), ("autocast", 3, 3)])
def test_a_unit_in_another_mode_ends_the_segment(mode, frames, recomputes):
    """The replay runs every unit of a segment with grad on and under the
    first unit's autocast; a unit that ran otherwise would be replayed
    otherwise, and its saved tensors would not line up with the forward's
    (found by review: before, it joined the segment, and with blocks of one
    shape the backward of the next block got its activations).  It ends
    the segment: under no_grad it gets no frame (and backward never reaches
    block 0's frame: nothing before the no_grad block gets a gradient),
    under autocast a frame of its own."""
    model = ModeChain(mode).train()
    ref = copy.deepcopy(model)
    ex, plan = segment_plan(model, X, frac=0.9, inflate=20)
    assert segments(plan) == [0, 0, 0, -1]  # blocks 0 to 2: one segment
    ex.apply(plan)
    model.active = ref.active = True
    before = counters(ex)
    for seed in (0, 1):
        assert_same_step(model, ref, X, seed)
    assert counters(ex, before) == (2 * frames, 2 * recomputes)
    assert ex.stats["active_frames"] == 0
