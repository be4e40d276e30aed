"""Selective checkpointing inside a layer (memscale._selective): the op
profile, the planner's choice, bitwise gradients (dropout replayed), and
nothing left behind by detach, copies or an error."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from conftest import (
    Attention,
    Block,
    adamw_step_peak,
    assert_same_step,
    hook_count,
    mlp,
    saved_tensor_hooks,
    tiny_gpt2,
)

import memscale
from memscale import _core, _planning, _selective, _torch_compat
from memscale._measure import measure_peak

GIB = 2**30
X = torch.randn(8, 64, 32, generator=torch.Generator().manual_seed(0))
ROWS = 8 * 64


def _level(ratio, nbytes):
    """The threshold of the level whose last kept output costs ``ratio``
    FLOPs per byte and has ``nbytes`` bytes (``_selective.rate``)."""
    return _selective.rate(ratio * nbytes, nbytes)


FC2_LEVEL = _level(64.0, ROWS * 32 * 4)  # fc2's output (128 -> 32)
FC1_LEVEL = _level(16.0, ROWS * 128 * 4)  # fc1's (32 -> 128)


def _units(model):
    return list(model.named_children())


def _unoptimized_peak(factory, x) -> int:
    model = factory()
    model.train()
    p = memscale.predict_peak(model, x, config=memscale.Config(memory_budget_gb=100))
    return p.unoptimized.peak_bytes


_PEAKS: dict[str, int] = {}


def _budget(name, factory, x, frac) -> float:
    if name not in _PEAKS:
        _PEAKS[name] = _unoptimized_peak(factory, x)
    return _PEAKS[name] * frac / GIB


def _mlp():
    m = mlp(depth=4, width=32, p=0.1)
    m.train()
    return m


def _wrapped(factory, x, frac, mode="balanced", name=None):
    budget = _budget(name or factory.__name__, factory, x, frac)
    model, ref = factory(), factory()
    ref.load_state_dict(model.state_dict())
    memscale.wrap(model, memscale.Config(mode=mode, memory_budget_gb=budget), sample_input=x)
    return model, ref


def _techniques(model):
    return [layer.techniques for layer in model._memscale_executor.plan.layers]


def _mse(model, x):
    return model(x).float().pow(2).mean()


# ------------------------------------------------------------- the policy


def test_the_policy_keeps_costly_outputs_and_never_random_ones():
    assert _selective.keeps(10.0, flops=100.0, nbytes=10, random=False)
    assert not _selective.keeps(10.0, flops=99.0, nbytes=10, random=False)
    assert not _selective.keeps(10.0, flops=1e9, nbytes=10, random=True)
    assert not _selective.keeps(0.0, flops=0.0, nbytes=10, random=False)  # no FLOP formula
    assert _selective.threshold(100.0, 10) == 10.0
    assert _selective.threshold(100.0, 0) == float("inf")


def test_profile_of_an_mlp_block_is_a_ladder_of_the_matmul_outputs():
    """Block: fc1 (32 -> 128), GELU, dropout, fc2 (128 -> 32), add.  fc2
    costs 64 FLOPs per byte it writes (2 x 128 per 4-byte element), fc1
    16; but fc2 and the add are the layer's tail (fc2's inputs are its
    last saved tensors), which no recompute runs, so no level keeps fc2's
    output (it would be held for nothing) and the level at 64 keeps
    nothing: one level, fc1's output kept (the layer's own threshold is
    below 16).  GELU and dropout (output and mask) are recomputed, at one
    per element.  The profile says where the tail starts (fc2's call), for
    the selective run to keep nothing from there on."""
    model = _mlp()
    profile = _planning.profile_upfront(model, _units(model), X, memscale.Config())
    gelu, dropout_out, dropout_mask = 128, 128, 128
    cheap = ROWS * (gelu + dropout_out + dropout_mask)
    fc1 = 2 * ROWS * 32 * 128
    for layer in profile.layers:
        assert layer.flops == 2 * fc1
        assert _selective.threshold(layer.flops, layer.saved_bytes) < 16.0
        assert layer.selective_levels == ((FC1_LEVEL, ROWS * 128 * 4, cheap),)
    for detail in profile.details:
        assert detail["tail_op"] == "aten.addmm.default"  # fc2's
        assert _planning.tail_from(detail) == ("aten.addmm.default", 1)  # fc1's is the first
        # Held run selective: its input and the kept outputs, less than kept.
        assert layer.input_bytes + layer.selective_levels[-1][1] < layer.saved_bytes


def test_levels_keep_more_and_recompute_less_in_turn():
    """The ladder from made-up op records: levels in decreasing threshold,
    each keeping more bytes and recomputing less (an op with no formula
    counts one per element), random ops never kept, of equal ratios the
    smaller output first (a level of its own), and none past an op whose
    output is written in place."""
    calls = [
        (800.0, 8, 2, False),  # 100 FLOPs per byte
        (400.0, 8, 2, False),  # 50
        (4000.0, 80, 20, False),  # 50, with the one above
        (100.0, 10, 3, False),  # 10
        (9e9, 4, 1, True),  # random: never kept
        (0.0, 40, 10, False),  # no formula: one per element
        (10.0, 10, 3, False),  # 1
    ]
    ops = _selective.LayerOps(calls)
    levels = _selective.layer_profile(ops, flops=1e4, saved_bytes=1000)
    by_rate = [_level(100.0, 8), _level(50.0, 8), _level(50.0, 80), _level(10.0, 10)]
    assert [t for t, _, _ in levels] == [*by_rate, _level(1.0, 10)]
    assert by_rate[1] > by_rate[2]  # the 8 bytes before the 80
    assert [b for _, b, _ in levels] == [8, 16, 96, 106, 116]
    rest = 9e9 + 10  # the random op and the op without a formula
    assert [f for _, _, f in levels] == [
        4510.0 + rest,
        4110.0 + rest,
        110.0 + rest,
        10.0 + rest,
        rest,
    ]
    # Written in place later: the level keeping call 3 and those after go.
    ops.mutated.add(3)
    assert [t for t, _, _ in _selective.layer_profile(ops, 1e4, 1000)] == by_rate[:3]
    ops.mutated.add(0)
    assert _selective.layer_profile(ops, 1e4, 1000) is None
    # A level keeping as much as the layer saves is no better than keeping it.
    ops.mutated.clear()
    assert [b for _, b, _ in _selective.layer_profile(ops, 1e4, 106)] == [8, 16, 96]
    # At most `limit` levels: the first, the last, the layer's own
    # threshold's (here 10: flops over saved bytes), the rest by bytes.
    picked = _selective.layer_profile(ops, flops=1e4, saved_bytes=1000, limit=3)
    assert [t for t, _, _ in picked] == [by_rate[0], by_rate[3], _level(1.0, 10)]


class _Calls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_attention_at_dropout_0_draws_nothing_and_is_kept(monkeypatch):
    """The attention kernels are tagged random for their dropout alone: at
    ``dropout_p == 0`` (passed or by default) they draw nothing, so a level
    may keep their output; above 0 they are random; cuDNN's stays random.
    torch's FLOP counter has no formula for the CPU kernel (the CUDA ones
    have one): given the CUDA flash kernel's here, SDPA at dropout 0
    writes out + logsumexp (8 x 4 x 64 x (8 + 1) floats) for 4 x 8 x 64 x
    64 x 8 FLOPs, about 56.9 per byte, above both projections' 16, so the
    first level keeps exactly its outputs.  Run at that level, the
    recompute does not run the kernel again and the gradients are bitwise
    the plain block's."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    q = torch.randn(2, 2, 8, 4)
    cpu = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert not _selective.draws_random(cpu, (q, q, q), {})
    assert not _selective.draws_random(cpu, (q, q, q, 0.0), {})
    assert _selective.draws_random(cpu, (q, q, q, 0.1), {})
    assert _selective.draws_random(cpu, (q, q, q), {"dropout_p": 0.1})
    efficient = aten._scaled_dot_product_efficient_attention.default
    assert not _selective.draws_random(efficient, (q, q, q, None, True), {})
    assert _selective.draws_random(efficient, (q, q, q, None, True, 0.5), {})
    cudnn = aten._scaled_dot_product_cudnn_attention.default
    assert _selective.draws_random(cudnn, (q, q, q, None, True), {})
    assert _selective.draws_random(aten.native_dropout.default, (q, 0.0, True), {})
    assert not _selective.draws_random(aten.mm.default, (q, q), {})

    assert aten._scaled_dot_product_flash_attention_for_cpu not in flop_registry
    monkeypatch.setitem(
        flop_registry,
        aten._scaled_dot_product_flash_attention_for_cpu,
        flop_registry[aten._scaled_dot_product_flash_attention],
    )
    x = torch.randn(8, 64, 32, generator=torch.Generator().manual_seed(4))
    block = Attention(p=0.0)
    block.train()
    with _selective.OpRecorder([block]) as rec:
        block(x)
    rec.close()
    levels = _selective.layer_profile(rec.ops[0], flops=1e9, saved_bytes=10**9)
    attention_out = 8 * 4 * 64 * (8 + 1) * 4
    threshold, kept, _ = levels[0]
    assert kept == attention_out and 56.0 < threshold < 57.0

    plain = Attention(p=0.0)
    plain.train()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = _selective.run(block.forward, threshold, (xa,), {})
    calls = _Calls()
    with calls:
        out.pow(2).mean().backward()
    assert "_scaled_dot_product_flash_attention_for_cpu.default" not in calls.names
    assert "_scaled_dot_product_flash_attention_for_cpu_backward.default" in calls.names
    assert "addmm.default" in calls.names  # the projections are recomputed
    plain(xb).pow(2).mean().backward()
    assert torch.equal(xa.grad, xb.grad)
    for a, b in zip(block.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("name", sorted(_torch_compat._GROUPED_SDPA))
def test_grouped_query_attention_is_counted_as_its_expanded_heads(monkeypatch, name):
    """torch's formulas for the fused attention kernels asserted equal head
    counts before torch 2.13 (seen on torch 2.11 on an H100: with
    grouped-query attention, fewer key/value heads, as Hugging Face's SDPA
    path calls the CUDA kernels, FlopCounterMode raised inside a real
    forward).  memscale's formulas count such a call as the same call with
    its keys and values expanded to the query's heads, forward and
    backward.  Here each kernel's formula is replaced by a stand-in as
    strict as torch 2.11's, which finds the query, key and value by their
    names in the operator's schema: called through memscale's counter with
    2 key/value heads against 8 query heads, it sees 8 everywhere."""
    from torch.utils.flop_counter import flop_registry

    packet = getattr(torch.ops.aten, name)
    names = [a.name for a in packet.default._schema.arguments]
    at = {role: names.index(role) for role in ("query", "key", "value")}
    query, kv = _torch_compat._GROUPED_SDPA[name]
    assert (query, kv) == (at["query"], (at["key"], at["value"]))
    seen = []

    def strict(*args, out_val=None, **kwargs):  # torch 2.11's check, shapes or tensors
        heads = [tuple(getattr(args[i], "shape", args[i]))[1] for i in at.values()]
        assert len(set(heads)) == 1, "query/key/value shapes are incompatible"
        seen.append(heads)
        return 7

    monkeypatch.setitem(flop_registry, packet, strict)
    q = torch.empty(2, 8, 16, 32, device="meta")
    kv_grouped = torch.empty(2, 2, 16, 32, device="meta")
    args = [None] * len(names)
    for role, i in at.items():
        args[i] = q if role == "query" else kv_grouped
    if at["query"] == 1:  # a backward: grad_out first
        args[0] = q
    with pytest.raises(AssertionError):
        strict(*args)
    seen.clear()
    assert _torch_compat.flop_formula(packet.default)(*args, out_val=None) == 7
    with _torch_compat.flop_counter() as counter:
        assert counter.flop_registry[packet](*args, out_val=None) == 7
    assert seen == [[8, 8, 8], [8, 8, 8]]


def test_the_attention_formulas_count_as_torch_s_own_here():
    """On this torch the wrapped formulas count what torch's own do, with
    and without grouped-query shapes (torch 2.13 counts grouped calls as
    their expanded heads itself), and every other operator keeps torch's
    formula (or none)."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    q = torch.empty(2, 8, 16, 32, device="meta")
    kv = torch.empty(2, 2, 16, 32, device="meta")
    flash = aten._scaled_dot_product_flash_attention
    count = _torch_compat.flop_formula(flash.default)
    expected = flop_registry[flash](q, q, q, out_val=None)
    assert count(q, kv, kv, out_val=None) == expected > 0
    assert count(q, q, q, out_val=None) == expected
    if _torch_compat.torch_version() >= (2, 13):
        # torch 2.11's own formula asserts on grouped shapes (the wrapped
        # one above counts them all the same).
        assert flop_registry[flash](q, kv, kv, out_val=None) == expected
    assert _torch_compat.flop_formula(aten.mm.default) is flop_registry[aten.mm]
    assert _torch_compat.flop_formula(aten.relu.default) is None


def test_attention_with_dropout_is_never_kept():
    """With dropout on, SDPA runs its math path on the CPU (a ``bernoulli_``
    draw): nothing random is kept, and at every level the recompute draws
    the same mask (the RNG state restored): bitwise gradients."""
    x = torch.randn(8, 64, 32, generator=torch.Generator().manual_seed(4))
    block, plain = Attention(p=0.2), Attention(p=0.2)
    for m in (block, plain):
        m.train()
    with _selective.OpRecorder([block]) as rec:
        block(x)
    rec.close()
    ops = rec.ops[0]
    assert any(random for _, _, _, random in ops.calls)
    levels = _selective.layer_profile(ops, flops=1e9, saved_bytes=10**9)
    for threshold, _, _ in levels:
        torch.manual_seed(11)
        xa = x.clone().requires_grad_()
        _selective.run(block.forward, threshold, (xa,), {}).pow(2).mean().backward()
        torch.manual_seed(11)
        xb = x.clone().requires_grad_()
        plain(xb).pow(2).mean().backward()
        assert torch.equal(xa.grad, xb.grad)
        for a, b in zip(block.parameters(), plain.parameters()):
            assert torch.equal(a.grad, b.grad)
            a.grad = b.grad = None


def test_a_warmup_profile_has_no_selective_layers():
    """Profiles measured on real warm-up steps record no ops: no layer may
    run selective, and the planner never picks it."""
    model = _mlp()
    prof = _planning.new_warmup_profiler(model, _units(model))
    try:
        prof.begin_pass()
        _mse(model, X).backward()
        prof.end_pass(ok=True)
    finally:
        prof.detach()
    profile = _planning.profile_from(prof, _units(model), "warmup")
    assert all(layer.selective_levels is None for layer in profile.layers)


# ------------------------------------------------------------- the planner


def test_balanced_runs_layers_selective_where_it_pays_conservative_does_not():
    """At 80% of the unoptimized peak, two layers run selective (a few
    elementwise ops recomputed) instead of two checkpointed (their whole
    forward recomputed); CONSERVATIVE checkpoints whole layers only."""
    model, _ = _wrapped(_mlp, X, 0.8)
    plan = model._memscale_executor.plan
    assert _techniques(model) == [("selective",), ("selective",), (), ()]
    assert plan.fits and plan.peak_projected_bytes <= plan.budget_bytes
    assert all(layer.rule == "solver" for layer in plan.layers[:2])
    assert "selective" in model._memscale_executor.describe()
    assert '"techniques":["selective"]' in plan.to_json()
    selective_ratio = plan.recompute_ratio
    memscale.detach(model)
    model, _ = _wrapped(_mlp, X, 0.8, mode="conservative")
    cons = model._memscale_executor.plan
    assert all("selective" not in t for t in _techniques(model))
    assert cons.technique_counts["checkpoint"] == 2
    assert selective_ratio < cons.recompute_ratio / 10
    memscale.detach(model)


def test_the_plans_level_runs_with_its_threshold_and_tail():
    """At 70% of the unoptimized peak the planner runs three layers at
    their one level (fc1's output kept: threshold 16 FLOPs per byte, above
    the layer's own; fc2's not, it is the tail).  The plan JSON carries
    the level and its threshold, the executor runs each layer at its
    plan's threshold and its tail, the measured peak is within
    the budget and the gradients are bitwise, dropout replayed.  At 50% it
    checkpoints two layers alone and runs the third at that level (which
    now keeps less than it did with fc2's output, then all three were
    checkpointed), within the budget."""
    model, ref = _wrapped(_mlp, X, 0.7)
    plan = model._memscale_executor.plan
    assert _techniques(model) == [("selective",)] * 3 + [()]
    assert [(lp.selective_level, lp.selective_threshold) for lp in plan.layers] == [
        (0, FC1_LEVEL)
    ] * 3 + [(-1, 0.0)]
    assert f'"selective_level":0,"selective_threshold":{FC1_LEVEL!r}' in plan.to_json()
    seen = []
    run = _selective.run

    def spy(forward, threshold, args, kwargs, tail=None, unit=None, skip=()):
        seen.append((threshold, tail))
        return run(forward, threshold, args, kwargs, tail, unit, skip)

    _selective.run = spy
    try:
        for seed in range(2):
            assert_same_step(model, ref, X, seed=seed, loss_fn=_mse)
        report = measure_peak(lambda: _mse(model, X).backward(), model=model, inputs=X, warmup=1)
    finally:
        _selective.run = run
    assert seen and set(seen) == {(FC1_LEVEL, ("aten.addmm.default", 1))}
    assert report.start_bytes + report.peak_delta_bytes <= plan.budget_bytes
    memscale.detach(model)
    model, _ = _wrapped(_mlp, X, 0.5)
    plan = model._memscale_executor.plan
    assert _techniques(model) == [("checkpoint",)] * 2 + [("selective",), ()]
    assert [lp.segment for lp in plan.layers] == [0, 1, -1, -1]
    report = measure_peak(lambda: _mse(model, X).backward(), model=model, inputs=X, warmup=1)
    assert report.start_bytes + report.peak_delta_bytes <= plan.budget_bytes
    memscale.detach(model)


def test_a_selective_run_keeps_nothing_of_the_tail(monkeypatch, caplog):
    """One MLP block run at threshold 16 (fc1's and fc2's outputs both
    reach it): given the tail (from fc2's call, the second addmm, on), the forward
    leaves fc2's output out of what it keeps, ROWS x 32 x 4 bytes less
    held into backward; the gradients are the same bits either way.  A
    tail whose call never comes (a third addmm: another forward) leaves
    the run to the threshold alone, as without it, and a warning says so
    (once per process)."""
    monkeypatch.setattr(_selective, "_TAIL_WARNED", [])
    block = _mlp()[0]
    profile = _planning.profile_upfront(block, [("b", block)], X, memscale.Config())
    tail = _planning.tail_from(profile.details[0])
    assert tail == ("aten.addmm.default", 1)
    held = {}
    grads = {}
    for name, given in (("none", None), ("tail", tail), ("other", ("aten.addmm.default", 2))):
        x = X.clone().requires_grad_()
        box = []

        def forward(given=given, x=x, box=box):
            torch.manual_seed(7)
            box.append(_selective.run(block.forward, 16.0, (x,), {}, given))

        held[name] = measure_peak(forward, model=block, inputs=x).end_delta_bytes
        box.pop().pow(2).mean().backward()
        grads[name] = [x.grad, *(p.grad for p in block.parameters())]
        block.zero_grad(set_to_none=True)
    assert held["none"] - held["tail"] == ROWS * 32 * 4
    assert held["other"] == held["none"]
    warned = [r for r in caplog.records if "never made the call" in r.getMessage()]
    assert len(warned) == 1 and "call 3 of aten.addmm.default" in warned[0].getMessage()
    for a, b in zip(grads["none"], grads["tail"]):
        assert torch.equal(a, b)


def test_a_llama_block_keeps_nothing_of_its_tail_for_real():
    """On a Hugging Face Llama the fake pass that profiles the blocks runs
    more ops than a real forward before attention (the mask is built and
    grouped-query keys expanded: fake tensors cannot show the mask is not
    needed), so the tail is found by its op's occurrence, not its position:
    the seventh ``mm`` (``down_proj``).  At 80% of the unoptimized peak
    three blocks run selective; a real step then peaks within 0.1% of the
    prediction (it is 4% above it when the tail's outputs are kept)."""
    from conftest import tiny_llama

    def build():
        m = tiny_llama(num_hidden_layers=4, vocab_size=256)
        m.train()
        return m

    ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    base = memscale.predict_peak(build(), batch, config=memscale.Config(memory_budget_gb=100))
    model = build()
    config = memscale.Config(
        mode="balanced",
        enable_offloading=False,
        memory_budget_gb=base.unoptimized.peak_bytes * 0.8 / GIB,
        enable_logging=False,
    )
    memscale.wrap(model, config, sample_input=batch)
    try:
        executor = model._memscale_executor
        plan = executor.plan
        runs = [i for i, layer in enumerate(plan.layers) if "selective" in layer.techniques]
        assert runs
        regions = executor.__dict__["_compile_regions"].units
        assert {regions[i].tail for i in runs} == {("aten.mm.default", 6)}
        peak = adamw_step_peak(model, batch, lambda m, b: m(**b).loss)
        assert abs(peak - plan.peak_projected_bytes) <= plan.peak_projected_bytes / 1000
        assert peak <= plan.budget_bytes
    finally:
        memscale.detach(model)


def test_a_selective_recompute_is_told_and_simulated():
    """torch's checkpoint recomputes a selective layer by calling its
    forward, not the module, so no module hook sees the recompute:
    ``_selective.run(..., unit=)`` tells ``RECOMPUTE_LISTENERS`` when it
    starts and ends (outside torch's cached mode, once per backward, not in
    the forward; the end is told when the early stop ends it).  The
    simulation listens: a plan's selective layers have recompute marks
    (their recompute's peak, the RNG-state copy it holds), as checkpointed
    layers do."""
    from memscale._planner import PredictionSession

    block = _mlp()[0]
    told = []

    def listener(unit, starts):
        told.append((unit is block, starts))

    _selective.RECOMPUTE_LISTENERS.append(listener)
    try:
        x = X.clone().requires_grad_()
        out = _selective.run(block.forward, 16.0, (x,), {}, None, block)
        assert told == []
        out.pow(2).mean().backward()
        assert told == [(True, True), (True, False)]
    finally:
        _selective.RECOMPUTE_LISTENERS.remove(listener)

    budget = _budget("_mlp", _mlp, X, 0.7)
    config = memscale.Config(mode="balanced", memory_budget_gb=budget, enable_logging=False)
    with PredictionSession(_mlp(), X, config=config) as session:
        plan = session.plan(config)
        runs = [i for i, layer in enumerate(plan.layers) if "selective" in layer.techniques]
        assert runs == [0, 1, 2]
        assert sorted(session._steps.recompute_peaks(plan, config)) == runs
    assert _selective.RECOMPUTE_LISTENERS == []


def test_build_plan_picks_each_layers_level_by_the_budget():
    """Two layers (100 bytes saved, input 10) with three levels each
    (keep 10/30/60, recomputing 30/2/0.5 FLOPs): the first runs selective
    (the second kept: a selective backward after it would hold it too),
    at the highest level the budget allows; the plan's JSON and hash
    change with the level."""
    levels = ((64.0, 10, 30.0), (16.0, 30, 2.0), (4.0, 60, 0.5))
    layers = [
        _core.LayerStats((f"h.{i}", "Block", 0, 100, 10, 50.0, 0), {"selective_levels": levels})
        for i in range(2)
    ]
    kw = dict(
        mode="balanced",
        allowed=_core.TECH_CHECKPOINT | _core.TECH_SELECTIVE,
        force=False,
        fixed_bytes=0,
        activation_bytes=200,
        total_flops=100.0,
        device="cpu",
        device_count=1,
        capacity_bytes=10**6,
        solver=True,
        flop_rate=1.0,
    )
    seen = {}
    for budget, want in ((200, -1), (170, 2), (140, 1), (120, 0)):
        plan = _core.build_plan(layers, budget_bytes=budget, **kw)
        assert plan.fits, budget
        assert [lp.selective_level for lp in plan.layers] == [want, -1], budget
        threshold = levels[want][0] if want >= 0 else 0.0
        assert [lp.selective_threshold for lp in plan.layers] == [threshold, 0.0]
        assert f'"selective_level":{want},"selective_threshold":{threshold!r}' in plan.to_json()
        seen[plan.hash] = budget
    assert len(seen) == 4


def test_the_same_problem_gives_the_same_plan():
    a, _ = _wrapped(_mlp, X, 0.8)
    b, _ = _wrapped(_mlp, X, 0.8)
    pa, pb = a._memscale_executor.plan, b._memscale_executor.plan
    assert pa.to_json() == pb.to_json() and pa.hash == pb.hash
    memscale.detach(a)
    memscale.detach(b)


def test_enable_checkpointing_false_turns_selective_off_too():
    config = memscale.Config(mode="balanced", memory_budget_gb=1.0, enable_checkpointing=False)
    assert not _planning.allowed_techniques(config) & _core.TECH_SELECTIVE
    assert _planning.allowed_techniques(config.replace(enable_checkpointing=True)) & (
        _core.TECH_SELECTIVE
    )
    assert not _planning.allowed_techniques(
        config.replace(enable_checkpointing=True, mode="conservative")
    ) & (_core.TECH_SELECTIVE)


# ------------------------------------------------------------- bitwise


def test_selective_layers_give_bitwise_gradients_with_dropout():
    """Dropout (p=0.1) is recomputed with the RNG state restored: the same
    masks, the same gradients bit for bit, step after step."""
    model, ref = _wrapped(_mlp, X, 0.7)
    assert _techniques(model)[:3] == [("selective",)] * 3
    for seed in range(3):
        assert_same_step(model, ref, X, seed=seed, loss_fn=_mse)
    memscale.detach(model)


def test_selective_peak_is_measured_within_the_budget():
    model, ref = _wrapped(_mlp, X, 0.8)
    plan = model._memscale_executor.plan
    report = measure_peak(lambda: _mse(model, X).backward(), model=model, inputs=X, warmup=1)
    unopt = measure_peak(lambda: _mse(ref, X).backward(), model=ref, inputs=X, warmup=1)
    assert report.peak_delta_bytes < unopt.peak_delta_bytes
    assert report.start_bytes + report.peak_delta_bytes <= plan.budget_bytes
    memscale.detach(model)


def _gpt2():
    m = tiny_gpt2(dropout=0.1, n_layer=4, n_positions=256)
    m.train()
    return m


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=256,
            attention_dropout=0.1,
            use_cache=False,
        )
    )
    m.train()
    return m


def _lm_loss(model, x):
    return model(input_ids=x, labels=x).loss


@pytest.mark.slow
@pytest.mark.parametrize("factory", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_hf_models_run_selective_with_bitwise_gradients(factory):
    x = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(1))
    model, ref = _wrapped(factory, x, 0.8)
    techniques = _techniques(model)
    assert ("selective",) in techniques, techniques
    for seed in range(2):
        assert_same_step(model, ref, x, seed=seed, loss_fn=_lm_loss)
    memscale.detach(model)
    assert_same_step(model, ref, x, seed=5, loss_fn=_lm_loss)


# ------------------------------------------------- nothing left behind


def test_detach_restores_every_forward_and_hook():
    model, ref = _wrapped(_mlp, X, 0.8)
    assert hook_count(model) > 0
    assert all("forward" in unit.__dict__ for unit in model)
    memscale.detach(model)
    assert hook_count(model) == 0
    assert all("forward" not in unit.__dict__ for unit in model)
    assert saved_tensor_hooks() is None
    assert_same_step(model, ref, X, loss_fn=_mse)


def test_copies_of_a_model_with_selective_layers_are_plain():
    model, ref = _wrapped(_mlp, X, 0.8)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert hook_count(clone) == 0
        assert all("forward" not in unit.__dict__ for unit in clone)
        assert_same_step(clone, ref, X, loss_fn=_mse)
    assert _techniques(model)[0] == ("selective",)  # the original stays wrapped
    assert_same_step(model, ref, X, loss_fn=_mse)
    memscale.detach(model)


class _Failing(Block):
    fail = False

    def forward(self, x):
        y = super().forward(x)
        if _Failing.fail:
            raise KeyboardInterrupt  # as Ctrl-C inside the layer would
        return y


def test_an_interrupt_inside_a_selective_layer_leaves_nothing_behind():
    def factory():
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[_Failing(32, 0.1) for _ in range(4)])
        m.train()
        return m

    model, ref = _wrapped(factory, X, 0.8, name="failing")
    assert _techniques(model)[0] == ("selective",)
    _Failing.fail = True
    try:
        with pytest.raises(KeyboardInterrupt):
            _mse(model, X).backward()
    finally:
        _Failing.fail = False
    assert saved_tensor_hooks() is None
    assert_same_step(model, ref, X, loss_fn=_mse)
    memscale.detach(model)
    assert hook_count(model) == 0


