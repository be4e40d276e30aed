"""``memscale.wrap`` and ``memscale.detach``: what they accept.

A model goes to :mod:`memscale.api`; a Hugging Face ``transformers.Trainer``
to :mod:`memscale.integrations.hf`, whose callback wraps the Trainer's
model through :mod:`memscale.api` when training starts.  This module sits
above both, so that neither imports the other back.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from . import api
from .config import AsyncOffloadConfig, Config

__all__ = ["detach", "wrap"]


def _is_trainer(obj: Any) -> bool:
    return (
        not isinstance(obj, torch.nn.Module)
        and hasattr(obj, "model")
        and callable(getattr(obj, "train", None))
    )


def _is_hf_trainer(obj: Any) -> bool:
    """A Trainer memscale can attach to: it takes callbacks (as
    ``transformers.Trainer`` does)."""
    return (
        _is_trainer(obj)
        and callable(getattr(obj, "add_callback", None))
        and hasattr(obj, "callback_handler")
    )


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
    """Attach memscale to ``target`` and return ``target``.

    ``target`` is an ``nn.Module``.  With ``sample_input`` the model is
    profiled now (on fake tensors first, with a real forward as fallback)
    and the plan applied at once; without it the first training forward's
    own inputs are profiled on fake tensors inside that forward's
    pre-hook, and the forward runs under the plan.  Where fake tensors
    cannot run the model (``use_static_profiling=False``, FSDP2, an
    operator without a fake kernel), the first ``config.warmup_steps``
    training forwards are measured for real instead and the plan applies
    after them.  ``optimizer`` (keyword only) sharpens the memory
    estimate with the optimizer's real state size.  With
    ``Config(use_8bit_optimizer=True)`` it is replaced: the 8-bit AdamW
    with its parameter groups and hyper-parameters is
    ``model._memscale_executor.optimizer`` (train with that one; a
    ``ValueError`` says why when ``optimizer`` cannot be replaced).
    ``loss_fn`` (keyword only) maps the model's output to the loss your
    training computes: the simulated steps the plan is made from then run
    it instead of the default stand-in (``output.loss`` where the model
    computes one, else the mean of squares of its outputs), so that a
    loss that holds more than the stand-in (a cross-entropy's
    ``log_softmax``, an MSE's elementwise buffer) is counted against the
    budget.

    Wrapping a model twice raises ``RuntimeError``: call ``detach`` first.

    ``target`` may also be a Hugging Face ``transformers.Trainer``: a
    ``memscale.integrations.hf.MemScaleCallback`` is added to it, which
    wraps the model the Trainer trains when training starts (with the
    Trainer's optimizer) and detaches it when training ends.  The Trainer
    is returned.
    """
    if _is_trainer(target):
        if not _is_hf_trainer(target):
            raise TypeError(
                "memscale.wrap() accepts a Hugging Face transformers.Trainer "
                "(an object with .model, .train() and .add_callback()); this "
                f"{type(target).__name__} takes no callbacks. Wrap its model "
                "instead: memscale.wrap(trainer.model)"
            )
        if optimizer is not None:
            raise TypeError(
                "memscale.wrap(trainer, optimizer=...): memscale uses the "
                "optimizer the Trainer builds; give yours to the Trainer "
                "(Trainer(..., optimizers=(optimizer, scheduler))) instead"
            )
        if loss_fn is not None:
            raise TypeError(
                "memscale.wrap(trainer, loss_fn=...): a Trainer's model "
                "computes its own loss (output.loss), which memscale "
                "simulates; pass no loss_fn"
            )
        from .integrations import hf  # imports transformers

        return hf.attach(
            target, api.effective_config(config, async_offload, async_config), sample_input
        )
    if not isinstance(target, torch.nn.Module) and type(target).__module__.split(".")[0] in (
        "lightning",
        "pytorch_lightning",
    ):
        raise TypeError(
            "memscale.wrap() does not take a PyTorch Lightning "
            f"{type(target).__name__}; pass the callback instead: "
            "Trainer(callbacks=[memscale.integrations.lightning.MemScaleCallback()])"
        )
    return api.wrap(
        target,
        config,
        sample_input,
        async_offload,
        async_config,
        optimizer=optimizer,
        loss_fn=loss_fn,
    )


def detach(model: Any) -> None:
    """Remove everything ``wrap`` attached and delete
    ``model._memscale_executor``.  A model that was never wrapped gets a
    warning, not an exception.  For a Hugging Face Trainer: removes
    memscale's callbacks from it, and detaches its model if wrapped."""
    if _is_hf_trainer(model):
        from .integrations import hf  # imports transformers

        if not hf.detach_trainer(model):
            warnings.warn(
                "memscale.detach(): this Trainer has no memscale "
                "callback and its model is not wrapped; nothing to do",
                RuntimeWarning,
                stacklevel=2,
            )
        return
    if _is_trainer(model):
        model = model.model
    if not api.detach(model):
        warnings.warn(
            "memscale.detach(): this model is not wrapped by memscale; nothing to do",
            RuntimeWarning,
            stacklevel=2,
        )
