"""Small values stay real in memscale's fake passes (memscale._smallvalues):
the profile's pass takes the path a real forward takes, draws nothing from
the user's RNG streams and changes no input of the user's."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gpt2, tiny_llama
from torch.overrides import TorchFunctionMode

import memscale
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
@pytest.mark.parametrize("mask", [False, True, "sliced"], ids=["ids", "ids+mask", "sliced"])
def test_the_profiles_fake_pass_runs_the_attention_a_real_forward_runs(factory, mask):
    """Hugging Face builds a causal mask when the position ids it makes
    with ``torch.arange``, or the attention mask it is given, is a fake
    tensor (it takes it for a trace), and leaves it out in a real step
    whose mask is all ones.  The profile's pass keeps both real (a batch
    sliced from a larger tensor too): its
    attention runs as the real forward's (no mask; Llama's keys and values
    not expanded) and every layer saves the bytes a real forward saves."""
    model = factory()
    model.train()
    inputs = {"input_ids": IDS}
    if mask == "sliced":
        # A batch sliced from a dataset's tensor of over 8 MiB: the batch
        # alone counts (it is what the pass copies).
        dataset = torch.randint(0, 256, (20000, 64), generator=torch.Generator().manual_seed(2))
        masks = torch.ones(20000, 64, dtype=torch.int64)
        inputs = {"input_ids": dataset[:4], "attention_mask": masks[:4]}
    elif mask:
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


def test_calls_on_what_the_pass_made_run_for_real_once():
    """Inside the fake mode, what a call on real values only returns is
    real (``torch.arange``), an in-place write to it is applied once (the
    size is learnt on fake twins: the fake mode would run the real kernel
    of an arithmetic call on real arguments), and ``_foreach_add_`` on the
    pass's own tensors (an optimizer's step counters) writes them for
    real, though it returns nothing that says how big it is."""
    mode, _ = _torch_compat.fake_tensor_mode(allow_non_fake_inputs=True)
    with mode, _smallvalues.SmallValuesMode(_smallvalues.SmallValues(mode)):
        made = torch.arange(4)
        made.add_(1)
        made.mul_(2)
        steps = [torch.zeros(()), torch.full((), 2.0)]
        torch._foreach_add_(steps, 1)
    assert not _torch_compat.is_fake(made) and made.tolist() == [2, 4, 6, 8]
    assert [float(s) for s in steps] == [1.0, 3.0]


@torch.library.custom_op("memscale_test::bump", mutates_args=())
def _bump(x: torch.Tensor) -> torch.Tensor:
    _BUMPED.append(1)
    return x + 1


@_bump.register_fake
def _(x):
    return torch.empty_like(x)


_BUMPED: list[int] = []


def test_nothing_outside_the_pass_is_written_or_called_for_real():
    """A real tensor the pass did not make (a model's plain attribute, the
    caller's) is never written, also after a view of it was read: the call
    runs on its fake twin.  Only
    torch's own operators run for real: a custom operator (as a
    collective) on real values runs its fake implementation."""
    _BUMPED.clear()
    mode, _ = _torch_compat.fake_tensor_mode(allow_non_fake_inputs=True)
    outside = torch.zeros(3, dtype=torch.int64)
    with mode, _smallvalues.SmallValuesMode(_smallvalues.SmallValues(mode)):
        # A view of it, run for real, does not make it the pass's own.
        assert outside[:2].sum().item() == 0
        written = outside.add_(1)
        outside.view(-1).mul_(3)
        bumped = torch.ops.memscale_test.bump(torch.arange(3))
    assert outside.tolist() == [0, 0, 0] and written is outside
    assert _torch_compat.is_fake(bumped)
    assert _BUMPED == []


def test_each_simulated_forward_starts_from_the_batch_as_it_is():
    """A forward that changes an integer input in place (``lengths -= 1``)
    and reads it: the warm-up and every simulated step get the batch as the
    caller passed it, not as the previous simulated forward left it; the
    caller's tensor is unchanged."""
    seen = []

    class Trims(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x, lengths):
            lengths -= 1
            seen.append(int(lengths.max()))
            return self.fc(x[:, : int(lengths.max())]).sum()

    model = Trims()
    lengths = torch.tensor([255, 200])
    x = torch.randn(2, 256, 8)
    memscale.predict_peak(model, (x, lengths), memscale.Config(enable_logging=False))
    assert len(seen) >= 2 and set(seen) == {254}
    assert lengths.tolist() == [255, 200]


