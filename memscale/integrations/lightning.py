"""memscale for PyTorch Lightning.

::

    from memscale.integrations.lightning import MemScaleCallback
    trainer = Trainer(..., callbacks=[MemScaleCallback(config)])

The callback subclasses the ``Callback`` of every Lightning package that is
installed (``lightning.pytorch`` and the older ``pytorch_lightning``; the
``lightning`` package installs both), so one class works with either
``Trainer``.  Without either, importing this module raises an
``ImportError`` that names the extra to install.

- ``on_fit_start``: the LightningModule is on its device and the
  optimizers are built.  memscale wraps the LightningModule; a single
  optimizer sharpens the estimate (with several, Adam is assumed for every
  parameter).
- The plan is made inside the first training forward, from its own
  inputs (on fake tensors), and that forward already runs under it, as
  with ``memscale.wrap(model)``: when ``training_step`` calls
  ``self(...)``, or a submodule that holds every layer memscale plans
  (``self.model(**batch)`` around a Hugging Face model).
- A ``training_step`` that calls several submodules directly (an encoder,
  then a decoder) reaches no single forward that sees the whole model.
  With ``MemScaleCallback(plan_from_training_step=True)`` the plan is made
  at ``on_train_batch_start`` of the first training batch, by running
  ``training_step`` on that batch once on fake tensors (``self.log``
  records nothing of that pass; automatic optimization only), and the
  batch's real ``training_step`` already runs under it.  That pass repeats
  the step's other side effects (a counter it bumps, a list it appends
  to), so it is asked for, not done by default.  Without it, the callback
  sees on the first training batch (which then runs unoptimized) that no
  forward planned, says so in a warning naming the two remedies, measures
  the next ``config.warmup_steps`` batches for real, from
  ``on_train_batch_start`` to ``on_before_backward``, and plans after
  them.  Sanity-check and validation batches are never counted.
- ``teardown`` (and ``on_exception``) detach, so nothing is left on the
  module once ``fit`` returns or raises.
- ``state_dict`` stores the Config and the plan's hash in Lightning
  checkpoints.  A run resumed with ``fit(ckpt_path=...)`` plans with the
  stored Config (unless the callback was given one), and when its plan is
  made, checks that the hash is the stored one; a different hash (the
  model, the batch shapes, the hardware or the Config changed) gives a
  ``RuntimeWarning``.
"""

from __future__ import annotations

import importlib
import logging
import warnings
import weakref
from typing import Any

import torch

from .. import api
from ..config import AsyncOffloadConfig, Config
from . import _common

logger = logging.getLogger(__name__)

__all__ = ["MemScaleCallback"]

_STATE_VERSION = 1


def _callback_bases() -> tuple[type, ...]:
    bases: list[type] = []
    first_error: ImportError | None = None
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            first_error = first_error or exc
            continue
        callback = module.Callback
        # One package may re-export the other's class: keep each class
        # once, and only the most derived of related ones.
        if any(issubclass(base, callback) for base in bases):
            continue
        bases = [base for base in bases if not issubclass(callback, base)]
        bases.append(callback)
    if not bases:
        assert first_error is not None
        raise _common.missing_framework(
            "PyTorch Lightning", "lightning (or pytorch_lightning)", "lightning", first_error
        ) from first_error
    return tuple(bases)


_BASES = _callback_bases()


class _TrainingStep(torch.nn.Module):
    """A module whose forward is the LightningModule's ``training_step``
    (the LightningModule is its one submodule): what memscale profiles on
    fake tensors to plan from the first batch.  During the call the
    LightningModule is detached from its Trainer (``_trainer`` None, put
    back after), so that ``self.log`` records nothing of the fake pass."""

    def __init__(self, module: Any) -> None:
        super().__init__()
        self.module = module
        step = module.training_step
        try:
            takes_index = _signature_utils().is_param_in_hook_signature(
                step, "batch_idx", min_args=2
            )
        except ImportError:
            takes_index = True
        self._takes_index = bool(takes_index)

    def forward(self, batch: Any, batch_idx: int) -> Any:
        module = self.module
        trainer = module.__dict__.get("_trainer")
        module._trainer = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # self.log's "no Trainer" warning
                if self._takes_index:
                    return module.training_step(batch, batch_idx)
                return module.training_step(batch)
        finally:
            module._trainer = trainer


def _signature_utils() -> Any:
    for name in (
        "lightning.pytorch.utilities.signature_utils",
        "pytorch_lightning.utilities.signature_utils",
    ):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("no Lightning signature_utils")


def _config_from_dict(data: dict[str, Any]) -> Config:
    data = dict(data)
    if isinstance(data.get("async_config"), dict):
        data["async_config"] = AsyncOffloadConfig(**data["async_config"])
    return Config(**data)


