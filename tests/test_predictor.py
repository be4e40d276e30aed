"""The OOM predictor: predict_peak, estimate_savings (CPU, about 30 s).

Predictions are checked against measure_step, which measures a real step
exactly (memscale.benchmarks.measure.measure_peak); on the models here the
two agree to the byte, so the tolerance below (0.5%) only absorbs kernel
allocations of a few bytes, and a prediction that missed any real tensor
(a gradient, the optimizer's temporaries, a kernel's scratch buffer) fails.
"""

from __future__ import annotations

import contextlib
import json
import random

import pytest
import torch
from conftest import CNN, hook_count, mlp, tiny_gpt2, tiny_llama, token_batch
from torch import nn

import memscale
from memscale import _planner, _torch_compat, predictor
from memscale._planner import PredictionSession, predict_peak
from memscale.autotuning import measure_step
from memscale.predictor import DeviceSpec, PeakPrediction, _workspace

FORCE = memscale.Config(mode="conservative", force_optimize=True, enable_logging=False)
QUIET = memscale.Config(enable_logging=False)
TOLERANCE = 0.005


def _mse_target():
    return torch.randn(64, 32, generator=torch.Generator().manual_seed(5))


def _mse_loss():
    """The MLP case's loss function, against a fixed target."""
    target = _mse_target()
    return lambda out: nn.functional.mse_loss(out, target)


CASES = {
    # model factory, sample input, loss_fn
    "mlp": (
        lambda: mlp(depth=4, width=32),
        lambda: torch.randn(64, 32, generator=torch.Generator().manual_seed(2)),
        _mse_loss,
    ),
    "cnn": (
        CNN,
        lambda: torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(2)),
        lambda: None,
    ),
    "gpt2": (
        tiny_gpt2,
        lambda: {"input_ids": token_batch(), "labels": token_batch()},
        lambda: None,
    ),
    # Its attention-mask code branches on the values of the position ids,
    # which the predictor keeps real: all-fake, the step would build an
    # explicit mask and copy the key/value heads, a few percent more.
    "llama": (
        tiny_llama,
        lambda: {"input_ids": token_batch(batch=4, seq=64), "labels": token_batch(batch=4, seq=64)},
        lambda: None,
    ),
}


def _case(name):
    factory, make_input, make_loss = CASES[name]
    model = factory()
    model.train()
    return model, make_input(), make_loss()


@pytest.mark.parametrize("name", ["cnn", "llama", "mlp"])
def test_prediction_matches_the_measured_step(name):
    model, x, loss_fn = _case(name)
    with PredictionSession(model, x, loss_fn=loss_fn) as session:
        predictions = {None: session.predict(QUIET), FORCE: session.predict(FORCE)}
    for config, prediction in predictions.items():
        measured = measure_step(model, x, config, loss_fn=loss_fn).peak_bytes
        got = prediction.unoptimized if config is None else prediction.optimized
        error = abs(got.peak_bytes - measured) / measured
        assert error <= TOLERANCE, (name, config, got, measured)
    # Under the plan every unit is checkpointed, and that never costs memory
    # (the tiny Llama peaks in the optimizer step, where it saves nothing).
    assert prediction.checkpointed_layers
    assert prediction.optimized.peak_bytes <= prediction.unoptimized.peak_bytes
    assert prediction.optimized.activations <= prediction.unoptimized.activations


def _optimizer_phase(name, make_optimizer):
    """The unoptimized simulated step's optimizer phase (each event's bytes,
    category and storage, numbered by first appearance; the kernel calls
    by event index), the whole step's predicted peak, and how many
    optimizer steps the simulation ran."""
    model, x, loss_fn = _case(name)
    with PredictionSession(model, x, make_optimizer(model), loss_fn=loss_fn) as session:
        prediction = session.predict(FORCE)
        steps = session._steps
        tracker = steps._unoptimized.tracker
        ran = steps._sim.step.optimizer_steps
    start = next(at for at, phase in tracker.phase_marks if phase == "optimizer")
    end = next(at for at, phase in tracker.phase_marks if phase == "end")
    order: dict[int, int] = {}
    events = [
        (order.setdefault(serial, len(order)), delta, tracker.categories[serial])
        for serial, delta in tracker.events[start:end]
    ]
    calls = [(i - start, sig) for i, sig, _ in tracker.kernel_calls if start <= i <= end]
    return events, calls, prediction.unoptimized, prediction.optimized, ran


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=0.1, amsgrad=True),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True),
    ],
    ids=["adamw", "adam-amsgrad", "adamw-foreach"],
)
def test_the_warm_ups_adam_update_stands_for_the_steady_one(monkeypatch, make_optimizer):
    # The warm-up's update, less the state it made, is replayed as the
    # steady-state update: the same events as running the update once
    # more in the first tracked step, with one simulated update fewer.
    derived = _optimizer_phase("llama", make_optimizer)
    monkeypatch.setattr(predictor._step, "_FIRST_UPDATE_IS_STEADY", ())
    ran_again = _optimizer_phase("llama", make_optimizer)
    assert derived[:4] == ran_again[:4]
    assert derived[0]  # the update makes temporaries
    assert (derived[4], ran_again[4]) == (1, 2)


class _FlopCounterTally:
    """The warm-up's FLOP counter as it was: torch's FlopCounterMode, a
    dispatch mode above the warm-up's caller (which then counts nothing)."""

    on = False

    def __init__(self):
        self.mode = memscale._torch_compat.flop_counter()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

    def get_total_flops(self):
        return self.mode.get_total_flops()


class _FrozenFirst(nn.Module):
    """A block whose first linear runs under torch.inference_mode: there
    ``aten.linear`` reaches the dispatch modes whole (no autograd key to
    decompose it), and FlopCounterMode counts it by its decomposition."""

    def __init__(self, frozen):
        super().__init__()
        self.a, self.b, self.frozen = nn.Linear(64, 64), nn.Linear(64, 64), frozen

    def forward(self, x):
        if self.frozen:
            with torch.inference_mode():
                y = self.a(x.detach())
            y = y.clone()
        else:
            y = self.a(x)
        return torch.relu(self.b(y)) + x


