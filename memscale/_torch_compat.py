"""The one place memscale touches private torch APIs.

Static profiling runs the model on fake tensors (shapes and dtypes, no
memory), which torch provides only through ``torch._subclasses``.  Private
APIs move between releases, so each use is checked here and has a fallback:
if fake tensors are unavailable or fail, profiling falls back to a real
forward pass (``Config.use_empirical_fallback``).

The OOM predictor (memscale.predictor) also needs ``TorchDispatchMode``,
the fake-tensor helpers, a module's parameter tables and the profiler's raw
events; without them it raises a clear error, or (fake-tensor helpers,
profiler events) predicts without real values and kernel probes.
``verify_correctness`` suspends memscale's forward hooks through the module
hook tables, and falls back to re-applying the plan.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Releases this module was checked against; newer ones are tried, and any
# failure is reported and falls back.
TESTED_TORCH = ((2, 4), (2, 13))


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch."""
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def storage_key(t: torch.Tensor) -> int:
    """The identity of a tensor's storage: views share one.

    ``UntypedStorage._cdata`` is the storage implementation's address; unlike
    ``data_ptr()`` it is also defined for meta and fake tensors.  The C
    profiler uses the same attribute (csrc/module.c).
    """
    return t.untyped_storage()._cdata


def _fake_tensor_names(*names: str) -> tuple[Any, ...] | None:
    """``names`` from torch's private ``torch._subclasses.fake_tensor``, in
    order; None when this torch lacks the module or any of them."""
    try:
        module = importlib.import_module("torch._subclasses.fake_tensor")
        return tuple(getattr(module, name) for name in names)
    except (ImportError, AttributeError):  # pragma: no cover - depends on the torch release
        return None


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake (or meta) tensor: no data to read or write."""
    if t.device.type == "meta":
        return True
    try:
        from torch._subclasses.fake_tensor import is_fake as _is_fake
    except ImportError:  # pragma: no cover - older or newer torch
        return type(t).__name__ == "FakeTensor"
    return bool(_is_fake(t))


def fake_tensor_mode(
    *,
    allow_non_fake_inputs: bool = False,
    allow_fallback_kernels: bool = True,
) -> tuple[Any, Callable[[torch.Tensor], torch.Tensor]] | None:
    """A FakeTensorMode and a converter from real to fake tensors.

    Returns None when this torch has no usable FakeTensorMode; callers then
    profile with real tensors.  ``allow_non_fake_inputs`` lets real tensors
    met inside the mode (e.g. a loss target held by a closure) be faked on
    the fly; ``allow_fallback_kernels=False`` makes an operator without a
    fake implementation raise instead of running its real kernel on
    zero-filled inputs (which would allocate real memory).
    """
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:  # pragma: no cover - depends on the torch release
        logger.info("fake tensors are unavailable in torch %s", torch.__version__)
        return None
    if torch_version() < TESTED_TORCH[0]:  # pragma: no cover
        return None
    mode = FakeTensorMode(
        allow_non_fake_inputs=allow_non_fake_inputs, allow_fallback_kernels=allow_fallback_kernels
    )

    def convert(t: torch.Tensor) -> torch.Tensor:
        fake = mode.from_tensor(t)
        if t.requires_grad and not fake.requires_grad:  # pragma: no cover
            fake.requires_grad_(True)
        return fake

    return mode, convert


def dispatch_mode_base() -> type | None:
    """``TorchDispatchMode``, the base class of a mode that sees every aten
    operator call below autograd (the OOM predictor counts the storages
    operators return with one).  It lives in the private
    ``torch.utils._python_dispatch``; None when this torch lacks it or is
    older than the releases checked here, and the predictor then reports
    that it cannot run (wrap() is not affected).
    """
    if torch_version() < TESTED_TORCH[0]:  # pragma: no cover
        return None
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:  # pragma: no cover - depends on the torch release
        logger.info("TorchDispatchMode is unavailable in torch %s", torch.__version__)
        return None
    return TorchDispatchMode


def fake_tensor_tools() -> (
    tuple[Callable[[Any], bool], Callable[[], Any], tuple[type[BaseException], ...]] | None
):
    """``(is_fake, unset_fake_temporarily, value_errors)`` from
    ``torch._subclasses.fake_tensor``: a test for fake tensors, a context
    manager that runs real operators inside a FakeTensorMode, and the
    exceptions a fake operator raises when its result depends on tensor
    values.  None when this torch lacks them; the OOM predictor then runs
    every operator on fake tensors."""
    if torch_version() < TESTED_TORCH[0]:  # pragma: no cover
        return None
    got = _fake_tensor_names(
        "is_fake",
        "unset_fake_temporarily",
        "DataDependentOutputException",
        "DynamicOutputShapeException",
    )
    if got is None:
        return None
    is_fake_, unset, *errors = got
    return is_fake_, unset, tuple(errors)


def guard_dispatch(cls: type, *, answers_fake_devices: bool = False) -> type:
    """Class decorator of memscale's dispatch modes: their
    ``__torch_dispatch__`` skips torch's dynamo-disabling wrapper while no
    frame can be traced.  With ``answers_fake_devices``
    (:func:`guard_fake_dispatch`) the guard also answers a fake tensor's
    ``prim.device`` query itself, as :func:`fake_device_reader` reads it,
    before the method is called at all.

    torch wraps the ``__torch_dispatch__`` of every TorchDispatchMode
    (``torch._disable_dynamo``), so that dynamo, while a compiled function
    runs, never traces it; the wrapper costs a dozen Python calls per
    operator.  Dynamo sees frames only through the frame evaluator it
    installs while a compiled function runs (PEP 523); the extension's
    ``DispatchGuard`` calls the raw method while the interpreter's own
    evaluator is in place and torch's wrapped one under any other.  Left
    as torch made it where the wrapper is not one that names the raw
    method (``__wrapped__``) or the extension lacks the guard."""
    wrapped = cls.__dict__.get("__torch_dispatch__")
    raw = getattr(wrapped, "__wrapped__", None)
    try:
        from . import _core

        guard = _core.DispatchGuard
    except (ImportError, AttributeError):  # pragma: no cover - an old build
        return cls
    if not isinstance(raw, types.FunctionType) or not callable(wrapped):
        return cls
    devices = None
    fake_cls = fake_tensor_class()
    if answers_fake_devices and fake_cls is not None and fake_device_reader() is not None:
        devices = (torch.ops.prim.device.default, fake_cls, torch.device)
    cls.__torch_dispatch__ = guard(raw, wrapped, devices)  # type: ignore[attr-defined]
    return cls


def guard_fake_dispatch(cls: type) -> type:
    """:func:`guard_dispatch` for a mode on fake tensors whose method
    answers their ``prim.device`` first (with :func:`fake_device_reader`):
    the guard answers it before the method is called, without the
    interpreter (the autograd engine asks some 25 times per layer of a
    backward)."""
    return guard_dispatch(cls, answers_fake_devices=True)


def fake_tensor_class() -> type | None:
    """torch's FakeTensor class (``is_fake`` is True for its instances),
    or None when this torch lacks it."""
    got = _fake_tensor_names("FakeTensor")
    return got[0] if got is not None else None


def fake_device_reader() -> Callable[[Any], torch.device | None] | None:
    """A reader of the device a fake tensor reports, for ``prim.device``.

    Torch's C++ code (the autograd engine above all) asks a fake tensor for
    its device through the ``prim.device`` operator, which reaches every
    Python dispatch mode on the stack; FakeTensorMode answers it with the
    tensor's ``fake_device`` (``meta`` inside one of its kernels).  The OOM
    predictor's storage tracker, a mode above it, answers the same way
    without dispatching further (a backward asks some 25 times per layer).
    The reader returns None for anything but a fake tensor outside a fake
    kernel: then the operator is dispatched as usual.  None when this torch
    lacks the attributes read."""
    if torch_version() < TESTED_TORCH[0]:  # pragma: no cover
        return None
    fake_cls = fake_tensor_class()
    if fake_cls is None:  # pragma: no cover - depends on the torch release
        return None

    def read(t: Any) -> torch.device | None:
        if not isinstance(t, fake_cls):
            return None
        mode = getattr(t, "fake_mode", None)
        if mode is None or getattr(mode, "in_kernel_invocation", True):
            return None
        device = getattr(t, "fake_device", None)
        return device if isinstance(device, torch.device) else None

    return read


class _Misses:
    """What the extension's ``FakeCalls`` (csrc/fake_calls.c) hands back to
    Python: the first call of each key, and a call from the memo whose
    output it does not make itself.

    FakeTensorMode answers a call it has seen before (its cache key: the
    operator, every fake argument's metadata, the other arguments and some
    global state) by making the output from its cache entry; computing that
    key in Python is most of what such a call costs.  ``FakeCalls`` keys the
    call by the same values more cheaply (each tensor's dtype, shape,
    strides, device, storage offset and bytes, and flags; the other
    arguments with their types; the same global state); on a first call,
    :meth:`miss` dispatches it to FakeTensorMode and notes in the memo the
    key and entry the mode made (and the entry's recipe, for the extension
    to make the output from), or None where the mode did not cache it.  A
    later call with the same key gets the output FakeTensorMode's cache
    would give: made by the extension from the recipe, or by the mode's own
    method (:meth:`entry_output`).  A call whose arguments it cannot key (a
    real tensor, a symbolic size, a constant, another mode's fake tensor,
    an argument of another type), or made while another mode is on the
    stack, is dispatched as usual.

    It refers to nothing of the ``FakeCalls`` it serves (no cycle)."""

    def __init__(
        self,
        mode: Any,
        state_cls: Any,
        valid_cls: Any,
        memo: dict[Any, Any],
        lean: _LeanOutputs | None,
    ) -> None:
        self._mode = mode
        self._state_cls = state_cls
        self._valid_cls = valid_cls
        self._cache = type(mode).cache
        # key -> (FakeTensorMode's key, its entry, the entry's recipe or
        # None), or None: not cached.
        self._memo = memo
        self._lean = lean

    def alone(self) -> bool:
        """Whether a stack of one mode, with ``mode`` in the fake slot, is
        ``mode`` alone (no other mode to pass by): asked once, on the
        first such call."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        stack = _get_current_dispatch_mode_stack()
        return len(stack) == 1 and stack[0] is self._mode

    def miss(self, func: Any, args: Any, kwargs: Any, key: tuple[Any, ...]) -> Any:
        kwargs = kwargs or {}
        mode = self._mode
        try:
            cache_key = mode._cache_key(self._state_cls(None), func, args, kwargs)
        except Exception:  # noqa: BLE001 - its cache is bypassed for this call
            cache_key = None
        out = func(*args, **kwargs)
        entry = self._cache.get(cache_key) if cache_key is not None else None
        if isinstance(entry, self._valid_cls):
            recipe = self._lean.recipe(entry, func) if self._lean is not None else None
            self._memo[key] = (cache_key, entry, recipe)
        else:
            self._memo[key] = None
        return out

    def entry_output(self, known: tuple[Any, Any, Any], func: Any, args: Any) -> Any:
        return self._mode._output_from_cache_entry(
            self._state_cls(None), known[1], known[0], func, args
        )


