"""The simulation session: the fake world and the warm-up set up once, the
unoptimized step simulated once, and the step under each plan it is given
simulated when first asked for."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import (
    _compiled,
    _core,
    _hf_cache,
    _model,
    _recompute_check,
    _selective,
    _step_in_backward,
    _verify,
)
from .._executor import Executor
from .._hardware import Hardware
from .._offload import SimulatedTier, async_settings
from ..config import Config
from ._fake import FakeWorld
from ._results import PeakBreakdown
from ._step import Step, Trace, estimated_state, fake_optimizer
from ._workspace import PROBE_LIMIT, Kernel, library_workspace_bytes, probe_workspace

logger = logging.getLogger(__name__)


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def _freeze_old_objects() -> list[None] | None:
    """Leave the objects the process holds now out of the cyclic garbage
    collector's passes until :func:`_thaw` (``gc.freeze``); a sentinel
    made right after (for :func:`_thaw`), or None where it did not freeze.

    The simulated steps make and drop some hundred thousand objects (fake
    tensors, their records), and the full collections they set off would
    each walk every object of the process again (0.14 CPU seconds each
    with the 320,000 that ``scripts/wrap_time.py`` holds on the chain of
    1,000 blocks).  Frozen objects are only skipped: ``gc.unfreeze``
    puts them back in the oldest generation, where one that became
    garbage meanwhile is collected by the next full collection.  So is
    garbage not yet collected when the freeze starts (a dropped model in
    a reference cycle), except where CUDA is in use: its memory would
    count against the first training steps, so it is collected first
    (one full collection).  While frozen, objects are not in
    ``gc.get_objects()``.  Not done when the process has frozen objects
    itself (thawing would undo that, as a server that freezes before
    forking its workers does) or turned the collector off."""
    if gc.get_freeze_count() or not gc.isenabled():
        return None
    if torch.cuda.is_initialized():
        gc.collect()
    gc.freeze()
    return [None]  # (tracked by the collector, and not frozen)


def _thaw(sentinel: list[None] | None) -> None:
    """Undo :func:`_freeze_old_objects`, unless the process froze objects
    itself since (code the simulation ran, or another thread: the
    sentinel is frozen then), which thawing would undo too; the
    simulation's own freeze then stays, as the process's would have
    frozen those objects too."""
    if sentinel is not None and any(o is sentinel for o in gc.get_objects()):
        gc.unfreeze()


class _Simulation:
    """Everything the simulated steps need, set up once: the fake world, the
    fake optimizer warmed up, and the profile measured in the warm-up."""

    def __init__(
        self,
        model: nn.Module,
        sample_input: Any,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: Callable[[Any], Any] | None,
        device: torch.device,
        target_type: str,
        read_profile: Callable[[Any, list[tuple[str, nn.Module]], Any], Any],
        floor: _model.Floor = _model.NO_FLOOR,
    ) -> None:
        self.model = model
        self.floor = floor
        self.target_type = target_type
        self.sample_input = sample_input
        self.real_optimizer = optimizer
        self.loss_fn = loss_fn
        self.device = device
        self.read_profile = read_profile
        self.units = _core.find_units(model)

    def __enter__(self) -> _Simulation:
        self._frozen = None
        try:
            self._frozen = _freeze_old_objects()
            self._rng = _verify.rng_state()  # a model may draw from any stream
            self.world = FakeWorld(self.model, self.device, self.sample_input)
            self.world.__enter__()
        except BaseException:
            _thaw(self.__dict__.pop("_frozen"))
            raise
        try:
            args, kwargs = _model.split_input(self.sample_input)
            inputs = (self.world.fake_tree(args), self.world.fake_tree(kwargs))
            opt, self.optimizer_name = fake_optimizer(
                self.real_optimizer, self.world, self.target_type
            )
            self.optimizer_simulated = opt is not None
            fallback = (
                []
                if opt is not None
                else estimated_state(self.world, self.real_optimizer, self.model)
            )
            self.step = Step(
                self.world, inputs, self.loss_fn, opt, fallback, target_type=self.target_type
            )
            self.profile = self._warm_up()
            self._below_floor(opt)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _below_floor(self, opt: torch.optim.Optimizer | None) -> None:
        """After the warm-up (which made the state): the step in backward,
        and the state on a simulated tier, as ``self.floor`` says."""
        self.in_backward: Any = None
        if not self.floor.step_in_backward:
            return
        self.step.replays_optimizer = False
        self.step.optimizer_replay = None  # the warm-up's, of a step after backward
        if opt is not None:
            tier = (
                _step_in_backward.SimulatedStateTier()
                if self.floor.state_tier is not None
                else None
            )
            self.in_backward = _step_in_backward.StepInBackward(
                opt, tier, prefetch_depth=self.floor.prefetch_depth
            )
            return
        # The optimizer's state is estimated, not simulated: the gradients
        # are freed as the update would free them.
        self.step.fallback_state = []
        handles = []
        for p in self.world.params:
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(_drop_grad))
        self.in_backward = handles

    def _warm_up(self) -> Any:
        """The first step: it creates gradients and optimizer state (a
        steady-state step starts with both), and the C profiler measures
        its forward, as static profiling in wrap() does; what it measured,
        read by ``read_profile``.  Tracked, and the unoptimized step made
        from it, where :meth:`_merges` (``Step.first_tracked``); untracked
        otherwise (``Step.warm_up``)."""
        units = self.units
        params = self.world.params + self.world.buffers
        holder: dict[str, Any] = {}

        class _Pass:
            def __init__(self_inner, caller: Any) -> None:
                # The warm-up's caller: its FLOP tally is the FLOP counter
                # (the same formulas as FlopCounterMode, without a mode).
                self_inner.caller = caller

            def __enter__(self_inner) -> Any:
                modules = [m for _, m in units]
                caller = self_inner.caller
                prof = _core.Profiler(modules, params, caller.flops)
                prof.attach()
                holder["profiler"] = prof
                try:
                    prof.begin_pass()
                except BaseException:
                    prof.detach()
                    raise
                # The ops of each unit, for its selective profile: the
                # same recording as wrap()'s static profiling, handed each
                # call by the caller rather than as a mode of its own.
                ops = _selective.recorder(modules, prof, as_mode=False)
                if ops is not None:
                    try:
                        ops.__enter__()
                    except BaseException:
                        ops.close()
                        prof.end_pass(ok=False)
                        prof.detach()
                        raise
                    caller.recorder = ops
                holder["ops"] = ops
                return prof

            def __exit__(self_inner, exc_type: Any, *_: Any) -> None:
                prof = holder["profiler"]
                ops = holder.get("ops")
                self_inner.caller.recorder = None
                try:
                    if ops is not None:
                        ops.__exit__(None, None, None)
                        ops.close()
                finally:
                    try:
                        prof.end_pass(ok=exc_type is None)
                    finally:
                        prof.detach()

        try:
            if self._merges():
                # The warm-up and the unoptimized step in one tracked step.
                self._first = self.step.first_tracked(_Pass, [m for _, m in units])
                profiler = holder["profiler"]
            else:
                profiler = self.step.warm_up(_Pass)
            return self.read_profile(profiler, units, holder.get("ops"))
        finally:
            # The class and its methods are a cycle that refers to the
            # holder: let the recording go with the last reference to it.
            holder.clear()

    def _merges(self) -> bool:
        """Whether the warm-up is also the unoptimized step
        (``Step.first_tracked``): the optimizer's first update is a steady
        one, and no step in backward changes the steps after it."""
        return self.step.first_update_is_steady() and not self.floor.step_in_backward

    def __exit__(self, *exc: Any) -> None:
        try:
            in_backward = self.__dict__.pop("in_backward", None)
            if isinstance(in_backward, list):
                for h in in_backward:
                    h.remove()
            elif in_backward is not None:
                in_backward.remove()
        finally:
            try:
                self.world.__exit__(None, None, None)
            finally:
                try:
                    _verify.set_rng_state(self._rng)
                finally:
                    _thaw(self.__dict__.pop("_frozen", None))

    def unoptimized(self) -> Trace:
        """The unoptimized steady-state step: the one the warm-up made
        (``Step.first_tracked``) the first time it is asked for, if it
        made one; simulated otherwise."""
        first = self.__dict__.pop("_first", None)
        if first is not None:
            return first
        return self.step.tracked([], [m for _, m in self.units])

    def under(self, plan: Any, config: Config, hardware: Hardware) -> Trace:
        """The step with the C executor applying ``plan`` to the model, and
        the settings wrap() makes with it (a Hugging Face model trains with
        ``config.use_cache=False`` under checkpointing)."""
        return self._under(plan, config, hardware, self.step, first=False)

    def first_step(self, plan: Any, config: Config, hardware: Hardware) -> Trace:
        """The first training step after ``wrap``, under ``plan``: no
        gradient exists when it starts, the optimizer has no state yet
        (unless the one given already has some), and each checkpointed
        layer is checked at its first forward (``_recompute_check``: the
        layer's saved tensors held while it runs once more).  The
        steady-state steps' gradients are put back after it."""
        stateful = self.real_optimizer is not None and bool(self.real_optimizer.state)
        step = Step(
            self.world,
            (self.step.args, self.step.kwargs),
            self.loss_fn,
            self.step.optimizer,
            self.step.fallback_state,
            target_type=self.target_type,
            state_made_in_step=not stateful,
        )
        grads = [(p, p.grad) for p in self.world.params]
        try:
            for p, _ in grads:
                p.grad = None
            return self._under(plan, config, hardware, step, first=True)
        finally:
            for p, grad in grads:
                p.grad = grad

    def _under(
        self, plan: Any, config: Config, hardware: Hardware, step: Step, first: bool
    ) -> Trace:
        undo_cache = None
        executor = Executor(self.model, self.units, warmup_steps=config.warmup_steps)
        try:
            executor.init_python_state(config, hardware, "static")
            # The profile the plan comes from (a selective run keeps nothing
            # of a unit's tail: _compiled.update reads where it starts).
            executor.profile = self.profile
            if plan.technique_counts["selective"]:
                # Selective layers run through their unit's forward, as
                # wrap() installs it.
                _compiled.install(executor, self.units)
            executor.apply(plan)
            if plan.technique_counts["offload"]:
                settings = async_settings(config)
                executor.set_offload(
                    None,
                    SimulatedTier(
                        settings.min_offload_bytes,
                        settings.prefetch_depth if config.async_offload else 0,
                    ),
                )
            if plan.technique_counts["checkpoint"] or plan.technique_counts["selective"]:
                undo_cache = _hf_cache.disable_use_cache(self.model)[1]
            if plan.technique_counts["checkpoint"] and first:  # as wrap() installs it
                _recompute_check.install(executor, self.model, plan, None)
            chosen = [m for (_, m), layer in zip(self.units, plan.layers) if layer.techniques]
            joining = [
                m
                for (_, m), layer in zip(self.units, plan.layers)
                if "checkpoint" in layer.techniques and layer.segment != layer.index
            ]
            nested: dict[int, list[nn.Module]] = {}
            for (_, m), layer in zip(self.units, plan.layers):
                if "checkpoint" in layer.techniques and layer.nested:
                    nested.setdefault(layer.segment, []).append(m)
            return step.tracked(chosen, [m for _, m in self.units], joining, list(nested.values()))
        finally:
            if undo_cache is not None:
                undo_cache()
            executor.detach()


class SimulationSession:
    """Simulated training steps of one model and batch, on fake tensors.

    Entering it sets up the fake world, runs the warm-up step (its forward
    measured by the C profiler, as ``wrap()``'s static profiling measures
    it; ``read_profile(profiler, units)`` makes :attr:`profile` of the
    measurement) and simulates the unoptimized step once (with Adam or
    AdamW, made from the warm-up step itself where it can be); the step
    under a plan is simulated when first asked for (once per plan).  The model's
    parameters and buffers are fake while it is open.  Making the plans is
    the caller's job (``memscale._planner.PredictionSession``).
    """

    def __init__(
        self,
        model: nn.Module,
        sample_input: Any,
        optimizer: torch.optim.Optimizer | None,
        hardware: Hardware,
        sim_device: torch.device,
        *,
        loss_fn: Callable[[Any], Any] | None,
        read_profile: Callable[[Any, list[tuple[str, nn.Module]], Any], Any],
        floor: _model.Floor = _model.NO_FLOOR,
    ) -> None:
        self.model = model
        self.hardware = hardware
        self._sim_device = sim_device
        # What the libraries keep on the device besides the step's tensors
        # (cuBLAS workspaces on CUDA; 0 elsewhere), measured on entry.
        self.library_bytes = 0
        self._sim = _Simulation(
            model,
            sample_input,
            optimizer,
            loss_fn,
            sim_device,
            hardware.device,
            read_profile,
            floor,
        )
        self._traces: dict[str, Trace] = {}
        self._workspace: dict[Any, Kernel] = {}
        self._unprobed: dict[str, int] = {}
        self.is_open = False

    def _guard(self, what: Callable[[], Any]) -> Any:
        try:
            return what()
        except (TypeError, ValueError):
            raise
        except Exception as exc:
            why = _model.inference_input_error(
                self._sim.sample_input, "the OOM predictor", str(exc)
            )
            if why is not None:
                raise why from exc
            raise RuntimeError(
                f"memscale could not simulate a training step of "
                f"{type(self.model).__name__} on fake tensors ("
                f"{type(exc).__name__}: {exc}). Check that a real step runs "
                "with this sample_input; an operator without a fake "
                "implementation, or a model that reads tensor values to "
                "choose what to do, cannot be predicted"
            ) from exc

    def __enter__(self) -> SimulationSession:
        self._guard(self._sim.__enter__)
        self.is_open = True
        try:
            self._unoptimized = self._guard(self._sim.unoptimized)
            self._probe(self._unoptimized, "")
            self.library_bytes = library_workspace_bytes(self._sim_device)
            if self.library_bytes:
                logger.info(
                    "memscale: the libraries keep %d bytes on %s (cuBLAS workspaces); "
                    "every predicted peak includes them",
                    self.library_bytes,
                    self._sim_device,
                )
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.is_open:
            self.is_open = False
            self._sim.__exit__(None, None, None)

    @property
    def profile(self) -> Any:
        """What the warm-up's forward measured, as ``read_profile`` read it."""
        return self._sim.profile

    @property
    def optimizer_name(self) -> str:
        """The class name of the optimizer simulated (AdamW without one)."""
        return self._sim.optimizer_name

    @property
    def optimizer_simulated(self) -> bool:
        """Whether the optimizer's step runs on fake tensors (False: its
        state is estimated from its class, and it has no workspace)."""
        return self._sim.optimizer_simulated

    def _probe(self, trace: Trace, key: str) -> None:
        limit = min(PROBE_LIMIT, max(1, self.hardware.capacity_bytes // 8))
        found, unprobed = probe_workspace(trace.signatures(), limit)
        self._workspace.update(found)
        self._unprobed[key] = unprobed

    def _trace(self, plan: Any, config: Config) -> tuple[str, Trace]:
        """The step simulated under ``plan`` (once per plan), and its key."""
        key = plan.hash
        if plan.technique_counts["offload"] and config.async_offload:
            # Same plan, another step: async prefetch reads ahead.
            key += f"/prefetch{async_settings(config).prefetch_depth}"
        if key not in self._traces:
            self._traces[key] = self._guard(lambda: self._sim.under(plan, config, self.hardware))
            self._probe(self._traces[key], key)
        return key, self._traces[key]

    def first_step(self, plan: Any, config: Config) -> PeakBreakdown:
        """The first training step after ``wrap`` under ``plan`` (see
        ``_Simulation.first_step``), simulated once per plan."""
        key = "first/" + plan.hash
        if plan.technique_counts["offload"] and config.async_offload:
            key += f"/prefetch{async_settings(config).prefetch_depth}"
        if key not in self._traces:
            self._traces[key] = self._guard(
                lambda: self._sim.first_step(plan, config, self.hardware)
            )
            self._probe(self._traces[key], key)
        return self._breakdown(self._traces[key])

    def _breakdown(self, trace: Trace) -> PeakBreakdown:
        """The peak of ``trace`` with the libraries' workspaces, which are
        alive all step long (every absolute figure of this class has them)."""
        return trace.breakdown(self._workspace).with_libraries(self.library_bytes)

    def simulated_peak(self, plan: Any, config: Config) -> int:
        """The peak bytes of the step under ``plan`` (made with ``config``)."""
        return int(self._breakdown(self._trace(plan, config)[1]).peak_bytes)

    def recompute_peaks(self, plan: Any, config: Config) -> dict[int, int]:
        """Per recomputed unit (its index in the plan), the peak bytes of
        the step under ``plan`` from where backward reaches it (its
        recompute starts) to where backward reaches the next one, or to the
        end of backward: what its recompute and backward need on top of
        what is held then.  From the same simulated step as
        :meth:`simulated_peak` (once per plan)."""
        trace = self._trace(plan, config)[1]
        tracker = trace.tracker
        index = {id(m): i for i, (_, m) in enumerate(self._sim.units)}
        marks = [(at, index[id(m)]) for at, m in tracker.recompute_marks if id(m) in index]
        end = next(
            (at for at, phase in tracker.phase_marks if phase == "optimizer"),
            len(tracker.events),
        )
        bounds = [at for at, _ in marks] + [end]
        peaks = tracker.span_peaks(self._workspace, bounds)
        out: dict[int, int] = {}
        for (_, unit), peak in zip(marks, peaks):
            out[unit] = max(out.get(unit, 0), int(peak) + self.library_bytes)
        return out

    def forward_holds(self, plan: Any = None, config: Config | None = None) -> dict[int, int]:
        """Per unit (its index in the plan), the bytes its forward leaves
        alive in the step under ``plan`` (from the same simulated step as
        :meth:`simulated_peak`), or in the unoptimized step (no plan)."""
        if plan is None:
            tracker = self._unoptimized.tracker
        else:
            assert config is not None
            tracker = self._trace(plan, config)[1].tracker
        index = {id(m): i for i, (_, m) in enumerate(self._sim.units)}
        marks = tracker.forward_marks
        out: dict[int, int] = {}
        for (start, unit), (end, _) in zip(marks[::2], marks[1::2]):
            i = index.get(id(unit))
            if i is not None:  # a unit called twice holds both calls' bytes
                out[i] = out.get(i, 0) + sum(delta for _, delta in tracker.events[start:end])
        return out

    def unoptimized_peak(self) -> int:
        """The peak bytes of the unoptimized step."""
        return int(self._breakdown(self._unoptimized).peak_bytes)

    def breakdowns(self, plan: Any, config: Config) -> tuple[PeakBreakdown, PeakBreakdown, int]:
        """The unoptimized step and the step under ``plan`` (the unoptimized
        one when the plan checkpoints nothing), and the kernel calls of the
        two whose scratch memory was not measured."""
        key, trace = "", self._unoptimized
        if plan.technique_counts["checkpoint"]:
            key, trace = self._trace(plan, config)
        return (
            self._breakdown(self._unoptimized),
            self._breakdown(trace),
            self._unprobed[""] + self._unprobed.get(key, 0),
        )