def _frozen_first():
    torch.manual_seed(0)
    model = nn.Sequential(_FrozenFirst(True), _FrozenFirst(False))
    return model, torch.randn(32, 64), lambda out: out.pow(2).mean()


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2", "llama", "frozen-first"])
def test_the_warm_ups_flop_tally_counts_as_flop_counter_mode(monkeypatch, name):
    def profile_flops():
        model, x, loss_fn = _frozen_first() if name == "frozen-first" else _case(name)
        with PredictionSession(model, x, loss_fn=loss_fn) as session:
            profile = session._steps.profile
        return [layer.flops for layer in profile.layers], profile.total_flops

    tallied = profile_flops()
    monkeypatch.setattr(predictor._step, "FlopTally", _FlopCounterTally)
    assert tallied == profile_flops()
    assert tallied[1] > 0 and all(f > 0 for f in tallied[0])
    if name == "frozen-first":  # both linears of each block counted
        assert tallied[0] == [2 * (2 * 32 * 64 * 64)] * 2


class _ModeRecorder:
    """The warm-up's op recorder as a dispatch mode of its own, above the
    warm-up's caller (as it was before the caller handed it each call):
    the reference the caller's hand-over is held to."""

    def __init__(self, units, profiler, as_mode=False):
        from memscale import _selective

        self.inner = _selective.OpRecorder(units, (profiler._count, profiler._ident))
        self.ops = self.inner.ops

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def close(self):
        self.inner.close()

    def record(self, *args):
        pass  # the mode records


@pytest.mark.parametrize("name", ["gpt2", "llama", "cnn", "frozen-first"])
def test_the_warm_up_caller_hands_the_op_recorder_what_its_mode_saw(monkeypatch, name):
    """The warm-up's caller hands the profiler's op recorder every call,
    as the recorder saw them as a mode above it: the same ops of each unit
    (costs, classes, names, tail, saved, data flow), and the same profile
    (frozen-first: a linear under inference mode, which the caller runs
    as its decomposition, recorded whole)."""
    from memscale import _selective

    def recorded():
        made = []
        recorder = _selective.recorder

        def keep(*args, **kwargs):
            ops = recorder(*args, **kwargs)
            made.append(ops)
            return ops

        with monkeypatch.context() as m:
            m.setattr(_selective, "recorder", keep)
            model, x, loss_fn = _frozen_first() if name == "frozen-first" else _case(name)
            with PredictionSession(model, x, loss_fn=loss_fn) as session:
                profile = session._steps.profile
        (ops,) = made
        return profile, ops.ops

    handed = recorded()
    with monkeypatch.context() as m:
        m.setattr(_selective, "recorder", _ModeRecorder)
        as_mode = recorded()
    assert handed[1] == as_mode[1]
    assert handed[0] == as_mode[0]
    assert sum(len(layer.calls) for layer in handed[1]) > 0
    assert any(layer.tail for layer in handed[1])


def test_a_recording_less_what_it_kept_renumbers_its_kernel_calls():
    from memscale.predictor._tracker import StorageTracker

    tracker = StorageTracker()
    tracker.kernel_calls = []
    before = tracker._born(100)
    since = tracker.mark()
    tracker._born(8)  # kept: the state
    temporary = tracker._born(16)
    tracker.kernel_calls.append((len(tracker.events), "sig", (temporary,)))
    tracker._died(temporary)
    recording = tracker.recorded_less_kept(since)
    # As if the kept storage had not been made: the temporary is the
    # recording's first storage, and the kernel call its first event's.
    assert recording.events == ((0, 16), (0, -16))
    assert recording.sizes_at_birth == (16,)
    assert recording.kernel_calls == ((1, "sig", (0,)),)
    tracker._died(before)  # a storage made before it: not a recording
    assert tracker.recorded_less_kept(since) is None


@pytest.mark.parametrize("name", ["llama", "mlp"])
def test_the_first_step_after_wrap_is_predicted(name):
    # Issue 22: the first step checks each checkpointed layer (its saved
    # tensors held while it runs again) and starts without optimizer
    # state; measured: the first step after wrap (no warm-up step).
    model, x, loss_fn = _case(name)
    prediction = predict_peak(model, x, FORCE, loss_fn=loss_fn)
    measured = measure_step(model, x, FORCE, loss_fn=loss_fn, warmup=0).peak_bytes
    got = prediction.first_step
    assert abs(got.peak_bytes - measured) <= TOLERANCE * measured, (got, measured)
    assert got.optimizer_state == 0 or got.phase == "optimizer"
    if name == "llama":
        # Its first step peaks in forward, at the check of a layer (without
        # the check it peaks in backward, 4% lower, and misses the measure).
        assert got.phase == "forward"
    assert prediction.fits == (
        max(got.peak_bytes, prediction.optimized.peak_bytes) <= prediction.budget_bytes
    )


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_the_plan_is_the_plan_wrap_applies(name):
    model, x, _ = _case(name)
    configs = (FORCE, QUIET, QUIET.replace(memory_budget_gb=1e-9))
    # wrap() is given no loss: it predicts with the default one.
    with PredictionSession(model, x) as session:
        predictions = [session.predict(config) for config in configs]
    for config, prediction in zip(configs, predictions):
        if config.memory_budget_gb is not None:
            # No plan fits: predict_peak reports the plan it would make;
            # wrap() refuses, saying the smallest budget it reaches.
            with pytest.raises(memscale.MemoryBudgetError):
                memscale.wrap(model, config, sample_input=x)
            assert "_memscale_executor" not in model.__dict__
            continue
        memscale.wrap(model, config, sample_input=x)
        try:
            plan = model._memscale_executor.plan
            assert plan.hash == prediction.plan_hash
            assert plan.peak_projected_bytes == prediction.engine_projected_bytes
        finally:
            memscale.detach(model)


def test_a_model_on_the_meta_device_is_predicted_without_its_memory():
    from memscale.benchmarks.measure import measure_peak

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(32)])
    params = sum(p.numel() * 4 for p in model.parameters())  # 512 MiB
    assert params > 500 << 20
    spec = DeviceSpec("cpu", capacity_bytes=64 << 30, name="a 64 GiB host")
    box = []
    report = measure_peak(
        lambda: box.append(predict_peak(model, torch.randn(8, 2048), FORCE, device=spec))
    )
    prediction = box[0]
    # Parameters, gradients and AdamW's two moments: 4x the parameters,
    # and the step allocated a small fraction of one of them for real.
    assert 4 * params <= prediction.unoptimized.peak_bytes <= 4.1 * params
    assert report.peak_delta_bytes < 32 << 20
    assert prediction.capacity_bytes == 64 << 30
    assert prediction.budget_bytes == int((64 << 30) * 0.85)
    assert prediction.device_name == "a 64 GiB host"
    assert all(p.is_meta for p in model.parameters())


