"""Activation tiling: which layers may run in tiles, and along which axis.

A tiled layer runs its input in ``tiles`` consecutive slices along the
batch or the sequence dimension inside its checkpoint frame; backward
recomputes one tile at a time, so only one tile's intermediate
activations are alive at once (``csrc/exec_tiling.c``, ``csrc/tiling.c``).
That is only correct for a layer whose output rows depend on its input
rows alone.  This module decides, per layer:

* **Known structure**: a row-independent leaf (``Linear``, the norms over
  the last dimension, elementwise activations, ``Identity``) or an
  ``nn.Sequential`` built only of them is tiled without a check.
* **Declared**: :func:`declare_row_independent` on a module or a class
  (for a custom MLP block, say) is taken at its word.
* **Anything else** is verified the first time it runs tiled: the layer
  runs untiled and tiled (no grad, same RNG state, buffers restored) on
  that very input and is tiled only if the outputs agree (float32: within
  1e-5 relative) and the layer draws no random numbers (dropout would draw
  different masks per tile, so its result would change).  Otherwise it is
  checkpointed whole, and that is logged once.  The sequence dimension is
  tried first (more tiles at small batch), then the batch.

Layers holding batch-norm, or dropout with ``p > 0``, are never candidates
unless declared: the first couples the rows of a batch, the second would
change its random masks.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any

import torch
from torch import nn

from . import _attention, _copying, _core
from ._verify import max_difference, named_tensors, rng_state, set_rng_state

logger = logging.getLogger(__name__)

__all__ = ["declare_row_independent", "is_candidate"]

# Leaves whose output row i depends on input row i only (rows: every
# dimension but the last).
_ROW_LEAVES: tuple[type, ...] = (
    nn.Linear,
    nn.LayerNorm,
    nn.Identity,
    nn.GELU,
    nn.ReLU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Mish,
    nn.LeakyReLU,
    nn.ELU,
    nn.Softplus,
    nn.Hardswish,
    nn.ReLU6,
    nn.GLU,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())

_BATCH_COUPLED: tuple[type, ...] = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)

_declared_modules: weakref.WeakKeyDictionary[nn.Module, int | None] = weakref.WeakKeyDictionary()
_declared_classes: dict[type, int | None] = {}

# Relative tolerance of the verification, by the output's dtype.
_RTOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def declare_row_independent(target: nn.Module | type, dim: int | None = None) -> None:
    """Declare that ``target`` (a module, or every instance of a module
    class) computes each output row from the same input row alone, so
    memscale may tile it without verifying it.  ``dim`` is the dimension
    to tile (default: 1, the sequence, for inputs of 3 or more
    dimensions, else 0).  Applies to plans made after the call."""
    if dim is not None and not (isinstance(dim, int) and dim >= 0):
        raise ValueError(f"dim must be an int >= 0 or None, got {dim!r}")
    if isinstance(target, nn.Module):
        _declared_modules[target] = dim
    elif isinstance(target, type) and issubclass(target, nn.Module):
        _declared_classes[target] = dim
    else:
        raise TypeError(
            "declare_row_independent() takes an nn.Module or an "
            f"nn.Module subclass, got {type(target).__name__}"
        )


def _declared(unit: nn.Module) -> tuple[bool, int | None]:
    if unit in _declared_modules:
        return True, _declared_modules[unit]
    for cls in type(unit).__mro__:
        if cls in _declared_classes:
            return True, _declared_classes[cls]
    return False, None


def _structural(unit: nn.Module) -> bool:
    if isinstance(unit, _ROW_LEAVES):
        return True
    if type(unit) is nn.Sequential:
        return all(_structural(m) for m in unit)
    return isinstance(unit, nn.Dropout) and unit.p == 0


def is_candidate(unit: nn.Module) -> bool:
    """Whether the engine may plan to tile ``unit`` (it is still verified
    when it first runs, unless its structure or a declaration says it is
    row-independent)."""
    if _declared(unit)[0]:
        return True
    if unit._forward_hooks or unit._forward_pre_hooks:
        # A hook around it may save tensors outside the tiles.
        return False
    for m in unit.modules():
        if isinstance(m, _BATCH_COUPLED):
            return False
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return False
    return True


def _lead(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    return None


def _default_dim(x: torch.Tensor) -> int:
    return 1 if x.dim() >= 3 else 0


def _disagreement(
    unit: nn.Module, forward: Any, args: tuple, kwargs: dict, dim: int, tiles: int
) -> str | None:
    """None when tiling ``unit`` along ``dim`` gives its untiled output on
    this input, else why not.  Leaves RNG streams and buffers as found."""
    rng = rng_state()
    buffers = [(b, b.detach().clone()) for b in unit.buffers()]
    try:
        with torch.no_grad():
            before = torch.get_rng_state()
            cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
            ref = forward(*args, **kwargs)
            if not torch.equal(before, torch.get_rng_state()) or (
                cuda is not None
                and any(not torch.equal(a, b) for a, b in zip(cuda, torch.cuda.get_rng_state_all()))
            ):
                return "it draws random numbers (dropout?), which tiling would change"
            set_rng_state(rng)
            for b, saved in buffers:
                b.copy_(saved)
            tiled = _core.tile_call(forward, args, kwargs, dim, tiles)
    except Exception as exc:  # noqa: BLE001 - the reason is the answer
        return f"the tiled call raised {type(exc).__name__}: {exc}"
    finally:
        set_rng_state(rng)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    want, got = named_tensors(ref), named_tensors(tiled)
    if [n for n, _ in want] != [n for n, _ in got]:
        return "its tiled output has a different structure"
    for (name, a), (_, b) in zip(want, got):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{name}: shape or dtype differs when tiled"
        if not a.is_floating_point():
            if not torch.equal(a, b):
                return f"{name} differs when tiled"
            continue
        rtol = _RTOL.get(a.dtype, 1e-5)
        scale = float(a.detach().abs().max()) if a.numel() else 0.0
        absolute, _ = max_difference(b, a)
        if absolute > rtol * max(scale, torch.finfo(a.dtype).tiny):
            return (
                f"{name} differs by {absolute:.3g} when tiled (largest "
                f"value {scale:.3g}, tolerance {rtol:g} relative)"
            )
    return None


def verify(unit: nn.Module, forward: Any, args: tuple, kwargs: dict, tiles: int) -> int | None:
    """The executor's tile verifier, called at a tiled layer's first tiled
    call: the dimension to tile ``unit`` along, None to checkpoint it whole
    from now on, or -1 when this input cannot tell (no dimension with two
    or more rows): the call runs whole and the next one asks again."""
    x = _lead(args, kwargs)
    if x is None:
        logger.info("memscale: %s is not tiled: it has no tensor input", type(unit).__name__)
        return None
    declared, dim = _declared(unit)
    if declared or _structural(unit):
        return dim if dim is not None else _default_dim(x)
    candidates = [d for d in ((1, 0) if x.dim() >= 3 else (0,)) if x.shape[d] >= 2]
    if not candidates:
        return -1
    reasons = []
    for dim in candidates:
        # As many tiles as the call will make (no more than rows).
        why = _disagreement(unit, forward, args, kwargs, dim, min(tiles, int(x.shape[dim])))
        if why is None:
            logger.info(
                "memscale: %s verified row-independent along dim %d; tiled in %d",
                type(unit).__name__,
                dim,
                tiles,
            )
            return dim
        reasons.append(f"dim {dim}: {why}")
    logger.warning(
        "memscale: %s is not tiled (checkpointed whole instead): "
        "%s. If it is row-independent, say so with "
        "memscale.tiling.declare_row_independent().",
        type(unit).__name__,
        "; ".join(reasons),
    )
    return None


class _TiledForward:
    """The forward of a tiled layer: ``tiled`` (the executor's
    ``_TiledForward``, whose attributes it shows, such as the ``dim`` its
    tiles run along); under ``torch.compile``, which cannot trace it,
    ``whole``, the layer's forward untiled (``memscale._compiled``
    checkpoints it and lists tiling as not applied)."""

    def __init__(self, tiled: Any, whole: Any) -> None:
        self.tiled = tiled
        self.whole = whole

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.whole(*args, **kwargs)
        return self.tiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("tiled", "whole"):  # not set yet (copying, pickling)
            raise AttributeError(name)
        return getattr(self.tiled, name)


def _unmeasured_verifier(executor: Any) -> Any:
    """:func:`verify`, whose runs of the layer count in no FLOPs of a step
    measured under the plan (``Executor.unmeasured``)."""
    ref = weakref.ref(executor)

    def verifier(unit: nn.Module, forward: Any, args: tuple, kwargs: dict, tiles: int) -> Any:
        ex = ref()
        with contextlib.nullcontext() if ex is None else ex.unmeasured():
            return verify(unit, forward, args, kwargs, tiles)

    return verifier


def install(executor: Any, units: list[tuple[str, nn.Module]], plan: Any) -> None:
    """Give each layer the plan tiles a tiled forward (restored by
    ``detach``) and the executor its verifier."""
    tiled = [i for i, layer in enumerate(plan.layers) if layer.tiles > 1]
    if not tiled:
        return
    model = executor.model
    if model is not None:
        # Inside the tiled blocks, attention over query tiles too.
        _attention.attach(executor, model, max(plan.layers[i].tiles for i in tiled))
    executor.set_tile_verifier(_unmeasured_verifier(executor))
    for i in tiled:
        unit = units[i][1]

        def tiled_forward(_: Any, unit: nn.Module = unit, i: int = i) -> _TiledForward:
            return _TiledForward(executor.tiled_forward(i, unit.forward), unit.forward)

        _copying.set_forward(executor, unit, tiled_forward)


def layer_flags(units: list[tuple[str, nn.Module]]) -> list[int]:
    """The profiler's flag bit for each unit that may be tiled."""
    return [_core.LAYER_TILEABLE if is_candidate(m) else 0 for _, m in units]
