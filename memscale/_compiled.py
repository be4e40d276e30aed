"""memscale under ``torch.compile``: the plan applied inside the compiled graph.

The executor carries out a plan through module hooks and saved-tensor
hooks at run time (``csrc/hooks.c``, ``csrc/frame.c``).  Dynamo cannot
trace those, and AOT autograd saves other tensors than an eager recompute
would, so under tracing every hook of memscale returns at once (see
``memscale._executor.Executor._pre``) and the plan takes this path
instead:

* every planning unit's ``forward`` is replaced, from ``wrap`` to
  ``detach``, by :func:`_unit_forward`.  In eager mode it calls the
  forward it replaced (the executor's hooks do the work, as always).
  While dynamo traces it (``torch.compiler.is_compiling()``), a unit the
  plan checkpoints runs its own forward through
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, which
  dynamo turns into its checkpoint higher-order op: the region is in the
  compiled graph, and AOT autograd's partitioner saves its inputs and
  recomputes the rest in backward, as the eager frame does;
* a unit the plan runs ``selective`` (``memscale._selective``) runs its
  forward through torch's selective checkpointing in eager mode; compiled,
  it is a checkpoint region (listed as a fallback: dynamo would trace the
  op policy, which reads each op's FLOPs);
* what the region carries is read from a :class:`_Regions` object, plain
  Python that dynamo guards on: a new plan (or ``detach``, which puts the
  forwards back) makes the compiled code recompile;
* what the plan does that cannot run compiled is listed per layer
  (:func:`fallbacks`, ``Executor.compile_fallbacks``), and logged once,
  all together, at the first trace under the plan: the layer is then only
  checkpointed (see ``docs/compile.md``).
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import weakref
from typing import Any, NamedTuple

import torch
from torch import nn

from . import _copying, _planning, _selective

logger = logging.getLogger(__name__)

__all__ = ["CompileFallback", "fallbacks", "install", "update"]


OFFLOAD = (
    "offload moves the layer's inputs to its tier through saved-tensor hooks "
    "and an I/O thread at run time, which a compiled graph cannot contain; "
    "compiled, the layer is checkpointed and its inputs stay in memory"
)
TILING = (
    "tiling runs the layer's forward slice by slice from C, which dynamo "
    "cannot trace; compiled, the layer runs whole, checkpointed"
)
SEGMENT = (
    "a checkpoint segment recomputes its layers from the first one's inputs "
    "across their separate calls, which one checkpoint region cannot span; "
    "compiled, each of its {n} layers is a checkpoint region of its own, and "
    "the {k} activations between them are kept"
)
SELECTIVE = (
    "selective checkpointing picks the ops to keep at run time, op by op, "
    "which a compiled graph does not do; compiled, the layer is a "
    "checkpoint region and AOT autograd's partitioner chooses what it keeps"
)
MIXED_PRECISION = (
    "mixed precision enters autocast in the model's forward pre-hook and "
    "leaves it in its forward hook, which dynamo cannot trace; compiled, the "
    "model runs in its own precision: call the compiled model under "
    "torch.autocast(...) yourself"
)


class CompileFallback(NamedTuple):
    """A part of the plan that is not applied under ``torch.compile``:
    ``layer`` (a unit's name, or ``""`` for the whole model), the
    ``technique`` ("offload", "tiling", "segment", "selective" or
    "mixed_precision") and
    why, with what runs instead (``reason``)."""

    layer: str
    technique: str
    reason: str

    def message(self) -> str:
        where = f"layer {self.layer!r}" if self.layer else "the model"
        return f"memscale: under torch.compile, {self.technique} of {where} is not applied: {self.reason}"


def fallbacks(plan: Any, mixed_precision: bool = False) -> tuple[CompileFallback, ...]:
    """What of ``plan`` is not applied when the model is compiled, one
    entry per layer and technique (``mixed_precision``: the executor enters
    autocast)."""
    found: list[CompileFallback] = []
    if mixed_precision:
        found.append(CompileFallback("", "mixed_precision", MIXED_PRECISION))
    if plan is None:
        return tuple(found)
    layers = plan.layers
    members = collections.Counter(
        layer.segment for layer in layers if "checkpoint" in layer.techniques
    )
    seen_segments: set[int] = set()
    for layer in layers:
        techniques = set(layer.techniques)
        if "selective" in techniques:
            found.append(CompileFallback(layer.name, "selective", SELECTIVE))
        if "checkpoint" not in techniques:
            continue
        if "offload" in techniques:
            found.append(CompileFallback(layer.name, "offload", OFFLOAD))
        if "tiling" in techniques or layer.tiles > 1:
            found.append(CompileFallback(layer.name, "tiling", TILING))
        seg = layer.segment
        if seg >= 0 and seg not in seen_segments:
            seen_segments.add(seg)
            n = members[seg]
            if n > 1:
                found.append(CompileFallback(layer.name, "segment", SEGMENT.format(n=n, k=n - 1)))
    return tuple(found)


# Messages logged at the first trace of a unit, by key (one per plan);
# dynamo calls _announce for real while tracing (assume_constant_result),
# never at run time.  Keys are dropped by update() and by detach.
_PENDING: dict[int, tuple[str, ...]] = {}
_KEYS = itertools.count(1)


@torch.compiler.assume_constant_result
def _announce(key: int) -> bool:
    """Log what of the plan of ``key`` is not applied compiled, once."""
    for line in _PENDING.pop(key, ()):
        logger.info("%s", line)
    return True


class _Region:
    """What the compiled path does for one unit under the current plan:
    ``checkpoint``, whether it runs as a checkpoint region; ``selective``,
    the threshold of a unit run selective (its level's,
    ``LayerPlan.selective_threshold``), or None.  One object per unit, read through the unit's own forward: when
    each block is compiled on its own, dynamo guards on these values, which
    are the same for blocks planned alike, so they share one graph."""

    __slots__ = ("checkpoint", "selective", "skip", "tail")

    def __init__(self) -> None:
        self.checkpoint = False
        self.selective: float | None = None
        # Where the unit's tail starts, and the calls the recompute does not
        # run, for a selective run (eager only).
        self.tail: tuple[str, int] | None = None
        self.skip: tuple[tuple[str, int], ...] = ()


class _Regions:
    """The units' regions, and ``announce``: the key of the current plan's
    notes (0: none), the same for every unit."""

    def __init__(self, n: int) -> None:
        self.units = tuple(_Region() for _ in range(n))
        self.announce = 0


def _unit_forward(unit: nn.Module, region: _Region, own: Any, regions: _Regions) -> Any:
    """The forward installed on a unit: its forward in eager mode (run
    selective when the plan says so), and in a checkpoint region while
    dynamo traces it and the plan checkpoints the unit or runs it
    selective (in training, with gradients on: what opens an eager frame).  Its
    forward is ``own`` (the instance's own, set before wrap), or when None its
    class's, looked up at each call: a class patched after ``wrap`` is seen,
    as it would be without memscale."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        inner = own if own is not None else functools.partial(type(unit).forward, unit)
        if torch.compiler.is_compiling():
            key = regions.announce
            if key:
                _announce(key)
            if region.checkpoint and unit.training and torch.is_grad_enabled():
                return _selective.checkpoint_call(inner, args, kwargs)
            return inner(*args, **kwargs)
        limit = region.selective
        if limit is not None and unit.training and torch.is_grad_enabled():
            return _selective.run(inner, limit, args, kwargs, region.tail, unit, region.skip)
        return inner(*args, **kwargs)

    return forward


def install(executor: Any, units: list[tuple[str, nn.Module]]) -> None:
    """Give every unit the forward of the compiled path (put back by
    ``detach``); no region until :func:`update` gives a plan.  Runs before
    any other forward of memscale's is installed (tiling, the recompute
    check), so that those wrap this one and it calls the unit's own."""
    regions = _Regions(len(units))
    executor.__dict__["_compile_regions"] = regions
    ref = weakref.ref(executor)

    def drop_notes() -> None:
        ex = ref()
        if ex is not None:
            _PENDING.pop(ex.__dict__.get("_compile_regions", regions).announce, None)

    executor.on_detach(drop_notes)
    for region, (_, unit) in zip(regions.units, units):
        _copying.set_forward(
            executor, unit, functools.partial(_unit_forward, unit, region, regions=regions)
        )


def update(executor: Any, plan: Any) -> None:
    """The compiled path follows ``plan`` (a new plan: the compiled code
    recompiles); ``executor.compile_fallbacks`` says what of it is not
    applied compiled, logged at the first trace under the plan."""
    regions = executor.__dict__.get("_compile_regions")
    found = fallbacks(plan, executor.autocast is not None)
    executor.__dict__["compile_fallbacks"] = found
    if regions is None:
        return
    _PENDING.pop(regions.announce, None)
    regions.announce = 0
    if found:
        regions.announce = next(_KEYS)
        _PENDING[regions.announce] = tuple(note.message() for note in found)
    layers = plan.layers if plan is not None else ()
    # The profile the plan was made from says where each unit's tail starts
    # (its selective levels keep nothing from there on).
    profile = getattr(executor, "profile", None)
    details = profile.details if profile is not None else ()
    for i, region in enumerate(regions.units):
        techniques = set(layers[i].techniques) if i < len(layers) else set()
        region.checkpoint = bool({"checkpoint", "selective"} & techniques)
        region.selective = layers[i].selective_threshold if "selective" in techniques else None
        profiled = region.selective is not None and i < len(details)
        region.tail = _planning.tail_from(details[i]) if profiled else None
        region.skip = _planning.skips_from(details[i], region.selective) if profiled else ()
