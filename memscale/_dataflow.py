"""Which of a layer's calls a selective recompute needs: the dataflow
between the calls of one forward, as ``memscale._selective.OpRecorder``
records it on fake tensors (``LayerOps.deps``, ``saved``, ``transparent``,
``masked``), and the names of the ops it treats apart.

:func:`dead_calls` finds the matrix products and convolutions whose output
nothing autograd saved reads and no call before the tail reads but to
view it: a level neither keeps them nor runs them again
(``_selective.level_skips``, ``_selective.run``'s ``skip``).  See
docs/checkpointing.md, "Nor what nothing saved reads (dead calls)".
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from . import _torch_compat

if TYPE_CHECKING:  # pragma: no cover
    from ._selective import LayerOps

__all__ = [
    "ALIAS_NAMES",
    "MASKED_NAMES",
    "SAVES_NO_INPUT",
    "SAVES_THE_OTHER",
    "dead_calls",
    "op_name",
    "shape_only",
    "skippable",
    "transparent",
]

# Ops that read only their tensor argument's shape, dtype and device, not
# its values (dropout's noise is ``empty_like(x)`` filled in place): an
# output they are given is not needed for its values.
SHAPE_ONLY_NAMES = frozenset(
    {
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
    }
)

# The ops a recompute may leave unrun when nothing it saves needs their
# output (:func:`dead_calls`): matrix products and convolutions, whose
# backward saves their inputs and never their output (an attention
# kernel saves its output, so it always runs).
SKIPPABLE_NAMES = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "cudnn_convolution"}
)


# Dropout as one op (CUDA's fused kernel): its second output, the mask,
# comes from the RNG alone, not from the input's values, so a saved mask
# needs no earlier call; and where nothing reads its first output but the
# tail, it may run on an unwritten input (:func:`dead_calls`).
MASKED_NAMES = frozenset({"native_dropout"})


# Where a tail call reads a skipped output (``_selective._Policy.check_reads``):
# ops that save no input, and ops that save an operand only when another
# one needs a gradient.
SAVES_NO_INPUT = frozenset({"add", "sub"})
SAVES_THE_OTHER = frozenset({"mul", "div"})  # (div: the read operand its dividend)


def op_name(func: Any) -> str:
    return getattr(_torch_compat.op_packet(func), "__name__", "")


def shape_only(func: Any) -> bool:
    return op_name(func) in SHAPE_ONLY_NAMES


# Ops whose output is a view of their input though their schema does not
# say so (a bias-free Linear on a 3-d input is ``mm`` then ``_unsafe_view``).
ALIAS_NAMES = frozenset({"_unsafe_view", "alias", "_reshape_alias"})


def transparent(func: Any) -> bool:
    """Whether a call of ``func`` reads no value of its tensor arguments:
    a view of them, or an op that reads only their shape."""
    return (
        getattr(func, "is_view", False)
        or op_name(func) in ALIAS_NAMES
        or op_name(func) in SHAPE_ONLY_NAMES
    )


def skippable(name: str) -> bool:
    """Whether the op named ``name`` (``str(func)``: "aten.mm.default") is
    one of ``SKIPPABLE_NAMES``."""
    parts = name.split(".")
    return parts[0] == "aten" and parts[1:] in ([n, "default"] for n in SKIPPABLE_NAMES)


def dead_calls(ops: LayerOps, kept: Collection[int]) -> frozenset[int]:
    """The calls a recompute keeping the outputs of ``kept`` need not run:
    the matrix products and convolutions (``SKIPPABLE_NAMES``) whose
    output nothing autograd saves in the forward reads, through any chain
    of calls (a kept call's output is handed back, so what it reads is not
    needed for it), and whose output no call before the tail reads but
    to make a view of it or to read its shape (a recompute runs those
    calls, so it would run this one for them), or a fused dropout whose
    own output is needed by none and read by no call before the tail but
    views (its saved mask does not read the input: :func:`_unread_by`).
    GPT-2's MLP output projection is one: only the dropout after it reads
    it, which is the tail and saves its noise, not its input (on CUDA,
    a fused dropout, which saves its mask).  Such a call in ``kept`` is
    among them too (keeping it holds bytes for nothing).  Empty where the
    forward's saves were not recorded on fake tensors, or it ran more
    than once."""
    if not ops.saves_known or ops.entered != 1 or len(ops.deps) != len(ops.calls):
        return frozenset()
    candidates = {
        i
        for i, name in enumerate(ops.names)
        if skippable(name) and not ops.calls[i][3] and i not in ops.tail
    }
    if not candidates:
        return frozenset()
    needed: set[int] = set()
    stack = list(ops.saved)
    while stack:
        i = stack.pop()
        if i in needed:
            continue
        needed.add(i)
        if i not in kept:
            stack.extend(ops.deps[i])
    unread = _unread_by(ops, needed)
    for reader, deps in enumerate(ops.deps):
        if reader not in ops.tail and reader not in ops.transparent and reader not in unread:
            candidates.difference_update(deps)
    return frozenset(candidates - needed)


def _readers_before_tail(ops: LayerOps, call: int) -> bool:
    """Whether a call before the tail reads ``call``'s output but to view
    it or read its shape."""
    return any(
        call in deps and reader not in ops.tail and reader not in ops.transparent
        for reader, deps in enumerate(ops.deps)
    )


def _unread_by(ops: LayerOps, needed: set[int]) -> set[int]:
    """The fused dropouts whose first output nothing needs and no call
    before the tail reads (but views): run on an unwritten input, they
    still draw the right mask, and what they compute from it is never
    read."""
    return {r for r in ops.masked if r not in needed and not _readers_before_tail(ops, r)}
