"""Config.optimizer_in_backward and Config.offload_optimizer_state: the
update inside backward and the optimizer state on the disk tier give the
ordinary step's results bit for bit (docs/below-the-floor.md)."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from conftest import tiny_gpt2, token_batch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import memscale
from memscale.optim import AdamW8bit

BASE = memscale.Config(mode="conservative", force_optimize=True, enable_logging=False)
IN_BACKWARD = BASE.replace(optimizer_in_backward=True)
ON_DISK = IN_BACKWARD.replace(offload_optimizer_state="disk")


def _groups(model, **kw):
    params = list(model.parameters())
    return [
        {"params": params[:5], "lr": 1e-3},
        {"params": params[5:], "lr": 3e-3, "weight_decay": 0.1},
    ]


OPTIMIZERS = {
    "adamw": lambda m: torch.optim.AdamW(_groups(m)),
    "adamw-foreach": lambda m: torch.optim.AdamW(_groups(m), foreach=True),
    "adamw-fused": lambda m: torch.optim.AdamW(_groups(m), fused=True),
    "adamw8bit": lambda m: AdamW8bit(_groups(m), min_8bit_size=64),
}


def _train(make_opt, config, steps=3):
    """``steps`` steps of a tiny GPT-2 with a StepLR scheduler; returns the
    model, the losses, the optimizer's state_dict and the executor's
    step-in-backward stats (None unwrapped)."""
    model = tiny_gpt2(dropout=0.0)
    model.train()
    opt = make_opt(model)
    if config is not None:
        memscale.wrap(model, config, optimizer=opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    x = token_batch(batch=2, seq=16)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if config is not None and config.optimizer_in_backward:
            assert all(p.grad is None for p in model.parameters())
        opt.step()
        sched.step()
        losses.append(loss.detach())
    stats = None
    if config is not None:
        stats = model._memscale_executor.step_in_backward.stats
    state = opt.state_dict()
    if config is not None:
        memscale.detach(model)
    return model, losses, state, stats


def _assert_same_state(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        sa, sb = a["state"][k], b["state"][k]
        assert sa.keys() == sb.keys(), k
        for key in sa:
            assert torch.equal(sa[key], sb[key]), (k, key)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("config", [IN_BACKWARD, ON_DISK], ids=["in-backward", "state-on-disk"])
def test_bitwise_equal_to_the_ordinary_step(name, config):
    ref, ref_losses, ref_state, _ = _train(OPTIMIZERS[name], None)
    model, losses, state, stats = _train(OPTIMIZERS[name], config)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    _assert_same_state(state, ref_state)
    assert stats["steps_completed"] == 3
    assert stats["updates"] == 3 * stats["parameters"]
    if config.offload_optimizer_state == "disk":
        tier = stats["tier"]
        assert tier["bytes_written"] > 0 and tier["tensors_read"] > 0
        assert tier["prefetched"] > 0  # the I/O thread read ahead


def test_state_leaves_memory_and_detach_restores_everything():
    model = tiny_gpt2(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters())
    memscale.wrap(model, ON_DISK, optimizer=opt)
    x = token_batch(batch=2, seq=16)
    model(input_ids=x, labels=x).loss.backward()
    # Between steps only the scalar step counts stay in optimizer.state.
    for state in opt.state.values():
        assert all(v.dim() == 0 for v in state.values()), state.keys()
    assert "step" in opt.__dict__
    assert all(p._post_accumulate_grad_hooks for p in model.parameters())
    memscale.detach(model)
    assert "step" not in opt.__dict__
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    for p in model.parameters():
        assert opt.state[p]["exp_avg"].shape == p.shape
    # The ordinary step again.
    model(input_ids=x, labels=x).loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.step()


def test_state_dict_round_trip_with_the_state_on_disk():
    """A checkpoint taken between steps, loaded into a fresh model and
    optimizer (also wrapped), continues exactly as the run that took it."""
    x = token_batch(batch=2, seq=16)

    def step(model, opt):
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()

    model = tiny_gpt2(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters())
    memscale.wrap(model, ON_DISK, optimizer=opt)
    step(model, opt)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()
    saved_opt = {
        "state": {k: {n: t.clone() for n, t in s.items()} for k, s in saved_opt["state"].items()},
        "param_groups": saved_opt["param_groups"],
    }
    step(model, opt)

    other = tiny_gpt2(dropout=0.0)
    other.load_state_dict(saved_model)
    other_opt = torch.optim.AdamW(other.parameters())
    memscale.wrap(other, ON_DISK, optimizer=other_opt)
    other_opt.load_state_dict(saved_opt)
    for state in other_opt.state.values():  # sent to the tier at once
        assert all(v.dim() == 0 for v in state.values())
    step(other, other_opt)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)
    memscale.detach(model)
    memscale.detach(other)


def test_step_with_a_closure_runs_it_and_the_post_hooks():
    model = tiny_gpt2(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    memscale.wrap(model, IN_BACKWARD, optimizer=opt)
    x = token_batch(batch=2, seq=16)
    seen = []
    opt.register_step_post_hook(lambda *a: seen.append(1))
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and seen == [1]
    assert model._memscale_executor.optimizer_steps == 1
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    memscale.detach(model)


def test_wrap_refuses_what_it_cannot_do():
    model = tiny_gpt2(dropout=0.0)
    with pytest.raises(ValueError, match="optimizer_in_backward=True needs the optimizer"):
        memscale.wrap(model, IN_BACKWARD)
    opt = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match="LBFGS"):
        memscale.wrap(model, IN_BACKWARD, optimizer=opt)
    opt = torch.optim.AdamW(model.parameters())
    opt.register_step_pre_hook(lambda *a: None)
    with pytest.raises(ValueError, match="step pre-hooks"):
        memscale.wrap(model, IN_BACKWARD, optimizer=opt)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="offload_optimizer_state='disk'"):
        memscale.wrap(model, IN_BACKWARD.replace(offload_optimizer_state="host"), optimizer=opt)
    with pytest.raises(ValueError, match="verify_correctness"):
        memscale.wrap(model, IN_BACKWARD.replace(verify_correctness=True), optimizer=opt)
    off = memscale.AsyncOffloadConfig(max_disk_gb=0)
    with pytest.raises(ValueError, match="max_disk_gb"):
        memscale.wrap(model, ON_DISK.replace(async_config=off), optimizer=opt)
    # Nothing was left behind by the refusals.
    assert "_memscale_executor" not in model.__dict__
    assert "step" not in opt.__dict__
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_config_validation():
    with pytest.raises(ValueError, match="needs optimizer_in_backward=True"):
        memscale.Config(offload_optimizer_state="disk")
    with pytest.raises(ValueError, match="'host', 'disk' or None"):
        memscale.Config(optimizer_in_backward=True, offload_optimizer_state="nvme")
    with pytest.raises(TypeError, match="offload_optimizer_state"):
        memscale.Config(optimizer_in_backward=True, offload_optimizer_state=1)
    with pytest.raises(TypeError, match="optimizer_in_backward must be a bool"):
        memscale.Config(optimizer_in_backward="yes")
    c = memscale.Config(optimizer_in_backward=True, offload_optimizer_state=" Disk ")
    assert c.offload_optimizer_state == "disk"


def test_a_failed_update_says_what_was_updated():
    model = tiny_gpt2(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters())
    memscale.wrap(model, IN_BACKWARD, optimizer=opt)
    sib = model._memscale_executor.step_in_backward
    calls = []
    raw = sib._raw_step

    def failing(o):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk gone")
        return raw(o)

    sib._raw_step = failing
    x = token_batch(batch=2, seq=16)
    with pytest.raises(RuntimeError, match="updated 2 parameters before it") as info:
        model(input_ids=x, labels=x).loss.backward()
    assert isinstance(info.value.__cause__, OSError)
    memscale.detach(model)


def test_an_interrupted_backward_is_reported_at_the_next(caplog):
    model = tiny_gpt2(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters())
    memscale.wrap(model, IN_BACKWARD, optimizer=opt)
    x = token_batch(batch=2, seq=16)
    model(input_ids=x, labels=x).loss.backward()  # planned (on fake tensors) and stepped

    def interrupt(*args):
        raise KeyboardInterrupt

    handle = model.transformer.h[0].register_full_backward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(input_ids=x, labels=x).loss.backward()
    handle.remove()
    with caplog.at_level(logging.WARNING, logger="memscale"):
        model(input_ids=x, labels=x).loss.backward()
    assert "the last backward stopped after updating" in caplog.text
    sib = model._memscale_executor.step_in_backward
    assert sib.steps_completed == 2  # the interrupted one is not counted
    n = sib.stats["parameters"]
    done = int(re.search(r"after updating (\d+) of (\d+)", caplog.text).group(1))
    assert 0 < done < n  # block 0's own backward ran; the embeddings' did not
    assert sib.updates == 2 * n + done
    memscale.detach(model)


def test_the_planner_counts_the_floor():
    model = tiny_gpt2(dropout=0.0, n_embd=128, vocab_size=4096)
    opt = torch.optim.AdamW(model.parameters())
    x = token_batch(vocab=4096, batch=2, seq=32)
    batch = {"input_ids": x, "labels": x}
    plain = memscale.predict_peak(model, batch, BASE, optimizer=opt)
    below = memscale.predict_peak(model, batch, ON_DISK, optimizer=opt)
    params = sum(p.numel() * 4 for p in model.parameters())
    # At the peak: every gradient and both of Adam's moments (3x the
    # parameters) in the ordinary step; with the floor, those of the
    # parameter in flight only (here the tied 4096x128 embedding's, a
    # ninth of the model, counted as the update's workspace).
    assert plain.optimized.gradients == params
    assert plain.optimized.optimizer_state >= 2 * params
    assert below.optimized.gradients == 0
    assert below.optimized.optimizer_state < params / 1000  # the step counts
    assert below.optimized.peak_bytes < plain.optimized.peak_bytes - params
    budget = (below.optimized.peak_bytes + plain.optimized.peak_bytes) / 2 / 2**30
    config = memscale.Config(memory_budget_gb=budget, enable_logging=False)
    with pytest.raises(memscale.MemoryBudgetError) as info:
        memscale.wrap(model, config, batch, optimizer=opt)
    tips = dict(info.value.suggestions)
    key = next(k for k in tips if "offload_optimizer_state='disk'" in k)
    assert tips[key] <= budget * 2**30
    below_config = config.replace(optimizer_in_backward=True, offload_optimizer_state="disk")
    memscale.wrap(model, below_config, batch, optimizer=opt)
    memscale.detach(model)


def test_a_scheduler_built_after_wrap_keeps_working_after_detach():
    model = tiny_gpt2(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    memscale.wrap(model, IN_BACKWARD, optimizer=opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)  # wraps opt.step
    x = token_batch(batch=2, seq=16)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    sched.step()
    memscale.detach(model)
    model(input_ids=x, labels=x).loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # through the scheduler's wrapper: the ordinary step
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_the_disk_cap_keeps_the_rest_of_the_state_in_memory():
    """max_disk_gb applies: what does not fit stays in optimizer.state, and
    the results are still the ordinary step's."""
    ref, ref_losses, ref_state, _ = _train(OPTIMIZERS["adamw"], None, steps=2)
    capped = ON_DISK.replace(async_config=memscale.AsyncOffloadConfig(max_disk_gb=64 / 2**20))
    model, losses, state, stats = _train(OPTIMIZERS["adamw"], capped, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    _assert_same_state(state, ref_state)
    tier = stats["tier"]
    assert tier["refused_over_cap"] > 0
    assert 0 < tier["peak_bytes_on_disk"] <= 64 << 10


@pytest.mark.parametrize("how", ["unfrozen", "added"])
def test_a_parameter_that_trains_only_after_wrap_is_refused_at_step(how):
    """Staged unfreezing or add_param_group() after wrap: backward has no
    hook on that parameter, so step() must not pass over it silently."""
    model = tiny_gpt2(dropout=0.0)
    late = model.transformer.wte.weight
    late.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained if how == "added" else model.parameters(), lr=1e-2)
    memscale.wrap(model, IN_BACKWARD, optimizer=opt)
    try:
        late.requires_grad_(True)
        if how == "added":
            opt.add_param_group({"params": [late]})
        x = token_batch(batch=2, seq=16)
        model(input_ids=x, labels=x).loss.backward()
        kept = late.grad.clone()
        with pytest.raises(RuntimeError, match=r"after wrap.*memscale\.detach\(model\)"):
            opt.step()
        assert torch.equal(late.grad, kept)  # the gradient is not lost
    finally:
        memscale.detach(model)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_the_optimizer_is_an_ordinary_one_with_the_whole_state(how, tmp_path):
    """copy.deepcopy or torch.save of the optimizer while its state is on
    the disk tier: the copy holds every state tensor (not only ``step``)
    and steps as an ordinary optimizer; the original goes on as before."""
    import copy

    x = token_batch(batch=2, seq=16)
    model = tiny_gpt2(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    memscale.wrap(model, ON_DISK, optimizer=opt)
    try:
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        if how == "deepcopy":
            copied = copy.deepcopy(opt)
        else:
            torch.save(opt, tmp_path / "opt.pt")
            copied = torch.load(tmp_path / "opt.pt", weights_only=False)
        want = opt.state_dict()["state"]
        got = copied.state_dict()["state"]
        assert want.keys() == got.keys()
        for k in want:
            assert want[k].keys() == got[k].keys() == {"step", "exp_avg", "exp_avg_sq"}
            assert all(torch.equal(want[k][n], got[k][n]) for n in want[k])
        # The original's state went back to the tier; the copy is ordinary.
        assert all(v.dim() == 0 for s in opt.state.values() for v in s.values())
        assert "step" not in copied.__dict__ and "__deepcopy__" not in copied.__dict__
        params = [p for g in copied.param_groups for p in g["params"]]
        for p in params:
            p.grad = torch.ones_like(p)
        before = [p.detach().clone() for p in params]
        copied.step()
        assert all(not torch.equal(a, p) for a, p in zip(before, params))
    finally:
        memscale.detach(model)
    assert "__deepcopy__" not in opt.__dict__ and "__reduce_ex__" not in opt.__dict__


def test_after_a_failed_update_the_next_backward_is_a_fresh_step(caplog):
    # The first update of a backward raises: the next backward must begin
    # a step of its own (its end counted), with no false "stopped after
    # updating" warning one backward later.
    model = tiny_gpt2(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters())
    memscale.wrap(model, IN_BACKWARD, optimizer=opt)
    x = token_batch(batch=2, seq=16)
    model(input_ids=x, labels=x).loss.backward()  # planned and stepped
    sib = model._memscale_executor.step_in_backward
    raw = sib._raw_step

    def failing(o):
        raise OSError("disk gone")

    sib._raw_step = failing
    with pytest.raises(RuntimeError, match="updated 0 parameters before it"):
        model(input_ids=x, labels=x).loss.backward()
    sib._raw_step = raw
    with caplog.at_level(logging.WARNING, logger="memscale"):
        model(input_ids=x, labels=x).loss.backward()
        model(input_ids=x, labels=x).loss.backward()
    assert "stopped after updating" not in caplog.text
    assert sib.steps_completed == 3
    n = sib.stats["parameters"]
    assert sib.updates == 3 * n
    memscale.detach(model)


@pytest.mark.parametrize("where", ["optimizer", "global"])
def test_a_step_pre_hook_added_after_wrap_is_refused_before_any_update(where):
    model = tiny_gpt2(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters())
    memscale.wrap(model, IN_BACKWARD, optimizer=opt)
    x = token_batch(batch=2, seq=16)
    model(input_ids=x, labels=x).loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def pre(*args):
        calls.append(1)

    if where == "optimizer":
        handle = opt.register_step_pre_hook(pre)
    else:
        handle = register_optimizer_step_pre_hook(pre)
    try:
        with pytest.raises(RuntimeError, match="step pre-hooks .* added after wrap"):
            model(input_ids=x, labels=x).loss.backward()
    finally:
        handle.remove()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not calls
    model(input_ids=x, labels=x).loss.backward()  # without the hook: trains on
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    memscale.detach(model)


class _CountingTier:
    """A state tier that keeps the tensors themselves and counts the
    bytes it holds."""

    def __init__(self) -> None:
        self.held = 0

    def put(self, t):
        self.held += t.numel() * t.element_size()
        return [t.detach().clone()]

    def prefetch(self, record):
        pass

    def get(self, record):
        t = record.pop()
        self.held -= t.numel() * t.element_size()
        return t

    def discard(self, record):
        for t in record:
            self.held -= t.numel() * t.element_size()
        record.clear()

    def end_step(self):
        pass

    def close(self):
        pass

    @property
    def stats(self):
        return {"held": self.held}


def test_load_state_dict_gives_back_what_the_replaced_state_held_on_the_tier():
    from memscale._step_in_backward import StepInBackward

    model = tiny_gpt2(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters())
    tier = _CountingTier()
    sib = StepInBackward(opt, tier=tier)
    try:
        x = token_batch(batch=2, seq=16)
        model(input_ids=x, labels=x).loss.backward()
        one_step = tier.held
        assert one_step == 2 * sum(p.numel() * 4 for p in model.parameters())  # two moments
        for _ in range(3):
            opt.load_state_dict(opt.state_dict())
        assert tier.held == one_step  # not four times as much
    finally:
        sib.remove()
    assert tier.held == 0


def test_the_host_tier_counts_a_discarded_record_as_free():
    from memscale._step_in_backward import HostStateTier, _HostRecord

    tier = HostStateTier(cap_bytes=1 << 20, disk=None)
    tier.used = 64
    tier.discard(_HostRecord(torch.empty(16), torch.device("cpu"), 64, None))
    assert tier.used == 0


def test_the_disk_tier_checksums_optimizer_state_in_debug_mode():
    config = ON_DISK.replace(async_config=memscale.AsyncOffloadConfig(debug=True))
    model = tiny_gpt2(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters())
    memscale.wrap(model, config, optimizer=opt)
    x = token_batch(batch=2, seq=16)
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    stats = model._memscale_executor.step_in_backward.tier.stats
    assert stats["tensors_read"] > 0
    assert stats["verified"] == stats["tensors_read"]
    memscale.detach(model)


def test_a_tensor_lr_turns_the_foreach_default_off_as_torch_does():
    # torch's Adam takes its single-tensor path for a Tensor lr without
    # capturable even where foreach is the default (a CUDA model); the
    # update of one parameter must make the same choice.
    model = tiny_gpt2(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    memscale.wrap(model, IN_BACKWARD, optimizer=opt)
    sib = model._memscale_executor.step_in_backward
    sib._foreach = True  # what torch decides for CUDA parameters
    x = token_batch(batch=2, seq=16)
    model(input_ids=x, labels=x).loss.backward()  # foreach with a Tensor lr raises
    assert sib.steps_completed == 1
    memscale.detach(model)
