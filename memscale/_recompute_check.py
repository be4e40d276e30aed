"""Each checkpointed layer is checked once, at its first checkpointed
forward: does running it again compute what its forward computed?

Checkpointing is only exact when a layer's recompute in backward saves the
same tensors as its forward did.  A layer whose forward reads state that
running it changes does not: a key/value cache it appends to (Hugging
Face's with ``use_cache=True``), a counter or an attribute it updates,
random numbers drawn outside torch's RNG.  Found in backward, that is a
crash deep inside autograd with the step lost (or, when only values
differ, a wrong gradient nobody sees).  Found here, it is one log line and
the layer is simply not checkpointed.

How, for each checkpointed layer (not tiled ones: the tile verifier checks
those), at its first training forward under a checkpoint frame:

1. The forward runs under saved-tensor hooks of ours, pushed inside the
   executor's frame: each tensor the forward saves is fingerprinted
   (shape, dtype, device and, where kernels are deterministic, a hash of
   its bytes)
   and held by us for now.
2. Right after, still inside the layer's call, its forward runs again as
   its recompute would (same inputs, torch's RNG state from before the
   forward, the state its pre-hooks set still in force; buffers put back
   after), and what it
   saves is fingerprinted and dropped at once.
3. Equal: the held tensors are handed to the frame (which keeps only a
   handle, as always) and the layer is checkpointed from then on.
   Different: the held tensors stay, so this step's backward uses them
   (exact, no recompute); the layer, the saved tensor and the likely
   cause are logged, and from the next forward on the plan is made again
   with that layer ineligible (rule ``ineligible:unrepeatable``).  With
   ``Config(strict_recompute=True)`` a :class:`RecomputeMismatchError`
   is raised instead.
   Under ``torch.distributed`` the ranks agree first: at the next
   training forward after one that checked a layer, every rank gathers
   the layers that failed on any rank, and the plan made again is
   exchanged as the first one was (``_distributed.shared_plan``), so
   every rank runs the same plan.  (Every rank must run the same layers
   in its training forwards, as DDP and FSDP2 require anyway.)

The check costs one more forward of each checkpointed layer and, while a
layer is checked, that layer's saved tensors: once per layer, at the first
step.  Like a recompute, the second run repeats the forward's side effects
(a cache it appends to gets the entry twice).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import _core, _distributed, _offload, _tiling, _torch_compat, _verify
from ._format import plan_table
from ._solve import PlanProblem

logger = logging.getLogger(__name__)

__all__ = ["RecomputeMismatchError", "install"]

_MISSING = object()
_LIKELY = (
    "its forward reads state that running it changes: a key/value cache it "
    "appends to (a Hugging Face model given use_cache=True), a counter or "
    "an attribute it updates, or random numbers drawn outside torch's RNG"
)


class RecomputeMismatchError(RuntimeError):
    """A checkpointed layer computed something else when run again, and
    ``Config(strict_recompute=True)`` asked for an error."""


def _fingerprint(t: torch.Tensor, values: bool, state: set[int]) -> tuple[Any, ...]:
    """Shape, dtype, device and (with ``values``) a hash of ``t``'s bytes; none
    for the layer's buffers (``state``: their storages), which its forward
    may update (BatchNorm's running statistics: a recompute restores them,
    and training-mode gradients do not read them)."""
    meta = (tuple(t.shape), t.dtype, t.device.type)
    if not values or t.is_meta or _torch_compat.is_fake(t) or _torch_compat.storage_key(t) in state:
        return (*meta, None)
    try:
        with torch.no_grad():
            x = t.detach().resolve_conj().resolve_neg().contiguous()
            raw_t = x.reshape(-1).view(torch.uint8).cpu()
            if raw_t.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                # numpy() marks a storage it reads as not resizable: not
                # the model's (FSDP2 frees its unsharded parameters by
                # resizing their storage to 0), a copy of it.
                raw_t = raw_t.clone()
            raw = raw_t.numpy().tobytes()
    except (RuntimeError, TypeError):  # sparse, nested, ...: shapes only
        return (*meta, None)
    return (*meta, hashlib.blake2b(raw, digest_size=16).hexdigest())


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[:3] == b[:3] and (a[3] is None or b[3] is None or a[3] == b[3])


def _describe(fp: tuple[Any, ...]) -> str:
    dtype = str(fp[1]).replace("torch.", "")
    return f"{dtype}{list(fp[0])}"


def _difference(first: list[tuple[Any, ...]], again: list[tuple[Any, ...]]) -> str | None:
    """What differs between the forward's saved tensors and the second
    run's, in words; None when they agree."""
    for k, (a, b) in enumerate(zip(first, again)):
        if not _same(a, b):
            if a[:3] == b[:3]:
                return (
                    f"saved tensor #{k} ({_describe(a)}) has other values "
                    f"when run again (sum {b[3]!r} instead of {a[3]!r})"
                )
            return (
                f"saved tensor #{k} is {_describe(b)} when run again "
                f"where the forward saved {_describe(a)}"
            )
    if len(first) != len(again):
        k = min(len(first), len(again))
        extra = (again if len(again) > k else first)[k]
        return (
            f"the forward saved {len(first)} tensors and the second run "
            f"{len(again)} (from saved tensor #{k}, {_describe(extra)})"
        )
    return None


