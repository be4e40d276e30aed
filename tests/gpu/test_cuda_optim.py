"""8-bit AdamW on CUDA: bitsandbytes' when it is installed; memscale's own
keeps float32 moments for CUDA parameters, and its C kernel refuses CUDA
tensors with an error that says where the 8-bit update for them is."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from conftest import tiny_gpt2, token_batch
from gpu_helpers import DEV

import memscale
from memscale import _core, optim
from memscale.optim import AdamW8bit

pytestmark = pytest.mark.cuda


def test_bitsandbytes_adamw8bit_trains_through_config():
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    pytest.importorskip("transformers", reason="transformers is not installed")
    model = tiny_gpt2(dropout=0.0).to(DEV)
    ids = token_batch(batch=4, seq=32).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    memscale.wrap(
        model,
        memscale.Config(use_8bit_optimizer=True, enable_logging=False),
        sample_input={"input_ids": ids, "labels": ids},
        optimizer=opt,
    )
    ours = model._memscale_executor.optimizer
    assert type(ours).__module__.split(".")[0] == "bitsandbytes" and optim.is_8bit(ours)
    losses = []
    for _ in range(20):
        ours.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        ours.step()
        losses.append(loss.item())
    memscale.detach(model)
    assert losses[-1] < 0.8 * losses[0], losses


def test_memscale_adamw8bit_keeps_float32_moments_for_cuda_parameters():
    torch.manual_seed(0)
    start = torch.randn(8192, device=DEV)
    ours = torch.nn.Parameter(start.clone())
    ref = torch.nn.Parameter(start.clone())
    opt = AdamW8bit([ours], lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        g = torch.randn(8192, device=DEV)
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    state = opt.state[ours]
    assert not AdamW8bit.quantizes(ours, opt.param_groups[0])
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].device == ours.device
    assert state["exp_avg_sq"].dtype == torch.float32 and "exp_avg_scale" not in state
    # The same AdamW update, written out: equal to torch's within float32.
    assert torch.allclose(ours, ref, atol=1e-6, rtol=0)


def test_the_kernel_refuses_cuda_tensors_by_name():
    n = 256
    on = dict(device=DEV)
    args = (
        torch.zeros(n, **on),
        torch.zeros(n, **on),
        torch.zeros(n, dtype=torch.int8, **on),
        torch.zeros(n // 64, **on),
        torch.zeros(n, dtype=torch.uint8, **on),
        torch.zeros(n // 64, **on),
    )
    kwargs = dict(
        lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, block=64, threads=1
    )
    with pytest.raises(ValueError, match=r"param is on cuda:\d+, and memscale's 8-bit kernel"):
        _core.adamw8bit_step(*args, **kwargs)


def test_make_8bit_adamw_without_bitsandbytes_says_so(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails
    monkeypatch.setattr(optim, "_warned_no_backend", False)
    p = torch.nn.Parameter(torch.zeros(8192, device=DEV))
    with caplog.at_level(logging.INFO, logger="memscale"):
        opt = optim.make_8bit_adamw([p])
    assert type(opt) is AdamW8bit
    assert "no usable 8-bit optimizer backend for cuda parameters" in caplog.text