def test_the_model_is_left_as_it_was():
    model = CNN()
    model.eval()
    x = torch.randn(4, 3, 8, 8)
    model(x).sum().backward()  # existing gradients must survive
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    hooks = hook_count(model)
    rng = torch.get_rng_state()
    py_rng = random.getstate()
    predict_peak(model, x, FORCE)
    assert [id(p) for p in model.parameters()] == params
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
        assert not _torch_compat.fake_tensor_tools()[0](value)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)
    assert not any(m.training for m in model.modules())
    assert hook_count(model) == hooks
    assert torch.equal(torch.get_rng_state(), rng)
    assert random.getstate() == py_rng
    assert not hasattr(model, "_memscale_executor")


class CachesAMask(nn.Module):
    """Stores a tensor on itself in forward, as some models cache masks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        self.last_mask = torch.ones_like(x)
        return self.fc(x * self.last_mask)


def test_a_model_that_draws_from_python_random_leaves_the_stream_alone():
    from test_verify import broken_model

    model = broken_model()
    state = random.getstate()
    predict_peak(model, torch.randn(4, 16), FORCE)
    assert random.getstate() == state


def test_a_tensor_cached_in_forward_does_not_outlive_the_simulation():
    model = nn.Sequential(CachesAMask(), CachesAMask())
    model[0].last_mask = "before"
    predict_peak(model, torch.randn(2, 8), FORCE)
    assert model[0].last_mask == "before"
    assert "last_mask" not in model[1].__dict__


class ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if h.sum().item() > 0:  # a branch on an activation's value
            return h
        return -h


def test_a_step_that_cannot_be_simulated_raises_and_restores():
    model = nn.Sequential(ReadsAValue(), ReadsAValue())
    params = [id(p) for p in model.parameters()]
    with pytest.raises(RuntimeError, match="could not simulate.*Sequential"):
        predict_peak(model, torch.randn(2, 8), FORCE)
    assert [id(p) for p in model.parameters()] == params
    assert not any(_torch_compat.fake_tensor_tools()[0](p) for p in model.parameters())
    assert hook_count(model) == 0
    model(torch.randn(2, 8)).sum().backward()  # still an ordinary model


def test_predictions_are_deterministic_and_sum_up():
    model, x, loss_fn = _case("gpt2")
    first = predict_peak(model, x, FORCE, loss_fn=loss_fn)
    with PredictionSession(model, x, loss_fn=loss_fn) as session:
        second = session.predict(FORCE)
    assert first == second
    for breakdown in (first.unoptimized, first.optimized):
        parts = sum(getattr(breakdown, c) for c in predictor.CATEGORIES)
        assert parts == breakdown.peak_bytes
        assert breakdown.phase in predictor.PHASES
    assert first.optimized.activations < first.unoptimized.activations
    text = str(first)
    for word in ("unoptimized", "memscale plan", "optimizer state", "peak", "fits"):
        assert word in text
    data = first.to_dict()
    json.dumps(data)
    assert data["optimized"]["peak_bytes"] == first.optimized.peak_bytes
    assert data["fits"] is True and data["checkpointed_layers"]


def test_fits_follows_the_budget():
    model, x, loss_fn = _case("mlp")
    with PredictionSession(model, x, loss_fn=loss_fn) as session:
        full = session.predict(FORCE)
        between = (full.unoptimized.peak_bytes + full.optimized.peak_bytes) // 2
        tight = session.predict(FORCE.replace(memory_budget_gb=between / 2**30))
        tiny = session.predict(FORCE.replace(memory_budget_gb=1e-6))
    assert full.fits_unoptimized and full.fits
    assert not tight.fits_unoptimized and tight.fits
    assert not tiny.fits_unoptimized and not tiny.fits
    with pytest.raises(RuntimeError, match="inside"):
        session.predict(FORCE)


def test_optimizers_are_simulated_as_given():
    model, x, loss_fn = _case("mlp")
    params = sum(p.numel() * 4 for p in model.parameters())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    prediction = predict_peak(model, x, QUIET, sgd, loss_fn=loss_fn)
    assert prediction.optimizer == "SGD" and prediction.optimizer_simulated
    assert prediction.unoptimized.optimizer_state == 0
    measured = measure_step(model, x, None, sgd, loss_fn=loss_fn).peak_bytes
    assert abs(prediction.unoptimized.peak_bytes - measured) <= TOLERANCE * measured
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prediction = predict_peak(model, x, QUIET, momentum, loss_fn=loss_fn)
    assert prediction.unoptimized.optimizer_state == params
    adamw = predict_peak(model, x, QUIET, loss_fn=loss_fn)
    assert adamw.optimizer == "AdamW"
    assert adamw.unoptimized.optimizer_state >= 2 * params

    class NeedsMore(torch.optim.Adam):
        def __init__(self, params, extra, lr=1e-3):
            super().__init__(params, lr=lr)

    odd = NeedsMore(model.parameters(), extra=1)
    prediction = predict_peak(model, x, QUIET, odd, loss_fn=loss_fn)
    assert not prediction.optimizer_simulated
    assert prediction.unoptimized.optimizer_state == 2 * params


def test_the_default_loss():
    model = mlp(depth=2, width=8)
    out = model(torch.randn(3, 8))
    loss = predictor.default_loss(out)
    assert loss.dim() == 0 and loss.requires_grad
    assert predictor.default_loss({"loss": loss, "logits": out}) is loss
    with pytest.raises(ValueError, match="loss_fn"):
        predictor.default_loss(out.detach())


def test_a_cuda_target_counts_the_caching_allocators_blocks():
    # CUDA's caching allocator gives every request a block of a multiple of
    # 512 bytes and torch.cuda.max_memory_allocated counts the block: a
    # tensor of 20 bytes takes 512 there.  This model's tensors are all
    # under 512 bytes.
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    x = torch.randn(7, 3)
    cpu = predict_peak(model, x, device="cpu").unoptimized
    cuda = predict_peak(model, x, device=DeviceSpec("cuda", capacity_bytes=1 << 30)).unoptimized
    assert cpu.parameters == 4 * (15 + 5 + 5 + 1)
    assert cuda.parameters == cuda.gradients == 4 * 512
    assert cuda.inputs == 512
    for b in (cuda.peak_bytes, cuda.activations, cuda.workspace, cuda.optimizer_state):
        assert b % 512 == 0
    assert cuda.peak_bytes > 4 * cpu.peak_bytes
    # The first step after wrap too.
    first = predict_peak(model, x, FORCE, device=DeviceSpec("cuda", capacity_bytes=1 << 30))
    assert first.first_step.peak_bytes % 512 == 0 and first.first_step.parameters == 4 * 512


def test_arguments_are_checked():
    model, x, _ = _case("mlp")
    with pytest.raises(ValueError, match="sample_input"):
        predict_peak(model, None)
    with pytest.raises(TypeError, match="nn.Module"):
        predict_peak("model", x)
    with pytest.raises(TypeError, match="config"):
        predict_peak(model, x, config={"mode": "balanced"})
    with pytest.raises(TypeError, match="optimizer"):
        predict_peak(model, x, optimizer="adam")
    with pytest.raises(TypeError, match="loss_fn"):
        predict_peak(model, x, loss_fn=3)
    with pytest.raises(TypeError, match="device"):
        predict_peak(model, x, device=3.5)
    with pytest.raises(ValueError, match="capacity_bytes"):
        DeviceSpec("cuda", capacity_bytes=0)
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        DeviceSpec("tpu", capacity_bytes=1 << 30)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="DeviceSpec"):
            predict_peak(model, x, device="cuda")
    with torch.device("meta"):
        meta = mlp(depth=2, width=8)
    with pytest.raises(ValueError, match="meta device.*DeviceSpec"):
        predict_peak(meta, torch.randn(2, 8))
    memscale.wrap(model, FORCE, sample_input=x)
    try:
        with pytest.raises(RuntimeError, match="detach"):
            predict_peak(model, x)
    finally:
        memscale.detach(model)


def test_a_device_description_as_a_dict():
    model, x, loss_fn = _case("mlp")
    prediction = predict_peak(
        model, x, QUIET, loss_fn=loss_fn, device={"type": "cpu", "capacity_bytes": 1 << 30}
    )
    assert prediction.capacity_bytes == 1 << 30 and prediction.simulated_on == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_a_cuda_target_without_cuda_is_simulated_with_cpu_kernels():
    model, x, loss_fn = _case("mlp")
    spec = DeviceSpec("cuda", capacity_bytes=24 << 30)
    prediction = predict_peak(model, x, QUIET, loss_fn=loss_fn, device=spec)
    assert prediction.device == "cuda" and prediction.simulated_on == "cpu"
    assert "simulated with cpu kernels" in str(prediction)
    # torch picks the foreach AdamW on CUDA: its temporaries span every
    # parameter at once, so the optimizer step weighs more than on a CPU.
    cpu = predict_peak(model, x, QUIET, loss_fn=loss_fn)
    assert prediction.unoptimized.peak_bytes >= cpu.unoptimized.peak_bytes


def test_estimate_savings():
    model, x, loss_fn = _case("mlp")
    with pytest.raises(ValueError, match="sample_input"):
        memscale.estimate_savings(model)
    estimate = memscale.estimate_savings(model, x, FORCE, loss_fn=loss_fn)
    prediction = predict_peak(model, x, FORCE, loss_fn=loss_fn)
    assert estimate.peak_unoptimized_bytes == prediction.unoptimized.peak_bytes
    assert estimate.peak_optimized_bytes == prediction.optimized.peak_bytes
    assert (
        estimate.saved_bytes
        == (estimate.peak_unoptimized_bytes - estimate.peak_optimized_bytes)
        > 0
    )
    assert estimate.time_ratio == pytest.approx(1 + estimate.recompute_ratio / 3)
    assert 0 < estimate.recompute_ratio <= 1
    assert estimate.checkpointed_layers == estimate.layer_count == 4
    text = str(estimate)
    assert "unoptimized" in text and "saved" in text and "x1." in text
    assert estimate.to_dict()["saved_bytes"] == estimate.saved_bytes


def test_without_dispatch_modes_the_predictor_says_why(monkeypatch):
    monkeypatch.setattr(_torch_compat, "dispatch_mode_base", lambda: None)
    model, x, loss_fn = _case("mlp")
    with pytest.raises(RuntimeError, match="TorchDispatchMode"):
        predict_peak(model, x, FORCE, loss_fn=loss_fn)
    assert hook_count(model) == 0
    memscale.wrap(model, FORCE, sample_input=x)  # wrap does not need it
    memscale.detach(model)


@pytest.mark.parametrize("missing", ["fake_tensor_mode", "module_tensor_tables"])
def test_without_fake_tensors_the_predictor_says_why(monkeypatch, missing):
    monkeypatch.setattr(_torch_compat, missing, lambda *a, **k: None)
    model, x, loss_fn = _case("mlp")
    params = [id(p) for p in model.parameters()]
    with pytest.raises(RuntimeError, match="could not simulate.*(fake tensors|tables)"):
        predict_peak(model, x, FORCE, loss_fn=loss_fn)
    assert [id(p) for p in model.parameters()] == params
    assert hook_count(model) == 0


def test_without_fake_tensor_tools_every_operator_runs_fake(monkeypatch):
    model, x, loss_fn = _case("mlp")
    exact = predict_peak(model, x, FORCE, loss_fn=loss_fn)
    monkeypatch.setattr(_torch_compat, "fake_tensor_tools", lambda: None)
    _workspace._PROBED.clear()
    fallback = predict_peak(model, x, FORCE, loss_fn=loss_fn)
    # No kernel is probed (mse_loss's buffer is missed) and nothing else
    # changes for a model that does not branch on values.
    assert fallback.unoptimized.peak_bytes <= exact.unoptimized.peak_bytes
    assert fallback.unoptimized.peak_bytes >= 0.97 * exact.unoptimized.peak_bytes


def test_a_running_profiler_skips_the_kernel_probes():
    model, x, _ = _case("cnn")
    _workspace._PROBED.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        prediction = predict_peak(model, x, FORCE)
    assert prediction.unprobed_calls > 0
    probed = predict_peak(model, x, FORCE)
    assert probed.unprobed_calls == 0
    assert probed.unoptimized.peak_bytes > prediction.unoptimized.peak_bytes


def test_which_calls_a_cuda_step_probes():
    """On CUDA every aten call is probed except views and random operators
    (probing one would advance the user's generator)."""
    aten = torch.ops.aten
    for op in (aten.mm.default, aten.add.Tensor, aten.sum.dim_IntList, aten.mse_loss.default):
        assert _workspace.probe_on_device(op), op
    for op in (
        aten.view.default,
        aten.t.default,
        aten.native_dropout.default,
        aten.bernoulli_.float,
        aten.rand_like.default,
        aten._local_scalar_dense.default,
        # values decide the output, or a zero fails on the device
        aten.nonzero.default,
        aten.masked_select.default,
        aten._functional_assert_async.msg,
        aten.lu_unpack.default,
    ):
        assert not _workspace.probe_on_device(op), op
    assert not _workspace.probe_on_device(len)


def test_a_call_that_fails_on_zero_inputs_is_counted_unprobed():
    _workspace._PROBED.clear()
    zeros = torch.zeros(3, 3)
    failing = _workspace.signature(torch.ops.aten.cholesky.default, (zeros,), {})
    ok = _workspace.signature(torch.ops.aten.mse_loss.default, (zeros, zeros), {})
    state = torch.get_rng_state()
    found, unprobed = _workspace.probe_workspace({failing: 36, ok: 4}, 1 << 20)
    assert unprobed == 1 and set(found) == {ok}
    assert torch.equal(torch.get_rng_state(), state)


def test_an_in_place_call_returns_nothing_new():
    """What an in-place call returns is its input: the probe does not take
    it for a new storage (its scratch would be hidden behind it)."""
    _workspace._PROBED.clear()
    x = torch.zeros(64, 64)
    sig = _workspace.signature(torch.ops.aten.add_.Tensor, (x, x), {})
    found, unprobed = _workspace.probe_workspace({sig: 0}, 1 << 20)
    assert unprobed == 0 and found[sig].returned == (0,)


def test_the_probe_reads_the_allocator_events_of_its_device_only():
    """The profiler records every allocator's events (CUDA's too, with CPU
    activity alone): a probe of a call on one device reads that device's."""
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )
    prof.start()
    x = torch.zeros(1000)
    prof.stop()
    del x
    cpu = [e for e in _torch_compat.profiler_memory_events(prof, "cpu") if e[0] == "[memory]"]
    cuda = [e for e in _torch_compat.profiler_memory_events(prof, "cuda") if e[0] == "[memory]"]
    every = [e for e in _torch_compat.profiler_memory_events(prof) if e[0] == "[memory]"]
    assert [e[3] for e in cpu] == [4000] and cuda == [] and every == cpu


