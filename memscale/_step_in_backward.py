"""Below the floor: the optimizer step inside backward, and the optimizer
state on a tier (``Config.optimizer_in_backward``,
``Config.offload_optimizer_state``; docs/below-the-floor.md).

:class:`StepInBackward` registers a post-accumulate-grad hook on every
trainable parameter of the optimizer.  When backward has finished a
parameter's gradient, the hook runs the user's own optimizer on a
one-parameter view of that parameter's group (the group's current
hyper-parameters, so a learning-rate scheduler's changes are seen), then
sets the gradient to None: at most the gradients of the layer in flight
exist at once.  ``optimizer.step()`` becomes a step that runs its closure
(if any) and the step post-hooks, and updates nothing (backward did);
``zero_grad()`` keeps its meaning (there is nothing left to zero).

With a state tier, a parameter's state tensors leave for the tier right
after its update (a fresh slot each time: the tier holds the last
completed update's state) and come back just before the next one; the
tier's I/O thread reads the states of the parameters expected next (in
the order of the last backward) ahead of need.  ``state_dict()`` brings
the whole state back for the dict it returns; ``load_state_dict()`` sends
the loaded state to the tier.

This module imports no other part of memscale but the torch compatibility
layer, the offload tier's spill directory helpers and the config.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from . import _core, _distributed, _offload, _torch_compat
from .config import Config

logger = logging.getLogger(__name__)

__all__ = [
    "DiskStateTier",
    "HostStateTier",
    "SimulatedStateTier",
    "StateTier",
    "StepInBackward",
    "check",
    "install",
]


class StateTier(Protocol):
    """Where optimizer state tensors wait between two updates."""

    def put(self, t: torch.Tensor) -> Any | None:
        """A record standing for ``t`` (the caller drops ``t``), or None
        when ``t`` stays in memory."""

    def prefetch(self, record: Any) -> None:
        """Start bringing ``record`` back (only an optimisation)."""

    def get(self, record: Any) -> torch.Tensor:
        """The tensor back, on its device; the record is used up."""

    def discard(self, record: Any) -> None:
        """``record`` will never be read (the state it stands for was
        replaced): give back what it holds."""

    def end_step(self) -> None:
        """A backward pass completed."""

    def close(self) -> None:
        """Free the tier (records still alive are dropped unread)."""

    @property
    def stats(self) -> dict[str, Any]: ...


# --------------------------------------------------------------------------
# Tiers.


class _DiskRecord:
    __slots__ = ("device", "spilled")

    def __init__(self, spilled: Any, device: torch.device) -> None:
        self.spilled = spilled
        self.device = device


class DiskStateTier:
    """The disk tier: a ``SpillStore`` of its own (an unlinked file in a
    private directory, an I/O thread), with no cap but ``max_bytes``
    (``AsyncOffloadConfig.max_disk_gb``).  Device tensors are copied to
    host memory first."""

    def __init__(
        self,
        spill_dir: str | None,
        max_bytes: int | None,
        *,
        async_io: bool = True,
        debug: bool = False,
    ):
        self._path = _offload.make_spill_dir(spill_dir)
        self._creator = os.getpid()
        try:
            self.store = _core.SpillStore(
                self._path,
                async_io=async_io,
                min_bytes=0,
                max_bytes=-1 if max_bytes is None else max_bytes,
                prefetch_depth=0,  # this tier prefetches by hand
                debug=debug,  # AsyncOffloadConfig.debug: checksum every read
                log=_offload.log_event,
            )
        except BaseException:
            _offload.remove_dir(self._path, self._creator)
            raise
        _offload.register_store(self.store)
        self._finalizer = weakref.finalize(self, _offload.remove_dir, self._path, self._creator)
        self.bytes_put = 0

    @property
    def path(self) -> str:
        return self._path

    def put(self, t: torch.Tensor) -> _DiskRecord | None:
        device = t.device
        host = t.detach() if device.type == "cpu" else t.detach().to("cpu")
        spilled = self.store.put_copy(host)
        if spilled is None:
            return None
        self.bytes_put += int(spilled.nbytes)
        return _DiskRecord(spilled, device)

    def prefetch(self, record: Any) -> None:
        if isinstance(record, _DiskRecord):
            record.spilled.prefetch()

    def get(self, record: Any) -> torch.Tensor:
        t = record.spilled.get()
        if record.device.type != "cpu":
            t = t.to(record.device)
        return t

    def discard(self, record: Any) -> None:
        pass  # the C record frees its slot when it is dropped

    def end_step(self) -> None:
        self.store.new_step()  # forget the step's put order

    def close(self) -> None:
        self.store.close()
        self._finalizer()

    @property
    def stats(self) -> dict[str, Any]:
        return dict(self.store.stats)


class _HostRecord:
    __slots__ = ("back", "back_event", "device", "event", "host", "nbytes")

    def __init__(self, host: torch.Tensor, device: torch.device, nbytes: int, event: Any) -> None:
        self.host = host
        self.device = device
        self.nbytes = nbytes
        self.event = event  # the device-to-host copy's, or None
        self.back: torch.Tensor | None = None  # prefetched to the device
        self.back_event: Any = None


class HostStateTier:
    """The host tier for a CUDA model: each state tensor in a pinned host
    tensor of its own, copied on a side stream, up to ``cap_bytes``
    (``max_cpu_offload_gb``; -1 for none); beyond the cap, the disk tier
    when there is one, else the tensor stays on the device.  Unverified:
    this project's machines have no GPU."""

    def __init__(self, cap_bytes: int, disk: DiskStateTier | None) -> None:
        self.cap_bytes = cap_bytes
        self.disk = disk
        self.used = 0
        self.bytes_put = 0
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._counts = {"to_host": 0, "to_disk": 0, "kept": 0, "prefetched": 0}

    def put(self, t: torch.Tensor) -> Any | None:
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cuda" or not t.is_contiguous():
            return None
        if self.cap_bytes >= 0 and self.used + nbytes > self.cap_bytes:
            rec = self.disk.put(t) if self.disk is not None else None
            self._counts["to_disk" if rec is not None else "kept"] += 1
            return rec
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        event = _offload.copy_out(t, host, self.stream)
        self.used += nbytes
        self.bytes_put += nbytes
        self._counts["to_host"] += 1
        return _HostRecord(host, t.device, nbytes, event)

    def prefetch(self, record: Any) -> None:
        if not isinstance(record, _HostRecord):
            if self.disk is not None:
                self.disk.prefetch(record)
            return
        if record.back is not None or self.stream is None:
            return
        with torch.cuda.stream(self.stream):
            if record.event is not None:
                self.stream.wait_event(record.event)
            record.back = record.host.to(record.device, non_blocking=True)
            record.back_event = torch.cuda.Event()
            record.back_event.record(self.stream)
        self._counts["prefetched"] += 1

    def get(self, record: Any) -> torch.Tensor:
        if not isinstance(record, _HostRecord):
            assert self.disk is not None
            return self.disk.get(record)
        self.used -= record.nbytes
        if record.back is not None:
            current = torch.cuda.current_stream(record.device)
            current.wait_event(record.back_event)
            record.back.record_stream(current)
            return record.back
        if record.event is not None:
            record.event.synchronize()
        return record.host.to(record.device)

    def discard(self, record: Any) -> None:
        if isinstance(record, _HostRecord):
            self.used -= record.nbytes
        elif self.disk is not None:
            self.disk.discard(record)

    def end_step(self) -> None:
        if self.disk is not None:
            self.disk.end_step()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    @property
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self._counts, host_bytes=self.used)
        if self.disk is not None:
            out["disk"] = self.disk.stats
        return out


