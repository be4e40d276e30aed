"""Measure -> plan -> verify: the engine plans from the OOM predictor's
simulated steps.  The one owner of that loop.

The engine's memory model (``csrc/memory.c``) estimates a step's peak
from the profile (``_planning``); the predictor (:mod:`memscale.predictor`)
simulates the step on fake tensors.  :class:`PredictionSession` holds one
simulation open and calibrates the engine on it
(:meth:`PredictionSession.plan_offsets`): the unoptimized peak's
correction, then the memory model's terms per layer (:func:`calibrate`,
from the unoptimized step and the step with every layer checkpointed
alone), and one simulation of the plan made with them to verify it.
``wrap`` plans with those (:func:`predicted_offsets`) and, when no plan
fits, reports the least budget verified the same way
(:func:`verified_least_budget`); :func:`predict_peak` and
:func:`estimate_savings` report them.

This module imports ``_planning`` (profiles and engine inputs) and the
predictor (the simulation); neither of them imports it, nor each other.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from . import _core, _model, _planning, policy, predictor
from ._format import format_bytes
from ._hardware import Hardware
from ._planning import Profile
from ._solve import PlanProblem, layer_stats, solve
from .config import GIB, Config, OptimizationMode
from .predictor import PeakPrediction, SavingsEstimate

logger = logging.getLogger(__name__)

__all__ = [
    "Offsets",
    "PredictionSession",
    "estimate_savings",
    "fallback_config",
    "least_budget",
    "make_plan",
    "predict_peak",
    "predicted_offsets",
    "verified_least_budget",
]


def _size(n: float) -> str:
    return format_bytes(n, digits=1)


def make_plan(
    profile: Profile,
    config: Config,
    hardware: Hardware,
    fixed: int,
    peak_offset: int = 0,
    plan_offset: int | None = None,
) -> _core.Plan:
    """The engine's plan.  ``peak_offset`` and ``plan_offset`` are the OOM
    predictor's corrections of the engine's unoptimized peak and of its
    plans' peaks (see :meth:`PredictionSession.plan_offsets`)."""
    return solve(_planning.plan_problem(profile, config, hardware, fixed, peak_offset, plan_offset))


def least_budget(problem: PlanProblem) -> int:
    """The planner's smallest feasible budget for ``problem`` (a budget of
    1 byte makes every plan infeasible, so the planner reports its
    minimum)."""
    plan = solve(problem.replace(budget_bytes=1, force=False))
    if plan.min_budget_bytes >= 0:
        return int(plan.min_budget_bytes)
    return int(plan.peak_projected_bytes)


def fallback_config(config: Config, fallback: bool | None) -> Config:
    """The Config the plan is made with: ``config``, or, when the planner's
    plans did not fit when simulated, every layer checkpointed alone."""
    if not fallback:
        return config
    return config.replace(
        force_optimize=True, mode=OptimizationMode.CONSERVATIVE, enable_tiling=False
    )


def _read_profile(profiler: Any, units: list[tuple[str, nn.Module]], ops: Any = None) -> Profile:
    """The simulation's warm-up forward, measured as static profiling
    measures one (the same profile, so the same plan as ``wrap``)."""
    return _planning.profile_from(profiler, units, "static", ops=ops)


def _verifiable(plan: Any, forced: Any) -> bool:
    """Whether simulating ``plan`` tells something new: it fits, it
    checkpoints or runs layers selective, no layer is tiled (the
    simulation runs tiled layers whole) and it is not every layer
    checkpointed alone (simulated)."""
    counts = plan.technique_counts
    return bool(
        plan.fits
        and (counts["checkpoint"] or counts.get("selective", 0))
        and not counts["tiling"]
        and not _same_choices(plan, forced)
    )


def _same_choices(a: Any, b: Any) -> bool:
    return [(x.techniques, x.segment, x.nested, x.tiles) for x in a.layers] == [
        (y.techniques, y.segment, y.nested, y.tiles) for y in b.layers
    ]


