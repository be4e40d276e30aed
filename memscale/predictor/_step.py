"""One simulated training step: the loss, the optimizer rebuilt on fake
parameters, the untracked warm-up and the tracked step (zero_grad,
forward, loss, backward, optimizer step) with its events."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .. import _model, _selective, _torch_compat
from .._tree import tensors_in
from . import _update
from ._fake import FakeWorld
from ._results import PeakBreakdown
from ._tracker import FakeCaller, FlopTally, Recording, StorageTracker
from ._workspace import CUDA_GRANULE, Kernel

logger = logging.getLogger(__name__)


def default_loss(output: Any) -> torch.Tensor:
    """The loss of a model output when no ``loss_fn`` is given.

    ``output.loss`` or ``output["loss"]`` when the model computes its own
    loss (Hugging Face models given labels); a scalar output as is; else a
    stand-in: the mean of squares of every floating-point output tensor
    that requires grad (its backward, like a real loss's, makes one
    gradient the size of each output).  Pass ``loss_fn`` for the real one.
    """
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    if isinstance(output, torch.Tensor) and output.dim() == 0 and output.requires_grad:
        return output
    parts = [t for t in tensors_in(output) if t.requires_grad and t.is_floating_point()]
    if not parts:
        raise ValueError(
            "the model's output holds no tensor that requires grad, so there "
            "is no training step to predict; pass loss_fn=... (a callable from "
            "the output to a scalar loss)"
        )
    total = parts[0].pow(2).mean()
    for t in parts[1:]:
        total = total + t.pow(2).mean()
    return total


def _foreach_default(device_type: str) -> bool:
    # torch.optim picks the foreach implementation by default only for
    # tensors on these device types (torch/optim/optimizer.py); fake
    # tensors are not of a foreach-supported type, so the choice is made here.
    return device_type in ("cuda", "xpu")


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer,
    param: Callable[[torch.Tensor], torch.Tensor] = lambda p: p,
    foreach: bool | None = None,
) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class with the same parameter
    groups and settings and no state; ``param`` maps each parameter to the
    one to use.  With ``foreach`` given, a group whose ``foreach`` is unset
    (None, torch's "decide for me") gets it.  Settings travel in the groups;
    the constructor gets the defaults it names (AdamW's records
    ``decoupled_weight_decay``, which its constructor does not take)."""
    cls = type(optimizer)
    groups = []
    for group in optimizer.param_groups:
        new = {k: v for k, v in group.items() if k != "params"}
        new["params"] = [param(p) for p in group["params"]]
        if (
            foreach is not None
            and "foreach" in new
            and new["foreach"] is None
            and not new.get("fused")
            and not new.get("differentiable")
        ):
            new["foreach"] = foreach
        groups.append(new)
    sig = inspect.signature(cls.__init__)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    kwargs = {k: v for k, v in optimizer.defaults.items() if takes_any or k in sig.parameters}
    return cls(groups, **kwargs)


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` cannot be called without a closure (its
    ``closure`` parameter has no default: ``torch.optim.LBFGS``)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def fake_optimizer(
    optimizer: torch.optim.Optimizer | None, world: FakeWorld, target_type: str
) -> tuple[torch.optim.Optimizer | None, str]:
    """An optimizer of the same class and settings over the fake parameters
    (AdamW with its defaults when none is given); None when the class cannot
    be rebuilt.  An unset ``foreach`` is decided as torch decides it for the
    target device type (the foreach kernels keep whole-model temporaries)."""
    foreach = _foreach_default(target_type)
    if optimizer is None:
        params = [p for p in world.params if p.requires_grad]
        return torch.optim.AdamW(params, foreach=foreach), "AdamW"
    cls = type(optimizer)
    if _needs_closure(optimizer):
        logger.info(
            "memscale: %s's step needs a closure (it evaluates the loss "
            "itself), which a simulated step cannot give; its state is "
            "estimated from its class",
            cls.__name__,
        )
        return None, cls.__name__
    try:
        return rebuild_optimizer(optimizer, world.fake, foreach), cls.__name__
    except Exception as exc:  # noqa: BLE001 - reported, estimated instead
        logger.info(
            "memscale: cannot rebuild %s on fake tensors (%s: %s); its "
            "state is estimated from its class",
            cls.__name__,
            type(exc).__name__,
            exc,
        )
        return None, cls.__name__


def estimated_state(
    world: FakeWorld, optimizer: torch.optim.Optimizer | None, model: nn.Module
) -> list[torch.Tensor]:
    """Fake state tensors for an optimizer that cannot run on fake tensors:
    as many parameter-sized tensors as ``_model.optimizer_state_bytes``
    counts."""
    trainable = [p for p in world.params if p.requires_grad]
    per = sum(p.untyped_storage().nbytes() for p in trainable)
    want = _model.optimizer_state_bytes(model, optimizer)
    copies = round(want / per) if per else 0
    return [torch.empty_like(p) for _ in range(copies) for p in trainable]


def _module_state(model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """Each module's plain attributes and tables as they are now (for
    :func:`_same_module_state`)."""
    return [(m, _fingerprint(vars(m), _DEPTH)) for m in model.modules()]


# How deep into the containers and objects a module holds their contents
# are compared (an attribute holding a dict of flags: two; the module's
# own ``vars`` are the first level, so its ``_parameters``, ``_buffers``
# and ``_modules`` tables are read to their tensors and modules).
_DEPTH = 3

# Values compared by type and value, at any depth: these types exactly
# (the quick test), and their subclasses (numpy's float64, an IntEnum).
_ATOMS = frozenset({int, float, complex, str, bytes, bool, type(None)})
_ATOM_BASES = (int, float, complex, str, bytes)


def _fingerprint(value: Any, depth: int) -> Any:
    """What ``value`` holds, as far as ``depth`` levels of dicts, lists,
    tuples, sets and objects with a ``__dict__`` (a number, string or None
    by its value; each other value, a module or a tensor by its identity:
    it is compared, not read)."""
    kind = type(value)
    if kind in _ATOMS or isinstance(value, _ATOM_BASES):
        return (kind, value)
    if depth == 0 or isinstance(value, (torch.Tensor, nn.Module)):
        return id(value)
    depth -= 1
    # (The atoms are inlined below: a module's tables are most of what is
    # read, and most of what they hold is atoms or empty.)
    if isinstance(value, dict):
        return (
            id(value),
            tuple(
                [
                    (k, (type(v), v) if type(v) in _ATOMS else _fingerprint(v, depth))
                    for k, v in value.items()
                ]
            )
            if value
            else (),
        )
    if isinstance(value, (list, tuple)):
        return (
            id(value),
            tuple([(type(v), v) if type(v) in _ATOMS else _fingerprint(v, depth) for v in value]),
        )
    if isinstance(value, (set, frozenset)):
        return (id(value), frozenset([id(v) for v in value]))
    try:
        attrs = getattr(value, "__dict__", None)
    except Exception:  # noqa: BLE001 - an object that will not say: by identity
        attrs = None
    if isinstance(attrs, dict):
        return (id(value), _fingerprint(attrs, depth))
    return id(value)


def _same_module_state(before: list[tuple[nn.Module, Any]]) -> bool:
    """Whether every module of ``before`` holds what it held then, in its
    plain attributes and tables (none added, removed or rebound, and no
    dict, list, set or object they hold changed in place, as deep as
    ``_DEPTH``)."""
    return all(_fingerprint(vars(m), _DEPTH) == held for m, held in before)


def _leaves_reached(loss: torch.Tensor) -> set[int]:
    """ids of the leaf tensors backward from ``loss`` would accumulate a
    gradient into (the AccumulateGrad nodes of its graph)."""
    return {
        id(node.variable)
        for node in _torch_compat.autograd_nodes(loss)
        if isinstance(getattr(node, "variable", None), torch.Tensor)
    }


@dataclasses.dataclass
class Trace:
    """One tracked step: its events, and the categories learnt at its end."""

    tracker: Any
    recategorize: dict[int, str]

    def signatures(self) -> dict[Any, int]:
        """Recorded kernel calls, each with the bytes it returned."""
        sizes = self.tracker.sizes_at_birth
        return {
            sig: sum(sizes[s] for s in serials if s is not None)
            for _, sig, serials in self.tracker.kernel_calls or ()
        }

    def breakdown(self, workspace: Mapping[Any, Kernel]) -> PeakBreakdown:
        return self.tracker.breakdown(self.recategorize, workspace)


# Optimizers whose first step runs the ops of every later one, and makes
# its state besides (torch's Adam and AdamW, in each implementation: the
# state is made in _init_group, and the update is the same code at every
# step): the warm-up's step, tracked, less the state it made, is the
# steady-state step's events (Step._first_update_recorded), so no tracked
# step runs the optimizer again.  Other optimizers are run once more, in
# the first tracked step, and recorded there.
_FIRST_UPDATE_IS_STEADY = (torch.optim.Adam, torch.optim.AdamW)

# The phases a tracked step marks, in order (Step.run).
_PHASES = ("start", "forward", "backward", "optimizer", "end")


class Step:
    """One simulated training step at a time over a FakeWorld."""

    def __init__(
        self,
        world: FakeWorld,
        inputs: tuple[Any, Any],
        loss_fn: Callable[[Any], Any] | None,
        optimizer: torch.optim.Optimizer | None,
        fallback_state: list[torch.Tensor],
        *,
        target_type: str,
        state_made_in_step: bool = False,
    ) -> None:
        self.world = world
        # The first step of a fresh optimizer: its state is made at the
        # start of its step (torch's optimizers build it there), not
        # alive before; the warmed-up state objects stand in for it.
        self.state_made_in_step = state_made_in_step
        # The inputs, their small values real (memscale._smallvalues).
        self.args, self.kwargs = inputs
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.fallback_state = fallback_state
        # The steady-state optimizer step, as the first tracked step ran it
        # (StorageTracker.recorded), or the warm-up's first update less the
        # state it made (_first_update_recorded, Adam and AdamW): its memory
        # does not depend on the plan (the same gradients and state, every
        # temporary freed inside it), so tracked steps replay its events
        # instead of running it again.  None: not recorded yet, or it
        # cannot be replayed.
        self.optimizer_replay: Recording | None = None
        # False when optimizer.step() does more than its events show (the
        # step in backward keeps its own bookkeeping across steps).
        self.replays_optimizer = True
        self.optimizer_steps = 0  # optimizer steps run (warm-up included)
        # The device type predicted for ("cuda": storages take the caching
        # allocator's blocks, _workspace.CUDA_GRANULE).
        self.target_type = target_type

    def _loss(self, output: Any) -> torch.Tensor:
        loss = self.loss_fn(output) if self.loss_fn is not None else default_loss(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
        return loss

    def _zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            for p in self.world.params:
                p.grad = None

    def run(
        self,
        tracker: Any,
        on_forward: Callable[[Any], Any] | None = None,
        update: bool = True,
    ) -> None:
        """zero_grad, forward, loss, backward, optimizer step, each phase
        marked in ``tracker``'s events.  The forward runs inside
        ``on_forward(tracker)`` when given (the profiler's pass); without
        ``update`` the optimizer phase is left empty."""
        self._zero_grad()
        tracker.set_phase("forward")
        with torch.enable_grad():
            with on_forward(tracker) if on_forward is not None else contextlib.nullcontext():
                output = self.world.model(*self.args, **self.kwargs)
            loss = self._loss(output)
            del output
            tracker.set_phase("backward")
            loss.backward()
        tracker.set_phase("optimizer")
        if update and self.optimizer is not None:
            if self.optimizer_replay is not None:
                tracker.replay(self.optimizer_replay)
            else:
                since = tracker.mark()
                self.optimizer.step()
                self.optimizer_steps += 1
                if self.replays_optimizer and not self.state_made_in_step:
                    self.optimizer_replay = tracker.recorded(since)
        del loss
        tracker.set_phase("end")

    def warm_up(self, on_forward: Callable[[FakeCaller], Any]) -> Any:
        """The first step, untracked: a steady-state step starts with
        gradients and optimizer state, so this one makes them.  The forward
        runs inside ``on_forward(caller)`` (the profiler's pass, whose value
        is returned), as wrap()'s static profiling runs it; ``caller`` is
        the mode every call of the step goes through, its ``flops`` the
        tally of the FLOPs of its calls (the pass's FLOP counter), its
        ``recorder`` where the pass may put an op recorder.
        Backward is not run: the parameters it would give a gradient are
        the ones the loss's graph reaches, and a zero gradient of each is
        enough for the optimizer to build its state.  Its operators are
        called as the tracked steps call them (:class:`FakeCaller`, below
        the profiler's modes)."""
        self.world.refill_inputs()
        caller = FakeCaller(self.world.calls, self.world.small, FlopTally())
        with caller:
            self._zero_grad()
            with torch.enable_grad():
                with on_forward(caller) as result:
                    output = self.world.model(*self.args, **self.kwargs)
                loss = self._loss(output)
                del output
                reached = _leaves_reached(loss)
                del loss
            # The optimizer's state is fake but its step counters, real
            # (small values narrowed to one element, memscale._smallvalues:
            # a counter's ``+= 1`` and ``item()`` run on it for real, as
            # fake ones would go through the fake mode's constant
            # propagation, thousands of times on a deep model).
            for p in self.world.params:
                if p.requires_grad and id(p) in reached:
                    p.grad = torch.zeros_like(p)
            recorded = self.first_update_is_steady()
            if self.optimizer is not None and not recorded:
                with self.world.small.narrowed():
                    self.optimizer.step()
        if recorded:
            self._first_update_recorded()
        if self.optimizer is not None:
            self.optimizer_steps += 1
        return result

    def first_update_is_steady(self) -> bool:
        """Whether the optimizer's first update, tracked, less the state it
        makes, is the steady-state update (``_FIRST_UPDATE_IS_STEADY``)."""
        return (
            self.optimizer is not None
            and self.replays_optimizer
            and not self.state_made_in_step
            and type(self.optimizer) in _FIRST_UPDATE_IS_STEADY
        )

    def first_tracked(
        self, on_forward: Callable[[Any], Any], marked: list[nn.Module]
    ) -> Trace | None:
        """The warm-up and the unoptimized step in one (for an optimizer
        whose first update is a steady one, :meth:`first_update_is_steady`):
        the first step tracked, its forward inside ``on_forward(tracker)``
        (the profiler's pass, as :meth:`warm_up` runs it) and its backward
        making the gradients; then the first update, recorded
        (:meth:`_first_update_recorded`: the state made).  What it returns
        is the steady-state step made from the first one
        (:meth:`_steady_from_first`), or None where the first step is not
        a steady one but for the gradients and the state it starts with
        (then the caller simulates one)."""
        before = _module_state(self.world.model)
        first = self.tracked([], marked, on_forward=on_forward, update=False)
        # A forward that changed a module's Python state (a flag set at the
        # first call, a counter, a buffer or module made or rebound) may
        # run otherwise at the next call: the next one is simulated.
        steady = _same_module_state(before)
        self._first_update_recorded()
        self.optimizer_steps += 1
        return self._steady_from_first(first) if steady else None

    def _steady_from_first(self, first: Trace) -> Trace | None:
        """The steady-state step's trace, made from the first step's
        (``first``, tracked without its update): a steady step starts with
        the gradients of the step before (as the first one's backward made
        them) and the optimizer's state, after the parameters and buffers
        and before the inputs (:meth:`existing`); its zero_grad frees the
        gradients, in the optimizer's order, before its forward; and its
        update is the recorded one, where the first step's optimizer phase
        starts.  Sizes as a tracker counts them on the predicted device.

        None where the first step is not a steady one but for those: a
        call ran as its decomposition; it made something it still holds
        at its end that is not a gradient (a cache a layer builds once); a
        parameter it gave a gradient is not the optimizer's (its gradient
        would grow, not be freed and made again); a gradient shares a
        storage; its start is not what a steady step's starts with; or the
        update was not recorded.  (:meth:`first_tracked` also gives None
        where the forward changed a module's Python state.)"""
        tr = first.tracker
        if tr.decomposed or [p for _, p in tr.phase_marks] != list(_PHASES):
            return None
        forward_at = tr.phase_marks[1][0]
        update_at = tr.phase_marks[3][0]
        steady = self._tracker(self.world.small)
        try:
            for t in self.world.params + self.world.buffers:
                steady.track(t, "parameters")
            params_end = len(steady.events)
            grads = [p.grad for p in self.world.params if p.grad is not None]
            for grad in grads:
                steady.track(grad, "gradients")
            grads_end = len(steady.events)
            for t in self.optimizer_state():
                steady.track(t, "optimizer_state")
            state_end = len(steady.events)
            for t in tensors_in((self.args, self.kwargs)):
                steady.track(t, "inputs")
            start = steady.events[:params_end] + steady.events[state_end:]
            if [d for _, d in tr.events[:forward_at]] != [d for _, d in start]:
                return None
            assert self.optimizer is not None
            order = [p for group in self.optimizer.param_groups for p in group["params"]]
            if {id(p) for p in self.world.params if p.grad is not None} - {id(p) for p in order}:
                return None
            made = {serial for serial, _ in steady.events[params_end:grads_end]}
            frees: list[int] = []
            for p in order:
                if p.grad is not None:
                    serial = steady.serial_of(p.grad)
                    if serial not in made or serial in frees:
                        return None
                    frees.append(serial)
        finally:
            steady.close()
        started = {serial for serial, _ in tr.events[:forward_at]}
        for serial, size in enumerate(tr.sizes):
            if size and serial not in started and first.recategorize.get(serial) != "gradients":
                return None
        # The steady start's gradients and state, as serials of the first
        # step's tracker.
        adopted: dict[int, int] = {}
        for serial, _ in steady.events[params_end:state_end]:
            adopted[serial] = len(tr.sizes)
            tr.sizes.append(steady.sizes[serial])
            tr.sizes_at_birth.append(steady.sizes_at_birth[serial])
            tr.categories.append(steady.categories[serial])
        born = [(adopted[serial], delta) for serial, delta in steady.events[params_end:state_end]]
        freed = []
        for serial in frees:
            freed.append((adopted[serial], -steady.sizes[serial]))
            tr.sizes[adopted[serial]] = 0
        update = self.optimizer_replay
        if update is None:
            return None
        base = len(tr.sizes)
        tr.sizes += [0] * len(update.sizes_at_birth)
        tr.sizes_at_birth += update.sizes_at_birth
        tr.categories += update.categories
        replayed = [(base + serial, delta) for serial, delta in update.events]
        inserts = ((params_end, born), (forward_at, freed), (update_at, replayed))

        def moved(at: int, after: bool = True) -> int:
            """Where old event index ``at`` is now (``after``: past what
            was put in at that very index)."""
            return at + sum(len(e) for where, e in inserts if where < at or (where == at and after))

        events = tr.events
        tr.events = (
            events[:params_end]
            + born
            + events[params_end:forward_at]
            + freed
            + events[forward_at:update_at]
            + replayed
            + events[update_at:]
        )
        # The update's phase mark stays before what it put in; every
        # other mark moves past what was put in where it is.
        tr.phase_marks = [
            (0 if name == "start" else moved(at, name != "optimizer"), name)
            for at, name in tr.phase_marks
        ]
        tr.forward_marks = [(moved(at), m) for at, m in tr.forward_marks]
        tr.recompute_marks = [(moved(at), m) for at, m in tr.recompute_marks]
        if tr.kernel_calls is not None:
            # (a call's index is where its outputs were made: a forward call
            # comes after zero_grad's frees, a backward one before the
            # update)
            calls = [(moved(at, at != update_at), sig, got) for at, sig, got in tr.kernel_calls]
            at_update = moved(update_at, False)
            calls += [
                (at_update + i, sig, tuple(None if s is None else base + s for s in got))
                for i, sig, got in update.kernel_calls
            ]
            tr.kernel_calls = sorted(calls, key=lambda call: call[0])
        return first

    def optimizer_state(self) -> list[torch.Tensor]:
        """The optimizer's state tensors (or the estimated stand-ins)."""
        out: list[torch.Tensor] = []
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return out + list(self.fallback_state)

    def existing(self) -> list[tuple[torch.Tensor, str]]:
        """Tensors alive when a step starts, with their category."""
        out: list[tuple[torch.Tensor, str]] = []
        out += [(t, "parameters") for t in self.world.params + self.world.buffers]
        out += [(p.grad, "gradients") for p in self.world.params if p.grad is not None]
        if not self.state_made_in_step:
            out += [(t, "optimizer_state") for t in self.optimizer_state()]
        out += [(t, "inputs") for t in tensors_in((self.args, self.kwargs))]
        return out

    def _tracker(self, small: Any) -> StorageTracker:
        """A StorageTracker for a step of this world (``small``: what of
        its calls runs for real, memscale._smallvalues)."""
        tracker = StorageTracker(small, self.world.calls)
        if self.world.device.type == "cpu":
            tracker.kernel_calls = []
            # The Python numbers autograd keeps are CPU tensors of their own.
            tracker.count_numbers = True
        elif self.world.device.type == "cuda" and torch.cuda.is_available():
            tracker.kernel_calls = []
            tracker.probe_all = True
        if self.target_type == "cuda":
            tracker.granule = (CUDA_GRANULE, self.world.device.type)
        return tracker

    def _first_update_recorded(self) -> None:
        """The warm-up's optimizer step (the first: it makes the state),
        run under a StorageTracker; its events less the state it made are
        a steady-state step's (``_FIRST_UPDATE_IS_STEADY``), kept as
        :attr:`optimizer_replay`.  The step counters are real, as the
        untracked warm-up makes them (small values narrowed to one
        element).  torch's one-parameter-at-a-time Adam loop on a deep
        model is recorded from a few of its iterations
        (:func:`_update.recorded_update`) where it can be."""

        def make_tracker() -> StorageTracker:
            tracker = self._tracker(self.world.small)
            for t in self.world.params + self.world.buffers:
                tracker.track(t, "parameters")
            for p in self.world.params:
                if p.grad is not None:
                    tracker.track(p.grad, "gradients")
            tracker.set_phase("optimizer")
            return tracker

        gc_was_enabled = gc.isenabled()
        gc.disable()  # frees at refcount zero only, as in a tracked step
        try:
            replay = _update.recorded_update(
                self.optimizer, make_tracker, self.world, self.world.state_copy
            )
            if replay is None:
                tracker = make_tracker()
                try:
                    with tracker:
                        since = tracker.mark()
                        with self.world.small.narrowed():
                            self.optimizer.step()  # type: ignore[union-attr]
                        replay = tracker.recorded_less_kept(since)
                finally:
                    tracker.close()
            self.optimizer_replay = replay
        finally:
            if gc_was_enabled:
                gc.enable()

    def tracked(
        self,
        recompute_units: list[nn.Module],
        marked: list[nn.Module] | None = None,
        joining: list[nn.Module] | None = None,
        nested: list[list[nn.Module]] | None = None,
        on_forward: Callable[[Any], Any] | None = None,
        update: bool = True,
    ) -> Trace:
        """Run one step under a StorageTracker; what it recorded.  The
        forwards of the ``marked`` units (outermost calls, in the forward
        phase) are marked in its ``forward_marks``.  The ``joining`` units
        (of ``recompute_units``) join the checkpoint segment of the unit
        before them, whose frame keeps the one RNG state.  Each of the
        ``nested`` lists is the units of a nested checkpoint segment."""
        self.world.refill_inputs()
        tracker = self._tracker(self.world.small)
        handles = []

        # The executor's checkpoint frame keeps the RNG state of its layer's
        # forward (a real ByteTensor made outside any operator, so the
        # tracker cannot see it) until backward is done with the layer,
        # which is when the next layer is recomputed, or backward ends: a
        # tensor of that size stands in for it over the same span
        # (StorageTracker.stand_in).  A
        # segment's frame keeps one for all its units (csrc/segment.c: a
        # joining unit records its state only when the generator moved
        # since the unit before it ended, which no fake operator makes it
        # do); none on a CUDA device (they are host tensors).
        # A recompute also holds a copy of the caller's RNG state from its
        # start to its end (csrc/frame.c recompute_rng, as torch's
        # checkpoint does for a selective layer), a segment's once for all
        # its units: ``caller`` stands in for it, from the recompute's
        # first unit to the leave of the last (``ends``: a unit the next
        # one does not join).
        rng_bytes = _model.checkpoint_frame_bytes(self.world.device.type)
        no_state = {id(m) for m in joining or ()}
        ends = {
            id(unit)
            for unit, after in zip(recompute_units, [*recompute_units[1:], None])
            if after is None or id(after) not in no_state
        }
        # A nested segment's backward (csrc/frame.c, FrameNest) is a first
        # pass over its units but the last, then each unit's own recompute,
        # last first: each is a recompute holding the caller's state; the
        # first pass keeps, after each unit, the next one's RNG state until
        # that unit's own recompute ends; the frame's own state stays until
        # the first unit's own recompute.
        nest_of: dict[int, tuple[list[int], int]] = {}
        for group in nested or ():
            for k, unit in enumerate(group):
                nest_of[id(unit)] = ([id(m) for m in group], k)
        nest_seen: dict[int, int] = {}
        nest_kept: dict[int, torch.Tensor] = {}
        nest_entry: list[tuple[list[int], int, bool]] = []
        held: dict[int, list[torch.Tensor]] = {}
        done: list[torch.Tensor] = []
        caller: list[torch.Tensor] = []
        nesting = [0]

        def enter(module: nn.Module, *_: Any) -> None:
            if tracker.phase == "backward":
                if tracker.recompute_depth == 0:
                    done.clear()
                    tracker.recompute_marks.append((len(tracker.events), module))
                    nest_entry.clear()
                    if id(module) in nest_of:
                        ids, k = nest_of[id(module)]
                        seen = nest_seen.get(ids[0], 0)
                        nest_seen[ids[0]] = seen + 1
                        nest_entry.append((ids, k, seen < len(ids) - 1))
                    if rng_bytes and not caller:
                        caller.append(tracker.stand_in(rng_bytes, self.world.device))
                tracker.recompute_depth += 1
            elif tracker.phase == "forward":
                if (
                    nesting[0] == 0
                    and rng_bytes
                    and id(module) not in no_state
                    and module.training
                    and torch.is_grad_enabled()
                ):
                    held.setdefault(id(module), []).append(
                        tracker.stand_in(rng_bytes, self.world.device)
                    )
                nesting[0] += 1

        def leave(module: nn.Module, *_: Any) -> None:
            if tracker.phase == "backward" and tracker.recompute_depth > 0:
                tracker.recompute_depth -= 1
                if tracker.recompute_depth == 0 and nest_entry:
                    ids, k, first_pass = nest_entry.pop()
                    if first_pass:
                        if rng_bytes:
                            nest_kept[ids[k + 1]] = tracker.stand_in(rng_bytes, self.world.device)
                        if k == len(ids) - 2:
                            caller.clear()
                        return
                    nest_kept.pop(ids[k], None)
                    caller.clear()
                    if k > 0:
                        return
                if held.get(id(module)):
                    done.append(held[id(module)].pop(0))
                if tracker.recompute_depth == 0 and id(module) in ends:
                    caller.clear()
            elif tracker.phase == "forward" and nesting[0] > 0:
                nesting[0] -= 1

        depth = [0]

        def mark_in(module: nn.Module, *_: Any) -> None:
            if tracker.phase == "forward":
                if depth[0] == 0:
                    tracker.forward_marks.append((len(tracker.events), module))
                depth[0] += 1

        def mark_out(module: nn.Module, *_: Any) -> None:
            if tracker.phase == "forward" and depth[0] > 0:
                depth[0] -= 1
                if depth[0] == 0:
                    tracker.forward_marks.append((len(tracker.events), module))

        # A selective unit's recompute runs its forward, not the unit (torch's
        # checkpoint calls it): _selective.run tells instead of its hooks.
        recomputing = {id(unit) for unit in recompute_units}

        def on_selective(module: nn.Module, starts: bool) -> None:
            if id(module) in recomputing:
                (enter if starts else leave)(module)

        gc_was_enabled = gc.isenabled()
        # Frees at refcount zero only, the same every run: a collection in
        # the middle of the step would free cyclic garbage at a moment that
        # depends on what ran before.
        gc.disable()
        try:
            for unit in recompute_units:
                handles.append(unit.register_forward_pre_hook(enter))
                handles.append(unit.register_forward_hook(leave, always_call=True))
            _selective.RECOMPUTE_LISTENERS.append(on_selective)
            for unit in marked or ():
                handles.append(unit.register_forward_pre_hook(mark_in))
                handles.append(unit.register_forward_hook(mark_out, always_call=True))
            for t, category in self.existing():
                tracker.track(t, category)

            def on_phase(phase: str) -> None:
                if phase == "optimizer":  # the graph and its frames are gone
                    nest_kept.clear()
                    held.clear()
                    done.clear()
                    caller.clear()
                    if self.state_made_in_step:
                        for t in self.optimizer_state():
                            tracker.track(t, "optimizer_state")

            tracker.on_phase = on_phase
            if on_forward is not None:
                tracker.flops = FlopTally()
            with tracker:
                self.run(tracker, on_forward, update)
                nest_kept.clear()
                held.clear()
                done.clear()
                caller.clear()
            tracker.active = False
            recategorize: dict[int, str] = {}
            for p in self.world.params:
                if p.grad is not None:
                    serial = tracker.serial_of(p.grad)
                    if serial is not None:
                        recategorize[serial] = "gradients"
            if self.optimizer is not None:
                for state in self.optimizer.state.values():
                    for v in state.values():
                        if isinstance(v, torch.Tensor):
                            serial = tracker.serial_of(v)
                            if serial is not None:
                                recategorize[serial] = "optimizer_state"
            return Trace(tracker, recategorize)
        finally:
            tracker.close()
            tracker.on_phase = None  # its closure refers to the tracker: no cycle
            for h in handles:
                h.remove()
            if on_selective in _selective.RECOMPUTE_LISTENERS:
                _selective.RECOMPUTE_LISTENERS.remove(on_selective)
            if gc_was_enabled:
                gc.enable()
