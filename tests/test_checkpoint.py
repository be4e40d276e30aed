"""Activation checkpointing: the same loss and gradients as without memscale.

Every test runs a wrapped model and an identical unwrapped one from the same
RNG state and compares bitwise (CPU fp32 ops here are deterministic;
dropout masks are replayed from the recorded RNG state).
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    CNN,
    FORCE,
    Block,
    assert_same_grads,
    assert_same_step,
    mlp,
    tiny_bert,
    tiny_gpt2,
    token_batch,
    twins,
)
from torch import nn

import memscale

CASES = {
    "mlp": (lambda: mlp(p=0.0), lambda: torch.randn(8, 32)),
    "mlp-dropout": (lambda: mlp(p=0.3), lambda: torch.randn(8, 32)),
    "cnn-batchnorm": (CNN, lambda: torch.randn(4, 3, 8, 8)),
    "gpt2": (tiny_gpt2, token_batch),
    "bert": (tiny_bert, token_batch),
}


def _sample(x):
    return {"input_ids": x} if x.dtype == torch.long else x


@pytest.mark.parametrize("profiling", ["static", "empirical", "warmup"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gradient_parity(case, profiling):
    factory, make_input = CASES[case]
    model, ref = twins(factory)
    x = make_input()
    config = FORCE
    sample = _sample(x)
    if profiling == "empirical":
        config = FORCE.replace(use_static_profiling=False)
    elif profiling == "warmup":
        sample = None
    memscale.wrap(model, config, sample_input=sample)
    executor = model._memscale_executor
    for seed in range(3):  # with warm-up, the plan applies from step 3
        assert_same_step(model, ref, x, seed)
    assert executor.state == "applied"
    assert executor.plan.technique_counts["checkpoint"] > 0
    assert executor.stats["recomputes"] > 0
    # Buffers (BatchNorm running statistics) are updated once per step,
    # not again by the recompute.
    for (name, b1), (_, b2) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(b1, b2), name
    memscale.detach(model)


def test_plan_is_applied_to_every_block_of_gpt2():
    model, _ = twins(tiny_gpt2)
    memscale.wrap(model, FORCE, sample_input={"input_ids": token_batch()})
    plan = model._memscale_executor.plan
    assert [l.name for l in plan.layers] == [f"transformer.h.{i}" for i in range(3)]
    assert all(l.techniques == ("checkpoint",) and l.rule == "force-all" for l in plan.layers)
    memscale.detach(model)


def test_autograd_grad_and_backward_inputs():
    model, ref = twins(lambda: mlp(p=0.2))
    x = torch.randn(4, 32, requires_grad=True)
    memscale.wrap(model, FORCE, sample_input=x)
    params = list(model.parameters())
    ref_params = list(ref.parameters())

    torch.manual_seed(0)
    g1 = torch.autograd.grad(model(x).sum(), [x] + params)
    torch.manual_seed(0)
    g2 = torch.autograd.grad(ref(x).sum(), [x] + ref_params)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)

    # backward(inputs=...): only the first block's weight gets a gradient.
    torch.manual_seed(1)
    model(x).sum().backward(inputs=[params[0]])
    torch.manual_seed(1)
    ref(x).sum().backward(inputs=[ref_params[0]])
    assert torch.equal(params[0].grad, ref_params[0].grad)
    assert params[2].grad is None
    memscale.detach(model)


def test_retain_graph_twice():
    model, ref = twins(lambda: mlp(p=0.2))
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE, sample_input=x)
    torch.manual_seed(3)
    loss = model(x).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    torch.manual_seed(3)
    ref_loss = ref(x).sum()
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    assert_same_grads(model, ref)
    memscale.detach(model)


class KwargsBlock(nn.Module):
    """Takes keyword arguments and returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, *, scale=1.0, mask=None):
        h = torch.tanh(self.lin(x)) * scale
        if mask is not None:
            h = h * mask
        return {"hidden": h + x, "aux": (h.sum(), h.mean())}


class KwargsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([KwargsBlock() for _ in range(3)])

    def forward(self, x, mask):
        aux = 0
        for layer in self.layers:
            out = layer(x, scale=0.5, mask=mask)
            x = out["hidden"]
            aux = aux + out["aux"][0]
        return x.sum() + aux


