"""The storage tracker: a dispatch mode below autograd that registers the
storage of every tensor an operator returns, hears through a weak
reference when it is freed, and turns the events of one step into its peak
and what made it up."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import _core, _torch_compat
from .._smallvalues import SmallValues
from .._tree import tensor_list
from ._results import CATEGORIES, PeakBreakdown
from ._workspace import Kernel, in_blocks, probe_on_device, signature, workspace_ops

_EQUAL = torch.ops.aten.equal.default
_DEVICE = torch.ops.prim.device.default
_NO_DISPATCH = torch._C._DisableTorchDispatch

# A Python number given for a tensor argument (``x * 0.5``, ``x + 1``)
# reaches an operator as a real 0-dim CPU tensor of its own, made by
# torch's argument parser (a "wrapped number": 8 bytes for a float or an
# int) and freed when the call returns, unless autograd keeps it for
# backward: a wrapped number is saved as it is, past any saved-tensor hook
# (so a checkpointed layer keeps it too), when the tensor beside it needs a
# gradient and the operator's backward reads it (``MulBackward0`` keeps
# ``other``).  A dispatch mode is handed the number, not the tensor: the
# storage tracker counts a stand-in for it.  These operators keep it.
_KEEPS_NUMBER = frozenset(
    (
        torch.ops.aten.mul.Tensor,
        torch.ops.aten.mul_.Tensor,
        torch.ops.aten.div.Tensor,
        torch.ops.aten.div_.Tensor,
        torch.ops.aten.div.Tensor_mode,
        torch.ops.aten.div_.Tensor_mode,
    )
)


# Overloads taking a Scalar whose CPU kernels wrap it themselves (they call
# the Tensor overload on a wrapped number): the Scalar's position.  A
# backward formula calls these (``PowBackward0``: ``exponent * ...``), and
# so does Python's ``1 - x`` (``rsub``) or ``2 ** x``.
_WRAPS_SCALAR: dict[Any, int] = {
    torch.ops.aten.mul.Scalar: 1,
    torch.ops.aten.div.Scalar: 1,
    torch.ops.aten.add.Scalar: 1,
    torch.ops.aten.sub.Scalar: 1,
    torch.ops.aten.rsub.Scalar: 1,
    torch.ops.aten.remainder.Scalar: 1,
    torch.ops.aten.pow.Scalar: 0,
}


def _number_slots(func: Any) -> tuple[tuple[int, bool], ...]:
    """Where ``func`` wraps a Python number it is given, among its first
    two arguments: (position, whether the slot is typed Tensor: the
    number was wrapped by torch's argument parser, before the call;
    otherwise by the kernel, a Scalar of :data:`_WRAPS_SCALAR`)."""
    scalar = _WRAPS_SCALAR.get(func)
    if scalar is not None:
        return ((scalar, False),)
    try:
        arguments = func._schema.arguments
    except AttributeError:
        return ()
    return tuple(
        (i, True)
        for i, arg in enumerate(arguments[:2])
        if not arg.kwarg_only and isinstance(arg.type, torch.TensorType)
    )


# The wrapped tensor of a Python number, by the number's type: its dtype
# and bytes.
_NUMBER_DTYPES: dict[type, torch.dtype] = {
    float: torch.float64,
    int: torch.int64,
    bool: torch.bool,
    complex: torch.complex128,
}


class _KeptNumber:
    """Stands in for a wrapped number (or a kernel's cast of one): its bytes
    are counted while the object lives (:meth:`StorageTracker.track_number`);
    freed when the call returns, or kept with an autograd node."""

    __slots__ = ("__weakref__",)


def _release(cell: list[Any], *_: Any) -> None:
    """A node's post hook: its backward ran and released what it kept."""
    cell.clear()


# The base class, looked up once at import: torch's TorchDispatchMode (its
# module is loaded by ``import torch`` already, so this costs nothing).  A
# torch without it (before 2.4) gets the class on ``object``, so that
# importing memscale still works (wrap() does not need it), and a
# StorageTracker refuses to be made, saying why.
_DispatchMode: type = _torch_compat.dispatch_mode_base() or object

# StorageTracker.track's work, in the extension (csrc/storage_track.c).
_track = _core.track


@dataclasses.dataclass(frozen=True)
class Recording:
    """A stretch of a step's events whose storages were all made and freed
    inside it (serials counted from its first), to be replayed in another
    step (:meth:`StorageTracker.replay`)."""

    events: tuple[tuple[int, int], ...]
    sizes_at_birth: tuple[int, ...]
    categories: tuple[str, ...]
    kernel_calls: tuple[tuple[int, Any, tuple[int | None, ...]], ...]


class FlopTally:
    """The FLOPs of the calls a :class:`FakeCaller` makes while this is
    entered: what ``torch.utils.flop_counter.FlopCounterMode`` counts
    (torch's FLOP formulas and memscale's, ``_torch_compat.flop_formula``,
    through ``_torch_compat.call_flops``, which remembers a shape formula's
    count per shapes), without a dispatch mode of its own above the caller.  The C profiler enters it for its pass and
    reads :meth:`get_total_flops` where each unit starts and ends, as it
    does a FlopCounterMode."""

    def __init__(self) -> None:
        self.total = 0
        self.on = False
        self._decomposes: dict[Any, bool] = {}

    def __enter__(self) -> FlopTally:
        self.on = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.on = False

    def get_total_flops(self) -> int:
        return self.total

    def decomposes(self, func: Any) -> bool:
        """Whether FlopCounterMode would run ``func`` as its decomposition
        (an operator with a CompositeImplicitAutograd kernel that reaches
        the dispatch modes whole, as ``aten.linear`` does under
        ``torch.inference_mode``), counting the pieces."""
        known = self._decomposes.get(func)
        if known is None:
            known = self._decomposes[func] = (
                isinstance(func, torch._ops.OpOverload)
                and func is not _DEVICE
                and (
                    torch._C.DispatchKey.CompositeImplicitAutograd in func.py_kernels
                    or torch._C._dispatch_has_kernel_for_dispatch_key(
                        func.name(), torch._C.DispatchKey.CompositeImplicitAutograd
                    )
                )
            )
        return known

    def count(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        flops = _torch_compat.call_flops(func, args, kwargs, out)
        if flops is not None:
            self.total += flops


class _Profiled(_DispatchMode):
    """A mode that may carry the profiler's pass (the warm-up's forward):
    ``flops``, the pass's FLOP counter, counts each call while on, and
    ``recorder`` (memscale._selective.OpRecorder, made with
    as_mode=False) is handed each call as a mode of its own right above
    this one would see it: every call but the pieces of a decomposition.
    One mode fewer for torch to hand every call (and every prim.device
    query) to."""

    def __init__(self, flops: FlopTally | None = None) -> None:
        super().__init__()
        self.flops = flops
        self.recorder: Any = None
        self._decomposing = 0
        # Whether a call ran as its decomposition (FlopCounterMode's way
        # with one that reaches the modes whole, under inference mode).
        self.decomposed = False

    def _decompose(self, func: Any, args: Any, kwargs: Any) -> Any:
        """While the FLOP counter is on, a call FlopCounterMode would run
        as its decomposition, run so (its pieces come back through this
        mode) and recorded whole; NotImplemented otherwise."""
        flops = self.flops
        if flops is None or not flops.on or not flops.decomposes(func):
            return NotImplemented
        self._decomposing += 1
        try:
            with self:
                out = func.decompose(*args, **kwargs)
        finally:
            self._decomposing -= 1
        if out is not NotImplemented:
            self.decomposed = True
            if self.recorder is not None and not self._decomposing:
                self.recorder.record(func, args, kwargs, out)
        return out

    def _profile(self, func: Any, args: Any, kwargs: Any, out: Any, count: bool = True) -> None:
        """A call as the profiler's pass counts (unless counted already)
        and records it."""
        flops = self.flops
        if count and flops is not None and flops.on:
            flops.count(func, args, kwargs, out)
        if self.recorder is not None and not self._decomposing:
            self.recorder.record(func, args, kwargs, out)


@_torch_compat.guard_fake_dispatch
class FakeCaller(_Profiled):
    """A dispatch mode that calls every operator as the storage tracker
    does (``calls``: FakeTensorMode's cache through a cheaper key; the
    fake tensors' ``prim.device`` answered directly), tracking nothing:
    the untracked warm-up runs under it, and the profiler's pass with it
    (:class:`_Profiled`)."""

    def __init__(
        self,
        calls: Callable[[Any, Any, Any], Any] | None,
        small: SmallValues | None = None,
        flops: FlopTally | None = None,
    ) -> None:
        super().__init__(flops)
        self._calls = calls
        self._fake_device = _torch_compat.fake_device_reader()
        self._small = small if small is not None else SmallValues(None, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and self._fake_device is not None and len(args) == 1:
            device = self._fake_device(args[0])
            if device is not None:
                return device
        kwargs = kwargs or {}
        if self.flops is not None:
            out = self._decompose(func, args, kwargs)
            if out is not NotImplemented:
                return out
        if self._small.all_real(args, kwargs):
            out = self._small.run(func, args, kwargs)
        elif self._calls is None:
            out = func(*args, **kwargs)
        else:
            out = self._calls(func, args, kwargs)
        self._profile(func, args, kwargs, out)
        return out


def _counted_apart(mode: StorageTracker, func: Any, args: Any, kwargs: Any) -> bool:
    """While ``mode``'s FLOP counter is on, a call FlopCounterMode would
    run as its decomposition, with fake tensors only: its pieces run apart
    (through a caller of their own, which counts them, below ``mode``:
    untracked, and no real value written twice), so that the call itself
    runs whole, as every other step runs it.  False: not such a call (or
    its decomposition declined)."""
    flops = mode.flops
    if flops is None or not flops.on or not flops.decomposes(func):
        return False
    if not all(_torch_compat.is_fake(t) for t in tensor_list((args, kwargs))):
        return False
    with FakeCaller(mode._calls, mode._small, flops):
        out = func.decompose(*args, **kwargs)
    return out is not NotImplemented


def _numbers_given(slots: tuple[int, ...], args: Any) -> bool:
    """Whether a Python number is given at one of ``slots`` of ``args``."""
    for i in slots:  # noqa: SIM110 - (a loop: no generator made per call)
        if i < len(args) and type(args[i]) in _NUMBER_DTYPES:
            return True
    return False


@_torch_compat.guard_fake_dispatch
class StorageTracker(_Profiled):
    """Registers the storage of every tensor an operator returns and
    records an event when it is allocated and when it is freed.  It may
    carry the profiler's pass (:class:`_Profiled`: the first step's
    forward, :meth:`Step.first_tracked`)."""

    def __init__(
        self,
        small: SmallValues | None = None,
        calls: Callable[[Any, Any, Any], Any] | None = None,
    ) -> None:
        if _torch_compat.dispatch_mode_base() is None:
            raise RuntimeError(
                f"memscale's OOM predictor needs torch's TorchDispatchMode, which "
                f"torch {torch.__version__} does not provide; install torch >= 2.4"
            )
        super().__init__()
        # How an operator is called (func, args, kwargs): FakeTensorMode's
        # cache read through a cheaper key (_torch_compat.fake_calls), or
        # None: func(*args, **kwargs).
        self._calls = calls
        # prim.device answered here (it returns no tensor to track).
        self._fake_device = _torch_compat.fake_device_reader()
        # Calls on real tensors only that run for real (_smallvalues).
        self._small = small if small is not None else SmallValues(None, 0)
        # id(storage) -> (weakref, serial); the weakref's callback
        # records the free.
        self._known: dict[int, tuple[weakref.ref, int]] = {}
        self.sizes: list[int] = []  # per serial, current bytes
        self.sizes_at_birth: list[int] = []
        self.categories: list[str] = []  # per serial
        self.events: list[tuple[int, int]] = []  # (serial, +/- bytes)
        self.phase_marks: list[tuple[int, str]] = [(0, "start")]
        # (event index, unit) where backward reached a recomputed unit
        # (its recompute starts there).
        self.recompute_marks: list[tuple[int, Any]] = []
        # (event index, unit) where a recomputed unit's forward starts and
        # where it ends (pairs, in order).
        self.forward_marks: list[tuple[int, Any]] = []
        self.phase = "start"
        self.recompute_depth = 0
        self.active = True
        # (event index, call signature, serials of the new storages it
        # returned) of operators whose kernels keep scratch memory (see
        # _workspace._WORKSPACE_OPS); None: not recorded.
        self.kernel_calls: list[tuple[int, Any, tuple[int | None, ...]]] | None = None
        # Record every probeable call, not only those of _WORKSPACE_OPS
        # (a step on CUDA: _workspace.probe_on_device).
        self.probe_all = False
        # (granule, device type): a step for a CUDA device, whose caching
        # allocator gives every request a block of a multiple of the
        # granule and counts the block (torch.cuda.max_memory_allocated):
        # the storages of tensors on that device type (the fake tensors',
        # the CPU's when a CUDA target is simulated with CPU kernels) take
        # their bytes so rounded, and those on another none (the
        # extension's track(), csrc/storage_track.c).
        # None: every storage counts its own bytes.
        self.granule: tuple[int, str] | None = None
        # Called with each new phase before it is marked (the step's own
        # bookkeeping of what the executor holds).
        self.on_phase: Callable[[str], None] | None = None
        # Count the Python numbers operators are given for tensors (see
        # _KEEPS_NUMBER): a step on the CPU, where they are allocated; on
        # an accelerator they are host tensors.
        self.count_numbers = False
        # id(func) -> (func, _number_slots(func)): an operator's hash is a
        # Python call, its id is not (the operator is kept to check it).
        self._slots: dict[int, tuple[Any, tuple[tuple[int, bool], ...]]] = {}
        # ids of _workspace.workspace_ops() (which keeps them alive).
        self._workspace_ids = frozenset(map(id, workspace_ops()))
        # id(func) -> (func, the positions of its number slots), for the
        # operators whose calls may take the plain path of
        # __torch_dispatch__ (_is_plain).
        self._plain: dict[int, tuple[Any, tuple[int, ...]]] = {}
        # (tensor dtype, number type, default dtype) -> the dtype a kernel
        # computes a tensor and a Python number in (_cast_dtype).
        self._casts: dict[tuple[torch.dtype, type, torch.dtype], torch.dtype] = {}
        # (weak reference to an operator's output, the stand-in for the
        # number it kept): tied to the output's autograd node once the
        # operator has returned through autograd (_settle).
        self._kept: list[tuple[weakref.ref, _KeptNumber]] = []
        # serial -> the weak reference whose callback records a stand-in's
        # free (kept here so that it outlives what it refers to).
        self._number_refs: dict[int, weakref.ref] = {}

    def set_phase(self, phase: str) -> None:
        if self._kept:
            self._settle()
        if self.on_phase is not None:
            self.on_phase(phase)
        self.phase = phase
        self.phase_marks.append((len(self.events), phase))

    def _category(self) -> str:
        if self.phase == "forward" or self.recompute_depth > 0:
            return "activations"
        return "workspace"

    def serial_of(self, t: torch.Tensor) -> int | None:
        st = t.untyped_storage()
        entry = self._known.get(id(st))
        if entry is not None and entry[0]() is st:
            return entry[1]
        return None

    def track(self, t: torch.Tensor, category: str | None = None) -> int | None:
        """Register the storage of ``t``; its serial if it is new (None:
        known, a resize in place recorded).  The extension does the work,
        per output of every simulated operator (``csrc/storage_track.c``):
        ``_known`` maps id(storage) to a weak reference whose callback
        records the free (:meth:`_died`); a new storage is born as
        :meth:`_born` makes one, its bytes those of the predicted device's
        memory it takes (with a granule: rounded up to it on the granule's
        device type, none on another, such as AdamW's host step counters
        in a step on CUDA)."""
        return _track(self, t, category)

    def stand_in(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A tensor of ``nbytes`` on ``device`` for what the step holds out
        of the operators' sight (the RNG state a checkpoint frame keeps),
        tracked as an operator's output would be from here.  It is made
        past the dispatch modes (as an operator would make it for real,
        :mod:`memscale._smallvalues`, without learning its size on fake
        twins first: it is known)."""
        with _NO_DISPATCH():
            t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if self.active:
            self.track(t)
        return t

    def _born(self, nbytes: int, category: str | None = None) -> int:
        """A new serial of ``nbytes``, allocated now."""
        serial = len(self.sizes)
        self.sizes.append(nbytes)
        self.sizes_at_birth.append(nbytes)
        self.categories.append(category or self._category())
        if nbytes:
            self.events.append((serial, nbytes))
        return serial

    def _died(self, serial: int) -> None:
        """``serial`` is freed now (recorded while the tracker is active)."""
        if self.active and self.sizes[serial]:
            self.events.append((serial, -self.sizes[serial]))
            self.sizes[serial] = 0

    def _numbers(self, func: Any, args: Any) -> list[tuple[int, _KeptNumber]] | None:
        """Stand-ins for the Python numbers ``func`` wraps, counted from
        now: (position, stand-in), position -1 for a cast.  A CPU kernel also casts a wrapped
        number to the dtype it computes in, when that is another (a float
        times a float32 tensor: 4 more bytes while it runs).  In
        backward's own formulas a number given for a tensor is one autograd
        kept (``grad * other``): only its cast is new."""
        slots = self._slots_of(func)
        formula = self.phase == "backward" and not self.recompute_depth
        held = None
        for i, parsed in slots:
            if i >= len(args):
                continue
            dtype = _NUMBER_DTYPES.get(type(args[i]))
            if dtype is None:
                continue
            if held is None:
                held = []
            if not (formula and parsed):
                held.append((i, self.track_number(dtype.itemsize)))
            other = args[1 - i] if len(args) >= 2 else None
            if isinstance(other, torch.Tensor):
                cast = self._cast_dtype(other, args[i])
                if cast != dtype:
                    held.append((-1, self.track_number(cast.itemsize)))
        return held

    def _cast_dtype(self, tensor: torch.Tensor, number: Any) -> torch.dtype:
        """``torch.result_type(tensor, number)``, remembered per tensor dtype,
        number type and default dtype: a wrapped number's value never moves
        the result (it only does as a tensor of its own), and on a fake
        tensor each call of ``result_type`` is an uncached fake-tensor
        dispatch (about 0.1 ms; 10,000 of them in a 1,000-layer AdamW
        step)."""
        key = (tensor.dtype, type(number), torch.get_default_dtype())
        cast = self._casts.get(key)
        if cast is None:
            cast = self._casts[key] = torch.result_type(tensor, number)
        return cast

    def _keep_numbers(self, func: Any, args: Any, out: Any, held: list[tuple[int, Any]]) -> None:
        """After the call: the numbers autograd keeps stay counted until its
        node has run (tied to it by :meth:`_settle`); the others are freed
        (``held`` is emptied)."""
        if func in _KEEPS_NUMBER and isinstance(out, torch.Tensor) and torch.is_grad_enabled():
            ref = None
            for i, number in held:
                other = args[1 - i] if i >= 0 and len(args) >= 2 else None
                if isinstance(other, torch.Tensor) and other.requires_grad:
                    ref = ref or weakref.ref(out)
                    self._kept.append((ref, number))
        held.clear()

    def track_number(self, nbytes: int) -> _KeptNumber:
        """A new stand-in of ``nbytes``, counted from now until it is
        freed."""
        held = _KeptNumber()
        serial = self._born(nbytes)
        refs = self._number_refs

        def freed(_: weakref.ref, serial: int = serial) -> None:
            del refs[serial]
            self._died(serial)

        refs[serial] = weakref.ref(held, freed)
        return held

    def _settle(self) -> None:
        """Tie each kept number to the autograd node of the operator that
        kept it, once autograd has given the operator's output its node
        (an operator called by autograd before that, such as
        ``prim.device``, leaves it for later): freed when that node's
        backward has run, or with the node.  An output freed before then
        takes its number with it."""
        kept, self._kept = self._kept, []
        for ref, held in kept:
            out = ref()
            if out is None:
                continue
            if out._is_view():
                # An in-place operator on a view: its node is in the base's
                # history (CopySlices).  A view's grad_fn is never read
                # here: autograd may be rebuilding it, under a lock that
                # reading it takes, while it calls an operator.
                out = out._base
            node = out.grad_fn
            if node is None:
                self._kept.append((ref, held))
            else:
                node.register_hook(functools.partial(_release, [held]))

    def close(self) -> None:
        """Stop following storages: inactive, and the weak references whose
        callbacks record frees dropped (each callback refers to the
        tracker: a cycle the collector would otherwise have to find, with
        every list of the step in it).  The events, sizes and marks stay;
        :meth:`serial_of` knows no storage from here."""
        self.active = False
        self._known.clear()
        self._number_refs.clear()
        self._kept.clear()

    def mark(self) -> tuple[int, int, int]:
        """Where the step is now: (events, serials, kernel calls) so far;
        :meth:`recorded` takes what happened after it."""
        return len(self.events), len(self.sizes), len(self.kernel_calls or ())

    def recorded(self, since: tuple[int, int, int]) -> Recording | None:
        """What happened from ``since`` (a :meth:`mark`) to now, to be put
        into another step by :meth:`replay`; None when it touched a storage
        made before it, or left one it made alive (then it depends on the
        step it ran in, and only running it again tells)."""
        at, first, calls = since
        events = self.events[at:]
        if any(serial < first for serial, _ in events) or any(self.sizes[first:]):
            return None
        return Recording(
            events=tuple((serial - first, delta) for serial, delta in events),
            sizes_at_birth=tuple(self.sizes_at_birth[first:]),
            categories=tuple(self.categories[first:]),
            kernel_calls=tuple(
                (i - at, sig, tuple(None if s is None else s - first for s in got))
                for i, sig, got in (self.kernel_calls or [])[calls:]
            ),
        )

    def recorded_less_kept(self, since: tuple[int, int, int]) -> Recording | None:
        """:meth:`recorded`, less the storages made from ``since`` that are
        still alive (what a first optimizer update makes and keeps, its
        state): their events are left out and the other storages numbered
        as if they had not been made, a kernel call that made only kept
        storages is left out, and another's output among them is not
        given.  None when it touched a storage made before it."""
        at, first, calls = since
        events = self.events[at:]
        if any(serial < first for serial, _ in events):
            return None
        serial_of: dict[int, int] = {}  # a storage left, from ``first`` -> its new number
        for serial in range(first, len(self.sizes)):
            if not self.sizes[serial]:
                serial_of[serial] = len(serial_of)
        new_index = []  # per event from ``at``: its index among those left
        left: list[tuple[int, int]] = []
        for serial, delta in events:
            new_index.append(len(left))
            if serial in serial_of:
                left.append((serial_of[serial], delta))
        new_index.append(len(left))
        return Recording(
            events=tuple(left),
            sizes_at_birth=tuple(self.sizes_at_birth[s] for s in serial_of),
            categories=tuple(self.categories[s] for s in serial_of),
            kernel_calls=tuple(
                (
                    new_index[i - at],
                    sig,
                    tuple(None if s is None else serial_of.get(s) for s in got),
                )
                for i, sig, got in (self.kernel_calls or [])[calls:]
                # (a call that made only kept storages is not a steady step's)
                if not got or not all(s is not None and s not in serial_of for s in got)
            ),
        )

    def replay(self, recording: Recording) -> None:
        """Append ``recording``'s events as if what made them ran here: new
        serials for the storages it made (each born and freed in it), the
        same bytes, categories and kernel calls."""
        at, first = len(self.events), len(self.sizes)
        self.sizes += [0] * len(recording.sizes_at_birth)
        self.sizes_at_birth += recording.sizes_at_birth
        self.categories += recording.categories
        self.events += [(first + serial, delta) for serial, delta in recording.events]
        if self.kernel_calls is not None:
            self.kernel_calls += [
                (at + i, sig, tuple(None if s is None else first + s for s in got))
                for i, sig, got in recording.kernel_calls
            ]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # The plain path, which most calls of a step take: an operator
        # that wraps no Python number and keeps no kernel scratch
        # (``_plain``), outside the profiler's pass, with no number kept
        # to settle, not on real values only: called through the memo and
        # its outputs tracked, as :meth:`_dispatch` would.
        plain = self._plain.get(id(func))
        if (
            plain is not None
            and plain[0] is func
            and self.flops is None
            and not self._kept
            and not self.probe_all
            and self._calls is not None
            and not (self.count_numbers and _numbers_given(plain[1], args))
            and not self._small.all_real(args, kwargs)
        ):
            out = self._calls(func, args, kwargs or {})
            if self.active:
                if isinstance(out, torch.Tensor):
                    _track(self, out, None)
                else:
                    for t in tensor_list(out):
                        _track(self, t, None)
            return out
        return self._dispatch(func, args, kwargs)

    def _dispatch(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Every call the plain path does not take: the operator learnt for
        it when it can."""
        if id(func) not in self._plain and self._is_plain(func):
            self._plain[id(func)] = (func, tuple(i for i, _ in self._slots_of(func)))
        if func is _DEVICE and self._fake_device is not None and len(args) == 1:
            device = self._fake_device(args[0])
            if device is not None:
                return device
        if func is _EQUAL and self.phase == "backward":
            # The executor compares a layer's buffers before and after
            # its recompute (csrc/frame.c, restore_buffers) to put
            # updated statistics back.  Fake tensors have no values; a
            # layer whose recompute can change its buffers does (e.g.
            # BatchNorm), so answer "changed": the executor copies the
            # snapshot back, as it does in a real step.
            return False
        kwargs = kwargs or {}
        counted = False
        if self.flops is not None:  # the profiler's pass
            counted = _counted_apart(self, func, args, kwargs)
            if not counted:
                out = self._decompose(func, args, kwargs)
                if out is not NotImplemented:
                    return out
        if self._kept:
            self._settle()
        held = self._numbers(func, args) if self.count_numbers and self.active else None
        if self._small.all_real(args, kwargs):
            out = self._small.run(func, args, kwargs)
        elif self._calls is not None:
            out = self._calls(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if self.flops is not None:
            self._profile(func, args, kwargs, out, count=not counted)
        if self.active:
            # Most operators return one tensor: no walk through a tree.
            serials = (
                (_track(self, out, None),)
                if isinstance(out, torch.Tensor)
                else tuple([_track(self, t, None) for t in tensor_list(out)])
            )
            if self.kernel_calls is not None and (
                probe_on_device(func) if self.probe_all else id(func) in self._workspace_ids
            ):
                sig = signature(func, args, kwargs)
                if sig is not None:
                    self.kernel_calls.append((len(self.events), sig, serials))
        if held:
            self._keep_numbers(func, args, out, held)
        return out

    def _is_plain(self, func: Any) -> bool:
        """Whether ``func``'s calls may take the plain path (those given
        no Python number where it wraps one, :meth:`_numbers`): not
        ``prim.device`` nor ``aten.equal`` (answered here), and not an
        operator whose kernel keeps scratch (``_workspace.workspace_ops``)."""
        return not (func is _DEVICE or func is _EQUAL or id(func) in self._workspace_ids)

    def _slots_of(self, func: Any) -> tuple[tuple[int, bool], ...]:
        """``_number_slots(func)``, remembered by the operator's id."""
        known = self._slots.get(id(func))
        if known is None or known[0] is not func:
            known = self._slots[id(func)] = (func, _number_slots(func))
        return known[1]

    def span_peaks(self, workspace: Mapping[Any, Kernel], bounds: list[int]) -> list[int]:
        """The highest level (bytes alive, with kernels' scratch) between
        each two consecutive event indices of ``bounds`` (ascending): one
        figure per span [bounds[k], bounds[k + 1]], measured as
        :meth:`breakdown` measures the step's peak."""
        levels = self.levels(workspace)
        return [max(levels[lo : hi + 1]) for lo, hi in itertools.pairwise(bounds)]

    def levels(self, workspace: Mapping[Any, Kernel], scratch: bool = True) -> list[int]:
        """The bytes alive before each event (and after the last), the
        real sizes ``workspace`` gives counted, and with ``scratch`` the
        scratch of the kernel called there on top."""
        extra, scale = self._kernel_sizes(workspace)
        if not scratch:
            extra = {}
        levels = []
        level = 0
        for i, (serial, delta) in enumerate(self.events):
            levels.append(level + extra.get(i, 0))
            if serial in scale:
                delta = scale[serial] if delta > 0 else -scale[serial]
            level += delta
        levels.append(level + extra.get(len(self.events), 0))
        return levels

    def _kernel_sizes(
        self, workspace: Mapping[Any, Kernel]
    ) -> tuple[dict[int, int], dict[int, int]]:
        scratch: dict[int, int] = {}
        scale: dict[int, int] = {}  # serial -> real bytes
        for at, sig, serials in self.kernel_calls or ():
            kernel = workspace.get(sig)
            if kernel is None:
                continue
            if kernel.scratch > scratch.get(at, 0):
                scratch[at] = kernel.scratch
            for serial, real in zip(serials, kernel.returned):
                if self.granule is not None and real:
                    real = in_blocks(real, self.granule[0])
                if serial is not None and real > self.sizes_at_birth[serial]:
                    scale[serial] = real
        return scratch, scale

    def breakdown(
        self, recategorize: Mapping[int, str], workspace: Mapping[Any, Kernel]
    ) -> PeakBreakdown:
        """The peak of the event sequence and what was alive then.
        ``workspace`` gives, per recorded kernel call, its scratch bytes
        (alive only during the call, on top of everything else) and the
        real storage sizes of what it returns (a CPU kernel may return a
        scalar whose storage is its whole elementwise buffer)."""
        scratch, scale = self._kernel_sizes(workspace)
        events = self.events
        n = len(events)
        if scale:  # one alloc and one free, real size
            deltas = [(scale[s] if d > 0 else -scale[s]) if s in scale else d for s, d in events]
        else:
            deltas = [d for _, d in events]
        level = list(itertools.accumulate(deltas, initial=0))  # before each event
        # The first point of the highest level, in the order of a walk
        # through the events: at each index p, the level after event p - 1,
        # then the scratch of a kernel called at p on top of the level
        # before event p.  Ranked 2p - 1 and 2p; none above zero: the start.
        peak = max(level)
        rank = 2 * level.index(peak) - 1 if peak > 0 else None
        peak_scratch = 0
        for at in sorted(scratch):
            w = scratch[at]
            if not 0 <= at <= n or not w:
                continue
            if level[at] + w > peak or (
                level[at] + w == peak and rank is not None and 2 * at < rank
            ):
                peak, rank, peak_scratch = level[at] + w, 2 * at, w
        if rank is None:
            peak, peak_at, peak_phase = 0, 0, "start"
        else:
            peak_at = (rank + 1) // 2
            # The phase the walk was in at the event (after event p - 1) or
            # kernel (at p): the last mark at or before it.
            walked = peak_at - 1 if rank % 2 else peak_at
            marks = self.phase_marks[1:]
            found = bisect.bisect_right([m for m, _ in marks], walked)
            peak_phase = marks[found - 1][1] if found else "start"
        # What was alive there, by category.
        cats = [recategorize.get(i, c) for i, c in enumerate(self.categories)]
        best = dict.fromkeys(CATEGORIES, 0)
        for (serial, _), delta in zip(events[:peak_at], deltas):
            best[cats[serial]] += delta
        best["workspace"] += peak_scratch
        return PeakBreakdown(peak_bytes=peak, phase=peak_phase, **best)