class _SimRecord:
    __slots__ = ("layout", "proto", "tensor")

    def __init__(self, t: torch.Tensor) -> None:
        self.proto = t.new_empty((0,))  # same kind of tensor (fake), no bytes
        self.layout = (tuple(t.shape), t.stride())
        self.tensor: torch.Tensor | None = None

    def load(self) -> torch.Tensor:
        if self.tensor is None:
            shape, stride = self.layout
            self.tensor = self.proto.new_empty_strided(shape, stride)
        return self.tensor


class SimulatedStateTier:
    """What a state tier does to device memory, for the OOM predictor's
    fake tensors: the tensors leave, and come back as new ones of the same
    layout when prefetched or read; no bytes are moved."""

    def __init__(self) -> None:
        self.bytes_put = 0

    def put(self, t: torch.Tensor) -> _SimRecord:
        self.bytes_put += t.numel() * t.element_size()
        return _SimRecord(t)

    def prefetch(self, record: Any) -> None:
        record.load()

    def get(self, record: Any) -> torch.Tensor:
        t = record.load()
        record.tensor = None
        return t

    def discard(self, record: Any) -> None:
        record.tensor = None

    def end_step(self) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def stats(self) -> dict[str, Any]:
        return {"bytes_put": self.bytes_put}


# --------------------------------------------------------------------------
# The step in backward.


