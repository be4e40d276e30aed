"""The public entry points: wrap, optimize, detach.

``wrap`` profiles the model (up front with ``sample_input``, otherwise
during the first ``warmup_steps`` training forwards), runs the decision
engine and attaches the executor's hooks.  Everything it changes is undone
by ``detach``; an error inside ``wrap`` undoes what was done so far.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any, Iterator

import torch

from . import _core, _planning
from .config import AsyncOffloadConfig, Config
from .executor import Executor

logger = logging.getLogger(__name__)

ATTR = "_memscale_executor"

# Config fields whose technique is not part of this release: accepted,
# validated, and reported when set, never silently ignored.
_NOT_YET = {
    "use_mixed_precision": "mixed precision",
    "use_8bit_optimizer": "the 8-bit optimizer",
    "async_offload": "async offload",
    "observability_port": "Prometheus metrics",
    "verify_correctness": "verify_correctness",
    "auto_policy": "the strategy policy (auto_policy)",
}


def _is_trainer(obj: Any) -> bool:
    return (not isinstance(obj, torch.nn.Module) and hasattr(obj, "model")
            and callable(getattr(obj, "train", None)))


def _effective_config(config: Config | None, async_offload: bool | None,
                      async_config: AsyncOffloadConfig | None) -> Config:
    if config is None:
        config = Config()
    elif not isinstance(config, Config):
        raise TypeError(f"config must be a memscale.Config or None, got "
                        f"{type(config).__name__}")
    changes: dict[str, Any] = {}
    if async_offload is not None:
        if not isinstance(async_offload, bool):
            raise TypeError("async_offload must be True, False or None, got "
                            f"{async_offload!r}")
        changes["async_offload"] = async_offload
    else:
        env = os.environ.get("MEMSCALE_ASYNC_OFFLOAD")
        if env is not None:
            if env not in ("0", "1"):
                raise ValueError("MEMSCALE_ASYNC_OFFLOAD must be '0' or '1', "
                                 f"got {env!r}")
            changes["async_offload"] = env == "1"
    if async_config is not None:
        changes["async_config"] = async_config
    return config.replace(**changes) if changes else config


def _report_unavailable(config: Config) -> None:
    for field, what in _NOT_YET.items():
        if getattr(config, field) not in (False, None):
            logger.warning("memscale: Config.%s is set, but %s is not part of "
                           "this release yet; it is not applied", field, what)


def _log_plan(config: Config, hardware: dict[str, Any], plan: Any) -> None:
    if not config.enable_logging:
        return
    logger.info("memscale hardware: %s x%d, %s each (%s)", hardware["device"],
                hardware["count"], _planning.format_bytes(hardware["capacity_bytes"]),
                hardware["name"])
    logger.info("%s", _planning.plan_table(plan))
    if plan.skipped:
        logger.info("memscale: the model fits comfortably (pressure %.2f); left "
                    "alone. Config(force_optimize=True) optimizes anyway.",
                    plan.pressure)
    elif not plan.fits:
        logger.warning("memscale: even with every eligible layer optimized the "
                       "projected peak (%s) exceeds the budget (%s)",
                       _planning.format_bytes(plan.peak_projected_bytes),
                       _planning.format_bytes(plan.budget_bytes))


def _after_plan(model: torch.nn.Module, executor: Executor, plan: Any) -> None:
    """Model-level settings that go with a plan (undone by detach)."""
    if not plan.technique_counts["checkpoint"]:
        return
    hf_config = getattr(model, "config", None)
    if hf_config is not None and getattr(hf_config, "use_cache", None) is True:
        hf_config.use_cache = False

        def restore(cfg=hf_config) -> None:
            cfg.use_cache = True

        executor.on_detach(restore)
        logger.info("memscale: set model.config.use_cache=False for training "
                    "with checkpointing (restored by detach)")


def wrap(target: Any, config: Config | None = None, sample_input: Any = None,
         async_offload: bool | None = None,
         async_config: AsyncOffloadConfig | None = None,
         *, optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Attach memscale to ``target`` and return ``target``.

    ``target`` is an ``nn.Module``.  With ``sample_input`` the model is
    profiled now (on fake tensors first, with a real forward as fallback)
    and the plan applied at once; without it the first
    ``config.warmup_steps`` training forwards are measured and the plan is
    applied after them.  ``optimizer`` (keyword only) sharpens the memory
    estimate with the optimizer's real state size.

    Wrapping a model twice raises ``RuntimeError``: call ``detach`` first.
    """
    if _is_trainer(target):
        raise TypeError(
            "memscale.wrap() of a Hugging Face Trainer is not part of this "
            "release yet; wrap the model instead: memscale.wrap(model) before "
            "passing it to the Trainer")
    if not isinstance(target, torch.nn.Module):
        raise TypeError("memscale.wrap() needs a torch.nn.Module (or a Hugging "
                        f"Face Trainer), got {type(target).__name__}")
    model = target
    if model.__dict__.get(ATTR) is not None:
        raise RuntimeError(
            "this model is already wrapped by memscale; call "
            "memscale.detach(model) before wrapping it again")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("optimizer must be a torch.optim.Optimizer or None, "
                        f"got {type(optimizer).__name__}")
    config = _effective_config(config, async_offload, async_config)
    _report_unavailable(config)

    device = _planning.model_device(model)
    if config.memory_budget_gb is not None and device.type not in ("cpu", "cuda"):
        hardware = {"device": device.type, "index": 0, "count": 1,
                    "capacity_bytes": int(config.memory_budget_gb * _planning.GIB),
                    "bf16": False, "name": device.type}
    else:
        hardware = _core.detect_hardware(device.type, device.index or 0)
    units = _core.find_units(model)
    fixed = _planning.fixed_bytes(model, optimizer)

    # Profile before any hook of ours exists, so that the profiling pass
    # is not seen (or counted) as a training forward.
    profile = None
    if sample_input is not None:
        profile = _planning.profile_upfront(model, units, sample_input, config)
    executor = Executor(model, units, warmup_steps=config.warmup_steps)
    try:
        method = profile.method if profile is not None else "warmup"
        executor._init_python_state(config, hardware, method)
        if profile is not None:
            executor.profile = profile
            plan = _planning.make_plan(profile, config, hardware, fixed)
            _log_plan(config, hardware, plan)
            executor.apply(plan)
            _after_plan(model, executor, plan)
        else:
            profiler = _planning.new_warmup_profiler(model, units)

            def on_profiled(prof: Any) -> Any:
                warm = _planning.profile_from(prof, units, "warmup")
                executor.profile = warm
                plan = _planning.make_plan(warm, config, hardware, fixed)
                _log_plan(config, hardware, plan)
                _after_plan(model, executor, plan)
                return plan

            try:
                executor.start_profiling(profiler, on_profiled)
            except BaseException:
                profiler.detach()
                raise
            if config.enable_logging:
                logger.info("memscale: profiling the first %d training forward "
                            "passes, then planning", config.warmup_steps)
        model.__dict__[ATTR] = executor
    except BaseException:
        if not hasattr(executor, "_restore"):
            executor._init_python_state(config, hardware, "failed")
        executor.detach()
        raise
    return target


def detach(model: Any) -> None:
    """Remove everything ``wrap`` attached and delete
    ``model._memscale_executor``.  A model that was never wrapped gets a
    warning, not an exception."""
    if _is_trainer(model):
        model = model.model
    executor = getattr(model, "__dict__", {}).get(ATTR)
    if executor is None:
        warnings.warn("memscale.detach(): this model is not wrapped by memscale; "
                      "nothing to do", RuntimeWarning, stacklevel=2)
        return
    try:
        executor.detach()
    finally:
        del model.__dict__[ATTR]


@contextlib.contextmanager
def optimize(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
             config: Config | None = None,
             sample_input: Any = None) -> Iterator[Executor]:
    """Wrap ``model`` for the duration of a ``with`` block; yields the
    executor and detaches on exit, also when the block raises."""
    wrap(model, config, sample_input, optimizer=optimizer)
    try:
        yield model.__dict__[ATTR]
    finally:
        detach(model)