def test_the_cublas_measurement_never_breaks_a_wrap(monkeypatch, caplog):
    """Where the measurement cannot run (inference mode: no backward) or
    fails, it is left out with a log line, not raised, and not cached."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(_workspace, "_LIBRARIES", {})
    cuda0 = torch.device("cuda", 0)
    with torch.inference_mode(), caplog.at_level("INFO", logger=_workspace.__name__):
        assert _workspace.library_workspace_bytes(cuda0) == 0
    assert "inference mode" in caplog.text

    def broken(index):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(_workspace, "_measure_libraries", broken)
    with caplog.at_level("WARNING", logger=_workspace.__name__):
        assert _workspace.library_workspace_bytes(cuda0) == 0
    assert "could not be measured" in caplog.text and "out of memory" in caplog.text
    assert _workspace._LIBRARIES == {}


def test_no_library_workspace_off_cuda():
    model, x, loss_fn = _case("mlp")
    prediction = predict_peak(model, x, FORCE, loss_fn=loss_fn)
    assert prediction.library_workspace_bytes == 0
    assert _workspace.library_workspace_bytes(torch.device("cpu")) == 0
    assert prediction.to_dict()["library_workspace_bytes"] == 0


def test_the_result_type():
    model, x, loss_fn = _case("mlp")
    prediction = predict_peak(model, x, FORCE, loss_fn=loss_fn)
    assert isinstance(prediction, PeakPrediction)
    with pytest.raises(AttributeError):
        prediction.budget_bytes = 1  # frozen
    assert prediction.time_ratio == pytest.approx(1 + prediction.recompute_ratio / 3)
    assert prediction.saved_bytes == (
        prediction.unoptimized.peak_bytes - prediction.optimized.peak_bytes
    )


def test_wrap_plans_from_the_predicted_peak():
    """The engine's unoptimized peak is the predictor's, and its decision
    follows it: a budget between the two estimates is judged as predicted."""
    model = tiny_gpt2()
    model.train()
    x = token_batch()
    memscale.wrap(model, QUIET, sample_input=x)
    plan = model._memscale_executor.plan
    memscale.detach(model)
    predicted = memscale.predict_peak(model, x, QUIET).unoptimized.peak_bytes
    assert plan.peak_unoptimized_bytes == predicted
    engine_alone = predicted - plan.peak_offset_bytes
    # The engine's own estimate of this step is above the prediction.
    assert 0 < predicted < engine_alone
    # A budget between the two: the prediction decides, and it fits, so the
    # plan smart-skips where the engine's own estimate would have planned.
    budget = (predicted + engine_alone) // 2
    config = QUIET.replace(memory_budget_gb=budget / (1 << 30))
    memscale.wrap(model, config, sample_input=x)
    plan = model._memscale_executor.plan
    memscale.detach(model)
    assert predicted <= plan.budget_bytes < engine_alone
    assert plan.skipped is True


def test_wrap_falls_back_to_the_engine_estimate(monkeypatch, caplog):
    import logging

    class Broken:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("cannot simulate")

    monkeypatch.setattr(_planner, "PredictionSession", Broken)
    model = mlp()
    with caplog.at_level(logging.INFO, logger="memscale"):
        memscale.wrap(model, QUIET, sample_input=torch.randn(4, 32))
    assert model._memscale_executor.plan.peak_offset_bytes == 0
    assert "could not simulate" in caplog.text
    memscale.detach(model)


@contextlib.contextmanager
def _fake_number_tracker(count: bool = True):
    """Under FakeTensorMode, a StorageTracker counting Python numbers (or
    not), entered in its forward phase and left in its end phase."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memscale.predictor._tracker import StorageTracker

    with FakeTensorMode():
        tracker = StorageTracker()
        tracker.count_numbers = count
        with tracker:
            tracker.set_phase("forward")
            yield tracker
            tracker.set_phase("end")