class _LeanOutputs:
    """Recipes read once off FakeTensorMode's cache entries, from which the
    extension's ``FakeCalls`` makes a cached call's output doing what the
    mode's ``_get_output_tensor_from_cache_entry`` does (torch 2.13) with
    fewer Python calls: a meta tensor ``empty_strided`` with the entry's
    shape, strides, dtype and ``requires_grad`` (no dispatch mode sees
    it), its conjugate and negative bits, a view's storage set to its
    base's, then the FakeTensor made around it with the attributes a
    FakeTensor made by the mode has, the same values in the same order
    (``template``, checked against a FakeTensor the mode makes,
    :func:`_lean_outputs`).

    A recipe exists only for outputs without symbolic sizes, strided, on a
    device that needs no resolving; a call whose recipe does not fit its
    arguments (a view's base or an in-place argument not a FakeTensor),
    or made while the mode is in an unexpected state, gets no output from
    it and is answered by FakeTensorMode's own method."""

    def __init__(
        self, mode: Any, fake_cls: Any, template: dict[str, Any], no_constant: Any
    ) -> None:
        self._fake_cls = fake_cls
        self._template = template
        # An entry's constant_value when it has none (the mode's method
        # refuses to return it).
        self._no_constant = no_constant
        self._guard = (
            torch._C._set_warn_deprecated_on_mutable_data_ptr
            if mode._allow_unsafe_data_ptr_access
            else torch._C._set_throw_on_mutable_data_ptr
        )
        self._exporting = torch.compiler.is_exporting

    def recipe(self, entry: Any, func: Any) -> tuple[bool, tuple[Any, ...]] | None:
        """``(is a tuple, one recipe per output)``, or None (not fit)."""
        is_view = isinstance(func, torch._ops.OpOverload) and func.is_view
        outs = []
        for info in entry.output_infos:
            if info.inplace_idx is None and info.metadata is None and info.view_idx is None:
                if info.constant_value is self._no_constant:
                    return None
                outs.append((_CONSTANT, info.constant_value))
            elif info.inplace_idx is not None:
                outs.append((_INPLACE, info.inplace_idx))
            elif info.metadata is None:
                outs.append((_CONSTANT, None))
            else:
                made = self._tensor_recipe(info, is_view)
                if made is None:
                    return None
                outs.append(made)
        return bool(entry.is_output_tuple), tuple(outs)

    def _tensor_recipe(self, info: Any, is_view: bool) -> tuple[Any, ...] | None:
        m = info.metadata
        ints = (*m.shape, *m.stride, m.storage_offset)
        if (
            not all(type(v) is int for v in ints)
            or (m.storage_bytes is not None and type(m.storage_bytes) is not int)
            or m.layout is not torch.strided
            or m.device.type == "meta"
            or self._fake_cls._normalize_fake_device(m.device) != m.device
            or (is_view and info.view_idx is None)
        ):
            return None
        return (
            _NEW,
            tuple(m.shape),
            tuple(m.stride),
            m.dtype,
            bool(m.requires_grad),
            bool(m.is_conj),
            bool(m.is_neg),
            info.view_idx if is_view else None,
            m.storage_offset,
            m.device,
        )

    def c_args(self) -> tuple[Any, ...]:
        """What the extension's ``FakeCalls`` builds outputs with (its
        ``lean`` argument): the attributes, the calls, the meta device and
        the recipe's kinds of output."""
        return (
            self._template,
            torch.empty_strided,
            torch.Tensor._make_subclass,
            torch._C._set_conj,
            torch._C._set_neg,
            self._guard,
            self._exporting,
            _NO_DISPATCH,
            "meta",
            _CONSTANT,
            _INPLACE,
            _NEW,
        )


