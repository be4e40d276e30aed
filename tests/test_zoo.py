"""The model zoo: every architecture of tests/zoo_models.py trains under
memscale with loss and gradients bitwise equal to the unwrapped model, in
CONSERVATIVE and BALANCED, with and without ``sample_input``; state_dict
keys unchanged while wrapped, nothing left after ``detach``.

T5 is the fast part (it failed in backward before: issue 22); the rest is
marked slow.  ``scripts/model_zoo.py`` writes the table of docs/model-zoo.md
from the same checks.
"""

from __future__ import annotations

import pytest
import torch
import zoo_models as zoo

import memscale
from memscale import _hf_cache

FAST = {"t5"}
CASES = [
    pytest.param(
        arch.name,
        mode,
        sample,
        id=f"{arch.name}-{mode}-{'sample' if sample else 'warmup'}",
        marks=() if arch.name in FAST else pytest.mark.slow,
    )
    for arch in zoo.ZOO
    for mode in zoo.MODES
    for sample in (True, False)
]


@pytest.mark.parametrize(("name", "mode", "sample"), CASES)
def test_trains_exactly(name, mode, sample):
    result = zoo.check(zoo.BY_NAME[name], mode, sample)
    # Not vacuous: the plan checkpointed layers.
    assert result["counts"]["checkpoint"] > 0


def test_zoo_spans_the_families():
    families = {arch.family for arch in zoo.ZOO}
    assert {"decoder", "encoder", "encoder-decoder", "vision", "moe", "multimodal"} <= families
    assert len(zoo.ZOO) >= 15


def test_t5_cache_off_on_every_config_and_restored():
    """T5's encoder and decoder stacks each hold a copy of the model's
    config, and the decoder reads ``use_cache`` from its own: with only
    ``model.config`` changed, the decoder kept filling a cache that the
    recompute of a decoder block then saw already filled."""
    model = zoo.build(zoo.BY_NAME["t5"])
    decoder_cfg = model.decoder.config
    assert decoder_cfg is not model.config and decoder_cfg.use_cache is True
    before = {id(c): dict(vars(c)) for c in _hf_cache.hf_configs(model)}
    batch = zoo.BY_NAME["t5"].batch()
    memscale.wrap(
        model, memscale.Config(mode="conservative", force_optimize=True), sample_input=batch
    )
    try:
        assert model.config.use_cache is False and decoder_cfg.use_cache is False
        out = model(**batch)
        assert out.past_key_values is None
        out.loss.backward()
    finally:
        memscale.detach(model)
    assert {id(c): dict(vars(c)) for c in _hf_cache.hf_configs(model)} == before


def test_use_cache_class_default_restored_exactly(monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    )
    cfg = model.config
    cfg.__dict__.pop("use_cache", None)
    monkeypatch.setattr(type(cfg), "use_cache", True)  # a class default only
    changed, undo = _hf_cache.disable_use_cache(model)
    assert changed == [cfg] and cfg.use_cache is False
    undo()
    assert "use_cache" not in vars(cfg) and cfg.use_cache is True
    undo()  # idempotent
    assert "use_cache" not in vars(cfg)
