"""The entry points for a model: wrap, optimize, detach,
apply_all_optimizations (``memscale.wrap`` and ``memscale.detach`` take a
Hugging Face Trainer too: :mod:`memscale._entry`).

``wrap`` profiles the model (up front with ``sample_input``, otherwise
inside the first training forward, from its own inputs, before it runs),
runs the decision engine and attaches the executor's hooks.  Everything it changes is undone
by ``detach``; an error inside ``wrap`` undoes what was done so far.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Iterator
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
    _telemetry,
    _tiling,
    _torch_compat,
    amp,
    observability,
    optim,
    policy,
)
from ._executor import Executor
from ._format import format_bytes, plan_table
from ._hardware import Hardware
from ._solve import PlanProblem
from .config import GIB, AsyncOffloadConfig, Config, OptimizationMode

logger = logging.getLogger(__name__)

ATTR = "_memscale_executor"


def effective_config(
    config: Config | None, async_offload: bool | None, async_config: AsyncOffloadConfig | None
) -> Config:
    """The Config ``wrap`` works with: ``config`` (``Config()`` when None)
    with the ``async_offload`` and ``async_config`` arguments, or else
    ``$MEMSCALE_ASYNC_OFFLOAD``, applied."""
    if config is None:
        config = Config()
    elif not isinstance(config, Config):
        raise TypeError(f"config must be a memscale.Config or None, got {type(config).__name__}")
    changes: dict[str, Any] = {}
    if async_offload is not None:
        if not isinstance(async_offload, bool):
            raise TypeError(f"async_offload must be True, False or None, got {async_offload!r}")
        changes["async_offload"] = async_offload
    else:
        env = os.environ.get("MEMSCALE_ASYNC_OFFLOAD")
        if env is not None:
            if env not in ("0", "1"):
                raise ValueError(f"MEMSCALE_ASYNC_OFFLOAD must be '0' or '1', got {env!r}")
            changes["async_offload"] = env == "1"
    if async_config is not None:
        changes["async_config"] = async_config
    return config.replace(**changes) if changes else config


def _warn_8bit_without_optimizer(config: Config, optimizer: Any) -> None:
    """use_8bit_optimizer replaces the optimizer wrap() is given (see wrap());
    without one there is nothing to replace: say so."""
    if config.use_8bit_optimizer and optimizer is None:
        logger.warning(
            "memscale: Config.use_8bit_optimizer is set, but wrap() is "
            "given no optimizer to replace; build yours with "
            "memscale.optim.make_8bit_adamw(model.parameters(), lr=...), "
            "or let memscale.apply_all_optimizations(model, optimizer) "
            "replace it"
        )


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
    if not plan.technique_counts["checkpoint"]:
        return
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


def _profile_sample(
    model: torch.nn.Module,
    units: list[tuple[str, torch.nn.Module]],
    sample_input: Any,
    config: Config,
    hardware: Hardware,
    optimizer: torch.optim.Optimizer | None,
    fixed: int,
) -> _Upfront:
    """Profile ``model`` on ``sample_input`` (fake tensors first, a real
    forward as fallback, per the Config) and ask the OOM predictor for its
    corrections."""
    with amp.profiling_context(config, hardware):
        profile = _planning.profile_upfront(model, units, sample_input, config)
        # Plan from the OOM predictor's peaks (simulated steps on fake
        # tensors), so that the plan and predict_peak() agree.  Stage 1
        # first (it is recorded on the executor later): the plan the
        # corrections are calibrated on is the one wrap() makes.
        _, early_config = policy.select_strategy(
            config,
            policy.StrategyContext.build(
                config, hardware, profile if policy.needs_profile(config, hardware) else None, fixed
            ),
        )
        offsets = _planner.predicted_offsets(
            model, sample_input, optimizer, profile, early_config, hardware, fixed
        )
        # No plan fits: the least budget, checked by simulating there.
        least = _planner.verified_least_budget(
            model, sample_input, optimizer, profile, early_config, hardware, fixed, offsets
        )
    return _Upfront(profile, offsets, least)


def _apply_sample_plan(
    model: torch.nn.Module,
    executor: Executor,
    units: list[tuple[str, torch.nn.Module]],
    config: Config,
    hardware: Hardware,
    fixed: int,
    optimizer: torch.optim.Optimizer | None,
    upfront: _Upfront,
) -> Any:
    """Stage 1, the plan (one for every rank), its log line and budget
    check, then the techniques attached and the plan applied."""
    profile, offsets, least = upfront
    executor.profile = profile
    executor.profiling = profile.method
    plan_config = _stage1(executor, config, hardware, profile, fixed)
    problem = _planning.plan_problem(
        profile,
        _planner.fallback_config(plan_config, offsets[2]),
        hardware,
        fixed,
        peak_offset=offsets[0],
        plan_offset=offsets[1],
    )
    plan = _distributed.shared_plan(problem)
    _log_plan(config, hardware, plan, executor.decision)
    _budget.check(plan, problem, plan_config, _model.optimizer_state_bytes(model, optimizer), least)
    _offload.attach(executor, plan_config, plan)
    _tiling.install(executor, units, plan)
    executor.apply(plan)
    _after_plan(model, executor, plan, problem)
    return plan


def _first_step_planning(model: torch.nn.Module, config: Config) -> bool:
    """Whether the first training forward's inputs can be profiled on fake
    tensors (the default); otherwise the first ``warmup_steps`` forwards
    are measured for real (``use_static_profiling=False``, or a model that
    fake tensors cannot run, such as one sharded with FSDP2)."""
    return config.use_static_profiling and _planning.static_profiling_supported(model) is None


def _plan_on_first_forward(
    model: torch.nn.Module,
    executor: Executor,
    units: list[tuple[str, torch.nn.Module]],
    config: Config,
    hardware: Hardware,
    fixed: int,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """No ``sample_input``: plan inside the first training forward, from its
    own inputs, before it runs (see ``memscale._firststep``).  If they
    cannot be profiled on fake tensors, that forward and the next
    ``warmup_steps - 1`` are measured instead (``use_empirical_fallback``)."""
    if policy.needs_profile(config, hardware):
        policy.requested_policy()  # a bad MEMSCALE_POLICY fails now
    static_only = config.replace(use_empirical_fallback=False)

    def plan(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            # Profiled as an unwrapped model (the OOM predictor refuses a
            # wrapped one): our hooks are paused, the attribute set aside.
            wrapped = model.__dict__.pop(ATTR, None)
            try:
                with executor.paused():
                    upfront = _profile_sample(
                        module,
                        units,
                        _model.Inputs(args, kwargs),
                        static_only,
                        hardware,
                        optimizer,
                        fixed,
                    )
            except RuntimeError as exc:
                if not config.use_empirical_fallback:
                    raise
                upfront = None
                logger.info(
                    "memscale: the first training forward could not be "
                    "profiled on fake tensors (%s); measuring the first %d "
                    "training forwards instead",
                    exc,
                    config.warmup_steps,
                )
            finally:
                if wrapped is not None:
                    model.__dict__[ATTR] = wrapped
            if upfront is None:
                _plan_after_warmup(model, executor, units, config, hardware, fixed, optimizer)
                return
            plan_made = _apply_sample_plan(
                model, executor, units, config, hardware, fixed, optimizer, upfront
            )
        except BaseException:
            # Leave nothing attached: the model runs as if never wrapped.
            if model.__dict__.get(ATTR) is executor:
                del model.__dict__[ATTR]
            executor.detach()
            raise
        _telemetry.plan_built(executor, plan_made, model)

    logger.debug(
        "memscale: no sample_input; the plan is made on the first training "
        "forward, from its inputs, before that forward runs"
    )
    names = [name for name, _ in units]
    first = _firststep.FirstForward(_firststep.chain(model, names), plan, executor.is_paused)
    executor.on_detach(first.remove)

    def measure_instead() -> None:
        first.remove()
        _plan_after_warmup(model, executor, units, config, hardware, fixed, optimizer)

    executor.await_first_forward(first, measure_instead)


def _plan_after_warmup(
    model: torch.nn.Module,
    executor: Executor,
    units: list[tuple[str, torch.nn.Module]],
    config: Config,
    hardware: Hardware,
    fixed: int,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Measure the first ``warmup_steps`` training forwards for real, then
    plan (they run unoptimized)."""
    executor.profiling = "warmup"
    if executor.decision is None:
        if not policy.needs_profile(config, hardware):
            _stage1(executor, config, hardware, None, fixed)
        else:
            policy.requested_policy()  # a bad MEMSCALE_POLICY fails now
    profiler = _planning.new_warmup_profiler(model, units)

    def on_profiled(prof: Any) -> Any:
        warm = _planning.profile_from(prof, units, "warmup")
        executor.profile = warm
        plan_config = (
            executor.config
            if executor.decision is not None
            else _stage1(executor, config, hardware, warm, fixed)
        )
        problem = _planning.plan_problem(warm, plan_config, hardware, fixed)
        plan = _distributed.shared_plan(problem)
        _log_plan(config, hardware, plan, executor.decision)
        _budget.check(plan, problem, plan_config, _model.optimizer_state_bytes(model, optimizer))
        _offload.attach(executor, plan_config, plan)
        _tiling.install(executor, units, plan)
        executor.plan_applied(plan)
        _after_plan(model, executor, plan, problem)
        _telemetry.plan_built(executor, plan, model)
        return plan

    try:
        executor.start_profiling(profiler, on_profiled)
    except BaseException:
        profiler.detach()
        raise
    logger.log(
        logging.INFO if config.enable_logging else logging.DEBUG,
        "memscale: profiling the first %d training forward passes for "
        "real (they run unoptimized), then planning",
        config.warmup_steps,
    )


