"""Each checkpointed layer is checked at its first checkpointed forward
(memscale/_recompute_check.py): a layer that computes something else when
run again is named at the first step, that step stays exact, and the plan
is made again without checkpointing it; or, with
Config(strict_recompute=True), RecomputeMismatchError is raised."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import zoo_models as zoo
from conftest import assert_same_step, hook_count
from torch import nn

import memscale
from memscale import _torch_compat

FORCE = memscale.Config(mode="conservative", force_optimize=True, enable_logging=False)


class CacheBlock(nn.Module):
    """Appends its input to its entry of a per-forward cache and attends
    over the entry (a key/value cache in miniature): run again, it sees its
    own input twice."""

    def __init__(self, index: int, width: int = 16) -> None:
        super().__init__()
        self.index = index
        self.fc1 = nn.Linear(width, 8 * width)
        self.fc2 = nn.Linear(8 * width, width)

    def forward(self, x, cache):
        entry = cache.setdefault(self.index, [])
        entry.append(x)
        h = torch.cat(entry, dim=1)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(h))).mean(dim=1, keepdim=True)


class CacheNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([CacheBlock(i) for i in range(3)])
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        cache: dict[int, list[torch.Tensor]] = {}
        for block in self.blocks:
            x = block(x, cache)
        return self.head(x).sum()


def _assert_steps_exact(model, ref, run, steps=3):
    """``steps`` training steps (RNG seed = step) with the loss ``run(model)``
    give the same losses and gradients, bit for bit."""
    for step in range(steps):
        assert_same_step(model, ref, None, seed=step, loss_fn=lambda m, _: run(m))


@pytest.mark.parametrize("sample", [True, False], ids=["sample_input", "warmup"])
def test_a_layer_with_a_cache_is_caught_at_the_first_step_and_falls_back(sample, caplog):
    model = CacheNet()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    hooks = hook_count(model)
    config = FORCE.replace(warmup_steps=1)
    memscale.wrap(model, config, sample_input=x if sample else None)
    ex = model._memscale_executor
    try:
        with caplog.at_level(logging.WARNING, logger="memscale"):
            _assert_steps_exact(model, ref, lambda m: m(x))
        assert ex.recompute_check.failed.keys() == {0, 1, 2}
        assert "checkpointed layer 'blocks.0' (CacheBlock) does not compute the same" in caplog.text
        assert (
            "saved tensor #0 is float32[20, 16] when run again where the forward "
            "saved float32[10, 16]" in caplog.text
        )
        assert "a key/value cache it appends to" in caplog.text
        assert [layer.rule for layer in ex.plan.layers] == ["ineligible:unrepeatable"] * 3
        assert ex.stats["recomputes"] == 0  # never recomputed: no late failure
    finally:
        memscale.detach(model)
    assert hook_count(model) == hooks
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_strict_recompute_raises_at_the_first_forward_and_leaves_nothing():
    model = CacheNet()
    x = torch.randn(2, 5, 16)
    hooks = hook_count(model)
    memscale.wrap(model, FORCE.replace(strict_recompute=True), sample_input=x)
    try:
        with pytest.raises(
            memscale.RecomputeMismatchError,
            match=r"layer 'blocks\.0' \(CacheBlock\).*saved tensor #0.*"
            r"Likely cause.*strict_recompute=False",
        ):
            model(x)
        assert _torch_compat.top_saved_tensors_hooks() is None  # every frame left
        assert model._memscale_executor.plan.technique_counts["checkpoint"] == 3
    finally:
        memscale.detach(model)
    assert hook_count(model) == hooks
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_repeatable_layers_pass_and_are_checked_once():
    model = zoo.build(zoo.BY_NAME["gpt2"])  # dropout on: torch's RNG is replayed
    batch = zoo.BY_NAME["gpt2"].batch()
    memscale.wrap(model, FORCE, sample_input=batch)
    try:
        check = model._memscale_executor.recompute_check
        model(**batch).loss.backward()
        assert check.passed == {0, 1} and not check.failed
        # The check's forward is gone; memscale's compiled-path forward
        # (memscale._compiled, from wrap to detach) stays.
        assert all(
            m.__dict__["forward"].__qualname__.startswith("_unit_forward") for m in check.units
        )
        assert model._memscale_executor.stats["recomputes"] == 2
    finally:
        memscale.detach(model)


def test_t5_with_use_cache_passed_falls_back_exactly(caplog):
    """A user who passes use_cache=True to the forward gets the cache
    memscale turned off in the config: the decoder blocks are caught at
    the first step and left un-checkpointed; the encoder's stay."""
    arch = zoo.BY_NAME["t5"]
    model = zoo.build(arch)
    ref = copy.deepcopy(model)
    batch = {**arch.batch(), "use_cache": True}
    memscale.wrap(model, FORCE, sample_input=arch.batch())
    try:
        with caplog.at_level(logging.WARNING, logger="memscale"):
            _assert_steps_exact(model, ref, lambda m: m(**batch).loss)
        ex = model._memscale_executor
        names = ex.layer_names
        assert {names[i] for i in ex.recompute_check.failed} == {
            "decoder.block.0",
            "decoder.block.1",
        }
        assert "checkpointed layer 'decoder.block.0' (T5Block)" in caplog.text
        assert [layer.techniques for layer in ex.plan.layers] == [
            ("checkpoint",),
            ("checkpoint",),
            (),
            (),
        ]
    finally:
        memscale.detach(model)