@pytest.mark.slow
def test_compiled_a_selective_layer_is_a_checkpoint_region():
    """Under torch.compile the layer runs as a checkpoint region (listed in
    compile_fallbacks); gradients agree with the unwrapped model's."""
    model, ref = _wrapped(_mlp, X, 0.8)
    fallbacks = model._memscale_executor.compile_fallbacks
    assert [(f.layer, f.technique) for f in fallbacks] == [("0", "selective"), ("1", "selective")]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    for net in (compiled, ref):
        net.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        _mse(net, X).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    memscale.detach(model)
    torch._dynamo.reset()


def test_a_layer_that_updates_its_buffers_never_runs_selective():
    """BatchNorm's running statistics are written in its forward; torch's
    checkpoint would write them again in the recompute, so such a layer
    has no selective profile (the C checkpoint, which puts buffers back,
    may still checkpoint it)."""
    from conftest import CNN

    model = CNN()
    model.train()
    x = torch.randn(4, 3, 16, 16)
    profile = _planning.profile_upfront(
        model, list(model.blocks.named_children()), x, memscale.Config()
    )
    assert all(layer.selective_levels is None for layer in profile.layers)
    model.eval()  # no statistics written: a profile
    profile = _planning.profile_upfront(
        model, list(model.blocks.named_children()), x, memscale.Config()
    )
    assert all(layer.selective_levels is not None for layer in profile.layers)


