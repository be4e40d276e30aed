"""Activation tiling: the C tile helpers, which layers are tiled along which
dimension (structure, declaration, verification), agreement with the
untiled model, memory, and how tiling composes with the rest."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import Block, mlp, tiny_gpt2
from torch import nn

import memscale
from memscale import Config, _core, tiling
from memscale.benchmarks.measure import measure_peak

FORCE_TILE = Config(mode="aggressive", force_optimize=True, enable_offloading=False)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def train_step(model, x, loss=lambda y: y.square().mean()):
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss(out).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_agrees(model, ref, x, tol=1e-5):
    """Outputs and every gradient within ``tol`` relative; a gradient that
    is 0 in exact arithmetic (a bias before a mean subtraction) is held to
    ``tol`` of a hundredth of the model's largest gradient."""
    out, grads = train_step(model, x)
    ref_out, ref_grads = train_step(ref, x)
    assert rel(out, ref_out) <= tol
    floor = 1e-2 * max(float(g.abs().max()) for g in ref_grads.values())
    for name, g in grads.items():
        want = ref_grads[name]
        assert float((g - want).abs().max()) <= tol * max(float(want.abs().max()), floor), name


# ---- tile_call ------------------------------------------------------------


def test_tile_call_slices_what_follows_the_lead_and_joins():
    seen = []

    def fn(x, mask, scale, pair=None):
        seen.append((tuple(x.shape), tuple(mask.shape), scale, tuple(pair[0].shape)))
        return x * 2, None

    x = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)
    mask = torch.ones(2, 1, 6, 6)  # follows the lead along dim 0 only
    pair = (torch.zeros(2, 6, 5), 7)
    out, none = _core.tile_call(fn, (x, mask, 3.0), {"pair": pair}, 1, 4)
    assert none is None and torch.equal(out, x * 2)
    # 6 rows in 4 tiles: 2, 2, 1, 1
    assert [s[0] for s in seen] == [(2, 2, 3), (2, 2, 3), (2, 1, 3), (2, 1, 3)]
    assert all(s[1] == (2, 1, 6, 6) and s[2] == 3.0 for s in seen)
    assert [s[3] for s in seen] == [(2, 2, 5), (2, 2, 5), (2, 1, 5), (2, 1, 5)]
    seen.clear()
    out, _ = _core.tile_call(fn, (x, mask, 1.0), {"pair": pair}, 0, 2)
    assert [s[1] for s in seen] == [(1, 1, 6, 6)] * 2 and torch.equal(out, x * 2)


@pytest.mark.parametrize(
    "dim,tiles,match",
    [
        (-1, 2, "dim must be"),
        (0, 0, "tiles in"),
        (0, _core.MAX_TILES + 1, "tiles in"),
        (3, 2, "no dimension 3"),
        (0, 5, "at least 5"),
    ],
)
def test_tile_call_rejects_bad_requests(dim, tiles, match):
    with pytest.raises(ValueError, match=match):
        _core.tile_call(lambda x: x, (torch.zeros(4, 3),), {}, dim, tiles)


def test_tile_call_refuses_outputs_it_cannot_join():
    calls = iter(range(10))
    with pytest.raises(TypeError, match="cannot be joined"):
        _core.tile_call(lambda x: next(calls), (torch.zeros(4, 3),), {}, 0, 2)


# ---- which layers, which dimension ------------------------------------------


