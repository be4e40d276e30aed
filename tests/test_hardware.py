"""memscale._hardware: the device description as one frozen value, made in
one place, and the dicts public functions still accept converted to it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import mlp

import memscale
from memscale import _core, _hardware, amp, policy
from memscale._format import format_bytes
from memscale._hardware import Hardware

GPU = {
    "device": "cuda",
    "index": 1,
    "count": 2,
    "capacity_bytes": 8 << 30,
    "bf16": False,
    "name": "a GPU",
}


def test_detect_is_the_c_core_description_typed():
    hw = _hardware.detect("cpu")
    assert type(hw) is Hardware
    assert hw.as_dict() == _core.detect_hardware("cpu")
    assert (hw.device, hw.index, hw.count) == ("cpu", 0, 1)
    assert hw.capacity_bytes > 0 and isinstance(hw.bf16, bool) and hw.name
    assert _hardware.detect("cpu") == hw  # a value: equal, and hashable
    assert len({hw, _hardware.detect("cpu")}) == 1


def test_detect_keeps_the_c_core_errors():
    with pytest.raises(ValueError, match="'tpu'"):
        _hardware.detect("tpu")


def test_hardware_is_frozen_with_slots():
    hw = Hardware.of(GPU)
    with pytest.raises(dataclasses.FrozenInstanceError):
        hw.capacity_bytes = 1  # type: ignore[misc]
    assert not hasattr(hw, "__dict__")
    assert [f.name for f in dataclasses.fields(Hardware)] == list(GPU)


def test_of_a_dict_and_back():
    hw = Hardware.of(GPU)
    assert hw.as_dict() == GPU
    assert Hardware.of(hw) is hw
    # Only device and capacity_bytes are required.
    small = Hardware.of({"device": "cuda", "capacity_bytes": 1 << 30})
    assert small == Hardware("cuda", 0, 1, 1 << 30, False, "cuda")


def test_of_a_dict_with_unknown_or_missing_keys_says_which():
    with pytest.raises(ValueError, match=r"unknown: capacity, vram") as err:
        Hardware.of({**GPU, "vram": 1, "capacity": 2})
    assert "device, index, count, capacity_bytes, bf16, name" in str(err.value)
    with pytest.raises(ValueError, match=r"missing: capacity_bytes"):
        Hardware.of({"device": "cuda"})
    with pytest.raises(TypeError, match=r"a memscale Hardware or a dict"):
        Hardware.of(["cuda", 1 << 30])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field, value, kind",
    [
        ("device", 0, "str"),
        ("count", 1.0, "int"),
        ("capacity_bytes", "8G", "int"),
        ("index", True, "int"),
        ("bf16", 1, "bool"),
        ("name", None, "str"),
    ],
)
def test_a_field_of_the_wrong_type_is_named(field, value, kind):
    with pytest.raises(TypeError, match=rf"Hardware\.{field} must be a {kind}, got {value!r}"):
        Hardware.of({**GPU, field: value})


def test_assumed_describes_a_device_by_its_size():
    hw = _hardware.assumed("xla", 0, 1 << 30)
    assert hw == Hardware("xla", 0, 1, 1 << 30, False, "xla")


def test_public_functions_still_take_a_dict():
    assert amp.autocast_dtype(GPU) is torch.float16
    assert amp.autocast_dtype({**GPU, "bf16": True}) is torch.bfloat16
    assert amp.autocast_dtype(Hardware.of(GPU)) is torch.float16
    config = memscale.Config(enable_logging=False, auto_policy=True)
    assert policy.needs_profile(config, GPU)
    from_dict = policy.StrategyContext.build(config, GPU)
    assert from_dict == policy.StrategyContext.build(config, Hardware.of(GPU))
    assert (from_dict.device_type, from_dict.device_count) == ("cuda", 2)
    with pytest.raises(ValueError, match="unknown: gpus"):
        policy.StrategyContext.build(config, {**GPU, "gpus": 2})


def test_the_executor_keeps_the_hardware_and_describes_it_as_before():
    model = mlp()
    memscale.wrap(model, memscale.Config(enable_logging=False), sample_input=torch.randn(4, 32))
    try:
        ex = model._memscale_executor
        hw = _hardware.detect("cpu")
        assert ex.hardware == hw
        first = ex.describe().splitlines()[0]
        assert first == (
            f"memscale hardware: cpu x1, {format_bytes(hw.capacity_bytes, digits=1)} "
            f"each ({hw.name})"
        )
    finally:
        memscale.detach(model)
