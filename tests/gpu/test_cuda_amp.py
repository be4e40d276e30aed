"""Mixed precision on CUDA: BF16 where the device has it, FP16 with the
GradScaler otherwise; checkpoint recomputes replay the forward's CUDA
autocast (on autograd's device thread), so a checkpointed step equals a
plain autocast step bit for bit."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import mlp
from gpu_helpers import DEV, deterministic, grads, same
from torch import nn

import memscale
from memscale import _core, amp

pytestmark = pytest.mark.cuda

MP_CKPT = memscale.Config(
    use_mixed_precision=True, mode="conservative", force_optimize=True, enable_logging=False
)


def _inner_dtypes(model: nn.Module, x: torch.Tensor) -> set[torch.dtype]:
    seen: list[torch.dtype] = []
    handles = [
        m.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
        for m in model.modules()
        if isinstance(m, nn.Linear)
    ]
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return set(seen)


def test_bf16_autocast_checkpointed_is_bitwise_manual_autocast():
    if not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name(DEV)} has no bfloat16")
    with deterministic():
        model, ref = mlp(width=64).to(DEV), mlp(width=64).to(DEV)
        x = torch.randn(16, 64).to(DEV)
        memscale.wrap(model, MP_CKPT, sample_input=x)
        ex = model._memscale_executor
        assert ex.autocast == ("cuda", torch.bfloat16)
        assert _inner_dtypes(model, x) == {torch.bfloat16}
        out = model(x)
        assert out.dtype == torch.float32
        out.square().mean().backward()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = ref(x)
        y.float().square().mean().backward()
        assert same(grads(model), grads(ref))
        assert ex.stats["recomputes"] == ex.plan.technique_counts["checkpoint"] == 4
        memscale.detach(model)
        assert not torch.is_autocast_enabled("cuda")


def _no_bf16(monkeypatch) -> None:
    real = _core.detect_hardware

    def no_bf16(*args, **kwargs):
        return {**real(*args, **kwargs), "bf16": False}

    monkeypatch.setattr(_core, "detect_hardware", no_bf16)


def test_fp16_with_grad_scaler_trains_as_manual_autocast(monkeypatch, caplog):
    """A device without BF16 (stood in for by hiding it): FP16, the
    scaler enabled, and three scaled optimizer steps bitwise equal to a
    manual FP16 autocast loop with torch's own GradScaler."""
    _no_bf16(monkeypatch)
    with deterministic():
        model, ref = mlp(width=64).to(DEV), mlp(width=64).to(DEV)
        x = torch.randn(16, 64).to(DEV)
        with caplog.at_level(logging.WARNING, logger="memscale"):
            memscale.wrap(model, MP_CKPT.replace(enable_logging=True), sample_input=x)
        assert "memscale.amp.grad_scaler(model)" in caplog.text
        assert model._memscale_executor.autocast == ("cuda", torch.float16)
        scaler = amp.grad_scaler(model, init_scale=1024.0)
        assert scaler.is_enabled() and scaler.get_scale() == 1024.0
        ref_scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        for _ in range(3):
            for m, o, s, manual in ((model, opt, scaler, False), (ref, ref_opt, ref_scaler, True)):
                o.zero_grad(set_to_none=True)
                if manual:
                    with torch.autocast("cuda", dtype=torch.float16):
                        y = m(x)
                else:
                    y = m(x)
                loss = y.float().square().mean()
                assert torch.isfinite(loss)
                s.scale(loss).backward()
                s.step(o)
                s.update()
            assert same(grads(model), grads(ref))
            assert scaler.get_scale() == ref_scaler.get_scale()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)
        memscale.detach(model)
        assert not amp.grad_scaler(model).is_enabled()
