"""memscale's 8-bit AdamW: the C kernel, the Optimizer, and how it trains."""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
from conftest import tiny_gpt2

from memscale import _core
from memscale.optim import AdamW8bit, make_8bit_adamw

V = 64


def markov_lm():
    return tiny_gpt2(0.0, n_layer=2, n_embd=128, vocab_size=V)


def markov_batches(steps, b=16, n=32):
    """Sequences from a fixed random Markov chain: a loss that levels off
    at the chain's entropy, not at 0, so relative differences mean
    something."""
    g = torch.Generator().manual_seed(1)
    table = torch.softmax(torch.randn(V, V, generator=g) * 3, -1)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.empty(b, n, dtype=torch.long)
        x[:, 0] = torch.randint(0, V, (b,), generator=gen)
        for t in range(1, n):
            x[:, t] = torch.multinomial(table[x[:, t - 1]], 1, generator=gen).squeeze(1)
        yield x


def train(make_opt, steps=200):
    model = markov_lm()
    model.train()
    opt = make_opt(model.parameters())
    losses = []
    for x in markov_batches(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-20:]) / 20, model, opt


@pytest.mark.slow
def test_trains_a_small_language_model_as_fp32_adamw_does():
    ref, _, _ = train(lambda p: torch.optim.AdamW(p, lr=3e-3))
    ours, _, opt = train(lambda p: AdamW8bit(p, lr=3e-3))
    assert ours == pytest.approx(ref, rel=0.03), (ours, ref)
    assert ref < 2.5  # it learned the chain (log V = 4.16 at the start)
    assert any(s["exp_avg"].dtype == torch.int8 for s in opt.state.values())


@pytest.mark.slow
def test_state_is_at_most_30_percent_of_adamw_on_the_benchmark_gpt2():
    from memscale.benchmarks.models import BENCHMARK_MODELS

    model, batch = BENCHMARK_MODELS["gpt2-12l"].build(seed=0)
    states = {}
    for name, cls in (("adamw", torch.optim.AdamW), ("8bit", AdamW8bit)):
        m = copy.deepcopy(model)
        opt = cls(m.parameters(), lr=1e-4)
        batch.loss_fn(m(*batch.args, **batch.kwargs)).backward()
        opt.step()
        states[name] = sum(
            t.numel() * t.element_size()
            for s in opt.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
    assert states["8bit"] <= 0.30 * states["adamw"], states


def test_state_dict_round_trips_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
    opt = AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=1024)
    x = torch.randn(32, 64)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    twin = copy.deepcopy(model)
    buf.seek(0)
    saved = torch.load(buf)
    twin.load_state_dict(saved["model"])
    opt2 = AdamW8bit(twin.parameters(), lr=1e-2, min_8bit_size=1024)
    opt2.load_state_dict(saved["opt"])
    for a, b in zip(opt.state.values(), opt2.state.values()):
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    for m, o in ((model, opt), (twin, opt2)):
        for _ in range(2):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_param_groups_weight_decay_and_small_or_other_params():
    torch.manual_seed(0)
    big = torch.nn.Parameter(torch.randn(8192))
    small = torch.nn.Parameter(torch.randn(10))  # under min_8bit_size: fp32 state
    double = torch.nn.Parameter(torch.randn(8192, dtype=torch.float64))
    opt = AdamW8bit(
        [
            {"params": [big, small], "weight_decay": 0.0},
            {"params": [double], "lr": 0.0, "weight_decay": 0.5},
        ],
        lr=0.1,
    )
    before = double.detach().clone()
    big_before = big.detach().clone()
    for p in (big, small, double):
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[big]["exp_avg"].dtype == torch.int8
    assert opt.state[small]["exp_avg"].dtype == torch.float32
    assert opt.state[double]["exp_avg"].dtype == torch.float64
    assert torch.equal(double, before)  # lr 0: neither decay nor step
    # First step of Adam with a constant gradient: every element moves by lr.
    assert torch.allclose(big_before - big.detach(), torch.full((8192,), 0.1), atol=1e-5)
    opt.zero_grad()
    assert big.grad is None