@pytest.mark.parametrize("count", [True, False])
def test_the_tracker_counts_the_python_numbers_operators_are_given(count):
    """``x * 0.5`` hands ``mul`` the number as an 8-byte CPU tensor made for
    the call, which autograd keeps until the multiplication's backward has
    run; ``x + 1.0``'s is freed when the call returns; a backward formula's
    own numbers are the kept ones (nothing new).  A step on an accelerator
    (``count_numbers`` off) counts none: they are host tensors there."""
    with _fake_number_tracker(count) as tracker:
        x = torch.empty(4, requires_grad=True)
        y = x * 0.5  # kept
        z = y + 1.0  # freed at once
        del y
        loss = z.sum()
        del z
        after_forward = len(tracker.events)
        tracker.set_phase("backward")
        loss.backward()
    numbers = [
        (i, serial, delta) for i, (serial, delta) in enumerate(tracker.events) if abs(delta) == 8
    ]
    if not count:
        assert numbers == []
        return
    births = [(i, serial) for i, serial, delta in numbers if delta > 0]
    frees = {serial: i for i, serial, delta in numbers if delta < 0}
    assert len(births) == 2 and len(frees) == 2  # none made in backward
    (kept_at, kept), (added_at, added) = births
    assert kept_at < added_at < after_forward
    assert frees[added] < after_forward  # the addition's, freed in forward
    assert frees[kept] >= after_forward  # the multiplication's, in backward