def wrap(
    target: Any,
    config: Config | None = None,
    sample_input: Any = None,
    async_offload: bool | None = None,
    async_config: AsyncOffloadConfig | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> Any:
    """Attach memscale to the model ``target`` and return it: what
    ``memscale.wrap`` does with a model (see :func:`memscale._entry.wrap`)."""
    if not isinstance(target, torch.nn.Module):
        raise TypeError(
            "memscale.wrap() needs a torch.nn.Module (or a Hugging "
            f"Face Trainer), got {type(target).__name__}"
        )
    # torch.compile(model) then wrap: the compiled module is wrapped, and
    # the user's compiled object, which calls it, keeps working (the plan
    # is then carried out inside its graph: memscale._compiled).
    model = _torch_compat.compiled_inner(target) or target
    if model.__dict__.get(ATTR) is not None:
        raise RuntimeError(
            "this model is already wrapped by memscale; call "
            "memscale.detach(model) before wrapping it again"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    config = effective_config(config, async_offload, async_config)
    _warn_8bit_without_optimizer(config, optimizer)
    given_optimizer = optimizer
    if optimizer is not None and config.use_8bit_optimizer and not optim.is_8bit(optimizer):
        optimizer = optim.to_8bit(optimizer)  # ValueError says why not
        logger.info(
            "memscale: replaced %s with an 8-bit AdamW (same parameter "
            "groups and hyper-parameters); train with "
            "model._memscale_executor.optimizer",
            type(given_optimizer).__name__,
        )

    device = _model.model_device(model)
    if config.memory_budget_gb is not None and device.type not in ("cpu", "cuda"):
        hardware = _hardware.assumed(device.type, 0, int(config.memory_budget_gb * GIB))
    else:
        hardware = _hardware.detect(device.type, device.index or 0)
    units = _core.find_units(model)
    fixed = _model.fixed_bytes(model, optimizer)  # FSDP2: the local shards
    if _distributed.is_fsdp2(model):
        fixed += _distributed.fsdp2_in_flight_bytes(model)

    # Profile before any hook of ours exists, so that the profiling pass
    # is not seen (or counted) as a training forward.
    upfront = None
    if sample_input is not None:
        upfront = _profile_sample(model, units, sample_input, config, hardware, optimizer, fixed)
    executor = Executor(model, units, warmup_steps=config.warmup_steps)
    try:
        method = (
            upfront.profile.method
            if upfront is not None
            else "first_step"
            if _first_step_planning(model, config)
            else "warmup"
        )
        executor.init_python_state(config, hardware, method)
        executor.optimizer = optimizer
        executor.units = units
        _compiled.install(executor, units)  # before any other forward of ours
        executor.count_steps(optimizer)
        executor.on_detach(observability.attach_logging(config))
        executor.on_detach(
            _torch_compat.install_call_guard(model, _abandoner(weakref.ref(executor)))
        )
        amp.attach(executor, model, config, hardware)
        if config.observability_port is not None:
            executor.metrics_server = observability.start_metrics_server(
                executor, config.observability_port
            )
            executor.on_detach(executor.metrics_server.close)
        if upfront is not None:
            _apply_sample_plan(model, executor, units, config, hardware, fixed, optimizer, upfront)
        elif _first_step_planning(model, config):
            _plan_on_first_forward(model, executor, units, config, hardware, fixed, optimizer)
        else:
            _plan_after_warmup(model, executor, units, config, hardware, fixed, optimizer)
        if config.verify_correctness:
            from . import _verify

            _verify.attach(model, executor)
        executor.on_detach(_copying.install(model, executor))
        model.__dict__[ATTR] = executor
    except BaseException:
        if not executor.has_python_state:
            executor.init_python_state(config, hardware, "failed")
        executor.detach()
        raise
    _telemetry.wrap_called(model, executor)  # never raises
    return target


def detach(model: Any) -> bool:
    """Remove everything ``wrap`` attached to ``model`` and delete
    ``model._memscale_executor``; False, with nothing done, when the model
    is not wrapped.  ``memscale.detach`` (:func:`memscale._entry.detach`)
    warns then, and takes a Trainer too.  A ``torch.compile`` wrapper is
    looked through: the module it compiles is detached (the compiled code
    recompiles at its next call, without memscale)."""
    model = _torch_compat.compiled_inner(model) or model
    executor = getattr(model, "__dict__", {}).get(ATTR)
    if executor is None:
        return False
    try:
        executor.detach()
    finally:
        del model.__dict__[ATTR]
    return True


@contextlib.contextmanager
def optimize(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: Config | None = None,
    sample_input: Any = None,
) -> Iterator[Executor]:
    """Wrap ``model`` for the duration of a ``with`` block; yields the
    executor and detaches on exit, also when the block raises.  With
    ``Config(use_8bit_optimizer=True)``, ``optimizer`` is replaced by its
    8-bit counterpart, ``executor.optimizer``: train with that one."""
    wrap(model, config, sample_input, optimizer=optimizer)
    try:
        yield (_torch_compat.compiled_inner(model) or model).__dict__[ATTR]
    finally:
        detach(model)


def apply_all_optimizations(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    config: Config | None = None,
    sample_input: Any = None,
) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
    """The full stack at once; returns ``(model, optimizer)``.

    ``model`` is wrapped with checkpointing and offload on every eligible
    layer (BALANCED, ``force_optimize=True``, unless ``config`` says
    otherwise) and BF16 mixed precision (FP16 where BF16 is unsupported:
    then use ``memscale.amp.grad_scaler(model)``).  An Adam or AdamW
    ``optimizer`` is replaced by an 8-bit AdamW with the same parameter
    groups and hyper-parameters, returned in its place: train with the
    returned one (and rebuild a learning-rate scheduler on it).  An
    optimizer that cannot be replaced faithfully (not Adam-family, Adam's
    L2 weight decay, amsgrad, already stepped) is kept, and the log says
    why.  ``memscale.detach(model)`` undoes the model's part.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"apply_all_optimizations() needs a torch.nn.Module, got {type(model).__name__}"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    if config is None:
        config = Config(mode=OptimizationMode.BALANCED, force_optimize=True)
    elif not isinstance(config, Config):
        raise TypeError(f"config must be a memscale.Config or None, got {type(config).__name__}")
    replace = optimizer is not None and not optim.is_8bit(optimizer)
    if optimizer is not None and replace:
        why = optim.unsupported_reason(optimizer)
        if why is not None:
            logger.warning("memscale: apply_all_optimizations keeps the given optimizer: %s", why)
            replace = False
    config = config.replace(
        use_mixed_precision=True,
        use_8bit_optimizer=replace or (optimizer is not None and optim.is_8bit(optimizer)),
    )
    wrap(model, config, sample_input, optimizer=optimizer)
    return model, (_torch_compat.compiled_inner(model) or model).__dict__[ATTR].optimizer
