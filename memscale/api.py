"""The entry points for a model: wrap, optimize, detach,
apply_all_optimizations (``memscale.wrap`` and ``memscale.detach`` take a
Hugging Face Trainer too: :mod:`memscale._entry`).

``wrap`` checks its arguments and runs the pipeline of
:class:`memscale._wrapping.Wrapping`: it profiles the model (up front with
``sample_input``, otherwise inside the first training forward, from its
own inputs, before it runs), runs the decision engine and attaches the
executor's hooks.  Everything it changes is undone by ``detach``; an
error inside ``wrap`` undoes what was done so far.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from . import _model, _step_in_backward, _telemetry, _torch_compat, _wrapping, optim
from ._executor import Executor
from ._wrapping import ATTR
from .config import AsyncOffloadConfig, Config, OptimizationMode

logger = logging.getLogger(__name__)

__all__ = ["ATTR", "apply_all_optimizations", "detach", "effective_config", "optimize", "wrap"]


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


def _checked_target(target: Any) -> torch.nn.Module:
    """The model ``target`` stands for, not wrapped yet, or a clear error.
    ``torch.compile(model)`` then wrap: the compiled module is wrapped, and
    the user's compiled object, which calls it, keeps working (the plan is
    then carried out inside its graph: memscale._compiled)."""
    if not isinstance(target, torch.nn.Module):
        raise TypeError(
            "memscale.wrap() needs a torch.nn.Module (or a Hugging "
            f"Face Trainer), got {type(target).__name__}"
        )
    model: torch.nn.Module = _torch_compat.compiled_inner(target) or target
    if model.__dict__.get(ATTR) is not None:
        raise RuntimeError(
            "this model is already wrapped by memscale; call "
            "memscale.detach(model) before wrapping it again"
        )
    return model


def _training_optimizer(
    config: Config, optimizer: torch.optim.Optimizer | None
) -> torch.optim.Optimizer | None:
    """The optimizer training will use: ``optimizer``, or its 8-bit
    replacement under ``Config.use_8bit_optimizer``."""
    _warn_8bit_without_optimizer(config, optimizer)
    if optimizer is None or not config.use_8bit_optimizer or optim.is_8bit(optimizer):
        return optimizer
    replaced = optim.to_8bit(optimizer)  # ValueError says why not
    logger.info(
        "memscale: replaced %s with an 8-bit AdamW (same parameter "
        "groups and hyper-parameters); train with "
        "model._memscale_executor.optimizer",
        type(optimizer).__name__,
    )
    return replaced


def wrap(
    target: Any,
    config: Config | None = None,
    sample_input: Any = None,
    async_offload: bool | None = None,
    async_config: AsyncOffloadConfig | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Any = None,
) -> Any:
    """Attach memscale to the model ``target`` and return it: what
    ``memscale.wrap`` does with a model (see :func:`memscale._entry.wrap`)."""
    model = _checked_target(target)
    _model.check_step_arguments(optimizer, loss_fn)
    config = effective_config(config, async_offload, async_config)
    _step_in_backward.check(config, optimizer)
    wrapping = _wrapping.Wrapping(model, config, _training_optimizer(config, optimizer), loss_fn)
    # Profile before any hook of ours exists, so that the profiling pass
    # is not seen (or counted) as a training forward.
    upfront = None if sample_input is None else wrapping.profile(model, sample_input, config)
    try:
        executor = wrapping.attach(wrapping.method(upfront))
        wrapping.plan(upfront)  # now, on the first training forward, or after warm-up
        wrapping.finish()
    except BaseException:
        wrapping.undo()
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
    inner = _torch_compat.compiled_inner(model)
    if inner is not None:
        _torch_compat.drop_copied_attribute(model, ATTR)
        model = inner
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
    *,
    loss_fn: Any = None,
) -> Iterator[Executor]:
    """Wrap ``model`` for the duration of a ``with`` block; yields the
    executor and detaches on exit, also when the block raises.  With
    ``Config(use_8bit_optimizer=True)``, ``optimizer`` is replaced by its
    8-bit counterpart, ``executor.optimizer``: train with that one.
    ``loss_fn`` as :func:`wrap`'s."""
    wrap(model, config, sample_input, optimizer=optimizer, loss_fn=loss_fn)
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