# ------------------------------------------------ in-place ops, retain_graph


class _InplaceBlock(torch.nn.Module):
    """Block with an in-place activation (``relu_`` writes fc1's output, a
    kept matmul output) or an in-place dropout (it writes GELU's output,
    which is recomputed)."""

    def __init__(self, inplace_act: bool, width: int = 32, p: float = 0.1) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.act = torch.nn.ReLU(inplace=True) if inplace_act else torch.nn.GELU()
        self.drop = torch.nn.Dropout(p, inplace=not inplace_act)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(self.drop(self.act(self.fc1(x))))


def _relu_inplace():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[_InplaceBlock(True) for _ in range(4)]).train()


def _dropout_inplace():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[_InplaceBlock(False) for _ in range(4)]).train()


def test_an_inplace_op_on_a_kept_output_ends_the_ladder_there():
    """``nn.ReLU(inplace=True)`` writes fc1's output: torch's selective
    checkpoint refuses a mutated cached output in backward, so no level
    keeps it.  The one level left would keep only fc2's output, which is
    the layer's tail (no recompute reads it): no level, the layer is kept
    or checkpointed; whatever the plan runs, gradients are bitwise.
    Without the tail known by position, that level stays."""
    model = _relu_inplace()
    profile = _planning.profile_upfront(model, _units(model), X, memscale.Config())
    assert all(layer.selective_levels is None for layer in profile.layers)
    recorder = _selective.OpRecorder([model[0]])
    with recorder:
        model[0](X)
    recorder.close()
    ops = recorder.ops[0]
    assert ops.tail_start() is None  # recorded without the saved-tensor hooks
    levels = _selective.layer_profile(ops, flops=1e9, saved_bytes=10**9)
    assert [(t, b) for t, b, _ in levels] == [(FC2_LEVEL, ROWS * 32 * 4)]
    model, ref = _wrapped(_relu_inplace, X, 0.8)
    assert {t for ts in _techniques(model) for t in ts} & {"selective", "checkpoint"}
    for seed in range(2):
        assert_same_step(model, ref, X, seed=seed, loss_fn=_mse)
    memscale.detach(model)