_CONSTANT: Any = object()
_INPLACE: Any = object()
_NEW: Any = object()


_UNSEEN: Any = object()
_STRIDED = torch.strided
_NO_SUBCLASS_FUNCTION = torch._C.DisableTorchFunctionSubclass
_NO_DISPATCH = torch._C._DisableTorchDispatch

# Non-tensor arguments keyed by (type, value), as FakeTensorMode keys them.
_KEYED_TYPES = frozenset(
    {int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format}
)


def fake_calls(mode: Any) -> Callable[[Any, Any, Any], Any] | None:
    """A caller of operators on the fake tensors of FakeTensorMode ``mode``
    (``calls(func, args, kwargs)``) that answers repeated calls from
    FakeTensorMode's dispatch cache with a cheaper key: the extension's
    ``FakeCalls`` over a :class:`_Misses` (the OOM predictor's storage
    tracker dispatches through it).  None when this torch lacks what it
    reads: then operators are called as usual."""
    if not TESTED_TORCH[0] <= torch_version() <= TESTED_TORCH[1]:
        return None  # its cache key may hold other values
    got = _fake_tensor_names(
        "FakeTensor", "FakeTensorMode", "_CacheKeyState", "_DispatchCacheValidEntry"
    )
    if got is None:  # pragma: no cover - depends on the torch release
        return None
    fake_cls, mode_cls, key_state, valid_entry = got
    if not isinstance(mode, mode_cls) or not _signatures_match(mode):
        return None  # pragma: no cover
    try:
        from . import _core

        made = _core.FakeCalls
    except (ImportError, AttributeError):  # pragma: no cover - an old build
        return None
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    lean = _lean_outputs(mode, fake_cls)
    memo: dict[Any, Any] = {}
    misses = _Misses(mode, key_state, valid_entry, memo, lean)
    return made(
        mode=mode,
        fake_cls=fake_cls,
        tensor_cls=torch.Tensor,
        memo=memo,
        miss=misses.miss,
        entry_output=misses.entry_output,
        alone=misses.alone,
        stack_len=torch._C._len_torch_dispatch_stack,
        slot_mode=torch._C._get_dispatch_mode,
        fake_slot=torch._C._TorchDispatchModeKey.FAKE,
        default_dtype=torch.get_default_dtype,
        default_device=torch._C._get_default_device,
        inference=torch.is_inference_mode_enabled,
        proxy_mode=get_proxy_mode,
        keyed_types=_KEYED_TYPES,
        strided=_STRIDED,
        no_subclass_fn=_NO_SUBCLASS_FUNCTION,
        unseen=_UNSEEN,
        lean=lean.c_args() if lean is not None else None,
    )


