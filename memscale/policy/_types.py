"""Stage 1's inputs and outputs: StrategyContext, StrategyDecision, the
strategies a policy may pick, and PolicyFallbackNeeded.

A *strategy* is the high-level choice Stage 1 makes before the rule engine
(Stage 2) expands it layer by layer: the mode, the techniques that are
eligible, and how hard the engine plans against the memory budget.

=============  ===========  =====================================================
strategy       mode         what Stage 2 is asked to do
=============  ===========  =====================================================
conservative   CONSERVATIVE plan to the full budget: the fewest layers that fit
balanced       BALANCED     plan to 85% of the budget: headroom for the memory
                            that the engine's estimate does not see
                            (temporaries of backward and of the optimizer step)
aggressive     AGGRESSIVE   every eligible layer (``force_optimize=True``)
=============  ===========  =====================================================

A strategy never turns on a technique the user's Config turned off
(``enable_checkpointing=False`` stays off), and never touches the profiling,
observability or experimental fields.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._hardware import Hardware
from .._solve import PlanProblem, solve
from ..config import Config, OptimizationMode

__all__ = [
    "DECISION_SOURCES",
    "FEATURES",
    "STRATEGIES",
    "PolicyFallbackNeeded",
    "Strategy",
    "StrategyContext",
    "StrategyDecision",
]

# Where a decision came from (spec: ml-policy.txt, "decision_source").
DECISION_SOURCES = ("user_config", "ml", "rule_fallback", "rule")


class PolicyFallbackNeeded(Exception):
    """The trained policy cannot decide (its artifact is missing, corrupt or
    of an unknown format, or the context lacks what it needs).

    Raised inside Stage 1 and caught there: the rule-based policy decides
    instead and the decision records ``decision_source="rule_fallback"``.
    It reaches a caller only through the policy classes used directly.
    """


@dataclass(frozen=True)
class Strategy:
    """One choice Stage 1 can make."""

    name: str
    mode: OptimizationMode
    # Share of the usable memory that Stage 2 plans against, in (0, 1].
    budget_fraction: float
    # Checkpoint every eligible layer, whatever the pressure.
    force_optimize: bool


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("conservative", OptimizationMode.CONSERVATIVE, 1.0, False),
        Strategy("balanced", OptimizationMode.BALANCED, 0.85, False),
        Strategy("aggressive", OptimizationMode.AGGRESSIVE, 1.0, True),
    )
}

# The numeric features a policy reads from a profiled context, in order.
FEATURES = (
    "pressure",  # predicted unoptimized peak / budget
    "min_pressure",  # predicted peak with every eligible layer checkpointed / budget
    "activation_share",  # activation bytes / predicted unoptimized peak
    "unit_share",  # activation bytes inside the planning units / all activation bytes
    "fixed_share",  # parameters + gradients + optimizer state / unoptimized peak
    "layer_count",  # planning units
)


def eligible_techniques(config: Config, mode: OptimizationMode) -> tuple[str, ...]:
    """The techniques ``mode`` makes eligible under ``config``'s switches
    (the same rule as the planner's; what this release can carry out is a
    subset, reported by the plan)."""
    out = []
    if config.enable_checkpointing:
        out.append("checkpoint")
    if config.enable_offloading and mode is not OptimizationMode.CONSERVATIVE:
        out.append("offload")
    if config.enable_tiling or mode is OptimizationMode.AGGRESSIVE:
        out.append("tiling")
    return tuple(out)


@dataclass(frozen=True)
class StrategyContext:
    """What Stage 1 knows when it decides: the hardware, the budget, and
    (once the model is profiled) the engine's predictions.

    Build it with :meth:`build`; tests may construct it directly with any
    hardware description (a GPU on a CPU-only machine, say).  Fields after
    ``fixed_bytes`` are ``None`` until the model is profiled.
    """

    device_type: str  # "cuda", "cpu", ... (the device the model is on)
    device_count: int
    capacity_bytes: int  # per device, as detected (or given)
    budget_bytes: int  # usable memory per the user's Config
    fixed_bytes: int  # parameters + buffers + gradients + optimizer state
    activation_bytes: int | None = None  # all activations saved for backward
    unit_activation_bytes: int | None = None  # those inside the planning units
    peak_unoptimized_bytes: int | None = None  # the engine's prediction
    peak_min_bytes: int | None = None  # predicted, every eligible layer checkpointed
    layer_count: int | None = None
    total_flops: float | None = None

    @property
    def has_gpu(self) -> bool:
        """Whether the model's device is an accelerator (not the host CPU)."""
        return self.device_type not in ("cpu", "meta")

    @property
    def profiled(self) -> bool:
        return self.peak_unoptimized_bytes is not None

    @classmethod
    def build(
        cls,
        config: Config,
        hardware: Hardware | Mapping[str, Any],
        profile: Any = None,
        fixed_bytes: int = 0,
    ) -> StrategyContext:
        """The context for ``config`` on ``hardware`` (a ``Hardware``, or a
        dict with the keys of ``memscale._core.detect_hardware``), with the
        engine's predictions when ``profile`` (a ``_planning.Profile``) is
        given."""
        from .. import _core, _planning

        hw = Hardware.of(hardware)
        budget = _planning.budget_bytes(config, hw)
        base: dict[str, Any] = dict(
            device_type=hw.device,
            device_count=hw.count,
            capacity_bytes=hw.capacity_bytes,
            budget_bytes=budget,
            fixed_bytes=int(fixed_bytes),
        )
        if profile is None:
            return cls(**base)

        # Every eligible layer checkpointed, by the engine's greedy rules.
        everything = solve(
            PlanProblem(
                layers=tuple(profile.layers),
                mode=OptimizationMode.CONSERVATIVE.value,
                allowed=_core.TECH_CHECKPOINT,
                force=True,
                budget_bytes=budget,
                fixed_bytes=int(fixed_bytes),
                activation_bytes=profile.activation_bytes,
                total_flops=profile.total_flops,
                device=hw.device,
                device_count=hw.count,
                capacity_bytes=hw.capacity_bytes,
            )
        )
        return cls(
            **base,
            activation_bytes=int(profile.activation_bytes),
            unit_activation_bytes=int(sum(layer.saved_bytes for layer in profile.layers)),
            peak_unoptimized_bytes=int(everything.peak_unoptimized_bytes),
            peak_min_bytes=int(everything.peak_projected_bytes),
            layer_count=len(profile.layers),
            total_flops=float(profile.total_flops),
        )

    def features(self) -> dict[str, float]:
        """The :data:`FEATURES` as floats; needs a profiled context."""
        if not self.profiled:
            raise PolicyFallbackNeeded(
                "the context has no profile yet (Stage 1 needs the engine's "
                "predictions to pick a strategy)"
            )
        budget = max(1, self.budget_bytes)
        peak = max(1, self.peak_unoptimized_bytes or 0)
        activation = max(1, self.activation_bytes or 0)
        values = {
            "pressure": peak / budget,
            "min_pressure": (self.peak_min_bytes or 0) / budget,
            "activation_share": (self.activation_bytes or 0) / peak,
            "unit_share": min(1.0, (self.unit_activation_bytes or 0) / activation),
            "fixed_share": self.fixed_bytes / peak,
            "layer_count": float(self.layer_count or 0),
        }
        return {name: float(values[name]) for name in FEATURES}


