"""Mixed precision (``Config(use_mixed_precision=True)``).

Every forward of the wrapped model runs under ``torch.autocast``: BF16
where the device supports it (the host CPU, CUDA from Ampere on), FP16
otherwise.  The executor enters it in the model's forward pre-hook and
leaves it in its always-called forward hook (``csrc/root.c``), and
checkpoint recomputes replay the autocast state of their forward, so a
recomputed layer computes exactly what its forward did.  Parameters,
gradients and optimizer state stay in float32; floating-point outputs of
the model are returned as float32, so a loss computed outside the model
is computed in float32 (as ``accelerate`` does).  ``detach`` removes both.

FP16 has a narrow exponent range, so small gradients underflow to 0
without loss scaling.  With FP16 the training loop needs a
``torch.amp.GradScaler``; :func:`grad_scaler` returns one that is enabled
exactly when the model runs in FP16, so the same loop works for both::

    scaler = memscale.amp.grad_scaler(model)
    loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()

Tolerance: on the test models (an MLP, a tiny GPT-2, BERT) the BF16 loss
is within 1% of float32's after the same steps; see tests/test_amp.py.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ._hardware import Hardware

logger = logging.getLogger(__name__)

__all__ = ["autocast_dtype", "grad_scaler"]


def autocast_dtype(hardware: Hardware | Mapping[str, Any]) -> torch.dtype:
    """BF16 when the device supports it, else FP16.  ``hardware``: a
    ``Hardware``, or a dict with the keys of
    ``memscale._core.detect_hardware``."""
    return torch.bfloat16 if Hardware.of(hardware).bf16 else torch.float16


def _to_float32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.dtype in (torch.bfloat16, torch.float16):
            return obj.float()
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_to_float32(v) for v in obj)
    if isinstance(obj, list):
        return [_to_float32(v) for v in obj]
    if isinstance(obj, Mapping) and hasattr(obj, "__setitem__"):
        for key in list(obj.keys()):
            value = obj[key]
            cast = _to_float32(value)
            if cast is not value:
                obj[key] = cast  # ModelOutput keeps its attribute in step
        return obj
    return obj


def profiling_context(config: Any, hardware: Hardware) -> Any:
    """The autocast the model will run under, for profiling it up front
    (activations are measured at the dtype they will have)."""
    import contextlib

    if not config.use_mixed_precision or hardware.device not in ("cpu", "cuda"):
        return contextlib.nullcontext()
    return torch.autocast(hardware.device, dtype=autocast_dtype(hardware))


def attach(executor: Any, model: torch.nn.Module, config: Any, hardware: Hardware) -> None:
    """Turn mixed precision on for ``model`` if the Config asks for it."""
    if not config.use_mixed_precision:
        return
    device_type = hardware.device
    if device_type not in ("cpu", "cuda"):
        logger.warning(
            "memscale: use_mixed_precision is not supported on %s; "
            "the model runs in its own precision",
            device_type,
        )
        return
    dtype = autocast_dtype(hardware)
    executor.set_autocast(device_type, dtype)
    executor.on_detach(lambda: executor.set_autocast(None, None))

    def outputs_to_float32(module: torch.nn.Module, args: Any, output: Any) -> Any:
        return _to_float32(output)

    handle = model.register_forward_hook(outputs_to_float32)
    executor.on_detach(handle.remove)
    if dtype is torch.float16:
        logger.warning(
            "memscale: mixed precision runs in FP16 (%s has no BF16 support): "
            "scale the loss with scaler = memscale.amp.grad_scaler(model), "
            "scaler.scale(loss).backward(), scaler.step(optimizer), "
            "scaler.update()",
            hardware.name,
        )
    else:
        logger.info(
            "memscale: mixed precision: forwards run under "
            "torch.autocast(%r, dtype=torch.bfloat16)",
            device_type,
        )


def grad_scaler(model: torch.nn.Module, **kwargs: Any) -> torch.amp.GradScaler:
    """A ``torch.amp.GradScaler`` for ``model``'s device, enabled when
    memscale runs the model in FP16 (disabled, a pass-through, otherwise).
    ``kwargs`` go to the GradScaler (``init_scale``, ``growth_interval``...)."""
    executor = getattr(model, "__dict__", {}).get("_memscale_executor")
    autocast = executor.autocast if executor is not None else None
    if autocast is None:
        device_type = next((p.device.type for p in model.parameters()), "cpu")
        return torch.amp.GradScaler(device_type, enabled=False, **kwargs)
    device_type, dtype = autocast
    return torch.amp.GradScaler(device_type, enabled=dtype is torch.float16, **kwargs)
