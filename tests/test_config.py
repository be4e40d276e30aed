"""Tests for memscale.config: defaults, validation, strict keywords, copies."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import subprocess
import sys

import pytest

from memscale.config import AsyncOffloadConfig, Config, OptimizationMode

CONFIG_FIELDS = [
    "mode",
    "enable_checkpointing",
    "enable_offloading",
    "enable_tiling",
    "use_mixed_precision",
    "use_8bit_optimizer",
    "max_cpu_offload_gb",
    "target_gpu_utilization",
    "force_optimize",
    "memory_budget_gb",
    "use_static_profiling",
    "use_empirical_fallback",
    "warmup_steps",
    "enable_logging",
    "log_file",
    "observability_port",
    "verify_correctness",
    "async_offload",
    "async_config",
    "auto_policy",
    "strict_recompute",
    "optimizer_in_backward",
    "offload_optimizer_state",
]
ASYNC_FIELDS = [
    "pinned_pool_mb",
    "prefetch_depth",
    "min_offload_bytes",
    "spill_dir",
    "max_disk_gb",
    "debug",
]
BOOL_FIELDS = [
    "enable_checkpointing",
    "enable_offloading",
    "enable_tiling",
    "use_mixed_precision",
    "use_8bit_optimizer",
    "force_optimize",
    "use_static_profiling",
    "use_empirical_fallback",
    "enable_logging",
    "verify_correctness",
    "async_offload",
    "auto_policy",
    "strict_recompute",
    "optimizer_in_backward",
]


# ---------------------------------------------------------------- defaults


def test_config_defaults() -> None:
    c = Config()
    assert c.mode is OptimizationMode.BALANCED
    assert c.enable_checkpointing is True
    assert c.enable_offloading is True
    assert c.enable_tiling is False
    assert c.use_mixed_precision is False
    assert c.use_8bit_optimizer is False
    assert c.max_cpu_offload_gb is None
    assert c.target_gpu_utilization == 0.85
    assert c.force_optimize is False
    assert c.memory_budget_gb is None
    assert c.use_static_profiling is True
    assert c.use_empirical_fallback is True
    assert c.warmup_steps == 2
    assert c.enable_logging is True
    assert c.log_file is None
    assert c.observability_port is None
    assert c.verify_correctness is False
    assert c.async_offload is False
    assert c.async_config is None
    assert c.auto_policy is False
    assert c.optimizer_in_backward is False
    assert c.offload_optimizer_state is None


def test_async_defaults() -> None:
    a = AsyncOffloadConfig()
    assert a.pinned_pool_mb == 256
    assert a.prefetch_depth == 2
    assert a.min_offload_bytes == 1 << 20
    assert a.spill_dir is None
    assert a.max_disk_gb is None
    assert a.debug is False


def test_field_order() -> None:
    assert [f.name for f in dataclasses.fields(Config)] == CONFIG_FIELDS
    assert [f.name for f in dataclasses.fields(AsyncOffloadConfig)] == ASYNC_FIELDS


def test_spec_examples() -> None:
    c = Config(mode=OptimizationMode.BALANCED, enable_offloading=True, max_cpu_offload_gb=64)
    assert c.max_cpu_offload_gb == 64.0 and isinstance(c.max_cpu_offload_gb, float)
    c = Config(
        mode=OptimizationMode.AGGRESSIVE,
        use_mixed_precision=True,
        use_8bit_optimizer=True,
        max_cpu_offload_gb=32,
    )
    assert c.mode is OptimizationMode.AGGRESSIVE and c.use_8bit_optimizer is True


# ---------------------------------------------------------------- mode


@pytest.mark.parametrize("text", ["balanced", "BALANCED", "Balanced", " balanced "])
def test_mode_string_coerced(text: str) -> None:
    assert Config(mode=text).mode is OptimizationMode.BALANCED


@pytest.mark.parametrize("member", list(OptimizationMode))
def test_mode_members(member: OptimizationMode) -> None:
    assert Config(mode=member.value.upper()).mode is member
    assert OptimizationMode.coerce(member) is member
    assert str(member) == member.value
    assert member == member.value  # str-valued enum


def test_mode_invalid_string_lists_allowed() -> None:
    with pytest.raises(ValueError, match="Config.mode") as info:
        Config(mode="turbo")
    for member in OptimizationMode:
        assert member.value in str(info.value)
    assert "'turbo'" in str(info.value)


def test_mode_coerce_standalone() -> None:
    assert OptimizationMode.coerce("AGGRESSIVE") is OptimizationMode.AGGRESSIVE
    with pytest.raises(ValueError, match="conservative"):
        OptimizationMode.coerce("fast")
    with pytest.raises(TypeError):
        OptimizationMode.coerce(1)  # type: ignore[arg-type]


# ---------------------------------------------------------------- validation

BAD_CONFIG = [
    # (field, value, exception)
    ("mode", 1, TypeError),
    ("mode", None, TypeError),
    ("mode", "fast", ValueError),
    *[(name, 1, TypeError) for name in BOOL_FIELDS],
    *[(name, "yes", TypeError) for name in BOOL_FIELDS],
    *[(name, None, TypeError) for name in BOOL_FIELDS],
    ("max_cpu_offload_gb", "64", TypeError),
    ("max_cpu_offload_gb", True, TypeError),
    ("max_cpu_offload_gb", -1, ValueError),
    ("max_cpu_offload_gb", math.nan, ValueError),
    ("max_cpu_offload_gb", math.inf, ValueError),
    ("target_gpu_utilization", None, TypeError),
    ("target_gpu_utilization", "0.9", TypeError),
    ("target_gpu_utilization", True, TypeError),
    ("target_gpu_utilization", 0, ValueError),
    ("target_gpu_utilization", -0.5, ValueError),
    ("target_gpu_utilization", 1.5, ValueError),
    ("target_gpu_utilization", math.nan, ValueError),
    ("memory_budget_gb", "8", TypeError),
    ("memory_budget_gb", False, TypeError),
    ("memory_budget_gb", 0, ValueError),
    ("memory_budget_gb", -4.0, ValueError),
    ("memory_budget_gb", math.inf, ValueError),
    ("warmup_steps", None, TypeError),
    ("warmup_steps", 2.0, TypeError),
    ("warmup_steps", True, TypeError),
    ("warmup_steps", "2", TypeError),
    ("warmup_steps", 0, ValueError),
    ("warmup_steps", -1, ValueError),
    ("log_file", 3, TypeError),
    ("log_file", b"log.txt", TypeError),
    ("log_file", "", ValueError),
    ("observability_port", "9090", TypeError),
    ("observability_port", 9090.0, TypeError),
    ("observability_port", True, TypeError),
    ("observability_port", 0, ValueError),
    ("observability_port", 65536, ValueError),
    ("async_config", {"prefetch_depth": 1}, TypeError),
    ("async_config", True, TypeError),
]


@pytest.mark.parametrize(("name", "value", "exc"), BAD_CONFIG)
def test_config_rejects(name: str, value: object, exc: type[Exception]) -> None:
    with pytest.raises(exc) as info:
        Config(**{name: value})
    assert type(info.value) is exc
    assert f"Config.{name}" in str(info.value)
    assert repr(value) in str(info.value)


def test_message_format() -> None:
    with pytest.raises(ValueError) as info:
        Config(target_gpu_utilization=1.5)
    assert str(info.value) == "Config.target_gpu_utilization must be a float in (0, 1], got 1.5"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("target_gpu_utilization", 1),
        ("target_gpu_utilization", 1e-9),
        ("max_cpu_offload_gb", 0),
        ("memory_budget_gb", 0.5),
        ("warmup_steps", 1),
        ("observability_port", 1),
        ("observability_port", 65535),
    ],
)
def test_config_accepts_bounds(name: str, value: object) -> None:
    assert getattr(Config(**{name: value}), name) == value


BAD_ASYNC = [
    *[
        (name, bad, TypeError)
        for name in ("pinned_pool_mb", "prefetch_depth", "min_offload_bytes")
        for bad in (1.0, "1", True, None)
    ],
    *[(name, -1, ValueError) for name in ("pinned_pool_mb", "prefetch_depth", "min_offload_bytes")],
    ("spill_dir", 1, TypeError),
    ("spill_dir", "", ValueError),
    ("max_disk_gb", "1", TypeError),
    ("max_disk_gb", True, TypeError),
    ("max_disk_gb", -0.001, ValueError),
    ("max_disk_gb", -2.5, ValueError),
    ("max_disk_gb", math.nan, ValueError),
    ("debug", 0, TypeError),
    ("debug", "true", TypeError),
]


@pytest.mark.parametrize(("name", "value", "exc"), BAD_ASYNC)
def test_async_rejects(name: str, value: object, exc: type[Exception]) -> None:
    with pytest.raises(exc) as info:
        AsyncOffloadConfig(**{name: value})
    assert type(info.value) is exc
    assert f"AsyncOffloadConfig.{name}" in str(info.value)


def test_async_accepts_zero_and_values() -> None:
    a = AsyncOffloadConfig(
        pinned_pool_mb=0, prefetch_depth=0, min_offload_bytes=0, max_disk_gb=2, debug=True
    )
    assert (a.pinned_pool_mb, a.prefetch_depth, a.min_offload_bytes) == (0, 0, 0)
    assert a.max_disk_gb == 2.0 and isinstance(a.max_disk_gb, float)
    assert Config(async_offload=True, async_config=a).async_config is a


def test_pathlike_stored_as_str(tmp_path: pathlib.Path) -> None:
    c = Config(log_file=tmp_path / "run.log")
    assert c.log_file == str(tmp_path / "run.log") and type(c.log_file) is str
    a = AsyncOffloadConfig(spill_dir=tmp_path)
    assert a.spill_dir == str(tmp_path) and type(a.spill_dir) is str


# ---------------------------------------------------------------- keywords


def test_unknown_keyword_suggests_and_lists() -> None:
    with pytest.raises(TypeError) as info:
        Config(enable_checkpoint=True)
    msg = str(info.value)
    assert "'enable_checkpoint'" in msg
    assert "did you mean 'enable_checkpointing'" in msg
    for name in CONFIG_FIELDS:
        assert name in msg


def test_unknown_keywords_all_named() -> None:
    with pytest.raises(TypeError) as info:
        Config(warmup=3, zzz=1)
    msg = str(info.value)
    assert "'warmup'" in msg and "'zzz'" in msg and "warmup_steps" in msg


def test_async_unknown_keyword() -> None:
    with pytest.raises(TypeError) as info:
        AsyncOffloadConfig(prefetch=4)
    msg = str(info.value)
    assert "did you mean 'prefetch_depth'" in msg
    for name in ASYNC_FIELDS:
        assert name in msg


def test_too_many_positional() -> None:
    with pytest.raises(TypeError, match="at most 23 positional"):
        Config(*([True] * 24))
    with pytest.raises(TypeError, match="at most 6 positional"):
        AsyncOffloadConfig(1, 2, 3, None, None, False, 7)


def test_positional_still_validated() -> None:
    assert Config("aggressive").mode is OptimizationMode.AGGRESSIVE
    with pytest.raises(TypeError, match="Config.enable_checkpointing"):
        Config("balanced", "yes")


# ---------------------------------------------------------------- immutability, copies


def test_frozen() -> None:
    c = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.mode = OptimizationMode.AGGRESSIVE  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        AsyncOffloadConfig().debug = True  # type: ignore[misc]


def test_hashable_and_equal() -> None:
    assert Config() == Config(mode="balanced")
    assert hash(Config()) == hash(Config())


def test_replace_returns_validated_copy() -> None:
    original = Config()
    changed = original.replace(mode="aggressive", warmup_steps=5)
    assert changed.mode is OptimizationMode.AGGRESSIVE and changed.warmup_steps == 5
    assert original.mode is OptimizationMode.BALANCED and original.warmup_steps == 2
    with pytest.raises(ValueError, match="Config.target_gpu_utilization"):
        original.replace(target_gpu_utilization=2.0)
    with pytest.raises(TypeError, match="did you mean 'enable_tiling'"):
        original.replace(enable_tilling=True)
    assert original == Config()


def test_async_replace() -> None:
    a = AsyncOffloadConfig()
    assert a.replace(prefetch_depth=4).prefetch_depth == 4
    assert a.prefetch_depth == 2
    with pytest.raises(ValueError, match="AsyncOffloadConfig.prefetch_depth"):
        a.replace(prefetch_depth=-1)


# ---------------------------------------------------------------- to_dict


def test_to_dict_json_round_trip(tmp_path: pathlib.Path) -> None:
    c = Config(
        mode=OptimizationMode.AGGRESSIVE,
        max_cpu_offload_gb=32,
        memory_budget_gb=6.5,
        log_file=tmp_path / "x.log",
        observability_port=9100,
        async_offload=True,
        async_config=AsyncOffloadConfig(prefetch_depth=3, spill_dir=tmp_path, max_disk_gb=10),
    )
    d = c.to_dict()
    assert list(d) == CONFIG_FIELDS
    assert d["mode"] == "aggressive" and type(d["mode"]) is str
    assert list(d["async_config"]) == ASYNC_FIELDS
    loaded = json.loads(json.dumps(d))
    assert loaded == d
    loaded["mode"] = OptimizationMode(loaded["mode"])
    loaded["async_config"] = AsyncOffloadConfig(**loaded["async_config"])
    assert Config(**loaded) == c


def test_to_dict_defaults() -> None:
    d = Config().to_dict()
    assert d["mode"] == "balanced" and d["async_config"] is None
    assert Config(**d) == Config()  # mode given as a string is coerced
    assert AsyncOffloadConfig(**AsyncOffloadConfig().to_dict()) == AsyncOffloadConfig()


def test_module_is_stdlib_only() -> None:
    import memscale.config as module

    assert module.__all__ == ["Config", "OptimizationMode", "AsyncOffloadConfig"]
    assert module.__doc__
    # Loaded on its own (bypassing the package __init__), it never imports torch.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('cfg', {module.__file__!r})\n"
        "mod = sys.modules['cfg'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        "mod.Config()\n"
        "sys.exit('torch' in sys.modules)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