def test_a_numbers_cast_follows_the_tensors_dtype_and_the_default_dtype():
    """The CPU kernel casts a wrapped float to the dtype it computes in: 4
    bytes for a float32 tensor or an integer one under the float32 default,
    none for an integer tensor under the float64 default (the number is
    already a float64).  The tracker remembers the cast per tensor dtype,
    number type and default dtype; a change of default is not served from
    the earlier answer."""
    before = torch.get_default_dtype()
    try:
        with _fake_number_tracker() as tracker:
            ints = torch.empty(4, dtype=torch.int64)
            floats = torch.empty(4)
            seen = []
            for tensor, default in (
                (floats, torch.float32),
                (ints, torch.float32),
                (ints, torch.float64),
                (ints, torch.float32),
            ):
                torch.set_default_dtype(default)
                start = len(tracker.events)
                _ = tensor * 0.5
                seen.append(sum(1 for _, delta in tracker.events[start:] if delta == 4))
    finally:
        torch.set_default_dtype(before)
    assert seen == [1, 1, 0, 1]


_VIEW_NUMBERS = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from memscale.predictor._tracker import StorageTracker

with FakeTensorMode():
    x = torch.empty(1000, requires_grad=True)
    tracker = StorageTracker()
    tracker.count_numbers = True
    with tracker:
        tracker.set_phase("forward")
        y = x * 1.0
        for view in (y[:500], y.view(10, 100)):
            view.mul_(0.5)
            view.div_(2)
        loss = y.sum()
        del y, view
        tracker.set_phase("backward")
        loss.backward()
        tracker.set_phase("end")
backward_at = next(i for i, phase in tracker.phase_marks if phase == "backward")
kept = {s for s, d in tracker.events if d == 8}
freed = {s for s, d in tracker.events[backward_at:] if d == -8}
print(len(kept), freed == kept)
"""


def test_a_number_kept_by_an_in_place_operator_on_a_view():
    """``y[:500].mul_(0.5)`` with ``y`` needing a gradient: the number is
    kept by the multiplication, whose node is in the base's history
    (CopySlices); the tracker ties it there without reading the view's
    ``grad_fn``, which autograd rebuilds under a lock while it calls an
    operator (reading it there hung the simulation: run in a process of
    its own, with a time limit).  All five numbers (``x * 1.0``'s and
    the four in-place operators') are freed in backward."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-c", _VIEW_NUMBERS],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["5", "True"]


def test_wrap_counts_the_loss_it_is_given():
    """``wrap(..., loss_fn=)``: the simulated steps run the training's own
    loss instead of the default stand-in (the mean of squares).  The
    benchmark MLP's loss is an MSE against a target, whose step peaks 1 MiB
    above the stand-in's; CONSERVATIVE at start + half its activations then
    planned a step 0.47 MiB over the budget.  Given the loss, the step
    fits, at the plan's prediction within 0.1% (to the byte here).  A loss_fn that
    is not callable is refused, naming it."""
    from conftest import adamw_step_peak

    from memscale.benchmarks.models import BENCHMARK_MODELS

    entry = BENCHMARK_MODELS["mlp"]

    def loss_of(batch):
        return lambda model, _: batch.loss_fn(model(*batch.args, **batch.kwargs))

    model, batch = entry.build(seed=0)
    tensors = (batch.args, batch.kwargs)
    unoptimized = adamw_step_peak(model, tensors, loss_of(batch), report=True)
    budget = unoptimized.start_bytes + unoptimized.peak_delta_bytes // 2
    config = memscale.Config(
        mode="conservative", memory_budget_gb=budget / 2**30, enable_logging=False
    )
    model, batch = entry.build(seed=0)
    memscale.wrap(model, config, sample_input=batch.sample_input, loss_fn=batch.loss_fn)
    try:
        plan = model._memscale_executor.plan
        assert plan.technique_counts["checkpoint"]
        peak = adamw_step_peak(model, (batch.args, batch.kwargs), loss_of(batch))
        assert peak <= budget
        assert abs(peak - plan.peak_projected_bytes) <= plan.peak_projected_bytes / 1000
    finally:
        memscale.detach(model)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        memscale.wrap(entry.build(seed=0)[0], config, batch.sample_input, loss_fn="mse")


def test_lbfgs_state_is_estimated_as_its_full_history_holds_it():
    """L-BFGS's step needs a closure, which a simulated step cannot give:
    its state is estimated, as what it holds once its history is full
    (two flat tensors per entry, the direction and the last gradient),
    and that is what a real L-BFGS holds after a few steps (its lists
    counted too); wrap plans with it."""
    from memscale import _model

    torch.manual_seed(0)
    model = mlp(depth=3, width=32)
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    p = predict_peak(
        model, x, QUIET, optimizer=torch.optim.LBFGS(model.parameters(), history_size=10)
    )
    assert not p.optimizer_simulated and p.optimizer == "LBFGS"
    opt = torch.optim.LBFGS(model.parameters(), history_size=10)
    for _ in range(5):

        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
    assert len(opt.state[opt._params[0]]["old_dirs"]) == 10
    held = _model.optimizer_state_bytes(model, opt)
    assert held == 22 * sum(q.numel() * 4 for q in model.parameters())
    assert p.unoptimized.optimizer_state == held
    memscale.wrap(model, FORCE, sample_input=x, optimizer=opt)
    assert model._memscale_executor.plan.technique_counts["checkpoint"]
    memscale.detach(model)


def _canonical(trace):
    """A step's trace with its serials numbered by their first event (the
    first step made steady numbers the gradients and state it starts with
    after its own): events, sizes, categories as the step ends with them,
    kernel calls and marks."""
    tracker = trace.tracker
    order = {}
    for serial, _ in tracker.events:
        order.setdefault(serial, len(order))
    return (
        [(order[s], delta) for s, delta in tracker.events],
        [tracker.sizes_at_birth[s] for s in order],
        [trace.recategorize.get(s, tracker.categories[s]) for s in order],
        [
            (at, sig, tuple(None if s is None else order.get(s, -1) for s in got))
            for at, sig, got in tracker.kernel_calls or ()
        ],
        tracker.phase_marks,
        [(at, type(m).__name__) for at, m in tracker.forward_marks],
    )


def _first_and_steady(model, x, loss_fn, optimizer, merged, device=None):
    """The profile, the unoptimized step (canonical), its peak and
    breakdown, the forced plan's hash and simulated peak, and how many
    times the model's forward ran, with the warm-up and the unoptimized
    step in one (``merged``) or apart."""
    from memscale.predictor._session import _Simulation

    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    merges = _Simulation._merges
    try:
        if not merged:
            _Simulation._merges = lambda self: False
        with PredictionSession(model, x, optimizer, loss_fn=loss_fn, device=device) as session:
            forwards = len(calls)
            steps = session._steps
            plan = session.plan(FORCE)
            return (
                session.profile,
                _canonical(steps._unoptimized),
                session.unoptimized_peak(),
                steps._breakdown(steps._unoptimized),
                plan.hash,
                steps.simulated_peak(plan, FORCE),
                steps._sim.step.optimizer_steps,
            ), forwards
    finally:
        _Simulation._merges = merges
        handle.remove()


@pytest.mark.parametrize("target", ["cpu", "cuda"])
@pytest.mark.parametrize(
    "name", ["mlp", "cnn", "gpt2", "llama", "frozen-first", "reversed", "first-call"]
)
def test_the_first_step_made_steady_is_the_steady_step_simulated(name, target):
    """With AdamW, the warm-up and the unoptimized step are one tracked
    step (one forward of the model): the steady step made from it, with
    the gradients and the state it starts with and the recorded update,
    is the one simulated apart, event for event (serials aside); the
    profile, the peaks and the plan are the same.  Also for a CUDA target
    simulated on the CPU (foreach AdamW, storages in the allocator's
    blocks).  The CNN's batch norm and frozen-first's linear under
    inference mode reach the modes whole: the profiler counts them by
    their decompositions, run apart, and the step runs them whole.
    "reversed": an optimizer holding the parameters last first (its
    zero_grad frees the gradients in that order); "first-call": the
    forward's first call is a conv kernel's that makes nothing (its
    scratch counted after zero_grad's frees)."""
    device = DeviceSpec("cuda", capacity_bytes=1 << 30) if target == "cuda" else None

    def case():
        if name == "frozen-first":
            return (*_frozen_first(), None)
        if name == "reversed":
            model, x, loss_fn = _case("mlp")
            return model, x, loss_fn, torch.optim.AdamW(list(model.parameters())[::-1])
        if name == "first-call":
            torch.manual_seed(0)
            return _FirstCall(), torch.randn(2, 3, 8, 8), lambda out: out, None
        return (*_case(name), None)

    merged, once = _first_and_steady(*case(), merged=True, device=device)
    apart, twice = _first_and_steady(*case(), merged=False, device=device)
    assert merged == apart
    assert (once, twice) == (1, 2)


class _BuildsOnce(nn.Module):
    """A layer that makes a table at its first forward and keeps it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.table = None

    def forward(self, x):
        if self.table is None:
            self.table = torch.ones(64, 32) * 2
        return torch.relu(self.fc(x)) * self.table


def _builds_once():
    torch.manual_seed(0)
    return nn.Sequential(_BuildsOnce(), nn.Linear(32, 32)), torch.randn(64, 32), None


class _OneHot(nn.Module):
    """Token ids made one-hot under inference mode (``aten.one_hot``
    reaches the modes whole there, on the ids, real small values)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 32)

    def forward(self, ids):
        with torch.inference_mode():
            hot = nn.functional.one_hot(ids, 8).float()
        return self.fc(hot.clone())