# The releases whose FakeTensor construction the lean build was checked
# against (FakeTensor.__new__ and FakeTensorMode's
# _get_output_tensor_from_cache_entry).
LEAN_TORCH = ((2, 13),)


def _lean_outputs(mode: Any, fake_cls: Any) -> _LeanOutputs | None:
    """A :class:`_LeanOutputs` for ``mode``, or None (outputs are then made
    by FakeTensorMode's own method): this torch is not one checked, or a
    FakeTensor the mode makes holds other attributes than those the lean
    build gives it, or another one of them has a value other than None."""
    if torch_version() not in LEAN_TORCH:
        return None
    try:
        from torch._subclasses.fake_tensor import FakeTensorConfig, SingletonConstant

        if FakeTensorConfig.debug or not isinstance(
            getattr(mode, "_allow_unsafe_data_ptr_access", None), bool
        ):
            return None
        probe = fake_cls(mode, torch.empty(1, device="meta"), torch.device("cpu"))
        attrs = dict(probe.__dict__)
    except Exception:  # noqa: BLE001 - the lean build is left out
        logger.debug("FakeTensor's layout could not be read", exc_info=True)
        return None
    names = list(attrs)
    if names[:2] != ["_fake_device", "fake_mode"] or attrs["fake_mode"] is not mode:
        return None
    template = {"_fake_device": None, "fake_mode": mode}
    for name in names[2:]:
        if attrs[name] is not None:
            return None
        template[name] = None
    if list(template) != _FAKE_ATTRS:
        return None
    return _LeanOutputs(mode, fake_cls, template, SingletonConstant)


_FAKE_ATTRS = [
    "_fake_device",
    "fake_mode",
    "constant",
    "pytype",
    "dispatch_keys",
    "real_tensor",
    *(
        f"_{memo}{suffix}"
        for memo in (
            "nonzero_memo",
            "item_memo",
            "unique_memo",
            "unique_consecutive_memo",
            "nested_int_memo",
        )
        for suffix in ("", "_vc", "_epoch")
    ),
]


