"""The AutoTuner: tune() and max_batch_size() (CPU, about 30 s).

Budgets are set between predicted peaks of the model, so that the answer
is known: e.g. the CNN's decision engine underestimates its step (the
convolutions' scratch memory is not in its memory model) and smart-skips
it, so the tuner has to give the engine a smaller budget to get a plan
that fits.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch
from conftest import CNN, hook_count, mlp

import memscale
from memscale._planner import PredictionSession
from memscale.autotuning import AutoTuner, NoConfigFits, measure_step, tuner

FORCE = memscale.Config(force_optimize=True, enable_logging=False)
QUIET = memscale.Config(enable_logging=False)


def cnn_case():
    model = CNN()
    model.train()
    return model, torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(4))


def peaks(model, x):
    with PredictionSession(model, x) as session:
        full = session.predict(FORCE)
    return full.unoptimized.peak_bytes, full.optimized.peak_bytes


def test_tune_finds_the_cheapest_plan_that_fits_and_confirms_it():
    model, x = cnn_case()
    unopt, all_layers = peaks(model, x)
    budget = (unopt + all_layers) // 2
    result = AutoTuner(model, x, budget_bytes=budget).tune()
    assert result.confirmed and result.measured_peak_bytes <= budget
    assert result.prediction.optimized.peak_bytes <= budget
    chosen = result.prediction.checkpointed_layers
    assert 0 < len(chosen) < result.prediction.layer_count
    # The engine's own estimate of this model is too low (it would
    # smart-skip), but it plans from the predicted peak: the tuner needs no
    # smaller budget than the real one.
    assert round(result.config.memory_budget_gb * 2**30) == budget
    assert not result.config.force_optimize
    # Checkpointing everything also fits, but recomputes more: a runner-up.
    assert any(
        c.status == "runner-up" and c.predicted_time_ratio > result.prediction.time_ratio
        for c in result.runner_ups
    )
    # Fed the predicted peak, the engine's own plans fit here: no candidate
    # is predicted over budget (before, the engine's low estimate made the
    # tuner search for a smaller engine budget).
    assert not any(c.status == "over budget (predicted)" for c in result.choices)
    assert [c.status for c in result.choices].count("chosen") == 1
    costs = [c.predicted_time_ratio for c in result.choices if c.fits]
    assert costs == sorted(costs)
    # The Config reproduces the plan, and the plan fits when measured.
    memscale.wrap(model, result.config, sample_input=x)
    try:
        assert model._memscale_executor.plan.hash == result.prediction.plan_hash
    finally:
        memscale.detach(model)
    assert measure_step(model, x, result.config).peak_bytes == result.measured_peak_bytes
    text = str(result)
    assert "chosen" in text and "runner-up" in text and "confirmed" in text
    assert result.to_dict()["config"]["memory_budget_gb"] == result.config.memory_budget_gb


def test_a_model_that_fits_is_left_alone():
    model, x = cnn_case()
    result = AutoTuner(model, x).tune()  # the host's usable memory
    assert result.prediction.checkpointed_layers == ()
    assert result.prediction.time_ratio == 1.0
    assert result.confirmed
    assert result.budget_bytes == memscale.predict_peak(model, x).budget_bytes


def test_tune_is_deterministic_and_leaves_the_model_as_it_was():
    model, x = cnn_case()
    model(x).sum().backward()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    rng, py_rng = torch.get_rng_state(), random.getstate()
    unopt, all_layers = peaks(model, x)
    budget = (unopt + all_layers) // 2
    first = AutoTuner(model, x, budget_bytes=budget).tune()
    second = AutoTuner(model, x, budget_bytes=budget).tune()
    assert first.config == second.config and first.choices == second.choices
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert torch.equal(torch.get_rng_state(), rng) and random.getstate() == py_rng
    assert hook_count(model) == 0 and not hasattr(model, "_memscale_executor")


def test_nothing_fits():
    model, x = cnn_case()
    with pytest.raises(NoConfigFits, match="max_batch_size") as info:
        AutoTuner(model, x, budget_bytes=1000).tune()
    assert info.value.choices
    assert all(c.status == "over budget (predicted)" for c in info.value.choices)


def test_a_trial_over_budget_passes_to_the_next_choice(monkeypatch):
    model, x = cnn_case()
    unopt, all_layers = peaks(model, x)
    budget = (unopt + all_layers) // 2
    real = tuner.measure_step
    calls = []

    def first_trial_fails(*args, **kwargs):
        report = real(*args, **kwargs)
        calls.append(report.peak_bytes)
        if len(calls) == 1:  # as if the prediction had been too low
            return type(report)(report.start_bytes, budget, report.end_delta_bytes)
        return report

    monkeypatch.setattr(tuner, "measure_step", first_trial_fails)
    result = AutoTuner(model, x, budget_bytes=budget).tune()
    assert len(calls) == 2 and result.confirmed
    statuses = [c.status for c in result.choices]
    assert statuses.count("over budget (measured)") == 1
    failed = next(c for c in result.choices if c.status == "over budget (measured)")
    assert failed.measured_peak_bytes > budget
    assert result.prediction.time_ratio >= failed.predicted_time_ratio


def test_max_batch_size_is_the_largest_predicted_to_fit_and_measured():
    model = mlp(depth=4, width=32)
    make = lambda b: torch.randn(b, 32, generator=torch.Generator().manual_seed(b))  # noqa: E731
    config = FORCE
    with PredictionSession(model, make(40)) as session:
        at40 = session.predict(config).optimized.peak_bytes
    result = AutoTuner(model, make(1), budget_bytes=at40).max_batch_size(
        make, config, low=1, high=1000
    )
    assert result.batch_size == 40
    assert result.confirmed and result.measured_peak_bytes <= at40
    assert result.predicted_peak_bytes == at40
    fits = {b: ok for b, _, ok in result.predictions}
    assert fits[40] and not fits[41]
    assert all(ok == (b <= 40) for b, ok in fits.items())
    assert "largest batch 40" in str(result)
    with pytest.raises(RuntimeError, match="even batch size 50"):
        AutoTuner(model, make(1), budget_bytes=at40).max_batch_size(make, config, low=50)


def test_arguments_are_checked():
    model, x = cnn_case()
    with pytest.raises(ValueError, match="budget_bytes"):
        AutoTuner(model, x, budget_bytes=0)
    with pytest.raises(ValueError, match="sample_input"):
        AutoTuner(model, None)
    with pytest.raises(TypeError, match="nn.Module"):
        AutoTuner("model", x)
    tuner_ = AutoTuner(model, x, budget_bytes=1 << 30)
    with pytest.raises(ValueError, match="max_trials"):
        tuner_.tune(max_trials=0)
    with pytest.raises(TypeError, match="make_input"):
        tuner_.max_batch_size(3)
    with pytest.raises(ValueError, match="high"):
        tuner_.max_batch_size(lambda b: x, low=4, high=2)
    memscale.wrap(model, FORCE, sample_input=x)
    try:
        with pytest.raises(RuntimeError, match="detach"):
            AutoTuner(model, x)
    finally:
        memscale.detach(model)


def test_the_progress_bar_shows_only_on_a_terminal(monkeypatch):
    assert isinstance(tuner._progress(3, "x"), tuner._NoBar)  # captured stderr
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    bar = tuner._progress(3, "memscale trials")
    try:
        assert not isinstance(bar, tuner._NoBar)
        bar.update(1)
    finally:
        bar.close()
