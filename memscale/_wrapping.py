"""The pipeline of one ``wrap`` (:class:`Wrapping`): profile -> Stage 1 ->
plan -> budget check -> techniques attached -> plan applied, run once, from
``sample_input`` inside ``wrap``, from the first training forward's own
inputs inside that forward, or after measured warm-up forwards.
:mod:`memscale.api` checks the arguments and drives it."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import (
    _budget,
    _compiled,
    _copying,
    _core,
    _distributed,
    _firststep,
    _hardware,
    _hf_cache,
    _model,
    _offload,
    _planner,
    _planning,
    _recompute_check,
    _step_in_backward,
    _telemetry,
    _tiling,
    _torch_compat,
    amp,
    observability,
    policy,
)
from ._executor import Executor
from ._format import format_bytes, plan_table
from ._hardware import Hardware
from ._solve import PlanProblem
from .config import GIB, Config
from .predictor import library_workspace_bytes

# The plan's log lines keep the logger name they have always had (users
# filter on it; docs/observability.md shows it).
logger = logging.getLogger("memscale.api")

ATTR = "_memscale_executor"  # where the executor lives: model.__dict__[ATTR]


def _stage1(
    executor: Executor, config: Config, hardware: Hardware, profile: Any, fixed: int
) -> Config:
    """Run Stage 1, record the decision on the executor, log it; return the
    effective Config for Stage 2."""
    if not policy.needs_profile(config, hardware):
        profile = None  # the decision does not depend on it
    context = policy.StrategyContext.build(config, hardware, profile, fixed)
    decision, effective = policy.select_strategy(config, context)
    executor.decision = decision
    executor.config = effective
    logger.debug("%s", decision.describe())
    return effective


def _abandoner(ref: weakref.ref[Executor]) -> Any:
    """What the model's call guard runs when a forward is left by an
    exception: the executor leaves what it entered (``Executor.abandon``),
    also on a ``KeyboardInterrupt``, which torch's ``always_call`` hooks
    never see."""

    def abandon() -> None:
        executor = ref()
        if executor is not None:
            executor.abandon()

    return abandon


DETAILS = "table: model._memscale_executor.describe(), or the 'memscale' logger at DEBUG"


def _budget_source(config: Config, hardware: Hardware) -> str:
    """Where the budget comes from, for the log."""
    if config.memory_budget_gb is not None:
        return "Config.memory_budget_gb"
    where = "host RAM" if hardware.device == "cpu" else f"{hardware.device} memory"
    return (
        f"{config.target_gpu_utilization:.0%} of "
        f"{format_bytes(hardware.capacity_bytes, digits=1)} {where}, "
        "Config.target_gpu_utilization"
    )


def _log_plan(config: Config, hardware: Hardware, plan: Any, decision: Any = None) -> None:
    """One INFO line per plan (what was decided, the expected peak, where
    the details are); the hardware and the per-layer table at DEBUG."""
    if not config.enable_logging:
        return

    def fmt(n: float) -> str:
        return format_bytes(n, digits=1)

    mode = f"mode {plan.mode}"
    if decision is not None and decision.decision_source != "user_config":
        mode += f", strategy {decision.strategy} (decision_source={decision.decision_source})"
    logger.debug(
        "memscale hardware: %s x%d, %s each (%s)",
        hardware.device,
        hardware.count,
        fmt(hardware.capacity_bytes),
        hardware.name,
    )
    logger.debug("%s", plan_table(plan))
    budget = f"{fmt(plan.budget_bytes)} ({_budget_source(config, hardware)})"
    if plan.skipped:
        logger.info(
            "memscale: model left alone (smart-skip, plan %s, %s): its predicted "
            "peak of %s fits comfortably in the budget of %s (pressure %.2f). "
            "Config(force_optimize=True) optimizes it anyway.",
            plan.hash[:12],
            mode,
            fmt(plan.peak_unoptimized_bytes),
            budget,
            plan.pressure,
        )
    else:
        counts = plan.technique_counts
        decided = ", ".join(f"{name} {counts[name]}" for name in counts if counts[name])
        logger.info(
            "memscale: plan %s (%s): %s of %d layers; predicted peak %s -> %s "
            "for a budget of %s (recompute %.0f%% of forward); %s",
            plan.hash[:12],
            mode,
            decided or "no technique",
            len(plan),
            fmt(plan.peak_unoptimized_bytes),
            fmt(plan.peak_projected_bytes),
            budget,
            plan.recompute_ratio * 100,
            DETAILS,
        )
    if not plan.fits:
        logger.warning(
            "memscale: even with every eligible layer optimized the "
            "projected peak (%s) exceeds the budget (%s)",
            fmt(plan.peak_projected_bytes),
            fmt(plan.budget_bytes),
        )


def _after_plan(
    model: torch.nn.Module, executor: Executor, plan: Any, problem: PlanProblem
) -> None:
    """Model-level settings that go with a plan (undone by detach): a
    checkpointed Hugging Face model trains with its key/value cache off on
    every config it holds (see ``_hf_cache``), and each checkpointed layer
    is checked at its first checkpointed forward (``_recompute_check``;
    ``problem``, the plan's, is solved again without a layer that
    fails)."""
    counts = plan.technique_counts
    if not (counts["checkpoint"] or counts["selective"]):
        return
    if counts["checkpoint"]:
        _recompute_check.install(executor, model, plan, problem)
    changed, undo = _hf_cache.disable_use_cache(model)
    if changed:

        def restore_copy(copy_of: Any, cfgs: list[Any] = changed) -> None:
            for cfg in cfgs:
                copied = copy_of(cfg)
                if copied is not None and getattr(copied, "use_cache", None) is False:
                    copied.use_cache = True

        executor.on_detach(undo)
        executor.on_copy(restore_copy)
        logger.info(
            "memscale: set use_cache=False on %d Hugging Face config(s) "
            "of the model for training with checkpointing (a recomputed "
            "layer must not see the cache its forward filled; restored "
            "by detach)",
            len(changed),
        )


class _Upfront(NamedTuple):
    """What profiling a sample (``sample_input``, or the first training
    forward's inputs) gives the planning."""

    profile: Any  # _planning.Profile
    offsets: _planner.Offsets
    least: int | None  # the least budget when no plan fits, else None


class Wrapping:
    """One ``wrap``: what it works with, and the steps of its one pipeline

        profile -> Stage 1 -> plan (one for every rank) -> budget check
        -> techniques attached -> plan applied

    run once, by :meth:`install`.  What differs between the ways of
    profiling is only where the profile comes from and when the pipeline
    runs: ``sample_input`` is profiled on fake tensors inside ``wrap``
    (:meth:`plan`); without it, the first training forward's own
    inputs are, inside that forward and before it runs
    (:meth:`plan_on_first_forward`); and where fake tensors cannot run the
    model, the first ``warmup_steps`` forwards are measured for real and
    the pipeline runs after the last one (:meth:`plan_after_warmup`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: Config,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: Callable[[Any], Any] | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.optimizer = optimizer
        self.loss_fn = loss_fn  # what the simulated steps take as the loss
        device = _model.model_device(model)
        if config.memory_budget_gb is not None and device.type not in ("cpu", "cuda"):
            self.hardware = _hardware.assumed(device.type, 0, int(config.memory_budget_gb * GIB))
        else:
            self.hardware = _hardware.detect(device.type, device.index or 0)
        self.units = _core.find_units(model)
        # FSDP2: the local shards; the floor as the Config places it
        self.fixed = _model.fixed_bytes(model, optimizer, _model.floor_of(config))
        if _distributed.is_fsdp2(model):
            self.fixed += _distributed.fsdp2_in_flight_bytes(model)
        # cuBLAS's workspaces on a CUDA device (0 elsewhere), as the OOM
        # predictor counts them in every simulated peak.
        self.fixed += library_workspace_bytes(device)
        self.executor: Executor | None = None

    # -- where the profile comes from --------------------------------------

    def profile(self, model: torch.nn.Module, inputs: Any, config: Config) -> _Upfront:
        """Profile ``model`` on ``inputs`` (fake tensors first, a real
        forward as fallback, per ``config``) and ask the OOM predictor for
        its corrections."""
        hardware, fixed, optimizer = self.hardware, self.fixed, self.optimizer

        def stage1(profile: Any) -> Config:
            # Stage 1 first (it is recorded on the executor later): the plan
            # the corrections are calibrated on is the one wrap() makes.
            return policy.select_strategy(
                config,
                policy.StrategyContext.build(
                    config,
                    hardware,
                    profile if policy.needs_profile(config, hardware) else None,
                    fixed,
                ),
            )[1]

        with amp.profiling_context(config, hardware):
            # Plan from the OOM predictor's peaks (simulated steps on fake
            # tensors), so that the plan and predict_peak() agree.  With
            # static profiling, the simulation's warm-up forward is the
            # profile (measured the same way): one fake forward, not two.
            offsets = None
            if config.use_static_profiling and _planning.static_profiling_supported(model) is None:
                offsets = _planner.predicted_offsets(
                    model, inputs, optimizer, None, config, hardware, fixed, stage1, self.loss_fn
                )
            if offsets is not None and offsets.profile is not None:
                profile = offsets.profile
                early_config = stage1(profile)
            else:
                profile = _planning.profile_upfront(model, self.units, inputs, config)
                early_config = stage1(profile)
                if offsets is None:
                    offsets = _planner.predicted_offsets(
                        model,
                        inputs,
                        optimizer,
                        profile,
                        early_config,
                        hardware,
                        fixed,
                        loss_fn=self.loss_fn,
                    )
                if offsets.profile is not None:
                    profile = offsets.profile
            # No plan fits: the least budget the calibrated planner reaches.
            least = _planner.verified_least_budget(profile, early_config, hardware, fixed, offsets)
        return _Upfront(profile, offsets, least)

    def method(self, upfront: _Upfront | None) -> str:
        """How the model is (or will be) profiled: the ``profiling`` the
        executor reports."""
        if upfront is not None:
            return str(upfront.profile.method)
        return "first_step"

    # -- the executor and what goes with it, before any plan ---------------

    def attach(self, method: str) -> Executor:
        """The executor, with everything that does not depend on the plan:
        step counting, logging, the call guard, mixed precision, the
        metrics server.  On an error the caller detaches it."""
        config, model = self.config, self.model
        executor = Executor(model, self.units, warmup_steps=config.warmup_steps)
        self.executor = executor
        executor.init_python_state(config, self.hardware, method)
        executor.optimizer = self.optimizer
        executor.units = self.units
        _compiled.install(executor, self.units)  # before any other forward of ours
        executor.count_steps(self.optimizer)
        executor.on_detach(observability.attach_logging(config))
        executor.on_detach(
            _torch_compat.install_call_guard(model, _abandoner(weakref.ref(executor)))
        )
        amp.attach(executor, model, config, self.hardware)
        if config.optimizer_in_backward:
            assert self.optimizer is not None  # _step_in_backward.check
            _refuse_fp16_scaler(executor)
            _step_in_backward.install(executor, config, self.optimizer)
        if config.observability_port is not None:
            executor.metrics_server = observability.start_metrics_server(
                executor, config.observability_port
            )
            executor.on_detach(executor.metrics_server.close)
        return executor

    @property
    def attached(self) -> Executor:
        """The executor :meth:`attach` made."""
        if self.executor is None:
            raise RuntimeError("memscale internal error: the executor is not attached yet")
        return self.executor

    # -- the pipeline ---------------------------------------------------------

    def install(
        self,
        profile: Any,
        offsets: _planner.Offsets | None = None,
        least: int | None = None,
        *,
        apply: bool = True,
        again: bool = False,
    ) -> Any:
        """The pipeline from a profile: Stage 1 (unless already decided),
        the plan (one for every rank), its log line and budget check, the
        techniques attached, the plan applied (by the C executor itself
        after measured warm-up steps: ``apply=False``) and the model-level
        settings that go with it.  ``again``: a plan replaces the one
        applied (:meth:`refine_after_warmup`): what the first set up (an
        offload tier, tiled forwards, the recompute check) is kept and
        given only what the new plan adds.  Returns the plan."""
        executor, config, hardware, fixed = self.attached, self.config, self.hardware, self.fixed
        old = executor.plan if again else None
        executor.profile = profile
        executor.profiling = profile.method
        if executor.decision is None:
            plan_config = _stage1(executor, config, hardware, profile, fixed)
        else:
            plan_config = executor.config
        if offsets is not None:
            problem = _planning.plan_problem(
                profile,
                _planner.fallback_config(plan_config, offsets[2]),
                hardware,
                fixed,
                peak_offset=offsets[0],
                plan_offset=offsets[1],
            )
        else:
            problem = _planning.plan_problem(profile, plan_config, hardware, fixed)
        check = executor.recompute_check
        if old is not None and check is not None and check.excluded:
            # Layers that failed the recompute check stay unchecked.
            problem = problem.with_layer_flags(check.excluded, _core.LAYER_UNREPEATABLE)
        plan = _distributed.shared_plan(problem)
        _log_plan(config, hardware, plan, executor.decision)
        if _budget.fails(plan):  # (the suggestions' figures only then)
            _budget.check(
                plan,
                problem,
                plan_config,
                _model.optimizer_state_bytes(self.model, self.optimizer),
                least,
                _model.floor_options(self.model, self.optimizer, config, hardware.device),
            )
        if old is None:
            _offload.attach(executor, plan_config, plan)
            _tiling.install(executor, self.units, plan)
        else:
            _recompute_check.attach_new_needs(executor, old, plan)
        if apply:
            executor.apply(plan)
        else:
            executor.plan_applied(plan)
        if old is not None and check is not None:
            check.rearm(plan, problem)  # the layers it newly checkpoints
        else:
            _after_plan(self.model, executor, plan, problem)
        return plan

    def plan(self, upfront: _Upfront | None) -> None:
        """Run the pipeline now from ``upfront`` (``sample_input``'s
        profile), or arrange for it to run on the first training forward."""
        if upfront is not None:
            self.install(*upfront)
        else:
            self.plan_on_first_forward()

    def plan_on_first_forward(self) -> None:
        """No ``sample_input``: run the pipeline inside the first training
        forward, from its own inputs, before it runs (see
        ``memscale._firststep``), or earlier from a training step's inputs
        (``Executor.plan_from_step``).  If they cannot be profiled on fake
        tensors, measure that forward and the next ``warmup_steps - 1``
        instead (``use_empirical_fallback``)."""
        executor, config, model = self.attached, self.config, self.model
        if policy.needs_profile(config, self.hardware):
            policy.requested_policy()  # a bad MEMSCALE_POLICY fails now
        # The first forward is planned on fake tensors also with
        # use_static_profiling=False: its measured steps refine that plan.
        static_only = config.replace(use_static_profiling=True, use_empirical_fallback=False)

        def plan(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            try:
                try:
                    upfront = self._profile_unwrapped(module, args, kwargs, static_only)
                except RuntimeError as exc:
                    if not config.use_empirical_fallback:
                        raise
                    logger.info(
                        "memscale: the first training forward could not be "
                        "profiled on fake tensors (%s); measuring the first %d "
                        "training forwards instead",
                        exc,
                        config.warmup_steps,
                    )
                    self.plan_after_warmup()
                    return
            except BaseException:
                self._leave()
                raise
            self._install_planned(upfront)

        def plan_from(
            module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> bool:
            try:
                upfront = self._profile_unwrapped(module, args, kwargs, static_only)
            except RuntimeError as exc:
                logger.info(
                    "memscale: the training step could not be profiled on fake "
                    "tensors (%s); the plan is made on the first training forward",
                    exc,
                )
                return False
            except BaseException:
                self._leave()
                raise
            first.remove()
            self._install_planned(upfront)
            return True

        logger.debug(
            "memscale: no sample_input; the plan is made on the first training "
            "forward, from its inputs, before that forward runs"
        )
        names = [name for name, _ in self.units]
        first = _firststep.FirstForward(_firststep.chain(model, names), plan, executor.is_paused)
        executor.on_detach(first.remove)

        def measure_instead() -> None:
            first.remove()
            self.plan_after_warmup()

        executor.await_first_forward(first, measure_instead, plan_from)

    def _profile_unwrapped(
        self,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        static_only: Config,
    ) -> _Upfront:
        """Profile a training forward's inputs on fake tensors, as an
        unwrapped model (the OOM predictor refuses a wrapped one): our hooks
        are paused, the attribute set aside."""
        executor, model = self.attached, self.model
        wrapped = model.__dict__.pop(ATTR, None)
        try:
            with executor.paused():
                return self.profile(module, _model.Inputs(args, kwargs), static_only)
        finally:
            if wrapped is not None:
                model.__dict__[ATTR] = wrapped

    def _install_planned(self, upfront: _Upfront) -> None:
        """The pipeline inside a training forward (and, with
        ``use_static_profiling=False``, the measuring that refines its
        plan); on an error nothing is left attached."""
        try:
            plan_made = self.install(*upfront)
            if not self.config.use_static_profiling:
                self.refine_after_warmup(upfront)
        except BaseException:
            self._leave()
            raise
        _telemetry.plan_built(self.attached, plan_made, self.model)

    def _leave(self) -> None:
        """Leave nothing attached: the model runs as if never wrapped."""
        executor = self.attached
        if self.model.__dict__.get(ATTR) is executor:
            del self.model.__dict__[ATTR]
        executor.detach()

    def refine_after_warmup(self, first: _Upfront) -> None:
        """``use_static_profiling=False``: the next ``warmup_steps``
        training forwards (from the one running, when planned in the
        model's own pre-hook) run under the plan made from ``first`` and
        are measured for real meanwhile; after the last one the pipeline
        runs again from what they measured and the new plan applies from the next
        forward on.  That step's backward still recomputes what its
        forward checkpointed under the first plan.  The measured figures
        replace the fake pass's (which, for one, cannot know the data: a
        Hugging Face model builds an attention mask on fake tensors that
        it skips for a real all-ones one).

        Measuring under a plan: the profiler's hooks see every layer's
        calls, inputs, outputs and FLOPs as without one, and what a
        checkpointed layer saves is counted by the checkpoint frame's
        saved-tensor hook, which takes the tensors in place of the
        profiler's (``csrc/frame.c``); the recompute check's second run of
        a layer counts no FLOPs (``_planning.WarmupFlops``)."""
        executor = self.attached
        flops = _planning.WarmupFlops()
        profiler = _planning.new_warmup_profiler(self.model, self.units, flops)

        def on_profiled(prof: Any) -> Any:
            executor.__dict__.pop("_warmup_flops", None)
            # Tiling candidates as the first profile found them (before the
            # plan's hooks were on the layers).
            tile_flags = [layer.flags & _core.LAYER_TILEABLE for layer in first.profile.layers]
            profile = _planning.profile_from(prof, self.units, "warmup", tile_flags)
            check = executor.recompute_check
            unseen = set(check.failed) if check is not None and check.failed else set()
            # A layer the recompute check refused while measured: its saved
            # tensors, held by the check, were not counted; nor were those
            # of a layer run selective (torch's checkpoint takes them).
            plan = executor.plan
            if plan is not None:
                unseen |= {
                    i for i, layer in enumerate(plan.layers) if "selective" in layer.techniques
                }
            if unseen:
                profile = _planning.merged(first.profile, profile, unseen)
            # Real steps record no op profile: the fake pass's stays.
            profile = _planning.with_selective_profiles(profile, first.profile)
            try:
                plan = self.install(profile, first.offsets, apply=False, again=True)
            except BaseException:
                self._leave()
                raise
            _telemetry.plan_built(executor, plan, self.model)
            return plan

        self._measure(
            profiler,
            on_profiled,
            "memscale: measuring %d training forward passes for real under "
            "this plan (Config.use_static_profiling=False), then planning "
            "again from what they measured",
        )
        executor.__dict__["_warmup_flops"] = flops  # dropped by detach

    def plan_after_warmup(self) -> None:
        """Measure the first ``warmup_steps`` training forwards for real
        (they run unoptimized), then run the pipeline from what they
        measured."""
        executor, config, hardware = self.attached, self.config, self.hardware
        executor.profiling = "warmup"
        if executor.decision is None:
            if not policy.needs_profile(config, hardware):
                _stage1(executor, config, hardware, None, self.fixed)
            else:
                policy.requested_policy()  # a bad MEMSCALE_POLICY fails now
        profiler = _planning.new_warmup_profiler(self.model, self.units)

        def on_profiled(prof: Any) -> Any:
            warm = _planning.profile_from(prof, self.units, "warmup")
            plan = self.install(warm, apply=False)
            _telemetry.plan_built(executor, plan, self.model)
            return plan

        self._measure(
            profiler,
            on_profiled,
            "memscale: profiling the first %d training forward passes for "
            "real (they run unoptimized), then planning",
        )

    def _measure(self, profiler: Any, on_profiled: Any, message: str) -> None:
        """Measure the next ``warmup_steps`` training forwards with
        ``profiler``, then call ``on_profiled``; ``message`` (with the step
        count) says so in the log."""
        config = self.config
        try:
            self.attached.start_profiling(profiler, on_profiled)
        except BaseException:
            profiler.detach()
            raise
        logger.log(
            logging.INFO if config.enable_logging else logging.DEBUG,
            message,
            config.warmup_steps,
        )

    def undo(self) -> None:
        """An error inside ``wrap``: detach what :meth:`attach` made."""
        executor = self.executor
        if executor is None:
            return
        if not executor.has_python_state:
            executor.init_python_state(self.config, self.hardware, "failed")
        executor.detach()

    # -- after the plan is made or scheduled ---------------------------------

    def finish(self) -> None:
        """The correctness checker (``verify_correctness``), the copy
        handling, and the executor on the model."""
        executor = self.attached
        if self.config.verify_correctness:
            from . import _verify

            _verify.attach(self.model, executor)
        executor.on_detach(_copying.install(self.model, executor))
        self.model.__dict__[ATTR] = executor


def _refuse_fp16_scaler(executor: Executor) -> None:
    """``optimizer_in_backward`` with FP16 autocast: a clear error at wrap."""
    autocast = executor.autocast
    if autocast is not None and autocast[1] is torch.float16:
        raise ValueError(
            "memscale: Config.optimizer_in_backward cannot be combined with "
            "FP16 mixed precision on this device: a GradScaler must see every "
            "gradient (to unscale it and skip the step on an overflow) before "
            "any parameter is updated. Use a device with BF16, or "
            "use_mixed_precision=False"
        )
