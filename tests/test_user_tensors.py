"""Nothing memscale does replaces a user's tensor (issue 20, item 1).

After every profiling path (static on fake tensors, empirical with a real
forward, the warm-up steps, the OOM predictor, the AutoTuner, FSDP2) every
parameter and buffer of the model is the same Python object as before,
of the same type (a plain ``nn.Parameter`` / ``torch.Tensor``, never a
FakeTensor), with the same bytes; also after a training step and after
``detach``.  The models register one module at two places, tie one
parameter into two modules, and tie GPT-2's head to its embedding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import loss_of, tiny_gpt2, token_batch
from torch import nn

import memscale
from memscale import _torch_compat
from memscale.autotuning import AutoTuner


class SharedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(8)  # buffers too

    def forward(self, x):
        return x + torch.tanh(self.norm(self.l(x)))


class SharedNet(nn.Module):
    """The issue's reproducer: one Block registered at two places."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        shared = SharedBlock()
        self.blocks = nn.ModuleList([shared, SharedBlock(), shared])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class TiedNet(nn.Module):
    """Two distinct Linear modules holding the same weight Parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.b = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.c = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.c[0].weight = self.a[0].weight
        self.b[0].bias = self.a[0].bias

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _shared():
    return SharedNet(), torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))


def _tied():
    return TiedNet(), torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))


def _gpt2():
    return tiny_gpt2(dropout=0.0), token_batch(seq=16)


MODELS = {"shared": _shared, "tied": _tied, "gpt2": _gpt2}


def tensors(model):
    """(name, tensor) of every parameter and buffer, at every place it is
    registered (duplicates included)."""
    return list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    )


def snapshot(model):
    return [(name, t, t.detach().clone()) for name, t in tensors(model)]


def local(t):
    return t.to_local() if callable(getattr(t, "to_local", None)) else t


def assert_untouched(model, snap, ref=None):
    """Same objects as in ``snap``, plain types, and the bytes of ``snap``
    (or of the same tensors of ``ref``, a twin trained the same way)."""
    now = tensors(model)
    assert [n for n, _ in now] == [n for n, _, _ in snap]
    ref_tensors = dict(tensors(ref)) if ref is not None else None
    for (name, t), (_, before, saved) in zip(now, snap):
        assert t is before, f"{name}: replaced by another tensor object"
        assert_plain(name, t)
        expected = saved if ref_tensors is None else ref_tensors[name].detach()
        assert torch.equal(local(t).detach(), local(expected)), f"{name}: bytes changed"


def assert_plain(name, t):
    """A real tensor: a plain Parameter or Tensor (or an FSDP2 DTensor
    whose local shard is one), never a fake."""
    for x in (t, t.data, local(t), local(t).data):
        assert not _torch_compat.is_fake(x), f"{name}: a fake tensor"
    assert type(t) in (torch.Tensor, nn.Parameter) or local(t) is not t, (
        f"{name}: {type(t).__name__}"
    )
    assert type(local(t).data) is torch.Tensor, f"{name}: {type(local(t).data).__name__}"


def full(t):
    return t.full_tensor() if callable(getattr(t, "full_tensor", None)) else t


def sgd_step(model, x):
    model.zero_grad(set_to_none=True)
    loss_of(model, x).backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-0.1)


def wrap_and_train(model, x, config, sample_input):
    ref = copy.deepcopy(model)
    snap = snapshot(model)
    memscale.wrap(model, config, sample_input=sample_input)
    assert_untouched(model, snap)
    for _ in range(2):  # a warm-up step (profiled), then a planned one
        sgd_step(model, x)
        sgd_step(ref, x)
        assert_untouched(model, snap, ref)
    memscale.detach(model)
    assert_untouched(model, snap, ref)
    assert "_memscale_executor" not in model.__dict__


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("path", ["static", "empirical", "warmup"])
def test_wrap_keeps_user_tensors(kind, path):
    model, x = MODELS[kind]()
    model.train()
    config = memscale.Config(
        force_optimize=True,
        enable_logging=False,
        warmup_steps=1,
        use_static_profiling=path == "static",
        use_empirical_fallback=path != "static",
    )
    wrap_and_train(model, x, config, None if path == "warmup" else x)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_predictor_keeps_user_tensors(kind):
    model, x = MODELS[kind]()
    snap = snapshot(model)
    config = memscale.Config(force_optimize=True, enable_logging=False)
    memscale.predict_peak(model, x, config)
    assert_untouched(model, snap)
    memscale.estimate_savings(model, x, config)
    assert_untouched(model, snap)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["shared", "gpt2"])
def test_autotuner_keeps_user_tensors(kind):
    model, x = MODELS[kind]()
    snap = snapshot(model)
    tuner = AutoTuner(
        model, x, budget_bytes=2**30, base_config=memscale.Config(enable_logging=False)
    )
    tuner.tune(trial=True, max_trials=1)
    assert_untouched(model, snap)
    assert "_memscale_executor" not in model.__dict__


@pytest.mark.parametrize("kind", ["shared", "gpt2"])
def test_fsdp2_keeps_user_tensors(kind, tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model, x = MODELS[kind]()
        model.train()
        units = model.blocks if kind == "shared" else model.transformer.h
        for unit in dict.fromkeys(units):  # each distinct block once
            fully_shard(unit)
        fully_shard(model)
        snap = snapshot(model)
        config = memscale.Config(force_optimize=True, enable_logging=False)
        memscale.wrap(model, config, sample_input=x)
        # The profiling forward leaves the root's parameters unsharded (as
        # any FSDP2 forward does): real, with the same values.
        saved = {name: full(s) for name, _, s in snap}
        for name, t in tensors(model):
            assert_plain(name, t)
            assert torch.equal(full(t.detach()), saved[name]), name
        model.zero_grad(set_to_none=True)
        loss_of(model, x).backward()  # FSDP2 reshards: its own tensors again

        def same_objects(when):
            for (name, t), (_, before, _) in zip(tensors(model), snap):
                assert t is before, f"{name} {when}: replaced"
                assert_plain(name, t)

        same_objects("after a step")
        memscale.detach(model)
        same_objects("after detach")
        assert "_memscale_executor" not in model.__dict__
    finally:
        dist.destroy_process_group()


class CountingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.calls = 0
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)]
        )

    def forward(self, x):
        self.calls += 1
        return self.blocks(x)


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("adam", [True, False])
@pytest.mark.parametrize("counter", ["attribute", "hook"])
def test_wrap_calls_forward_the_documented_number_of_times(static, adam, counter):
    """docs/api.md says how many times wrap(sample_input=...) runs the
    user's forward (Python-side counters see those calls): pinned here.
    A counter in a module attribute is Python state the forward changes:
    the first step may not be a steady one, and a steady one is simulated
    after it; one kept outside the model (a hook's list) changes none."""
    import pathlib

    docs = (pathlib.Path(__file__).parents[1] / "docs" / "api.md").read_text()
    assert "**The model's `forward` is called once** by `wrap` with torch's Adam" in docs
    assert "twice with another optimizer" in docs
    assert "forward changed a module's plain attributes, such as a call counter" in docs
    assert "once more with `use_static_profiling=False`" in docs
    model = CountingNet()
    calls = []
    if counter == "hook":
        model = model.blocks  # no attribute of its own changes
        model.register_forward_pre_hook(lambda *_: calls.append(1))
    else:
        model.register_forward_pre_hook(lambda m, _: calls.append(m.calls))
    config = memscale.Config(enable_logging=False, use_static_profiling=static)
    optimizer = None if adam else torch.optim.SGD(model.parameters(), lr=0.1)
    memscale.wrap(model, config, sample_input=torch.randn(4, 32), optimizer=optimizer)
    wrapped = (1 if adam and counter == "hook" else 2) + (0 if static else 1)
    assert len(calls) == wrapped
    model(torch.randn(4, 32))
    assert len(calls) == wrapped + 1  # training forwards are the user's own
    memscale.detach(model)


class Caching(nn.Module):
    """Keeps its last output in a plain attribute, as some caches do."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(16, 16)
        self.last = None

    def forward(self, x):
        y = torch.tanh(self.l(x))
        self.last = y.detach()
        self.seen = [y.detach()]
        return y


def test_static_profiling_leaves_no_fake_attribute():
    torch.manual_seed(0)
    model = nn.Sequential(Caching(), Caching())
    x = torch.randn(4, 16)
    memscale.wrap(model, memscale.Config(force_optimize=True, enable_logging=False), sample_input=x)
    for m in model:
        assert m.last is None  # as before wrap
        assert "seen" not in m.__dict__
    model(x).sum().backward()
    assert all(type(m.last) is torch.Tensor for m in model)
    memscale.detach(model)
