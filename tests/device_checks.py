"""Checks of the engine's decisions against a device's capacity, shared by
the CPU tests (tests/test_gpu_support.py, a stand-in capacity) and the
CUDA tests (tests/gpu/test_cuda_decisions.py, the device's real one).

``capacity`` is what the device reports (host RAM, a cgroup limit, a
GPU's ``total_memory``); the budget is ``capacity x
target_gpu_utilization``, the pressure the predicted unoptimized peak
over it, and smart-skip leaves a model alone when the peak fits.
"""

from __future__ import annotations

from typing import Any

from torch import nn

import memscale


def _plan(model: nn.Module, sample: Any, config: memscale.Config) -> Any:
    memscale.wrap(model, config, sample_input=sample)
    try:
        return model.__dict__["_memscale_executor"].plan
    finally:
        memscale.detach(model)


def check_smart_skip(model: nn.Module, sample: Any, capacity: int) -> Any:
    """At the default utilization a small model fits: left alone, with the
    budget and pressure taken from ``capacity``."""
    config = memscale.Config(enable_logging=False)
    plan = _plan(model, sample, config)
    budget = max(1, int(capacity * config.target_gpu_utilization))
    assert plan.budget_bytes == budget
    assert plan.skipped
    assert plan.technique_counts["checkpoint"] == 0
    assert plan.pressure == plan.peak_unoptimized_bytes / budget
    assert plan.pressure < 1.0
    return plan


def check_pressure(model: nn.Module, sample: Any, capacity: int) -> Any:
    """A utilization that leaves half the model's predicted peak: the
    pressure is 2 within the rounding of the budget, the model is not
    skipped, and the planner recomputes (checkpoints, or runs layers
    selective) until the projected peak fits."""
    peak = memscale.predict_peak(model, sample, memscale.Config(enable_logging=False))
    need = peak.unoptimized.peak_bytes
    utilization = need / 2 / capacity
    assert 0 < utilization < 1, "the model is too large for this check"
    config = memscale.Config(enable_logging=False, target_gpu_utilization=utilization)
    plan = _plan(model, sample, config)
    budget = max(1, int(capacity * config.target_gpu_utilization))
    assert plan.budget_bytes == budget
    assert plan.peak_unoptimized_bytes == need
    assert not plan.skipped
    assert abs(plan.pressure - 2.0) < 1e-6
    # It recomputes: whole layers, or a layer run selective.
    assert plan.technique_counts["checkpoint"] + plan.technique_counts["selective"] > 0
    assert plan.peak_projected_bytes <= budget
    return plan