def test_an_inplace_op_on_a_recomputed_output_keeps_the_profile():
    """An in-place dropout writes GELU's output, which is recomputed: the
    layer keeps its selective profile and runs selective, bitwise."""
    model = _dropout_inplace()
    profile = _planning.profile_upfront(model, _units(model), X, memscale.Config())
    assert all(layer.selective_levels[-1][1] == ROWS * 128 * 4 for layer in profile.layers)
    model, ref = _wrapped(_dropout_inplace, X, 0.8)
    assert ("selective",) in _techniques(model)
    for seed in range(2):
        assert_same_step(model, ref, X, seed=seed, loss_fn=_mse)
    memscale.detach(model)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_selective_layers_backward_twice_with_retain_graph_bitwise():
    """``backward(retain_graph=True)`` then a second backward through the
    same graph: each recomputes from the same kept outputs (torch's own
    selective cache allows one backward), and the gradients after each
    backward equal the unwrapped model's bit for bit (dropout replayed)."""
    model, ref = _wrapped(_mlp, X, 0.7)
    assert ("selective",) in _techniques(model)
    for seed in range(2):
        seen = []
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            out = m(X)
            out.pow(2).mean().backward(retain_graph=True)
            first = _grads(m)
            out.sum().backward()
            seen.append((first, _grads(m)))
        for got, want in zip(seen[0], seen[1]):
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    memscale.detach(model)