def _one_hot():
    torch.manual_seed(0)
    return _OneHot(), torch.randint(0, 8, (64,)), None


class _SetUpOnce(nn.Module):
    """Scales its input by statistics of its first batch, worked out with
    a large temporary at its first forward only (a flag, no tensor, says
    it is done: Glow's ActNorm)."""

    def __init__(self, in_a_dict=False):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(32))
        self.fc = nn.Linear(32, 32)
        self.flags = {"ready": False} if in_a_dict else None  # changed in place
        self.ready = False

    def forward(self, x):
        ready = self.flags["ready"] if self.flags is not None else self.ready
        if not ready:
            with torch.no_grad():
                big = x.unsqueeze(0).expand(16, -1, -1).contiguous()
                self.loc.copy_(-big.mean((0, 1)))
            if self.flags is not None:
                self.flags["ready"] = True
            else:
                self.ready = True
        return self.fc(x + self.loc)


class _FirstCall(nn.Module):
    """A conv whose first call in forward returns nothing (a workspace
    kernel's call at the very start of the forward)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        self.c(x[:0])
        return self.c(x).pow(2).mean()


def _partly_optimized():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    optimizer = torch.optim.AdamW(model[1].parameters())
    return model, torch.randn(64, 32), None, optimizer


def test_the_module_state_compares_numbers_and_strings_by_value():
    """A number or string rebound to an equal one (of a subclass too, as
    numpy's float64 or an IntEnum) is the same state; another value, a
    rebound tensor, or a dict changed in place is not."""
    import enum

    from memscale.predictor import _step

    class Scale(float):
        pass

    class Kind(enum.IntEnum):
        A = 1
        B = 2

    m = nn.Linear(2, 2)
    m.scale, m.kind, m.name, m.flags = Scale(0.5), Kind.A, "a", {"ready": 1}
    before = _step._module_state(m)
    m.scale, m.name = Scale(0.5), "".join(["a"])
    assert _step._same_module_state(before)
    for change in (
        lambda: setattr(m, "scale", Scale(0.25)),
        lambda: setattr(m, "kind", Kind.B),
        lambda: setattr(m, "name", "b"),
        lambda: m.flags.update(ready=2),
        lambda: setattr(m, "weight", nn.Parameter(m.weight.detach().clone())),
    ):
        m.scale, m.kind, m.name, m.flags["ready"] = Scale(0.5), Kind.A, "a", 1
        assert _step._same_module_state(before)
        change()
        assert not _step._same_module_state(before)


@pytest.mark.parametrize(
    "case", ["builds-once", "partly-optimized", "one-hot", "set-up-once", "set-up-once-in-a-dict"]
)
def test_a_first_step_that_is_not_steady_is_simulated_apart(case):
    """Where the first step is not a steady one but for the gradients and
    the state (a layer keeps a table it made at its first forward; a
    parameter gets a gradient the optimizer never frees; a call on real
    values runs as its decomposition under the profiler, its pieces
    tracked; a layer sets itself up at its first forward, with a flag),
    the steady step is simulated after it (two forwards), the same as
    with the warm-up apart."""

    def make():
        if case == "builds-once":
            return (*_builds_once(), None)
        if case == "partly-optimized":
            return _partly_optimized()
        if case.startswith("set-up-once"):
            torch.manual_seed(0)
            model = _SetUpOnce(in_a_dict=case.endswith("dict"))
            return model, torch.randn(64, 32), None, None
        return (*_one_hot(), None)

    merged, forwards = _first_and_steady(*make(), merged=True)
    apart, _ = _first_and_steady(*make(), merged=False)
    assert forwards == 2
    assert merged == apart


def _state_of(optimizer):
    """Each parameter's state: keys, layouts, fake or real, and the step
    counters' values (read past the fake mode)."""
    out = []
    with torch._C._DisableTorchDispatch():
        for state in optimizer.state.values():
            out.append(
                [
                    (
                        k,
                        (tuple(v.shape), v.stride(), v.dtype, str(v.device), type(v).__name__)
                        + ((float(v),) if type(v) is torch.Tensor else ()),
                    )
                    if isinstance(v, torch.Tensor)
                    else (k, v)
                    for k, v in state.items()
                ]
            )
    return out


def _deep_chain(depth=40):
    torch.manual_seed(0)
    blocks = []
    for i in range(depth):
        blocks += [nn.Linear(16, 16 if i % 3 else 24), nn.Linear(16 if i % 3 else 24, 16)]
        blocks.append(nn.LayerNorm(16))
    return nn.Sequential(*blocks), torch.randn(64, 16), None


def _update_groups(model, **settings):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    other = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay}, {"params": other, "weight_decay": 0.0, **settings}]


