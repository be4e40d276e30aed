"""Stage 1 of the two-stage strategy selection (opt in with
``Config(auto_policy=True)``).

Stage 1 picks the strategy (mode, eligible techniques, how hard to plan
against the budget); Stage 2, the deterministic rule engine, always makes
the per-layer plan.  :func:`select_strategy` runs it:

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

import logging
import os
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
    "select_strategy",
]

logger = logging.getLogger(__name__)

# "auto" (default): the trained tree, else the rules ("rule_fallback");
# "rule": the rule policy on purpose ("rule").
POLICY_ENV = "MEMSCALE_POLICY"
_POLICY_CHOICES = ("auto", "rule")


def requested_policy() -> str:
    """``$MEMSCALE_POLICY`` ("auto" when unset); raises ``ValueError`` for
    any other value, naming the allowed ones."""
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


def select_strategy(config: Config, context: StrategyContext) -> tuple[StrategyDecision, Config]:
    """Stage 1: the strategy decision and the effective Config (``config``
    itself, or a derived copy; ``config`` is never changed).

    ``auto_policy=False``, or a model on the host CPU: ``config`` as written
    (``decision_source="user_config"``).  On a GPU: the trained policy
    (``"ml"``), else the rule policy (``"rule_fallback"``), or the rule
    policy on purpose with ``MEMSCALE_POLICY=rule`` (``"rule"``).  Stage 2,
    the rule engine, makes the per-layer plan from the effective Config.
    """
    if not config.auto_policy:
        return StrategyDecision.from_config(
            config, "auto_policy=False: the Config is used as written"
        ), config
    if not context.has_gpu:
        return StrategyDecision.from_config(
            config,
            f"auto_policy=True, but the model is on the host "
            f"{context.device_type}: there is no device memory pressure to "
            "reason about, so the Config is used as written",
        ), config
    if not context.profiled:
        raise ValueError(
            "Stage 1 needs a profiled context on a GPU: build it with "
            "StrategyContext.build(config, hardware, profile, fixed_bytes)"
        )
    rules = RulePolicy()
    if requested_policy() == "rule":
        (name, reason), source, used = rules.choose(context), "rule", rules.name
    else:
        try:
            trained = load_trained_policy()
            (name, reason), source, used = trained.choose(context), "ml", trained.name
        except PolicyFallbackNeeded as exc:
            logger.info(
                "memscale: the trained strategy policy is unavailable (%s); "
                "the rule policy decides",
                exc,
            )
            (name, reason), source, used = rules.choose(context), "rule_fallback", rules.name
            reason += f"; trained policy unavailable: {exc}"
    decision = StrategyDecision.from_strategy(name, config, source, reason, used)
    return decision, decision.effective_config(config)
