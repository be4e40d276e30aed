"""What the framework integrations (``hf.py``, ``lightning.py``) share:
the ImportError of a missing framework, the model and optimizer inside the
frameworks' wrappers, the Config of a rank other than zero, and memscale's
figures for a training log."""

from __future__ import annotations

from typing import Any

import torch

from .._format import format_bytes

__all__ = [
    "figures",
    "for_rank",
    "missing_framework",
    "summary",
    "unwrap_model",
    "unwrap_optimizer",
]


def missing_framework(what: str, package: str, extra: str, exc: ImportError) -> ImportError:
    """The ImportError an integration raises when its framework is missing."""
    return ImportError(
        f"memscale's {what} integration needs the {package} package, which "
        f"could not be imported ({type(exc).__name__}: {exc}). Install it with: "
        f"pip install 'memscale[{extra}]'"
    )


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward a wrapper runs: DDP / DataParallel
    (``.module``) and ``torch.compile`` (``._orig_mod``) call their inner
    module, so memscale's hooks go on that one and fire through the
    wrapper."""
    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    for _ in range(16):  # wrappers nest a few levels at most
        if isinstance(model, parallel):
            model = model.module
            continue
        inner = model.__dict__.get("_modules", {}).get("_orig_mod")
        if isinstance(inner, torch.nn.Module) and type(model).__name__ == "OptimizedModule":
            model = inner
            continue
        break
    return model


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside the wrappers frameworks put around it
    (accelerate's ``AcceleratedOptimizer`` and Lightning's
    ``LightningOptimizer`` keep it as ``.optimizer`` / ``._optimizer``), so
    that memscale estimates the state of the real optimizer class.  None if
    there is no torch optimizer (memscale then assumes Adam)."""
    for _ in range(16):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def for_rank(config: Any, rank_zero: bool) -> Any:
    """The Config a process other than rank zero wraps with: no log
    messages, no log file and no metrics port (every rank would write the
    same file and bind the same port).  Rank zero keeps ``config``."""
    if rank_zero:
        return config
    changes: dict[str, Any] = {}
    if config.enable_logging:
        changes["enable_logging"] = False
    if config.log_file is not None:
        changes["log_file"] = None
    if config.observability_port is not None:
        changes["observability_port"] = None
    return config.replace(**changes) if changes else config


def figures(executor: Any) -> dict[str, int]:
    """memscale's figures for a training log, once a plan exists: the
    projected peak without and with the plan, the bytes the plan saves,
    the checkpointed layers and the recomputes so far.  Empty while the
    executor is still profiling."""
    plan = getattr(executor, "plan", None)
    if plan is None:
        return {}
    return {
        "memscale/peak_unoptimized_bytes": int(plan.peak_unoptimized_bytes),
        "memscale/peak_projected_bytes": int(plan.peak_projected_bytes),
        "memscale/bytes_saved": int(plan.peak_unoptimized_bytes - plan.peak_projected_bytes),
        "memscale/checkpointed_layers": int(plan.technique_counts["checkpoint"]),
        "memscale/recomputes": int(executor.stats["recomputes"]),
    }


def summary(executor: Any) -> str:
    """One line for the log at the end of training."""
    plan = executor.plan
    if plan is None:
        if executor.profiling == "first_step":
            return "no plan was made: no training forward ran"
        return (
            "no plan was made: training ended during the warm-up "
            f"({executor.stats['steps']} of {executor.config.warmup_steps} "
            "forward passes profiled)"
        )
    return (
        f"plan {plan.hash[:12]} checkpointed "
        f"{plan.technique_counts['checkpoint']} of {len(plan)} layers, "
        f"projected peak {format_bytes(plan.peak_unoptimized_bytes, digits=1)} -> "
        f"{format_bytes(plan.peak_projected_bytes, digits=1)}, "
        f"{executor.stats['recomputes']} recomputes"
    )


def check_step_in_backward(
    config: Any,
    framework: str,
    *,
    clip: tuple[str, Any],
    accumulation: tuple[str, int],
    fp16: tuple[str, bool],
    optimizers: int,
) -> None:
    """Refuse, before anything is attached, a training set-up the step in
    backward (``Config.optimizer_in_backward``) would silently change: each
    item names the framework's setting, then its value."""
    if not config.optimizer_in_backward:
        return
    where = f"memscale: Config.optimizer_in_backward with the {framework}"
    name, value = clip
    if value:
        raise ValueError(
            f"{where}: gradient clipping by norm ({name}={value!r}) needs every "
            "gradient before any parameter is updated, and the update runs as "
            f"each gradient is ready, which frees it; set {name} to 0/None, or "
            "optimizer_in_backward=False"
        )
    name, steps = accumulation
    if steps > 1:
        raise ValueError(
            f"{where}: gradient accumulation ({name}={steps}) sums gradients "
            "over several backward passes, and the update runs in each; set "
            f"{name}=1 (and a larger batch), or optimizer_in_backward=False"
        )
    name, on = fp16
    if on:
        raise ValueError(
            f"{where}: FP16 mixed precision ({name}) needs a GradScaler, which "
            "unscales and checks every gradient before the update; use BF16, "
            "or optimizer_in_backward=False"
        )
    if optimizers != 1:
        raise ValueError(
            f"{where}: it needs exactly one optimizer, and the {framework} has "
            f"{optimizers}; use one optimizer, or optimizer_in_backward=False"
        )