def test_kernel_matches_adamw_within_quantization():
    """One step from zero state: the moments are exact (one quantized
    level), so the update equals fp32 AdamW's to float precision."""
    torch.manual_seed(0)
    p = torch.randn(1000)
    ref = torch.nn.Parameter(p.clone())
    ours = torch.nn.Parameter(p.clone())
    g = torch.randn(1000)
    ref.grad, ours.grad = g.clone(), g.clone()
    torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1).step()
    AdamW8bit([ours], lr=1e-2, weight_decay=0.1, min_8bit_size=0).step()
    assert torch.allclose(ref, ours, atol=1e-4, rtol=0)


def test_kernel_rejects_bad_arguments():
    n = 100
    p, g = torch.zeros(n), torch.zeros(n)
    qm, sm = torch.zeros(n, dtype=torch.int8), torch.zeros(2)
    qv, sv = torch.zeros(n, dtype=torch.uint8), torch.zeros(2)
    kw = dict(
        lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, block=64, threads=2
    )
    _core.adamw8bit_step(p, g, qm, sm, qv, sv, **kw)
    with pytest.raises(TypeError, match="grad must be torch.float32"):
        _core.adamw8bit_step(p, g.double(), qm, sm, qv, sv, **kw)
    with pytest.raises(ValueError, match="exp_avg_scale has 1 elements, expected 2"):
        _core.adamw8bit_step(p, g, qm, torch.zeros(1), qv, sv, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        _core.adamw8bit_step(torch.zeros(n, 2)[:, 0], g, qm, sm, qv, sv, **kw)
    with pytest.raises(ValueError, match="block"):
        _core.adamw8bit_step(p, g, qm, sm, qv, sv, **dict(kw, block=0))
    with pytest.raises(ValueError, match="threads must be >= 1"):
        _core.adamw8bit_step(p, g, qm, sm, qv, sv, **dict(kw, threads=0))
    with pytest.raises(ValueError, match="step >= 1"):
        _core.adamw8bit_step(p, g, qm, sm, qv, sv, **dict(kw, step=0))
    with pytest.raises(ValueError, match="lr must be"):
        AdamW8bit([torch.nn.Parameter(p)], lr=float("nan"))


def test_factory_on_cpu_is_memscales():
    assert isinstance(make_8bit_adamw([torch.nn.Parameter(torch.zeros(3))]), AdamW8bit)


def test_threads_give_the_same_bits():
    """Blocks are independent: any thread count gives the same result."""
    torch.manual_seed(0)
    n, block = 64 * 1000 + 17, 64
    blocks = -(-n // block)
    out = []
    for threads in (1, 2, 3):
        p = torch.randn(n, generator=torch.Generator().manual_seed(1))
        qm, qv = torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8)
        sm, sv = torch.zeros(blocks), torch.zeros(blocks)
        for step in (1, 2, 3):
            g = torch.randn(n, generator=torch.Generator().manual_seed(step))
            _core.adamw8bit_step(
                p,
                g,
                qm,
                sm,
                qv,
                sv,
                lr=1e-2,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.01,
                step=step,
                block=block,
                threads=threads,
            )
        out.append((p, qm, qv, sm, sv))
    for other in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[0], other))


def test_small_moments_decay():
    """Rounding to the nearest level has fixed points (round(0.9 q) == q for
    |q| <= 5): an element whose gradient stops while another keeps its
    block's scale up kept moving for good.  Stochastic rounding lets its
    moments decay as AdamW's do."""
    n = 64
    ours = torch.nn.Parameter(torch.zeros(n))
    ref = torch.nn.Parameter(torch.zeros(n))
    opt = AdamW8bit([ours], lr=1e-3, weight_decay=0.0, min_8bit_size=0)
    ref_opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.0)
    for step in range(3000):
        g = torch.zeros(n)
        g[0] = 1.0
        if step == 0:
            g[1] = 0.05
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    # AdamW moves element 1 by -0.006 in all; the nearest-rounding kernel
    # took it to -0.68 and still moving.
    assert abs(ours[1].item() - ref[1].item()) < 0.02, (ours[1].item(), ref[1].item())
    assert abs(ours[0].item() - ref[0].item()) < 0.05 * abs(ref[0].item())


