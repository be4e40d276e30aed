"""The device a model trains on, as memscale plans for it: one frozen value.

``Hardware`` is made here and nowhere else: :func:`detect` asks the C core
(``_core.detect_hardware``), :func:`assumed` describes a device that
cannot be detected from its size alone, and :meth:`Hardware.of` converts
the plain dict that public functions still accept (the keys
``_core.detect_hardware`` returns).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import _core


@dataclass(frozen=True, slots=True)
class Hardware:
    """One device type and its memory, as the plan is made for it."""

    device: str  # the torch device type: "cpu", "cuda", ...
    index: int  # the model's device index
    count: int  # devices of that type
    capacity_bytes: int  # memory of one device (host RAM for "cpu")
    bf16: bool  # whether it computes in bfloat16 (else float16 for autocast)
    name: str  # what to call it in the log ("host CPU", the GPU's name)

    def __post_init__(self) -> None:
        for name, kind in _FIELD_TYPES:
            value = getattr(self, name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise TypeError(f"Hardware.{name} must be a {kind.__name__}, got {value!r}")

    @classmethod
    def of(cls, hardware: Hardware | Mapping[str, Any]) -> Hardware:
        """``hardware`` itself, or the Hardware a dict describes.

        The dict has the keys of ``memscale._core.detect_hardware``: device
        and capacity_bytes, and optionally index (0), count (1), bf16
        (False) and name (the device type).  Any other key is an error.
        """
        if isinstance(hardware, Hardware):
            return hardware
        if not isinstance(hardware, Mapping):
            raise TypeError(
                "hardware must be a memscale Hardware or a dict with the keys of "
                f"memscale._core.detect_hardware, got {type(hardware).__name__}"
            )
        names = [name for name, _ in _FIELD_TYPES]
        unknown = sorted(str(key) for key in hardware if key not in names)
        missing = [key for key in ("device", "capacity_bytes") if key not in hardware]
        if unknown or missing:
            raise ValueError(
                "a hardware dict has the keys " + ", ".join(names) + " (device and "
                "capacity_bytes required)"
                + (f"; unknown: {', '.join(unknown)}" if unknown else "")
                + (f"; missing: {', '.join(missing)}" if missing else "")
            )
        device = hardware["device"]
        return cls(
            device=device,
            index=hardware.get("index", 0),
            count=hardware.get("count", 1),
            capacity_bytes=hardware["capacity_bytes"],
            bf16=hardware.get("bf16", False),
            name=hardware.get("name", device),
        )

    def as_dict(self) -> dict[str, Any]:
        """The description as the dict ``memscale._core.detect_hardware``
        returns."""
        return {name: getattr(self, name) for name, _ in _FIELD_TYPES}


_FIELD_TYPES: tuple[tuple[str, type], ...] = (
    ("device", str),
    ("index", int),
    ("count", int),
    ("capacity_bytes", int),
    ("bf16", bool),
    ("name", str),
)


def detect(device_type: str, index: int = 0) -> Hardware:
    """The ``device_type`` device numbered ``index`` of this machine (the
    host's RAM for "cpu"); ``ValueError`` for a type memscale does not
    plan for, ``RuntimeError`` when it is not there."""
    return Hardware.of(_core.detect_hardware(device_type, index))


def assumed(device_type: str, index: int, capacity_bytes: int) -> Hardware:
    """A device memscale cannot detect, described by its size alone: one
    of it, no bfloat16, named by its type."""
    return Hardware(
        device=device_type,
        index=index,
        count=1,
        capacity_bytes=capacity_bytes,
        bf16=False,
        name=device_type,
    )