def _layer_key(layer: Any) -> tuple[Any, ...]:
    """Layers with the same key are taken to be the same shape: the same
    class, saved and input bytes and FLOPs."""
    return (layer.kind, layer.saved_bytes, layer.input_bytes, layer.flops)


def _per_shape(layers: Any, measured: dict[int, int]) -> dict[tuple[Any, ...], int]:
    """The largest figure measured per distinct layer shape."""
    out: dict[tuple[Any, ...], int] = {}
    for i, value in measured.items():
        key = _layer_key(layers[i])
        out[key] = max(out.get(key, value), value)
    return out


def calibrate(
    profile: Profile,
    base: Any,
    kept: dict[int, int],
    alone: dict[int, int],
    forced: Any,
    peaks: dict[int, int],
    frame: int = 0,
) -> tuple[int, Profile]:
    """The per-layer terms of the memory model, measured on two simulated
    steps: the unoptimized one and the one with every layer checkpointed
    alone (``forced``).  The first two per distinct layer shape
    (:func:`_layer_key`): the largest figure over its layers.  The third per
    layer (it depends on where the layer sits), its shape's largest for a
    layer not measured:

    * ``saved_bytes``: what the layer's forward leaves alive when kept
      (``kept[i]``: its saved tensors and its output; its input is the
      previous layer's);
    * ``input_bytes``: the same when checkpointed alone (``alone[i]``:
      what the next layer's checkpoint keeps);
    * ``backward_bytes``: what its recompute and backward need beyond
      those and what is held before it (``peaks[i]``, the peak from where
      backward reaches layer i to where it reaches the one before it, less
      the model's figure of that moment: what is alive throughout, i.e. the
      engine's unoptimized peak less the layers' saved bytes, what the
      layers before i hold and layer i's saved bytes).

    A layer checkpointed alone also holds its checkpoint's RNG state,
    ``frame`` bytes, which the simulation's stand-in makes outside the
    layer's forward: counted as the engine counts them for the plans made
    with these terms (``_planning.frame_bytes``: added to what each segment
    stores; none under ``force_optimize``, whose plans leave them out and
    get them in the common correction).

    Returns the common part of the last (the least excess, the plans'
    correction; it may be negative) and the profile with the terms; a
    layer of a shape never measured keeps the profiler's figures."""
    layers = profile.layers
    kept_of, alone_of = _per_shape(layers, kept), _per_shape(layers, alone)
    saved = [max(0, kept_of.get(_layer_key(x), int(x.saved_bytes))) for x in layers]
    stored = [max(0, alone_of.get(_layer_key(x), int(x.input_bytes))) for x in layers]
    engine_base = int(base.peak_unoptimized_bytes) - sum(saved)
    excess: dict[int, int] = {}
    held = 0
    for i, chosen in enumerate(forced.layers):
        if i in peaks:
            excess[i] = peaks[i] - (engine_base + held + saved[i])
        alone_here = chosen.techniques and chosen.segment == i
        held += stored[i] + frame if alone_here else saved[i]
    # A layer's own excess where it was measured (it depends on where the
    # layer sits: what is in flight when backward reaches it); else its
    # shape's largest.
    excess_of = _per_shape(layers, excess)
    common = min(excess.values()) if excess else 0
    new = tuple(
        layer_stats(
            (x.name, x.kind, x.param_bytes, saved[i], stored[i], x.flops, x.flags),
            x,
            backward_bytes=excess.get(i, excess_of.get(_layer_key(x), common)) - common,
        )
        for i, x in enumerate(layers)
    )
    return common, dataclasses.replace(profile, layers=new)