def _signatures_match(mode: Any) -> bool:
    """Whether FakeTensorMode's cache methods take what _Misses passes."""
    import inspect

    want = {
        "_cache_key": ["state", "func", "args", "kwargs"],
        "_output_from_cache_entry": ["state", "entry", "key", "func", "args"],
    }
    try:
        return all(
            list(inspect.signature(getattr(mode, name)).parameters) == params
            for name, params in want.items()
        ) and isinstance(getattr(type(mode), "cache", None), dict)
    except (AttributeError, TypeError, ValueError):  # pragma: no cover
        return False


def module_tensor_tables(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The dicts in which ``module`` keeps its own parameters and buffers
    (``_parameters`` and ``_buffers``; ``torch.func.functional_call`` swaps
    tensors through the same tables).  The OOM predictor puts fake twins in
    them for the length of a simulation.  None when this torch keeps them
    elsewhere; the predictor then reports that it cannot run."""
    params = getattr(module, "_parameters", None)
    buffers = getattr(module, "_buffers", None)
    if not isinstance(params, dict) or not isinstance(buffers, dict):
        return None
    return params, buffers


def tensor_version(t: torch.Tensor) -> int:
    """The version counter of ``t`` (bumped by every in-place change);
    the C executor reads the same attribute."""
    return int(t._version)


def profiler_memory_events(
    prof: Any, device_type: str | None = None
) -> list[tuple[str, int, int, int]] | None:
    """``(name, start_ns, end_ns, nbytes)`` of every raw event of a stopped
    ``torch.profiler.profile(profile_memory=True)`` session; allocator
    events are named ``"[memory]"``.  With ``device_type`` ("cpu",
    "cuda"), the allocator events of other devices are left out (the
    profiler records every allocator's events, CUDA's too, with CPU
    activity alone).  This reads the kineto results as
    ``memscale._measure`` does (``prof.profiler.kineto_results``,
    not a public API).  None when this torch does not provide them."""
    try:
        raw = prof.profiler.kineto_results.events()
        out = []
        for e in raw:
            name = e.name()
            if (
                device_type is not None
                and name == "[memory]"
                # DeviceType.CUDA -> "cuda"
                and str(e.device_type()).rsplit(".", 1)[-1].lower() != device_type
            ):
                continue
            out.append((name, e.start_ns(), e.end_ns(), e.nbytes()))
        return out
    except AttributeError:  # pragma: no cover - depends on the torch build
        logger.info("the profiler's raw events are unavailable in torch %s", torch.__version__)
        return None


def top_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The innermost saved-tensor hooks in force, ``(pack, unpack)``, or
    None when there are none.  torch keeps that stack in C++ and shows its
    top only through the private
    ``torch._C._autograd._top_saved_tensors_default_hooks``; where this
    torch lacks it, :data:`SAVED_TENSORS_HOOKS_VISIBLE` is False and this
    returns None."""
    if _TOP_HOOKS is None:
        return None
    return _TOP_HOOKS(False)  # ignore_is_tracing=False


_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
SAVED_TENSORS_HOOKS_VISIBLE = _TOP_HOOKS is not None


def autograd_nodes(tensor: torch.Tensor) -> list[Any]:
    """Every node of the autograd graph behind ``tensor`` (each once),
    following ``grad_fn.next_functions``."""
    nodes: list[Any] = []
    seen: set[int] = set()
    stack = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return nodes


def register_first_pre_hook(module: torch.nn.Module, hook: Any, **kwargs: Any) -> Any:
    """``module.register_forward_pre_hook(hook, prepend=True, **kwargs)``
    with the hook first in the dict's own order too: ``prepend`` moves it
    to the front of the OrderedDict's order only, while a plain ``dict``
    view of it (``dict.keys``, as torch 2.11's dynamo reads the hooks into
    its guards) still has it last, so that dynamo guarded on another hook
    than the one it traced and failed the guard on the frame it made it
    for.  The other hooks keep their ids and order."""
    handle = module.register_forward_pre_hook(hook, **kwargs)
    hooks = module._forward_pre_hooks
    rest = [(key, value) for key, value in hooks.items() if key != handle.id]
    mine = hooks[handle.id]
    hooks.clear()
    hooks[handle.id] = mine
    hooks.update(rest)
    return handle


def install_call_guard(model: torch.nn.Module, on_abort: Callable[[], None]) -> Callable[[], None]:
    """Make every call of ``model`` run ``on_abort()`` when it is left by an
    exception, then re-raise it; return the function that removes the
    guard.

    torch runs a module's ``always_call`` forward hooks only when the
    forward raises an ``Exception``: a ``KeyboardInterrupt`` (any other
    ``BaseException``) skips them, and what the pre-hooks entered (memscale's
    saved-tensor hooks and autocast) would stay entered process-wide.  The
    guard goes in ``Module._compiled_call_impl``, the per-instance slot
    ``Module.__call__`` runs in place of ``_call_impl`` when it is set (this
    is where ``Module.compile()`` puts its compiled call; a call already
    there is kept and run inside the guard).  ``Module.__getstate__`` drops
    the slot, so copies and pickles of the model do not carry it.  The
    guard holds the model weakly; nested calls of the same model abort only
    at the outermost one.
    """
    prev = model.__dict__.get("_compiled_call_impl")
    model_ref = weakref.ref(model)
    depth = [0]

    def guard(*args: Any, **kwargs: Any) -> Any:
        # The class's _call_impl is called with the model, not bound with
        # __get__: torch 2.11's dynamo cannot trace function.__get__ (it
        # broke the graph there and then failed its own guard check).
        call: Callable[..., Any] | None = prev
        first: tuple[Any, ...] = ()
        if call is None:
            m = model_ref()
            if m is None:  # pragma: no cover - called through a dead model
                raise ReferenceError("memscale: the model is gone")
            call, first = type(m)._call_impl, (m,)
        depth[0] += 1
        try:
            return call(*first, *args, **kwargs)
        except BaseException:
            if depth[0] == 1:
                try:
                    on_abort()
                except Exception:  # the original exception is what matters
                    logger.exception("memscale: cleaning up after an interrupted forward failed")
            raise
        finally:
            depth[0] -= 1

    model.__dict__["_compiled_call_impl"] = guard

    def remove() -> None:
        m = model_ref()
        if m is None or m.__dict__.get("_compiled_call_impl") is not guard:
            return  # gone, or replaced since (Module.compile()): leave it
        if prev is None:
            del m.__dict__["_compiled_call_impl"]
        else:
            m.__dict__["_compiled_call_impl"] = prev

    return remove


def graph_task_id() -> int:
    """The id of the backward pass running in this thread, -1 outside one
    (``torch._C._current_graph_task_id``)."""
    return int(torch._C._current_graph_task_id())


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass running now completes (not
    when it raises): the autograd engine's ``queue_callback``, called from
    inside a backward hook."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def raw_optimizer_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """``optimizer``'s class ``step`` without the wrapper ``Optimizer``
    puts around it (``profile_hook_step``: the profiler range and the step
    hooks), unbound.  The class's own step when it is not wrapped."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = getattr(step, "__wrapped__", step)
    return step


def optimizer_step_hooks(optimizer: torch.optim.Optimizer) -> tuple[list[Any], list[Any]]:
    """The step pre-hooks and post-hooks that run around ``optimizer.step``
    (its own and the global ones, in torch's order)."""
    from torch.optim import optimizer as _opt

    pre = list(getattr(_opt, "_global_optimizer_pre_hooks", {}).values())
    pre += list(getattr(optimizer, "_optimizer_step_pre_hooks", {}).values())
    post = list(getattr(optimizer, "_optimizer_step_post_hooks", {}).values())
    post += list(getattr(_opt, "_global_optimizer_post_hooks", {}).values())
    return pre, post


def default_foreach(params: list[torch.Tensor]) -> bool:
    """Whether torch's optimizers take their foreach path for ``params``
    when a group says ``foreach=None`` (the decision is made over all of a
    step's parameters; a step of one parameter must make the same one)."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # pragma: no cover - depends on the torch release
        return False
    _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    return bool(foreach)


def default_foreach_of_group(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], default: bool
) -> bool:
    """The foreach choice torch's ordinary step makes for ``group`` (with
    foreach=None and fused unset) when ``default`` is its choice over all
    the step's parameters: torch's Adam family turns foreach off for a
    Tensor ``lr`` without ``capturable`` (torch/optim/adam.py)."""
    if (
        default
        and isinstance(optimizer, torch.optim.Adam)
        and isinstance(group.get("lr"), torch.Tensor)
        and not group.get("capturable", False)
    ):
        return False
    return default


def drop_copied_attribute(compiled: Any, name: str) -> None:
    """Delete ``name`` from the functions a ``torch.compile`` wrapper made
    around the module it compiles: dynamo wraps the module object itself
    with ``functools.wraps``, which copies the module's ``__dict__`` (and
    so memscale's executor) into each wrapper function's."""
    seen: set[int] = set()
    todo = [compiled.__dict__.get(key) for key in ("forward", "_forward")]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if isinstance(fn, types.MethodType):
            todo.append(fn.__func__)
        elif isinstance(fn, types.FunctionType):  # never the module itself
            fn.__dict__.pop(name, None)
            todo.append(fn.__dict__.get("__wrapped__"))


def compiled_inner(target: Any) -> Any:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``, which
    keeps it as ``_orig_mod``) compiles, or None when ``target`` is not one."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is None or not isinstance(target, optimized):
        return None
    inner = target.__dict__.get("_modules", {}).get("_orig_mod")
    return inner if isinstance(inner, torch.nn.Module) else None


def op_writes_new(func: Any) -> bool:
    """Whether the aten operator ``func`` writes new tensors: no output
    aliases an input (views and in-place ops own no memory of their
    own).  Reads its private ``_schema``; False for an operator without
    one (a higher-order operator)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    return all(ret.alias_info is None for ret in schema.returns)


