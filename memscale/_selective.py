"""Selective checkpointing inside a layer: keep the costly ops' outputs,
recompute the cheap ones in backward.

A layer the plan runs ``selective`` (``_core.TECH_SELECTIVE``) runs its
forward through ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
with memscale's own two dispatch modes as its ``context_fn``
(:func:`contexts`: the forward's keeps the outputs the policy keeps, the
recompute's hands them back by operator and call index, as torch's
``create_selective_checkpoint_contexts`` does, without its private cache,
so any torch from 2.4 runs it): its inputs are held, the outputs of the
ops the policy keeps are kept, and every other op is run again in
backward from them.  The C executor treats the layer as kept (no
frame of its own); the forward is installed per unit by
``memscale._compiled`` (``_unit_forward``), from ``wrap`` to ``detach``.

Which ops are kept: those whose FLOPs per byte written reach the
threshold of the layer's *level*.  The profile offers the planner a small
ladder of levels per layer (:func:`layer_profile`): the ops with a FLOP
formula sorted by FLOPs per byte, each level a prefix of that order (it
keeps every op at or above its threshold), from the costliest ops only up
to every op with a formula (no counted FLOPs recomputed, the most bytes
kept), and always the level at the layer's own threshold (its forward
FLOPs over the bytes it saves for backward: keeping such an output costs
fewer bytes per FLOP it spares than checkpointing the whole layer does).
The solver picks one level per layer, or none (``LayerPlan.selective_level``
and ``selective_threshold``).  The rest (norms, activations, softmax,
dropout, residual adds, reshapes) is recomputed, except the matrix
products whose output nothing autograd saved reads and no op before the
tail reads but to view it (``_dataflow.dead_calls``, on a fake-tensor profile
only: GPT-2's MLP output projection, read only by the dropout after it):
no level keeps them, and the recompute does not run them (the level's
``skip``, :func:`level_skips`; :class:`_RecomputeMode` hands back an
unwritten tensor of the output's shape where the forward found the
profile right, and runs the product after all if an op that runs reads
it).  FLOPs are
``torch.utils.flop_counter``'s formulas (matmuls, convolutions,
attention; not the CPU's attention kernel, which torch's counter has
no formula for); an op without one counts as cheap.  An op that draws
random numbers (``nondeterministic_seeded``, such as dropout; an
attention kernel only when its ``dropout_p`` is above 0) is recomputed
with the RNG state the checkpoint restores, so its masks are the same,
and the gradients are bitwise those of the unwrapped layer (the
recompute runs the same kernels on the same values).  Such an op may
still be kept where it has a FLOP formula and draws from the default
generator of a CPU or CUDA device (a fused attention kernel with dropout
on CUDA, whose outputs carry the seed and offset its backward draws the
mask again from): the forward records the generator's state right after
the call, and the recompute, which does not run it, sets the generator
to that state, so every later random op draws what it drew in the
forward (``memscale._generators``; on the CPU the state's bytes count
as kept).  Dropout itself has no FLOP formula: it is never kept.
A layer whose forward writes its own buffers or parameters in place
(BatchNorm's running statistics) never runs selective: torch's
checkpoint would write them again in the recompute.

Profiling (:class:`OpRecorder`) runs in the same fake-tensor forward as
the C profiler: per unit, each op's FLOPs, its class (:func:`op_class`),
the bytes of its new outputs and whether it is random.
:func:`layer_profile` turns that into the layer's levels for the planner
(``LayerStats.selective_levels``: per level its threshold, the bytes kept
besides the input, and the recompute cost, in FLOPs at the matmul rate:
the recomputed ops' FLOPs at their class's rate, and the elements an op
without a FLOP formula writes at the element rate, one FLOP each with
the default costs: a level that keeps more recomputes less), and
:func:`recompute_cost` into what recomputing the whole layer costs.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.modules import module as _module
from torch.utils import _pytree as pytree
from torch.utils import checkpoint as _checkpoint_module
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint

from . import _dataflow, _generators, _torch_compat
from ._tree import tensor_list

logger = logging.getLogger(__name__)

__all__ = [
    "ATTENTION",
    "CONV",
    "MATMUL",
    "MAX_LEVELS",
    "UNWEIGHTED",
    "LayerOps",
    "OpRecorder",
    "Weights",
    "layer_profile",
    "op_class",
    "recompute_cost",
    "recorder",
    "run",
    "tail_of",
    "threshold",
]

# The most levels a layer offers the planner (the C solver's MS_SEL_LEVELS).
MAX_LEVELS = 8


def _outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


# torch's TorchDispatchMode, looked up once (None in a torch without it:
# no selective profile is recorded, and no layer runs selective).
_DispatchMode: type = _torch_compat.dispatch_mode_base() or object

# Ops a selective checkpoint passes through without counting them: torch's
# checkpoint runs a different number of ``detach`` calls in forward and
# recompute, and its determinism check asks ``prim.device`` (torch's own
# SAC_IGNORED_OPS, where this torch has it, adds the metadata ops of
# functional tensors).
IGNORED_OPS = frozenset(
    {torch.ops.aten.detach.default, torch.ops.prim.device.default}
    | set(getattr(_checkpoint_module, "SAC_IGNORED_OPS", ()))
)

# A dtype or device cast, never kept (it has no FLOP formula).  The
# selective modes do not count its calls either: autocast casts a weight
# once per autocast region and reuses the cast, and the recompute runs in
# a region of its own, so a weight the forward found cast already (used
# earlier in the same region: tied weights, a module called twice) is cast
# again there; counted, that extra call was a mismatch.
_CAST = torch.ops.aten._to_copy.default


# Attention kernels tagged ``nondeterministic_seeded`` for their dropout
# alone: they take the generator only when ``dropout_p`` is above 0, so
# a call with ``dropout_p == 0`` draws nothing and its output may be kept
# (a recompute that skips it leaves every later random op's draw as it
# was).  The cuDNN kernel is not among them: whether it reads the
# generator at dropout 0 is not known here, so it stays random.
_DROPOUT_ONLY_RANDOM = frozenset(
    {
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
    }
)


def draws_random(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call draws random numbers: the op is tagged
    ``nondeterministic_seeded``, except an attention kernel whose dropout
    is 0 (``_DROPOUT_ONLY_RANDOM``)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    name = _dataflow.op_name(func)
    if name not in _DROPOUT_ONLY_RANDOM:
        return True
    p = _torch_compat.op_argument(func, args, kwargs, "dropout_p")
    return not isinstance(p, (int, float)) or p != 0


def op_cost(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[float, int, int, bool]:
    """One call's (FLOPs, bytes of its new outputs, their elements, whether
    it draws random numbers from a generator a recompute cannot set past
    it: :func:`draws_random` without a ``_generators.device_of``).  A
    random call with a FLOP formula that may be kept counts its generator
    state among its bytes (``_generators.state_bytes``): keeping it keeps
    that too."""
    random = draws_random(func, args, kwargs)
    if not _torch_compat.op_writes_new(func):
        return 0.0, 0, 0, random
    tensors = _outputs(out)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    numel = sum(t.numel() for t in tensors)
    count = _torch_compat.call_flops(func, args, kwargs, out)
    flops = float(count) if count is not None else 0.0
    if random:
        device = _generators.device_of(func, args, kwargs, out)
        if device is not None and flops > 0.0:
            random = False
            nbytes += _generators.state_bytes(device)
    return flops, nbytes, numel, random


# The classes of ops with a FLOP formula, timed apart by memscale.costs
# (a matrix product, a convolution, an attention kernel); an op without a
# formula is costed per element it writes.
MATMUL, CONV, ATTENTION = 0, 1, 2


def op_class(func: Any) -> int:
    """The class of the op ``func`` when it has a FLOP formula (by the name
    of its overload packet: the convolutions and the attention kernels of
    ``flop_registry``; MATMUL for the rest)."""
    name = _dataflow.op_name(func)
    if "conv" in name:
        return CONV
    if "attention" in name:
        return ATTENTION
    return MATMUL


# What one FLOP of each class, and one element an op without a formula
# writes, costs in FLOPs at the matmul rate: (conv, attention, element),
# from the machine's measured rates (``_costs.CostTable.weights``).
Weights = tuple[float, float, float]
UNWEIGHTED: Weights = (1.0, 1.0, 1.0)


def _weighted(flops: float, numel: int, kind: int, weights: Weights) -> float:
    """One op's recompute at the matmul rate: its FLOPs at its class's rate,
    or, without a formula, its elements at the element rate."""
    if flops <= 0.0:
        return float(numel) * weights[2]
    if kind == CONV:
        return flops * weights[0]
    if kind == ATTENTION:
        return flops * weights[1]
    return flops


def rate(flops: float, nbytes: int) -> float:
    """What an op's output is worth keeping, the order levels keep outputs
    in: its FLOPs per byte written, and of outputs at the same FLOPs per
    byte, the one of fewer bytes first, so that a level can keep the
    smaller without the larger (a GPT-2 block's four products all cost 128
    FLOPs a byte, and their outputs are 2 to 8 MiB).  The FLOPs per byte
    are raised by a millionth for each halving of the bytes below 2**64:
    at a threshold of exactly some FLOPs per byte, every output of at
    least that many is kept, as without the order."""
    return flops / nbytes * (1.0 + 1e-6 * (64.0 - math.log2(nbytes)))


def keeps(threshold: float, flops: float, nbytes: int, random: bool) -> bool:
    """The policy: keep an op's output when it is not random (to
    :func:`op_cost`, a random call whose generator a recompute can set past
    it is not) and its :func:`rate` is at least ``threshold`` (the very
    value :func:`layer_profile` makes a level's threshold of)."""
    return not random and flops > 0.0 and nbytes > 0 and rate(flops, nbytes) >= threshold


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
    # Per call, its op_class (MATMUL where not recorded).
    classes: list[int] = field(default_factory=list)
    # The tail: the indices of the calls a recompute of the unit does not
    # run, those after the last tensor autograd saved in its forward
    # (recorded with the saved-tensor hooks; empty when not recorded).
    tail: set[int] = field(default_factory=set)
    # Per call, the op's name (``str(func)``: "aten.mm.default"), and how
    # many times the unit's forward ran while recorded.
    names: list[str] = field(default_factory=list)
    entered: int = 0
    # Per call, the calls whose outputs it reads (by storage: the call that
    # last wrote each tensor argument's storage, in place or new; none for
    # the ops that read only their argument's shape, _SHAPE_ONLY), and the
    # calls whose outputs autograd saved (recorded with the saved-tensor
    # hooks, on fake tensors only: ``saves_known``; on real tensors a
    # kernel may read memory the dispatcher does not see).  What
    # ``_dataflow.dead_calls`` reads.
    deps: list[tuple[int, ...]] = field(default_factory=list)
    saved: set[int] = field(default_factory=set)
    saves_known: bool = False
    # The calls that read no value of their arguments (_transparent), and
    # the fused dropouts (_dataflow.MASKED_NAMES).
    transparent: set[int] = field(default_factory=set)
    masked: set[int] = field(default_factory=set)

    def op_class(self, index: int) -> int:
        return self.classes[index] if index < len(self.classes) else MATMUL

    def tail_start(self) -> int | None:
        """The index of the first call of the tail when the forward ran
        once and its tail is every call from there on (what no level keeps
        and, named by :func:`tail_of`, what :func:`run` skips), else
        None."""
        if self.entered != 1 or not self.tail:
            return None
        start = min(self.tail)
        if start >= len(self.names) or self.tail != set(range(start, len(self.calls))):
            return None
        return start


def _all_fake(args: Any) -> bool:
    """Whether ``args`` holds tensors, all of them fake."""
    tools = _torch_compat.fake_tensor_tools()
    # (a module's arguments: pytree also opens the containers it knows of)
    tensors = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
    return tools is not None and bool(tensors) and all(tools[0](t) for t in tensors)


SavedHooks = tuple[Any, Any]  # (pack, unpack) of torch's saved-tensor hooks


@_torch_compat.guard_dispatch
class OpRecorder(_DispatchMode):
    """Records, per planning unit, the cost of every op its forward runs
    (while entered; the unit is known from forward hooks on the units,
    removed by :meth:`close`).  Use :func:`recorder`, which is None where
    torch has no dispatch modes.

    With ``saved_hooks`` (the saved-tensor hooks in force around it: the
    C profiler's ``_count`` and ``_ident``), it also records each unit's
    tail (``LayerOps.tail``): while entered, its own saved-tensor hooks
    note when the unit's forward saves a tensor for backward and hand the
    tensor on to those.  A checkpoint's recompute (torch's non-reentrant
    one with its default early stop, and memscale's executor alike) stops
    as soon as it has saved as many tensors as the forward did: autograd
    saves an op's inputs before the op runs and its outputs after, so the
    calls not yet recorded at the unit's last save are never rerun."""

    def __init__(
        self,
        units: list[nn.Module],
        saved_hooks: SavedHooks | None = None,
        as_mode: bool = True,
    ) -> None:
        super().__init__()
        # False: entering pushes no dispatch mode; the caller hands every
        # op to :meth:`record` itself (the OOM predictor's warm-up caller,
        # the mode right below where this one would be).
        self._as_mode = as_mode
        self.ops = [LayerOps([]) for _ in units]
        self._current: int | None = None
        self._state: set[int] = set()  # ids of the current unit's buffers and parameters
        self._producer: dict[int, int] = {}  # storage -> index of the call that last wrote it
        self._last_save = 0  # the current unit's calls recorded at its last save
        self._saved_hooks = saved_hooks
        self._saved_ctx: Any = None
        self._handles: list[Any] = []
        for i, unit in enumerate(units):
            self._handles.append(unit.register_forward_pre_hook(functools.partial(self._enter, i)))
            self._handles.append(unit.register_forward_hook(self._leave, always_call=True))

    def _enter(self, index: int, module: nn.Module, args: Any) -> None:
        self._current = index
        self.ops[index].entered += 1
        self.ops[index].saves_known = self._saved_hooks is not None and _all_fake(args)
        self._state = {id(t) for t in (*module.buffers(), *module.parameters())}
        self._producer = {}
        # A call that saves nothing is never recomputed: all of it is tail.
        self._last_save = len(self.ops[index].calls)

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._current is not None and self._saved_ctx is not None:
            ops = self.ops[self._current]
            ops.tail.update(range(self._last_save, len(ops.calls)))
        self._current = None
        self._producer = {}

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self._current is not None:
            ops = self.ops[self._current]
            self._last_save = len(ops.calls)
            producer = self._producer.get(_torch_compat.storage_key(tensor))
            if producer is not None:
                ops.saved.add(producer)
        assert self._saved_hooks is not None
        return self._saved_hooks[0](tensor)

    def __enter__(self) -> OpRecorder:
        if self._as_mode:
            super().__enter__()
        if self._saved_hooks is not None:
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._saved_hooks[1])
            try:
                ctx.__enter__()
            except BaseException:
                if self._as_mode:
                    super().__exit__(None, None, None)
                raise
            self._saved_ctx = ctx
        return self

    def __exit__(self, *exc: Any) -> Any:
        ctx, self._saved_ctx = self._saved_ctx, None
        result = None
        try:
            if ctx is not None:
                ctx.__exit__(*exc)
        finally:
            if self._as_mode:
                result = super().__exit__(*exc)
        return result

    def close(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        return out

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Record one op call of the current unit (``out``: what it
        returned)."""
        index = self._current
        if index is not None and func not in IGNORED_OPS:
            facts = _FACTS.get(func)
            if facts is None:
                facts = _FACTS[func] = _OpFacts.of(func)
            ops = self.ops[index]
            here = len(ops.calls)
            deps: set[int] = set()
            if not facts.shape_only:
                for t in _tensors((args, kwargs)):
                    producer = self._producer.get(_torch_compat.storage_key(t))
                    if producer is not None:
                        deps.add(producer)
            ops.deps.append(tuple(sorted(deps)))
            if facts.transparent:
                ops.transparent.add(here)
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
                key = _torch_compat.storage_key(t)
                producer = self._producer.get(key)
                if producer is not None:
                    ops.mutated.add(producer)
                # Whoever reads it from here on reads this call's write
                # (which read the earlier one: deps).
                self._producer[key] = here
            if facts.new_outputs:
                for t in _outputs(out):
                    self._producer[_torch_compat.storage_key(t)] = here
                if facts.masked and len(_outputs(out)) == 2:
                    # The mask depends on no value: no producer.
                    self._producer.pop(_torch_compat.storage_key(_outputs(out)[1]), None)
                    ops.masked.add(here)
            ops.calls.append(op_cost(func, args, kwargs, out))
            ops.classes.append(facts.op_class)
            ops.names.append(facts.name)


@dataclass(frozen=True)
class _OpFacts:
    """What :meth:`OpRecorder.record` reads of an op itself, worked out
    once per op (``_FACTS``)."""

    shape_only: bool
    transparent: bool
    new_outputs: bool  # it writes new outputs that are not views
    masked: bool
    op_class: int
    name: str

    @staticmethod
    def of(func: Any) -> _OpFacts:
        name = _dataflow.op_name(func)
        return _OpFacts(
            shape_only=_dataflow.shape_only(func),
            transparent=_dataflow.transparent(func),
            new_outputs=_torch_compat.op_writes_new(func) and name not in _dataflow.ALIAS_NAMES,
            masked=name in _dataflow.MASKED_NAMES,
            op_class=op_class(func),
            name=str(func),
        )


_FACTS: dict[Any, _OpFacts] = {}


def recorder(
    units: list[nn.Module], profiler: Any = None, as_mode: bool = True
) -> OpRecorder | None:
    """An :class:`OpRecorder` of ``units``, or None where torch has no
    dispatch modes or cannot run selective checkpointing
    (``_torch_compat.selective_supported``).  With ``profiler`` (the C
    Profiler whose pass it records, begun before it is entered) it records
    the units' tails too, its saved-tensor hooks handing every tensor on
    to the profiler's.  With ``as_mode`` False it is no dispatch mode: the
    caller hands it each op (:meth:`OpRecorder.record`)."""
    if _torch_compat.dispatch_mode_base() is None or not _torch_compat.selective_supported():
        return None
    hooks = None if profiler is None else (profiler._count, profiler._ident)
    return OpRecorder(units, hooks, as_mode)


def threshold(flops: float, saved_bytes: int) -> float:
    """A layer's own threshold: its forward FLOPs per byte it saves for
    backward (from its LayerStats).  :func:`layer_profile` always offers
    the level at this threshold; the plan may choose another
    (``LayerPlan.selective_threshold``)."""
    return flops / saved_bytes if saved_bytes > 0 else float("inf")


Level = tuple[float, int, float]


def _pick(ladder: list[Level], at_threshold: int, limit: int) -> list[Level]:
    """At most ``limit`` levels of ``ladder`` (fewest bytes kept first):
    the last (every op with a formula), the one at index ``at_threshold``
    (the layer's threshold; -1: none), and the rest spread evenly over the
    kept bytes between the first and the last."""
    if len(ladder) <= limit:
        return ladder
    chosen = {len(ladder) - 1, 0}
    if at_threshold >= 0:
        chosen.add(at_threshold)
    lo, hi = ladder[0][1], ladder[-1][1]
    slots = limit - len(chosen)
    for q in range(1, slots + 1):
        target = lo + (hi - lo) * q / (slots + 1)
        free = [k for k in range(len(ladder)) if k not in chosen]
        if not free:
            break
        chosen.add(min(free, key=lambda k: (abs(ladder[k][1] - target), k)))
    return [ladder[k] for k in sorted(chosen)]


def _cost_share(ops: LayerOps, index: int, weights: Weights) -> float:
    """Call ``index``'s part of :func:`recompute_cost` (its FLOPs at its
    class's rate; without a formula, its elements at the element rate less
    one each)."""
    op_flops, _, numel, _ = ops.calls[index]
    weighted = _weighted(op_flops, numel, ops.op_class(index), weights)
    return weighted if op_flops > 0.0 else weighted - float(numel)


def tail(ops: LayerOps, flops: float, weights: Weights = UNWEIGHTED) -> tuple[float, float]:
    """What a recompute of the layer does not run (``LayerOps.tail``, the
    calls after its forward's last saved tensor): (counted FLOPs, cost at
    the matmul rate as :func:`recompute_cost` weighs them), each at most
    the whole (``flops``, and its :func:`recompute_cost`).  (0.0, 0.0)
    when no tail was recorded."""
    if not ops.tail:
        return 0.0, 0.0
    counted = sum(ops.calls[i][0] for i in sorted(ops.tail))
    cost = sum(_cost_share(ops, i, weights) for i in sorted(ops.tail))
    whole = recompute_cost(ops, flops, weights)
    return min(max(counted, 0.0), flops), min(max(cost, 0.0), whole)


def recompute_cost(ops: LayerOps, flops: float, weights: Weights = UNWEIGHTED) -> float:
    """What recomputing the whole layer costs in FLOPs at the matmul rate:
    every op it runs at its class's rate (as a level's recompute is
    charged), less one FLOP per element an op without a formula writes.
    Unweighted that is its counted ``flops`` exactly, what the planner has
    always charged a whole recompute; weighted, it differs from the sum
    the levels are charged by that one FLOP per element only, next to the
    measured element rate's hundreds (``python -m memscale.costs``)."""
    extra = 0.0
    for i, (op_flops, _, _, _) in enumerate(ops.calls):
        extra += _cost_share(ops, i, weights) - op_flops
    return flops + extra


