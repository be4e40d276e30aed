"""Copying and pickling a wrapped model (issue 20, item 3).

Any copy (``copy.deepcopy``, ``copy.copy``, ``pickle``, ``torch.save``)
is an unwrapped model with the original's weights; the original stays
wrapped and trains exactly as before; the copy trains exactly as an
unwrapped model; ``detach`` of the original afterwards leaves nothing.
"""

from __future__ import annotations

import copy
import gc
import io
import logging
import pickle
import weakref

import pytest
import torch
from conftest import FORCE, assert_same_step, hook_count, mlp, tiny_gpt2, token_batch, train_step

import memscale

X = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(3))


def deep(m):
    return copy.deepcopy(m)


def shallow(m):
    return copy.copy(m)


def pickled(m):
    return pickle.loads(pickle.dumps(m))


def saved(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {"deepcopy": deep, "copy": shallow, "pickle": pickled, "torch.save": saved}


def assert_plain_copy(clone, model):
    """An unwrapped model of its own with the original's weights."""
    assert "_memscale_executor" not in clone.__dict__
    assert not {"__deepcopy__", "__reduce_ex__"} & set(clone.__dict__)
    assert hook_count(clone) == 0
    for (name, p), (_, q) in zip(clone.state_dict().items(), model.state_dict().items()):
        assert torch.equal(p, q), name
        assert p.data_ptr() != q.data_ptr(), f"{name} shares storage with the original"


@pytest.mark.parametrize("how", sorted(COPIES))
def test_copy_is_unwrapped_and_original_keeps_working(how, caplog):
    model, ref = mlp(), mlp()
    model.train()
    ref.train()
    memscale.wrap(model, FORCE, sample_input=X)
    hooks = hook_count(model)
    assert hooks > 0
    with caplog.at_level(logging.INFO, logger="memscale"):
        clone = COPIES[how](model)
    notes = [r for r in caplog.records if "copy is not wrapped" in r.getMessage()]
    assert len(notes) == 1
    assert_plain_copy(clone, model)
    # The original is still wrapped, with all its hooks, and exact.
    assert model._memscale_executor.state == "applied"
    assert hook_count(model) == hooks
    recomputes = model._memscale_executor.stats["recomputes"]
    assert_same_step(model, ref, X)
    assert model._memscale_executor.stats["recomputes"] > recomputes
    # The copy trains exactly as an unwrapped model.
    plain = mlp()
    plain.train()
    assert_same_step(clone, plain, X)
    memscale.detach(model)
    assert hook_count(model) == 0
    assert not {"__deepcopy__", "__reduce_ex__", "_memscale_executor"} & set(model.__dict__)
    memscale.wrap(clone, FORCE, sample_input=X)  # and the copy can be wrapped
    assert_same_step(clone, plain, X)
    memscale.detach(clone)


def test_ema_copy_tracks_the_wrapped_model():
    """timm/diffusers-style EMA: a deepcopy updated with lerp_ from the
    wrapped model as it trains, against the same without memscale."""
    model, ref = mlp(), mlp()
    for m in (model, ref):
        m.train()
    memscale.wrap(model, FORCE, sample_input=X)
    ema, ref_ema = copy.deepcopy(model), copy.deepcopy(ref)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    for step in range(3):
        for m, opt in zip((model, ref), opts):
            train_step(m, X, seed=step)
            opt.step()
        with torch.no_grad():
            for e, m in ((ema, model), (ref_ema, ref)):
                for pe, pm in zip(e.parameters(), m.parameters()):
                    pe.lerp_(pm, 0.1)
    for a, b in zip(
        list(model.parameters()) + list(ema.parameters()),
        list(ref.parameters()) + list(ref_ema.parameters()),
    ):
        assert torch.equal(a, b)
    assert hook_count(ema) == 0
    executor = weakref.ref(model._memscale_executor)
    memscale.detach(model)
    del opts
    gc.collect()
    assert executor() is None, "the executor outlived detach"
    assert hook_count(model) == 0


def test_gpt2_copy_gets_its_settings_back():
    """wrap sets config.use_cache=False on the model; the copy is as after
    detach (use_cache=True), the original keeps its setting until detach."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=128,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=True,
    )
    model = GPT2LMHeadModel(cfg)
    ref = copy.deepcopy(model)
    x = token_batch(vocab=128, seq=16)
    memscale.wrap(model, FORCE, sample_input={"input_ids": x, "labels": x})
    assert model.config.use_cache is False
    clone = copy.deepcopy(model)
    assert clone.config.use_cache is True
    assert model.config.use_cache is False
    assert clone.lm_head.weight is clone.transformer.wte.weight  # ties kept
    assert_plain_copy(clone, model)
    assert_same_step(clone, ref, x)
    assert_same_step(model, ref, x)
    memscale.detach(model)
    assert model.config.use_cache is True


def test_copy_of_a_model_holding_a_wrapped_submodule():
    """Copying a larger model that holds a wrapped model copies the inner
    one unwrapped too."""
    inner = mlp()
    inner.train()
    memscale.wrap(inner, FORCE, sample_input=X)
    outer = torch.nn.Sequential(inner, torch.nn.Linear(32, 32))
    clone = copy.deepcopy(outer)
    assert hook_count(clone) == 0
    assert "_memscale_executor" not in clone[0].__dict__
    assert "_memscale_executor" in inner.__dict__
    memscale.detach(inner)


def test_tiny_gpt2_fixture_copy():
    model = tiny_gpt2(dropout=0.0)
    x = token_batch(seq=16)
    memscale.wrap(model, FORCE, sample_input={"input_ids": x, "labels": x})
    clone = pickled(model)
    assert_plain_copy(clone, model)
    memscale.detach(model)


def test_copy_during_warmup_and_user_attributes():
    """A model copied while memscale still measures its warm-up steps is
    unwrapped too; a user's own memscale objects on the model are kept."""
    model, ref = mlp(), mlp()
    model.train()
    model.my_config = memscale.Config(mode="aggressive")
    memscale.wrap(model, memscale.Config(force_optimize=True, warmup_steps=2))
    train_step(model, X)
    clone = copy.deepcopy(model)
    assert hook_count(clone) == 0
    assert clone.my_config == model.my_config
    assert_same_step(clone, ref, X)
    train_step(model, X)
    train_step(model, X)
    assert model._memscale_executor.state == "applied"
    memscale.detach(model)


def test_copy_of_a_tiled_model_runs_its_own_forward():
    """Tiling puts a tiled forward on each tiled block; the copy has none."""
    model, ref = mlp(width=16), mlp(width=16)
    model.train()
    x = torch.randn(2, 64, 16)
    config = memscale.Config(mode="aggressive", force_optimize=True, enable_tiling=True)
    memscale.wrap(model, config, sample_input=x)
    assert any(layer.tiles > 1 for layer in model._memscale_executor.plan.layers)
    assert any("forward" in m.__dict__ for m in model.modules())
    clone = copy.deepcopy(model)
    assert not any("forward" in m.__dict__ for m in clone.modules())
    assert_same_step(clone, ref, x)
    memscale.detach(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_copy_shares_no_spill_store():
    """With async offload to disk, the original keeps spilling through its
    own store after a copy; the copy has none and trains exactly."""
    model, ref = mlp(), mlp()
    model.train()
    config = memscale.Config(
        mode="balanced",
        force_optimize=True,
        async_offload=True,
        async_config=memscale.AsyncOffloadConfig(min_offload_bytes=0),
    )
    memscale.wrap(model, config, sample_input=X)
    store = model._memscale_executor.offload_store
    assert store is not None
    clone = pickled(model)
    assert_plain_copy(clone, model)
    written = store.stats["tensors_written"]
    assert_same_step(model, ref, X)
    assert store.stats["tensors_written"] > written
    plain = mlp()
    plain.train()
    assert_same_step(clone, plain, X)
    memscale.detach(model)
