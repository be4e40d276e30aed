"""Small values stay real in a fake-tensor pass.

Model code reads some tensors' values to choose what to run: a Hugging
Face model asks whether its attention mask is all ones, or whether the
position ids it made with ``torch.arange`` hold several packed sequences,
and builds an attention mask only if so, or if the tensor is fake (it then
assumes it is being traced).  A pass on fake tensors alone therefore takes
another path than the real forward (a mask, keys and values expanded to
every head, another attention kernel), and what it measures is another
model's.  Every fake pass of memscale (the profile, the simulated steps)
keeps such values real instead:

* inputs that are not floating point and at most ``REAL_VALUE_LIMIT``
  bytes (token ids, masks, positions) stay real, as copies
  (:meth:`SmallValues.input`);
* an operator whose tensor arguments are all real (or that has none, as
  ``torch.arange``) runs for real when what it returns is at most that
  many bytes (:meth:`SmallValues.run`), so that its values exist.

Everything else is fake.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map_only

from . import _dataflow, _torch_compat
from ._tree import tensor_list, tensors_in

REAL_VALUE_LIMIT = 8 << 20
_PRUNE_AT = 4096  # storages remembered before the expired ones are dropped
_ELEMENT_BYTES = 16  # the widest element (complex128)
_aten = torch.ops.aten
# What torch calls on the tensor it made for a literal (``torch.tensor``).
_LIFTS = frozenset((_aten.lift_fresh.default, _aten.lift_fresh_copy.default))
# Operators that return a number, or their one-element argument (or a copy).
_ONE_ELEMENT_OPS = _LIFTS | frozenset(
    (_aten._local_scalar_dense.default, _aten.clone.default, _aten.detach.default)
)
_DispatchMode: type = _torch_compat.dispatch_mode_base() or object


class SmallValues:
    """Which calls of one fake pass run for real, and running them.

    ``mode`` is the pass's FakeTensorMode; ``limit`` the bytes a real
    result may have (0, or a torch without the fake-tensor tools: no call
    runs for real).  Only torch's own operators (``aten``, ``prims``) run
    for real, never a collective or a custom operator, and never one that
    writes a real tensor the pass did not make: an input the pass copied
    (:meth:`real_copy`) or what an earlier call run for real returned.  A
    call that does not run for real runs on fake twins of its real
    arguments, so that the fake mode never computes on them (it would run
    the real kernel of an arithmetic operator whose arguments are all
    real)."""

    def __init__(self, mode: Any, limit: int = REAL_VALUE_LIMIT) -> None:
        tools = _torch_compat.fake_tensor_tools() if limit and mode is not None else None
        self.limit = limit if tools is not None else 0
        self._mode = mode
        if tools is not None:
            self._is_fake, self._unset_fake, self._value_errors = tools
            # The class is_fake answers True for at once.
            self._fake_cls = _torch_compat.fake_tensor_class()
        # The real storages this pass made (storage key -> weak reference).
        self._made: dict[int, StorageWeakRef] = {}
        self._prune_at = _PRUNE_AT
        # Per operator: where its schema says it writes (position, name).
        self._writes: dict[Any, tuple[tuple[int, str], ...]] = {}
        # Per operator: whether :meth:`_one_element` may answer for it.
        self._one_element_ops: dict[Any, bool] = {}
        self._narrow = False  # only one-element calls run for real (narrowed)

    @contextlib.contextmanager
    def narrowed(self) -> Iterator[None]:
        """While entered, only calls on one-element tensors whose result is
        no larger run for real (:meth:`_one_element`): an optimizer's step
        counters are real, and the state it makes with factory calls
        (``torch.zeros(n)``, AdamW8bit's codes) stays fake, allocating
        nothing, as every other tensor of its step."""
        narrow, self._narrow = self._narrow, True
        try:
            yield
        finally:
            self._narrow = narrow

    def all_real(self, args: Any, kwargs: Any) -> bool:
        """Whether no tensor argument of a call is fake (False without a
        limit)."""
        if not self.limit:
            return False
        for a in args:  # most calls: a fake tensor is the first tensor
            if type(a) is self._fake_cls:
                return False
            if isinstance(a, (torch.Tensor, tuple, list, Mapping)):
                break
        is_fake = self._is_fake
        for t in tensor_list(args):
            if is_fake(t):
                return False
        if kwargs:
            for t in tensor_list(kwargs):
                if is_fake(t):
                    return False
        return True

    def run(self, func: Any, args: Any, kwargs: Any) -> Any:
        """A call whose tensor arguments are all real (or that has none),
        inside the fake mode.  Its result's size is learnt on fake twins
        first; it then runs for real (once) when that is at most the limit,
        or when it returns no tensor (``_foreach_add_``: what it writes is
        read later), or when its size depends on values and is bounded
        within the limit (:func:`_value_bound`: ``item()``, ``nonzero``),
        if it may (above); else the fake result stands, or the fake mode's
        error for a size it cannot know.  A call on one-element tensors
        whose result is no larger (:meth:`_one_element`: a step counter's
        ``+= 1`` and ``item()``) runs for real without the fake twins."""
        may = self._may_run(func, args, kwargs)
        if may and self._one_element(func, args, kwargs):
            return self._for_real(func, args, kwargs)
        fargs, fkwargs = self._faked(args, kwargs)
        if not may or self._narrow:
            return func(*fargs, **fkwargs)
        try:
            out = func(*fargs, **fkwargs)
        except self._value_errors:
            # It reads values: run for real only when what it can return
            # is bounded and small (repeat_interleave is not).
            bound = _value_bound(func, args, kwargs)
            if bound is None or bound > self.limit:
                raise
        else:
            sizes = [t.untyped_storage().nbytes() for t in tensors_in(out)]
            if sizes and sum(sizes) > self.limit:
                return out
        return self._for_real(func, args, kwargs)

    def _for_real(self, func: Any, args: Any, kwargs: Any) -> Any:
        with self._unset_fake():
            real = func(*args, **kwargs)
        # A result that is a view of an argument is the pass's own only if
        # that argument was.  ``lift_fresh``'s argument is the tensor torch
        # made for a literal in the pass (``torch.tensor(0.0)``: an
        # optimizer's step counter), the pass's own when torch allocated
        # its storage (resizable), not when it is a NumPy array's memory
        # (``torch.as_tensor(array)``, ``from_numpy``: not resizable).
        tensors = tensor_list((args, kwargs))
        if func in _LIFTS and all(t.untyped_storage().resizable() for t in tensors):
            given: set[int] = set()
        else:
            given = {_torch_compat.storage_key(t) for t in tensors}
        self._remember(real, given)
        return real

    def _one_element(self, func: Any, args: Any, kwargs: Any) -> bool:
        """Whether a call's result is known to be within the limit without
        learning its size: every tensor argument holds at most one element,
        and the operator returns a number, or tensors no larger than one
        element each (a pointwise operator broadcasts one-element tensors
        to one element; a ``_foreach_`` operator returns one tensor per
        element of its lists; ``lift_fresh`` returns its argument)."""
        known = self._one_element_ops.get(func)
        if known is None:
            known = self._one_element_ops[func] = func in _ONE_ELEMENT_OPS or (
                isinstance(func, torch._ops.OpOverload)
                and (torch.Tag.pointwise in func.tags or func.__name__.startswith("_foreach_"))
            )
        if not known:
            return False
        tensors = tensor_list((args, kwargs))
        return (
            bool(tensors)
            and len(tensors) * _ELEMENT_BYTES <= self.limit
            and all(t.numel() <= 1 for t in tensors)
        )

    def _faked(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        convert = self._mode.from_tensor
        return tree_map_only(torch.Tensor, convert, (args, kwargs))

    def _may_run(self, func: Any, args: Any, kwargs: Any) -> bool:
        if getattr(func, "namespace", None) not in ("aten", "prims"):
            return False
        writes = self._writes.get(func)
        if writes is None:
            writes = self._writes[func] = tuple(
                (i, a.name)
                for i, a in enumerate(func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write
            )
        for i, name in writes:
            written = args[i] if i < len(args) else kwargs.get(name)
            for t in tensor_list(written):
                ref = self._made.get(_torch_compat.storage_key(t))
                if ref is None or ref.expired():
                    return False
        return True

    def _remember(self, out: Any, given: set[int] | frozenset[int] = frozenset()) -> None:
        """Note the storages of ``out`` as the pass's own, but those of the
        ``given`` arguments (a view of a tensor the pass did not make)."""
        made = self._made
        if len(made) > self._prune_at:  # the expired ones go
            for key in [k for k, ref in made.items() if ref.expired()]:
                del made[key]
            # (not again before it has doubled: thousands of step counters
            # alive would make every call walk them)
            self._prune_at = max(_PRUNE_AT, 2 * len(made))
        for t in tensors_in(out):
            storage = t.untyped_storage()
            if storage._cdata not in given:
                made[storage._cdata] = StorageWeakRef(storage)

    def keeps(self, t: torch.Tensor, device_type: str) -> bool:
        """Whether the input ``t`` stays real in a pass on ``device_type``
        (its own bytes count, not its storage's: a batch sliced from a
        dataset's tensor is copied alone)."""
        return (
            bool(self.limit)
            and not t.is_meta
            and not t.is_floating_point()
            and not t.is_complex()
            and not t.requires_grad
            and t.device.type == device_type
            and not self._is_fake(t)
            and t.numel() * t.element_size() <= self.limit
        )

    def real_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A real copy of the real input ``t``, made inside the fake mode
        (the model may change it in place; the caller's stays as it is),
        which the pass's calls may write."""
        with self._unset_fake():
            copy = t.clone()
        self._remember(copy)
        return copy

    def refill(self, copy: torch.Tensor, t: torch.Tensor) -> None:
        """Put ``t``'s values back into its :meth:`real_copy` (which a
        forward may have changed in place) before another pass runs."""
        with self._unset_fake(), torch.no_grad():
            if copy.shape != t.shape:
                copy.resize_(t.shape)
            copy.copy_(t)


def _value_bound(func: Any, args: Any, kwargs: Any) -> int | None:
    """The most bytes a call whose output size depends on values can
    return, for the few calls whose bound the arguments give; None for any
    other (``repeat_interleave``, ``bincount``: unbounded)."""
    name = _dataflow.op_name(func)
    tensors = tensor_list((args, kwargs))
    if name in ("_local_scalar_dense", "is_nonzero", "equal"):
        return 0  # a Python number
    if not tensors:
        return None
    first = tensors[0]
    if name in ("nonzero", "argwhere"):
        return first.numel() * max(1, first.dim()) * 8
    if name == "masked_select":
        shape = torch.broadcast_shapes(*(t.shape for t in tensors[:2]))
        return shape.numel() * first.element_size()
    if name in ("_unique", "_unique2", "unique_dim", "unique_consecutive"):
        return first.numel() * (first.element_size() + 16)  # values, inverse, counts
    return None


@_torch_compat.guard_dispatch
class SmallValuesMode(_DispatchMode):
    """Above a FakeTensorMode: the calls :class:`SmallValues` says run for
    real do; every other call goes on to the fake mode."""

    def __init__(self, values: SmallValues) -> None:
        super().__init__()
        self._values = values

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._values.all_real(args, kwargs):
            return self._values.run(func, args, kwargs)
        return func(*args, **kwargs)