def _level_calls(
    ops: LayerOps, limit_ratio: float, end: int
) -> tuple[frozenset[int], frozenset[int]] | None:
    """The calls a level at ``limit_ratio`` keeps (before ``end``, the
    tail's start) and those its recompute does not run (``_dataflow.dead_calls``,
    never kept), or None when it would keep an output a later op writes
    in place (torch refuses a changed cached output)."""
    chosen = {
        i
        for i, (op_flops, nbytes, _, random) in enumerate(ops.calls[:end])
        if keeps(limit_ratio, op_flops, nbytes, random)
    }
    dead = _dataflow.dead_calls(ops, chosen)
    if (chosen - dead) & ops.mutated:
        return None
    return frozenset(chosen - dead), dead


Skip = tuple[tuple[str, int], ...]  # calls by (op name, how many calls of it come before)


def level_skips(ops: LayerOps, levels: tuple[Level, ...]) -> tuple[tuple[float, Skip], ...]:
    """Per level of ``levels`` (:func:`layer_profile`'s) whose recompute
    leaves calls unrun (``_dataflow.dead_calls``), its threshold and those calls
    by op name and occurrence, what :func:`run` is given (``skip``), with
    the fused dropouts that read their outputs (which run, on them
    unwritten: ``_dataflow._unread_by``)."""
    end = ops.tail_start()
    if end is None:
        end = len(ops.calls)
    out = []
    for limit_ratio, _, _ in levels:
        found = _level_calls(ops, limit_ratio, end)
        if found is None or not found[1]:
            continue
        dead = found[1]
        # The fused dropouts that read a dead call's output run on it unwritten.
        readers = {r for r in ops.masked if dead & set(ops.deps[r])}
        out.append(
            (
                limit_ratio,
                tuple(
                    (ops.names[i], ops.names[:i].count(ops.names[i]))
                    for i in sorted(dead | readers)
                ),
            )
        )
    return tuple(out)