def test_kwargs_and_dict_outputs():
    model, ref = twins(KwargsModel)
    x, mask = torch.randn(4, 16), (torch.rand(4, 16) > 0.5).float()
    memscale.wrap(model, FORCE, sample_input=(x, mask))
    model(x, mask).backward()
    ref(x, mask).backward()
    assert_same_grads(model, ref)
    assert model._memscale_executor.stats["recomputes"] == 3
    memscale.detach(model)


class SharedTwice(nn.Module):
    """One block called twice per forward, inside a stack of others."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(16, 0.2) for _ in range(2)])

    def forward(self, x):
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        return self.blocks[0](x)


def test_layer_called_twice_in_one_forward():
    model, ref = twins(SharedTwice)
    x = torch.randn(4, 16)
    memscale.wrap(model, FORCE, sample_input=x)
    for seed in range(2):
        assert_same_step(model, ref, x, seed)
    assert model._memscale_executor.stats["checkpoint_frames"] == 6
    memscale.detach(model)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList([Block(16) for _ in range(2)])

    def forward(self, x):
        for b in self.inner:
            x = b(x)
        return x


class Nested(nn.Module):
    """Planned units that contain repeated sub-blocks of their own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.outer = nn.ModuleList([Outer() for _ in range(2)])

    def forward(self, x):
        for o in self.outer:
            x = o(x)
        return x


def test_nested_layers():
    model, ref = twins(Nested)
    x = torch.randn(4, 16)
    memscale.wrap(model, FORCE, sample_input=x)
    assert_same_step(model, ref, x)
    assert model._memscale_executor.stats["recomputes"] == 2  # outer units only
    memscale.detach(model)


def test_frozen_embeddings_inputs_without_grad():
    model, ref = twins(tiny_gpt2)
    for m in (model, ref):
        m.transformer.wte.weight.requires_grad_(False)
        m.transformer.wpe.weight.requires_grad_(False)
    ids = token_batch()
    memscale.wrap(model, FORCE, sample_input={"input_ids": ids})
    for seed in range(2):
        assert_same_step(model, ref, ids, seed)
    assert model.transformer.wte.weight.grad is None
    memscale.detach(model)


def test_autocast_state_is_replayed():
    model, ref = twins(lambda: mlp(p=0.1))
    x = torch.randn(8, 32)
    memscale.wrap(model, FORCE, sample_input=x)
    for m in (model, ref):
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        out.float().pow(2).mean().backward()  # backward outside autocast
    assert_same_grads(model, ref)
    memscale.detach(model)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "eval"])
def test_no_overhead_without_training(mode):
    model, ref = twins(lambda: mlp(p=0.0))
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE, sample_input=x)
    ex = model._memscale_executor
    if mode == "no_grad":
        with torch.no_grad():
            out, expected = model(x), ref(x)
    elif mode == "inference_mode":
        with torch.inference_mode():
            out, expected = model(x), ref(x)
    else:
        model.eval()
        ref.eval()
        out, expected = model(x), ref(x)
    assert torch.equal(out, expected)
    assert ex.stats["checkpoint_frames"] == 0
    memscale.detach(model)


def test_input_modified_in_place_after_forward_is_reported():
    model, _ = twins(lambda: mlp(p=0.0))
    x = torch.randn(4, 32, requires_grad=True)
    memscale.wrap(model, FORCE, sample_input=x)
    h = x * 1.0
    out = model[1](model[0](h))
    h.add_(1.0)  # the input of block 0 changes after its forward
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()
    memscale.detach(model)


def test_layer_that_updates_its_input_in_place_is_not_checkpointed():
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            x.mul_(2.0)
            return torch.relu(self.lin(x))

    torch.manual_seed(0)
    model = nn.Sequential(InPlace(), InPlace())
    x = torch.randn(2, 8)
    memscale.wrap(model, FORCE, sample_input=x.clone())
    plan = model._memscale_executor.plan
    assert [l.rule for l in plan.layers] == ["ineligible:inplace-input"] * 2
    assert plan.technique_counts["checkpoint"] == 0
    memscale.detach(model)


def test_torch_compile_gives_the_unwrapped_gradients():
    """Dynamo alone (backend="eager") and with AOT autograd
    (backend="aot_eager"): the plan runs as checkpoint regions in the graph
    (tests/test_compile.py), the gradients are the unwrapped model's."""
    model, ref = twins(lambda: mlp(depth=2, p=0.0))  # two blocks: half the tracing
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE, sample_input=x)
    ref(x).sum().backward()
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
        torch.compile(model, backend=backend)(x).sum().backward()
        assert_same_grads(model, ref)
    torch._dynamo.reset()
    memscale.detach(model)
