"""Configuration for memscale: :class:`Config`, :class:`OptimizationMode` and
:class:`AsyncOffloadConfig`.

Both config classes are frozen dataclasses validated in ``__post_init__``:
a wrong type raises ``TypeError`` and a value out of range ``ValueError``,
each naming the field, what it accepts and what it got.  Unknown keywords are
rejected with the list of valid fields and a close match when there is one.
Use :meth:`Config.replace` to derive a changed, re-validated copy.

This module needs only the standard library (``import memscale.config`` never
imports torch).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Config", "OptimizationMode", "AsyncOffloadConfig"]

_T = TypeVar("_T")

# The unit of every *_gb field: GiB (2**30 bytes).
GIB = 1 << 30
# The largest byte count memscale plans with (the engine's limit, 1 PiB,
# csrc/plan.c MS_MAX_BYTES): every size field is bounded by it, so that a
# value the Config accepts converts to a byte count wrap() can use.
MAX_BYTES = 1 << 50
MAX_GB = MAX_BYTES // GIB  # 1048576 GiB
# prefetch_depth: layers read ahead of the one backward computes.
MAX_PREFETCH_DEPTH = 1024
# warmup_steps: training forwards measured before planning.
MAX_WARMUP_STEPS = 1 << 31
# offload_optimizer_state: the tiers the optimizer state can wait in.
STATE_TIERS = ("host", "disk")


class OptimizationMode(str, enum.Enum):
    """How aggressively the decision engine trades speed for memory."""

    CONSERVATIVE = "conservative"  # checkpointing only; least slowdown
    BALANCED = "balanced"  # checkpointing + offload (the default)
    AGGRESSIVE = "aggressive"  # the full stack, on more layers

    def __str__(self) -> str:
        return self.value

    @classmethod
    def coerce(cls, value: OptimizationMode | str, name: str = "mode") -> OptimizationMode:
        """Return ``value`` as a member; strings match case-insensitively."""
        if isinstance(value, cls):
            return value
        allowed = ", ".join(repr(m.value) for m in cls)
        if not isinstance(value, str):
            raise TypeError(
                f"{name} must be an OptimizationMode or one of {allowed}, "
                f"got {value!r} ({type(value).__name__})"
            )
        try:
            return cls(value.strip().lower())
        except ValueError:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}") from None


# --------------------------------------------------------------------------
# Shared machinery: strict keywords, validators, replace() / to_dict().


def _strict_init(cls: type[_T]) -> type[_T]:
    """Wrap a dataclass ``__init__`` so bad arguments get a helpful TypeError."""
    init = cls.__init__
    names = tuple(f.name for f in dataclasses.fields(cls) if f.init)  # type: ignore[arg-type]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(names):
            raise TypeError(
                f"{cls.__name__}() takes at most {len(names)} positional arguments "
                f"({', '.join(names)}), got {len(args)}; prefer keywords"
            )
        unknown = [key for key in kwargs if key not in names]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, names, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(
                f"{cls.__name__}() got unexpected keyword argument(s) {', '.join(hints)}; "
                f"valid fields are: {', '.join(names)}"
            )
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


class _ConfigBase:
    """``replace()``, ``to_dict()`` and validation helpers for frozen dataclasses."""

    def replace(self: _T, **changes: Any) -> _T:
        """Return a validated copy with ``changes`` applied; ``self`` is unchanged."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def to_dict(self) -> dict[str, Any]:
        """Return the fields, in order, as JSON-friendly values."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, _ConfigBase):
                value = value.to_dict()
            out[f.name] = value
        return out

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # the instance is frozen

    def _where(self, name: str) -> str:
        return f"{type(self).__name__}.{name}"

    def _type_error(self, name: str, expected: str, value: Any) -> TypeError:
        return TypeError(
            f"{self._where(name)} must be {expected}, got {value!r} ({type(value).__name__})"
        )

    def _check_bool(self, name: str) -> None:
        value = getattr(self, name)
        if not isinstance(value, bool):
            raise self._type_error(name, "a bool (True or False)", value)

    def _check_float(
        self, name: str, expected: str, ok: Callable[[float], bool], optional: bool = False
    ) -> None:
        value = getattr(self, name)
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self._type_error(name, expected, value)
        if not math.isfinite(value) or not ok(float(value)):
            raise ValueError(f"{self._where(name)} must be {expected}, got {value!r}")
        self._set(name, float(value))

    def _check_int(
        self, name: str, expected: str, ok: Callable[[int], bool], optional: bool = False
    ) -> None:
        value = getattr(self, name)
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise self._type_error(name, expected, value)
        if not ok(int(value)):
            raise ValueError(f"{self._where(name)} must be {expected}, got {value!r}")
        self._set(name, int(value))

    def _check_path(self, name: str) -> None:
        value = getattr(self, name)
        if value is None:
            return
        expected = "a non-empty str or os.PathLike path, or None"
        path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
        if not isinstance(path, str):
            raise self._type_error(name, expected, value)
        if not path:
            raise ValueError(f"{self._where(name)} must be {expected}, got {value!r}")
        if "\0" in path:
            raise ValueError(
                f"{self._where(name)} must be a path without NUL bytes ('\\0'), "
                f"got {value!r}; remove the NUL byte"
            )
        self._set(name, path)


# --------------------------------------------------------------------------
# The config classes.


@_strict_init
@dataclass(frozen=True)
class AsyncOffloadConfig(_ConfigBase):
    """Power-user tuning for the experimental async offload engine."""

    # Size of the reusable pinned host buffer pool (CUDA only), MiB, >= 0.
    pinned_pool_mb: int = 256
    # How many layers backward prefetches ahead of the one it computes, >= 0.
    prefetch_depth: int = 2
    # Tensors smaller than this many bytes are never offloaded, >= 0.
    min_offload_bytes: int = 1 << 20
    # Parent of the private spill directory; None = the system temp dir.
    spill_dir: str | None = None
    # Cap on bytes spilled to disk, in GB (>= 0; 0 = no disk tier);
    # None = unlimited.
    max_disk_gb: float | None = None
    # Checksum every reloaded tensor against what was offloaded (slow).
    debug: bool = False

    def __post_init__(self) -> None:
        self._check_int(
            "pinned_pool_mb",
            f"an int in 0..{MAX_BYTES >> 20} (MiB)",
            lambda v: 0 <= v <= MAX_BYTES >> 20,
        )
        self._check_int(
            "prefetch_depth",
            f"an int in 0..{MAX_PREFETCH_DEPTH}",
            lambda v: 0 <= v <= MAX_PREFETCH_DEPTH,
        )
        self._check_int(
            "min_offload_bytes",
            f"an int in 0..{MAX_BYTES} (2**50)",
            lambda v: 0 <= v <= MAX_BYTES,
        )
        self._check_path("spill_dir")
        self._check_float(
            "max_disk_gb",
            f"a float in [0, {MAX_GB}] (GiB) or None",
            lambda v: 0 <= v <= MAX_GB,
            optional=True,
        )
        self._check_bool("debug")


@_strict_init
@dataclass(frozen=True)
class Config(_ConfigBase):
    """Every optimization setting; pass it to ``wrap()`` or ``optimize()``."""

    # --- Core
    # Optimization aggressiveness (an OptimizationMode or its name as a string).
    mode: OptimizationMode = OptimizationMode.BALANCED
    # Apply gradient checkpointing.
    enable_checkpointing: bool = True
    # Apply CPU offloading.
    enable_offloading: bool = True
    # Apply activation tiling (more experimental).
    enable_tiling: bool = False
    # Use BF16/FP16 mixed precision.
    use_mixed_precision: bool = False
    # Use an 8-bit optimizer (bitsandbytes when usable, else a fallback).
    use_8bit_optimizer: bool = False

    # --- Memory budget
    # Cap on CPU RAM used for offloading, GB (>= 0); None = available CPU RAM.
    max_cpu_offload_gb: float | None = None
    # Fraction of device memory the engine aims to use, in (0, 1].
    target_gpu_utilization: float = 0.85
    # Optimize even when the model fits comfortably (bypasses the smart-skip).
    force_optimize: bool = False
    # Plan as if the device had this many usable GB (> 0);
    # None = detected capacity x target_gpu_utilization.
    memory_budget_gb: float | None = None

    # --- Profiling
    # Try torch.fx static analysis first.
    use_static_profiling: bool = True
    # Fall back to runtime profiling if static analysis fails.
    use_empirical_fallback: bool = True
    # Forward passes measured by empirical profiling before planning, >= 1.
    warmup_steps: int = 2

    # --- Observability
    # Log hardware detection and the optimization plan.
    enable_logging: bool = True
    # Log file path (str or os.PathLike, stored as str); None = stdout only.
    log_file: str | None = None
    # If set, expose Prometheus metrics on this TCP port (1..65535).
    observability_port: int | None = None
    # Run a baseline comparison to verify correctness (slow).
    verify_correctness: bool = False

    # --- Experimental
    # Enable the tier-aware async CPU offload engine.
    async_offload: bool = False
    # Power-user tuning for the async path; None = AsyncOffloadConfig() defaults.
    async_config: AsyncOffloadConfig | None = None
    # Opt in to the v1.2 ML policy Stage 1; False = use this Config exactly.
    auto_policy: bool = False

    # --- Checkpointing safety (after the spec's fields: positional
    # arguments keep their meaning)
    # A checkpointed layer that computes something else when run again
    # (checked once per layer at its first checkpointed forward): True =
    # raise memscale.RecomputeMismatchError; False = log it and stop
    # checkpointing that layer (the plan is made again without it).
    strict_recompute: bool = False

    # --- Below the floor (docs/below-the-floor.md): what activation
    # techniques leave alone, the gradients and the optimizer state.
    # Update each parameter as soon as its gradient is complete (during
    # backward) and free that gradient at once; needs the optimizer passed
    # to wrap/optimize/apply_all_optimizations.
    optimizer_in_backward: bool = False
    # Where the optimizer state waits between two updates of its parameter:
    # None = with the parameter; "host" = pinned host memory (a CUDA model;
    # max_cpu_offload_gb applies); "disk" = the disk tier (max_disk_gb
    # applies).  Needs optimizer_in_backward=True.
    offload_optimizer_state: str | None = None

    def __post_init__(self) -> None:
        self._set("mode", OptimizationMode.coerce(self.mode, self._where("mode")))
        for f in dataclasses.fields(self):
            if f.type == "bool":
                self._check_bool(f.name)
        self._check_float(
            "max_cpu_offload_gb",
            f"a float in [0, {MAX_GB}] (GiB) or None",
            lambda v: 0 <= v <= MAX_GB,
            optional=True,
        )
        self._check_float("target_gpu_utilization", "a float in (0, 1]", lambda v: 0 < v <= 1)
        self._check_float(
            "memory_budget_gb",
            f"a float in (0, {MAX_GB}] (GiB) or None",
            lambda v: 0 < v <= MAX_GB,
            optional=True,
        )
        self._check_int(
            "warmup_steps",
            f"an int in 1..{MAX_WARMUP_STEPS}",
            lambda v: 1 <= v <= MAX_WARMUP_STEPS,
        )
        self._check_path("log_file")
        self._check_int(
            "observability_port",
            "an int in 1..65535 or None",
            lambda v: 1 <= v <= 65535,
            optional=True,
        )
        value = self.async_config
        if value is not None and not isinstance(value, AsyncOffloadConfig):
            raise self._type_error("async_config", "an AsyncOffloadConfig or None", value)
        self._check_state_tier()

    def _check_state_tier(self) -> None:
        value = self.offload_optimizer_state
        if value is None:
            return
        expected = "'host', 'disk' or None"
        if not isinstance(value, str):
            raise self._type_error("offload_optimizer_state", expected, value)
        tier = value.strip().lower()
        if tier not in STATE_TIERS:
            raise ValueError(
                f"{self._where('offload_optimizer_state')} must be {expected}, got {value!r}"
            )
        if not self.optimizer_in_backward:
            raise ValueError(
                f"{self._where('offload_optimizer_state')}={tier!r} needs "
                "optimizer_in_backward=True: the state is streamed in for each "
                "parameter's update during backward; set "
                "Config(optimizer_in_backward=True, offload_optimizer_state="
                f"{tier!r})"
            )
        self._set("offload_optimizer_state", tier)
