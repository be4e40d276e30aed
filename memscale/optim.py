"""memscale's 8-bit AdamW, and a factory for the 8-bit optimizer.

``AdamW8bit`` keeps AdamW's two moment estimates in 8 bits per element
(block-wise, one fp32 scale per block; see ``csrc/adam8bit.c``): about 2.1
bytes of state per parameter instead of 8.  The update runs in the C core
on contiguous fp32 CPU tensors with the GIL released.  Parameters it cannot
take (not fp32, not on the CPU, smaller than ``min_8bit_size``) keep fp32
state and the standard AdamW update, so every parameter is handled.

``make_8bit_adamw(params, ...)`` returns bitsandbytes' ``AdamW8bit`` when
bitsandbytes is installed and the parameters are on a CUDA device, else
memscale's own.  ``to_8bit(optimizer)`` builds the 8-bit counterpart of a
``torch.optim.Adam``/``AdamW`` with its parameter groups and
hyper-parameters (what ``apply_all_optimizations`` and
``wrap``/``optimize`` with ``Config(use_8bit_optimizer=True)`` use).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch

from . import _core, _torch_compat

logger = logging.getLogger(__name__)

_QUANTIZED = ("exp_avg", "exp_avg_sq")
_DTYPES = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}


class AdamW8bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with 8-bit moments.

    A real ``torch.optim.Optimizer``: param groups, ``zero_grad``,
    ``state_dict`` / ``load_state_dict`` (the 8-bit state round-trips
    exactly).  ``amsgrad``, ``maximize`` and sparse gradients are not
    supported.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int = 64,
        min_8bit_size: int = 4096,
    ) -> None:
        if not (isinstance(lr, (int, float)) and lr >= 0 and math.isfinite(lr)):
            raise ValueError(f"AdamW8bit: lr must be a finite float >= 0, got {lr!r}")
        if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"AdamW8bit: betas must be two floats in [0, 1), got {betas!r}")
        if not eps > 0:
            raise ValueError(f"AdamW8bit: eps must be > 0, got {eps!r}")
        if not (weight_decay >= 0 and math.isfinite(weight_decay)):
            raise ValueError(f"AdamW8bit: weight_decay must be >= 0, got {weight_decay!r}")
        if not (isinstance(block_size, int) and 1 <= block_size <= 4096):
            raise ValueError(
                f"AdamW8bit: block_size must be an int in [1, 4096], got {block_size!r}"
            )
        if not (isinstance(min_8bit_size, int) and min_8bit_size >= 0):
            raise ValueError(f"AdamW8bit: min_8bit_size must be an int >= 0, got {min_8bit_size!r}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            block_size=block_size,
            min_8bit_size=min_8bit_size,
        )
        super().__init__(params, defaults)
        off_cpu = sorted({p.device.type for g in self.param_groups for p in g["params"]} - {"cpu"})
        if off_cpu:
            # Built directly (not through make_8bit_adamw) on a GPU model:
            # its moments are not quantized (the C kernel runs on the CPU).
            _warn_no_backend(
                f"{'/'.join(off_cpu)} parameters in memscale's AdamW8bit, whose "
                "8-bit kernel runs on CPU tensors only (for CUDA, use "
                "memscale.optim.make_8bit_adamw with bitsandbytes installed)"
            )

    @staticmethod
    def quantizes(p: torch.Tensor, group: dict[str, Any]) -> bool:
        """Whether the moments of ``p`` (in parameter group ``group``) are
        kept in 8 bits: a contiguous float32 CPU tensor of at least
        ``min_8bit_size`` elements; any other keeps float32 moments."""
        return (
            p.device.type == "cpu"
            and p.dtype == torch.float32
            and p.is_contiguous()
            and p.numel() >= group["min_8bit_size"]
        )

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        if self.quantizes(p, group):
            blocks = -(-p.numel() // group["block_size"])
            state["exp_avg"] = torch.zeros(p.numel(), dtype=torch.int8)
            state["exp_avg_scale"] = torch.zeros(blocks, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros(p.numel(), dtype=torch.uint8)
            state["exp_avg_sq_scale"] = torch.zeros(blocks, dtype=torch.float32)
        else:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW8bit does not support sparse gradients")
                state = self.state[p] or self._init_state(p, group)
                state["step"] += 1
                step = int(state["step"].item())
                if state["exp_avg"].dtype == torch.int8:
                    if _torch_compat.is_fake(p):
                        # The OOM predictor's simulated step: the update
                        # allocates nothing, and fake tensors have no data.
                        continue
                    grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                    if grad.data_ptr() == p.data_ptr():
                        grad = grad.clone()
                    _core.adamw8bit_step(
                        p,
                        grad,
                        state["exp_avg"],
                        state["exp_avg_scale"],
                        state["exp_avg_sq"],
                        state["exp_avg_sq_scale"],
                        lr=float(group["lr"]),
                        beta1=float(beta1),
                        beta2=float(beta2),
                        eps=float(group["eps"]),
                        weight_decay=float(group["weight_decay"]),
                        step=step,
                        block=int(group["block_size"]),
                        threads=torch.get_num_threads(),
                    )
                    # Written through data_ptr(): tell autograd it changed.
                    torch.autograd.graph.increment_version(p)
                else:
                    self._fp32_step(p, state, group, step)
        return loss

    @staticmethod
    def _fp32_step(
        p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], step: int
    ) -> None:
        beta1, beta2 = group["betas"]
        grad = p.grad
        p.mul_(1 - group["lr"] * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bc1 = 1 - beta1**step
        bc2_sqrt = math.sqrt(1 - beta2**step)
        denom = (state["exp_avg_sq"].sqrt() / bc2_sqrt).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bc1)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype on load; the
        # 8-bit moments hold small integers, which survive that exactly.
        for state in self.state.values():
            scale = state.get("exp_avg_scale")
            if scale is None:
                continue
            for key in _QUANTIZED:
                state[key] = state[key].to(_DTYPES[key]).reshape(-1)

    def state_bytes(self) -> int:
        """Bytes of optimizer state (tensors with one or more dimensions)."""
        return sum(
            t.numel() * t.element_size()
            for s in self.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )


_warned_no_backend = False


def _warn_no_backend(what: str) -> None:
    global _warned_no_backend
    if not _warned_no_backend:
        _warned_no_backend = True
        logger.warning(
            "memscale: no usable 8-bit optimizer backend for %s; those "
            "parameters keep the standard (float32) AdamW state",
            what,
        )


def make_8bit_adamw(
    params: Iterable[Any],
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
) -> torch.optim.Optimizer:
    """An 8-bit AdamW for ``params``: bitsandbytes' when it is installed and
    the parameters are on CUDA (unverified here: no GPU), else memscale's
    own (``AdamW8bit``)."""
    params = list(params)
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    if tensors and all(t.device.type == "cuda" for t in tensors):
        try:
            import bitsandbytes as bnb  # type: ignore[import-not-found]

            return bnb.optim.AdamW8bit(
                params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
            )
        except Exception as exc:  # noqa: BLE001 - reported, then ours
            logger.info(
                "memscale: bitsandbytes' 8-bit AdamW is not usable (%s: %s); using memscale's",
                type(exc).__name__,
                exc,
            )
    off_cpu = sorted({t.device.type for t in tensors if t.device.type != "cpu"})
    if off_cpu:
        _warn_no_backend(
            f"{'/'.join(off_cpu)} parameters (bitsandbytes is not installed or not usable)"
        )
    return AdamW8bit(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


# Adam/AdamW options AdamW8bit does not have; a group that sets one of
# them to anything but its default cannot be replaced faithfully.
_ADAM_ONLY = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}
_ADAM_IGNORED = ("foreach", "fused", "decoupled_weight_decay")


def is_8bit(optimizer: torch.optim.Optimizer) -> bool:
    """memscale's or bitsandbytes' 8-bit optimizer."""
    return isinstance(optimizer, AdamW8bit) or (
        type(optimizer).__module__.split(".")[0] == "bitsandbytes"
        and "8bit" in type(optimizer).__name__.lower()
    )


def unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot be replaced by an 8-bit AdamW with the same
    behaviour, or None when it can."""
    if isinstance(optimizer, AdamW8bit):
        return None
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        return (
            f"{type(optimizer).__name__} is not an Adam-family optimizer "
            "(torch.optim.Adam or AdamW)"
        )
    if any(s for s in optimizer.state.values()):
        return (
            "it has already taken steps: its float32 moments would be "
            "lost; replace it before the first optimizer.step()"
        )
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    for i, group in enumerate(optimizer.param_groups):
        for key, default in _ADAM_ONLY.items():
            if group.get(key, default) != default:
                return f"param group {i} sets {key}={group[key]!r}"
        if (
            not decoupled
            and not group.get("decoupled_weight_decay", False)
            and group.get("weight_decay", 0) != 0
        ):
            return (
                f"param group {i} uses Adam's L2 weight decay "
                f"({group['weight_decay']}); the 8-bit optimizer decouples "
                "it (AdamW): use torch.optim.AdamW"
            )
        if isinstance(group.get("lr"), torch.Tensor):
            return f"param group {i} has a tensor learning rate"
    return None