def test_candidates():
    assert tiling.is_candidate(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
    assert tiling.is_candidate(Block(8, p=0.0))
    assert not tiling.is_candidate(Block(8, p=0.1))  # dropout would change
    assert not tiling.is_candidate(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    declared = Block(8, p=0.1)
    tiling.declare_row_independent(declared)
    assert tiling.is_candidate(declared)
    with pytest.raises(TypeError, match="nn.Module"):
        tiling.declare_row_independent(3)
    with pytest.raises(ValueError, match="dim"):
        tiling.declare_row_independent(nn.Linear, dim=-1)


def test_mlp_blocks_are_verified_and_agree(caplog):
    model, ref = mlp(width=16), mlp(width=16)
    x = torch.randn(2, 64, 16, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="memscale"):
        memscale.wrap(model, FORCE_TILE, sample_input=x.detach())
        plan = model._memscale_executor.plan
        # Forced: tiles wherever they lower the peak (each block's
        # recompute makes it in turn, the last ones above the rest).
        tiles = [l.tiles for l in plan.layers]
        assert tiles == [4, 4, 8, 16]
        assert_agrees(model, ref, x)
    assert caplog.text.count("verified row-independent along dim 1") == 4
    stats = model._memscale_executor.stats
    assert stats["tiled_calls"] == 4 and stats["recomputes"] == sum(tiles)
    assert all(m.forward.dim == 1 for m in model)
    memscale.detach(model)


def test_structural_layers_need_no_verification(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(
        *[
            nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 8))
            for _ in range(3)
        ]
    )
    ref = copy.deepcopy(model)
    x = torch.randn(3, 40, 8)
    with caplog.at_level(logging.INFO, logger="memscale"):
        memscale.wrap(model, FORCE_TILE, sample_input=x)
        assert_agrees(model, ref, x)
    assert "verified" not in caplog.text
    assert model._memscale_executor.stats["tiled_calls"] == 3
    memscale.detach(model)


class RowMixer(nn.Module):
    """Subtracts the sequence mean: row i depends on every row."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def fc(self, x):
        return self.down(torch.tanh(self.up(x)))

    def forward(self, x):
        y = self.fc(x)
        return y - y.mean(dim=1, keepdim=True)


def test_row_mixing_layers_are_tiled_along_the_batch():
    torch.manual_seed(0)
    model = nn.Sequential(RowMixer(), RowMixer())
    ref = copy.deepcopy(model)
    x = torch.randn(4, 10, 8)
    memscale.wrap(model, FORCE_TILE, sample_input=x)
    assert_agrees(model, ref, x)
    assert [m.forward.dim for m in model] == [0, 0]
    memscale.detach(model)


class BatchMixer(RowMixer):
    def forward(self, x):
        y = self.fc(x)
        return y - y.mean(dim=(0, 1), keepdim=True)


def test_layers_failing_verification_are_checkpointed_whole(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(BatchMixer(), BatchMixer())
    ref = copy.deepcopy(model)
    x = torch.randn(4, 10, 8)
    with caplog.at_level(logging.WARNING, logger="memscale"):
        memscale.wrap(model, FORCE_TILE, sample_input=x)
        out, grads = train_step(model, x)
    ref_out, ref_grads = train_step(ref, x)
    # Checkpointed whole: bitwise the unoptimized result.
    assert torch.equal(out, ref_out)
    assert all(torch.equal(g, ref_grads[n]) for n, g in grads.items())
    assert "BatchMixer is not tiled (checkpointed whole instead)" in caplog.text
    assert "dim 1: " in caplog.text and "dim 0: " in caplog.text
    ex = model._memscale_executor
    assert ex.stats["tiled_calls"] == 0 and ex.stats["recomputes"] == 2
    assert [m.forward.dim for m in model] == ["demoted", "demoted"]
    memscale.detach(model)


class FunctionalDropout(RowMixer):
    def forward(self, x):
        return F.dropout(self.fc(x), 0.5, self.training)


def test_layers_that_draw_random_numbers_are_not_tiled(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(FunctionalDropout(), FunctionalDropout())
    ref = copy.deepcopy(model)
    x = torch.randn(4, 10, 8)
    with caplog.at_level(logging.WARNING, logger="memscale"):
        memscale.wrap(model, FORCE_TILE, sample_input=x)
        torch.manual_seed(1)
        out, grads = train_step(model, x)
    torch.manual_seed(1)
    ref_out, ref_grads = train_step(ref, x)
    # The verification left the RNG stream where it was: same masks.
    assert torch.equal(out, ref_out)
    assert all(torch.equal(g, ref_grads[n]) for n, g in grads.items())
    assert "draws random numbers" in caplog.text
    memscale.detach(model)


def test_declared_modules_skip_verification(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(Block(8), Block(8))
    ref = copy.deepcopy(model)
    for m in model:
        tiling.declare_row_independent(m, dim=0)
    x = torch.randn(4, 10, 8)
    with caplog.at_level(logging.INFO, logger="memscale"):
        memscale.wrap(model, FORCE_TILE, sample_input=x)
        assert_agrees(model, ref, x)
    assert "verified" not in caplog.text
    assert [m.forward.dim for m in model] == [0, 0]
    memscale.detach(model)


def test_gpt2_blocks_tile_along_the_batch():
    model, ref = tiny_gpt2(dropout=0.0), tiny_gpt2(dropout=0.0)
    ids = torch.randint(0, 256, (4, 32))
    memscale.wrap(model, FORCE_TILE, sample_input={"input_ids": ids})
    plan = model._memscale_executor.plan
    assert plan.technique_counts["tiling"] == 3
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    ref_out = ref(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    assert abs(out.loss.item() - ref_out.loss.item()) <= 1e-5 * abs(ref_out.loss.item())
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert rel(p.grad, grads[name].grad) <= 1e-4, name
    blocks = model.transformer.h
    assert [b.forward.dim for b in blocks] == [0, 0, 0]  # attention mixes the sequence
    memscale.detach(model)


def test_gpt2_with_dropout_is_not_tiled():
    model = tiny_gpt2(dropout=0.1)
    memscale.wrap(model, FORCE_TILE, sample_input={"input_ids": torch.randint(0, 256, (2, 16))})
    assert model._memscale_executor.plan.technique_counts["tiling"] == 0
    memscale.detach(model)


# ---- memory, budgets, composition ------------------------------------------


def _peak(model, x):
    def step():
        model(x).square().mean().backward()

    model.zero_grad(set_to_none=True)
    return measure_peak(step, model=model, inputs=(x,), warmup=1).peak_delta_bytes


def test_tiles_lower_the_measured_peak():
    x = torch.randn(2, 512, 64)
    peaks = {}
    for name, cfg in [
        ("checkpoint", Config(mode="conservative", force_optimize=True)),
        ("tiled", FORCE_TILE.replace(memory_budget_gb=1e-4)),
    ]:
        model = mlp(depth=2, width=64)
        memscale.wrap(model, cfg, sample_input=x)
        tiles = [l.tiles for l in model._memscale_executor.plan.layers]
        peaks[name] = _peak(model, x)
        memscale.detach(model)
    assert max(tiles) == _core.MAX_TILES  # the budget is out of reach
    # The 4x intermediate dominates: 16 tiles take the peak below half.
    assert peaks["tiled"] < 0.5 * peaks["checkpoint"], peaks


def test_budget_sets_the_tile_count():
    x = torch.randn(2, 256, 32)
    forced = Config(mode="conservative", force_optimize=True)
    prediction = memscale.predict_peak(mlp(depth=2, width=32), x, config=forced)
    saved = max(l.saved_bytes for l in prediction.plan.layers)
    # What the step needs with every layer checkpointed whole, less the
    # recompute of the largest layer: the rest of the peak.
    floor = prediction.optimized.peak_bytes - saved
    chosen = []
    for want in (2, 4, 8):
        model = mlp(depth=2, width=32)
        # Room for 1.25 shares of `want` tiles: `want` fit, want / 2 do not
        # (the planner counts memory in buckets of budget / 512 bytes, so
        # a budget on the very edge may need the next count).
        share = saved // want
        memscale.wrap(
            model,
            Config(
                enable_tiling=True,
                enable_offloading=False,
                memory_budget_gb=(floor + share + share // 4) / 2**30,
            ),
            sample_input=x,
        )
        chosen.append(max(l.tiles for l in model._memscale_executor.plan.layers))
        memscale.detach(model)
    assert chosen == [2, 4, 8]


@pytest.mark.parametrize("async_offload", [False, True])
def test_tiling_with_disk_offload(tmp_path, async_offload):
    model, ref = mlp(width=16), mlp(width=16)
    x = torch.randn(2, 64, 16)
    cfg = Config(
        mode="aggressive",
        force_optimize=True,
        async_config=memscale.AsyncOffloadConfig(min_offload_bytes=0, spill_dir=str(tmp_path)),
    )
    memscale.wrap(model, cfg, sample_input=x, async_offload=async_offload)
    plan = model._memscale_executor.plan
    assert plan.technique_counts["offload"] == 4
    assert plan.technique_counts["tiling"] == 4
    assert_agrees(model, ref, x)
    stats = model._memscale_executor.offload_store.stats
    assert stats["tensors_written"] >= 3 and stats["tensors_read"] == stats["tensors_written"]
    memscale.detach(model)


def test_retain_graph_and_second_backward():
    model, ref = mlp(width=16), mlp(width=16)
    x = torch.randn(2, 32, 16)
    memscale.wrap(model, FORCE_TILE, sample_input=x)
    for m in (model, ref):
        loss = m(x).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) <= 1e-5, n
    memscale.detach(model)


class Flaky(Block):
    fail = False

    def forward(self, x):
        if Flaky.fail and x.shape[1] < 64:  # only inside a tile
            raise RuntimeError("boom in a tile")
        return super().forward(x)


def test_an_error_inside_a_tile_leaves_nothing_behind():
    torch.manual_seed(0)
    model = nn.Sequential(Flaky(16), Flaky(16))
    ref = copy.deepcopy(model)
    x = torch.randn(2, 64, 16)
    memscale.wrap(model, FORCE_TILE, sample_input=x)
    train_step(model, x)  # verified and tiled
    Flaky.fail = True
    try:
        with pytest.raises(RuntimeError, match="boom in a tile"):
            model(x)
    finally:
        Flaky.fail = False
    assert model._memscale_executor.stats["active_frames"] == 0
    assert_agrees(model, ref, x)
    memscale.detach(model)
    assert all("forward" not in m.__dict__ for m in model)


def test_inplace_change_of_a_tiled_input_is_reported():
    model = mlp(width=16)
    x = torch.randn(2, 32, 16)
    memscale.wrap(model, FORCE_TILE, sample_input=x)
    h = x.clone().requires_grad_(True)
    y = h * 1.0
    out = model(y)
    with torch.no_grad():
        y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()
    memscale.detach(model)


def test_evaluation_and_no_grad_run_untiled():
    model, ref = mlp(width=16), mlp(width=16)
    x = torch.randn(2, 32, 16)
    memscale.wrap(model, FORCE_TILE, sample_input=x)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    model.eval()
    ref.eval()
    assert torch.equal(model(x), ref(x))
    assert model._memscale_executor.stats["tiled_calls"] == 0
    memscale.detach(model)


@pytest.mark.parametrize("static", [False, True], ids=["warmup", "first-forward"])
def test_warmup_path_tiles_too(static):
    # Without sample_input: the first forward planned on fake tensors and
    # already tiled; with use_static_profiling=False it is also measured
    # (tiled) and the plan made again from that.
    model, ref = mlp(width=16), mlp(width=16)
    x = torch.randn(2, 32, 16)
    memscale.wrap(model, FORCE_TILE.replace(warmup_steps=1, use_static_profiling=static))
    train_step(model, x)  # planned and tiled (and measured)
    ex = model._memscale_executor
    assert ex.plan.technique_counts["tiling"] == 4
    assert ex.profiling == ("static" if static else "warmup")
    if not static:
        # Measured while tiled: the figures of a step without a plan (the
        # tile verifier's runs of each layer count no FLOPs).
        plain = mlp(width=16)
        memscale.wrap(plain, FORCE_TILE.replace(warmup_steps=1))
        plain._memscale_executor.measure_real_steps()
        train_step(plain, x)
        assert ex.profile.layers == plain._memscale_executor.profile.layers
        memscale.detach(plain)
    assert_agrees(model, ref, x)
    assert ex.stats["tiled_calls"] == 8
    memscale.detach(model)
    assert all("forward" not in m.__dict__ for m in model)


def test_the_verifier_sees_the_tiles_the_call_makes():
    """A batch of 4 planned at 16 tiles runs in 4: verification runs with 4
    (it used to ask for 16 and refuse the layer for good)."""
    torch.manual_seed(0)
    model = nn.Sequential(RowMixer(), RowMixer())  # tiled along the batch
    ref = copy.deepcopy(model)
    x = torch.randn(4, 10, 8)
    memscale.wrap(
        model, FORCE_TILE.replace(memory_budget_gb=1e-9, force_optimize=True), sample_input=x
    )
    assert max(l.tiles for l in model._memscale_executor.plan.layers) > 4
    assert_agrees(model, ref, x)
    assert [m.forward.dim for m in model] == [0, 0]
    assert model._memscale_executor.stats["tiled_calls"] == 2
    memscale.detach(model)


def test_an_input_of_another_rank_runs_whole():
    model, ref = mlp(width=8, depth=2), mlp(width=8, depth=2)
    memscale.wrap(model, FORCE_TILE, sample_input=torch.randn(3, 40, 8))
    assert_agrees(model, ref, torch.randn(3, 40, 8))  # verified along dim 1
    flat = torch.randn(120, 8)  # 2-D: dim 1 is the features
    assert_agrees(model, ref, flat)
    assert model._memscale_executor.stats["tiled_calls"] == 2  # the 3-D step only
    memscale.detach(model)


def test_layers_with_hooks_are_not_tiling_candidates():
    block = Block(8)
    block.register_forward_hook(lambda m, a, out: out * 2)
    assert not tiling.is_candidate(block)


# ---- attention over query tiles (Hugging Face attention interface) ---------


def _gpt2(impl: str, seq: int = 64, heads: int = 4):
    model = tiny_gpt2(0.0, n_layer=2, n_embd=32, n_head=heads, vocab_size=128, n_positions=seq)
    model.config._attn_implementation = impl
    return model


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attention_is_tiled_over_queries_and_agrees(impl, monkeypatch):
    from memscale import _attention as attention

    model, ref = _gpt2(impl), _gpt2(impl)
    ids = torch.randint(0, 128, (2, 64))
    calls = []
    real_inner = attention._inner
    monkeypatch.setattr(attention, "_inner", lambda m, o: calls.append(o) or real_inner(m, o))
    memscale.wrap(model, FORCE_TILE, sample_input={"input_ids": ids})
    assert model.config._attn_implementation == attention.NAME
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    ref_out = ref(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    assert calls and set(calls) == {impl}  # each tile computed by the original
    assert abs(out.loss.item() - ref_out.loss.item()) <= 1e-5 * ref_out.loss.item()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) <= 1e-5, name
    memscale.detach(model)
    assert model.config._attn_implementation == impl
    assert not hasattr(model.config, attention._STATE)


@pytest.mark.slow
def test_query_tiles_lower_the_attention_peak(monkeypatch):
    from memscale import _attention as attention

    ids = torch.randint(0, 128, (1, 256))
    peaks = {}
    for tiled in (False, True):
        model = _gpt2("eager", seq=256, heads=8)
        if not tiled:
            monkeypatch.setattr(attention, "attach", lambda *a, **k: False)
        memscale.wrap(model, FORCE_TILE, sample_input={"input_ids": ids})
        # Batch 1: the blocks cannot be tiled along the batch.
        assert model.config._attn_implementation == (attention.NAME if tiled else "eager")

        def step(model=model):
            model(input_ids=ids, labels=ids).loss.backward()

        model.zero_grad(set_to_none=True)
        peaks[tiled] = measure_peak(step, model=model, inputs=(ids,), warmup=1).peak_delta_bytes
        memscale.detach(model)
        monkeypatch.undo()
    # The scores (1 x 8 x 256 x 256 float32, 2 MiB a layer, and their
    # softmax and gradient) shrink with the query tiles.
    assert peaks[True] < 0.8 * peaks[False], peaks


def test_attention_dropout_is_not_tiled_over_queries():
    from memscale import _attention as attention

    model = tiny_gpt2(dropout=0.1)
    assert attention.attach(object(), model, 4) is False
    assert model.config._attn_implementation != attention.NAME


def test_two_dimensional_inputs_and_the_last_layer():
    """Regression (found by the main job): a tile is sliced in backward, in
    no-grad mode; sliced there, it did not require grad, and its recompute
    saved fewer tensors than the forward (addmm's weight), failing the
    recompute check.  Slices are now made under grad mode."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(16), Block(16))
    ref = copy.deepcopy(model)
    x = torch.randn(64, 16)
    memscale.wrap(model, FORCE_TILE, sample_input=x)
    assert_agrees(model, ref, x)
    assert [m.forward.dim for m in model] == [0, 0]
    assert model._memscale_executor.stats["tiled_calls"] == 2
    memscale.detach(model)


class _Executor:
    """What ``_attention.attach`` needs of an executor (no detach here)."""

    def on_detach(self, fn):
        pass

    def on_copy(self, fn):
        pass


def test_query_tiles_give_the_attention_sinks_their_gradient():
    """Regression (review): the tiles differentiated only their queries,
    keys, values and mask, so GPT-OSS's ``sinks`` (a parameter the
    attention reads, passed as ``s_aux``) got no gradient at all."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from memscale import _attention as attention

    cfg = GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["full_attention"],
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_()
    ref = copy.deepcopy(model)
    assert attention.attach(_Executor(), model, 4)
    ids = torch.randint(0, 64, (2, 16))
    for m in (ref, model):
        m(ids, labels=ids).loss.backward()
    sinks = [n for n, _ in model.named_parameters() if n.endswith("sinks")]
    assert sinks
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            # Summed over tiles instead of in one reduction: close, not bitwise.
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name


class _Sinks(nn.Module):
    """An attention that reads a parameter of its own and a computed
    tensor from its keyword arguments, like GPT-OSS's sinks."""

    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(2))
        self.scale = nn.Parameter(torch.tensor(0.5))


def _sink_attention(module, q, k, v, mask, bias=None, **kw):
    s = (q @ k.transpose(-1, -2)) * module.scale
    if mask is not None:
        s = s + mask
    if bias is not None:
        s = s + bias
    sinks = module.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    p = torch.cat([s, sinks], dim=-1).softmax(-1)[..., :-1]
    return (p @ v).transpose(1, 2), None


def _sink_case(tiled: bool, penalty: bool):
    from memscale._attention import _Recomputed, _Tile

    torch.manual_seed(0)
    module = _Sinks().double()  # float64: the tiles sum in another order
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(1, 1, 6, 6, dtype=torch.float64)
    x = q * 1.5  # the tiles' queries have a history upstream
    bias = w.sin()  # computed, in the kwargs
    if tiled:
        outs = []
        for start in (0, 3):
            tile = _Tile(module, _sink_attention, False, start, 6, {"bias": bias})
            args = (x.narrow(2, start, 3), k, v, mask.narrow(2, start, 3))
            outs.append(_Recomputed.apply(tile, *args, *tile.extras()))
        out = torch.cat(outs, dim=1)
    else:
        out = _sink_attention(module, x, k, v, mask, bias=bias)[0]
    leaves = [q, k, v, w, module.sinks, module.scale]
    loss = out.pow(2).sum()
    if penalty:
        grads = torch.autograd.grad(loss, leaves, create_graph=True)
        loss = loss + sum(g.pow(2).sum() for g in grads)
    loss.backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("penalty", [False, True])
def test_query_tiles_differentiate_what_the_attention_reads(penalty):
    """Every trainable tensor a tile reads gets its gradient (the module's
    parameters, a computed kwargs tensor and what it came from), and the
    tiles are twice differentiable: a gradient penalty through them equals
    the untiled one (regression: ``once_differentiable`` raised)."""
    got, want = _sink_case(True, penalty), _sink_case(False, penalty)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a is not None, i
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), (i, rel(a, b))