def test_without_visible_saved_tensor_hooks_nothing_is_checked(monkeypatch, caplog):
    monkeypatch.setattr(_torch_compat, "SAVED_TENSORS_HOOKS_VISIBLE", False)
    model = zoo.build(zoo.BY_NAME["gpt2"])
    batch = zoo.BY_NAME["gpt2"].batch()
    with caplog.at_level(logging.INFO, logger="memscale"):
        memscale.wrap(model, FORCE, sample_input=batch)
    try:
        assert model._memscale_executor.recompute_check is None
        assert "checkpointed layers are not checked at the first step" in caplog.text
        model(**batch).loss.backward()
    finally:
        memscale.detach(model)


class SharedCacheNet(nn.Module):
    """The first CacheBlock runs at two positions (ALBERT-style sharing)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([CacheBlock(0), CacheBlock(1)])
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        cache: dict[int, list[torch.Tensor]] = {}
        for block in (self.blocks[0], self.blocks[0], self.blocks[1]):
            x = block(x, cache)
        return self.head(x).sum()


def test_a_shared_layer_that_fails_keeps_every_call_of_that_step():
    """The calls after the failed check in the same forward are not
    recomputed either: the first step's backward runs without a recompute.
    (That step's second call sees the cache entry the check's run added,
    as documented: a layer reading state it changed itself in the same
    forward; the steps after are exact.)"""
    model = SharedCacheNet()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    memscale.wrap(model, FORCE, sample_input=x)
    try:
        ex = model._memscale_executor
        assert ex.plan.technique_counts["checkpoint"] == 2
        model(x).backward()
        assert ex.stats["recomputes"] == 0
        assert all(p.grad is not None for p in model.parameters())
        _assert_steps_exact(model, ref, lambda m: m(x))
        assert ex.stats["recomputes"] == 0
        assert [layer.rule for layer in ex.plan.layers] == ["ineligible:unrepeatable"] * 2
    finally:
        memscale.detach(model)


def test_the_check_leaves_every_storage_it_read_resizable():
    # Its fingerprint read the saved tensors' bytes through numpy, which
    # marks a storage it reads as not resizable: the user's input here
    # (and under FSDP2, which frees unsharded parameters by resizing their
    # storage to 0, the first forward failed).
    from conftest import mlp

    model = mlp()
    memscale.wrap(model, FORCE)
    x = torch.randn(4, 32)
    model(x).sum().backward()
    assert model._memscale_executor.recompute_check.passed  # the check ran
    assert x.untyped_storage().resizable()
    assert all(p.untyped_storage().resizable() for p in model.parameters())
    memscale.detach(model)