# ------------------------------------------------ memscale's own modes


def test_selective_runs_without_torchs_private_selective_cache(monkeypatch):
    """The forward and recompute modes are memscale's: with torch's own
    selective-checkpoint pieces gone (its policy context, its caching and
    cached modes and their marks, as torch 2.11 lacks some of them),
    selective layers still plan, run and give the unwrapped model's loss
    and gradients bit for bit."""
    from torch.utils import checkpoint as ckpt

    for name in (
        "SelectiveCheckpointContext",
        "_CachingTorchDispatchMode",
        "_CachedTorchDispatchMode",
        "_CONSUMED",
        "create_selective_checkpoint_contexts",
    ):
        monkeypatch.delattr(ckpt, name, raising=False)
    model, ref = _wrapped(_mlp, X, 0.7)
    assert ("selective",) in _techniques(model)
    counted = {"kept": 0, "read": 0}

    class Counted(_selective._Cached):
        __slots__ = ()

        def __init__(self, tensor):
            counted["kept"] += 1
            super().__init__(tensor)

        def read(self):
            counted["read"] += 1
            return super().read()

    monkeypatch.setattr(_selective, "_Cached", Counted)
    for seed in range(2):
        assert_same_step(model, ref, X, seed=seed, loss_fn=_mse)
    # Outputs were kept in forward and handed back in the recompute.
    assert counted["kept"] > 0 and counted["read"] > 0
    memscale.detach(model)


def _kept_matmul(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x @ w  # kept: it has a FLOP formula
    return y, y.sin()  # sin saves its input for backward: recomputed


def test_a_kept_output_written_in_place_after_the_forward_is_refused():
    """An output the forward kept, written in place outside the layer
    before backward, would be read written by the recompute: backward
    raises, naming the cause and the way out, and nothing is read."""
    x = torch.randn(16, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    y, out = _selective.run(_kept_matmul, 0.0, (x, w), {})
    y.detach().add_(1.0)  # the user's in-place write of the kept output
    with pytest.raises(RuntimeError, match="written in place after its forward"):
        out.sum().backward()
    # Unwritten, the same layer's backward runs, and matches plain autograd.
    y, out = _selective.run(_kept_matmul, 0.0, (x, w), {})
    out.sum().backward()
    got = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    _, plain = _kept_matmul(x, w)
    plain.sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], w.grad)


