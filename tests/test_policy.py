"""Stage 1 (memscale.policy, policy.select_strategy): sources, fallbacks, the
shipped artifact, and the GPU branch on a CPU host through an injected
hardware description."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from conftest import hook_count, mlp

import memscale
from memscale import _core, _model, _planning, policy
from memscale.policy import (
    FEATURES,
    STRATEGIES,
    PolicyFallbackNeeded,
    RulePolicy,
    StrategyContext,
    StrategyDecision,
    TrainedPolicy,
)

GIB = 1 << 30


def gpu(capacity: int, count: int = 1) -> dict:
    return {
        "device": "cuda",
        "index": 0,
        "count": count,
        "capacity_bytes": int(capacity),
        "bf16": True,
        "name": "injected GPU",
    }


@pytest.fixture(scope="module")
def profiled():
    model = mlp()
    units = _core.find_units(model)
    config = memscale.Config()
    profile = _planning.profile_upfront(model, units, torch.randn(64, 32), config)
    return profile, _model.fixed_bytes(model, None)


def context_at(pressure: float, profiled, config=None) -> StrategyContext:
    """A profiled context on an injected GPU whose budget gives ``pressure``."""
    profile, fixed = profiled
    config = config or memscale.Config(auto_policy=True)
    probe = StrategyContext.build(config, gpu(GIB), profile, fixed)
    capacity = probe.peak_unoptimized_bytes / pressure / config.target_gpu_utilization
    return StrategyContext.build(config, gpu(capacity + 1), profile, fixed)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("MEMSCALE_POLICY", raising=False)
    monkeypatch.delenv("MEMSCALE_POLICY_ARTIFACT", raising=False)


# ---- select_strategy -----------------------------------------------------


def test_auto_policy_off_uses_config_bit_for_bit(profiled):
    config = memscale.Config(mode="aggressive", memory_budget_gb=3.0)
    decision, effective = policy.select_strategy(config, context_at(2.0, profiled, config))
    assert effective is config
    assert decision.decision_source == "user_config"
    assert decision.strategy == "as_configured"
    assert decision.mode is memscale.OptimizationMode.AGGRESSIVE
    assert "auto_policy=False" in decision.reason


def test_auto_policy_on_cpu_host_uses_config(profiled):
    profile, fixed = profiled
    config = memscale.Config(auto_policy=True)
    context = StrategyContext.build(config, _core.detect_hardware("cpu"), profile, fixed)
    decision, effective = policy.select_strategy(config, context)
    assert effective is config
    assert decision.decision_source == "user_config"
    assert "host cpu" in decision.reason


def test_gpu_uses_trained_policy(profiled):
    config = memscale.Config(auto_policy=True)
    before = config.to_dict()
    for pressure in (0.7, 1.2, 2.5):
        decision, effective = policy.select_strategy(config, context_at(pressure, profiled))
        assert decision.decision_source == "ml"
        assert decision.policy.startswith("strategy-tree ")
        assert decision.strategy in STRATEGIES
        assert decision.reason.startswith("tree: ")
        assert effective is not config
        assert effective.mode is STRATEGIES[decision.strategy].mode
        assert effective.auto_policy and effective.warmup_steps == config.warmup_steps
    assert config.to_dict() == before


def test_missing_artifact_falls_back_to_rules(profiled, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("MEMSCALE_POLICY_ARTIFACT", str(tmp_path / "absent.json"))
    config = memscale.Config(auto_policy=True)
    with caplog.at_level(logging.INFO, logger="memscale"):
        decision, effective = policy.select_strategy(config, context_at(1.2, profiled))
    assert decision.decision_source == "rule_fallback"
    assert decision.strategy == "balanced"  # the rule for pressure 1.2
    assert decision.policy == "rules"
    assert "trained policy unavailable" in decision.reason
    assert "absent.json" in caplog.text
    assert effective.mode is memscale.OptimizationMode.BALANCED
    assert effective.target_gpu_utilization == pytest.approx(0.85 * 0.85)


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps({"format": "other/1", "features": ["pressure"], "tree": {"leaf": "balanced"}}),
        json.dumps(
            {
                "format": policy.ARTIFACT_FORMAT,
                "features": ["hostname"],
                "tree": {"leaf": "balanced"},
            }
        ),
        json.dumps(
            {"format": policy.ARTIFACT_FORMAT, "features": ["pressure"], "tree": {"leaf": "yolo"}}
        ),
        json.dumps(
            {
                "format": policy.ARTIFACT_FORMAT,
                "features": ["pressure"],
                "tree": {
                    "feature": "pressure",
                    "threshold": "1",
                    "le": {"leaf": "balanced"},
                    "gt": {"leaf": "balanced"},
                },
            }
        ),
        json.dumps(
            {
                "format": policy.ARTIFACT_FORMAT,
                "features": ["pressure"],
                "tree": {"feature": "pressure", "threshold": 1.0, "le": {"leaf": "balanced"}},
            }
        ),
    ],
)
def test_corrupt_artifact_falls_back(profiled, monkeypatch, tmp_path, content):
    path = tmp_path / "tree.json"
    path.write_text(content)
    with pytest.raises(PolicyFallbackNeeded):
        TrainedPolicy.load(path)
    monkeypatch.setenv("MEMSCALE_POLICY_ARTIFACT", str(path))
    decision, _ = policy.select_strategy(
        memscale.Config(auto_policy=True), context_at(2.0, profiled)
    )
    assert decision.decision_source == "rule_fallback"
    assert decision.strategy == "aggressive"


def test_too_deep_tree_is_rejected():
    node = {"leaf": "balanced"}
    for _ in range(40):
        node = {"feature": "pressure", "threshold": 1.0, "le": node, "gt": {"leaf": "balanced"}}
    with pytest.raises(PolicyFallbackNeeded, match="deeper"):
        TrainedPolicy({"format": policy.ARTIFACT_FORMAT, "features": ["pressure"], "tree": node})


def test_rule_policy_on_purpose(profiled, monkeypatch):
    monkeypatch.setenv("MEMSCALE_POLICY", "rule")
    decision, _ = policy.select_strategy(
        memscale.Config(auto_policy=True), context_at(0.8, profiled)
    )
    assert decision.decision_source == "rule"
    assert decision.strategy == "conservative"


def test_bad_policy_env_names_the_values(profiled, monkeypatch):
    monkeypatch.setenv("MEMSCALE_POLICY", "neural")
    with pytest.raises(ValueError, match="MEMSCALE_POLICY must be one of"):
        policy.select_strategy(memscale.Config(auto_policy=True), context_at(1.0, profiled))


def test_unprofiled_gpu_context_is_refused():
    config = memscale.Config(auto_policy=True)
    context = StrategyContext.build(config, gpu(8 * GIB))
    with pytest.raises(ValueError, match="profiled context"):
        policy.select_strategy(config, context)


# ---- the policies and the decision ---------------------------------------


@pytest.mark.parametrize(
    "pressure,expected",
    [
        (0.5, "conservative"),
        (0.99, "conservative"),
        (1.2, "balanced"),
        (1.49, "balanced"),
        (1.6, "aggressive"),
        (3.5, "aggressive"),
    ],
)
def test_rule_policy_follows_the_pressure_guidance(profiled, pressure, expected):
    strategy, reason = RulePolicy().choose(context_at(pressure, profiled))
    assert strategy == expected
    assert ("smaller batch" in reason) == (pressure > 3)


def test_context_features(profiled):
    context = context_at(1.3, profiled)
    features = context.features()
    assert list(features) == list(FEATURES)
    assert features["pressure"] == pytest.approx(1.3, rel=1e-3)
    assert 0 < features["min_pressure"] < features["pressure"]
    assert features["layer_count"] == 4
    assert 0 < features["unit_share"] <= 1
    assert context.has_gpu and context.profiled
    with pytest.raises(PolicyFallbackNeeded):
        StrategyContext.build(memscale.Config(), gpu(GIB)).features()


def test_effective_config_applies_the_strategy():
    config = memscale.Config(memory_budget_gb=10.0, auto_policy=True)
    balanced = StrategyDecision.from_strategy("balanced", config, "ml", "test", None)
    assert balanced.effective_config(config).memory_budget_gb == pytest.approx(8.5)
    aggressive = StrategyDecision.from_strategy("aggressive", config, "ml", "test", None)
    eff = aggressive.effective_config(config)
    assert eff.force_optimize and eff.mode is memscale.OptimizationMode.AGGRESSIVE
    assert aggressive.techniques == ("checkpoint", "offload", "tiling")
    assert config.memory_budget_gb == 10.0 and not config.force_optimize
    # A technique the user turned off stays off.
    off = memscale.Config(enable_checkpointing=False, enable_offloading=False)
    assert StrategyDecision.from_strategy("aggressive", off, "ml", "t", None).techniques == (
        "tiling",
    )
    with pytest.raises(ValueError, match="unknown strategy"):
        StrategyDecision.from_strategy("reckless", config, "ml", "t", None)
    with pytest.raises(ValueError, match="decision_source"):
        StrategyDecision("balanced", config.mode, (), False, 1.0, "magic", "")
    line = aggressive.describe()
    assert "decision_source=ml" in line and "mode=aggressive" in line


def test_shipped_artifact():
    trained = policy.load_trained_policy()
    assert trained is policy.load_trained_policy()  # cached
    assert set(trained.features) <= set(FEATURES)
    info = trained.training
    assert info["generated_by"].startswith("scripts/train_policy.py")
    assert set(info["held_out"]) == {"trained tree", "rule policy"}
    for row in info["held_out"].values():
        assert 0 <= row["fits_share"] <= 1 and row["mean_predicted_slowdown"] >= 1
    # Deterministic: same features, same answer.
    features = dict.fromkeys(FEATURES, 1.0)
    assert trained.predict(features) == trained.predict(dict(features))
    assert str(policy.DEFAULT_ARTIFACT).endswith("memscale/policy/artifacts/strategy_tree.json")


# ---- wrap, end to end, with the hardware injected --------------------------


@pytest.fixture
def injected_gpu(monkeypatch):
    """A 64 MiB GPU as far as memscale can tell; the model stays on the CPU."""

    def detect(device_type, index=0):
        return gpu(64 << 20)

    monkeypatch.setattr(_core, "detect_hardware", detect)


@pytest.mark.parametrize("with_sample", [True, False])
def test_wrap_on_injected_gpu_records_the_decision(injected_gpu, caplog, with_sample):
    model = mlp(width=64)
    x = torch.randn(512, 64)
    config = memscale.Config(auto_policy=True, warmup_steps=1)
    with caplog.at_level(logging.INFO, logger="memscale"):
        memscale.wrap(model, config, sample_input=x if with_sample else None)
        executor = model._memscale_executor
        if not with_sample:
            assert executor.decision is None  # decided once profiled
            model(x).sum().backward()
        model(x).sum().backward()
    decision = executor.decision
    assert decision.decision_source == "ml"
    assert executor.config is not config and executor.config.mode is decision.mode
    assert executor.plan.mode == decision.mode.value
    assert executor.plan.device == "cuda"
    assert "decision_source=ml" in caplog.text
    assert config.mode is memscale.OptimizationMode.BALANCED  # the caller's: unchanged
    memscale.detach(model)
    assert hook_count(model) == 0


def test_wrap_on_injected_gpu_without_artifact(injected_gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("MEMSCALE_POLICY_ARTIFACT", str(tmp_path / "none.json"))
    model = mlp(width=64)
    memscale.wrap(model, memscale.Config(auto_policy=True), sample_input=torch.randn(512, 64))
    assert model._memscale_executor.decision.decision_source == "rule_fallback"
    memscale.detach(model)


def test_bad_policy_env_fails_at_wrap_and_leaves_nothing(injected_gpu, monkeypatch):
    monkeypatch.setenv("MEMSCALE_POLICY", "neural")
    model = mlp()
    for sample in (torch.randn(8, 32), None):
        with pytest.raises(ValueError, match="MEMSCALE_POLICY"):
            memscale.wrap(model, memscale.Config(auto_policy=True), sample_input=sample)
        assert hook_count(model) == 0 and not hasattr(model, "_memscale_executor")


@pytest.mark.parametrize("auto_policy", [False, True])
def test_cpu_wrap_plans_exactly_as_configured(auto_policy):
    """On this CPU host, auto_policy changes nothing: same plan, byte for byte."""
    x = torch.randn(8, 32)
    plans = []
    for flag in (False, auto_policy):
        model = mlp()
        config = memscale.Config(mode="conservative", force_optimize=True, auto_policy=flag)
        memscale.wrap(model, config, sample_input=x)
        executor = model._memscale_executor
        assert executor.config is config
        assert executor.decision.decision_source == "user_config"
        plans.append(executor.plan.to_json())
        memscale.detach(model)
    assert plans[0] == plans[1]


# ---- the training script's tree ---------------------------------------------


def _load_script():
    path = Path(__file__).resolve().parent.parent / "scripts" / "train_policy.py"
    spec = importlib.util.spec_from_file_location("train_policy", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_tree_learner_is_deterministic_and_cost_minimizing():
    tp = _load_script()
    cases = []
    for i in range(90):
        pressure = round(0.5 + i * 0.02, 4)
        features = dict.fromkeys(FEATURES, 0.5)
        features["pressure"] = pressure
        # conservative fits below 1.0, balanced below 1.6, aggressive always.
        outcomes = {
            "conservative": (pressure <= 1.0, 0, 0, 1.0),
            "balanced": (pressure <= 1.6, 0, 0, 1.1),
            "aggressive": (True, 0, 0, 1.3),
        }
        cases.append(tp.Case("m", "mlp", pressure, features, outcomes, None))
    tree = tp.grow(cases)
    assert tree == tp.grow(list(reversed(cases)))
    trained = TrainedPolicy(
        {"format": policy.ARTIFACT_FORMAT, "features": list(FEATURES), "tree": tree}
    )
    picks = [trained.predict(c.features)[0] for c in cases]
    assert picks == [tp._oracle(c) for c in cases]