def op_packet(func: Any) -> Any:
    """The overload packet of the aten operator ``func`` (the key of
    ``torch.utils.flop_counter.flop_registry``; its private
    ``_overloadpacket``; None for an operator without one)."""
    return getattr(func, "_overloadpacket", None)


# torch's FLOP formulas of the fused attention kernels assert that query,
# key and value have as many heads; with grouped-query attention
# (``enable_gqa=True``, which Hugging Face's SDPA path passes on CUDA when
# there is no mask) the kernels take fewer key/value heads, and
# FlopCounterMode raised inside the step.  Each query head attends over its
# group's keys as it would over its own, so the FLOPs are those of the
# keys and values expanded to the query's heads.  Per operator: the
# positions of the query and of the key and value (B, H, S, D).
_GROUPED_SDPA = {
    "_scaled_dot_product_flash_attention": (0, (1, 2)),
    "_scaled_dot_product_efficient_attention": (0, (1, 2)),
    "_scaled_dot_product_cudnn_attention": (0, (1, 2)),
    "_scaled_dot_product_flash_attention_backward": (1, (2, 3)),
    "_scaled_dot_product_efficient_attention_backward": (1, (2, 3)),
    "_scaled_dot_product_cudnn_attention_backward": (1, (2, 3)),
}


def _shape_of(x: Any) -> Any:
    return x.shape if isinstance(x, torch.Tensor) else x


