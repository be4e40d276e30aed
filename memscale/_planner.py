"""The plan -> simulate -> correct loop: the engine plans from the OOM
predictor's simulated peaks.

The engine's memory model (``csrc/engine.c``) estimates a step's peak from
the profile; the predictor (:mod:`memscale.predictor`) simulates the step
on fake tensors.  This module asks the predictor for its corrections of
the engine (:func:`predicted_offsets`), plans with them, and, when no plan
fits, checks the least budget by planning there again
(:func:`verified_least_budget`).  It imports both ``_planning`` (profiles
and engine inputs) and the predictor; neither of them imports it.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from . import _planning, predictor
from ._planning import Profile
from .config import GIB, Config

logger = logging.getLogger(__name__)


class Offsets(NamedTuple):
    """What the OOM predictor tells the engine (see predicted_offsets)."""

    peak: int  # correction of the unoptimized peak
    plan: int  # correction of the plans' peaks
    fallback: bool  # plan every layer checkpointed alone instead
    forced_peak: int | None  # simulated peak of that plan, if simulated


def predicted_offsets(
    model: torch.nn.Module,
    sample_input: Any,
    optimizer: torch.optim.Optimizer | None,
    profile: Profile,
    config: Config,
    hardware: dict[str, Any],
    fixed: int,
) -> Offsets:
    """The OOM predictor's corrections of the engine, for ``wrap``: of its
    unoptimized peak, and of its plans' peaks (see
    ``PredictionSession.plan_offsets``), so that a plan and
    ``memscale.predict_peak`` cannot disagree about whether the step fits;
    and whether to fall back to every layer checkpointed alone (see
    ``PredictionSession.plan_offsets``).  (0, 0, False) (logged) when the
    step cannot be simulated."""
    why_not = _planning.static_profiling_supported(model)
    if why_not is not None:
        logger.info("memscale: no OOM prediction for the engine: %s", why_not)
        return Offsets(0, 0, False, None)
    try:
        with predictor.PredictionSession(model, sample_input, optimizer, config=config) as session:
            offsets = session.plan_offsets(config, profile, fixed)
            fallback = bool(session._fallback.get(config))
            if fallback:
                logger.info(
                    "memscale: the budget planner's plans need more than "
                    "the budget when simulated; every layer is "
                    "checkpointed alone instead (that step fits)"
                )
            return Offsets(offsets[0], offsets[1], fallback, session.forced_peak)
    except Exception as exc:  # noqa: BLE001 - the engine's estimate stands
        logger.info(
            "memscale: the OOM predictor could not simulate a "
            "training step (%s: %s); the engine plans from its own "
            "estimate",
            type(exc).__name__,
            exc,
        )
        return Offsets(0, 0, False, None)


def verified_least_budget(
    model: torch.nn.Module,
    sample_input: Any,
    optimizer: torch.optim.Optimizer | None,
    profile: Profile,
    config: Config,
    hardware: dict[str, Any],
    fixed: int,
    offsets: Offsets,
    rounds: int = 3,
) -> int | None:
    """When no plan fits ``config``'s budget: the smallest budget the planner
    reaches, checked by planning at it with the corrections calibrated
    there (the calibration depends on the plan, so the least budget found
    under one budget's corrections can be short of another's).  None when a
    plan fits."""
    if offsets[2]:
        return None  # the fallback plan fits
    plan = _planning.make_plan(profile, config, hardware, fixed, *offsets[:2])
    if plan.fits or plan.skipped or plan.min_budget_bytes < 0:
        return None
    least = int(plan.min_budget_bytes)
    # Every layer checkpointed alone was simulated: that budget is reached.
    known = offsets.forced_peak
    for _ in range(rounds):
        if known is not None and least >= known:
            return known
        at = config.replace(memory_budget_gb=(least + 1) / GIB)
        there = predicted_offsets(model, sample_input, optimizer, profile, at, hardware, fixed)
        plan = _planning.make_plan(
            profile, _planning.fallback_config(at, there[2]), hardware, fixed, *there[:2]
        )
        if plan.fits:
            return least
        least = max(
            least + 1,
            int(plan.min_budget_bytes)
            if plan.min_budget_bytes >= 0
            else int(plan.peak_projected_bytes),
        )
    return least if known is None else min(least, known)
