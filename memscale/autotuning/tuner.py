"""The AutoTuner: the cheapest Config that fits, and the largest batch.

Every candidate is judged by the OOM predictor (:mod:`memscale.predictor`):
one training step simulated on fake tensors under the plan ``wrap`` makes
with that Config.  The cost of a candidate is its predicted step-time ratio
(``1 + recompute FLOPs / (3 x forward FLOPs)``), so the cheapest candidate
is the one that recomputes least.  The winner is then confirmed by a
measured trial: one real training step on the real model
(:func:`memscale.autotuning.trial.measure_step`), whose state is put back
afterwards.  The same model, input, budget and measurements give the same
answer: candidates are generated and ranked in a fixed order.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _planning
from .._format import format_bytes
from .._planner import PredictionSession
from ..config import GIB, Config, OptimizationMode
from ..predictor import PeakPrediction, resolve_device
from .trial import measure_step

logger = logging.getLogger(__name__)

__all__ = ["AutoTuner", "BatchSizeResult", "Choice", "NoConfigFits", "TuneResult"]

_MODES = (OptimizationMode.CONSERVATIVE, OptimizationMode.BALANCED, OptimizationMode.AGGRESSIVE)
# Steps of the search over the engine's budget, when the plan the engine
# picks for the real budget is predicted not to fit (see _tighter).
_BUDGET_SEARCH_STEPS = 24
# The batch-size search stops doubling here when ``high`` is not given.
_MAX_BATCH = 1 << 24


def _fmt(n: float) -> str:
    return format_bytes(n, digits=1)


def _quiet(config: Config) -> Config:
    """The Config a trial wraps with: the same plan, without the plan log
    or a verification replay in every trial."""
    return config.replace(enable_logging=False, verify_correctness=False)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int | None, desc: str) -> Any:
    """A tqdm bar on stderr when stderr is a terminal (and tqdm is
    installed); otherwise a stand-in that does nothing."""
    if not sys.stderr.isatty():
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)


@dataclasses.dataclass(frozen=True)
class Choice:
    """One candidate Config and what is known of it."""

    config: Config
    plan_hash: str
    checkpointed_layers: int
    predicted_peak_bytes: int
    predicted_time_ratio: float
    # Predicted peak <= budget.
    fits: bool
    # Peak of the measured trial, None when not tried.
    measured_peak_bytes: int | None
    # "chosen", "runner-up", "over budget (predicted)",
    # "over budget (measured)".
    status: str

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["config"] = self.config.to_dict()
        return out


def _choice_rows(choices: tuple[Choice, ...]) -> list[str]:
    rows = [
        (
            "mode",
            "force",
            "engine budget",
            "layers",
            "predicted peak",
            "measured peak",
            "step time",
            "status",
        )
    ]
    for c in choices:
        rows.append(
            (
                c.config.mode.value,
                "yes" if c.config.force_optimize else "no",
                _fmt(_planning.budget_bytes(c.config, None))
                if c.config.memory_budget_gb is not None
                else "-",
                str(c.checkpointed_layers),
                _fmt(c.predicted_peak_bytes),
                "-" if c.measured_peak_bytes is None else _fmt(c.measured_peak_bytes),
                f"x{c.predicted_time_ratio:.2f}",
                c.status,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """What :meth:`AutoTuner.tune` returns; ``str()`` prints a table."""

    # The cheapest Config whose predicted peak fits; pass it to wrap().
    config: Config
    # The prediction for it.
    prediction: PeakPrediction
    # The usable memory the search fitted into.
    budget_bytes: int
    # Peak of the measured trial (None without trials), and whether it
    # confirmed the prediction (measured peak <= budget).
    measured_peak_bytes: int | None
    confirmed: bool
    # Every distinct plan considered, cheapest first: the chosen one, the
    # runner-ups, and those over budget.
    choices: tuple[Choice, ...]

    @property
    def runner_ups(self) -> tuple[Choice, ...]:
        return tuple(c for c in self.choices if c.status == "runner-up")

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "prediction": self.prediction.to_dict(),
            "budget_bytes": self.budget_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "confirmed": self.confirmed,
            "choices": [c.to_dict() for c in self.choices],
        }

    def __str__(self) -> str:
        p = self.prediction
        head = (
            f"memscale AutoTuner: budget {_fmt(self.budget_bytes)}; chosen: "
            f"mode={self.config.mode.value} force_optimize="
            f"{self.config.force_optimize} memory_budget_gb="
            f"{self.config.memory_budget_gb!r}, predicted peak "
            f"{_fmt(p.optimized.peak_bytes)}, step time x{p.time_ratio:.2f}"
        )
        if self.measured_peak_bytes is not None:
            head += (
                f", measured {_fmt(self.measured_peak_bytes)} "
                f"({'confirmed' if self.confirmed else 'NOT confirmed'})"
            )
        return "\n".join([head] + _choice_rows(self.choices))


class NoConfigFits(RuntimeError):
    """No candidate Config fits the budget; ``.choices`` lists them all."""

    def __init__(self, message: str, choices: tuple[Choice, ...]) -> None:
        super().__init__(message)
        self.choices = choices


@dataclasses.dataclass(frozen=True)
class BatchSizeResult:
    """What :meth:`AutoTuner.max_batch_size` returns."""

    batch_size: int
    config: Config
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int | None
    confirmed: bool
    # (batch size, predicted peak, fits) of every prediction made, in order.
    predictions: tuple[tuple[int, int, bool], ...]
    # (batch size, measured peak) of every trial, in order.
    trials: tuple[tuple[int, int], ...]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["config"] = self.config.to_dict()
        return out

    def __str__(self) -> str:
        lines = [
            f"memscale AutoTuner: largest batch {self.batch_size} under "
            f"mode={self.config.mode.value}, budget {_fmt(self.budget_bytes)}: "
            f"predicted {_fmt(self.predicted_peak_bytes)}"
            + (
                ""
                if self.measured_peak_bytes is None
                else f", measured {_fmt(self.measured_peak_bytes)}"
                f" ({'confirmed' if self.confirmed else 'NOT confirmed'})"
            )
        ]
        for b, peak, fits in self.predictions:
            lines.append(
                f"  batch {b:>6}: predicted {_fmt(peak):>10}  {'fits' if fits else 'over budget'}"
            )
        return "\n".join(lines)


class AutoTuner:
    """Find the cheapest Config whose predicted peak fits a memory budget.

    ``model`` and ``sample_input`` are what you will train (the model must
    not be wrapped by memscale).  ``optimizer`` is the one you train with
    (default AdamW); it is never stepped: trials use a fresh one of the
    same class.  ``budget_bytes`` is the memory to fit in (default: the
    device's usable memory, capacity x ``target_gpu_utilization``).
    ``device`` (a name or :class:`memscale.predictor.DeviceSpec`),
    ``loss_fn`` and ``base_config`` (the Config the candidates are derived
    from, by mode, ``force_optimize`` and ``memory_budget_gb``; default
    ``Config()``) are optional keywords.
    """

    def __init__(
        self,
        model: nn.Module,
        sample_input: Any,
        optimizer: torch.optim.Optimizer | None = None,
        budget_bytes: int | None = None,
        *,
        device: Any = None,
        loss_fn: Callable[[Any], Any] | None = None,
        base_config: Config | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"AutoTuner needs a torch.nn.Module, got {type(model).__name__}")
        if base_config is None:
            base_config = Config()
        elif not isinstance(base_config, Config):
            raise TypeError(
                f"base_config must be a memscale.Config or None, got {type(base_config).__name__}"
            )
        if budget_bytes is not None and (
            isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1
        ):
            raise ValueError(
                "budget_bytes must be an int >= 1 or None (the "
                f"device's usable memory), got {budget_bytes!r}"
            )
        if model.__dict__.get("_memscale_executor") is not None:
            raise RuntimeError(
                "the AutoTuner tunes a model memscale has not "
                "wrapped; call memscale.detach(model) first"
            )
        if sample_input is None:
            raise ValueError(
                "AutoTuner needs sample_input (one batch) to predict and measure a training step"
            )
        self.model = model
        self.sample_input = sample_input
        self.optimizer = optimizer
        self.device = device
        self.loss_fn = loss_fn
        self.base_config = base_config
        if budget_bytes is None:
            hardware, _ = resolve_device(model, device, base_config)
            budget_bytes = _planning.budget_bytes(base_config, hardware)
        self.budget_bytes = int(budget_bytes)

    # ---- tune ----------------------------------------------------------

    def _config(self, mode: OptimizationMode, force: bool, engine_budget: int) -> Config:
        return self.base_config.replace(
            mode=mode, force_optimize=force, memory_budget_gb=engine_budget / GIB
        )

    def _candidates(self, session: PredictionSession) -> list[tuple[Config, PeakPrediction]]:
        """Every candidate, in a fixed order, with its prediction; one per
        distinct plan (the first Config giving it)."""
        seen: dict[tuple[tuple[str, ...], ...], int] = {}
        out: list[tuple[Config, PeakPrediction]] = []

        def consider(config: Config) -> PeakPrediction:
            plan = session.plan(config)
            # Plans that apply the same techniques to the same layers run
            # the same step (the mode and budget are recorded in the plan,
            # not acted on): keep the first Config that gives it.
            decisions = tuple(layer.techniques for layer in plan.layers)
            if decisions in seen:
                return out[seen[decisions]][1]
            prediction = session.predict(config)
            seen[decisions] = len(out)
            out.append((config, prediction))
            return prediction

        for force in (False, True):
            for mode in _MODES:
                consider(self._config(mode, force, self.budget_bytes))
        self._tighter(consider)
        return out

    def _tighter(self, consider: Callable[[Config], PeakPrediction]) -> None:
        """When the engine's own plan for the budget is predicted not to
        fit (its estimate is coarser than the simulation), give the engine
        smaller budgets: it then checkpoints more layers, in the same order.
        A bisection finds the largest engine budget whose plan fits."""
        first = consider(self._config(_MODES[0], False, self.budget_bytes))
        if first.optimized.peak_bytes <= self.budget_bytes:
            return
        lo, hi = 1, self.budget_bytes  # hi: plan predicted not to fit
        for _ in range(_BUDGET_SEARCH_STEPS):
            if hi - lo <= 1:
                break
            mid = (lo + hi) // 2
            if (
                consider(self._config(_MODES[0], False, mid)).optimized.peak_bytes
                <= self.budget_bytes
            ):
                lo = mid
            else:
                hi = mid

    def tune(self, *, trial: bool = True, max_trials: int = 3) -> TuneResult:
        """The cheapest Config (least predicted slowdown, then least
        predicted peak) whose predicted peak fits the budget, confirmed by a
        measured trial when ``trial`` (a candidate whose trial exceeds the
        budget is passed over, up to ``max_trials`` trials).  Raises
        :class:`NoConfigFits` when no candidate is predicted to fit."""
        if isinstance(max_trials, bool) or not isinstance(max_trials, int) or max_trials < 1:
            raise ValueError(f"max_trials must be an int >= 1, got {max_trials!r}")
        with PredictionSession(
            self.model,
            self.sample_input,
            self.optimizer,
            self.device,
            loss_fn=self.loss_fn,
            config=self.base_config,
        ) as session:
            candidates = self._candidates(session)
        ranked = sorted(
            range(len(candidates)),
            key=lambda i: (
                candidates[i][1].optimized.peak_bytes > self.budget_bytes,
                round(candidates[i][1].time_ratio, 12),
                candidates[i][1].optimized.peak_bytes,
                i,
            ),
        )
        budget = self.budget_bytes
        fitting = [i for i in ranked if candidates[i][1].optimized.peak_bytes <= budget]
        measured: dict[int, int] = {}
        chosen: int | None = None
        if fitting and trial:
            bar = _progress(min(max_trials, len(fitting)), "memscale trials")
            try:
                for i in fitting[:max_trials]:
                    config = candidates[i][0]
                    bar.set_postfix_str(
                        f"{config.mode.value}, {len(candidates[i][1].checkpointed_layers)} layers"
                    )
                    report = measure_step(
                        self.model,
                        self.sample_input,
                        _quiet(config),
                        self.optimizer,
                        loss_fn=self.loss_fn,
                    )
                    measured[i] = report.peak_bytes
                    bar.update(1)
                    if report.peak_bytes <= budget:
                        chosen = i
                        break
                    logger.info(
                        "memscale: the trial of %s measured %s, over the "
                        "budget %s; trying the next choice",
                        config,
                        _fmt(report.peak_bytes),
                        _fmt(budget),
                    )
            finally:
                bar.close()
        elif fitting:
            chosen = fitting[0]
        choices = []
        for i in ranked:
            config, prediction = candidates[i]
            fits = prediction.optimized.peak_bytes <= budget
            if i == chosen:
                status = "chosen"
            elif i in measured:
                status = "over budget (measured)"
            elif not fits:
                status = "over budget (predicted)"
            else:
                status = "runner-up"
            choices.append(
                Choice(
                    config,
                    prediction.plan_hash,
                    len(prediction.checkpointed_layers),
                    prediction.optimized.peak_bytes,
                    prediction.time_ratio,
                    fits,
                    measured.get(i),
                    status,
                )
            )
        choices_t = tuple(choices)
        if chosen is None:
            best = min((c.predicted_peak_bytes for c in choices_t), default=0)
            why = (
                "no candidate is predicted to fit"
                if not fitting
                else f"every trial ({len(measured)}) measured over the budget"
            )
            raise NoConfigFits(
                f"memscale AutoTuner: {why}: the least predicted peak is "
                f"{_fmt(best)} for a budget of {_fmt(budget)}. Use a smaller "
                "batch (AutoTuner.max_batch_size finds the largest that fits), "
                "a smaller model, or a larger budget.\n" + "\n".join(_choice_rows(choices_t)),
                choices_t,
            )
        config, prediction = candidates[chosen]
        return TuneResult(
            config=config,
            prediction=prediction,
            budget_bytes=budget,
            measured_peak_bytes=measured.get(chosen),
            confirmed=chosen in measured,
            choices=choices_t,
        )

    # ---- max_batch_size ------------------------------------------------

    def max_batch_size(
        self,
        make_input: Callable[[int], Any],
        config: Config | None = None,
        low: int = 1,
        high: int | None = None,
        *,
        trial: bool = True,
        max_trials: int = 3,
    ) -> BatchSizeResult:
        """The largest batch size in ``[low, high]`` whose training step is
        predicted to fit the budget under ``config``'s plan (default: the
        base Config with the budget as its memory budget), found by
        doubling from ``low`` and then bisecting, on predictions, and
        confirmed by a measured trial (a trial over budget shrinks the batch
        in proportion and tries again, up to ``max_trials``).
        ``make_input(batch_size)`` returns the sample input of that size."""
        if not callable(make_input):
            raise TypeError(
                "make_input must be a callable from a batch size to "
                f"a sample input, got {type(make_input).__name__}"
            )
        for name, value in (("low", low), ("high", high), ("max_trials", max_trials)):
            if value is None and name == "high":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if high is not None and high < low:
            raise ValueError(f"high ({high}) must be >= low ({low})")
        if config is None:
            config = self.base_config.replace(memory_budget_gb=self.budget_bytes / GIB)
        elif not isinstance(config, Config):
            raise TypeError(
                f"config must be a memscale.Config or None, got {type(config).__name__}"
            )
        budget = self.budget_bytes
        predictions: list[tuple[int, int, bool]] = []
        known: dict[int, int] = {}
        bar = _progress(None, "memscale batch search")

        def peak(b: int) -> int:
            if b not in known:
                with PredictionSession(
                    self.model,
                    make_input(b),
                    self.optimizer,
                    self.device,
                    loss_fn=self.loss_fn,
                    config=config,
                ) as session:
                    known[b] = session.predict(config).optimized.peak_bytes
                predictions.append((b, known[b], known[b] <= budget))
                bar.update(1)
                bar.set_postfix_str(f"batch {b}: {_fmt(known[b])}")
            return known[b]

        try:
            if peak(low) > budget:
                raise RuntimeError(
                    f"memscale AutoTuner: even batch size {low} is predicted to "
                    f"need {_fmt(known[low])}, over the budget of {_fmt(budget)}; "
                    "use a smaller low, a cheaper Config (AutoTuner.tune) or a "
                    "larger budget"
                )
            good, bad = low, None
            cap = high if high is not None else _MAX_BATCH
            while good < cap:
                nxt = min(good * 2, cap)
                if peak(nxt) <= budget:
                    good = nxt
                else:
                    bad = nxt
                    break
            while bad is not None and bad - good > 1:
                mid = (good + bad) // 2
                if peak(mid) <= budget:
                    good = mid
                else:
                    bad = mid
            trials: list[tuple[int, int]] = []
            confirmed = False
            if trial:
                for _ in range(max_trials):
                    report = measure_step(
                        self.model,
                        make_input(good),
                        _quiet(config),
                        self.optimizer,
                        loss_fn=self.loss_fn,
                    )
                    trials.append((good, report.peak_bytes))
                    bar.update(1)
                    if report.peak_bytes <= budget:
                        confirmed = True
                        break
                    smaller = min(good - 1, math.floor(good * budget / report.peak_bytes))
                    if smaller < low:
                        break
                    logger.info(
                        "memscale: batch %d measured %s, over the budget %s; trying %d",
                        good,
                        _fmt(report.peak_bytes),
                        _fmt(budget),
                        smaller,
                    )
                    good = smaller
                if not confirmed:
                    raise RuntimeError(
                        f"memscale AutoTuner: the trials measured over the budget "
                        f"of {_fmt(budget)} (batch size, peak: {trials}); the "
                        "prediction is off for this model: please report it"
                    )
            predicted = peak(good)
        finally:
            bar.close()
        return BatchSizeResult(
            batch_size=good,
            config=config,
            budget_bytes=budget,
            predicted_peak_bytes=predicted,
            measured_peak_bytes=trials[-1][1] if trials else None,
            confirmed=confirmed,
            predictions=tuple(predictions),
            trials=tuple(trials),
        )
