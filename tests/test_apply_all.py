"""apply_all_optimizations, and the 8-bit optimizer replacing a given one
(``to_8bit``; ``wrap``/``optimize`` with ``use_8bit_optimizer``)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import mlp, tiny_gpt2

import memscale
from memscale import Config, optim
from memscale.optim import AdamW8bit


def groups_of(opt):
    return [
        {k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])}
        for g in opt.param_groups
    ]


def test_to_8bit_keeps_groups_and_hyper_parameters():
    model = mlp(width=64)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1, "lr": 2e-3},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.8, 0.95),
        eps=1e-7,
    )
    for g in opt.param_groups:
        g["initial_lr"] = g["lr"]  # as an LR scheduler leaves it
    new = optim.to_8bit(opt)
    assert isinstance(new, AdamW8bit)
    assert [g["params"] for g in new.param_groups] == [g["params"] for g in opt.param_groups]
    for g, want in zip(new.param_groups, opt.param_groups):
        assert (g["lr"], g["betas"], g["eps"], g["weight_decay"], g["initial_lr"]) == (
            want["lr"],
            want["betas"],
            want["eps"],
            want["weight_decay"],
            want["initial_lr"],
        )
    assert optim.to_8bit(new) is new
    assert optim.is_8bit(new) and not optim.is_8bit(opt)


def test_adam_without_weight_decay_is_replaced():
    model = mlp(width=8)
    new = optim.to_8bit(torch.optim.Adam(model.parameters(), lr=5e-4))
    assert new.param_groups[0]["weight_decay"] == 0.0 and new.param_groups[0]["lr"] == 5e-4


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "not an Adam-family"),
        (lambda ps: torch.optim.Adam(ps, weight_decay=0.01), "L2 weight decay"),
        (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "amsgrad=True"),
        (lambda ps: torch.optim.AdamW(ps, maximize=True), "maximize=True"),
    ],
)
def test_to_8bit_refuses_what_it_cannot_replace(make, match):
    with pytest.raises(ValueError, match=match):
        optim.to_8bit(make(mlp(width=8).parameters()))


def test_to_8bit_refuses_an_optimizer_that_has_stepped():
    model = mlp(width=8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="already taken steps"):
        optim.to_8bit(opt)


@pytest.mark.filterwarnings("error:Accessing the data pointer of FakeTensor")
def test_wrap_replaces_the_optimizer_and_plans_with_its_state(caplog):
    x = torch.randn(4, 64)
    fixed = {}
    for eight in (False, True):
        model = mlp(width=64)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with caplog.at_level(logging.INFO, logger="memscale"):
            memscale.wrap(
                model,
                Config(use_8bit_optimizer=eight, force_optimize=True),
                sample_input=x,
                optimizer=opt,
            )
        ex = model._memscale_executor
        fixed[eight] = ex.plan.fixed_bytes
        assert (ex.optimizer is opt) == (not eight)
        if eight:
            assert isinstance(ex.optimizer, AdamW8bit)
            assert "train with model._memscale_executor.optimizer" in caplog.text
            assert not opt.state  # the given optimizer is left as it was
        memscale.detach(model)
    params = sum(p.numel() for p in mlp(width=64).parameters())
    # AdamW: 8 bytes of state per parameter; the 8-bit one about 2.1.
    assert fixed[False] - fixed[True] > 5 * params


def test_wrap_refuses_an_optimizer_it_cannot_replace_and_leaves_nothing():
    model = mlp(width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not an Adam-family"):
        memscale.wrap(model, Config(use_8bit_optimizer=True), optimizer=opt)
    assert "_memscale_executor" not in model.__dict__
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_optimize_yields_the_replacement():
    model = mlp(width=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 64)
    with memscale.optimize(model, opt, Config(use_8bit_optimizer=True), sample_input=x) as ex:
        new = ex.optimizer
        assert isinstance(new, AdamW8bit)
        model(x).square().mean().backward()
        new.step()
        assert new.state_bytes() < 0.3 * 2 * sum(p.numel() * 4 for p in model.parameters())
    assert "_memscale_executor" not in model.__dict__


def test_apply_all_optimizations_on_gpt2(caplog):
    model = tiny_gpt2(dropout=0.0)
    model.config.use_cache = True
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    ids = torch.randint(0, 256, (4, 32))
    with caplog.at_level(logging.INFO, logger="memscale"):
        model2, new = memscale.apply_all_optimizations(model, opt)
        assert model2 is model and isinstance(new, AdamW8bit)
        assert new.param_groups[0]["weight_decay"] == 0.05
        ex = model._memscale_executor
        assert ex.config.use_mixed_precision and ex.config.force_optimize
        assert ex.autocast == ("cpu", torch.bfloat16)
        losses = []
        for _ in range(6):  # warm-up profiling, then the plan
            loss = model(input_ids=ids, labels=ids).loss
            new.zero_grad()
            loss.backward()
            new.step()
            losses.append(loss.item())
    plan = ex.plan
    assert plan.technique_counts["checkpoint"] == len(plan.layers)
    assert model.config.use_cache is False
    assert caplog.text.count("use_cache=False") == 1
    assert losses[-1] < losses[0]
    memscale.detach(model)
    assert model.config.use_cache is True and ex.autocast is None


def test_apply_all_keeps_an_optimizer_it_cannot_replace(caplog):
    model = mlp(width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="memscale"):
        _, kept = memscale.apply_all_optimizations(model, opt, sample_input=torch.randn(2, 8))
    assert kept is opt
    assert "keeps the given optimizer: SGD is not an Adam-family" in caplog.text
    memscale.detach(model)


def test_apply_all_checks_its_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        memscale.apply_all_optimizations(object(), None)
    with pytest.raises(TypeError, match="Optimizer"):
        memscale.apply_all_optimizations(mlp(), object())
    with pytest.raises(TypeError, match="Config"):
        memscale.apply_all_optimizations(mlp(), None, config={})
    model = mlp(width=8)
    _, none = memscale.apply_all_optimizations(model, None, sample_input=torch.randn(2, 8))
    assert none is None
    memscale.detach(model)