class PredictionSession:
    """Predictions for one model and batch under several Configs.

    Entering it simulates the warm-up and the unoptimized step once; each
    :meth:`predict` then makes the plan ``wrap`` would make with that
    Config and simulates the step under it (once per distinct plan).  The
    model's parameters and buffers are fake while the session is open, so
    use it only as ``with PredictionSession(...) as session:`` around
    ``session.predict(...)`` calls (the AutoTuner does).
    """

    def __init__(
        self,
        model: nn.Module,
        sample_input: Any,
        optimizer: torch.optim.Optimizer | None = None,
        device: Any = None,
        *,
        loss_fn: Callable[[Any], Any] | None = None,
        config: Config | None = None,
    ) -> None:
        self._start = time.perf_counter()
        config = _check_args(model, sample_input, config, optimizer, loss_fn, "predict_peak")
        self.model = model
        self.optimizer = optimizer
        # Where the steps simulated keep gradients and optimizer state (the
        # Config's below-the-floor options, the same for every prediction).
        self.floor = _model.floor_of(config)
        self.hardware, self.sim_device = predictor.resolve_device(model, device, config)
        self._steps = predictor.SimulationSession(
            model,
            sample_input,
            optimizer,
            self.hardware,
            self.sim_device,
            loss_fn=loss_fn,
            read_profile=_read_profile,
            floor=self.floor,
        )
        # Configs whose plan is every layer checkpointed alone, because the
        # planner's did not fit when simulated (see plan_offsets).
        self._fallback: dict[Config, bool] = {}
        # Per Config, the profile with the per-layer terms (plan_offsets).
        self._profiles: dict[Config, Profile] = {}
        # Per Config that no plan fits, the least budget (plan_offsets).
        self._least: dict[Config, int] = {}
        # The simulated peak of every layer checkpointed alone (the last
        # plan_offsets computed it), or None.
        self.forced_peak: int | None = None

    def __enter__(self) -> PredictionSession:
        self._steps.__enter__()
        self._setup_seconds = time.perf_counter() - self._start
        return self

    def __exit__(self, *exc: Any) -> None:
        self._steps.__exit__(*exc)

    def _fixed(self) -> int:
        """What the engine holds all step long: the model's and the
        optimizer's tensors, and the libraries' workspaces on the device
        (as wrap() counts them: _wrapping._Pipeline)."""
        fixed = _model.fixed_bytes(self.model, self.optimizer, self.floor)
        return fixed + self._steps.library_bytes

    def plan(self, config: Config) -> Any:
        """The plan wrap() makes with ``config``: the same profile (the
        warm-up's forward on fake tensors), the same Stage 1 (the strategy
        policy, when ``auto_policy`` is on) and the same engine inputs."""
        fixed = self._fixed()
        profile = self._steps.profile
        if config.auto_policy:
            context = policy.StrategyContext.build(
                config,
                self.hardware,
                profile if policy.needs_profile(config, self.hardware) else None,
                fixed,
            )
            _, config = policy.select_strategy(config, context)
        # The engine plans from the predicted peaks (as wrap() does with
        # sample_input): the same corrections, the same plan.
        offset, plan_offset = self.plan_offsets(config, profile, fixed)
        return make_plan(
            self.calibrated_profile(config),
            fallback_config(config, self._fallback.get(config)),
            self.hardware,
            fixed,
            peak_offset=offset,
            plan_offset=plan_offset,
        )

    def plan_offsets(
        self, config: Config, profile: Any = None, fixed: int | None = None
    ) -> tuple[int, int]:
        """The engine's two corrections for ``config`` (its effective,
        post-Stage-1 form): of the unoptimized peak (predicted minus the
        engine's), and of its plans' recompute terms; the per-layer terms
        that go with the second are in :meth:`calibrated_profile`.

        When the budget planner has to checkpoint, the memory model is
        calibrated per layer on ONE simulated step, every layer
        checkpointed alone (:func:`layer_backward_bytes`): what each
        layer's recompute and backward need beyond its saved tensors and
        what is held before it.  The planner plans with those terms, and
        its plan is simulated once to verify it fits; when it does not
        (the engine's model is short elsewhere), every layer checkpointed
        alone, which was simulated, is the plan if it fits.  Smart-skipped
        and forced plans keep the one correction and no simulation."""
        if profile is None:
            profile = self._steps.profile
        if fixed is None:
            fixed = self._fixed()
        hw = self.hardware
        base = make_plan(profile, config, hw, fixed)
        offset = self.unoptimized_peak() - base.peak_unoptimized_bytes
        plan = make_plan(profile, config, hw, fixed, peak_offset=offset)
        self._fallback.pop(config, None)
        self._least.pop(config, None)
        self._profiles[config] = profile
        if (
            plan.skipped
            # A forced plan is calibrated only when it tiles: the tiles are
            # doubled while the projected peak falls, and the unoptimized
            # correction on every recompute term (which carries what the
            # start of backward holds, such as the loss's gradient) would
            # make tiles look useful where the measured peak is elsewhere.
            or (config.force_optimize and not plan.technique_counts["tiling"])
            or (
                not (plan.technique_counts["checkpoint"] or plan.technique_counts["selective"])
                and plan.fits
            )
        ):
            return offset, offset
        forced = make_plan(profile, fallback_config(config, True), hw, fixed, peak_offset=offset)
        if not forced.technique_counts["checkpoint"]:
            return offset, offset
        forced_peak = self._steps.simulated_peak(forced, config)
        self.forced_peak = forced_peak
        plan_offset, profile = calibrate(
            profile,
            base,
            self._steps.forward_holds(),
            self._steps.forward_holds(forced, config),
            forced,
            self._steps.recompute_peaks(forced, config),
            _planning.frame_bytes(config, hw),
        )
        self._profiles[config] = profile
        plan = make_plan(profile, config, hw, fixed, peak_offset=offset, plan_offset=plan_offset)
        budget = _planning.budget_bytes(config, hw)
        if _verifiable(plan, forced):
            # The one verification.  (The simulation runs tiled layers
            # whole, so a tiled plan is not simulated.)
            miss = self._steps.simulated_peak(plan, config) - plan.peak_projected_bytes
            if plan.peak_projected_bytes + miss > budget:
                if forced_peak <= budget:
                    # The planner's plan did not fit when simulated, but
                    # every layer checkpointed alone does: that plan, then.
                    self._fallback[config] = True
                else:
                    plan_offset += max(miss, 1)
        elif not plan.fits and plan.min_budget_bytes >= 0:
            self._least[config] = self._verified_least(
                config, profile, fixed, offset, plan_offset, int(plan.min_budget_bytes), forced
            )
        return offset, plan_offset

    def _verified_least(
        self,
        config: Config,
        profile: Profile,
        fixed: int,
        offset: int,
        plan_offset: int,
        least: int,
        forced: Any,
    ) -> int:
        """No plan fits ``config``'s budget: the least budget the planner
        reaches with the per-layer terms, checked by simulating its plan
        there once (the one verification).  When that plan needs more than
        the model says (the memory model leaves out what every frame keeps
        alive once per step, such as a position-ids tensor all layers are
        given, docs/planning.md), its simulated peak is the least budget,
        if the planner makes the same plan at that budget (then ``wrap``
        there makes it, simulates it at that peak and keeps it); else the
        simulated peak of every layer checkpointed alone.  Never above the
        unoptimized step's simulated peak (at that budget the model is left
        alone)."""
        assert self.forced_peak is not None
        known = min(self.forced_peak, self.unoptimized_peak())
        if least >= known:
            return known
        at = config.replace(memory_budget_gb=(least + 1) / GIB)
        there = make_plan(profile, at, self.hardware, fixed, offset, plan_offset)
        if not _verifiable(there, forced):
            return least
        peak = self._steps.simulated_peak(there, at)
        if peak <= _planning.budget_bytes(at, self.hardware):
            return least
        if peak < known:
            at = config.replace(memory_budget_gb=peak / GIB)  # exact: GIB is 2**30
            again = make_plan(profile, at, self.hardware, fixed, offset, plan_offset)
            if _same_choices(again, there) and peak <= _planning.budget_bytes(at, self.hardware):
                return peak
        return known

    def least_budget(self, config: Config) -> int | None:
        """The least budget :meth:`plan_offsets` verified for ``config`` when
        no plan fits it (None otherwise)."""
        return self._least.get(config)

    @property
    def profile(self) -> Profile:
        """The simulation's warm-up forward, measured as static profiling
        measures one."""
        return self._steps.profile

    def calibrated_profile(self, config: Config) -> Profile:
        """The profile the plan for ``config`` is made from: the warm-up's,
        with the per-layer terms :meth:`plan_offsets` measured."""
        return self._profiles.get(config, self._steps.profile)

    def falls_back(self, config: Config) -> bool:
        """Whether :meth:`plan_offsets` found, for ``config``, that the
        planner's plans need more than the budget when simulated while
        every layer checkpointed alone fits: the plan is then made with
        :func:`fallback_config`."""
        return bool(self._fallback.get(config))

    def unoptimized_peak(self) -> int:
        """The predicted peak bytes of the unoptimized step."""
        if not self._steps.is_open:
            raise RuntimeError(
                "PredictionSession.unoptimized_peak() runs inside "
                "'with PredictionSession(...) as session:'"
            )
        return self._steps.unoptimized_peak()

    def predict(self, config: Config | None = None) -> PeakPrediction:
        if not self._steps.is_open:
            raise RuntimeError(
                "PredictionSession.predict() runs inside 'with PredictionSession(...) as session:'"
            )
        t0 = time.perf_counter()
        if config is None:
            config = Config()
        elif not isinstance(config, Config):
            raise TypeError(
                f"config must be a memscale.Config or None, got {type(config).__name__}"
            )
        plan = self.plan(config)
        steps = self._steps
        unoptimized, optimized, unprobed = steps.breakdowns(plan, config)
        libraries = steps.library_bytes
        chosen = tuple(layer.name for layer in plan.layers if layer.techniques)
        result = PeakPrediction(
            unoptimized=unoptimized,
            optimized=optimized,
            first_step=steps.first_step(plan, config),
            device=self.hardware.device,
            device_name=self.hardware.name,
            capacity_bytes=self.hardware.capacity_bytes,
            budget_bytes=_planning.budget_bytes(config, self.hardware),
            simulated_on=self.sim_device.type,
            plan_hash=plan.hash,
            plan_skipped=bool(plan.skipped),
            checkpointed_layers=chosen,
            layer_count=len(plan),
            recompute_ratio=float(plan.recompute_ratio),
            forward_flops=float(steps.profile.total_flops),
            engine_unoptimized_bytes=int(plan.peak_unoptimized_bytes),
            engine_projected_bytes=int(plan.peak_projected_bytes),
            optimizer=steps.optimizer_name,
            optimizer_simulated=steps.optimizer_simulated,
            unprobed_calls=unprobed,
            library_workspace_bytes=libraries,
            seconds=self._setup_seconds + time.perf_counter() - t0,
            plan=plan,
        )
        _report_disagreement(result, plan)
        return result


