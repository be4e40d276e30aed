"""Config(verify_correctness=True): the first optimized step is replayed
without memscale and compared (CPU, about 15 s)."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch
from conftest import CNN, hook_count, loss_of, mlp, tiny_bert, tiny_gpt2, token_batch, twins
from torch import nn

import memscale
from memscale import _verify

VERIFY = memscale.Config(
    mode="conservative", force_optimize=True, verify_correctness=True, enable_logging=False
)
PLAIN = VERIFY.replace(verify_correctness=False)


class PythonDropout(nn.Module):
    """A deliberately broken layer for checkpointing: its dropout mask comes
    from Python's random module, which the executor does not replay, so
    the recompute in backward draws a different mask than the forward."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        keep = torch.tensor([random.random() > 0.5 for _ in range(x.shape[-1])], dtype=x.dtype)
        return torch.tanh(self.fc(x)) * keep


def broken_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[PythonDropout() for _ in range(3)])


def _noisy_step(m, x):
    """Draws from every RNG between forward and backward: the replay, which
    runs inside backward, must leave the streams where they were."""
    out = m(x)
    noise = torch.rand_like(out) * random.random()
    return (out + noise).pow(2).mean()


def _bn_step(m, x):
    """Changes a buffer between forward and backward: the replay, which
    starts from the buffers the forward saw, must put it back."""
    out = m(x)
    with torch.no_grad():
        m.blocks[0].bn.running_mean.add_(1.0)
    return out.logsumexp(-1).mean()


CASES = {
    "mlp-dropout": (lambda: mlp(p=0.1), lambda: torch.randn(8, 32), _noisy_step),
    "cnn-batchnorm": (CNN, lambda: torch.randn(4, 3, 8, 8), _bn_step),
    "gpt2-dropout": (tiny_gpt2, token_batch, loss_of),
    # The loss uses both outputs: the model's own loss and its logits.
    "bert-two-outputs": (
        tiny_bert,
        token_batch,
        lambda m, x: (lambda o: o.loss + o.logits.pow(2).mean())(m(input_ids=x, labels=x)),
    ),
}


def _sample(name, x):
    return {"input_ids": x, "labels": x} if name.startswith(("gpt2", "bert")) else x