def _reason_unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    if isinstance(optimizer, torch.optim.LBFGS):
        return "LBFGS re-evaluates the loss inside its step (a closure), which backward cannot do"
    pre, _ = _torch_compat.optimizer_step_hooks(optimizer)
    if pre:
        return (
            "the optimizer has step pre-hooks (register_step_pre_hook): they "
            "would run once per parameter, or not at all; remove them"
        )
    seen: set[int] = set()
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            return f"param group {i} sets differentiable=True"
        for p in group["params"]:
            if id(p) in seen:
                return "a parameter appears twice in the optimizer's groups"
            seen.add(id(p))
            if p.requires_grad and not p.is_leaf:
                return "a parameter is not a leaf tensor"
    return None


# The copy methods memscale puts on the optimizer (see StepInBackward).
_COPIERS = ("__deepcopy__", "__reduce_ex__")


def _copier(ref: weakref.ref[StepInBackward], name: str) -> Callable[..., Any]:
    """The optimizer's ``name`` (one of ``_COPIERS``) while the step runs
    in backward; through a weak reference, as the patched step."""

    def method(opt: torch.optim.Optimizer, arg: Any) -> Any:
        me = ref()
        if me is None:  # only reachable through a stale copy of the method
            opt.__dict__.pop(name, None)
            return copy.deepcopy(opt, arg) if name == "__deepcopy__" else opt.__reduce_ex__(arg)
        return me._deepcopy(opt, arg) if name == "__deepcopy__" else me._reduce(opt, arg)

    return method


def _is_ours(step: Any) -> bool:
    """Whether ``step`` is the step StepInBackward puts on an optimizer, or
    a wrapper made around it since (``functools.wraps``: an lr scheduler's)."""
    for _ in range(8):
        if step is None:
            return False
        if getattr(getattr(step, "__func__", step), "_memscale_step_in_backward", False):
            return True
        step = getattr(step, "__wrapped__", None)
    return False