def _report_disagreement(p: PeakPrediction, plan: Any) -> None:
    """Say so when the engine's decision rests on an estimate the
    simulation contradicts (see PeakPrediction.engine_*_bytes)."""
    if plan.skipped and not p.fits_unoptimized:
        logger.warning(
            "memscale: the decision engine estimates the unoptimized step at %s "
            "and leaves the model alone (smart-skip), but the simulated step "
            "needs %s, over the usable %s. Use force_optimize=True, or the "
            "Config memscale.autotuning.AutoTuner finds",
            _size(p.engine_unoptimized_bytes),
            _size(p.unoptimized.peak_bytes),
            _size(p.budget_bytes),
        )
    elif not plan.skipped and plan.fits and not p.fits:
        logger.warning(
            "memscale: the decision engine projects the planned step at %s, "
            "within the usable %s, but the simulated step needs %s; the "
            "memscale.autotuning.AutoTuner finds a Config whose plan fits",
            _size(p.engine_projected_bytes),
            _size(p.budget_bytes),
            _size(p.optimized.peak_bytes),
        )


def predict_peak(
    model: nn.Module,
    sample_input: Any,
    config: Config | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    device: Any = None,
    *,
    loss_fn: Callable[[Any], Any] | None = None,
) -> PeakPrediction:
    """Predict the peak memory of one training step, without and with
    memscale's plan, on fake tensors: no memory of the step is allocated,
    so a model larger than this machine can be predicted (build it under
    ``torch.device("meta")`` and pass ``device``).

    ``sample_input`` is one batch (a tensor, a tuple of positional inputs or
    a dict of keyword inputs); real or meta tensors.  ``config`` is the
    Config ``wrap`` would get (default ``Config()``); the plan predicted is
    the plan ``wrap(model, config, sample_input, optimizer=optimizer)``
    makes for the model in training mode.  ``optimizer`` is the optimizer
    you train with (its class and settings are rebuilt on fake parameters;
    default AdamW).  ``device`` is None (the model's device, detected), a
    device name, or a :class:`memscale.predictor.DeviceSpec` with its
    capacity.  ``loss_fn`` maps the model's output to the loss (default
    :func:`memscale.predictor.default_loss`).

    The step is ``optimizer.zero_grad(set_to_none=True)``, forward, loss,
    backward, ``optimizer.step()``, in steady state (gradients and
    optimizer state exist when it starts); ``first_step`` is the first
    step after ``wrap`` under the plan (no optimizer state yet, each
    checkpointed layer checked once: its saved tensors held while it runs
    again), and ``fits`` asks both to fit.  The model's parameters, buffers,
    attributes, RNG state and training flags are as before when this
    returns, also when it raises.
    """
    with PredictionSession(
        model, sample_input, optimizer, device, loss_fn=loss_fn, config=config
    ) as session:
        return session.predict(config)


