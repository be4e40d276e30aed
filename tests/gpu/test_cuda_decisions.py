"""Hardware detection and the engine's decisions against the device's real
capacity: the budget is total_memory x target_gpu_utilization, a small
model is left alone (smart-skip), and a budget of half its peak gives
pressure 2 and a plan that fits.  tests/test_gpu_support.py runs the same
checks on the CPU with a stand-in capacity."""

from __future__ import annotations

import pytest
import torch
from conftest import mlp
from device_checks import check_pressure, check_smart_skip
from gpu_helpers import DEV, record

from memscale import _hardware

pytestmark = pytest.mark.cuda


def test_detected_hardware_is_the_device_s():
    props = torch.cuda.get_device_properties(DEV)
    hw = _hardware.detect("cuda", torch.cuda.current_device())
    assert hw.device == "cuda" and hw.index == torch.cuda.current_device()
    assert hw.capacity_bytes == props.total_memory
    assert hw.name == props.name
    assert hw.count == torch.cuda.device_count()
    assert hw.bf16 == torch.cuda.is_bf16_supported()
    record("hardware", hw.as_dict())
    with pytest.raises(RuntimeError, match="not available"):
        _hardware.detect("cuda", torch.cuda.device_count())


def test_smart_skip_against_the_device_capacity():
    capacity = torch.cuda.get_device_properties(DEV).total_memory
    plan = check_smart_skip(mlp().to(DEV), torch.randn(8, 32).to(DEV), capacity)
    record("smart_skip", {"budget": plan.budget_bytes, "pressure": plan.pressure})


def test_pressure_against_the_device_capacity():
    capacity = torch.cuda.get_device_properties(DEV).total_memory
    model = mlp(depth=6, width=64).to(DEV)
    # Large enough that its tensors, not the libraries' workspaces (about
    # 65 MiB on an H100, counted in every peak), are most of the peak.
    plan = check_pressure(model, torch.randn(32768, 64).to(DEV), capacity)
    record(
        "pressure",
        {
            "budget": plan.budget_bytes,
            "pressure": plan.pressure,
            "peak_unoptimized": plan.peak_unoptimized_bytes,
            "peak_projected": plan.peak_projected_bytes,
            "checkpointed": plan.technique_counts["checkpoint"],
        },
    )
