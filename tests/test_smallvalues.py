"""Small values stay real in memscale's fake passes (memscale._smallvalues):
the profile's pass takes the path a real forward takes, draws nothing from
the user's RNG streams and changes no input of the user's."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gpt2, tiny_llama
from torch.overrides import TorchFunctionMode

from memscale import _planning, _smallvalues, _torch_compat

IDS = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))


class _Attention(TorchFunctionMode):
    """How SDPA is called: (query fake, a mask given, is_causal, enable_gqa)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls.append((mask is not None, kwargs.get("is_causal"), kwargs.get("enable_gqa")))
        return func(*args, **kwargs)


def _blocks(model):
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    return [(f"layer{i}", layer) for i, layer in enumerate(layers)]


def _llama():
    return tiny_llama(attn_implementation="sdpa", max_position_embeddings=256)


def _gpt2():
    return tiny_gpt2(dropout=0.0, n_positions=256, attn_implementation="sdpa")


@pytest.mark.parametrize("factory", [_llama, _gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("mask", [False, True], ids=["ids", "ids+mask"])
def test_the_profiles_fake_pass_runs_the_attention_a_real_forward_runs(factory, mask):
    """Hugging Face builds a causal mask when the position ids it makes
    with ``torch.arange``, or the attention mask it is given, is a fake
    tensor (it takes it for a trace), and leaves it out in a real step
    whose mask is all ones.  The profile's pass keeps both real: its
    attention runs as the real forward's (no mask; Llama's keys and values
    not expanded) and every layer saves the bytes a real forward saves."""
    model = factory()
    model.train()
    inputs = {"input_ids": IDS}
    if mask:
        inputs["attention_mask"] = torch.ones_like(IDS)
    units = _blocks(model)
    with _Attention() as fake_calls:
        static = _planning.profile_from(
            *_planning._profile_static(model, units, (), inputs)[:1], units, "static"
        )
    with _Attention() as real_calls:
        real = _planning.profile_from(
            *_planning._profile_empirical(model, units, (), inputs)[:1], units, "empirical"
        )
    assert fake_calls.calls and fake_calls.calls == real_calls.calls
    assert not any(given for given, _, _ in fake_calls.calls)
    assert [layer.saved_bytes for layer in static.layers] == [
        layer.saved_bytes for layer in real.layers
    ]


class _Draws(torch.nn.Module):
    """A layer that draws a few indices (a call with no tensor argument,
    run for real in a fake pass) and changes its integer input in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x, positions):
        picked = torch.randint(0, 16, (4,))
        positions.fill_(3)
        return self.fc(x)[:, picked].sum() + positions.sum()


def test_the_profiles_pass_leaves_the_rng_and_the_inputs_as_they_were():
    """A call run for real in the profile's pass may draw from the RNG: the
    user's stream is as before the pass.  An input kept real is a copy: the
    forward's in-place write does not reach the caller's tensor."""
    layer = _Draws()
    positions = torch.arange(8)
    x = torch.randn(8, 16)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    _planning._profile_static(layer, [("layer", layer)], (x, positions), {})
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(positions, torch.arange(8))


def test_a_call_that_returns_nothing_on_real_values_runs_for_real():
    """``_foreach_add_`` on real tensors inside the fake mode (an optimizer's
    step counters) writes them for real: nothing it returns says how big
    it is, and what it writes is read later (a step count of 0 divides by
    zero in AdamW's bias correction)."""
    mode, _ = _torch_compat.fake_tensor_mode(allow_non_fake_inputs=True)
    steps = [torch.tensor(0.0), torch.tensor(2.0)]
    with mode, _smallvalues.SmallValuesMode(_smallvalues.SmallValues()):
        torch._foreach_add_(steps, 1)
        made = torch.arange(4)
    assert [float(s) for s in steps] == [1.0, 3.0]
    assert not _torch_compat.is_fake(made) and made.tolist() == [0, 1, 2, 3]