def test_a_size_that_depends_on_values_runs_for_real_only_when_bounded():
    """``nonzero`` on a small real mask runs for real (its output is at most
    the mask's elements by its dimensions); ``repeat_interleave``, whose
    output a small input does not bound, is not computed: the fake mode's
    error says the size is not known."""
    mode, _ = _torch_compat.fake_tensor_mode(allow_non_fake_inputs=True)
    with mode, _smallvalues.SmallValuesMode(_smallvalues.SmallValues(mode)):
        found = torch.nonzero(torch.tensor([0, 3, 0, 5]))
        with pytest.raises(Exception, match="repeat_interleave"):
            torch.repeat_interleave(torch.tensor([10**9]))
    assert found.flatten().tolist() == [1, 3]


def test_a_literal_is_the_pass_own_and_a_numpy_array_is_not():
    """``torch.tensor(0.0)`` made in the pass (an optimizer's step counter)
    is the pass's own: ``+= 1`` on it runs for real and ``item()`` reads
    it.  ``torch.as_tensor`` and ``torch.from_numpy`` of a NumPy array,
    which reach the same ``lift_fresh``, share the array's memory: a write
    runs on a fake twin, and the array is as it was."""
    import numpy as np

    array = np.zeros(2, dtype=np.float32)
    mode, _ = _torch_compat.fake_tensor_mode(allow_non_fake_inputs=True)
    with mode, _smallvalues.SmallValuesMode(_smallvalues.SmallValues(mode)):
        step = torch.tensor(0.0)
        step += 1
        step += 1
        seen = step.item()
        torch.as_tensor(array).add_(1)
        torch.from_numpy(array).mul_(3).add_(5)
    assert not _torch_compat.is_fake(step) and seen == 2.0 and float(step) == 2.0
    assert array.tolist() == [0.0, 0.0]


def test_calls_on_one_element_run_for_real_without_fake_twins(monkeypatch):
    """A call whose tensors hold one element each and whose result is no
    larger (a pointwise operator, ``_foreach_``, ``item()``) runs for real
    at once: the step counters of a deep model's optimizer cost no fake
    twin each.  A larger one still learns its size on twins first."""
    twins = []
    faked = _smallvalues.SmallValues._faked

    def counted(self, args, kwargs):
        twins.append(1)
        return faked(self, args, kwargs)

    monkeypatch.setattr(_smallvalues.SmallValues, "_faked", counted)
    mode, _ = _torch_compat.fake_tensor_mode(allow_non_fake_inputs=True)
    with mode, _smallvalues.SmallValuesMode(_smallvalues.SmallValues(mode)):
        steps = [torch.tensor(0.0), torch.tensor(4.0)]
        torch._foreach_add_(steps, 1)
        steps[0] += 1
        scale = (steps[1] * 0.5).sqrt().item()
        assert twins == []
        torch.arange(4).add_(1)
    assert [float(s) for s in steps] == [2.0, 5.0] and scale == pytest.approx(1.5811388)
    assert len(twins) == 2


def test_the_pass_remembers_thousands_of_storages_without_walking_them_each_call(monkeypatch):
    """The storages a pass made are remembered (weakly); the expired ones
    are dropped when their count doubles, not at every call past 4,096:
    thousands of step counters alive would make each call walk them."""
    walked = []

    class Counted(_smallvalues.StorageWeakRef):
        def expired(self):
            walked.append(1)
            return super().expired()

    monkeypatch.setattr(_smallvalues, "StorageWeakRef", Counted)
    values = _smallvalues.SmallValues(_torch_compat.fake_tensor_mode()[0])
    alive = [torch.zeros(()) for _ in range(4500)]
    for t in alive:
        values._remember(t)
    assert len(values._made) == len(alive)
    assert len(walked) < 2 * len(alive)


def test_a_counter_a_forward_makes_on_a_module_is_gone_after_the_passes():
    """A module that makes a counter in its first forward (a literal, real
    in memscale's passes) and bumps it each forward: predict_peak and wrap
    leave the attribute as it was, however many passes they ran."""

    class Counts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.seen = None

        def forward(self, x):
            if self.seen is None:
                self.seen = torch.tensor(0)
            self.seen += 1
            return self.fc(x)

    config = memscale.Config(mode="conservative", force_optimize=True, enable_logging=False)
    model = Counts()
    memscale.predict_peak(model, torch.randn(4, 8), config)
    assert model.seen is None
    memscale.wrap(model, config, sample_input=torch.randn(4, 8))
    assert model.seen is None
    model(torch.randn(4, 8)).sum().backward()
    assert int(model.seen) == 1  # the user's own forward counts
    memscale.detach(model)
