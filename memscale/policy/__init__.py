"""Stage 1 of the two-stage strategy selection (opt in with
``Config(auto_policy=True)``).

Stage 1 picks the strategy (mode, eligible techniques, how hard to plan
against the budget); Stage 2, the deterministic rule engine, always makes
the per-layer plan.  ``memscale.api._select_strategy`` runs it:

* ``auto_policy=False``: skipped; the Config is used as written
  (``decision_source="user_config"``).
* ``auto_policy=True`` with the model on the host CPU: skipped as well
  (there is no device memory pressure to reason about;
  ``decision_source="user_config"``).
* ``auto_policy=True`` with the model on a GPU: the trained tree
  (``"ml"``); if its artifact cannot be used, the rule policy
  (``"rule_fallback"``).  ``MEMSCALE_POLICY=rule`` asks for the rule
  policy on purpose (``"rule"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._hardware import Hardware
from ..config import Config
from ._types import (
    DECISION_SOURCES,
    FEATURES,
    STRATEGIES,
    PolicyFallbackNeeded,
    Strategy,
    StrategyContext,
    StrategyDecision,
    eligible_techniques,
)
from .rules import RulePolicy
from .trained import ARTIFACT_FORMAT, DEFAULT_ARTIFACT, TrainedPolicy, load_trained_policy

__all__ = [
    "ARTIFACT_FORMAT",
    "DECISION_SOURCES",
    "DEFAULT_ARTIFACT",
    "FEATURES",
    "POLICY_ENV",
    "PolicyFallbackNeeded",
    "RulePolicy",
    "STRATEGIES",
    "Strategy",
    "StrategyContext",
    "StrategyDecision",
    "TrainedPolicy",
    "eligible_techniques",
    "load_trained_policy",
    "needs_profile",
    "requested_policy",
]

# "auto" (default): the trained tree, else the rules ("rule_fallback");
# "rule": the rule policy on purpose ("rule").
POLICY_ENV = "MEMSCALE_POLICY"
_POLICY_CHOICES = ("auto", "rule")


def requested_policy() -> str:
    """``$MEMSCALE_POLICY`` ("auto" when unset); raises ``ValueError`` for
    any other value, naming the allowed ones."""
    import os

    value = os.environ.get(POLICY_ENV, "").strip().lower() or "auto"
    if value not in _POLICY_CHOICES:
        raise ValueError(
            f"{POLICY_ENV} must be one of {_POLICY_CHOICES} (or unset), "
            f"got {os.environ.get(POLICY_ENV)!r}"
        )
    return value


def needs_profile(config: Config, hardware: Hardware | Mapping[str, Any]) -> bool:
    """Whether Stage 1 will consult a policy (and so needs the profiled
    model): ``auto_policy`` is on and the model is on an accelerator.
    ``hardware``: a ``Hardware``, or a dict with the keys of
    ``memscale._core.detect_hardware``."""
    return bool(config.auto_policy) and Hardware.of(hardware).device not in ("cpu", "meta")