_UPDATES = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters()),
    "adam": lambda m: torch.optim.Adam(m.parameters(), weight_decay=0.01),
    "amsgrad": lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True),
    "maximize": lambda m: torch.optim.AdamW(m.parameters(), maximize=True, weight_decay=0),
    "groups": lambda m: torch.optim.AdamW(_update_groups(m, lr=1e-4)),
    "cuda-for-loop": lambda m: torch.optim.AdamW(m.parameters(), foreach=False),
    # a group no parameter of which gets a gradient
    "idle-group": lambda m: torch.optim.AdamW(
        [{"params": list(m.parameters())}, {"params": [nn.Parameter(torch.zeros(3))], "lr": 0}]
    ),
}


@pytest.mark.parametrize("model", ["chain", "gpt2"])
@pytest.mark.parametrize("update", sorted(_UPDATES))
def test_the_update_recorded_from_a_few_parameters_is_the_whole_update(model, update):
    """torch's one-parameter-at-a-time Adam loop, run over a few of a deep
    model's parameters and spliced (memscale/predictor/_update.py): the
    steady update's events and every parameter's state are those of the
    whole first update, run over every parameter; so are the unoptimized
    step and its peak, and a step that runs the optimizer again on that
    state (and the state after it).  AdamW and Adam, amsgrad, maximize, two groups, and
    a CUDA target (for-loop AdamW there, storages in the allocator's
    blocks)."""
    from memscale.predictor import _update

    device = DeviceSpec("cuda", capacity_bytes=1 << 30) if update == "cuda-for-loop" else None
    used = []
    recorded = _update.recorded_update

    def spy(*args, **kwargs):
        out = recorded(*args, **kwargs)
        used.append(out is not None)
        return out

    def run(reduce):
        if model == "chain":
            m, x, loss_fn = _deep_chain()
        else:
            m, x, loss_fn = _case("gpt2")
        with contextlib.ExitStack() as stack:
            mp = stack.enter_context(pytest.MonkeyPatch.context())
            mp.setattr(_update, "recorded_update", spy if reduce else lambda *a, **k: None)
            session = stack.enter_context(
                PredictionSession(m, x, _UPDATES[update](m), loss_fn=loss_fn, device=device)
            )
            steps = session._steps
            step = steps._sim.step
            replay = step.optimizer_replay
            state = _state_of(step.optimizer)
            # A step under a plan with the optimizer run again, on the
            # state the first update left (copies, where spliced).
            plan = session.plan(FORCE)
            step.optimizer_replay, step.replays_optimizer = None, False
            again = steps._sim.under(plan, FORCE, steps.hardware)
            return (
                replay,
                state,
                _canonical(steps._unoptimized),
                session.unoptimized_peak(),
                _canonical(again),
                _state_of(step.optimizer),
            )

    reduced = run(True)
    assert used == [True]
    assert reduced == run(False)
    assert reduced[0].events


def test_an_update_the_splice_does_not_know_runs_whole():
    """Only torch's own Adam and AdamW, each group's loop one parameter at
    a time, with number settings, are recorded from a few parameters."""
    from memscale.predictor._update import supported

    params = [nn.Parameter(torch.zeros(2))]
    assert supported(torch.optim.AdamW(params, foreach=False))
    assert not supported(torch.optim.AdamW(params, foreach=True))
    assert not supported(torch.optim.AdamW(params))  # foreach unset: torch decides
    assert not supported(torch.optim.AdamW(params, foreach=False, capturable=True))
    assert not supported(torch.optim.Adam(params, foreach=False, lr=torch.tensor(0.1)))
    assert not supported(torch.optim.SGD(params, lr=0.1, foreach=False))

    class Mine(torch.optim.AdamW):
        pass

    assert not supported(Mine(params, foreach=False))
    with pytest.warns(UserWarning):  # torch steps a parameter given twice twice
        assert not supported(torch.optim.AdamW(params + params, foreach=False))
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(lambda *_: None)
    try:  # it would run over the few parameters only
        assert not supported(torch.optim.AdamW(params, foreach=False))
    finally:
        handle.remove()
    assert supported(torch.optim.AdamW(params, foreach=False))


def test_an_update_with_a_zero_byte_parameter_runs_whole():
    """A parameter of no elements is a storage without events: the
    update runs whole (the same recording, serial for serial)."""
    from memscale.predictor import _update

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(20)])
    model.register_parameter("empty", nn.Parameter(torch.zeros(0)))
    got = []
    recorded = _update.recorded_update

    def spy(*args, **kwargs):
        got.append(recorded(*args, **kwargs))
        return got[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_update, "recorded_update", spy)
        model.empty.grad = None

        class _Uses(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = model

            def forward(self, x):
                return self.inner(x).sum() + self.inner.empty.sum()

        with PredictionSession(_Uses(), torch.randn(8, 16), loss_fn=lambda out: out) as session:
            assert session._steps._sim.step.optimizer_replay is not None
    assert got == [None]