def _grouped_formula(packet: Any, query: int, kv: tuple[int, ...]) -> Any:
    """``packet``'s formula in torch's ``flop_registry`` (looked up at each
    call, so a formula registered later is used; it takes tensors or
    shapes, and ``out_val``) counting a grouped-query call as the same call
    with its keys and values expanded to the query's heads."""
    from torch.utils.flop_counter import flop_registry

    def count(*args: Any, out_val: Any = None, out_shape: Any = None, **kwargs: Any) -> Any:
        shapes = [_shape_of(a) for a in args]
        q = shapes[query] if query < len(shapes) else None
        if isinstance(q, torch.Size) and len(q) == 4:
            for i in kv:
                if i < len(shapes):
                    k = shapes[i]
                    if (
                        isinstance(k, torch.Size)
                        and len(k) == 4
                        and k[1] != q[1]
                        and k[1] > 0
                        and q[1] % k[1] == 0
                    ):
                        shapes[i] = torch.Size((k[0], q[1], k[2], k[3]))
        out = out_val if out_val is not None else out_shape
        return flop_registry[packet](*shapes, out_val=out, **kwargs)

    return count


def _flop_mapping_uncached() -> dict[Any, Any]:
    from torch.utils.flop_counter import flop_registry

    mapping = {}
    for name, (query, kv) in _GROUPED_SDPA.items():
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and packet in flop_registry:
            mapping[packet] = _grouped_formula(packet, query, kv)
    return mapping


_FLOP_MAPPING: list[dict[Any, Any]] = []


def flop_mapping() -> dict[Any, Any]:
    """The formulas memscale counts with besides torch's ``flop_registry``:
    the fused attention kernels' counting grouped-query calls too (see
    ``_GROUPED_SDPA``).  Pass as ``FlopCounterMode(custom_mapping=...)``
    (their formulas take shapes, as torch's own do)."""
    if not _FLOP_MAPPING:
        _FLOP_MAPPING.append(_flop_mapping_uncached())
    return _FLOP_MAPPING[0]


def flop_counter(**kwargs: Any) -> Any:
    """A ``torch.utils.flop_counter.FlopCounterMode(display=False)`` that
    counts with :func:`flop_mapping` too."""
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False, custom_mapping=flop_mapping(), **kwargs)


def flop_formula(func: Any) -> Any:
    """The FLOP formula of the aten operator ``func`` (called with the
    call's arguments and ``out_val``), or None where it has none."""
    from torch.utils.flop_counter import flop_registry

    packet = op_packet(func)
    if packet is None:
        return None
    return flop_mapping().get(packet) or flop_registry.get(packet)