@dataclass(frozen=True)
class StrategyDecision:
    """Stage 1's result, stored on the executor as ``executor.decision``."""

    # "conservative", "balanced", "aggressive", or "as_configured" when
    # Stage 1 was skipped (decision_source "user_config").
    strategy: str
    mode: OptimizationMode
    # Techniques eligible under the decision (the plan shows what this
    # release applied).
    techniques: tuple[str, ...]
    force_optimize: bool
    # Share of the usable memory Stage 2 plans against.
    budget_fraction: float
    # One of DECISION_SOURCES.
    decision_source: str
    # Why, in a few words (a rule, a tree path, or why Stage 1 was skipped).
    reason: str
    # Which policy decided: "rules", "strategy-tree <sha256 prefix>", or None.
    policy: str | None = None

    def __post_init__(self) -> None:
        if self.decision_source not in DECISION_SOURCES:
            raise ValueError(
                f"decision_source must be one of {DECISION_SOURCES}, got {self.decision_source!r}"
            )
        if not (0 < self.budget_fraction <= 1) or not math.isfinite(self.budget_fraction):
            raise ValueError(f"budget_fraction must be in (0, 1], got {self.budget_fraction!r}")

    @classmethod
    def from_config(cls, config: Config, reason: str) -> StrategyDecision:
        """The decision that uses ``config`` as written."""
        return cls(
            strategy="as_configured",
            mode=config.mode,
            techniques=eligible_techniques(config, config.mode),
            force_optimize=config.force_optimize,
            budget_fraction=1.0,
            decision_source="user_config",
            reason=reason,
        )

    @classmethod
    def from_strategy(
        cls, name: str, config: Config, source: str, reason: str, policy: str | None
    ) -> StrategyDecision:
        try:
            strategy = STRATEGIES[name]
        except KeyError:
            raise ValueError(
                f"unknown strategy {name!r}; choose from {sorted(STRATEGIES)}"
            ) from None
        return cls(
            strategy=name,
            mode=strategy.mode,
            techniques=eligible_techniques(config, strategy.mode),
            force_optimize=config.force_optimize or strategy.force_optimize,
            budget_fraction=strategy.budget_fraction,
            decision_source=source,
            reason=reason,
            policy=policy,
        )

    def effective_config(self, config: Config) -> Config:
        """``config`` with this decision applied: ``config`` itself when
        Stage 1 was skipped, else a validated copy (``config`` is frozen and
        never changed)."""
        if self.decision_source == "user_config":
            return config
        changes: dict[str, Any] = {"mode": self.mode, "force_optimize": self.force_optimize}
        if self.budget_fraction != 1.0:
            if config.memory_budget_gb is not None:
                changes["memory_budget_gb"] = config.memory_budget_gb * self.budget_fraction
            else:
                changes["target_gpu_utilization"] = (
                    config.target_gpu_utilization * self.budget_fraction
                )
        return config.replace(**changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["mode"] = self.mode.value
        out["techniques"] = list(self.techniques)
        return out

    def describe(self) -> str:
        """One log line."""
        techniques = "+".join(self.techniques) or "none"
        return (
            f"memscale strategy: {self.strategy} (decision_source="
            f"{self.decision_source}) mode={self.mode.value} "
            f"techniques={techniques} force_optimize={self.force_optimize} "
            f"budget_fraction={self.budget_fraction:g}"
            + (f" policy={self.policy}" if self.policy else "")
            + f": {self.reason}"
        )