def to_8bit(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The 8-bit AdamW counterpart of ``optimizer`` (a ``torch.optim.Adam``
    or ``AdamW`` that has not stepped yet): the same parameters in the same
    groups, with the same lr, betas, eps and weight decay (and any extra
    keys a group carries, such as a scheduler's ``initial_lr``).  Raises
    ``ValueError`` saying why when that cannot be done faithfully.  A
    learning-rate scheduler built on ``optimizer`` must be rebuilt on the
    result."""
    if isinstance(optimizer, AdamW8bit):
        return optimizer
    why = unsupported_reason(optimizer)
    if why is not None:
        raise ValueError(f"memscale cannot replace the optimizer with an 8-bit AdamW: {why}")
    groups = []
    for group in optimizer.param_groups:
        g = {k: v for k, v in group.items() if k not in _ADAM_ONLY and k not in _ADAM_IGNORED}
        g["params"] = list(group["params"])
        g["betas"] = tuple(float(b) for b in group["betas"])
        groups.append(g)
    first = optimizer.param_groups[0] if optimizer.param_groups else {}
    return make_8bit_adamw(
        groups,
        lr=float(first.get("lr", 1e-3)),
        betas=tuple(first.get("betas", (0.9, 0.999))),
        eps=float(first.get("eps", 1e-8)),
        weight_decay=float(first.get("weight_decay", 0.0)),
    )