class _CallFlops:
    """The FLOPs of one operator call by its formula (:func:`flop_formula`),
    None where it has none; remembered per operator and the shapes and
    other values of the call's arguments and output.

    A formula of torch's made by its ``shape_wrapper`` (every one but those
    registered ``get_raw``) is given each tensor's shape and every other
    value as it is, and memscale's (:func:`_grouped_formula`) hands shapes
    on to torch's, which it reads at each call: the operator, the formulas,
    the tensors' shapes and the other values decide the result, so a call
    with the same ones gets the one counted first.  (Torch's wrapper walks
    the arguments with pytree: in a deep model's profiled forward, the
    formulas cost more than the calls.)  A call with another kind of value
    or a symbolic size, or whose formula may read tensors' values, is
    counted every time."""

    # Remembered calls at most (the memo starts again past it).
    LIMIT = 1 << 16

    def __init__(self) -> None:
        self._memo: dict[tuple[Any, ...], Any] = {}
        self._shape_codes: tuple[Any, ...] | None = None

    def _shape_only(self, formula: Any) -> bool:
        """Whether ``formula`` is one of torch's made by ``shape_wrapper``
        (given shapes and the other values only)."""
        if self._shape_codes is None:
            from torch.utils.flop_counter import shape_wrapper

            self._shape_codes = (shape_wrapper(_shape_of).__code__,)
        return getattr(formula, "__code__", None) in self._shape_codes

    def __call__(self, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        # (looked up at each call: a formula registered later counts)
        formula = flop_formula(func)
        if formula is None:
            return None
        inner = formula
        if getattr(formula, "__code__", None) is _GROUPED_CODE:
            # memscale's wrapper reads torch's formula at each call: that
            # one decides, and is keyed.
            from torch.utils.flop_counter import flop_registry

            inner = flop_registry.get(op_packet(func))
        if inner is None or not self._shape_only(inner):
            return formula(*args, **kwargs, out_val=out)
        key: list[Any] = [formula, inner, func, len(args)]
        if not _shape_key(args, key):
            return formula(*args, **kwargs, out_val=out)
        if kwargs:
            key += (len(kwargs), *kwargs)
            if not _shape_key(kwargs.values(), key):
                return formula(*args, **kwargs, out_val=out)
        if not _shape_key((out,), key):
            return formula(*args, **kwargs, out_val=out)
        memo_key = tuple(key)
        try:
            got = self._memo.get(memo_key, _UNSEEN)
        except TypeError:  # a symbolic size: not hashable
            return formula(*args, **kwargs, out_val=out)
        if got is _UNSEEN:
            got = formula(*args, **kwargs, out_val=out)
            if len(self._memo) >= self.LIMIT:
                self._memo.clear()
            self._memo[memo_key] = got
        return got


def _shape_key(values: Any, out: list[Any]) -> bool:
    """Append to ``out`` what a shape-reading FLOP formula is given of
    ``values``: each tensor's shape, each list's and tuple's length and
    items, each other value with its type; False for a value of another
    type (not keyed)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            out += (_TENSOR, v.shape)
        elif type(v) is list or type(v) is tuple:
            out += (type(v), len(v))
            if not _shape_key(v, out):
                return False
        elif v is None or type(v) in _KEYED_TYPES:
            out += (type(v), v)
        else:
            return False
    return True


_TENSOR: Any = object()

_GROUPED_CODE = _grouped_formula(None, 0, ()).__code__

# The FLOPs of operator calls (FlopTally and the selective recorder's
# op_cost count with it).
call_flops = _CallFlops()


NO_ARGUMENT = object()


def op_argument(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The value of the aten operator ``func``'s argument ``name`` in this
    call (from ``args`` or ``kwargs``, else its schema's default), or
    ``NO_ARGUMENT`` when it has no such argument or no schema.  Reads its
    private ``_schema``."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return NO_ARGUMENT
    for i, arg in enumerate(schema.arguments):
        if arg.name != name:
            continue
        if name in kwargs:
            return kwargs[name]
        if i < len(args) and not arg.kwarg_only:
            return args[i]
        return arg.default_value
    return NO_ARGUMENT


def op_written_args(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments the aten operator ``func`` writes in place (its
    schema marks them ``Tensor(a!)``), from ``args`` and ``kwargs``; none
    for an operator without a schema.  Reads its private ``_schema``."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        if i < len(args):
            written.append(args[i])
        elif arg.name in kwargs:
            written.append(kwargs[arg.name])
    return written


def selective_supported() -> bool:
    """Whether this torch can run memscale's selective checkpointing: it
    has dispatch modes, and its non-reentrant checkpoint takes a
    ``context_fn`` (memscale's own forward and recompute modes,
    ``memscale._selective.contexts``; nothing private of torch's
    selective checkpoint is used, so torch 2.4 and later run it)."""
    if not _SELECTIVE_OK:
        _SELECTIVE_OK.append(_selective_check_uncached())
    return _SELECTIVE_OK[0]


def _selective_check_uncached() -> bool:
    import inspect

    from torch.utils import checkpoint as ckpt

    if dispatch_mode_base() is None:
        return False
    try:
        return "context_fn" in inspect.signature(ckpt.checkpoint).parameters
    except (TypeError, ValueError):  # pragma: no cover - depends on the torch release
        return False


_SELECTIVE_OK: list[bool] = []