def _train(model, x, step, steps=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        step(model, x).backward()
        opt.step()
    return opt


@pytest.mark.parametrize("name", sorted(CASES))
def test_correct_techniques_pass_and_training_is_unchanged(name, caplog):
    factory, make_input, step = CASES[name]
    torch.manual_seed(3)
    checked, plain = factory(), None
    plain = copy.deepcopy(checked)
    x = make_input()
    results = {}
    for label, model, config in (("verify", checked, VERIFY), ("plain", plain, PLAIN)):
        model.train()
        torch.manual_seed(11)
        random.seed(11)
        memscale.wrap(model, config, sample_input=_sample(name, x))
        with caplog.at_level(logging.INFO, logger="memscale._verify"):
            opt = _train(model, x, step)
        executor = model._memscale_executor
        results[label] = (
            opt,
            torch.get_rng_state(),
            random.getstate(),
            getattr(executor, "verifier", None),
            executor.stats,
        )
        memscale.detach(model)
    opt_v, rng_v, py_v, verifier, stats_v = results["verify"]
    opt_p, rng_p, py_p, _, stats_p = results["plain"]
    assert verifier is not None and verifier.done
    assert verifier.report["gradient_abs"] == 0.0
    assert verifier.report["output_abs"] == 0.0
    assert "matches the unoptimized replay" in caplog.text
    # Parameters, buffers, optimizer state, RNG streams: as without verify.
    for (k, a), (_, b) in zip(checked.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), k
    for sa, sb in zip(opt_v.state.values(), opt_p.state.values()):
        for key in sa:
            assert torch.equal(sa[key], sb[key])
    assert torch.equal(rng_v, rng_p) and py_v == py_p
    assert stats_v["training_forwards"] == stats_p["training_forwards"]
    assert stats_v["recomputes"] == stats_p["recomputes"]


SETTING = {"scale": 1.0}


class LateSetting(nn.Module):
    """Reads a setting that the training loop changes between forward and
    backward: run again at once it computes the same (the first-step
    recompute check passes it), recomputed in backward it does not."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.fc(x)) * SETTING["scale"]


def test_a_broken_recompute_is_caught():
    torch.manual_seed(0)
    model = nn.Sequential(*[LateSetting() for _ in range(3)])
    x = torch.randn(4, 16)
    hooks = hook_count(model)
    memscale.wrap(model, VERIFY, sample_input=x)
    wrapped_hooks = hook_count(model)
    SETTING["scale"] = 1.0
    try:
        loss = model(x).pow(2).sum()
        SETTING["scale"] = 2.0
        with pytest.raises(
            _verify.VerificationError, match="differs from the same step without memscale.*bitwise"
        ):
            loss.backward()
    finally:
        SETTING["scale"] = 1.0
    verifier = model._memscale_executor.verifier
    assert verifier.report["gradient_abs"] > 0
    assert model._memscale_executor.recompute_check.passed == {0, 1, 2}
    # The check is over: its hooks are gone, training can go on.
    assert hook_count(model) == wrapped_hooks - 2
    model(x).sum().backward()
    memscale.detach(model)
    assert hook_count(model) == hooks


def test_a_layer_that_cannot_recompute_is_caught_at_the_first_step(caplog):
    """Python's random module is not replayed by a recompute: the check
    finds it in the first step's forward, that step is exact (the verifier
    agrees), and the layers are no longer checkpointed."""
    model = broken_model()
    x = torch.randn(4, 16)
    memscale.wrap(model, VERIFY, sample_input=x)
    try:
        with caplog.at_level(logging.WARNING, logger="memscale"):
            model(x).pow(2).sum().backward()
        ex = model._memscale_executor
        assert ex.verifier.report["gradient_abs"] == 0.0
        assert ex.recompute_check.failed.keys() == {0, 1, 2}
        assert "checkpointed layer '0' (PythonDropout) does not compute the same" in caplog.text
        model(x).sum().backward()
        assert [layer.rule for layer in ex.plan.layers] == ["ineligible:unrepeatable"] * 3
    finally:
        memscale.detach(model)


def test_the_same_broken_layer_passes_without_checkpointing():
    model = broken_model()
    x = torch.randn(4, 16)
    memscale.wrap(model, VERIFY.replace(force_optimize=False), sample_input=x)
    try:
        assert not hasattr(model._memscale_executor, "verifier")  # smart-skip
        model(x).sum().backward()
    finally:
        memscale.detach(model)


def test_executor_pause_makes_the_model_run_as_without_memscale():
    model, ref = twins(lambda: mlp(p=0.1))
    x = torch.randn(4, 32)
    memscale.wrap(model, PLAIN, sample_input=x)
    executor = model._memscale_executor
    with executor.paused():
        with executor.paused():  # nestable
            torch.manual_seed(0)
            model(x).sum().backward()
    torch.manual_seed(0)
    ref(x).sum().backward()
    assert executor.stats["checkpoint_frames"] == 0
    assert executor.stats["training_forwards"] == 0
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    model(x).sum().backward()  # resumed: checkpointing again
    assert executor.stats["checkpoint_frames"] > 0
    with pytest.raises(RuntimeError, match="without a matching pause"):
        executor.resume()
    memscale.detach(model)


def test_a_forward_without_backward_passes_the_check_to_the_next():
    model = mlp(p=0.1)
    x = torch.randn(8, 32)
    memscale.wrap(model, VERIFY, sample_input=x)
    model(x)  # no backward
    verifier = model._memscale_executor.verifier
    assert not verifier.done
    model(x).sum().backward()
    assert verifier.done and verifier.report["gradient_abs"] == 0.0
    memscale.detach(model)


def test_planned_in_the_first_forward_the_first_step_is_checked():
    model = mlp(p=0.1)
    x = torch.randn(8, 32)
    memscale.wrap(model, VERIFY)  # no sample_input: planned in the first forward
    verifier = model._memscale_executor.verifier
    model(x).sum().backward()
    assert verifier.done and verifier.report["gradient_abs"] == 0.0
    memscale.detach(model)


def test_with_warmup_profiling_the_first_applied_step_is_checked():
    model = mlp(p=0.1)
    x = torch.randn(8, 32)
    memscale.wrap(model, VERIFY.replace(warmup_steps=2, use_static_profiling=False))
    verifier = model._memscale_executor.verifier
    for _ in range(2):
        model(x).sum().backward()
        assert not verifier.done  # still profiling
    model(x).sum().backward()
    assert verifier.done and verifier.report["gradient_abs"] == 0.0
    memscale.detach(model)


def test_verify_is_no_longer_reported_as_unavailable(caplog):
    model = mlp()
    with caplog.at_level(logging.WARNING, logger="memscale"):
        memscale.wrap(model, VERIFY, sample_input=torch.randn(2, 32))
    memscale.detach(model)
    assert "verify_correctness" not in caplog.text


def test_detach_before_backward_removes_everything():
    model = mlp()
    x = torch.randn(8, 32)
    hooks = hook_count(model)
    memscale.wrap(model, VERIFY, sample_input=x)
    out = model(x)
    memscale.detach(model)
    assert hook_count(model) == hooks
    out.sum().backward()  # no check runs on a detached model
