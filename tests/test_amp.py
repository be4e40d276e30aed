"""Mixed precision through the executor's hooks: BF16 on the CPU, the FP16
path with loss scaling, recomputes under the forward's autocast, loss
agreement with float32, and detach."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from conftest import mlp, tiny_bert, tiny_gpt2
from torch import nn

import memscale
from memscale import Config, _core, amp

MP = Config(use_mixed_precision=True)
MP_CKPT = Config(use_mixed_precision=True, mode="conservative", force_optimize=True)


def inner_dtypes(model, x):
    seen = []
    handles = [
        m.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
        for m in model.modules()
        if isinstance(m, nn.Linear)
    ]
    try:
        out = model(x)
    finally:
        for h in handles:
            h.remove()
    return set(seen), out


def test_bf16_inside_float32_outside_and_detach_removes_it():
    model = mlp(width=16)
    x = torch.randn(4, 16)
    memscale.wrap(model, MP, sample_input=x)
    assert model._memscale_executor.autocast == ("cpu", torch.bfloat16)
    dtypes, out = inner_dtypes(model, x)
    assert dtypes == {torch.bfloat16} and out.dtype == torch.float32
    out.sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():  # evaluation runs in mixed precision too
        assert inner_dtypes(model, x)[0] == {torch.bfloat16}
    memscale.detach(model)
    dtypes, out = inner_dtypes(model, x)
    assert dtypes == {torch.float32} and out.dtype == torch.float32
    assert not model._forward_hooks and not torch.is_autocast_enabled("cpu")


def test_checkpointed_bf16_is_bitwise_manual_autocast():
    """Recomputes replay the forward's autocast: memscale's checkpointed
    BF16 step equals a plain autocast step without memscale, bit for bit."""
    model, ref = mlp(width=32), mlp(width=32)
    x = torch.randn(8, 32)
    memscale.wrap(model, MP_CKPT, sample_input=x)
    assert model._memscale_executor.plan.technique_counts["checkpoint"] == 4
    model(x).square().mean().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ref(x)
    y.float().square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert model._memscale_executor.stats["recomputes"] == 4
    memscale.detach(model)


def test_hf_model_output_is_float32():
    model = tiny_gpt2(dropout=0.0)
    ids = torch.randint(0, 256, (2, 16))
    memscale.wrap(model, MP, sample_input={"input_ids": ids})
    out = model(input_ids=ids, labels=ids)
    assert out.logits.dtype == torch.float32 and out["logits"] is out.logits
    assert out.loss.dtype == torch.float32
    memscale.detach(model)


def _train(model, batches, steps, wrap_config=None, scaler_for=None):
    if wrap_config is not None:
        memscale.wrap(model, wrap_config, sample_input=batches(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = amp.grad_scaler(model) if scaler_for else None
    losses = []
    for step in range(steps):
        batch = batches(step)
        loss = model(**batch).loss if isinstance(batch, dict) else model(batch).square().mean()
        opt.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        losses.append(loss.item())
    if wrap_config is not None:
        memscale.detach(model)
    return losses


@pytest.mark.parametrize("name,build", [("gpt2", tiny_gpt2), ("bert", tiny_bert)])
def test_bf16_loss_within_tolerance_of_float32(name, build):
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (4, 32), generator=gen) for _ in range(4)]

    def batches(step):
        ids = data[step % len(data)]
        return {"input_ids": ids, "labels": ids}

    fp32 = _train(build(dropout=0.0), batches, 30)
    bf16 = _train(build(dropout=0.0), batches, 30, MP)
    assert fp32[-1] < 0.8 * fp32[0]  # it learns
    # The documented tolerance: within 2% of float32's loss, every step.
    for a, b in zip(bf16, fp32):
        assert abs(a - b) <= 0.02 * b, (name, a, b)


def fp16_hardware(monkeypatch):
    real = _core.detect_hardware

    def no_bf16(*args, **kwargs):
        return {**real(*args, **kwargs), "bf16": False}

    monkeypatch.setattr(_core, "detect_hardware", no_bf16)


def test_fp16_path_with_grad_scaler(monkeypatch, caplog):
    fp16_hardware(monkeypatch)
    model, ref = mlp(width=16), mlp(width=16)
    x = torch.randn(8, 16)
    with caplog.at_level(logging.WARNING, logger="memscale"):
        memscale.wrap(model, MP_CKPT, sample_input=x)
    assert "memscale.amp.grad_scaler(model)" in caplog.text
    assert model._memscale_executor.autocast == ("cpu", torch.float16)
    scaler = amp.grad_scaler(model, init_scale=1024.0)
    assert scaler.is_enabled() and scaler.get_scale() == 1024.0
    # The same step as a manual FP16 autocast step with the same scaler.
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for m, s, manual in ((model, scaler, False), (ref, ref_scaler, True)):
        if manual:
            with torch.autocast("cpu", dtype=torch.float16):
                y = m(x)
        else:
            y = m(x)
        s.scale(y.float().square().mean()).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    memscale.detach(model)
    assert not amp.grad_scaler(model).is_enabled()


def test_fp16_training_with_the_scaler_learns(monkeypatch):
    fp16_hardware(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (4, 32), generator=gen) for _ in range(4)]

    def batches(step):
        ids = data[step % len(data)]
        return {"input_ids": ids, "labels": ids}

    fp32 = _train(tiny_gpt2(dropout=0.0), batches, 20)
    fp16 = _train(tiny_gpt2(dropout=0.0), batches, 20, MP, scaler_for=True)
    assert all(torch.isfinite(torch.tensor(fp16)))
    assert abs(fp16[-1] - fp32[-1]) <= 0.02 * fp32[-1]


def test_a_raising_forward_leaves_autocast_off():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.shape[0] == 3:
                raise ValueError("boom")
            return self.fc(x)

    model = Boom()
    memscale.wrap(model, MP, sample_input=torch.randn(2, 4))
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(3, 4))
    assert not torch.is_autocast_enabled("cpu")
    assert model(torch.randn(2, 4)).dtype == torch.float32
    memscale.detach(model)


def test_verify_correctness_with_mixed_precision():
    model = mlp(width=16)
    x = torch.randn(8, 16)
    memscale.wrap(model, MP_CKPT.replace(verify_correctness=True), sample_input=x)
    model(x).square().mean().backward()  # raises on a mismatch
    report = model._memscale_executor.verifier.report
    assert report["gradient_abs"] == 0.0 and report["output_abs"] == 0.0
    memscale.detach(model)


def test_set_autocast_checks_its_arguments():
    model = mlp(width=8)
    memscale.wrap(model, Config(), sample_input=torch.randn(2, 8))
    ex = model._memscale_executor
    with pytest.raises(TypeError, match="device type"):
        ex.set_autocast("cpu", None)
    with pytest.raises(RuntimeError):
        ex.set_autocast("nosuchdevice", torch.bfloat16)
    assert ex.autocast is None
    memscale.detach(model)


def test_an_interrupted_forward_does_not_leave_autocast_on():
    """KeyboardInterrupt skips torch's always-called hooks: the autocast the
    interrupted forward entered is left at the next forward, and at detach
    (left on, autocast would also keep serving stale bf16 weight copies)."""

    class Interrupting(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.interrupt = False

        def forward(self, x):
            y = self.fc(x)
            if self.interrupt:
                raise KeyboardInterrupt
            return y

    model = Interrupting()
    memscale.wrap(model, MP, sample_input=torch.randn(2, 4))
    model.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 4))
    # torch ran no hook; the model's call guard left the autocast.
    assert not torch.is_autocast_enabled("cpu")
    model.interrupt = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing stale left for the next forward
        model(torch.randn(2, 4))
    assert not torch.is_autocast_enabled("cpu")
    # Without the guard (the root's own _call_impl), the next forward leaves
    # the stale autocast.
    model.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        type(model)._call_impl(model, torch.randn(2, 4))
    assert torch.is_autocast_enabled("cpu")
    model.interrupt = False
    with pytest.warns(RuntimeWarning, match="autocast it entered was left"):
        model(torch.randn(2, 4))
    assert not torch.is_autocast_enabled("cpu")
    # Training still learns (weights are not served from a stale cache).
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(8, 4)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[2] < losses[1] < losses[0]
    model.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 4))
    memscale.detach(model)
    assert not torch.is_autocast_enabled("cpu")