class StepInBackward:
    """Run ``optimizer``'s update of each parameter inside backward, as
    soon as its gradient is complete; keep its state on ``tier`` between
    updates (None: with the parameter).  ``remove()`` undoes everything:
    hooks, the patched ``step``, the state hooks; the state comes back to
    ``optimizer.state``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        tier: Any | None = None,
        prefetch_depth: int = 0,
    ) -> None:
        why = _reason_unsupported(optimizer)
        if why is not None:
            raise ValueError(
                f"memscale: Config.optimizer_in_backward cannot run "
                f"{type(optimizer).__name__} inside backward: {why}"
            )
        self.optimizer = optimizer
        self.tier = tier
        self.prefetch_depth = max(0, int(prefetch_depth))
        self._raw_step = _torch_compat.raw_optimizer_step(optimizer)
        self._params: list[torch.Tensor] = []
        self._group_index: list[int] = []
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    self._params.append(p)
                    self._group_index.append(gi)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        # The path torch's ordinary step takes for a group with foreach=None
        # (decided over all its parameters): a step of one takes it too.
        self._foreach = _torch_compat.default_foreach(self._params) if self._params else False
        # Tiered state: parameter index -> {state key: tier record}.
        self._out: dict[int, dict[str, Any]] = {}
        # Backward order of the last completed step, and of this one.
        self._last_order: list[int] = []
        self._order: list[int] = []
        self._updated: set[int] = set()
        self._task: int | None = None
        self._open = False
        self.steps_completed = 0
        self.updates = 0
        self._handles: list[Any] = []
        self._removed = False
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            me = ref()
            if me is not None:
                me._on_grad(p)

        try:
            for p in self._params:
                self._handles.append(p.register_post_accumulate_grad_hook(hook))
            self._handles.append(optimizer.register_state_dict_pre_hook(self._state_dict_pre))
            self._handles.append(optimizer.register_state_dict_post_hook(self._state_dict_post))
            self._handles.append(
                optimizer.register_load_state_dict_post_hook(self._load_state_dict_post)
            )
            self._had_step = "step" in optimizer.__dict__
            self._prev_step = optimizer.__dict__.get("step")
            optimizer.__dict__["step"] = self._make_step()
            for name in _COPIERS:
                if name in optimizer.__dict__:
                    raise ValueError(
                        f"memscale: Config.optimizer_in_backward cannot run an "
                        f"optimizer with its own {name} (memscale copies it "
                        "as an ordinary optimizer)"
                    )
                optimizer.__dict__[name] = types.MethodType(_copier(ref, name), optimizer)
            if self.tier is not None:
                for i in range(len(self._params)):
                    self._send(i)
        except BaseException:
            self.remove()
            raise

    # -- the user's optimizer.step() -------------------------------------

    def _make_step(self) -> Any:
        ref = weakref.ref(self)

        def step(opt: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
            """memscale (optimizer_in_backward): the update ran inside
            backward; this runs ``closure`` (which runs backward) if given,
            then the step post-hooks, and returns the closure's loss."""
            me = ref()
            if me is None or me._removed:
                # Detached, and still called through a wrapper made around
                # this step (an lr scheduler built after wrap): the
                # ordinary step.
                return type(opt).step(opt, closure)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            me._refuse_unhooked()
            opt._opt_called = True  # type: ignore[attr-defined]  # as lr schedulers expect
            _, post = _torch_compat.optimizer_step_hooks(opt)
            for h in post:
                h(opt, (), {} if closure is None else {"closure": closure})
            return loss

        step._memscale_step_in_backward = True  # type: ignore[attr-defined]
        # A bound method, as torch's lr schedulers expect optimizer.step to be.
        return types.MethodType(step, self.optimizer)

    # -- copies of the optimizer (copy.deepcopy, pickle, torch.save) ------

    @contextlib.contextmanager
    def _as_ordinary(self) -> Iterator[None]:
        """The optimizer as if memscale were not attached, for the time a
        copy is taken: the patched step and the copy methods set aside, the
        state on the tier brought back; all put back after."""
        opt = self.optimizer
        saved = {k: opt.__dict__.pop(k) for k in ("step", *_COPIERS) if k in opt.__dict__}
        try:
            self._state_dict_pre(opt)
            yield
        finally:
            opt.__dict__.update(saved)
            self._state_dict_post(opt, {})

    def _deepcopy(self, opt: torch.optim.Optimizer, memo: dict[int, Any]) -> Any:
        """``copy.deepcopy(optimizer)``: an ordinary optimizer with the whole
        state, updating in ``step()`` as usual (nothing of memscale's)."""
        with self._as_ordinary():
            return copy.deepcopy(opt, memo)

    def _reduce(self, opt: torch.optim.Optimizer, protocol: int) -> Any:
        """Pickling (``torch.save(optimizer)``): as the ordinary optimizer,
        with the whole state (a snapshot: the tier takes it back at once)."""
        with self._as_ordinary():
            rv = type(opt).__reduce_ex__(opt, protocol)
            if isinstance(rv, tuple) and len(rv) > 2 and isinstance(rv[2], dict):
                snapshot = dict(rv[2])
                if isinstance(snapshot.get("state"), dict):
                    snapshot["state"] = {k: dict(v) for k, v in snapshot["state"].items()}
                rv = (*rv[:2], snapshot, *rv[3:])
            return rv

    def _refuse_unhooked(self) -> None:
        """A parameter of the optimizer with a gradient that backward did
        not update: made trainable, or added with ``add_param_group``, after
        ``wrap``.  Updating nothing would leave it untrained without a
        word: say so (its gradient is left as it is)."""
        missed = [
            (gi, pi, tuple(p.shape))
            for gi, group in enumerate(self.optimizer.param_groups)
            for pi, p in enumerate(group["params"])
            if p.grad is not None and id(p) not in self._index
        ]
        if missed:
            where = ", ".join(
                f"group {gi} parameter {pi} {list(shape)}" for gi, pi, shape in missed[:5]
            )
            more = f" and {len(missed) - 5} more" if len(missed) > 5 else ""
            raise RuntimeError(
                "memscale: Config.optimizer_in_backward updates the parameters "
                "that were trainable and in the optimizer when wrap() ran; "
                f"{len(missed)} other parameter(s) have a gradient that nothing "
                f"will apply ({where}{more}): made trainable or added with "
                "add_param_group() after wrap. Call memscale.detach(model) and "
                "wrap it again after changing which parameters train (their "
                "gradients are kept)."
            )

    # -- inside backward -------------------------------------------------

    def _begin(self, task: int) -> None:
        pre, _ = _torch_compat.optimizer_step_hooks(self.optimizer)
        if pre:
            # Checked before anything of this backward is updated.
            raise RuntimeError(
                "memscale (optimizer_in_backward): the optimizer has step "
                "pre-hooks (register_step_pre_hook, or the global "
                "register_optimizer_step_pre_hook), added after wrap; they "
                "would have to run before each parameter's update inside "
                "backward, which memscale cannot do. Nothing of this backward "
                "was updated (the gradients are kept). Remove the hooks, or "
                "detach and train without optimizer_in_backward"
            )
        if self._open and self._updated:
            logger.warning(
                "memscale: the last backward stopped after updating %d of %d "
                "parameters (optimizer_in_backward): they hold that step's "
                "values and state, the others the step before",
                len(self._updated),
                len(self._params),
            )
            self._updated.clear()
            self._order.clear()
        self._task = task
        self._open = True
        ref = weakref.ref(self)

        def end() -> None:
            me = ref()
            if me is not None:
                me._end()

        _torch_compat.at_backward_end(end)

    def _abort(self) -> None:
        """An update raised: this backward ends here (the error says what
        was updated), and the next one begins afresh."""
        self._open = False
        self._task = None
        self._order.clear()
        self._updated.clear()
        if self.tier is not None:
            self.tier.end_step()

    def _end(self) -> None:
        self._open = False
        self._task = None
        if self._order:
            self._last_order = list(self._order)
            self.steps_completed += 1
        self._order.clear()
        self._updated.clear()
        if self.tier is not None:
            self.tier.end_step()

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._removed:
            return
        i = self._index.get(id(p))
        if i is None or p.grad is None:
            return
        task = _torch_compat.graph_task_id()
        if not self._open or (task != self._task and i in self._updated):
            self._begin(task)
        try:
            self._step_one(i, p)
        except Exception as exc:  # an interruption (KeyboardInterrupt) goes as is
            updated = len(self._updated)
            self._abort()
            raise RuntimeError(
                f"memscale (optimizer_in_backward): updating parameter {i} of "
                f"{len(self._params)} ({tuple(p.shape)}) failed: "
                f"{type(exc).__name__}: {exc}. This step updated "
                f"{updated} parameters before it (they keep the new "
                "values and state); this one and the rest keep the last "
                "step's (its state is "
                f"{'in optimizer.state' if i not in self._out else 'on the tier'})"
            ) from exc
        except BaseException:
            self._abort()
            raise
        self._updated.add(i)
        self._order.append(i)
        self.updates += 1

    def _step_one(self, i: int, p: torch.Tensor) -> None:
        """Parameter i's state back from the tier, its update, its gradient
        freed, its state sent to the tier again."""
        self._bring_back(i)
        self._prefetch_next(len(self._order) + 1)
        self._update(i, p)
        p.grad = None
        if self.tier is not None:
            self._send(i)

    def _update(self, i: int, p: torch.Tensor) -> None:
        opt = self.optimizer
        group = opt.param_groups[self._group_index[i]]
        view = {k: v for k, v in group.items() if k != "params"}
        view["params"] = [p]
        if "foreach" in view and view["foreach"] is None and not view.get("fused"):
            view["foreach"] = _torch_compat.default_foreach_of_group(
                opt, view, default=self._foreach
            )
        groups = opt.param_groups
        opt.param_groups = [view]
        try:
            self._raw_step(opt)
        finally:
            opt.param_groups = groups

    # -- the tier --------------------------------------------------------

    def _send(self, i: int) -> None:
        """Send parameter i's state tensors to the tier (a fresh dict in
        optimizer.state: a state_dict() taken before keeps its own)."""
        assert self.tier is not None
        p = self._params[i]
        state = self.optimizer.state.get(p)
        if not state:
            return
        out = self._out.setdefault(i, {})
        kept = {}
        for key, value in state.items():
            rec = None
            if isinstance(value, torch.Tensor) and value.dim() > 0 and key not in out:
                rec = self.tier.put(value)
            if rec is None:
                kept[key] = value
            else:
                out[key] = rec
        self.optimizer.state[p] = kept

    def _bring_back(self, i: int) -> None:
        out = self._out.pop(i, None)
        if not out:
            return
        assert self.tier is not None
        p = self._params[i]
        state = dict(self.optimizer.state.get(p, {}))
        try:
            while out:
                key, rec = next(iter(out.items()))
                state[key] = self.tier.get(rec)
                del out[key]
        finally:
            if out:  # a read failed: what is still out stays out
                self._out[i] = out
            self.optimizer.state[p] = state

    def _prefetch_next(self, position: int) -> None:
        if self.tier is None or not self.prefetch_depth:
            return
        order = self._last_order
        for j in order[position : position + self.prefetch_depth]:
            for rec in self._out.get(j, {}).values():
                self.tier.prefetch(rec)

    def _state_dict_pre(self, optimizer: torch.optim.Optimizer) -> None:
        for i in list(self._out):
            self._bring_back(i)

    def _state_dict_post(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> None:
        if self.tier is not None and not self._removed:
            for i in range(len(self._params)):
                self._send(i)

    def _load_state_dict_post(self, optimizer: torch.optim.Optimizer) -> None:
        # The old state is replaced: its records go, and what they held on
        # the tier is given back.
        out, self._out = self._out, {}
        if self.tier is not None:
            for records in out.values():
                for rec in records.values():
                    self.tier.discard(rec)
        if self.tier is not None and not self._removed:
            for i in range(len(self._params)):
                self._send(i)

    # -- detach ----------------------------------------------------------

    def remove(self) -> None:
        """Remove the hooks and the patched step; bring the state back."""
        if self._removed:
            return
        self._removed = True
        try:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            opt = self.optimizer
            for name in _COPIERS:
                opt.__dict__.pop(name, None)
            if _is_ours(opt.__dict__.get("step")):
                if self._had_step:
                    opt.__dict__["step"] = self._prev_step
                else:
                    del opt.__dict__["step"]
            for i in list(self._out):
                self._bring_back(i)
        finally:
            if self.tier is not None:
                self.tier.close()

    @property
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "steps_completed": self.steps_completed,
            "updates": self.updates,
            "parameters": len(self._params),
        }
        if self.tier is not None:
            out["tier"] = self.tier.stats
        return out


