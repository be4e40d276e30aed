"""From a model and a Config to the engine's inputs: profiling runs.

The measuring itself is the C profiler (``memscale._core.Profiler``); this
module decides how to run it (fake tensors first, a real forward as
fallback, or the user's first training steps) and assembles the engine's
problem (``_solve.PlanProblem``).  Planning with it, and with the OOM
predictor's corrections, is :mod:`memscale._planner`'s job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from . import (
    _core,
    _costs,
    _distributed,
    _model,
    _offload,
    _selective,
    _smallvalues,
    _tiling,
    _torch_compat,
    _verify,
)
from ._hardware import Hardware
from ._model import checkpoint_frame_bytes, split_input, tensors_of
from ._solve import OffloadInputs, PlanProblem, SolverInputs, layer_stats
from .config import GIB, Config, OptimizationMode

logger = logging.getLogger(__name__)


# Techniques the executor can carry out in this release.  A technique a mode
# or Config asks for beyond these is reported (never silently dropped).
IMPLEMENTED = _core.TECH_CHECKPOINT | _core.TECH_OFFLOAD | _core.TECH_TILING | _core.TECH_SELECTIVE

TECHNIQUE_BITS = {
    "checkpoint": _core.TECH_CHECKPOINT,
    "offload": _core.TECH_OFFLOAD,
    "tiling": _core.TECH_TILING,
    "selective": _core.TECH_SELECTIVE,
}


@dataclass(frozen=True)
class Profile:
    """What one profiling run measured, in engine units."""

    layers: tuple[_core.LayerStats, ...]
    activation_bytes: int
    total_flops: float
    method: str  # "static", "empirical" or "warmup"
    # Per layer, everything the profiler measured (name, kind, param_bytes,
    # saved_bytes, input_bytes, output_bytes, flops, calls, flags).
    details: tuple[dict[str, Any], ...] = ()


@contextlib.contextmanager
def _preserved_state(model: torch.nn.Module) -> Iterator[None]:
    """Leave RNG and buffers (e.g. BatchNorm statistics) as they were."""
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _measure(
    units: list[tuple[str, torch.nn.Module]], params: list[torch.Tensor], run: Any
) -> tuple[Any, Any]:
    """The C profiler's measurement of ``run()`` and the ops each unit ran
    (``_selective.OpRecorder``, or None)."""
    modules = [m for _, m in units]
    profiler = _core.Profiler(modules, params, _torch_compat.flop_counter())
    profiler.attach()
    ops = _selective.recorder(modules, profiler)
    try:
        profiler.begin_pass()
        ok = False
        try:
            with torch.enable_grad(), ops if ops is not None else contextlib.nullcontext():
                run()
            ok = True
        finally:
            profiler.end_pass(ok=ok)
    finally:
        profiler.detach()
        if ops is not None:
            ops.close()
    return profiler, ops


@contextlib.contextmanager
def fake_pass(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor]]]:
    """The profile's fake pass, set up: inside a FakeTensorMode, with the
    model's parameters and buffers swapped for fake twins (FSDP2's hooks
    off), it yields the inputs faked, their small values real
    (:mod:`memscale._smallvalues`, as in the simulated steps), and the fake
    twins; calls on small real values run for real (the modes entered in
    the block, the profiler's, see each call once).  The model's tensors
    and the RNG streams (a call run for real may draw) are put back."""
    fake = _torch_compat.fake_tensor_mode(allow_non_fake_inputs=True)
    if fake is None:
        raise RuntimeError("fake tensors are not available in this torch")
    mode, convert = fake
    device_type = _model.model_device(model).type
    values = _smallvalues.SmallValues(mode)

    def to_fake(obj: Any) -> Any:
        # Nested too: a batch can be a dict or a tuple of tensors (a
        # Lightning training_step's).
        if isinstance(obj, torch.Tensor):
            return values.real_copy(obj) if values.keeps(obj, device_type) else convert(obj)
        if isinstance(obj, dict):
            return type(obj)((k, to_fake(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(to_fake(v) for v in obj)
        return obj

    rng = _verify.rng_state()
    try:
        with mode, _without_fsdp2_hooks(model), _fake_twins(model, convert) as fakes:
            fargs = tuple(to_fake(a) for a in args)
            fkwargs = {k: to_fake(v) for k, v in kwargs.items()}
            with _smallvalues.SmallValuesMode(values):
                yield fargs, fkwargs, fakes
    finally:
        _verify.set_rng_state(rng)


def _profile_static(model, units, args, kwargs):
    with fake_pass(model, args, kwargs) as (fargs, fkwargs, fakes):

        def run():
            model(*fargs, **fkwargs)

        return _measure(units, fakes, run)


def _is_fsdp2_hook(hook: Any) -> bool:
    """Whether ``hook`` is FSDP2's forward (pre-)hook: a method of its
    ``FSDPState`` (wrapped, for a group of modules sharded together)."""
    owner = getattr(hook, "__self__", None)  # a bound method (decorated or not)
    if owner is None:
        owner = getattr(inspect.unwrap(hook), "__self__", None)
    return (
        owner is not None
        and type(owner).__name__ == "FSDPState"
        and type(owner).__module__.startswith("torch.distributed.fsdp")
    )


@contextlib.contextmanager
def _without_fsdp2_hooks(model: torch.nn.Module) -> Iterator[None]:
    """A model sharded with FSDP2 (``fully_shard``) runs the block without
    FSDP2's forward hooks (the all-gather of a module's parameters before
    its forward, the reshard after it, the backward hooks they register),
    its state untouched: with :func:`_fake_twins` giving each sharded
    parameter an unsharded fake twin, the fake pass runs the model the
    shards stand for.  Nothing to do for another model."""
    saved: list[tuple[torch.nn.Module, str, Any]] = []
    try:
        for module in model.modules():
            if not _distributed.is_fsdp2_module(module):
                continue
            found = False
            for attr in ("_forward_pre_hooks", "_forward_hooks"):
                hooks = module.__dict__[attr]
                keep = type(hooks)((k, h) for k, h in hooks.items() if not _is_fsdp2_hook(h))
                if len(keep) < len(hooks):
                    found = True
                    saved.append((module, attr, hooks))
                    module.__dict__[attr] = keep
            if not found:
                raise RuntimeError(
                    f"memscale cannot find FSDP2's forward hooks on {type(module).__name__} "
                    f"in torch {torch.__version__}, so a fake-tensor pass of the "
                    "unsharded model cannot run"
                )
        yield
    finally:
        for module, attr, hooks in reversed(saved):
            module.__dict__[attr] = hooks


def _unsharded_twin(real: torch.Tensor, convert: Any) -> torch.Tensor:
    """A fake twin of ``real``; of a DTensor (an FSDP2 shard), a plain fake
    tensor of the full shape (made inside the fake mode)."""
    if _distributed.is_dtensor(real):
        return torch.empty(real.shape, dtype=real.dtype, device=real.device)
    return convert(real)


@contextlib.contextmanager
def _fake_twins(model: torch.nn.Module, convert: Any) -> Iterator[list[torch.Tensor]]:
    """Put a fake twin in place of every parameter and buffer of ``model``
    for the length of the block, and the user's own tensor objects back
    after it, also when it raises.

    One twin per distinct tensor object (keyed by ``id``), so that a
    tensor tied into two modules stays tied, and one swap per table entry
    of each distinct module: a module registered at two places is swapped
    (and restored) once.  ``torch.func.functional_call`` swaps by
    qualified name, and with a module reachable under two names it saved
    its own fake twin as the "original" the second time and left it in
    place (issue 20).  Yields the distinct twins.
    """
    twins: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    # A forward may keep a tensor in a plain attribute (a cache, a mask):
    # one made in the fake pass must not outlive it.
    attrs = _model.attributes(model)
    try:
        for module in model.modules():  # each distinct module once
            tables = _torch_compat.module_tensor_tables(module)
            if tables is None:
                raise RuntimeError(
                    "memscale's static profiling swaps a module's parameters "
                    "for fake ones through its parameter tables, which torch "
                    f"{torch.__version__} does not expose"
                )
            for table in tables:
                for name, real in list(table.items()):
                    if real is None:
                        continue
                    twin = twins.get(id(real))
                    if twin is None:
                        twin = _unsharded_twin(real, convert)
                        if isinstance(real, torch.nn.Parameter):
                            twin = torch.nn.Parameter(twin, requires_grad=real.requires_grad)
                        twins[id(real)] = twin
                    swapped.append((table, name, real))
                    table[name] = twin
        yield list(twins.values())
    finally:
        for table, name, real in reversed(swapped):
            table[name] = real
        _model.restore_attributes(attrs)


def _profile_empirical(model, units, args, kwargs):
    def run():
        model(*args, **kwargs)

    return _measure(units, list(tensors_of(model)), run)


def profile_upfront(
    model: torch.nn.Module,
    units: list[tuple[str, torch.nn.Module]],
    sample_input: Any,
    config: Config,
) -> Profile:
    """Measure one forward pass before training, per the Config's order."""
    args, kwargs = split_input(sample_input)
    errors = []
    methods = []
    # (A model sharded with FSDP2 is profiled as the unsharded model its
    # shards stand for: see _without_fsdp2_hooks.)
    if config.use_static_profiling:
        methods.append(("static", _profile_static))
    if config.use_empirical_fallback or not config.use_static_profiling:
        methods.append(("empirical", _profile_empirical))
    for name, fn in methods:
        try:
            with _preserved_state(model):
                profiler, ops = fn(model, units, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - reported below
            logger.info("memscale: %s profiling failed: %s: %s", name, type(exc).__name__, exc)
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        return profile_from(profiler, units, name, ops=ops)
    why = _model.inference_input_error(sample_input, "wrap()", "; ".join(errors))
    if why is not None:
        raise why
    raise RuntimeError(
        "memscale could not profile the model with sample_input ("
        + "; ".join(errors)
        + "). Check that model(sample_input) runs, or "
        "pass sample_input=None to profile the first training steps"
        + ("" if config.use_empirical_fallback else ", or set Config(use_empirical_fallback=True)")
        + "."
    )


def profile_from(
    profiler: Any,
    units: list[tuple[str, torch.nn.Module]],
    method: str,
    tile_flags: list[int] | None = None,
    ops: Any = None,
    costs: _costs.CostTable | None = None,
) -> Profile:
    """The profile ``profiler`` measured; ``tile_flags``: each unit's
    tiling flag, when not to be read off the units now (memscale's own
    hooks on them, while a plan is applied, make none a candidate); with
    ``ops`` (an ``_selective.OpRecorder`` of the same pass) each layer's
    selective profile, its ``recompute_cost`` and its tail (``tail_flops``
    and ``tail_cost``: what a recompute ending in it does not run) too, in
    FLOPs at the matmul rate of ``costs`` (default: the units' device's,
    ``_costs.for_device``)."""
    layers = []
    details = []
    if tile_flags is None:
        tile_flags = _tiling.layer_flags(units)
    weights = _selective.UNWEIGHTED
    if ops is not None:
        weights = (costs if costs is not None else _units_costs(units)).weights()
    for i, ((name, module), r, tile_flag) in enumerate(zip(units, profiler.results(), tile_flags)):
        kind = type(module).__name__
        fields = (
            name,
            kind,
            r["param_bytes"],
            r["saved_bytes"],
            r["input_bytes"],
            float(r["flops"]),
            r["flags"] | tile_flag,
        )
        named: dict[str, Any] = {}
        skips: tuple[Any, ...] = ()
        if ops is not None:
            flops = float(r["flops"])
            levels = _selective.layer_profile(ops.ops[i], flops, r["saved_bytes"], weights=weights)
            if levels is not None:
                named["selective_levels"] = levels
                skips = _selective.level_skips(ops.ops[i], levels)
            cost = _selective.recompute_cost(ops.ops[i], flops, weights)
            if cost != flops:  # (with the default costs it is flops: left out)
                named["recompute_cost"] = cost
            tail_flops, tail_cost = _selective.tail(ops.ops[i], flops, weights)
            if tail_flops > 0.0 or tail_cost > 0.0:
                named["tail_flops"] = tail_flops
                if tail_cost != tail_flops:
                    named["tail_cost"] = tail_cost
        layers.append(_core.LayerStats(fields, named) if named else _core.LayerStats(fields))
        detail = {"name": name, "kind": kind, **r}
        if skips:
            # Per level, the calls its recompute does not run
            # (_selective.run, given them by _compiled.update).
            detail["skips"] = skips
        tail = _selective.tail_of(ops.ops[i]) if ops is not None else None
        if tail is not None:
            # Where its tail starts: a selective run keeps nothing from
            # there on (_selective.run, given it by _compiled.update).
            detail["tail_op"], detail["tail_nth"] = tail
        details.append(detail)
    return Profile(
        tuple(layers),
        profiler.total_saved_bytes,
        float(profiler.total_flops),
        method,
        tuple(details),
    )


def _units_costs(units: list[tuple[str, torch.nn.Module]]) -> _costs.CostTable:
    """The cost constants of the device the units' tensors are on."""
    for _, module in units:
        for tensor in (*module.parameters(), *module.buffers()):
            device = tensor.device
            return _costs.for_device(device.type, device.index or 0)
    return _costs.for_device("cpu")


class _GlobalOnly:
    """In place of ``FlopCounterMode``'s module tracker: every FLOP counts
    under "Global" only (the per-module breakdown is not used).  The
    tracker's global module hooks put gradient hooks on module inputs,
    which fail in a run without gradients inside a training forward (the
    tile verifier's)."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class WarmupFlops(FlopCounterMode):
    """The FLOP counter of passes measured for real under a plan: a
    ``FlopCounterMode`` whose totals leave out what runs inside
    :meth:`excluded`: the checks memscale runs inside a layer's call the
    first time (the recompute check's second run, the tile verifier's
    runs), which are no part of the training step."""

    def __init__(self) -> None:
        super().__init__(display=False, custom_mapping=_torch_compat.flop_mapping())
        self.mod_tracker = _GlobalOnly()  # type: ignore[assignment]
        self._excluded = 0

    def __enter__(self) -> WarmupFlops:
        self._excluded = 0  # entering clears the counts (one per pass)
        super().__enter__()
        return self

    def get_total_flops(self) -> int:
        return int(super().get_total_flops()) - self._excluded

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """What runs in the block does not count."""
        before = super().get_total_flops()
        try:
            yield
        finally:
            self._excluded += int(super().get_total_flops() - before)


def new_warmup_profiler(
    model: torch.nn.Module,
    units: list[tuple[str, torch.nn.Module]],
    flops: FlopCounterMode | None = None,
) -> Any:
    """A Profiler of real training forwards, its hooks attached; ``flops``
    its FLOP counter (a new ``FlopCounterMode`` if None)."""
    profiler = _core.Profiler(
        [m for _, m in units],
        list(tensors_of(model)),
        _torch_compat.flop_counter() if flops is None else flops,
    )
    profiler.attach()
    return profiler


# csrc/engine.h's MS_LAYER_NOT_CALLED: the profiler saw no call of the layer.
LAYER_NOT_CALLED = 1 << 1


# A layer's tail in its profile details: its first op's name and how many
# calls of that op come before it (_selective.tail_of); and per selective
# level, the calls its recompute does not run (_selective.level_skips).
TAIL_KEYS = ("tail_op", "tail_nth", "skips")


def tail_from(detail: dict[str, Any]) -> tuple[str, int] | None:
    """The tail a layer's profile details give :func:`_selective.run`."""
    op, nth = detail.get("tail_op"), detail.get("tail_nth")
    return (op, nth) if isinstance(op, str) and isinstance(nth, int) else None


def skips_from(detail: dict[str, Any], threshold: float) -> tuple[tuple[str, int], ...]:
    """The calls that the selective level at ``threshold`` of a layer's
    profile details does not run again (given :func:`_selective.run`)."""
    for limit_ratio, skip in detail.get("skips", ()):
        if limit_ratio == threshold:
            return tuple(skip)
    return ()


def merged(first: Profile, measured: Profile, indices: set[int]) -> Profile:
    """``measured``, with the layers at ``indices`` planned for both: the
    larger of each figure and the flags of either (a layer is "not called"
    only if called in neither)."""
    layers = []
    details = []
    for i, (a, b, da, db) in enumerate(
        zip(first.layers, measured.layers, first.details, measured.details)
    ):
        if i not in indices:
            layers.append(b)
            details.append(db)
            continue
        called = da.get("calls", 0) or db.get("calls", 0)
        flags = a.flags | b.flags
        if called:
            flags &= ~LAYER_NOT_CALLED
        layers.append(
            layer_stats(
                (
                    a.name,
                    a.kind,
                    max(a.param_bytes, b.param_bytes),
                    max(a.saved_bytes, b.saved_bytes),
                    max(a.input_bytes, b.input_bytes),
                    max(a.flops, b.flops),
                    flags,
                ),
                a,
            )
        )
        detail = dict(db)
        for key, value in da.items():
            if key == "flags":  # as the profiler reports them
                detail[key] = (value | db.get(key, 0)) & ~(LAYER_NOT_CALLED if called else 0)
            elif key in TAIL_KEYS:  # a name and a count, not figures: first's
                detail[key] = value
            elif key not in ("name", "kind") and isinstance(value, (int, float)):
                detail[key] = max(value, db.get(key, value))
        details.append(detail)
    return Profile(
        tuple(layers),
        max(first.activation_bytes, measured.activation_bytes),
        max(first.total_flops, measured.total_flops),
        measured.method,
        tuple(details),
    )


def with_selective_profiles(measured: Profile, first: Profile) -> Profile:
    """``measured`` (real steps, which record no op profile), with each
    layer's selective profile and tail from ``first`` (the fake pass's)."""
    layers = []
    details = []
    # (A Profile made by hand may have no details: none to carry, then.)
    first_details = first.details or tuple({} for _ in first.layers)
    measured_details = measured.details or tuple({} for _ in measured.layers)
    for a, b, da, db in zip(first.layers, measured.layers, first_details, measured_details):
        if (a.selective_levels is not None and b.selective_levels is None) or (
            a.tail_flops is not None and b.tail_flops is None
        ):
            layers.append(layer_stats(tuple(b), a))
            db = {**db, **{key: da[key] for key in TAIL_KEYS if key in da}}
        else:
            layers.append(b)
        details.append(db)
    return dataclasses.replace(measured, layers=tuple(layers), details=tuple(details))


def allowed_techniques(config: Config) -> int:
    """Techniques the engine may use: the mode's, minus what the Config
    turns off, minus what this release cannot carry out (reported)."""
    wanted = 0
    if config.enable_checkpointing:
        wanted |= _core.TECH_CHECKPOINT
    if config.enable_offloading and config.mode is not OptimizationMode.CONSERVATIVE:
        wanted |= _core.TECH_OFFLOAD
    if config.enable_tiling or config.mode is OptimizationMode.AGGRESSIVE:
        wanted |= _core.TECH_TILING
    if config.enable_checkpointing and config.mode is not OptimizationMode.CONSERVATIVE:
        # Selective checkpointing inside a layer (memscale._selective): in
        # BALANCED and AGGRESSIVE; CONSERVATIVE checkpoints whole layers,
        # as the frameworks' own gradient checkpointing does.  It needs
        # dispatch modes and a checkpoint that takes a context_fn
        # (_torch_compat.selective_supported).
        if _torch_compat.selective_supported():
            wanted |= _core.TECH_SELECTIVE
        else:
            logger.info(
                "memscale: selective checkpointing needs dispatch modes and "
                "torch.utils.checkpoint's context_fn, which torch %s lacks; "
                "the plan checkpoints whole layers instead",
                torch.__version__,
            )
    if wanted & _core.TECH_OFFLOAD and not wanted & _core.TECH_CHECKPOINT:
        # Offload moves checkpointed layers' inputs: without checkpointing
        # there is nothing for it to move.
        logger.info(
            "memscale: offload moves checkpointed layers' inputs; with "
            "enable_checkpointing=False it is not used"
        )
        wanted &= ~_core.TECH_OFFLOAD
    missing = [
        name for name, bit in TECHNIQUE_BITS.items() if wanted & bit and not IMPLEMENTED & bit
    ]
    if missing:
        logger.info(
            "memscale: %s not available in this release; the plan "
            "uses the other techniques of mode %s",
            " and ".join(missing),
            config.mode.value,
        )
    return wanted & IMPLEMENTED


def budget_bytes(config: Config, hardware: Hardware | None) -> int:
    """The memory a plan must fit: ``Config.memory_budget_gb``, else the
    device's capacity times ``target_gpu_utilization`` (``hardware`` may
    be None only when the Config sets the budget)."""
    if config.memory_budget_gb is not None:
        return max(1, int(config.memory_budget_gb * GIB))
    if hardware is None:
        raise ValueError("the budget of a Config without memory_budget_gb needs the hardware")
    return max(1, int(hardware.capacity_bytes * config.target_gpu_utilization))


MAX_SEGMENT = 64  # longest checkpoint segment the planner considers
RESOLUTION = 512  # memory buckets of the planner's DP


def solver_inputs(config: Config, hardware: Hardware, offload_in: OffloadInputs) -> SolverInputs:
    """The budget planner's cost model for ``hardware``, offloading to the
    tier ``offload_in`` names first."""
    costs = _costs.for_device(hardware.device, hardware.index)
    bandwidth = costs.host_bw if offload_in.host_tier else costs.disk_bw
    return SolverInputs(
        flop_rate=costs.flop_rate,
        offload_bandwidth=bandwidth,
        async_offload=bool(config.async_offload),
        tile_overhead=costs.tile_overhead,
        max_segment=MAX_SEGMENT,
        resolution=RESOLUTION,
    )


def frame_bytes(config: Config, hardware: Hardware) -> int:
    """What the engine adds to each checkpoint's stored bytes for its RNG
    state under ``config`` (:func:`plan_problem`): none under
    ``force_optimize``."""
    return 0 if config.force_optimize else checkpoint_frame_bytes(hardware.device)


def with_frame_bytes(layers: Any, frame: int) -> tuple[_core.LayerStats, ...]:
    """``layers`` with ``frame`` bytes (what a checkpoint keeps besides its
    inputs: ``_model.checkpoint_frame_bytes``) added to each one's
    ``input_bytes``."""
    if not frame:
        return tuple(layers)
    return tuple(
        layer_stats(
            (x.name, x.kind, x.param_bytes, x.saved_bytes, x.input_bytes + frame, x.flops, x.flags),
            x,
            backward_bytes=x.backward_bytes,  # as given: the engine checks it
        )
        for x in layers
    )


def plan_problem(
    profile: Profile,
    config: Config,
    hardware: Hardware,
    fixed: int,
    peak_offset: int = 0,
    plan_offset: int | None = None,
) -> PlanProblem:
    """The engine's problem for ``profile`` under ``config`` on
    ``hardware``: plain data, so that one rank can send it to the others.
    A layer's ``input_bytes`` there is what checkpointing it keeps: its
    inputs and the RNG state of its checkpoint (one per segment: the engine
    counts the stored bytes of a segment's first layer only), so that the
    budget planner does not checkpoint alone a layer that frees less.  Not
    under ``force_optimize``, which checkpoints every eligible layer whose
    inputs are less than what it saves, as asked (its projected peak leaves
    the states out); the plan of every layer checkpointed alone that
    calibrates the memory model per layer (``_planner.fallback_config``) is
    such a plan."""
    offload_in = _offload.plan_inputs(config, hardware)
    return PlanProblem(
        layers=with_frame_bytes(profile.layers, frame_bytes(config, hardware)),
        mode=config.mode.value,
        allowed=allowed_techniques(config),
        force=config.force_optimize,
        budget_bytes=budget_bytes(config, hardware),
        fixed_bytes=fixed,
        activation_bytes=profile.activation_bytes,
        total_flops=profile.total_flops,
        device=hardware.device,
        device_count=hardware.count,
        capacity_bytes=hardware.capacity_bytes,
        peak_offset_bytes=int(peak_offset),
        plan_offset_bytes=int(peak_offset if plan_offset is None else plan_offset),
        offload=offload_in,
        solver=solver_inputs(config, hardware, offload_in),
    )


def static_profiling_supported(model: torch.nn.Module) -> str | None:
    """Why the OOM predictor's fake-tensor steps must not run on ``model``,
    or None.  FSDP2 keeps its own parameter state (sharded DTensors it
    swaps for all-gathered ones around each forward, gradients it
    reduce-scatters), which simulated steps would have to model.  (The
    static profile's one forward runs the unsharded model instead: see
    _without_fsdp2_hooks.)"""
    if _distributed.is_fsdp2(model):
        return (
            "the model is sharded with FSDP2 (fully_shard), whose "
            "parameter state a fake-tensor pass would disturb"
        )
    return None
