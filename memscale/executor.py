"""The executor object stored on a wrapped model.

The hooks and the checkpointing machinery are in C
(``memscale._core.Executor``); this subclass only keeps what the Python
layer needs to undo its own changes and to report: the effective Config,
the hardware, and the restore actions run by ``detach``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

from . import _core
from .config import Config

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class Executor(_core.Executor):
    """Applies a memscale plan to one model; see ``memscale.wrap``.

    Attributes set by ``wrap``: ``config`` (the effective Config),
    ``hardware`` (the device description the plan was made for),
    ``profiling`` ("static", "empirical" or "warmup"), ``profile`` (what
    was measured per layer, including output bytes and forward FLOPs),
    ``decision`` (Stage 1's ``memscale.policy.StrategyDecision``, with its
    ``decision_source``; None until made) and ``metrics_server`` (the
    ``memscale.observability.MetricsServer`` serving this model's metrics,
    or None) and ``offload_store`` (the disk tier of offload, a
    ``memscale._core.SpillStore`` whose ``stats`` count what was spilled,
    or None), ``optimizer`` (the optimizer ``wrap`` was given, or its 8-bit
    replacement with ``use_8bit_optimizer``; None without one).
    """

    config: Config
    hardware: dict[str, Any]
    profiling: str
    profile: Any  # the _planning.Profile measured (None while warming up)
    decision: Any  # a memscale.policy.StrategyDecision, or None until made
    metrics_server: Any  # a memscale.observability.MetricsServer, or None

    def _init_python_state(self, config: Config, hardware: dict[str, Any],
                           profiling: str) -> None:
        self.config = config
        self.hardware = hardware
        self.profiling = profiling
        self.profile = None
        self.decision = None
        self.metrics_server = None
        self.offload_store = None  # the disk tier (a _core.SpillStore), if any
        self.offload_host = None  # the host tier (memscale.offload.HostTier), if any
        self.optimizer: torch.optim.Optimizer | None = None  # the optimizer to train with (replaced when 8-bit)
        self.recompute_check: Any = None  # memscale._recompute_check.RecomputeCheck
        self._restore: list[Callable[[], None]] = []

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within the block every hook of this executor does nothing: the
        model runs exactly as without memscale (other hooks still run)."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def on_detach(self, action: Callable[[], None]) -> None:
        """Run ``action`` when the executor is detached (LIFO order)."""
        self._restore.append(action)

    def detach(self) -> None:
        """Remove every hook and undo every change; idempotent."""
        try:
            super().detach()
        finally:
            while self._restore:
                action = self._restore.pop()
                try:
                    action()
                except Exception:  # keep undoing the rest
                    logger.exception("memscale: a restore step failed")

    def __repr__(self) -> str:
        plan = self.plan
        summary = f"plan={plan.hash[:12]}" if plan is not None else "no plan"
        return f"<memscale Executor state={self.state} {summary}>"
