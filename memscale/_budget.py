"""The error ``wrap`` raises when no plan fits the memory budget.

The budget planner (``csrc/solver.c``) reports the smallest budget it can
reach with the techniques the Config allows (``Plan.min_budget_bytes``;
``memscale._planner.least_budget`` asks it for other engine inputs).
This module turns that into an error that says what the budget is, what
memscale can reach, and which Config changes would lower that, each with
the smallest budget the planner finds with the change made.
"""

from __future__ import annotations

from typing import Any

from . import _core
from ._format import format_bytes
from ._planner import least_budget
from ._solve import PlanProblem
from .config import Config


class MemoryBudgetError(ValueError):
    """No plan fits the memory budget.  ``budget_bytes`` is the budget,
    ``min_budget_bytes`` the smallest one memscale can reach for this model
    and batch with the Config as given, ``suggestions`` a list of
    (change, smallest budget with it) pairs."""

    def __init__(
        self,
        message: str,
        budget_bytes: int,
        min_budget_bytes: int,
        suggestions: list[tuple[str, int]],
    ) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        self.suggestions = suggestions


def _gib(n: float) -> str:
    return format_bytes(n, digits=1)


def suggestions(
    problem: PlanProblem,
    config: Config,
    optimizer_state_bytes: int,
    floor_savings: list[tuple[str, int]] | None = None,
) -> list[tuple[str, int]]:
    """Config changes that lower the smallest reachable budget, with it.
    ``floor_savings``: the below-the-floor changes, each with the bytes it
    takes off the step's fixed bytes (``_model.floor_options``)."""
    out: list[tuple[str, int]] = []
    for what, saved in floor_savings or ():
        out.append(
            (what, least_budget(problem.replace(fixed_bytes=max(0, problem.fixed_bytes - saved))))
        )
    allowed = problem.allowed
    if not allowed & _core.TECH_OFFLOAD and (
        problem.offload.host_tier or problem.offload.disk_tier
    ):
        what = (
            "mode=OptimizationMode.BALANCED (offload)"
            if config.enable_offloading
            else "enable_offloading=True"
        )
        mode = "balanced" if problem.mode == "conservative" else problem.mode
        out.append(
            (
                what,
                least_budget(
                    problem.replace(
                        mode=mode,
                        allowed=allowed
                        | _core.TECH_OFFLOAD
                        | (_core.TECH_CHECKPOINT if config.enable_checkpointing else 0),
                    )
                ),
            )
        )
    if not allowed & _core.TECH_TILING:
        out.append(
            (
                "enable_tiling=True",
                least_budget(problem.replace(allowed=allowed | _core.TECH_TILING)),
            )
        )
    if not config.use_mixed_precision:
        out.append(
            (
                "use_mixed_precision=True (activations in 16 bits, about half)",
                least_budget(problem.scaled_activations(0.5)),
            )
        )
    if not config.use_8bit_optimizer and optimizer_state_bytes > 0:
        saved = int(optimizer_state_bytes * (1 - 2.125 / 8))
        out.append(
            (
                "the 8-bit optimizer (use_8bit_optimizer=True with your "
                "optimizer, or memscale.apply_all_optimizations)",
                least_budget(problem.replace(fixed_bytes=max(0, problem.fixed_bytes - saved))),
            )
        )
    out.append(
        (
            "half the batch size (activations scale with it)",
            least_budget(problem.scaled_activations(0.5)),
        )
    )
    return out


def fails(plan: Any) -> bool:
    """Whether the planner found no plan for the budget (:func:`check`
    raises then)."""
    return not (plan.fits or plan.skipped or plan.min_budget_bytes < 0)


def check(
    plan: Any,
    problem: PlanProblem,
    config: Config,
    optimizer_state_bytes: int,
    least: int | None = None,
    floor_savings: list[tuple[str, int]] | None = None,
) -> None:
    """Raise :class:`MemoryBudgetError` when the planner found no plan.
    ``least``: the least budget as checked by simulation (wrap with a
    sample_input), else the planner's own figure is reported."""
    if not fails(plan):
        return
    budget = int(plan.budget_bytes)
    planner_least = int(plan.min_budget_bytes)
    least = planner_least if least is None else max(int(least), budget + 1)
    # A change is suggested only where the planner's figure with it is below
    # its own figure without it (two figures of one model); the figure shown
    # carries the same correction as ``least`` (the simulated step's excess
    # over the planner, when a sample_input was given).
    correction = least - planner_least
    tips = [
        (what, b + correction)
        for what, b in suggestions(problem, config, optimizer_state_bytes, floor_savings)
        if b < planner_least
    ]
    lines = [f"  - {what}: {_gib(b)}" for what, b in tips]
    source = (
        "Config.memory_budget_gb"
        if config.memory_budget_gb is not None
        else f"the device's capacity x target_gpu_utilization ({config.target_gpu_utilization})"
    )
    message = (
        f"memscale: no plan fits the memory budget of {_gib(budget)} ({source}). "
        f"The smallest budget memscale can reach for this model and batch is "
        f"{_gib(least)} (unoptimized: {_gib(plan.peak_unoptimized_bytes)}), "
        f"with mode {plan.mode} and the techniques your Config allows."
    )
    if lines:
        message += (
            " Config changes that lower it (the planner's estimate with each):\n" + "\n".join(lines)
        )
    else:
        message += (
            " No Config change lowers it further: raise the budget or "
            "make the model or the batch smaller."
        )
    raise MemoryBudgetError(message, budget, least, tips)
