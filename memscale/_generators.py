"""The default generators a selective layer's recompute sets past a random
call it does not run.

A selective layer (``memscale._selective``) may keep the output of a random
call with a FLOP formula, a fused attention kernel with dropout on CUDA,
when the call draws from the default generator of its output's device and
from no other (:data:`RESTORABLE_RANDOM`, :func:`device_of`).  The forward
records that generator's state right after the call (:func:`after`); the
recompute, which does not run the call, sets the generator to it
(:class:`PutBack`), so every later random call draws what it drew in the
forward, and puts the generator back where it found it when the recompute
ends.  In a fake-tensor pass (the simulation) no generator draws: a
stand-in of the bytes each state takes in the device's memory is made
instead, through the dispatch modes below the caller's (the storage
tracker counts it): the CPU generator's state on the CPU, none on CUDA
(its state is a host tensor).  States are read and set on the generator
itself: ``torch.cuda.set_rng_state`` clones the state through the
dispatcher in torch 2.4 to 2.6, which a selective mode would count as a
call of the layer.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from . import _torch_compat
from ._tree import tensor_list

# The device types whose default generator a recompute can set past a
# kept random call: the CPU's and each CUDA device's, the generators
# torch's checkpoint restores.
_DEVICE_TYPES = ("cpu", "cuda")

# The random operators (overload packets by name) known to draw from the
# default generator of their first output's device, and from no other:
# torch's fused attention kernels, whose dropout draws on the query's
# device.  Only these may be kept; a custom operator that draws so may be
# added by its name ("ns::op"), which declares it: one that draws elsewhere
# (its mask on the CPU for a CUDA output) would leave that generator behind
# when the recompute skips it.
RESTORABLE_RANDOM: set[str] = {
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
}


def device_of(func: Any, args: tuple, kwargs: dict, out: Any) -> torch.device | None:
    """The device whose default generator the random call ``func`` draws
    from, where a recompute that does not run the call can set that
    generator past it: the device of its first output, a CPU or CUDA one,
    for an operator of :data:`RESTORABLE_RANDOM`.  None for any other
    operator, or where the call is given a generator of its own (no
    checkpoint restores that one), or makes no tensor, or its output is on
    another device type: such a call is never kept, and its recompute
    draws again in order."""
    packet = _torch_compat.op_packet(func)
    if packet is None or getattr(packet, "_qualified_op_name", None) not in RESTORABLE_RANDOM:
        return None
    generator = _torch_compat.op_argument(func, args, kwargs, "generator")
    if generator is not None and generator is not _torch_compat.NO_ARGUMENT:
        return None
    tensors = tensor_list(out)
    if not tensors or tensors[0].device.type not in _DEVICE_TYPES:
        return None
    return tensors[0].device


@functools.cache
def _cpu_state_bytes() -> int:
    return int(torch.get_rng_state().untyped_storage().nbytes())


def state_bytes(device: torch.device) -> int:
    """The bytes in ``device``'s memory one state of its default generator
    takes: the CPU generator's on the CPU; a CUDA generator's state is a
    host tensor, none of the device's."""
    return _cpu_state_bytes() if device.type == "cpu" else 0


class State:
    """A state of ``device``'s default generator; ``real`` is False in a
    fake-tensor pass, where ``tensor`` is a stand-in of its bytes."""

    __slots__ = ("device", "real", "tensor")

    def __init__(self, device: torch.device, tensor: torch.Tensor, real: bool) -> None:
        self.device = device
        self.tensor = tensor
        self.real = real


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


def now(device: torch.device, real: bool) -> State:
    """The state of ``device``'s default generator now, or in a fake-tensor
    pass (``real`` False) a stand-in of its bytes."""
    if not real:
        stand_in = torch.empty(state_bytes(device), dtype=torch.uint8, device=device)
        return State(device, stand_in, False)
    return State(device, _generator(device).get_state(), True)


def after(device: torch.device, real: bool) -> State | None:
    """:func:`now`, right after a kept random call; None where the state
    cannot be read (a CUDA stream capturing a graph): the call is then not
    kept."""
    if real and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    return now(device, real)


def set_state(device: torch.device, state: torch.Tensor) -> None:
    _generator(device).set_state(state)


class PutBack:
    """The generators one recompute set (:meth:`set`), each with the state
    it had before the first set, which :meth:`restore` puts back."""

    __slots__ = ("before",)

    def __init__(self) -> None:
        self.before: dict[torch.device, State] = {}

    def set(self, state: State) -> None:
        """Set ``state``'s generator to it, as running the call it follows
        would have (nothing in a fake-tensor pass but the stand-in of the
        state it found)."""
        if state.device not in self.before:
            self.before[state.device] = now(state.device, state.real)
        if state.real:
            set_state(state.device, state.tensor)

    def restore(self) -> None:
        before, self.before = self.before, {}
        for state in before.values():
            if state.real:
                set_state(state.device, state.tensor)