def estimate_savings(
    model: nn.Module,
    sample_input: Any = None,
    config: Config | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    device: Any = None,
    loss_fn: Callable[[Any], Any] | None = None,
) -> SavingsEstimate:
    """Predicted peak memory without and with memscale's plan on the same
    hardware, the bytes saved, and the predicted step-time ratio
    (``1 + recompute FLOPs / (3 x forward FLOPs)``).  Computed by
    :func:`predict_peak` on fake tensors; ``sample_input`` is required.
    Prints as a table; ``to_dict()`` gives the figures."""
    if sample_input is None:
        raise ValueError(
            "estimate_savings() needs sample_input: the estimate simulates one "
            "training step on that batch (on fake tensors, with no memory). "
            "Pass one batch: estimate_savings(model, sample_input=batch)"
        )
    p = predict_peak(model, sample_input, config, optimizer, device, loss_fn=loss_fn)
    unopt, opt = p.unoptimized.peak_bytes, p.optimized.peak_bytes
    return SavingsEstimate(
        peak_unoptimized_bytes=unopt,
        peak_optimized_bytes=opt,
        saved_bytes=unopt - opt,
        saved_fraction=(unopt - opt) / unopt if unopt else 0.0,
        time_ratio=p.time_ratio,
        recompute_ratio=p.recompute_ratio,
        device=p.device,
        capacity_bytes=p.capacity_bytes,
        budget_bytes=p.budget_bytes,
        fits_unoptimized=p.fits_unoptimized,
        fits_optimized=p.fits,
        plan_hash=p.plan_hash,
        checkpointed_layers=len(p.checkpointed_layers),
        layer_count=p.layer_count,
    )


