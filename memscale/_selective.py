"""Selective checkpointing inside a layer: keep the costly ops' outputs,
recompute the cheap ones in backward.

A layer the plan runs ``selective`` (``_core.TECH_SELECTIVE``) runs its
forward through ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
with ``create_selective_checkpoint_contexts``: its inputs are held, the
outputs of the ops the policy saves are kept, and every other op is run
again in backward from them.  The C executor treats the layer as kept (no
frame of its own); the forward is installed per unit by
``memscale._compiled`` (``_unit_forward``), from ``wrap`` to ``detach``.

Which ops are kept: those that cost more FLOPs per byte they write than
the layer as a whole (its forward FLOPs over the bytes it saves for
backward, the layer's *threshold*).  Keeping such an output costs fewer
bytes per FLOP it spares than checkpointing the whole layer does; the rest
(norms, activations, softmax, dropout, residual adds, reshapes) is
recomputed.  FLOPs are ``torch.utils.flop_counter``'s formulas (matmuls,
convolutions, attention); an op without one counts as cheap.  An op that
draws random numbers (``nondeterministic_seeded``, such as dropout) is
never kept: it is recomputed with the RNG state the checkpoint restores,
so its masks are the same, and the gradients are bitwise those of the
unwrapped layer (the recompute runs the same kernels on the same values).
A layer whose forward writes its own buffers or parameters in place
(BatchNorm's running statistics) never runs selective: torch's
checkpoint would write them again in the recompute.

Profiling (:class:`OpRecorder`) runs in the same fake-tensor forward as
the C profiler: per unit, each op's FLOPs, the bytes of its new outputs
and whether it is random.  :func:`layer_profile` turns that into the
layer's selective figures for the planner (``LayerStats``'s
``selective_saved_bytes`` and ``selective_flops``: the bytes kept besides
the input, and the recompute cost, FLOPs of the recomputed ops plus one
per element an op without a FLOP formula writes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, checkpoint
from torch.utils.flop_counter import flop_registry

from . import _torch_compat

__all__ = ["LayerOps", "OpRecorder", "layer_profile", "recorder", "run", "threshold"]


def _outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


# torch's TorchDispatchMode, looked up once (None in a torch without it:
# no selective profile is recorded, and no layer runs selective).
_DispatchMode: type = _torch_compat.dispatch_mode_base() or object


def op_cost(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[float, int, int, bool]:
    """One call's (FLOPs, bytes of its new outputs, their elements,
    whether it draws random numbers)."""
    random = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
    if not _torch_compat.op_writes_new(func):
        return 0.0, 0, 0, random
    tensors = _outputs(out)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    numel = sum(t.numel() for t in tensors)
    packet = _torch_compat.op_packet(func)
    count = flop_registry.get(packet) if packet is not None else None
    flops = float(count(*args, **kwargs, out_val=out)) if count is not None else 0.0
    return flops, nbytes, numel, random


def keeps(threshold: float, flops: float, nbytes: int, random: bool) -> bool:
    """The policy: keep an op's output when it is not random and costs at
    least ``threshold`` FLOPs per byte written."""
    return not random and flops > 0.0 and nbytes > 0 and flops >= threshold * nbytes


@dataclass
class LayerOps:
    """What the ops of one unit's forward cost: per call (FLOPs, bytes,
    elements, random); ``updates_state``: an op wrote one of the unit's
    buffers or parameters in place (BatchNorm's running statistics);
    ``mutated``: the indices of the calls whose outputs a later op of the
    unit writes in place or through ``out=`` (``nn.ReLU(inplace=True)``
    after a Linear)."""

    calls: list[tuple[float, int, int, bool]]
    updates_state: bool = False
    mutated: set[int] = field(default_factory=set)


class OpRecorder(_DispatchMode):
    """Records, per planning unit, the cost of every op its forward runs
    (while entered; the unit is known from forward hooks on the units,
    removed by :meth:`close`).  Use :func:`recorder`, which is None where
    torch has no dispatch modes."""

    def __init__(self, units: list[nn.Module]) -> None:
        super().__init__()
        self.ops = [LayerOps([]) for _ in units]
        self._current: int | None = None
        self._state: set[int] = set()  # ids of the current unit's buffers and parameters
        self._producer: dict[int, int] = {}  # storage -> index of the call that wrote it new
        self._handles: list[Any] = []
        for i, unit in enumerate(units):
            self._handles.append(unit.register_forward_pre_hook(functools.partial(self._enter, i)))
            self._handles.append(unit.register_forward_hook(self._leave, always_call=True))

    def _enter(self, index: int, module: nn.Module, args: Any) -> None:
        self._current = index
        self._state = {id(t) for t in (*module.buffers(), *module.parameters())}
        self._producer = {}

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        self._current = None
        self._producer = {}

    def close(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        index = self._current
        if index is not None and func not in SAC_IGNORED_OPS:
            ops = self.ops[index]
            written = [
                t
                for t in _torch_compat.op_written_args(func, args, kwargs)
                if isinstance(t, torch.Tensor)
            ]
            if any(id(t) in self._state for t in written):
                ops.updates_state = True
            for t in written:
                # A kept output written later would be the mutated value in
                # the recompute (torch refuses it): note which call made it.
                producer = self._producer.get(_torch_compat.storage_key(t))
                if producer is not None:
                    ops.mutated.add(producer)
            if _torch_compat.op_writes_new(func):
                for t in _outputs(out):
                    self._producer[_torch_compat.storage_key(t)] = len(ops.calls)
            ops.calls.append(op_cost(func, args, kwargs, out))
        return out


def recorder(units: list[nn.Module]) -> OpRecorder | None:
    """An :class:`OpRecorder` of ``units``, or None where torch has no
    dispatch modes or cannot run selective checkpointing
    (``_torch_compat.selective_supported``)."""
    if _torch_compat.dispatch_mode_base() is None or not _torch_compat.selective_supported():
        return None
    return OpRecorder(units)


def threshold(flops: float, saved_bytes: int) -> float:
    """A layer's threshold: its forward FLOPs per byte it saves for
    backward (from its LayerStats, or its LayerPlan at run time)."""
    return flops / saved_bytes if saved_bytes > 0 else float("inf")


def layer_profile(ops: LayerOps, flops: float, saved_bytes: int) -> tuple[int, float] | None:
    """The bytes of the outputs the layer keeps run selective, and what its
    recompute costs; None when nothing was measured, or when its forward
    updates its own state (a recompute would update it again: torch's
    checkpoint does not put buffers back)."""
    if not ops.calls or saved_bytes <= 0 or ops.updates_state:
        return None
    limit = threshold(flops, saved_bytes)
    kept = 0
    cost = 0.0
    for i, (op_flops, nbytes, numel, random) in enumerate(ops.calls):
        if keeps(limit, op_flops, nbytes, random):
            if i in ops.mutated:
                return None
            kept += nbytes
        else:
            cost += op_flops if op_flops > 0.0 else float(numel)
    return kept, cost


def _policy(threshold: float) -> Any:
    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        flops, nbytes, _, random = op_cost(func, args, kwargs, ctx.op_output)
        if keeps(threshold, flops, nbytes, random):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def run(forward: Any, threshold: float, args: tuple, kwargs: dict) -> Any:
    """``forward(*args, **kwargs)`` checkpointed selectively: the outputs of
    ops the layer's ``threshold`` keeps are kept, the rest recomputed in
    backward (RNG state restored, so random ops draw the same).  Each
    backward of a ``retain_graph=True`` graph recomputes from the same kept
    outputs (``_torch_compat.selective_contexts``)."""
    policy = _policy(threshold)
    return checkpoint(
        forward,
        *args,
        use_reentrant=False,
        context_fn=functools.partial(_torch_compat.selective_contexts, policy),
        **kwargs,
    )
