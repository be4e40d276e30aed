"""A random call with FLOPs kept by a selective layer (memscale._selective):
the recompute does not run it and sets its generator to the state the
forward's call left it in, so every later random call draws what it drew
in the forward.

On CUDA such a call is a fused attention kernel with dropout (its outputs
carry the seed and offset its backward draws the mask again from); the
CPU has none (SDPA with dropout runs its math path), so these tests make
one: ``memscale_test::noisy_mm``, a matrix product with its own dropout,
tagged ``nondeterministic_seeded``, with a FLOP formula."""

from __future__ import annotations

import pytest
import torch
from conftest import adamw_step_peak, assert_same_step
from torch import nn
from torch.utils.flop_counter import flop_registry

import memscale
from memscale import _generators, _selective
from memscale._planner import PredictionSession

GIB = 2**30
_RUNS: list[int] = []


@torch.library.custom_op(
    "memscale_test::noisy_mm", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def _noisy_mm(x: torch.Tensor, w: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    _RUNS.append(1)
    keep = torch.rand(x.shape[0], w.shape[1]) >= p
    return (x @ w) * keep / (1.0 - p), keep


@_noisy_mm.register_fake
def _(x, w, p):
    return x.new_empty(x.shape[0], w.shape[1]), x.new_empty(
        x.shape[0], w.shape[1], dtype=torch.bool
    )


def _setup(ctx, inputs, output):
    x, w, p = inputs
    ctx.p = p
    ctx.save_for_backward(x, w, output[1])


def _backward(ctx, grad, _grad_keep):
    x, w, keep = ctx.saved_tensors
    grad = grad * keep / (1.0 - ctx.p)
    return grad @ w.t(), x.t() @ grad, None


_noisy_mm.register_autograd(_backward, setup_context=_setup)
NOISY = torch.ops.memscale_test.noisy_mm.default


def _flops(x, w, p, out_val=None, **_):
    return 2 * x.shape[0] * x.shape[1] * w.shape[1]


@pytest.fixture(autouse=True)
def _counted(monkeypatch):
    """torch's FLOP counter counts the product (as it does CUDA's fused
    attention kernels), and the product is declared to draw from the
    default generator of its output's device (as they do)."""
    monkeypatch.setitem(flop_registry, NOISY.overloadpacket, _flops)
    monkeypatch.setattr(
        _generators,
        "RESTORABLE_RANDOM",
        _generators.RESTORABLE_RANDOM | {"memscale_test::noisy_mm"},
    )


class _Noisy(nn.Module):
    """A projection up, the random product down (its dropout 0.25), a tanh
    (which saves its output: the product's is read), an output projection
    and a dropout after it: a random call after the kept one."""

    def __init__(self, width: int = 32, hidden: int = 256) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.w = nn.Parameter(torch.randn(hidden, width) / hidden**0.5)
        self.out = nn.Linear(width, width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        h, _ = torch.ops.memscale_test.noisy_mm(torch.relu(self.up(x)), self.w, 0.25)
        return x + self.drop(self.out(torch.tanh(h)))


def _pair(seed: int = 0) -> tuple[_Noisy, _Noisy]:
    torch.manual_seed(seed)
    block, plain = _Noisy(), _Noisy()
    plain.load_state_dict(block.state_dict())
    block.train()
    plain.train()
    return block, plain


X = torch.randn(512, 32, generator=torch.Generator().manual_seed(0))


def _levels(block):
    with _selective.OpRecorder([block]) as rec:
        block(X)
    rec.close()
    ops = rec.ops[0]
    return ops, _selective.layer_profile(ops, flops=1e9, saved_bytes=10**9)


def test_a_random_call_with_flops_counts_its_generator_state_and_may_be_kept():
    """``op_cost``: the random product is not random to the policy (its
    generator can be set past it) and its bytes are its outputs' and the
    CPU generator's state; the first level keeps it.  A random call given
    a generator of its own, or on another device type, stays random."""
    block, _ = _pair()
    ops, levels = _levels(block)
    index = ops.names.index(str(NOISY))
    flops, nbytes, _, random = ops.calls[index]
    state = torch.get_rng_state().untyped_storage().nbytes()
    assert not random
    assert flops == 2 * 512 * 256 * 32
    assert nbytes == 512 * 32 * (4 + 1) + state
    assert levels[0][1] == nbytes  # the first level keeps it alone

    h = torch.randn(512, 256)
    out = NOISY(h, block.w, 0.25)
    assert _generators.device_of(NOISY, (h, block.w, 0.25), {}, out) == torch.device("cpu")
    aten = torch.ops.aten
    # Dropout stays random: it is not declared (nor has it a FLOP formula).
    assert _selective.op_cost(aten.native_dropout.default, (X, 0.1, True), {}, (X, X > 0))[3]
    bernoulli = aten.bernoulli.default
    assert _generators.device_of(bernoulli, (X,), {}, X) is None
    with pytest.MonkeyPatch.context() as m:
        # Declared, it draws from its output's device; given a generator of
        # its own, or on another device type, it does not.
        m.setattr(_generators, "RESTORABLE_RANDOM", {"aten::bernoulli"})
        assert _generators.device_of(bernoulli, (X,), {}, X) == torch.device("cpu")
        g = torch.Generator()
        assert _generators.device_of(bernoulli, (X,), {"generator": g}, X) is None
        meta = torch.empty(4, device="meta")
        assert _generators.device_of(bernoulli, (meta,), {}, meta) is None
    # Not declared to draw from its output's device: random, never kept.
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_generators, "RESTORABLE_RANDOM", set())
        assert _generators.device_of(NOISY, (h, block.w, 0.25), {}, out) is None
        assert _selective.op_cost(NOISY, (h, block.w, 0.25), {}, out)[3]


def test_a_kept_random_call_is_not_run_again_and_later_calls_draw_as_in_the_forward():
    """At the level that keeps the random product, the recompute does not
    run it; the dropout after it draws the forward's mask (the generator
    set past the product), so the gradients are bitwise the plain block's,
    and the caller's generator ends where the plain step leaves it.
    Twice, with ``retain_graph=True``: each recompute sets it again."""
    block, plain = _pair()
    _, levels = _levels(block)
    threshold = levels[0][0]

    _RUNS.clear()
    torch.manual_seed(7)
    xa = X.clone().requires_grad_()
    out = _selective.run(block.forward, threshold, (xa,), {})
    assert _RUNS == [1]
    loss = out.pow(2).mean()
    loss.backward(retain_graph=True)
    assert _RUNS == [1]  # not run again in the recompute
    after = torch.get_rng_state()
    first = [xa.grad.clone(), *(p.grad.clone() for p in block.parameters())]
    loss.backward()
    assert _RUNS == [1]

    torch.manual_seed(7)
    xb = X.clone().requires_grad_()
    plain_loss = plain(xb).pow(2).mean()
    plain_loss.backward(retain_graph=True)
    assert torch.equal(after, torch.get_rng_state())
    expected = [xb.grad.clone(), *(p.grad.clone() for p in plain.parameters())]
    for a, b in zip(first, expected):
        assert torch.equal(a, b)
    plain_loss.backward()
    for a, b in zip(
        [xa.grad, *(p.grad for p in block.parameters())],
        [xb.grad, *(p.grad for p in plain.parameters())],
    ):
        assert torch.equal(a, b)


def test_a_generator_the_checkpoint_does_not_restore_is_put_back_after_the_recompute(monkeypatch):
    """torch's checkpoint restores the generators of the devices of the
    layer's inputs around its recompute; a generator the recompute set for
    a kept call is put back where it found it when the recompute ends,
    also where the checkpoint would not restore it (here: it preserves no
    RNG state), outside the recompute's mode (a state set through the
    dispatcher is no call of the layer)."""
    from torch.utils import checkpoint as ckpt

    real = ckpt.checkpoint

    def unpreserved(*args, **kwargs):
        return real(*args, preserve_rng_state=False, **kwargs)

    monkeypatch.setattr(_selective, "checkpoint", unpreserved)
    real_set = _generators.set_state

    def cloning(device, state):
        # As torch.cuda.set_rng_state did in torch 2.4 to 2.6: a clone
        # through the dispatcher, which the recompute's mode must not see.
        real_set(device, state.clone())

    monkeypatch.setattr(_generators, "set_state", cloning)
    block, _ = _pair()
    _, levels = _levels(block)
    torch.manual_seed(7)
    out = _selective.run(block.forward, levels[0][0], (X.clone().requires_grad_(),), {})
    torch.manual_seed(123)
    before = torch.get_rng_state()
    _RUNS.clear()
    out.pow(2).mean().backward()
    assert _RUNS == []  # (the product was kept: its state was set)
    assert torch.equal(torch.get_rng_state(), before)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*[_Noisy() for _ in range(4)])
        self.head = nn.Linear(32, 32)

    def forward(self, x):
        return self.head(self.blocks(x))


def _mse(model, x):
    return model(x).pow(2).mean()


def test_a_planned_model_keeps_its_random_products_within_its_prediction():
    """Planned under a budget, blocks run selective at a level that keeps
    the random product; a training step (AdamW) peaks at the prediction
    within 0.1% and at the simulated step's peak to the byte (the
    simulation counts each kept call's generator state, 2 x 5,056 bytes at
    the peak here), and the gradients are bitwise the unwrapped model's,
    step after step."""
    ref = _Stack()
    ref.train()
    base = memscale.predict_peak(ref, X, config=memscale.Config(memory_budget_gb=100))
    model = _Stack()
    model.train()
    config = memscale.Config(
        mode="balanced",
        enable_offloading=False,
        memory_budget_gb=base.unoptimized.peak_bytes * 0.85 / GIB,
        enable_logging=False,
    )
    memscale.wrap(model, config, sample_input=X)
    try:
        plan = model._memscale_executor.plan
        runs = [i for i, layer in enumerate(plan.layers) if "selective" in layer.techniques]
        assert runs
        _RUNS.clear()
        _mse(model, X).backward()
        assert len(_RUNS) == 4  # the forward's four, none in the recompute
        model.zero_grad(set_to_none=True)
        for seed in range(2):
            assert_same_step(model, ref, X, seed=seed, loss_fn=_mse)
        peak = adamw_step_peak(model, X, _mse)
        assert abs(peak - plan.peak_projected_bytes) <= plan.peak_projected_bytes / 1000
        assert peak <= plan.budget_bytes
        with PredictionSession(_Stack().train(), X, config=config) as session:
            simulated = session._steps.simulated_peak(session.plan(config), config)
        assert simulated == peak
    finally:
        memscale.detach(model)


class _Keyworded(nn.Module):
    """A block whose forward takes its input and a flag by keyword; the
    flag is named as one of torch's checkpoint's own arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.drop = nn.Dropout(0.5)

    def forward(self, *, x, debug=False):
        out = x + self.drop(self.fc(x))
        return out * 2 if debug else out


def test_keyword_arguments_reach_the_forward_and_torchs_rng_bookkeeping(monkeypatch):
    """A selective layer called with its tensors by keyword: torch's
    checkpoint finds the devices whose RNG state it records and restores
    among its positional arguments only (on CUDA a dropout would draw
    other masks in the recompute), so ``run`` hands it every keyword
    argument positionally, and a keyword named as one of the
    checkpoint's own (``debug``) reaches the forward.  The gradients are
    bitwise the plain block's."""
    from torch.utils import checkpoint as ckpt

    seen = []

    def spied(real):
        def spy(*args):
            seen.append(args)
            return real(*args)

        return spy

    # (Where CUDA is initialized, get_device_states is asked too.)
    for name in ("get_device_states", "_infer_device_type"):
        monkeypatch.setattr(ckpt, name, spied(getattr(ckpt, name)))
    torch.manual_seed(0)
    block, plain = _Keyworded(), _Keyworded()
    plain.load_state_dict(block.state_dict())
    xa, xb = X.clone().requires_grad_(), X.clone().requires_grad_()
    torch.manual_seed(5)
    out = _selective.run(block.forward, 1.0, (), {"x": xa, "debug": True})
    torch.manual_seed(5)
    expected = plain(x=xb, debug=True)
    assert torch.equal(out, expected)  # (debug reached the forward: doubled)
    assert seen and all(any(a is xa for a in args) for args in seen)
    out.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    assert torch.equal(xa.grad, xb.grad)
    for a, b in zip(block.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad)
