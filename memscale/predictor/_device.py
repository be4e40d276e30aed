"""The device a prediction is for: given by hand (:class:`DeviceSpec`) or
detected, and the device the fake tensors of the simulation live on."""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .. import _hardware, _model
from .._hardware import Hardware
from ..config import GIB, Config

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """A device to predict for, given by hand: for a device this machine does
    not have (``DeviceSpec("cuda", capacity_bytes=24 * 2**30)``), or to
    override the detected capacity.  The step is simulated with fake tensors
    on ``type`` ("cpu" or "cuda"), so kernels and optimizer defaults are the
    ones torch picks for that device type; without a CUDA runtime here, a
    "cuda" target is simulated with CPU kernels (and the optimizer's
    CUDA defaults), against its capacity.
    """

    # Device type: "cpu" or "cuda".
    type: str
    # Total memory of one device, in bytes (> 0).
    capacity_bytes: int
    # Free-form name shown in reports; "" = the device type.
    name: str = ""
    # Number of devices (>= 1); the plan records it.
    count: int = 1
    # Device index (>= 0).
    index: int = 0
    # Whether the device supports bfloat16.
    bf16: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.type, str) or self.type not in ("cpu", "cuda"):
            raise ValueError(f"DeviceSpec.type must be 'cpu' or 'cuda', got {self.type!r}")
        cap = self.capacity_bytes
        if (
            isinstance(cap, bool)
            or not isinstance(cap, numbers.Real)
            or not math.isfinite(cap)
            or cap < 1
        ):
            raise ValueError(
                f"DeviceSpec.capacity_bytes must be a number of bytes >= 1, got {cap!r}"
            )
        object.__setattr__(self, "capacity_bytes", int(cap))
        if not isinstance(self.name, str):
            raise TypeError(f"DeviceSpec.name must be a str, got {self.name!r}")
        for field, low in (("count", 1), ("index", 0)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"DeviceSpec.{field} must be an int >= {low}, got {value!r}")
        if not isinstance(self.bf16, bool):
            raise TypeError(f"DeviceSpec.bf16 must be a bool, got {self.bf16!r}")

    def hardware(self) -> Hardware:
        """The description the decision engine plans with."""
        return Hardware(
            device=self.type,
            index=self.index,
            count=self.count,
            capacity_bytes=self.capacity_bytes,
            bf16=self.bf16,
            name=self.name or self.type,
        )


def resolve_device(model: nn.Module, device: Any, config: Config) -> tuple[Hardware, torch.device]:
    """(hardware description, device the fake tensors live on)."""
    if isinstance(device, Mapping):
        device = DeviceSpec(**dict(device))
    if isinstance(device, DeviceSpec):
        return device.hardware(), _simulation_device(device.type)
    if device is None:
        dev = _model.model_device(model)
        if dev.type == "meta":
            raise ValueError(
                "the model is on the meta device, so there is no device to "
                "predict for; pass device=DeviceSpec('cuda', capacity_bytes=...) "
                "(memscale.predictor.DeviceSpec) or device='cpu'"
            )
    elif isinstance(device, (str, torch.device)):
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"device must name a torch device, got {device!r}: {exc}") from None
    else:
        raise TypeError(
            "device must be None, a str or torch.device, a "
            "memscale.predictor.DeviceSpec or a dict of its fields, "
            f"got {type(device).__name__}"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"memscale predicts for 'cpu' and 'cuda' devices, not "
            f"{dev.type!r}; pass device=DeviceSpec(...)"
        )
    try:
        hardware = _hardware.detect(dev.type, dev.index or 0)
    except RuntimeError as exc:
        if config.memory_budget_gb is None:
            raise ValueError(
                f"cannot detect the {dev} device here ({exc}); pass its size: "
                f"device=DeviceSpec({dev.type!r}, capacity_bytes=...) or "
                "Config(memory_budget_gb=...)"
            ) from None
        hardware = _hardware.assumed(dev.type, dev.index or 0, int(config.memory_budget_gb * GIB))
    return hardware, _simulation_device(dev.type)


def _simulation_device(device_type: str) -> torch.device:
    """The device the fake tensors live on: the target's type when this
    torch can run it (autograd needs the device's runtime even for fake
    tensors: a CPU-only build aborts the process on a fake CUDA backward),
    else the CPU, whose kernels and optimizer defaults are then simulated."""
    if device_type == "cuda" and not torch.cuda.is_available():
        logger.info(
            "memscale: CUDA is not available here; the step is "
            "simulated with CPU kernels, against the given capacity"
        )
        return torch.device("cpu")
    return torch.device(device_type)
