"""Checkpointing on CUDA: the recompute replays the forward's CUDA RNG
state (dropout), so gradients are bitwise the unwrapped model's."""

from __future__ import annotations

import pytest
import torch
from conftest import FORCE, hook_count, mlp, tiny_gpt2, token_batch, train_step
from gpu_helpers import DEV, deterministic, grads, same

import memscale

pytestmark = pytest.mark.cuda

CONFIG = FORCE.replace(enable_logging=False)


def _mlp():
    return mlp(depth=4, width=64, p=0.2).to(DEV), torch.randn(32, 64).to(DEV)


def _gpt2():
    pytest.importorskip("transformers", reason="transformers is not installed")
    # Eager attention: torch's fused attention kernels have no
    # deterministic backward on CUDA.
    model = tiny_gpt2(dropout=0.1, attn_implementation="eager").to(DEV)
    return model, token_batch(batch=2, seq=32).to(DEV)


BUILD = {"mlp": _mlp, "gpt2": _gpt2}


@pytest.mark.parametrize("name", sorted(BUILD))
def test_checkpointed_dropout_is_bitwise_the_unwrapped_model(name):
    with deterministic():
        model, x = BUILD[name]()
        ref, _ = BUILD[name]()
        model.train()
        ref.train()
        # The control: the unwrapped model is reproducible on this device,
        # so a difference below is memscale's.
        first = train_step(ref, x, seed=7)
        first_grads = grads(ref)
        again = train_step(ref, x, seed=7)
        assert torch.equal(first, again) and same(first_grads, grads(ref)), (
            "the unwrapped model is not reproducible on this device"
        )
        after_ref = torch.cuda.get_rng_state(DEV)
        sample = x if name == "mlp" else {"input_ids": x, "labels": x}
        memscale.wrap(model, CONFIG, sample_input=sample)
        ex = model._memscale_executor
        counts = ex.plan.technique_counts
        assert counts["checkpoint"] == len(ex.plan.layers) > 0
        loss = train_step(model, x, seed=7)
        assert torch.equal(loss, first), f"loss {loss.item()} != {first.item()}"
        assert same(grads(model), first_grads)
        assert ex.stats["recomputes"] == counts["checkpoint"]
        # The recompute put the caller's CUDA RNG state back: the generator
        # is where the unwrapped step left it.
        assert torch.equal(torch.cuda.get_rng_state(DEV), after_ref)
        memscale.detach(model)
        assert hook_count(model) == 0


def test_dropout_masks_differ_between_steps_and_replay_within_one():
    """Two steps with different seeds draw different masks (dropout is
    live), and each matches its own unwrapped step."""
    with deterministic():
        model, x = _mlp()
        ref, _ = _mlp()
        memscale.wrap(model, CONFIG, sample_input=x)
        losses = []
        for seed in (1, 2):
            loss = train_step(model, x, seed=seed)
            assert torch.equal(loss, train_step(ref, x, seed=seed))
            assert same(grads(model), grads(ref))
            losses.append(loss)
        assert not torch.equal(losses[0], losses[1])
        memscale.detach(model)
