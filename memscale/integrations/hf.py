"""memscale for the Hugging Face ``transformers.Trainer``.

Two ways in, with the same behaviour::

    memscale.wrap(trainer)        # adds a MemScaleCallback to the Trainer
    Trainer(..., callbacks=[MemScaleCallback(config)])

When training starts (``on_train_begin``) the Trainer has built its
optimizer, applied its own settings (gradient checkpointing among them)
and prepared the model with accelerate.  The callback then wraps the model
the Trainer trains, ``kwargs["model"]`` with any DDP / DataParallel /
``torch.compile`` wrapper looked through, so the hooks sit on the modules
whose forward runs.  The Trainer's optimizer sharpens the estimate.
Unless a ``sample_input`` is given, the plan is made inside the first
training forward, from its own inputs, and that forward already runs
under it (see ``memscale.wrap``).
When training ends (``on_train_end``) everything is detached, so nothing is
left on the model once ``train()`` returns.

Hugging Face's own gradient checkpointing: memscale takes over.  If it is
on when training starts (``TrainingArguments(gradient_checkpointing=True)``,
``activation_checkpointing=True`` in transformers 5, or
``model.gradient_checkpointing_enable()``), it is switched off for the run
and memscale's plan decides which layers to checkpoint; it is switched
back on, exactly as it was, when memscale detaches.  No layer is ever
checkpointed twice.  ``Config(enable_checkpointing=False)`` leaves
Hugging Face's checkpointing on instead (memscale then checkpoints
nothing).  Either way the log says which.

``on_log`` adds memscale's figures to the logs (``memscale/...`` keys, see
``memscale.integrations._common.figures``) and to the matching entry of
``trainer.state.log_history``.  Only world process zero logs messages.

If ``train()`` raises, transformers calls no further callback, so memscale
stays attached until the next ``train()`` (which removes it and plans
anew; this is also how ``auto_find_batch_size`` retries work) or until
``memscale.detach(trainer)``.

Works with transformers 4.40 and later (both the 4.x and 5.x callback and
checkpointing APIs).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import api
from ..config import Config
from . import _common

try:
    from transformers import TrainerCallback
except ImportError as _exc:
    raise _common.missing_framework("Hugging Face Trainer", "transformers", "hf", _exc) from _exc

logger = logging.getLogger(__name__)

__all__ = ["MemScaleCallback"]

_MISSING = object()


class MemScaleCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that applies memscale to the model
    the Trainer trains, from ``on_train_begin`` to ``on_train_end``.

    ``config`` is a :class:`memscale.Config` (None: ``Config()``).
    ``sample_input`` (keyword only) is passed to :func:`memscale.wrap` to
    profile up front instead of inside the first training forward; it must
    be model inputs on the model's device.  Every hook accepts ``**kwargs``.
    While training runs, :attr:`executor` is memscale's executor.
    """

    def __init__(self, config: Config | None = None, *, sample_input: Any = None) -> None:
        if config is not None and not isinstance(config, Config):
            raise TypeError(
                "MemScaleCallback(config=...) must be a memscale.Config "
                f"or None, got {type(config).__name__}"
            )
        self.config = config
        self.sample_input = sample_input
        self._executor: Any = None
        self._model_ref: weakref.ref[torch.nn.Module] | None = None
        self._took_over = False
        self._plan_told = False

    @property
    def executor(self) -> Any:
        """memscale's executor on the model while training runs, else None."""
        return self._executor

    # ---- Trainer events ---------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        zero = bool(getattr(state, "is_world_process_zero", True))
        if self._executor is not None:
            if zero:
                logger.info(
                    "memscale: the previous train() did not end "
                    "normally; removing what memscale attached then "
                    "and planning anew"
                )
            self._release(log_summary=False)
        model = kwargs.get("model")
        if not isinstance(model, torch.nn.Module):
            logger.warning(
                "memscale: the Trainer passed no model to "
                "on_train_begin; memscale is not applied to this run"
            )
            return
        model = _common.unwrap_model(model)
        if model.__dict__.get(api.ATTR) is not None:
            if zero:
                logger.warning(
                    "memscale: the Trainer's model is already wrapped by "
                    "memscale.wrap(model); the MemScaleCallback leaves that "
                    "wrapping as it is. Call memscale.detach(model) before "
                    "train() to let the callback manage it."
                )
            return
        config = _common.for_rank(self.config if self.config is not None else Config(), zero)
        optimizer = _common.unwrap_optimizer(kwargs.get("optimizer"))
        _common.check_step_in_backward(
            config,
            "Hugging Face Trainer",
            clip=("TrainingArguments.max_grad_norm", getattr(args, "max_grad_norm", None)),
            accumulation=(
                "TrainingArguments.gradient_accumulation_steps",
                int(getattr(args, "gradient_accumulation_steps", 1) or 1),
            ),
            fp16=("TrainingArguments.fp16", bool(getattr(args, "fp16", False))),
            optimizers=0 if optimizer is None else 1,
        )
        restore = _take_over_hf_checkpointing(model, config, zero)
        try:
            api.wrap(model, config, self.sample_input, optimizer=optimizer)
        except BaseException:
            if restore is not None:
                restore()
            raise
        executor = model.__dict__[api.ATTR]
        if restore is not None:
            executor.on_detach(restore)
        self._executor = executor
        self._model_ref = weakref.ref(model)
        self._took_over = restore is not None
        self._plan_told = False
        if zero:
            logger.info(
                "memscale: attached to the Trainer's %s for this train() (optimizer: %s)",
                type(model).__name__,
                type(optimizer).__name__ if optimizer is not None else "none seen, Adam assumed",
            )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        executor = self._executor
        if executor is None or self._plan_told or executor.plan is None:
            return
        self._plan_told = True
        plan = executor.plan
        if (
            self._took_over
            and not plan.technique_counts["checkpoint"]
            and getattr(state, "is_world_process_zero", True)
        ):
            logger.warning(
                "memscale: the plan checkpoints no layer (pressure %.2f%s), so "
                "Hugging Face's gradient checkpointing stays off for this run. "
                "Config(force_optimize=True) makes memscale checkpoint anyway; "
                "Config(enable_checkpointing=False) keeps Hugging Face's.",
                plan.pressure,
                ", smart-skip" if plan.skipped else "",
            )

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        executor = self._executor
        if executor is None or not isinstance(logs, dict):
            return
        figures = _common.figures(executor)
        if not figures:
            return
        logs.update(figures)
        # Trainer.log appends a copy of ``logs`` to log_history just before
        # calling on_log; put the figures in that record too.
        history = getattr(state, "log_history", None)
        if history and isinstance(history[-1], dict):
            last = history[-1]
            if last.get("step") == getattr(state, "global_step", None) and all(
                k in last for k in logs if k not in figures
            ):
                last.update(figures)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._release(log_summary=bool(getattr(state, "is_world_process_zero", True)))

    # ---- internals ----------------------------------------------------------

    def _release(self, log_summary: bool) -> None:
        """Detach what this callback attached (idempotent)."""
        executor, ref = self._executor, self._model_ref
        self._executor = None
        self._model_ref = None
        self._took_over = False
        if executor is None:
            return
        if log_summary:
            logger.info("memscale: training ended; %s; detached", _common.summary(executor))
        model = ref() if ref is not None else None
        if model is not None and model.__dict__.get(api.ATTR) is executor:
            api.detach(model)
        else:  # the model is gone or was re-wrapped: undo our part anyway
            executor.detach()

    def __repr__(self) -> str:
        state = "idle" if self._executor is None else self._executor.state
        return f"<memscale MemScaleCallback {state}>"