def test_non_finite_gradients_do_not_corrupt_other_elements():
    n = 64
    p = torch.nn.Parameter(torch.ones(n))
    opt = AdamW8bit([p], lr=1e-2, weight_decay=0.0, min_8bit_size=0)
    g = torch.full((n,), 0.5)
    g[3] = float("nan")
    p.grad = g
    opt.step()
    state = opt.state[p]
    assert torch.isnan(p[3])
    others = torch.cat([p[:3], p[4:]]).detach()
    assert torch.isfinite(others).all() and torch.allclose(
        others, torch.full((n - 1,), 0.99), atol=1e-4
    )
    assert state["exp_avg"][3].item() == 0  # the NaN moment is not stored
    assert int(state["exp_avg"][0]) == 127


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_one_non_finite_gradient_element_stays_in_its_element(bad):
    """An inf gradient element used to make its block's scale infinite, and
    the next step decoded the whole 64-element block as NaN (issue 20).  As
    in torch's AdamW, only that element's parameter goes non-finite; every
    other element of the block takes, step after step, exactly the update it
    takes when that element's gradient is 0, and stays near AdamW's."""
    n, bad_at, steps = 256, 70, 4  # element 6 of the second block
    torch.manual_seed(0)
    start = torch.randn(n)
    grads = [torch.randn(n) for _ in range(steps)]
    runs = {}
    for name in ("bad", "zero", "adamw"):
        p = torch.nn.Parameter(start.clone())
        opt = (
            torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1)
            if name == "adamw"
            else AdamW8bit([p], lr=1e-2, weight_decay=0.1, min_8bit_size=0)
        )
        for i, g in enumerate(grads):
            g = g.clone()
            if i == 0:
                g[bad_at] = 0.0 if name == "zero" else bad
            elif name != "adamw":
                g[bad_at] = 0.0
            p.grad = g
            opt.step()
        runs[name] = p.detach()
    others = torch.ones(n, dtype=torch.bool)
    others[bad_at] = False
    assert not torch.isfinite(runs["bad"][bad_at])
    assert not torch.isfinite(runs["adamw"][bad_at])  # AdamW does the same
    assert torch.isfinite(runs["bad"][others]).all()
    assert torch.equal(runs["bad"][others], runs["zero"][others])
    # 8-bit moments: within 5e-3 of AdamW after 4 steps of up to 1e-2 each.
    assert torch.allclose(runs["bad"][others], runs["adamw"][others], atol=5e-3, rtol=0)


def test_a_step_is_visible_to_autograd():
    p = torch.nn.Parameter(torch.randn(8192))
    opt = AdamW8bit([p], lr=1e-2)
    p.grad = torch.randn(8192)
    before = p._version
    opt.step()
    assert p._version > before


def test_8bit_kernel_refuses_a_tensor_off_the_cpu_by_name():
    n = 256
    meta = dict(device="meta")
    args = [
        torch.zeros(n),
        torch.zeros(n),
        torch.zeros(n, dtype=torch.int8),
        torch.zeros(n // 64),
        torch.zeros(n, dtype=torch.uint8),
        torch.zeros(n // 64),
    ]
    kwargs = dict(
        lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, block=64, threads=1
    )
    for i, what in enumerate(["param", "grad", "exp_avg", "exp_avg_scale"]):
        moved = list(args)
        moved[i] = torch.empty_like(args[i], **meta)
        with pytest.raises(ValueError, match=rf"{what} is on meta, and memscale's 8-bit kernel"):
            _core.adamw8bit_step(*moved, **kwargs)


def test_built_directly_on_parameters_off_the_cpu_it_says_the_state_stays_fp32(caplog, monkeypatch):
    import memscale.optim as optim

    monkeypatch.setattr(optim, "_warned_no_backend", False)
    meta = torch.nn.Parameter(torch.empty(1024, device="meta"))
    with caplog.at_level(logging.WARNING, logger="memscale"):
        AdamW8bit([meta])
    assert "meta parameters in memscale's AdamW8bit" in caplog.text
    assert "make_8bit_adamw" in caplog.text
    caplog.clear()
    monkeypatch.setattr(optim, "_warned_no_backend", False)
    with caplog.at_level(logging.WARNING, logger="memscale"):
        AdamW8bit([torch.nn.Parameter(torch.zeros(1024))])  # CPU: nothing to say
    assert "AdamW8bit" not in caplog.text