class _Held:
    """What our pack returns while a layer is checked: the tensor itself,
    then (once the layer passed) the executor frame's handle for it."""

    __slots__ = ("handle", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.handle: Any = None


def _is_frame_pack(pack: Any) -> bool:
    owner = getattr(pack, "__self__", None)
    return (
        getattr(pack, "__name__", "") == "_pack"
        and type(owner).__module__ == _core.__name__
        and type(owner).__name__ == "_Frame"
    )


def _cpu_cuda_rng() -> tuple[torch.Tensor, Any]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_cpu_cuda_rng(state: tuple[torch.Tensor, Any]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


class RecomputeCheck:
    """The check of one wrapped model's checkpointed layers (see the
    module docstring); removed by the executor's detach."""

    def __init__(
        self,
        executor: Any,
        model: nn.Module,
        plan: Any,
        problem: PlanProblem | None,
        strict: bool,
    ) -> None:
        self._executor = weakref.ref(executor)
        self._problem = problem
        self.strict = strict
        self.names = list(executor.layer_names)
        self.units = [model.get_submodule(name) for name in self.names]
        self.passed: set[int] = set()
        self.failed: dict[int, str] = {}
        self._replanned: set[int] = set()
        self._wrapped: dict[int, Any] = {}  # index -> previous forward
        self._busy = False
        # Under torch.distributed: whether this rank checked a layer since
        # the ranks last agreed on the failures.
        self._exchange_due = False
        self._root = _torch_compat.register_first_pre_hook(model, self._replan)
        self._arm(plan)

    # ---- which layers, and their forward ---------------------------------

    def _arm(self, plan: Any) -> None:
        for i, layer in enumerate(plan.layers):
            if (
                "checkpoint" in layer.techniques
                and layer.tiles <= 1
                and i not in self.passed
                and i not in self._wrapped
            ):
                self._wrap(i)

    def _wrap(self, i: int) -> None:
        unit = self.units[i]
        previous = unit.__dict__.get("forward", _MISSING)
        inner = unit.forward
        check = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            return check._forward(i, inner, args, kwargs)

        unit.__dict__["forward"] = forward
        self._wrapped[i] = previous

    def _unwrap(self, i: int) -> None:
        if i not in self._wrapped:
            return
        previous = self._wrapped.pop(i)
        unit = self.units[i]
        if previous is _MISSING:
            unit.__dict__.pop("forward", None)
        else:
            unit.__dict__["forward"] = previous

    def remove(self) -> None:
        """Every forward put back, the hook off, no reference to the model
        kept."""
        for i in list(self._wrapped):
            self._unwrap(i)
        self._root.remove()
        self.units = []
        self._problem = None

    # ---- the check ---------------------------------------------------------

    def _forward(
        self, i: int, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if torch.compiler.is_compiling():
            # Compiled: the recompute is part of the graph, not a replay of
            # this forward (memscale._compiled); nothing to check.
            return inner(*args, **kwargs)
        hooks = _torch_compat.top_saved_tensors_hooks()
        if (
            self._busy
            or i in self.passed
            or hooks is None
            or not _is_frame_pack(hooks[0])
            or not torch.is_grad_enabled()
        ):
            return inner(*args, **kwargs)  # not under a checkpoint frame now
        if i in self.failed:
            # Called again before the plan is made again (a layer shared by
            # several positions): it keeps its saved tensors too.
            with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                return inner(*args, **kwargs)
        frame_pack, frame_unpack = hooks
        values = (
            all(not t.is_cuda for t in _planning_tensors(args, kwargs))
            or torch.are_deterministic_algorithms_enabled()
        )
        state = {_torch_compat.storage_key(b) for b in self.units[i].buffers()}
        rng = _cpu_cuda_rng()
        held: list[_Held] = []
        first: list[tuple[Any, ...]] = []

        def pack(t: torch.Tensor) -> _Held:
            first.append(_fingerprint(t, values, state))
            box = _Held(t)
            held.append(box)
            return box

        def unpack(box: _Held) -> torch.Tensor:
            if box.tensor is not None:
                return box.tensor
            return frame_unpack(box.handle)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = inner(*args, **kwargs)
        again = self._run_again(i, inner, args, kwargs, rng, values, state)
        why = _difference(first, again)
        self._exchange_due = True
        if why is None:
            for box in held:  # the frame keeps handles only, as always
                box.handle = frame_pack(box.tensor)
                box.tensor = None
            self.passed.add(i)
            self._unwrap(i)
            return out
        message = (
            f"memscale: checkpointed layer {self.names[i]!r} "
            f"({type(self.units[i]).__name__}) does not compute the same "
            f"when run again, as its recompute in backward would: {why}. "
            f"Likely cause: {_LIKELY}."
        )
        if self.strict:
            raise RecomputeMismatchError(
                message + " Make its forward repeatable, or set "
                "Config(strict_recompute=False) to let memscale stop "
                "checkpointing this layer instead."
            )
        logger.warning(
            "%s Checkpointing is off for this layer from the next "
            "forward on (this step keeps its activations, so it is "
            "exact); Config(strict_recompute=True) raises instead.",
            message,
        )
        self.failed[i] = why
        return out

    def _run_again(
        self,
        i: int,
        inner: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        rng: tuple[torch.Tensor, Any],
        values: bool,
        state: set[int],
    ) -> list[tuple[Any, ...]]:
        """Run layer ``i`` as its recompute would; its saved tensors'
        fingerprints (the tensors themselves are dropped at once)."""
        unit = self.units[i]
        again: list[tuple[Any, ...]] = []

        def pack(t: torch.Tensor) -> None:
            again.append(_fingerprint(t, values, state))

        def unpack(_: None) -> torch.Tensor:
            raise RuntimeError(
                "memscale: internal error: a tensor of the recompute check was unpacked"
            )

        # torch's RNG from where the forward started, as the recompute sets
        # it; every other stream goes on from here, as in the recompute.
        # All are put back after: the check changes no RNG stream.
        now = _verify.rng_state()
        buffers = [(b, b.detach().clone()) for b in unit.buffers()]
        executor = self._executor()
        self._busy = True
        try:
            _set_cpu_cuda_rng(rng)
            # The forward itself, not the module's call: we are inside the
            # call, so what its pre-hooks did (an FSDP2 all-gather, arguments
            # they replaced) is still in force, and running them again inside
            # it would not be (FSDP2 would reshard twice).  A step measured
            # for real does not count this run's FLOPs.
            with (
                torch.enable_grad(),
                torch.autograd.graph.saved_tensors_hooks(pack, unpack),
                contextlib.nullcontext() if executor is None else executor.unmeasured(),
            ):
                inner(*args, **kwargs)
        finally:
            self._busy = False
            _verify.set_rng_state(now)
            with torch.no_grad():
                for buf, value in buffers:
                    buf.copy_(value)
        return again

    @property
    def excluded(self) -> set[int]:
        """The layers plans are made without (failed the check here or,
        under torch.distributed, on another rank)."""
        return set(self._replanned)

    def rearm(self, plan: Any, problem: PlanProblem | None) -> None:
        """A new plan replaced the one checked (made from measured steps):
        the layers it newly checkpoints are checked too, and a layer that
        fails is planned without from ``problem``, the new plan's."""
        self._problem = problem
        self._arm(plan)

    # ---- the fallback --------------------------------------------------------

    def _replan(self, model: nn.Module, args: Any) -> None:
        """Before a forward: the plan made again without the layers that
        failed the check (once per failed layer); under torch.distributed,
        the layers that failed on any rank, with the plan exchanged."""
        if torch.compiler.is_compiling():
            return  # planning is eager; the compiled path needs no check
        executor = self._executor()
        if executor is None or self._problem is None:
            return
        if _distributed.active():
            # A collective: only at a training forward (one every rank
            # runs; an evaluation on one rank must not wait for the
            # others), after one that checked a layer.
            if not (self._exchange_due and model.training and torch.is_grad_enabled()):
                return
            self._exchange_due = False
            failed = _distributed.union_of_ranks(set(self.failed))
        else:
            failed = set(self.failed)
        todo = sorted(failed - self._replanned)
        if not todo:
            return
        self._replanned.update(todo)
        problem = self._problem.with_layer_flags(failed, _core.LAYER_UNREPEATABLE)
        plan = _distributed.shared_plan(problem)
        old = executor.plan
        executor.apply(plan)
        for i in todo:
            self._unwrap(i)
        self._problem = problem
        attach_new_needs(executor, old, plan)
        elsewhere = [i for i in todo if i not in self.failed]
        logger.warning(
            "memscale: plan made again without checkpointing %s "
            "(rule ineligible:unrepeatable%s):\n%s",
            ", ".join(repr(self.names[i]) for i in todo),
            (
                "; failed the check on another rank: "
                + ", ".join(repr(self.names[i]) for i in elsewhere)
                if elsewhere
                else ""
            ),
            plan_table(plan),
        )
        self._arm(plan)  # layers the new plan checkpoints are checked too


def _keep(t: Any) -> Any:
    return t


def _planning_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack: list[Any] = [args, kwargs]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return out


def attach_new_needs(executor: Any, old: Any, plan: Any) -> None:
    """What the new plan uses and the old one did not set up: an offload
    tier, tiled forwards."""
    if executor.offload_store is None and executor.offload_host is None:
        _offload.attach(executor, executor.config, plan)
    before = {i for i, layer in enumerate(old.layers) if layer.tiles > 1} if old else set()
    new = [i for i, layer in enumerate(plan.layers) if layer.tiles > 1 and i not in before]
    if new:
        model = executor.model
        units = [(name, model.get_submodule(name)) for name in executor.layer_names]
        only_new = _Layers(
            [layer if i in new else _Untiled() for i, layer in enumerate(plan.layers)]
        )
        _tiling.install(executor, units, only_new)


class _Untiled:
    tiles = 1


class _Layers:
    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers


def install(
    executor: Any,
    model: nn.Module,
    plan: Any,
    problem: PlanProblem | None,
) -> RecomputeCheck | None:
    """Check ``plan``'s checkpointed layers at their first checkpointed
    forward (removed by the executor's detach).  ``problem``, the plan's,
    is solved again without a layer that fails (None: not planned again)."""
    if not any("checkpoint" in layer.techniques and layer.tiles <= 1 for layer in plan.layers):
        return None
    if not _torch_compat.SAVED_TENSORS_HOOKS_VISIBLE:
        logger.info(
            "memscale: this torch (%s) does not show its saved-tensor "
            "hooks; checkpointed layers are not checked at the first "
            "step (a recompute that differs in shape still fails in "
            "backward)",
            torch.__version__,
        )
        return None
    check = RecomputeCheck(
        executor, model, plan, problem, bool(getattr(executor.config, "strict_recompute", False))
    )
    executor.on_detach(check.remove)

    def fix_copy(copy_of: Any) -> None:
        # A copy of the wrapped model must not keep our forwards (bound to
        # the original's layers).
        for i, previous in list(check._wrapped.items()):
            copied = copy_of(check.units[i])
            if copied is not None and previous is _MISSING:
                copied.__dict__.pop("forward", None)

    executor.on_copy(fix_copy)
    executor.recompute_check = check
    return check