def layer_profile(
    ops: LayerOps,
    flops: float,
    saved_bytes: int,
    limit: int = MAX_LEVELS,
    weights: Weights = UNWEIGHTED,
) -> tuple[Level, ...] | None:
    """The layer's levels run selective, fewest bytes kept first: per
    level (threshold, bytes of the outputs it keeps, what its recompute
    costs).  The ops with a FLOP formula that are not random (to
    :func:`op_cost`) are sorted by their :func:`rate`; each distinct
    value is a level's threshold (it keeps every op at or above it), down
    to the level that keeps them all.
    A level is left out when it would keep an output a later op writes in
    place (torch refuses a changed cached output), and so are the ones
    after it; a level that keeps no fewer bytes than the layer saves is no
    better than keeping the layer.  Of more than ``limit`` levels, the
    last, the one at the layer's threshold (:func:`threshold`) and the
    rest spread evenly by bytes are kept.  A level's recompute cost is in
    FLOPs at the matmul rate: each recomputed op's FLOPs at its class's
    rate, or its elements at the element rate (``weights``; unweighted,
    one per element); the ops of the layer's tail (``LayerOps.tail``) are
    not recomputed: torch's checkpoint stops a selective recompute early
    too, once the forward's last saved tensor is saved again.  Where the
    tail is known by position (``LayerOps.tail_start``), no level keeps
    an output of it either (:func:`run` is given the position), and a
    level that then keeps nothing, or no more than the one before, is left
    out.  None when nothing was measured, no level remains, or the forward
    updates its own state (a recompute would update it again: torch's
    checkpoint does not put buffers back)."""
    if not ops.calls or saved_bytes <= 0 or ops.updates_state:
        return None
    ratios = sorted(
        {
            rate(op_flops, nbytes)
            for op_flops, nbytes, _, random in ops.calls
            if keeps(0.0, op_flops, nbytes, random)
        },
        reverse=True,
    )
    layer_threshold = threshold(flops, saved_bytes)
    # Where the tail is known by position, run() keeps none of its outputs
    # (no recompute reads them).
    end = ops.tail_start()
    if end is None:
        end = len(ops.calls)
    ladder: list[Level] = []
    at_threshold = -1
    for limit_ratio in ratios:
        found = _level_calls(ops, limit_ratio, end)
        if found is None:
            break
        kept_calls, dead = found
        kept = sum(ops.calls[i][1] for i in kept_calls)
        cost = 0.0
        for i, (op_flops, _, numel, _) in enumerate(ops.calls):
            # (the recompute stops before its tail, and runs no dead call)
            if i not in kept_calls and i not in ops.tail and i not in dead:
                cost += _weighted(op_flops, numel, ops.op_class(i), weights)
        if kept >= saved_bytes:
            break
        if (kept == 0 and not dead) or (ladder and ladder[-1][1:] == (kept, cost)):
            # It keeps only tail outputs and runs every call, or it is no
            # different from the level before.
            if limit_ratio >= layer_threshold and ladder:
                at_threshold = len(ladder) - 1
            continue
        if limit_ratio >= layer_threshold:
            at_threshold = len(ladder)
        ladder.append((limit_ratio, kept, cost))
    if not ladder:
        return None
    return tuple(_pick(ladder, at_threshold, limit))