# --------------------------------------------------------------------------
# wrap()'s part.


def check(config: Config, optimizer: torch.optim.Optimizer | None) -> None:
    """Raise ``ValueError`` at ``wrap`` when the Config asks for the step
    in backward and it cannot be had."""
    if not config.optimizer_in_backward:
        return
    if optimizer is None:
        raise ValueError(
            "memscale: Config.optimizer_in_backward=True needs the optimizer: "
            "pass it, as memscale.wrap(model, config, optimizer=opt), "
            "memscale.optimize(model, opt, config) or "
            "memscale.apply_all_optimizations(model, opt, config=config)"
        )
    if config.verify_correctness:
        raise ValueError(
            "memscale: Config.optimizer_in_backward cannot be combined with "
            "verify_correctness=True: replaying the step would update the "
            "parameters a second time; set one of them to False"
        )
    if _distributed.active():
        raise ValueError(
            "memscale: Config.optimizer_in_backward is not supported with "
            "torch.distributed (world size > 1): each gradient would be "
            "used before it is reduced across ranks; set it to False"
        )
    why = _reason_unsupported(optimizer)
    if why is not None:
        raise ValueError(
            f"memscale: Config.optimizer_in_backward cannot run "
            f"{type(optimizer).__name__} inside backward: {why}"
        )


