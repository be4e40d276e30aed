"""memscale: a drop-in training-memory optimizer for PyTorch.

``memscale.wrap(model)`` profiles the model and the hardware, lets a
deterministic engine decide layer by layer where to apply activation
checkpointing, and attaches it through hooks; ``memscale.detach(model)``
takes it all off again.
"""

import logging

from ._budget import MemoryBudgetError
from ._entry import detach, wrap
from ._planner import estimate_savings, predict_peak
from ._recompute_check import RecomputeMismatchError
from ._version import __version__
from .api import apply_all_optimizations, optimize
from .config import AsyncOffloadConfig, Config, OptimizationMode

__all__ = [
    "AsyncOffloadConfig",
    "Config",
    "MemoryBudgetError",
    "OptimizationMode",
    "RecomputeMismatchError",
    "__version__",
    "apply_all_optimizations",
    "detach",
    "estimate_savings",
    "optimize",
    "predict_peak",
    "wrap",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