Tail = tuple[str, int]  # (the name of the tail's first op, how many calls of it come before)


def tail_of(ops: LayerOps) -> Tail | None:
    """What :func:`run` needs to keep nothing of the unit's tail (its
    ``tail=``), or None where the tail is not known by position: the
    tail's first op by name and occurrence (the forward's n-th call of that
    op), which a forward run for real finds even where it runs other ops
    than the profile's fake pass did before it (a Hugging Face attention
    mask is built, and grouped-query keys expanded, only on fake tensors,
    whose values cannot show the mask is not needed)."""
    start = ops.tail_start()
    if start is None:
        return None
    name = ops.names[start]
    return name, ops.names[:start].count(name)


class _Policy:
    """The selective policy of one forward: keep what ``threshold`` keeps,
    nothing from ``tail`` on, and none of the calls of ``skip`` (by op name
    and occurrence: :func:`level_skips`), which the recompute does not
    run.  :class:`_KeepMode` asks it of every op but :data:`IGNORED_OPS`,
    once, in the forward; the recompute follows the forward's answers.
    ``reached``: the tail's first call was made.  ``skip_valid``: this
    forward read no output of a ``skip`` call before its tail but to view
    it or read its shape (:meth:`check_reads`), as its profile said; where
    it did (it runs otherwise than its profile), the recompute runs
    every call."""

    def __init__(
        self, threshold: float, tail: Tail | None, skip: Skip = (), unit: nn.Module | None = None
    ) -> None:
        self.threshold = threshold
        self.tail = tail
        self.skip = frozenset(skip)
        self.unit = unit  # whose submodules' hooks turn the skip off (_hooked)
        self.seen = 0  # calls of the tail's first op so far
        self.reached = False
        self.skip_valid = bool(self.skip)
        # The storages of the skip calls' outputs (weakly: an address may be
        # reused once one is freed), and whether each is computed from an
        # unwritten one (_skipped_kind).
        self.skipped: dict[int, tuple[StorageWeakRef, bool]] = {}
        # The layouts of the skip calls' outputs, by (op name, occurrence).
        self.layouts: dict[tuple[str, int], list[tuple[Any, ...]]] = {}

    def _skipped_kind(self, t: torch.Tensor) -> bool | None:
        """None where ``t`` is no output of a skip call, else whether it
        is computed from an unwritten one (never written in the
        recompute), rather than put off (written when a call that runs
        reads it)."""
        entry = self.skipped.get(_torch_compat.storage_key(t))
        if entry is None or entry[0].expired():  # (an address reused)
            return None
        return entry[1]

    def _note(self, outputs: list[torch.Tensor], computed: bool) -> None:
        for t in outputs:
            storage = t.untyped_storage()
            self.skipped[storage._cdata] = (StorageWeakRef(storage), computed)

    def check_reads(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Note a call that reads a ``skip`` call's output where the
        recompute would run it on the unwritten output, or autograd might
        save that: before the tail, any call but a view or one that reads
        only the shape; in the tail (where torch's early stop may come at
        the call's own save, before it runs), any call but an add or a
        subtract, which save no input, or a multiply, or a divide by it
        not, with one operand read unwritten and the other needing no
        gradient (dropout's noise), which then save no unwritten operand.
        What such a tail call computes from a fused dropout's output, which
        the recompute computes from an unwritten input, counts as such in
        turn."""
        if not self.skipped or _dataflow.transparent(func):
            return
        tensors = _tensors((args, kwargs))
        found = [self._skipped_kind(t) for t in tensors]
        read = [f is not None for f in found]
        if not any(read):
            return
        if self.reached and self._saves_none(func, tensors, read):
            if any(found):  # (its output is computed from unwritten values too)
                self._note(_tensors(out), True)
            return
        self.skip_valid = False

    @staticmethod
    def _saves_none(func: Any, tensors: list[torch.Tensor], read: list[bool]) -> bool:
        name = _dataflow.op_name(func)
        if name in _dataflow.SAVES_NO_INPUT:
            return True
        if name not in _dataflow.SAVES_THE_OTHER or len(tensors) != 2 or sum(read) != 1:
            return False
        if name == "div" and not read[0]:  # (a divisor is saved)
            return False
        return not any(t.requires_grad for t, r in zip(tensors, read) if not r)

    def check_layout(self, func: Any, index: int, out: Any) -> None:
        """Note the outputs of the ``skip`` call ``(func, index)``: their
        storages (:meth:`check_reads`) and layouts, which the recompute's
        unwritten stand-ins copy (a kernel may choose another layout than
        its meta function)."""
        outputs = _tensors(out)
        if _dataflow.op_name(func) in _dataflow.MASKED_NAMES:
            # A fused dropout's output is computed from an unwritten input
            # in the recompute; its mask is not.
            self._note(outputs[:1], True)
            return
        self.layouts[str(func), index] = [(t.shape, t.stride(), t.dtype, t.device) for t in outputs]
        self._note(outputs, False)

    def keep(self, func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
        if self.tail is not None:
            if not self.reached and str(func) == self.tail[0]:
                self.reached = self.seen == self.tail[1]
                self.seen += 1
            if self.reached:
                return False
        flops, nbytes, _, random = op_cost(func, args, kwargs, out)
        return keeps(self.threshold, flops, nbytes, random)


_MISMATCH = (
    "The recompute of a selective layer ran other operators than its "
    "forward did (%s). The layer's forward must run the same operators "
    "again in backward: control flow that reads global state, or an input "
    "changed in place between forward and backward, changes them. Plan "
    "with selective off (Config(mode='conservative')) for such a model."
)


_EXCLUDE_GUARD = getattr(torch._C, "_SetExcludeDispatchKeyGuard", None)


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A detached alias of ``tensor`` made below autograd, with the
    view-tracking key back on so that it shares ``tensor``'s version
    counter (an in-place write of either shows in both)."""
    if _EXCLUDE_GUARD is None:  # pragma: no cover - depends on the torch release
        return tensor.detach()
    with _EXCLUDE_GUARD(torch._C.DispatchKey.ADInplaceOrView, False):
        return tensor.detach()


class _Cached:
    """One kept output of a selective forward: a detached alias (no
    autograd history, no reference cycle), with the version it had when
    kept."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = _alias(tensor)
        self.version = tensor._version

    def read(self) -> torch.Tensor:
        """A new alias for each recompute: autograd gives what the recompute
        returns a history of its own, which this entry must not hold (it
        would keep the recompute's saved tensors alive as long as the
        forward's kept outputs)."""
        if self.tensor._version != self.version:
            raise RuntimeError(
                "memscale: an output a selective layer kept for its recompute "
                "was written in place after its forward, so the recompute "
                "would read the written value. The layer's profile keeps no "
                "output a later op of the layer writes; an op outside the layer "
                "wrote it. Write a copy instead (out = out.clone() before the "
                "in-place op), or plan with selective off "
                "(Config(mode='conservative'))."
            )
        return _alias(self.tensor)


class _Kept:
    """What one selective forward kept: per op, how many times the forward
    called it, and the kept outputs by (op, call index).  Every recompute
    reads the same outputs (a second backward of a ``retain_graph=True``
    graph recomputes from them too)."""

    __slots__ = ("calls", "outputs", "states")

    def __init__(self) -> None:
        self.calls: dict[Any, int] = {}
        self.outputs: dict[tuple[Any, int], Any] = {}
        # Of each kept random call: its generator's state right after it.
        self.states: dict[tuple[Any, int], _generators.State] = {}


@_torch_compat.guard_dispatch
class _KeepMode(_DispatchMode):
    """The forward's mode: runs every op and keeps the outputs the policy
    keeps."""

    def __init__(self, policy: _Policy, kept: _Kept) -> None:
        super().__init__()
        self.policy = policy
        self.kept = kept

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # As torch's own selective modes: a function compiled with
        # torch.compile and called inside the layer is compiled (dynamo
        # skips compiling under a mode that does not say this).
        return True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = {} if kwargs is None else kwargs
        out = func(*args, **kwargs)
        if func in IGNORED_OPS:
            return out
        policy = self.policy
        if func is _CAST:
            policy.keep(func, args, kwargs, out)  # where the tail starts
            policy.check_reads(func, args, kwargs, out)
            return out
        calls = self.kept.calls
        index = calls.get(func, 0)
        calls[func] = index + 1
        # Only an aten operator's output is kept: a higher-order operator
        # (the compiled code of a torch.compile'd function) runs again.
        keep = isinstance(func, torch._ops.OpOverload) and policy.keep(func, args, kwargs, out)
        if policy.skip:
            if (str(func), index) in policy.skip:
                keep = False
                if (
                    _dataflow.op_name(func) not in _dataflow.MASKED_NAMES
                ):  # (it reads them unwritten)
                    policy.check_reads(func, args, kwargs, out)
                policy.check_layout(func, index, out)
            else:
                policy.check_reads(func, args, kwargs, out)
        if keep and draws_random(func, args, kwargs):
            # The recompute will not run it: it sets the generator to the
            # state the call left it in, so every later call draws as here.
            device = _generators.device_of(func, args, kwargs, out)
            real = not any(_torch_compat.is_fake(t) for t in _outputs(out))
            state = None if device is None else _generators.after(device, real)
            if state is None:
                keep = False  # (it runs again in order, as an unkept one)
            else:
                self.kept.states[(func, index)] = state
        if keep:
            self.kept.outputs[(func, index)] = tree_map_only(torch.Tensor, _Cached, out)
        return out


class _PutOff:
    """A call the recompute did not run (its ``skip``): its arguments and
    their versions then, and the unwritten outputs it handed back in its
    place, which :meth:`run` writes when a later op reads one after all
    (a recompute that does not stop early, or a forward that runs
    otherwise than its profile)."""

    __slots__ = ("args", "func", "kwargs", "outputs", "versions")

    def __init__(self, func: Any, args: tuple, kwargs: dict, outputs: Any) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.outputs = outputs
        self.versions = [t._version for t in _tensors((args, kwargs))]

    def run(self, mode: _RecomputeMode) -> None:
        """Run the call into its outputs, after the put-off calls whose
        outputs it reads (``mode``'s; writing those is no change of its
        inputs)."""
        written = mode.run_put_off(self.func, self.args, self.kwargs)
        for t, version in zip(_tensors((self.args, self.kwargs)), self.versions):
            if t._version != version and _torch_compat.storage_key(t) not in written:
                raise RuntimeError(
                    _MISMATCH % f"an input of {self.func}, whose output the recompute was "
                    "told no saved tensor reads, was written in place before a "
                    "later op read that output"
                )
        real = self.func(*self.args, **self.kwargs)
        for mine, theirs in zip(_tensors(self.outputs), _tensors(real)):
            mine.copy_(theirs)


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of an operator's arguments or outputs (tuples, lists
    and dicts of them)."""
    return tensor_list(tree)


def _unwritten(layouts: list[tuple[Any, ...]] | None) -> Any:
    """Tensors allocated and not written, of the forward's ``layouts``
    (shape, stride, dtype, device) of a call's outputs, or None where the
    forward made no such call: a single one, or a tuple."""
    if not layouts:
        return None
    made = [
        torch.empty_strided(shape, stride, dtype=dtype, device=device)
        for shape, stride, dtype, device in layouts
    ]
    return made[0] if len(made) == 1 else tuple(made)


@_torch_compat.guard_dispatch
class _RecomputeMode(_DispatchMode):
    """The recompute's mode: an op whose output the forward kept returns it
    without running; a call of the policy's ``skip`` (whose output nothing
    the recompute saves reads) returns unwritten outputs of its shape
    without running, where the forward found it so (``skip_valid``), and
    runs after all, into them, when a later op that runs reads one
    (:class:`_PutOff`; an op that makes a view of it or reads only its
    shape does not count); every other op runs again.  The call counts
    start over each time the recompute is entered."""

    def __init__(self, kept: _Kept, policy: _Policy) -> None:
        super().__init__()
        self.kept = kept
        self.policy = policy
        self.counts: dict[Any, int] = {}
        self.put_off: dict[int, _PutOff] = {}  # by the storage of each unwritten output
        self.skipping = False  # (set on entering)
        # The generators a kept random call's state was set on, put back
        # on leaving.
        self.generators = _generators.PutBack()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # as _KeepMode's

    def __enter__(self) -> Any:
        self.counts.clear()
        self.put_off.clear()
        # A hook registered since the forward would run in this recompute.
        self.skipping = self.policy.skip_valid and not _hooked(self.policy.unit)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        self.put_off.clear()
        try:
            return super().__exit__(*exc)
        finally:
            # Outside the mode.  torch's checkpoint restores the generators
            # of the devices of the layer's inputs after its recompute; any
            # other one set here goes back to where the recompute found it
            # (undoing, with the set, the draws of the calls after it).
            self.generators.restore()

    def run_put_off(self, func: Any, args: tuple, kwargs: dict) -> set[int]:
        """Run the put-off calls whose outputs a call of ``func`` that runs
        reads (none when it only views them or reads their shape); the
        storages they wrote."""
        written: set[int] = set()
        if not self.put_off or _dataflow.transparent(func):
            return written
        for t in _tensors((args, kwargs)):
            later = self.put_off.get(_torch_compat.storage_key(t))
            if later is None:
                continue
            keys = {_torch_compat.storage_key(out) for out in _tensors(later.outputs)}
            for key in keys:
                self.put_off.pop(key, None)
            later.run(self)
            written |= keys
        return written

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = {} if kwargs is None else kwargs
        if func in IGNORED_OPS:
            return func(*args, **kwargs)
        if func is _CAST:
            self.run_put_off(func, args, kwargs)
            return func(*args, **kwargs)
        index = self.counts.get(func, 0)
        self.counts[func] = index + 1
        if index >= self.kept.calls.get(func, 0):
            raise RuntimeError(
                _MISMATCH
                % f"call {index + 1} of {func}, which the forward made {self.kept.calls.get(func, 0)} times"
            )
        entry = self.kept.outputs.get((func, index))
        if entry is not None:
            state = self.kept.states.get((func, index)) if self.kept.states else None
            if state is not None:
                # As running the call would have: every later random call
                # draws what it drew in the forward.
                self.generators.set(state)
            return tree_map_only(_Cached, _Cached.read, entry)
        policy = self.policy
        if self.skipping and (str(func), index) in policy.skip:
            if _dataflow.op_name(func) in _dataflow.MASKED_NAMES:
                # It reads an unwritten output: its mask is drawn as in the
                # forward, and its own output is read by no call that runs.
                return func(*args, **kwargs)
            outputs = _unwritten(policy.layouts.get((str(func), index)))
            if outputs is not None:
                later = _PutOff(func, args, kwargs, outputs)
                for out in _tensors(outputs):
                    self.put_off[_torch_compat.storage_key(out)] = later
                return outputs
        self.run_put_off(func, args, kwargs)
        return func(*args, **kwargs)


def contexts(policy: _Policy) -> tuple[Any, Any]:
    """The forward's and the recompute's contexts of one selective
    checkpoint (``checkpoint(context_fn=...)``), sharing what the forward
    keeps."""
    kept = _Kept()
    return _KeepMode(policy, kept), _RecomputeMode(kept, policy)


# Called with (unit, True) when a selective unit's recompute starts and
# (unit, False) when it ends (however it ends): torch's checkpoint calls the
# forward again in backward, not the unit, so no module hook sees the
# recompute.  The simulation (memscale.predictor) listens while it runs a
# step, to count what a recompute holds as the executor's recomputes are
# counted.
RECOMPUTE_LISTENERS: list[Any] = []


class _Told:
    """The recompute's context (torch's checkpoint enters it around the
    recompute, outside the forward it calls), telling the listeners of
    :data:`RECOMPUTE_LISTENERS` before the cached mode is entered and after
    it is left, so that what they do runs outside it."""

    def __init__(self, inner: Any, unit: nn.Module) -> None:
        self.inner = inner
        self.unit = unit
        self.listeners = tuple(RECOMPUTE_LISTENERS)

    def __enter__(self) -> Any:
        for listener in self.listeners:
            listener(self.unit, True)
        try:
            return self.inner.__enter__()
        except BaseException:
            self._tell_end()
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            self._tell_end()

    def _tell_end(self) -> None:
        for listener in reversed(self.listeners):
            listener(self.unit, False)


_TAIL_WARNED: list[bool] = []


def _tail_missed(tail: Tail) -> None:
    if not _TAIL_WARNED:
        _TAIL_WARNED.append(True)
        logger.warning(
            "memscale: a selective layer's forward never made the call its "
            "profile's tail starts at (call %d of %s): it keeps the outputs of "
            "its tail too, more than the plan counted.  The forward runs "
            "differently than when it was profiled (wrap's sample_input, or "
            "the first steps); wrapping with the inputs training uses gives "
            "the plan this forward's tail.",
            tail[1] + 1,
            tail[0],
        )


def _hooked(unit: nn.Module | None) -> bool:
    """Whether a forward hook may run inside ``unit``'s forward: one of a
    submodule's, or a global one (the unit's own run around its forward,
    not in the recompute)."""
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return True
    if unit is None:
        return False
    return any(m._forward_hooks or m._forward_pre_hooks for m in unit.modules() if m is not unit)


def checkpoint_call(forward: Any, args: tuple, kwargs: dict, **options: Any) -> Any:
    """``forward(*args, **kwargs)`` under torch's non-reentrant checkpoint
    (``options``: its own arguments, such as ``context_fn``), with the
    keyword arguments handed to it as positional ones and the keyword call
    rebuilt inside: the checkpoint finds the devices whose RNG state it
    records and restores among its positional arguments only (a layer
    called as ``layer(hidden_states=x)`` on CUDA would have its dropout
    draw other masks in the recompute), and a keyword named as one of its
    own (``debug``, ``determinism_check``...) would not reach the
    forward.  Dynamo traces the closure as it traces the forward."""
    names = tuple(kwargs)
    count = len(args)

    def call(*given: Any) -> Any:
        return forward(*given[:count], **dict(zip(names, given[count:])))

    return checkpoint(call, *args, *kwargs.values(), use_reentrant=False, **options)


def run(
    forward: Any,
    threshold: float,
    args: tuple,
    kwargs: dict,
    tail: Tail | None = None,
    unit: nn.Module | None = None,
    skip: Skip = (),
) -> Any:
    """``forward(*args, **kwargs)`` checkpointed selectively: the outputs of
    ops ``threshold`` keeps (the plan's level's) are kept, the rest recomputed in
    backward (RNG state restored, so random ops draw the same).  Each
    backward of a ``retain_graph=True`` graph recomputes from the same kept
    outputs (:func:`contexts`).  With ``tail``
    (:func:`tail_of` the unit's profile), nothing from its tail on is kept:
    the recompute stops before it, so a kept output there would be held
    for nothing.  The tail starts at the n-th call of its first op; a
    forward that never makes that call keeps by threshold alone (and a
    warning says so, once per process).  ``unit``: the module whose forward
    this is, for :data:`RECOMPUTE_LISTENERS`.  ``skip``: the calls of the
    level that neither are kept nor run again (:func:`level_skips`)."""
    if skip and _hooked(unit):
        # A hook of a submodule runs again in the recompute, and would see
        # the unwritten outputs (the recompute checks again: _RecomputeMode).
        skip = ()
    policy = _Policy(threshold, tail, skip, unit)

    def context_fn() -> tuple[Any, Any]:
        keep, recompute = contexts(policy)
        if unit is None or not RECOMPUTE_LISTENERS:
            return keep, recompute
        return keep, _Told(recompute, unit)

    out = checkpoint_call(forward, args, kwargs, context_fn=context_fn)
    if tail is not None and not policy.reached:
        _tail_missed(tail)
    return out