def test_a_recompute_does_not_hold_what_it_recomputed():
    """A kept output handed back in a recompute gets a history of its own
    there (autograd's), whose saved tensors are the recompute's: the entry
    hands out a new alias each time and holds none of it, so a recomputed
    input of a kept matmul is freed once its node has run, with or without
    ``retain_graph``."""
    from torch.multiprocessing.reductions import StorageWeakRef

    refs: list = []
    freed: list[bool] = []

    def layer(x, w1, w2):
        a = x @ w1  # kept
        a.register_hook(lambda g: freed.append(refs[-1].expired()))
        b = a.sin()  # recomputed; saved by the kept matmul below
        refs.append(StorageWeakRef(b.untyped_storage()))
        return (b @ w2).sin()

    for retain in (False, True):
        refs.clear()
        freed.clear()
        x, w1, w2 = (torch.randn(32, 32, requires_grad=True) for _ in range(3))
        out = _selective.run(layer, 0.0, (x, w1, w2), {})
        out.sum().backward(retain_graph=retain)
        assert freed == [True], retain  # b of the recompute, by a's gradient
        assert refs[-1].expired()
        del out


def test_a_compiled_function_inside_a_selective_layer_is_compiled():
    """A function compiled with ``torch.compile`` and called inside a
    selective layer compiles (the modes say ``ignore_compile_internals``,
    as torch's own do), and the layer's gradients are the plain ones."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def inner(h):
        return (h @ h.T).relu()

    def layer(x):
        return inner(x.sin()).sum(-1)

    x = torch.randn(8, 8, requires_grad=True)
    try:
        _selective.run(layer, 0.0, (x,), {}).sum().backward()
        got = x.grad.clone()
        assert counter.frame_count == 1
        x.grad = None
        layer(x).sum().backward()
        assert torch.equal(got, x.grad)
    finally:
        torch._dynamo.reset()


def test_a_weight_autocast_cast_before_the_layer_is_cast_again_in_the_recompute():
    """Autocast casts a weight once per autocast region: a selective layer
    whose weight was used earlier in the same region (tied weights, a
    module called twice) finds it cast in its forward, and its recompute,
    in a region of its own, casts it again.  That cast is neither kept nor
    counted, so the recompute runs, and the gradients are the plain ones."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)

    def run(selective: bool) -> list[torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
            out = _selective.run(lin.forward, 0.0, (y,), {}) if selective else lin(y)
        out.float().sum().backward()
        grads = [x.grad.clone(), lin.weight.grad.clone()]
        x.grad = lin.weight.grad = lin.bias.grad = None
        return grads

    for got, want in zip(run(True), run(False)):
        assert torch.equal(got, want)


def test_a_recompute_that_runs_other_operators_is_refused():
    """A forward whose recompute takes another branch (global state read in
    the forward) runs an operator the forward never called: backward
    raises with what differed, instead of handing back a wrong kept
    output."""
    flag = [True]

    def branchy(x: torch.Tensor) -> torch.Tensor:
        h = x.sin() if flag[0] else x.cos()
        return (h @ x).tanh()

    x = torch.randn(8, 8, requires_grad=True)
    out = _selective.run(branchy, 0.0, (x,), {})
    flag[0] = False
    with pytest.raises(RuntimeError, match="ran other operators than its forward"):
        out.sum().backward()


# ------------------------------------------------------------ torch gate


def test_selective_needs_dispatch_modes_and_a_checkpoint_context_fn(monkeypatch):
    """memscale's selective checkpoint is its own two dispatch modes given
    to ``checkpoint(context_fn=...)``: a torch without dispatch modes, or
    whose checkpoint takes no ``context_fn``, cannot run it; then no op is
    recorded, no layer gets a selective profile, and selective is not an
    allowed technique.  Nothing private of torch's selective checkpoint
    is needed (its ``op_output`` and indexed cache came after torch
    2.4)."""
    from torch.utils import checkpoint as ckpt

    from memscale import _torch_compat

    config = memscale.Config(mode="balanced")
    assert _torch_compat.selective_supported()
    assert _planning.allowed_techniques(config) & _core.TECH_SELECTIVE

    def old_checkpoint(function, *args, use_reentrant=None, **kwargs):  # no context_fn
        raise AssertionError("not called")

    monkeypatch.setattr(ckpt, "checkpoint", old_checkpoint)
    assert not _torch_compat._selective_check_uncached()
    monkeypatch.undo()
    monkeypatch.setattr(_torch_compat, "dispatch_mode_base", lambda: None)
    assert not _torch_compat._selective_check_uncached()
    monkeypatch.undo()
    for name in ("SelectiveCheckpointContext", "_CachingTorchDispatchMode", "_CONSUMED"):
        monkeypatch.delattr(ckpt, name, raising=False)
    assert _torch_compat._selective_check_uncached()
    monkeypatch.undo()

    monkeypatch.setattr(_torch_compat, "selective_supported", lambda: False)
    assert not _planning.allowed_techniques(config) & _core.TECH_SELECTIVE
    model = _mlp()
    assert _selective.recorder(list(model.children())) is None
    profile = _planning.profile_upfront(model, _units(model), X, config)
    assert all(layer.selective_levels is None for layer in profile.layers)
    model, ref = _wrapped(_mlp, X, 0.7)
    assert "selective" not in {t for ts in _techniques(model) for t in ts}
    assert_same_step(model, ref, X, loss_fn=_mse)
    memscale.detach(model)


# ------------------------------------- calls the recompute does not run


class _ResidualDropout(torch.nn.Module):
    """GPT-2's MLP: fc1, GELU, fc2, then dropout on the residual branch.
    Only the dropout reads fc2's output, and it saves its noise, not its
    input: nothing autograd saves needs fc2's output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(32, 128)
        self.fc2 = torch.nn.Linear(128, 32)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(x))))


def _run_counting(block, threshold, skip, tail, op="addmm.default"):
    """One forward of ``block`` run selective and its backward: the calls
    of ``op`` the backward made (through ``_Calls``: the recompute's, and
    for ``mm`` the backward's own), and the gradients."""
    x = X.clone().requires_grad_()
    torch.manual_seed(3)
    out = _selective.run(block.forward, threshold, (x,), {}, tail, None, skip)
    with _Calls() as calls:
        out.pow(2).mean().backward()
    grads = [x.grad, *(p.grad for p in block.parameters())]
    block.zero_grad(set_to_none=True)
    return calls.names.count(op), grads


def _plain_grads(block):
    """The gradients of one step of ``block`` as it is (dropout's seed 3)."""
    x = X.clone().requires_grad_()
    torch.manual_seed(3)
    block(x).pow(2).mean().backward()
    grads = [x.grad, *(p.grad for p in block.parameters())]
    block.zero_grad(set_to_none=True)
    return grads


def test_a_call_no_saved_tensor_reads_is_neither_kept_nor_run_again():
    """The profile finds fc2 dead (no saved tensor reads its output): the
    level at fc1's ratio keeps fc1's output only, the one at fc2's keeps
    nothing and is charged neither fc2 nor its output's bytes (it was the
    ladder's first level, keeping fc2's output for nothing), and both say
    their recompute leaves fc2 (the second addmm) unrun.  Run so, the
    recompute makes one addmm fewer; the gradients are the same bits as
    the unwrapped block's, dropout replayed."""
    block = _ResidualDropout()
    profile = _planning.profile_upfront(block, [("b", block)], X, memscale.Config())
    (layer,) = profile.layers
    fc1 = 2 * ROWS * 32 * 128
    cheap = ROWS * (128 + 32 + 32)  # GELU, the noise and the dropout's output
    assert [(t, b) for t, b, _ in layer.selective_levels] == [
        (FC2_LEVEL, 0),
        (FC1_LEVEL, ROWS * 128 * 4),
    ]
    assert layer.selective_levels[0][2] < fc1 + cheap + ROWS * 128
    skip = (("aten.addmm.default", 1),)
    assert profile.details[0]["skips"] == ((FC2_LEVEL, skip), (FC1_LEVEL, skip))
    assert _planning.skips_from(profile.details[0], FC2_LEVEL) == skip
    assert _planning.skips_from(profile.details[0], 1.0) == ()
    tail = _planning.tail_from(profile.details[0])
    assert tail == ("aten.mul.Tensor", 0)  # the dropout's: the noise is its last save
    expected = _plain_grads(block)
    # (threshold, skip): addmm calls the recompute makes, bytes held.
    runs = {
        (FC2_LEVEL, skip): (1, 0),
        (FC2_LEVEL, ()): (1, ROWS * 32 * 4),  # fc2's output kept, for nothing
        (1e30, ()): (2, 0),  # nothing kept: a whole recompute
        (FC1_LEVEL, skip): (0, ROWS * 128 * 4),
    }
    held = {}
    for (threshold, given), (calls, _) in runs.items():
        ran, grads = _run_counting(block, threshold, given, tail)
        assert ran == calls, (threshold, given)
        for a, b in zip(grads, expected):
            assert torch.equal(a, b)
        x = X.clone().requires_grad_()
        box = []

        def forward(x=x, t=threshold, g=given, box=box):
            box.append(_selective.run(block.forward, t, (x,), {}, tail, None, g))

        held[threshold, given] = measure_peak(forward, model=block, inputs=x).end_delta_bytes
    least = held[1e30, ()]
    assert {key: held[key] - least for key in runs} == {
        key: kept for key, (_, kept) in runs.items()
    }


def _tanh_of_matmul(x, w):
    a = x * 1.0
    h = a @ w
    return h.tanh()  # tanh saves its output: h is needed


def test_a_skip_the_forward_finds_read_is_not_skipped():
    """Told to leave the mm unrun (as a profile of another forward might
    say), the forward sees tanh read its output before any tail: the
    recompute runs every call, and the gradients are the same bits as
    without memscale."""
    x = torch.randn(16, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    _tanh_of_matmul(x, w).sum().backward()
    expected = [x.grad, w.grad]
    x.grad = w.grad = None
    out = _selective.run(_tanh_of_matmul, 1e30, (x, w), {}, None, None, (("aten.mm.default", 0),))
    with _Calls() as calls:
        out.sum().backward()
    assert calls.names.count("mm.default") == 3  # the recompute's, then two in backward
    assert torch.equal(x.grad, expected[0]) and torch.equal(w.grad, expected[1])


def test_a_put_off_call_whose_output_is_read_after_all_runs_then():
    """With torch's early stop off, the recompute runs the tail too: the
    dropout's multiply reads fc2's unwritten output, so fc2 runs then,
    into it (the recompute makes both addmm calls), and the gradients are
    the same bits."""
    block = _ResidualDropout()
    profile = _planning.profile_upfront(block, [("b", block)], X, memscale.Config())
    tail = _planning.tail_from(profile.details[0])
    skip = _planning.skips_from(profile.details[0], FC2_LEVEL)
    assert skip
    expected = _plain_grads(block)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        ran, grads = _run_counting(block, FC2_LEVEL, skip, tail)
    assert ran == 2
    for a, b in zip(grads, expected):
        assert torch.equal(a, b)


def _mm_then_written(x, w):
    a = x * 2.0
    h = a @ w  # w needs no gradient: mm saves w, not a
    a.add_(1.0)
    noise = torch.empty_like(h).bernoulli_(0.5)
    return h * noise + a  # the multiply saves the noise: the tail starts there


def test_a_put_off_calls_input_written_before_its_output_is_read_is_refused():
    """The put-off mm's input is written in place before the tail's
    multiply reads the mm's output (the recompute runs the tail: early
    stop off): running it then would compute from the written value, so
    the recompute refuses, naming the call.  With early stop on it never
    runs, and the gradients are the same bits as without memscale."""
    w = torch.randn(8, 8)
    skip = (("aten.mm.default", 0),)
    tail = ("aten.mul.Tensor", 1)
    x = torch.randn(16, 8, requires_grad=True)
    torch.manual_seed(0)
    _mm_then_written(x, w).sum().backward()
    expected = x.grad
    x.grad = None
    torch.manual_seed(0)
    _selective.run(_mm_then_written, 1e30, (x, w), {}, tail, None, skip).sum().backward()
    assert torch.equal(x.grad, expected)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        out = _selective.run(_mm_then_written, 1e30, (x, w), {}, tail, None, skip)
        with pytest.raises(RuntimeError, match="an input of aten.mm.default"):
            out.sum().backward()


def test_gpt2s_mlp_output_projection_is_left_to_the_dropout():
    """In a Hugging Face GPT-2 block with dropout, the MLP's output
    projection (the block's fourth addmm) is read only by the residual
    dropout: every level of every block leaves it unrun and unkept."""
    model = _gpt2()
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    units = [(f"transformer.h.{i}", block) for i, block in enumerate(model.transformer.h)]
    profile = _planning.profile_upfront(model, units, {"input_ids": x}, memscale.Config())
    for layer, detail in zip(profile.layers, profile.details):
        assert layer.selective_levels
        assert [t for t, _ in detail["skips"]] == [t for t, _, _ in layer.selective_levels]
        assert {s for _, s in detail["skips"]} == {(("aten.addmm.default", 3),)}


class _FrozenRead(torch.nn.Module):
    """A frozen Linear (its addmm saves only its weight) whose output an
    add reads before the tail (which starts after ``sin`` saves ``a``),
    and nothing saved reads: not dead, since a recompute runs the add."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc0 = torch.nn.Linear(32, 32)
        self.fc = torch.nn.Linear(32, 32).requires_grad_(False)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        a = self.fc0(x) + 1.0
        h = self.fc(a)
        a.mul_(2.0)
        y = self.drop(h + a)
        return y + a.sin()


def test_only_a_fake_profile_and_no_reader_before_the_tail_make_a_call_dead():
    """No call is dead where an op before the tail reads its output (the
    recompute runs that op, so it would run the call for it), nor in a
    profile of real tensors (use_static_profiling=False: a kernel may read
    memory the dispatcher does not see); a bias-free Linear's mm, followed
    by the view Linear makes of it, is dead as the addmm is."""
    block = _FrozenRead()
    profile = _planning.profile_upfront(block, [("b", block)], X, memscale.Config())
    assert "skips" not in profile.details[0]
    block = _ResidualDropout()
    real = _planning.profile_upfront(
        block, [("b", block)], X, memscale.Config(use_static_profiling=False)
    )
    assert real.layers[0].selective_levels and "skips" not in real.details[0]
    block.fc1 = torch.nn.Linear(32, 128, bias=False)
    block.fc2 = torch.nn.Linear(128, 32, bias=False)
    profile = _planning.profile_upfront(block, [("b", block)], X, memscale.Config())
    skip = _planning.skips_from(profile.details[0], FC2_LEVEL)
    assert skip == (("aten.mm.default", 1),)
    tail = _planning.tail_from(profile.details[0])
    expected = _plain_grads(block)
    for threshold, given, recomputed in ((FC2_LEVEL, skip, 1), (1e30, (), 2)):
        ran, grads = _run_counting(block, threshold, given, tail, "mm.default")
        assert ran == recomputed + 4  # and backward's four
        for a, b in zip(grads, expected):
            assert torch.equal(a, b)


class _FusedDropout(_ResidualDropout):
    """As :class:`_ResidualDropout` with dropout as one op returning its
    output and mask (``native_dropout``, what CUDA runs): autograd saves
    the mask, which reads nothing of fc2's output."""

    def forward(self, x):
        h = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return x + torch.native_dropout(h, 0.1, True)[0]


def test_a_fused_dropout_runs_on_the_unwritten_output_it_alone_reads():
    """fc2's output is read only by the fused dropout, whose own output
    only the tail reads: fc2 is dead, and the dropout runs on its unwritten
    output in the recompute (its mask drawn as in the forward).  The
    recompute makes one addmm (fc1's) where a whole one makes two, and the
    gradients are the same bits as the unwrapped block's."""
    block = _FusedDropout()
    profile = _planning.profile_upfront(block, [("b", block)], X, memscale.Config())
    skip = (("aten.addmm.default", 1), ("aten.native_dropout.default", 0))
    assert profile.details[0]["skips"] == ((FC2_LEVEL, skip), (FC1_LEVEL, skip))
    assert [b for _, b, _ in profile.layers[0].selective_levels] == [0, ROWS * 128 * 4]
    tail = _planning.tail_from(profile.details[0])
    expected = _plain_grads(block)
    for threshold, given, recomputed in ((FC2_LEVEL, skip, 1), (1e30, (), 2)):
        ran, grads = _run_counting(block, threshold, given, tail)
        assert ran == recomputed
        for a, b in zip(grads, expected):
            assert torch.equal(a, b)


class _GatedByInput(torch.nn.Module):
    """fc2's output times a gate of the block's input: the tail's multiply
    saves fc2's output only when the gate needs a gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(32, 128)
        self.fc2 = torch.nn.Linear(128, 32)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))) * torch.sigmoid(x)


def _same_grads_run_and_plain(block, x, threshold, tail, skip, unit=None):
    """Whether ``block`` run selective with ``skip`` gives the gradients of
    the plain block, bitwise (``x`` with or without its own gradient)."""
    grads = []
    for selective in (False, True):
        xi = x.detach().clone().requires_grad_(x.requires_grad)
        torch.manual_seed(3)
        if selective:
            out = _selective.run(block.forward, threshold, (xi,), {}, tail, unit, skip)
        else:
            out = block(xi)
        out.pow(2).mean().backward()
        grads.append([xi.grad, *(p.grad for p in block.parameters())])
        block.zero_grad(set_to_none=True)
    return all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads[0], grads[1]))


def test_a_skip_stands_down_where_the_run_differs_from_its_profile():
    """Each run below differs from the profile its skip came from in a way
    that would put fc2's (or the conv's) unwritten output into backward,
    and each gives the plain block's gradients bitwise: (a) the input
    needs a gradient in training, not when profiled, so the tail's
    multiply saves fc2's output (the forward sees a tail call that may
    save it); (b) a forward hook on fc2 would capture the unwritten
    output in the recompute (a hooked submodule turns the skip off); (c)
    the stand-in takes the layout of the forward's output, not a meta
    kernel's (a conv with a channels-last weight writes channels last);
    (d) a skipped call reading another's output (a skip list naming other
    calls than the profile's); (e) an op that saves its input reads, in
    the tail, what a fused dropout computed from the unwritten product.
    A hook registered after the forward, before the recompute, sees the
    written output too."""
    block = _GatedByInput()
    profile = _planning.profile_upfront(block, [("b", block)], X, memscale.Config())
    skip = _planning.skips_from(profile.details[0], FC2_LEVEL)
    assert skip == (("aten.addmm.default", 1),)
    tail = _planning.tail_from(profile.details[0])
    assert _same_grads_run_and_plain(block, X.clone().requires_grad_(), FC2_LEVEL, tail, skip)
    out = _selective.run(
        block.forward, FC2_LEVEL, (X.clone().requires_grad_(),), {}, tail, None, skip
    )
    with _Calls() as calls:
        out.pow(2).mean().backward()
    assert calls.names.count("addmm.default") == 2  # fc2 ran again (stale memory may hide it)
    block.zero_grad(set_to_none=True)
    # (b)
    block = _ResidualDropout()
    profile = _planning.profile_upfront(block, [("b", block)], X, memscale.Config())
    skip, tail = (
        _planning.skips_from(profile.details[0], FC2_LEVEL),
        _planning.tail_from(profile.details[0]),
    )
    acts = {}
    handle = block.fc2.register_forward_hook(lambda m, i, o: acts.__setitem__("fc2", o.detach()))
    try:
        x = X.clone().requires_grad_()
        out = _selective.run(block.forward, FC2_LEVEL, (x,), {}, tail, block, skip)
        captured = acts["fc2"].clone()
        out.pow(2).mean().backward()
        assert torch.equal(acts["fc2"], captured)
    finally:
        handle.remove()
    # (b) again, the hook registered after the forward, before backward
    x = X.clone().requires_grad_()
    out = _selective.run(block.forward, FC2_LEVEL, (x,), {}, tail, block, skip)
    captured = []
    handle = block.fc2.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    try:
        out.pow(2).mean().backward()
    finally:
        handle.remove()
    with torch.no_grad():
        assert torch.equal(captured[0], block.fc2(torch.nn.functional.gelu(block.fc1(X))))
    block.zero_grad(set_to_none=True)
    # (c)
    conv = _ConvDropout().to(memory_format=torch.channels_last)
    images = torch.randn(2, 8, 12, 12, generator=torch.Generator().manual_seed(2))
    profile = _planning.profile_upfront(conv, [("c", conv)], images, memscale.Config())
    (threshold, skip), *_ = profile.details[0]["skips"]
    assert skip == (("aten.convolution.default", 0),)
    tail = _planning.tail_from(profile.details[0])
    assert _same_grads_run_and_plain(conv, images.requires_grad_(), threshold, tail, skip)
    # (d)
    chain = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    both = (("aten.addmm.default", 0), ("aten.addmm.default", 1))
    assert _same_grads_run_and_plain(chain, X.clone().requires_grad_(), 1e30, None, both)
    # (e) a fused dropout's output, computed from the unwritten product in
    # the recompute, read in the tail by an op that saves it (tanh)
    fused = _FusedDropout()
    profile = _planning.profile_upfront(fused, [("b", fused)], X, memscale.Config())
    skip, tail = (
        _planning.skips_from(profile.details[0], FC2_LEVEL),
        _planning.tail_from(profile.details[0]),
    )
    assert skip
    fused.forward = lambda x: _FusedDropout.forward(fused, x).tanh()
    assert _same_grads_run_and_plain(fused, X.clone().requires_grad_(), FC2_LEVEL, tail, skip)


class _ConvDropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.conv(x))
