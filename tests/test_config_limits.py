"""Values that used to validate and then fail inside ``wrap`` (issue 20,
item 7): each is rejected by the Config naming the field, or handled; the
largest value accepted works end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import hook_count, mlp

import memscale
from memscale import _core, _distributed
from memscale.policy import PolicyFallbackNeeded, load_trained_policy

A = memscale.AsyncOffloadConfig
# The limits docs/api.md states.
MAX_GB = 1048576  # GiB: 2**50 bytes, the engine's limit
MAX_PREFETCH_DEPTH = 1024
MAX_WARMUP_STEPS = 2**31
X = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(2))

TOO_BIG = [
    ("Config", "memory_budget_gb", 1e308),
    ("Config", "memory_budget_gb", MAX_GB * 1.5),
    ("Config", "max_cpu_offload_gb", 1e308),
    ("Config", "warmup_steps", 2**63),
    ("AsyncOffloadConfig", "max_disk_gb", 1e308),
    ("AsyncOffloadConfig", "max_disk_gb", MAX_GB + 1),
    ("AsyncOffloadConfig", "prefetch_depth", 2**31),
    ("AsyncOffloadConfig", "prefetch_depth", MAX_PREFETCH_DEPTH + 1),
    ("AsyncOffloadConfig", "min_offload_bytes", 2**64),
    ("AsyncOffloadConfig", "pinned_pool_mb", 2**60),
]


@pytest.mark.parametrize(("cls", "field", "value"), TOO_BIG)
def test_too_large_is_rejected_naming_the_field(cls, field, value):
    with pytest.raises(
        ValueError,
        match=rf"{cls}\.{field} must be .*at most|{cls}\.{field} "
        r"must be an? (int|float) in",
    ):
        getattr(memscale, cls)(**{field: value})


@pytest.mark.parametrize("field", ["memory_budget_gb", "max_cpu_offload_gb"])
def test_infinity_is_rejected(field):
    with pytest.raises(ValueError, match=rf"Config\.{field}"):
        memscale.Config(**{field: math.inf})


def _wrap_and_step(config):
    model = mlp()
    model.train()
    memscale.wrap(model, config, sample_input=X)
    try:
        model(X).pow(2).mean().backward()
    finally:
        memscale.detach(model)
    assert hook_count(model) == 0


@pytest.mark.parametrize(
    "changes",
    [
        {"memory_budget_gb": MAX_GB},
        {"max_cpu_offload_gb": MAX_GB},
        {"async_config": A(max_disk_gb=MAX_GB, min_offload_bytes=0)},
        {"async_config": A(prefetch_depth=MAX_PREFETCH_DEPTH, min_offload_bytes=0)},
        {"async_config": A(min_offload_bytes=2**50)},
        {"warmup_steps": MAX_WARMUP_STEPS},
    ],
)
def test_largest_accepted_value_wraps(changes):
    """What the Config accepts, wrap takes (no OverflowError)."""
    config = memscale.Config(
        force_optimize=True, enable_logging=False, async_offload=True, **changes
    )
    _wrap_and_step(config)


@pytest.mark.parametrize(
    ("cls", "field"), [("AsyncOffloadConfig", "spill_dir"), ("Config", "log_file")]
)
def test_nul_byte_in_a_path_is_rejected(cls, field, tmp_path):
    with pytest.raises(ValueError, match=rf"{cls}\.{field} must be a path without NUL"):
        getattr(memscale, cls)(**{field: f"{tmp_path}/a\0b"})


@pytest.mark.parametrize("raw", ["inf", "-inf", "nan", "-5", "1e400", "0"])
def test_dist_timeout_not_a_finite_positive_number(raw, monkeypatch):
    monkeypatch.setenv("MEMSCALE_DIST_TIMEOUT", raw)
    with pytest.raises(
        ValueError,
        match="MEMSCALE_DIST_TIMEOUT must be a number of "
        r"seconds > 0 and at most .*unset it",
    ):
        _distributed.timeout_seconds()


def test_dist_timeout_accepted(monkeypatch):
    monkeypatch.setenv("MEMSCALE_DIST_TIMEOUT", "12.5")
    assert _distributed.timeout_seconds() == 12.5
    monkeypatch.delenv("MEMSCALE_DIST_TIMEOUT")
    assert _distributed.timeout_seconds() == _distributed.DEFAULT_TIMEOUT_S


@pytest.fixture
def injected_gpu(monkeypatch):
    """A 64 MiB GPU as far as memscale can tell (Stage 1 consults the policy
    on a GPU); the model stays on the CPU."""

    def detect(device_type, index=0):
        return {
            "device": "cuda",
            "index": 0,
            "count": 1,
            "capacity_bytes": 64 << 20,
            "bf16": True,
            "name": "injected GPU",
        }

    monkeypatch.setattr(_core, "detect_hardware", detect)


@pytest.mark.parametrize("shape", ["array", "object"])
def test_deeply_nested_policy_artifact_falls_back(shape, injected_gpu, monkeypatch, tmp_path):
    """A JSON artifact nested 100,000 levels takes the rule fallback (as any
    unusable artifact does), not a RecursionError out of wrap."""
    depth = 100_000
    text = "[" * depth + "]" * depth if shape == "array" else '{"a":' * depth + "1" + "}" * depth
    path = tmp_path / "deep.json"
    path.write_text(text)
    monkeypatch.setenv("MEMSCALE_POLICY_ARTIFACT", str(path))
    model = mlp()
    memscale.wrap(model, memscale.Config(auto_policy=True, enable_logging=False), sample_input=X)
    try:
        decision = model._memscale_executor.decision
        assert decision.decision_source == "rule_fallback"
        assert "nested too deeply" in decision.reason
    finally:
        memscale.detach(model)


def test_policy_artifact_path_with_nul_falls_back():
    with pytest.raises(PolicyFallbackNeeded, match="not a valid path"):
        load_trained_policy("/tmp/tree\0.json")


def test_deep_but_parseable_tree_still_falls_back(injected_gpu, monkeypatch, tmp_path):
    """Nested beyond MAX_DEPTH but within the parser's reach: the tree check
    rejects it (as before)."""
    node: dict = {"leaf": "balanced"}
    for _ in range(200):
        node = {"feature": "pressure", "threshold": 1.0, "le": node, "gt": {"leaf": "balanced"}}
    artifact = {"format": "memscale-strategy-tree/1", "features": ["pressure"], "tree": node}
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(artifact))
    monkeypatch.setenv("MEMSCALE_POLICY_ARTIFACT", str(path))
    model = mlp()
    memscale.wrap(model, memscale.Config(auto_policy=True, enable_logging=False), sample_input=X)
    try:
        assert model._memscale_executor.decision.decision_source == "rule_fallback"
    finally:
        memscale.detach(model)