def _hf_checkpointing_on(model: torch.nn.Module) -> bool:
    # transformers 4.x and 5.x both keep a ``gradient_checkpointing`` flag
    # on every module that can checkpoint (the layers, and the model).
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _take_over_hf_checkpointing(
    model: torch.nn.Module, config: Config, log: bool
) -> Callable[[], None] | None:
    """Switch Hugging Face's gradient checkpointing off if it is on, and
    return the action that restores it exactly (None if nothing changed)."""
    if not _hf_checkpointing_on(model):
        return None
    if not config.enable_checkpointing:
        if log:
            logger.info(
                "memscale: Hugging Face gradient checkpointing is on and "
                "Config(enable_checkpointing=False): memscale leaves it "
                "on and checkpoints no layer itself"
            )
        return None
    saved = [
        (m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func", _MISSING))
        for m in model.modules()
        if hasattr(m, "gradient_checkpointing")
    ]
    input_hook = model.__dict__.get("_require_grads_hook")

    def restore() -> None:
        for module, flag, func in saved:
            module.gradient_checkpointing = flag
            if func is _MISSING:
                module.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                module._gradient_checkpointing_func = func
        if (
            input_hook is not None
            and model.__dict__.get("_require_grads_hook") is None
            and callable(getattr(model, "enable_input_require_grads", None))
        ):
            model.enable_input_require_grads()  # type: ignore[operator]

    # transformers 5 renamed the API (the old names warn); 4.x has only the
    # old one.  Any flag the call leaves on is cleared directly.
    disable = getattr(model, "activation_checkpointing_disable", None) or getattr(
        model, "gradient_checkpointing_disable", None
    )
    try:
        if callable(disable):
            disable()
        for module, _, _ in saved:
            module.gradient_checkpointing = False  # type: ignore[assignment]
    except BaseException:
        restore()
        raise
    if log:
        logger.warning(
            "memscale: Hugging Face gradient checkpointing was on "
            "(TrainingArguments(gradient_checkpointing=True) or "
            "gradient_checkpointing_enable()). memscale takes over so that no "
            "layer is checkpointed twice: Hugging Face's is off during this "
            "train(), memscale's plan chooses the layers, and Hugging Face's "
            "is switched back on when training ends. "
            "Config(enable_checkpointing=False) keeps Hugging Face's instead."
        )
    return restore


def attach(trainer: Any, config: Config | None, sample_input: Any = None) -> Any:
    """``memscale.wrap(trainer)``: add a MemScaleCallback; return trainer."""
    if any(isinstance(cb, MemScaleCallback) for cb in trainer.callback_handler.callbacks):
        raise RuntimeError(
            "this Trainer already has a memscale MemScaleCallback (from "
            "memscale.wrap(trainer) or callbacks=[...]); call "
            "memscale.detach(trainer) before wrapping it again"
        )
    model = getattr(trainer, "model", None)
    if (
        isinstance(model, torch.nn.Module)
        and _common.unwrap_model(model).__dict__.get(api.ATTR) is not None
    ):
        raise RuntimeError(
            "the Trainer's model is already wrapped by memscale; call "
            "memscale.detach(trainer.model) before memscale.wrap(trainer), "
            "or keep the model's wrapping and do not wrap the trainer"
        )
    trainer.add_callback(MemScaleCallback(config, sample_input=sample_input))
    return trainer


def detach_trainer(trainer: Any) -> bool:
    """``memscale.detach(trainer)``: remove every MemScaleCallback from the
    Trainer and what it attached, and detach ``trainer.model`` if memscale
    wraps it.  Returns whether there was anything to remove."""
    found = False
    for cb in [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MemScaleCallback)]:
        try:
            cb._release(log_summary=False)
        finally:
            trainer.remove_callback(cb)
        found = True
    model = getattr(trainer, "model", None)
    if isinstance(model, torch.nn.Module):
        model = _common.unwrap_model(model)
        if model.__dict__.get(api.ATTR) is not None:
            api.detach(model)
            found = True
    return found
