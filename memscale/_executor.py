"""The executor object stored on a wrapped model.

The hooks and the checkpointing machinery are in C
(``memscale._core.Executor``); this subclass only keeps what the Python
layer needs to undo its own changes and to report: the effective Config,
the hardware, and the restore actions run by ``detach``.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import _compiled, _core
from ._format import format_bytes, plan_table
from ._hardware import Hardware
from .config import Config

logger = logging.getLogger(__name__)


class Executor(_core.Executor):
    """Applies a memscale plan to one model; see ``memscale.wrap``.

    Attributes set by ``wrap``: ``config`` (the effective Config),
    ``hardware`` (the device description the plan was made for),
    ``profiling`` ("static", "empirical" or "warmup"; "first_step" until
    the first training forward plans), ``profile`` (what was measured per
    layer, including output bytes and forward FLOPs),
    ``decision`` (Stage 1's ``memscale.policy.StrategyDecision``, with its
    ``decision_source``; None until made) and ``metrics_server`` (the
    ``memscale.observability.MetricsServer`` serving this model's metrics,
    or None) and ``offload_store`` (the disk tier of offload, a
    ``memscale._core.SpillStore`` whose ``stats`` count what was spilled,
    or None), ``optimizer`` (the optimizer ``wrap`` was given, or its 8-bit
    replacement with ``use_8bit_optimizer``; None without one).
    """

    config: Config
    hardware: Hardware
    profiling: str
    profile: Any  # the _planning.Profile measured (None while warming up)
    decision: Any  # a memscale.policy.StrategyDecision, or None until made
    metrics_server: Any  # a memscale.observability.MetricsServer, or None
    units: list[tuple[str, torch.nn.Module]]  # the planning units, while attached
    # Without sample_input, until the first training forward has planned:
    _first_forward: Any  # the memscale._firststep.FirstForward hooks
    _measure_instead: Callable[[], None]  # switches to measuring real steps

    def init_python_state(self, config: Config, hardware: Hardware, profiling: str) -> None:
        """Set what the Python layer keeps (see the class docstring); once,
        right after the executor is made."""
        self.config = config
        self.hardware = hardware
        self.profiling = profiling
        self.profile = None
        self.decision = None
        self.metrics_server = None
        self.offload_store = None  # the disk tier (a _core.SpillStore), if any
        self.offload_host = None  # the host tier (memscale.offload.HostTier), if any
        self.optimizer: torch.optim.Optimizer | None = (
            None  # the optimizer to train with (replaced when 8-bit)
        )
        self.recompute_check: Any = None  # memscale._recompute_check.RecomputeCheck
        self._restore: list[Callable[[], None]] = []
        # Run on a copy of the model (see memscale._copying): each undoes on
        # the copy one change that detach undoes on the model.
        self._copy_fixups: list[Callable[[Callable[[Any], Any]], None]] = []
        self.layer_recomputes = 0  # see count_layer_recomputes
        # What of the plan is not applied under torch.compile (see
        # memscale._compiled.fallbacks); set with each plan.
        self.compile_fallbacks: tuple[_compiled.CompileFallback, ...] = ()
        self.optimizer_steps = 0  # see count_steps
        # memscale._step_in_backward.StepInBackward (optimizer_in_backward)
        self.step_in_backward: Any = None

    @property
    def has_python_state(self) -> bool:
        """Whether :meth:`init_python_state` has run."""
        return "_restore" in self.__dict__

    def await_first_forward(
        self,
        first: Any,
        measure_instead: Callable[[], None],
        plan_from: Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any]], bool],
    ) -> None:
        """Plan on the first training forward: ``first`` (a
        ``memscale._firststep.FirstForward``) holds the hooks that do it,
        ``measure_instead`` switches to measuring real steps instead (see
        :meth:`measure_real_steps`), ``plan_from`` plans from another
        module's forward (see :meth:`plan_from_step`).  All are dropped by
        detach."""
        self._first_forward = first
        self._measure_instead = measure_instead
        self._plan_from = plan_from

    # The module hooks (registered by the C executor under these names):
    # while dynamo traces a forward they return at once, since the plan is
    # then carried out inside the compiled graph (memscale._compiled) and
    # dynamo cannot trace the C hooks nor compile their saved-tensor hooks.

    def _pre(self, module: Any, args: Any, kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        return super()._pre(module, args, kwargs)

    def _post(self, module: Any, args: Any, output: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        return super()._post(module, args, output)

    def _root_pre(self, module: Any, args: Any, kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        return super()._root_pre(module, args, kwargs)

    def _root_post(self, module: Any, args: Any, output: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        return super()._root_post(module, args, output)

    def enter_root(self, module: torch.nn.Module) -> None:
        """What the root module's forward pre-hook does, called by hand: a
        framework whose training step does not call the root module
        (Lightning's ``training_step``) opens the pass with it."""
        self._root_pre(module, (), {})

    def leave_root(self, module: torch.nn.Module) -> None:
        """What the root module's forward hook does, called by hand: ends
        the pass (nothing when the hook has ended it); after the last
        warm-up pass this plans and applies."""
        self._root_post(module, (), None)

    def abandon(self) -> None:
        """Leave what the forward in progress entered (the C executor's
        ``_abandon``): the model's call guard runs it when a forward is
        left by an exception."""
        self._abandon()

    def pause(self) -> None:
        """Make every hook of this executor do nothing until :meth:`resume`
        (nests)."""
        super().pause()
        self.__dict__["_pause_depth"] = self.__dict__.get("_pause_depth", 0) + 1

    def resume(self) -> None:
        """Undo one :meth:`pause`."""
        super().resume()
        depth = self.__dict__.get("_pause_depth", 0)
        self.__dict__["_pause_depth"] = max(0, depth - 1)

    def is_paused(self) -> bool:
        """Whether :meth:`pause` is in effect."""
        return self.__dict__.get("_pause_depth", 0) > 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within the block every hook of this executor does nothing: the
        model runs exactly as without memscale (other hooks still run)."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    @contextlib.contextmanager
    def unmeasured(self) -> Iterator[None]:
        """What runs in the block counts in no FLOPs of a pass measured for
        real (the recompute check's second run of a layer): see
        ``memscale._planning.WarmupFlops``."""
        counter = self.__dict__.get("_warmup_flops")
        if counter is None:
            yield
            return
        with counter.excluded():
            yield

    def on_detach(self, action: Callable[[], None]) -> None:
        """Run ``action`` when the executor is detached (LIFO order)."""
        self._restore.append(action)

    def on_copy(self, fixup: Callable[[Callable[[Any], Any]], None]) -> None:
        """Run ``fixup(copy_of)`` on every copy of the wrapped model, where
        ``copy_of(obj)`` is the copy's counterpart of ``obj``: it undoes on
        the copy a change of the model's that ``detach`` undoes."""
        self._copy_fixups.append(fixup)

    def detach(self) -> None:
        """Remove every hook and undo every change; idempotent."""
        try:
            super().detach()
        finally:
            # What refers to the model (the executor keeps no reference to
            # it once detached).
            for name in (
                "units",
                "_first_forward",
                "_measure_instead",
                "_plan_from",
                "_warmup_flops",
            ):
                self.__dict__.pop(name, None)
            while self._restore:
                action = self._restore.pop()
                try:
                    action()
                except Exception:  # keep undoing the rest
                    logger.exception("memscale: a restore step failed")

    def count_steps(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Count ``optimizer``'s ``step()`` calls in ``optimizer_steps``
        (removed by detach)."""
        self.optimizer_steps = 0
        if optimizer is None:
            return
        ref = weakref.ref(self)

        def counted(opt: Any, args: Any, kwargs: Any) -> None:
            ex = ref()
            if ex is not None:
                ex.optimizer_steps += 1

        self.on_detach(optimizer.register_step_post_hook(counted).remove)

    def count_layer_recomputes(self, units: list[tuple[str, torch.nn.Module]], plan: Any) -> None:
        """Count in ``layer_recomputes`` the forwards of the layers the plan
        recomputes that run during backward: the recomputes, layer by layer
        (``stats['recomputes']`` counts segments).  Removed by detach."""
        ref = weakref.ref(self)
        graph_task = torch._C._current_graph_task_id

        def counted(module: torch.nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():
                return  # compiled: the recompute is in the graph
            ex = ref()
            if ex is not None and graph_task() != -1 and not ex.is_paused():
                ex.layer_recomputes += 1

        handles = self.__dict__.setdefault("_recompute_counters", [])
        while handles:  # a new plan: count its layers only
            handles.pop().remove()
        if not handles and "_recompute_counters_removed" not in self.__dict__:
            self.__dict__["_recompute_counters_removed"] = True

            def remove() -> None:
                while handles:
                    handles.pop().remove()

            self.on_detach(remove)
        for (_, unit), layer in zip(units, plan.layers):
            if {"checkpoint", "tiling"} & set(layer.techniques):
                handles.append(unit.register_forward_pre_hook(counted))

    def apply(self, plan: Any) -> None:
        """Apply ``plan`` (see ``memscale._core.Executor.apply``)."""
        super().apply(plan)
        self.plan_applied(plan)

    def plan_applied(self, plan: Any) -> None:
        """What follows a new plan on the Python side: the recompute
        counters and the compiled path (``memscale._compiled``)."""
        units = self.__dict__.get("units")
        if units is not None:
            self.count_layer_recomputes(units, plan)
        _compiled.update(self, plan)

    @property
    def plans_on_first_forward(self) -> bool:
        """Whether the plan is still to be made on the first training
        forward (``wrap`` without ``sample_input``)."""
        first = self.__dict__.get("_first_forward")
        return first is not None and first.pending

    def measure_real_steps(self) -> None:
        """Give up planning on the first training forward (which never
        reached the model's forward, nor the module that holds every
        planning unit): measure the next ``Config.warmup_steps`` training
        forwards for real instead, then plan."""
        if not self.plans_on_first_forward:
            raise RuntimeError(
                "memscale: measure_real_steps() is only possible "
                "before the first training forward was planned"
            )
        self.__dict__.pop("_measure_instead")()

    def plan_from_step(
        self, step: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> bool:
        """Plan now, before the first training forward, from one call of
        ``step`` (a module whose forward runs a whole training step of the
        wrapped model, such as Lightning's ``training_step``, and holds the
        wrapped model among its submodules) on ``args`` and ``kwargs``,
        profiled on fake tensors as a first forward's inputs are.  True
        when the plan is made and applied; False, with nothing changed,
        when the step cannot be profiled (the plan is then made on the
        first training forward, as before)."""
        if not self.plans_on_first_forward:
            raise RuntimeError(
                "memscale: plan_from_step() is only possible before the "
                "first training forward was planned"
            )
        return bool(self.__dict__["_plan_from"](step, args, kwargs))

    def describe(self) -> str:
        """The hardware and the plan, one row per layer (what ``wrap``
        logs at DEBUG); a line saying so while there is no plan yet."""
        hw = self.hardware
        lines = [
            f"memscale hardware: {hw.device} x{hw.count}, "
            f"{format_bytes(hw.capacity_bytes, digits=1)} each ({hw.name})"
        ]
        plan = self.plan
        if plan is None:
            when = (
                "after the first Config.warmup_steps training forwards"
                if self.state == "profiling"
                else "on the first training forward"
            )
            lines.append(f"memscale: no plan yet; it is made {when}")
        else:
            lines.append(plan_table(plan))
            lines.extend(note.message() for note in self.__dict__.get("compile_fallbacks", ()))
        return "\n".join(lines)

    def __repr__(self) -> str:
        plan = self.plan
        summary = f"plan={plan.hash[:12]}" if plan is not None else "no plan"
        return f"<memscale Executor state={self.state} {summary}>"
