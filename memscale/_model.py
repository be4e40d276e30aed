"""What a model holds and what it is given: the device it is on, the bytes
a training step starts with (parameters, buffers, gradients, optimizer
state; :func:`fixed_bytes`), and a sample input as positional and keyword
inputs (:func:`split_input`).

Shared by the profiling (``_planning``), the OOM predictor and the planner;
imports no other part of memscale but the torch compatibility layer, the
walk through nested inputs (``_tree``) and the 8-bit optimizer's class.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from . import _torch_compat
from ._tree import tensors_in
from .config import AsyncOffloadConfig, Config
from .optim import AdamW8bit

__all__ = [
    "Floor",
    "Inputs",
    "fixed_bytes",
    "floor_of",
    "floor_options",
    "model_device",
    "optimizer_state_bytes",
    "split_input",
    "storage_bytes",
    "tensors_of",
]


class Inputs(NamedTuple):
    """Positional and keyword inputs together (a forward's own, as the
    first training forward's are profiled)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def split_input(sample_input: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sample input as (args, kwargs): a tensor, a tuple/list, a dict, or
    :class:`Inputs`."""
    if isinstance(sample_input, Inputs):
        return tuple(sample_input.args), dict(sample_input.kwargs)
    if isinstance(sample_input, torch.Tensor):
        return (sample_input,), {}
    if isinstance(sample_input, (tuple, list)):
        return tuple(sample_input), {}
    if isinstance(sample_input, dict):
        return (), dict(sample_input)
    raise TypeError(
        "sample_input must be a tensor, a tuple/list of positional inputs or "
        f"a dict of keyword inputs, got {type(sample_input).__name__}"
    )


def model_device(model: torch.nn.Module) -> torch.device:
    for tensor in tensors_of(model):
        return tensor.device
    return torch.device("cpu")


def tensors_of(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if callable(getattr(t, "to_local", None)):
            t = t.to_local()  # type: ignore[attr-defined]  # a DTensor (FSDP2): this rank's shard
        key = _torch_compat.storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def check_step_arguments(optimizer: Any, loss_fn: Any) -> None:
    """The ``optimizer`` and ``loss_fn`` a training step is simulated with
    (``wrap``, ``predict_peak``): a TypeError naming the one that is not a
    torch optimizer, or not callable, and not None."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable (the model's output -> its scalar loss) or None, "
            f"got {type(loss_fn).__name__}"
        )


def inference_input_error(sample_input: Any, what: str, failure: str) -> ValueError | None:
    """The error to raise when ``what`` (``wrap``'s profiling, the OOM
    predictor's simulation) failed with ``failure`` on torch's refusal of an
    inference tensor (made under ``torch.inference_mode()``: it has no
    version counter, so autograd cannot save it for backward) and
    ``sample_input`` holds one: a ValueError naming the input; else None.
    A batch made under inference mode that the step never saves (a uint8
    image cast first) is simulated as any other."""
    if "Inference tensors" not in failure:
        return None
    args, kwargs = split_input(sample_input)
    places = [(f"positional input {i}", a) for i, a in enumerate(args)]
    places += [(f"input {k!r}", v) for k, v in kwargs.items()]
    for where, value in places:
        if any(t.is_inference() for t in tensors_in(value)):
            return ValueError(
                f"{what}: sample_input's {where} holds a tensor made under "
                "torch.inference_mode(), which a training step cannot save for "
                "backward; pass a clone made outside it (tensor.clone()), or "
                "make the batch under torch.no_grad()"
            )
    return None


Attributes = list[tuple[torch.nn.Module, dict[str, Any]]]


def attributes(model: torch.nn.Module) -> Attributes:
    """Every module's plain attributes as they are now, for
    :func:`restore_attributes` after a pass of memscale's."""
    return [(module, dict(module.__dict__)) for module in model.modules()]


def restore_attributes(before: Attributes) -> list[tuple[torch.nn.Module, str]]:
    """A forward may keep a tensor in a plain attribute (a cache, a mask, a
    counter it makes on its first call): one kept in a pass of memscale's
    (fake, or a small value made real in it) must not outlive the pass,
    nor change the model the user trains.  Every attribute that holds a
    tensor and was set or rebound since ``before`` gets its old value
    back, or is removed if new; the (module, name) of each."""
    restored = []
    for module, old in before:
        for key, value in list(module.__dict__.items()):
            if key in ("_parameters", "_buffers", "_modules"):
                continue
            if value is old.get(key, _MISSING) or not any(True for _ in tensors_in(value)):
                continue
            if key in old:
                module.__dict__[key] = old[key]
            else:
                del module.__dict__[key]
            restored.append((module, key))
    return restored


_MISSING = object()


def checkpoint_frame_bytes(device_type: str) -> int:
    """Bytes a checkpoint keeps in the device's memory besides its inputs,
    from its forward until backward is done with it: the RNG state its
    frame records (csrc/frame.c, ms_frame_new; the C executor's frame of a
    segment records one for all its units when nothing draws from the
    generator between them, csrc/segment.c; ``torch.utils.checkpoint``,
    which runs selective layers, records one per call), i.e. the CPU
    generator's state and every CUDA generator's once CUDA is initialized.
    They are host tensors: on a CUDA device they take none of its memory."""
    if device_type != "cpu":
        return 0
    total = torch.get_rng_state().untyped_storage().nbytes()
    if torch.cuda.is_initialized():
        total += sum(s.untyped_storage().nbytes() for s in torch.cuda.get_rng_state_all())
    return total