def _check_args(
    model: Any, sample_input: Any, config: Any, optimizer: Any, loss_fn: Any, what: str
) -> Config:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what}() needs a torch.nn.Module, got {type(model).__name__}")
    if sample_input is None:
        raise ValueError(
            f"{what}() needs sample_input (a batch as the model takes it: a "
            "tensor, a tuple of positional inputs or a dict of keyword inputs) "
            "to simulate a training step; it allocates none of its memory"
        )
    _model.split_input(sample_input)  # TypeError for anything else
    if config is None:
        config = Config()
    elif not isinstance(config, Config):
        raise TypeError(f"config must be a memscale.Config or None, got {type(config).__name__}")
    _model.check_step_arguments(optimizer, loss_fn)
    if model.__dict__.get("_memscale_executor") is not None:
        raise RuntimeError(
            f"{what}() predicts for a model memscale has not wrapped (its hooks "
            "would run in the simulation); call it before memscale.wrap(model), "
            "or after memscale.detach(model)"
        )
    return config


# --------------------------------------------------------------------------
# wrap's side: the corrections the engine plans with
# --------------------------------------------------------------------------


class Offsets(NamedTuple):
    """What the OOM predictor tells the engine (see predicted_offsets)."""

    peak: int  # correction of the unoptimized peak
    plan: int  # correction of the plans' recompute terms
    fallback: bool  # plan every layer checkpointed alone instead
    forced_peak: int | None  # simulated peak of that plan, if simulated
    # The profile with the per-layer terms (backward_bytes), or None.
    profile: Profile | None = None
    # No plan fits: the least budget, verified (PredictionSession.least_budget).
    least: int | None = None


