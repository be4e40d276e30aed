"""The planning problem as one value, and the one call of the C planner.

A :class:`PlanProblem` holds everything the decision engine decides on:
the profiled layers (``_core.LayerStats``), the step's fixed and
activation bytes, the device's figures, the budget and the techniques the
Config allows, the OOM predictor's corrections, the offload tiers and the
budget planner's cost model.  :func:`solve` hands it to
``_core.build_plan`` and returns the immutable ``_core.Plan``; no other
module calls the C planner (``tests/test_imports.py`` checks).

A problem is plain data: ranks exchange it pickled
(``_distributed.shared_plan``), and variants of it are made with
:meth:`PlanProblem.replace` (the least budget, a Config change the budget
error suggests, a layer the first step found unrepeatable).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from . import _core


@dataclass(frozen=True, slots=True)
class OffloadInputs:
    """Where checkpointed layers' inputs may wait for backward."""

    min_offload_bytes: int = 0  # inputs smaller than this stay on the device
    host_tier: bool = False  # host RAM of a GPU
    host_cap_bytes: int = -1  # cap on the host tier, -1 for none
    disk_tier: bool = True  # spill files


@dataclass(frozen=True, slots=True)
class SolverInputs:
    """The budget planner's cost model (``csrc/solver.c``): what a
    recomputed FLOP, an offloaded byte and a tile call cost, and the size
    of its search."""

    flop_rate: float  # forward FLOP/s
    offload_bandwidth: float  # bytes/s to the offload tier
    async_offload: bool  # transfers overlap compute
    tile_overhead: float  # seconds per extra call of a tiled layer
    max_segment: int  # longest checkpoint segment considered
    resolution: int  # memory buckets of the dynamic program


@dataclass(frozen=True, slots=True)
class PlanProblem:
    """Everything one plan is decided on.  Without ``solver`` the engine's
    greedy rules plan; with it, the budget planner."""

    layers: tuple[_core.LayerStats, ...]
    mode: str  # "conservative", "balanced" or "aggressive"
    allowed: int  # the _core.TECH_* bits the engine may use
    force: bool  # Config.force_optimize: no smart-skip
    budget_bytes: int
    fixed_bytes: int  # parameters, buffers, gradients, optimizer state
    activation_bytes: int  # saved for backward by an unoptimized step
    total_flops: float  # forward FLOPs of the whole model
    device: str  # the device type
    device_count: int
    capacity_bytes: int  # memory of one device
    peak_offset_bytes: int = 0  # the OOM predictor's correction of the peak
    plan_offset_bytes: int | None = None  # ... of plans' peaks (None: the same)
    offload: OffloadInputs = OffloadInputs()
    solver: SolverInputs | None = None

    def replace(self, **changes: Any) -> PlanProblem:
        """A copy with ``changes`` made; this problem is unchanged."""
        return dataclasses.replace(self, **changes)

    def with_layer_flags(self, indices: Iterable[int], flags: int) -> PlanProblem:
        """A copy whose layers at ``indices`` have ``flags`` set too."""
        chosen = set(indices)
        return self.replace(
            layers=tuple(
                layer_stats((*layer[:6], layer.flags | flags), layer) if i in chosen else layer
                for i, layer in enumerate(self.layers)
            )
        )

    def scaled_activations(self, factor: float) -> PlanProblem:
        """A copy with every activation figure (each layer's saved and
        input bytes, the step's activation bytes) times ``factor``."""
        return self.replace(
            layers=tuple(
                layer_stats(
                    (
                        layer.name,
                        layer.kind,
                        layer.param_bytes,
                        int(layer.saved_bytes * factor),
                        int(layer.input_bytes * factor),
                        layer.flops,
                        layer.flags,
                    ),
                    layer,
                    factor,
                )
                for layer in self.layers
            ),
            activation_bytes=int(self.activation_bytes * factor),
        )


def layer_stats(
    fields: tuple[Any, ...],
    like: _core.LayerStats | None = None,
    factor: float = 1.0,
    *,
    backward_bytes: int | None = None,
) -> _core.LayerStats:
    """A ``LayerStats`` of the seven tuple ``fields``, with the fields
    ``like`` has by name only: its selective profile, its
    ``recompute_cost``, its tail (``tail_flops``, ``tail_cost``) and its
    per-layer ``backward_bytes`` (bytes times ``factor``);
    ``backward_bytes`` given here replaces the latter."""
    named: dict[str, Any] = {}
    if like is not None and like.selective_levels is not None:
        named["selective_levels"] = (
            like.selective_levels
            if factor == 1.0  # (as they are: with_frame_bytes copies every layer)
            else tuple((t, int(kept * factor), cost) for t, kept, cost in like.selective_levels)
        )
    if like is not None and like.recompute_cost is not None:
        named["recompute_cost"] = like.recompute_cost
    if like is not None and like.tail_flops is not None:
        # A part of the recompute: no more than the whole of ``fields``
        # (whose FLOPs may be another pass's).
        flops = float(fields[5])
        named["tail_flops"] = min(like.tail_flops, flops)
        if like.tail_cost is not None:
            named["tail_cost"] = min(like.tail_cost, named.get("recompute_cost") or flops)
    if backward_bytes is None and like is not None and like.backward_bytes is not None:
        backward_bytes = int(like.backward_bytes * factor)
    if backward_bytes is not None:
        named["backward_bytes"] = backward_bytes
    return _core.LayerStats(fields, named) if named else _core.LayerStats(fields)


def _keywords(problem: PlanProblem) -> dict[str, Any]:
    """``problem`` as ``_core.build_plan``'s keywords."""
    kw: dict[str, Any] = {
        "mode": problem.mode,
        "allowed": problem.allowed,
        "force": problem.force,
        "budget_bytes": problem.budget_bytes,
        "fixed_bytes": problem.fixed_bytes,
        "activation_bytes": problem.activation_bytes,
        "total_flops": problem.total_flops,
        "device": problem.device,
        "device_count": problem.device_count,
        "capacity_bytes": problem.capacity_bytes,
        "peak_offset_bytes": problem.peak_offset_bytes,
        "plan_offset_bytes": problem.plan_offset_bytes,
        **dataclasses.asdict(problem.offload),
    }
    if problem.solver is not None:
        kw.update(solver=True, **dataclasses.asdict(problem.solver))
    return kw


def solve(problem: PlanProblem) -> _core.Plan:
    """The engine's plan for ``problem``."""
    return _core.build_plan(problem.layers, **_keywords(problem))