def optimizer_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of optimizer state one step will hold.

    An optimizer whose state already exists is measured.  Otherwise the
    state is derived from its class: Adam-family optimizers keep two
    tensors per trainable parameter, SGD with momentum one, SGD without
    none, L-BFGS two per entry of its history and two more; with no
    optimizer, Adam is assumed (the spec's rule of thumb).
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    per_param = storage_bytes(trainable)
    if optimizer is None:
        return 2 * per_param
    # Per-parameter buffers only: scalar entries such as Adam's ``step`` are
    # left out, so a plan does not change once the optimizer has stepped.
    existing = [
        t
        for state in optimizer.state.values()
        for v in state.values()
        for t in tensors_in(v)  # LBFGS keeps lists of them
        if t.dim() > 0
    ]
    if existing:
        return storage_bytes(existing)
    if isinstance(optimizer, AdamW8bit):
        # int8 + uint8 moments and one float32 scale per block each, for
        # the parameters it quantizes; float32 moments for the others.
        total = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if AdamW8bit.quantizes(p, group):
                    blocks = -(-p.numel() // group["block_size"])
                    total += 2 * p.numel() + 8 * blocks
                else:
                    total += 2 * p.numel() * p.element_size()
        return total
    name = type(optimizer).__name__.lower()
    if isinstance(optimizer, torch.optim.LBFGS):
        # Once its history is full: history_size directions and steps,
        # the search direction and the previous flat gradient, each the
        # size of all its parameters.
        history = optimizer.param_groups[0].get("history_size", 100)
        return (2 * history + 2) * per_param
    if name == "sgd":
        momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
        return per_param if momentum else 0
    if name in ("adagrad", "rmsprop", "adadelta", "adafactor"):
        return per_param
    if any(g.get("amsgrad", False) for g in optimizer.param_groups):
        return 3 * per_param  # exp_avg, exp_avg_sq, max_exp_avg_sq
    return 2 * per_param


class Floor(NamedTuple):
    """Where a step keeps the gradients and the optimizer state: the
    Config's below-the-floor options (docs/below-the-floor.md)."""

    step_in_backward: bool = False  # Config.optimizer_in_backward
    state_tier: str | None = None  # Config.offload_optimizer_state
    prefetch_depth: int = 0  # states read ahead of the one updated


NO_FLOOR = Floor()


def floor_of(config: Config) -> Floor:
    """The floor ``config`` asks for."""
    if not config.optimizer_in_backward:
        return NO_FLOOR
    settings = config.async_config if config.async_config is not None else AsyncOffloadConfig()
    return Floor(True, config.offload_optimizer_state, settings.prefetch_depth)


def _layer_in_flight_bytes(model: torch.nn.Module) -> int:
    """The gradients a step in backward holds at once, at most: those of
    the module whose parameters' gradients are computed together (its own
    trainable parameters), the largest such module."""
    best = 0
    seen: set[int] = set()
    for module in model.modules():
        own = [
            p
            for p in module.parameters(recurse=False)
            if p.requires_grad and _torch_compat.storage_key(p) not in seen
        ]
        for p in own:
            seen.add(_torch_compat.storage_key(p))
        best = max(best, storage_bytes(own))
    return best


def _state_in_flight_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, depth: int
) -> int:
    """The optimizer state a tiered step holds at once: the largest
    parameter's state and the ``depth`` next (counted as the largest),
    each in proportion to the parameter's size."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    total = storage_bytes(trainable)
    if not total:
        return 0
    ratio = optimizer_state_bytes(model, optimizer) / total
    sizes = sorted((p.untyped_storage().nbytes() for p in trainable), reverse=True)
    return int(ratio * sum(sizes[: 1 + max(0, depth)]))


def fixed_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, floor: Floor = NO_FLOOR
) -> int:
    """Parameters + buffers + gradients + optimizer state, as ``floor``
    places them: with the step in backward, only the gradients of the
    layer in flight; with the state on a tier, only the state in flight
    (on the device: the tier is host memory or disk)."""
    params_and_buffers = storage_bytes(list(tensors_of(model)))
    if floor.step_in_backward:
        grads = _layer_in_flight_bytes(model)
    else:
        grads = storage_bytes([p for p in model.parameters() if p.requires_grad])
    if floor.state_tier is not None:
        state = _state_in_flight_bytes(model, optimizer, floor.prefetch_depth)
    else:
        state = optimizer_state_bytes(model, optimizer)
    return params_and_buffers + grads + state


def floor_options(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    config: Config,
    device_type: str,
) -> list[tuple[str, int]]:
    """The below-the-floor Config changes ``config`` has not made, each
    with the bytes it takes off :func:`fixed_bytes` (for
    ``MemoryBudgetError``'s suggestions)."""
    now = fixed_bytes(model, optimizer, floor_of(config))
    depth = floor_of(config.replace(optimizer_in_backward=True)).prefetch_depth
    tier = "host" if device_type == "cuda" else "disk"
    out: list[tuple[str, int]] = []
    if not config.optimizer_in_backward:
        out.append(
            (
                "optimizer_in_backward=True (with the optimizer passed to wrap: "
                "each gradient freed as soon as its parameter is updated)",
                now - fixed_bytes(model, optimizer, Floor(True, None, depth)),
            )
        )
    if config.offload_optimizer_state is None:
        out.append(
            (
                f"optimizer_in_backward=True, offload_optimizer_state={tier!r} "
                f"(the optimizer state on the {tier} tier between updates)",
                now - fixed_bytes(model, optimizer, Floor(True, tier, depth)),
            )
        )
    return [(what, saved) for what, saved in out if saved > 0]