def predicted_offsets(
    model: torch.nn.Module,
    sample_input: Any,
    optimizer: torch.optim.Optimizer | None,
    profile: Profile | None,
    config: Config,
    hardware: Hardware,
    fixed: int,
    stage1: Callable[[Profile], Config] | None = None,
    loss_fn: Callable[[Any], Any] | None = None,
) -> Offsets:
    """The OOM predictor's corrections of the engine, for ``wrap``: of its
    unoptimized peak, and of its plans' peaks with the per-layer terms
    (see ``PredictionSession.plan_offsets``), so that a plan and
    ``memscale.predict_peak`` cannot disagree about whether the step fits;
    and whether to fall back to every layer checkpointed alone.

    ``profile`` None: the simulation's warm-up forward is the profile (it
    is measured as static profiling measures one, so ``wrap`` need not run
    that forward again); ``stage1`` then maps it to the Config to plan with
    (default ``config``).  The returned ``profile`` is the one to plan
    from.  (0, 0, False) (logged), with ``profile`` None, when the step
    cannot be simulated.  ``loss_fn``: the loss of the model's output
    (``wrap``'s), else the OOM predictor's default."""
    why_not = _planning.static_profiling_supported(model)
    if why_not is not None:
        logger.info("memscale: no OOM prediction for the engine: %s", why_not)
        return Offsets(0, 0, False, None)
    try:
        with PredictionSession(
            model, sample_input, optimizer, loss_fn=loss_fn, config=config
        ) as session:
            if profile is None:
                profile = session.profile
                if stage1 is not None:
                    config = stage1(profile)
            offsets = session.plan_offsets(config, profile, fixed)
            fallback = session.falls_back(config)
            if fallback:
                logger.info(
                    "memscale: the budget planner's plan needs more than "
                    "the budget when simulated; every layer is "
                    "checkpointed alone instead (that step fits)"
                )
            return Offsets(
                offsets[0],
                offsets[1],
                fallback,
                session.forced_peak,
                session.calibrated_profile(config),
                session.least_budget(config),
            )
    except Exception as exc:  # noqa: BLE001 - the engine's estimate stands
        logger.info(
            "memscale: the OOM predictor could not simulate a "
            "training step (%s: %s); the engine plans from its own "
            "estimate",
            type(exc).__name__,
            exc,
        )
        return Offsets(0, 0, False, None)


def verified_least_budget(
    profile: Profile, config: Config, hardware: Hardware, fixed: int, offsets: Offsets
) -> int | None:
    """When no plan fits ``config``'s budget: the smallest budget the planner
    reaches with the per-layer terms (they do not depend on the budget),
    as the simulation verified it (``offsets.least``), else the planner's
    figure.  None when a plan fits."""
    if offsets.fallback:
        return None  # the fallback plan fits
    plan = make_plan(offsets.profile or profile, config, hardware, fixed, *offsets[:2])
    if plan.fits or plan.skipped or plan.min_budget_bytes < 0:
        return None
    if offsets.least is not None:
        return offsets.least
    least = int(plan.min_budget_bytes)
    known = offsets.forced_peak
    return least if known is None else min(least, known)
