"""A measured trial: one real training step, measured exactly, then undone.

The AutoTuner confirms its predictions with :func:`measure_step`, and the
prediction-error table of the README compares against it.  The figure is
``memscale._measure.measure_peak``'s: the live tensor bytes at
the highest point of ``zero_grad(set_to_none=True)``, forward, loss,
backward and the optimizer step, after one warm-up step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .. import _model
from ..config import Config

__all__ = ["fresh_optimizer", "measure_step"]


def fresh_optimizer(
    optimizer: torch.optim.Optimizer | None, model: nn.Module
) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class and settings over the same
    parameters, with no state (AdamW with its defaults when None), so that
    a trial never changes the optimizer the caller trains with."""
    from ..predictor import rebuild_optimizer

    if optimizer is None:
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    try:
        return rebuild_optimizer(optimizer)
    except Exception as exc:
        raise TypeError(
            f"memscale cannot build a second {type(optimizer).__name__} for a "
            f"measured trial ({type(exc).__name__}: {exc}); pass optimizer=None "
            "(AdamW is then used), or run without trials (trial=False)"
        ) from exc


@contextlib.contextmanager
def _restored(model: nn.Module) -> Iterator[None]:
    """Put back, on exit, what a training step changes: parameter values,
    buffers (BatchNorm statistics), gradients, RNG streams (torch CPU and
    CUDA, Python's, NumPy's) and training flags.  The copies are kept on
    the CPU."""
    from .._verify import rng_state, set_rng_state

    params = list(model.parameters())
    saved_params = [p.detach().to("cpu", copy=True) for p in params]
    saved_grads = [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in params]
    buffers = list(model.buffers())
    saved_buffers = [b.detach().to("cpu", copy=True) for b in buffers]
    flags = [(m, m.training) for m in model.modules()]
    rng = rng_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value, grad in zip(params, saved_params, saved_grads):
                p.copy_(value)
                p.grad = None if grad is None else grad.to(p.device)
            for b, value in zip(buffers, saved_buffers):
                b.copy_(value)
        for m, flag in flags:
            m.training = flag
        set_rng_state(rng)


def measure_step(
    model: nn.Module,
    sample_input: Any,
    config: Config | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    loss_fn: Callable[[Any], Any] | None = None,
    warmup: int = 1,
) -> Any:
    """Measure one real training step of ``model`` on ``sample_input``.

    With ``config``, memscale is wrapped for the trial (as
    ``wrap(model, config, sample_input, optimizer=optimizer)``) and detached
    after; with None the model runs as it is.  The step uses a fresh
    optimizer of ``optimizer``'s class and settings (AdamW when None) and
    ``loss_fn`` (default :func:`memscale.predictor.default_loss`), in
    training mode.  ``warmup`` steps run first (1: gradients and optimizer
    state exist, as in steady state).  Returns the
    :class:`memscale._measure.MemoryReport` of the measured step.

    The model is left as it was: parameter values, buffers, gradients, RNG
    streams and training flags are restored, and memscale is detached, also
    when the step raises.  This needs the memory of the step (it is the
    real thing) plus a CPU copy of the parameters.
    """
    from .. import api
    from .._measure import measure_peak
    from ..predictor import default_loss

    if not isinstance(model, nn.Module):
        raise TypeError(f"measure_step() needs a torch.nn.Module, got {type(model).__name__}")
    if model.__dict__.get(api.ATTR) is not None:
        raise RuntimeError(
            "measure_step() runs its own memscale.wrap(); call memscale.detach(model) first"
        )
    if any(t.is_meta for t in model.parameters()):
        raise ValueError(
            "the model is on the meta device and cannot run a real "
            "step; trials need a materialized model (trial=False "
            "skips them)"
        )
    args, kwargs = _model.split_input(sample_input)
    compute_loss = loss_fn if loss_fn is not None else default_loss
    with _restored(model):
        model.train()
        if config is not None:
            api.wrap(model, config, sample_input, optimizer=optimizer)
        try:
            opt = fresh_optimizer(optimizer, model)

            def step() -> torch.Tensor:
                opt.zero_grad(set_to_none=True)
                loss = compute_loss(model(*args, **kwargs))
                loss.backward()
                opt.step()
                return loss.detach()

            return measure_peak(step, model=model, inputs=(args, kwargs, opt.state), warmup=warmup)
        finally:
            if model.__dict__.get(api.ATTR) is not None:
                api.detach(model)
