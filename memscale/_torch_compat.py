"""The one place memscale touches private torch APIs.

Static profiling runs the model on fake tensors (shapes and dtypes, no
memory), which torch provides only through ``torch._subclasses``.  Private
APIs move between releases, so each use is checked here and has a fallback:
if fake tensors are unavailable or fail, profiling falls back to a real
forward pass (``Config.use_empirical_fallback``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

# Releases this module was checked against; newer ones are tried, and any
# failure is reported and falls back.
TESTED_TORCH = ((2, 4), (2, 13))


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch."""
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def storage_key(t: torch.Tensor) -> int:
    """The identity of a tensor's storage: views share one.

    ``UntypedStorage._cdata`` is the storage implementation's address; unlike
    ``data_ptr()`` it is also defined for meta and fake tensors.  The C
    profiler uses the same attribute (csrc/module.c).
    """
    return t.untyped_storage()._cdata


def fake_tensor_mode() -> tuple[Any, Callable[[torch.Tensor], torch.Tensor]] | None:
    """A FakeTensorMode and a converter from real to fake tensors.

    Returns None when this torch has no usable FakeTensorMode; callers then
    profile with real tensors.
    """
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:  # pragma: no cover - depends on the torch release
        logger.info("fake tensors are unavailable in torch %s", torch.__version__)
        return None
    if torch_version() < TESTED_TORCH[0]:  # pragma: no cover
        return None
    mode = FakeTensorMode(allow_non_fake_inputs=False)

    def convert(t: torch.Tensor) -> torch.Tensor:
        fake = mode.from_tensor(t)
        if t.requires_grad and not fake.requires_grad:  # pragma: no cover
            fake.requires_grad_(True)
        return fake

    return mode, convert