class MemScaleCallback(*_BASES):  # type: ignore[misc]
    """A Lightning ``Callback`` that applies memscale to the LightningModule
    from ``on_fit_start`` to ``teardown``; see the module docstring.

    ``config`` is a :class:`memscale.Config` (None: the one stored in the
    checkpoint a run resumes from, else ``Config()``).
    ``plan_from_training_step=True`` plans at the first training batch by
    running ``training_step`` on it once on fake tensors (for a
    ``training_step`` that calls several submodules directly).  While fitting,
    :attr:`executor` is memscale's executor; :attr:`plan_hash` is the hash
    of the last plan made (kept after teardown, and saved in checkpoints).
    """

    def __init__(
        self, config: Config | None = None, *, plan_from_training_step: bool = False
    ) -> None:
        if config is not None and not isinstance(config, Config):
            raise TypeError(
                "MemScaleCallback(config=...) must be a memscale.Config "
                f"or None, got {type(config).__name__}"
            )
        if not isinstance(plan_from_training_step, bool):
            raise TypeError(
                "MemScaleCallback(plan_from_training_step=...) must be True or "
                f"False, got {plan_from_training_step!r}"
            )
        self.config = config
        self.plan_from_training_step = plan_from_training_step
        self.plan_hash: str | None = None
        self._expected_hash: str | None = None
        self._executor: Any = None
        self._module_ref: weakref.ref[torch.nn.Module] | None = None
        self._in_pass = False
        self._checked = False
        # Whether the callback marks the profiled passes itself (None: not
        # known before the first training batch has run).
        self._bracket: bool | None = None
        self._forwards_before: int | None = None
        self._last_figures: dict[str, int] = {}

    @property
    def executor(self) -> Any:
        """memscale's executor on the LightningModule while fitting, else None."""
        return self._executor

    # ---- fit lifecycle ------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        zero = bool(getattr(trainer, "is_global_zero", True))
        self._release(log_summary=False)  # a fit that never tore down
        if pl_module.__dict__.get(api.ATTR) is not None:
            if zero:
                logger.warning(
                    "memscale: the LightningModule is already wrapped by "
                    "memscale.wrap(); the MemScaleCallback leaves that wrapping "
                    "as it is. Call memscale.detach(module) before fit() to let "
                    "the callback manage it."
                )
            return
        config = _common.for_rank(self.config if self.config is not None else Config(), zero)
        optimizers = list(getattr(trainer, "optimizers", None) or [])
        optimizer = _common.unwrap_optimizer(optimizers[0]) if len(optimizers) == 1 else None
        precision = str(getattr(trainer, "precision", ""))
        _common.check_step_in_backward(
            config,
            "Lightning Trainer",
            clip=("Trainer(gradient_clip_val=...)", getattr(trainer, "gradient_clip_val", None)),
            accumulation=(
                "Trainer(accumulate_grad_batches=...)",
                int(getattr(trainer, "accumulate_grad_batches", 1) or 1),
            ),
            fp16=(f"Trainer(precision={precision!r})", precision.startswith("16")),
            optimizers=len(optimizers),
        )
        api.wrap(pl_module, config, optimizer=optimizer)
        self._executor = pl_module.__dict__[api.ATTR]
        self._module_ref = weakref.ref(pl_module)
        self._in_pass = False
        self._checked = False
        self._bracket = None
        self._forwards_before = None
        self._last_figures = {}
        if zero:
            logger.info(
                "memscale: attached to %s for fit() (optimizer: %s)",
                type(pl_module).__name__,
                type(optimizer).__name__
                if optimizer is not None
                else f"{len(optimizers)} optimizers, Adam assumed",
            )

    def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        executor = self._executor
        if (
            self.plan_from_training_step
            and executor is not None
            and self._bracket is None
            and executor.plans_on_first_forward
            and getattr(pl_module, "automatic_optimization", False)
        ):
            batch = args[0] if args else kwargs.get("batch")
            batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
            # Plan from this batch's training_step, on fake tensors, so that
            # it runs under the plan (False: planned on the first forward).
            executor.plan_from_step(_TrainingStep(pl_module), (batch, batch_idx), {})
        if (
            executor is None
            or self._in_pass
            or not (executor.state == "profiling" or executor.plans_on_first_forward)
        ):
            return
        if self._bracket is None:  # first batch: does forward run?
            self._forwards_before = executor.stats["training_forwards"]
        elif self._bracket and executor.state == "profiling":
            # Open the pass as the LightningModule's forward pre-hook would
            # (the executor's own hook, called by hand).
            executor.enter_root(pl_module)
            self._in_pass = True

    def on_before_backward(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self._end_pass(pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self._end_pass(pl_module)  # a step without backward
        executor = self._executor
        if executor is not None and self._bracket is None and self._forwards_before is not None:
            # training_step did not call self(...) if no training forward
            # of the LightningModule was counted during the batch.
            self._bracket = executor.stats["training_forwards"] == self._forwards_before
            if self._bracket and executor.plans_on_first_forward:
                # Neither the LightningModule's forward nor a module that
                # holds every planning unit ran: no inputs to plan from.
                logger.warning(
                    "memscale: training_step calls neither the "
                    "LightningModule's forward nor one module holding "
                    "every layer memscale plans, so the first batch ran "
                    "unoptimized; measuring the next %d training steps "
                    "for real (they run unoptimized too), then planning. "
                    "To have the plan from the first batch, call self(...) "
                    "in training_step, or use "
                    "MemScaleCallback(plan_from_training_step=True)%s.",
                    executor.config.warmup_steps,
                    " (its pass on fake tensors failed: see the log above)"
                    if self.plan_from_training_step
                    else "",
                )
                executor.measure_real_steps()
            if self._bracket and executor.state == "profiling":
                logger.debug(
                    "memscale: training_step does not call the "
                    "LightningModule's forward; the callback marks "
                    "the profiled passes"
                )
        self._check_plan()

    def on_exception(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self._release(log_summary=False)

    def teardown(
        self, trainer: Any, pl_module: Any, stage: Any = None, *args: Any, **kwargs: Any
    ) -> None:
        self._release(log_summary=bool(getattr(trainer, "is_global_zero", True)))

    # ---- checkpoints --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        config = self.config if self.config is not None else Config()
        return {"version": _STATE_VERSION, "config": config.to_dict(), "plan_hash": self.plan_hash}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._expected_hash = state_dict.get("plan_hash")
        stored = state_dict.get("config")
        if stored is None:
            return
        try:
            config = _config_from_dict(stored)
        except (TypeError, ValueError) as exc:
            warnings.warn(
                f"memscale: the Config stored in the checkpoint cannot "
                f"be restored ({exc}); this run plans with "
                f"{'the given Config' if self.config else 'Config()'}",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        if self.config is None:
            self.config = config
        elif self.config != config:
            warnings.warn(
                "memscale: this MemScaleCallback's Config differs from "
                "the one stored in the checkpoint; the given one is "
                "used, so the plan may differ from the saved run's",
                RuntimeWarning,
                stacklevel=2,
            )

    # ---- internals ----------------------------------------------------------

    def _end_pass(self, pl_module: Any) -> None:
        if not self._in_pass:
            return
        self._in_pass = False
        executor = self._executor
        if executor is not None:
            # Ends the pass (a no-op if the module's own forward hook ended
            # it); after the last warm-up pass this plans and applies.
            executor.leave_root(pl_module)

    def _check_plan(self) -> None:
        executor = self._executor
        if executor is None or executor.plan is None:
            return
        # The last plan made (use_static_profiling=False makes the plan
        # again after the measured steps).
        self.plan_hash = executor.plan.hash
        if self._checked:
            return
        self._checked = True
        expected = self._expected_hash
        if expected is not None and expected != self.plan_hash:
            warnings.warn(
                f"memscale: the resumed run's plan ({self.plan_hash[:12]}) differs "
                f"from the plan stored in the checkpoint ({expected[:12]}): the "
                "model, the batch shapes, the hardware or the Config changed",
                RuntimeWarning,
                stacklevel=2,
            )

    def figures(self) -> dict[str, int]:
        """memscale's figures (``memscale/...`` keys: projected peak without
        and with the plan, bytes saved, checkpointed layers, recomputes)
        once a plan exists; after teardown, the last ones of the fit."""
        if self._executor is not None:
            return _common.figures(self._executor)
        return dict(self._last_figures)

    def _release(self, log_summary: bool) -> None:
        """Detach what this callback attached (idempotent)."""
        if self._executor is None:
            return
        self._check_plan()
        executor, ref = self._executor, self._module_ref
        self._last_figures = _common.figures(executor)
        self._executor = None
        self._module_ref = None
        self._in_pass = False
        if log_summary:
            logger.info("memscale: fit ended; %s; detached", _common.summary(executor))
        module = ref() if ref is not None else None
        if module is not None and module.__dict__.get(api.ATTR) is executor:
            api.detach(module)
        else:
            executor.detach()

    def __repr__(self) -> str:
        state = "idle" if self._executor is None else self._executor.state
        return f"<memscale MemScaleCallback {state}>"