def test_a_gradient_penalty_through_wrapped_query_tiles_agrees():
    """Regression (review): a gradient penalty (``create_graph=True``)
    through a model whose attention is tiled over queries raised
    (``once_differentiable``); it now equals the unwrapped model's."""
    from memscale import _attention as attention

    model, ref = _gpt2("eager"), _gpt2("eager")
    ref.load_state_dict(model.state_dict())
    ids = torch.randint(0, 128, (2, 64))
    memscale.wrap(model, FORCE_TILE, sample_input={"input_ids": ids})
    assert model.config._attn_implementation == attention.NAME
    for m in (ref, model):
        emb = m.transformer.wte(ids)
        loss = m(inputs_embeds=emb, labels=ids).loss
        (g,) = torch.autograd.grad(loss, emb, create_graph=True)
        (loss + g.pow(2).sum()).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) <= 1e-5, name
    memscale.detach(model)


def test_double_backward_refuses_a_read_tensor_upstream_of_the_queries():
    """A parameter the attention reads that the queries were also computed
    from would get its gradient twice when the tile differentiates the
    saved queries themselves (create_graph): refused, not miscounted."""
    from memscale._attention import _Recomputed, _Tile

    module = _Sinks()
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    x = q * module.scale  # the queries depend on a parameter the tile reads
    tile = _Tile(module, _sink_attention, False, 0, 6, {})
    out = _Recomputed.apply(tile, x, k, v, None, *tile.extras())
    with pytest.raises(RuntimeError, match="counted twice"):
        torch.autograd.grad(out.pow(2).sum(), [module.scale], create_graph=True)
    # First order reads detached copies: no double count there (the total
    # gradient: direct, and through the queries).
    x = q * module.scale
    out = _Recomputed.apply(tile, x, k, v, None, *tile.extras())
    (got,) = torch.autograd.grad(out.pow(2).sum(), [module.scale])
    x = q * module.scale
    out = _sink_attention(module, x, k, v, None)[0]
    (want,) = torch.autograd.grad(out.pow(2).sum(), [module.scale])
    assert torch.allclose(got, want, rtol=1e-5)