def make_tier(config: Config, device: torch.device) -> Any | None:
    """The state tier ``config`` asks for on ``device``, or None."""
    tier = config.offload_optimizer_state
    if tier is None:
        return None
    settings = _offload.async_settings(config)
    cap = _offload.disk_cap_bytes(config)
    if tier == "host":
        if device.type != "cuda":
            raise ValueError(
                "memscale: Config.offload_optimizer_state='host' moves the "
                f"state from a CUDA device to host memory, and this model is on "
                f"{device.type!r}, whose state is already in host memory; use "
                "offload_optimizer_state='disk'"
            )
        disk = None
        if cap is None or cap > 0:
            disk = DiskStateTier(settings.spill_dir, cap, async_io=True, debug=settings.debug)
        return HostStateTier(_offload.host_cap_bytes(config), disk)
    if cap == 0:
        raise ValueError(
            "memscale: Config.offload_optimizer_state='disk' needs the disk "
            "tier, and AsyncOffloadConfig.max_disk_gb=0 turns it off; raise "
            "max_disk_gb or leave it None"
        )
    return DiskStateTier(settings.spill_dir, cap, async_io=True, debug=settings.debug)


def install(executor: Any, config: Config, optimizer: torch.optim.Optimizer) -> StepInBackward:
    """Attach the step in backward for ``optimizer`` (and its state tier)
    to ``executor``; ``detach`` removes it."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    device = params[0].device if params else torch.device("cpu")
    tier = make_tier(config, device)
    try:
        sib = StepInBackward(
            optimizer, tier, prefetch_depth=_offload.async_settings(config).prefetch_depth
        )
    except BaseException:
        if tier is not None:
            tier.close()
        raise
    executor.step_in_backward = sib
    executor.on_detach(sib.remove)
    if config.enable_logging:
        logger.info(
            "memscale: the optimizer step runs inside backward (%d parameters)%s",
            len(sib._params),
            ""
            if tier is None
            else f"; optimizer state on the {config.offload_optimizer_state} tier"
            + (
                f" ({tier.path})"
                if isinstance(tier, DiskStateTier)
                else f" (cap {config.max_cpu_offload_gb} GiB)"
                if config.max_cpu_offload_gb is not None
                else ""
            ),
        )
    return sib


def state_bytes_in_flight(per_param_state: list[int], prefetch_depth: int) -> int:
    """Device bytes of optimizer state a tiered step holds at once: the
    largest parameter's state and the ``prefetch_depth`` next ones (at
    most, the largest ones)."""
    ranked = sorted(per_param_state, reverse=True)
    return sum(ranked[: 1 + max(0, prefetch_depth)])
