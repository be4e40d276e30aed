"""The fake world of a simulation: every parameter and buffer of the model
swapped for a fake twin inside one FakeTensorMode, inputs converted (small
integer ones kept real), and the model's own tensors and attributes put
back on exit."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

from .. import _model, _torch_compat
from .._smallvalues import REAL_VALUE_LIMIT, SmallValues
from .._tree import tensors_in
from ._tracker import FakeCaller

__all__ = ["REAL_VALUE_LIMIT", "FakeWorld"]

_EMPTY_STRIDED = torch.ops.aten.empty_strided.default

logger = logging.getLogger(__name__)


class FakeWorld:
    """Swaps every parameter and buffer of ``model`` for a fake twin (same
    shape, dtype, strides; ties kept) inside one FakeTensorMode, and puts
    the real ones back on exit.  Also converts inputs, and keeps the model
    in training mode while it lasts."""

    def __init__(self, model: nn.Module, device: torch.device, inputs: Any = ()) -> None:
        fake = _torch_compat.fake_tensor_mode(
            allow_non_fake_inputs=True, allow_fallback_kernels=False
        )
        if fake is None:
            raise RuntimeError(
                "memscale's OOM predictor runs the step on fake tensors, which "
                f"torch {torch.__version__} does not provide; install torch >= 2.4"
            )
        self.mode, self._convert = fake
        # Operator calls on its fake tensors, answered from FakeTensorMode's
        # cache through a cheaper key (None: called as usual); the storage
        # tracker of every simulated step calls through it.
        self.calls = _torch_compat.fake_calls(self.mode)
        # Calls through it, tracking nothing (making the fake parameters).
        self._caller = FakeCaller(self.calls)
        self.model = model
        self.device = device
        # The inputs it will fake (what may view a parameter or buffer).
        self._inputs = inputs
        self._memo: dict[int, torch.Tensor] = {}
        self._real_copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # What of this world's passes runs for real (memscale._smallvalues).
        self.small = SmallValues(self.mode, REAL_VALUE_LIMIT)
        self._keep: list[torch.Tensor] = []
        tools = _torch_compat.fake_tensor_tools()
        self._real = tools[1] if tools is not None else contextlib.nullcontext
        self._is_fake = tools[0] if tools is not None else _torch_compat.is_fake
        self._swapped: list[tuple[dict[str, Any], str, Any]] = []
        self._training: list[tuple[nn.Module, bool]] = []
        self._attrs: list[tuple[nn.Module, dict[str, Any]]] = []
        self.params: list[torch.Tensor] = []  # unique fake parameters
        self.buffers: list[torch.Tensor] = []  # unique fake buffers
        self.param_of: dict[int, torch.Tensor] = {}  # id(real) -> fake

    def fake(self, t: torch.Tensor, alone: bool = False) -> torch.Tensor:
        """The fake twin of a real or meta tensor (memoized).  ``alone``:
        no other tensor the world fakes shares ``t``'s storage (a
        parameter or buffer of its own, :meth:`__enter__`)."""
        got = self._memo.get(id(t))
        if got is not None:
            return got
        if alone and _whole_storage(t) and t.device.type == self.device.type:
            # What the converter would make of it, a fresh fake storage of
            # the same bytes under the same shape, strides and dtype, made
            # through the fake-call memo (a tenth of the converter's cost,
            # which describes every tensor it converts in full).
            out = self._empty_like(t)
        elif t.device.type == self.device.type and not t.is_meta:
            if self._is_fake(t):
                plain = t.detach()
            else:
                # Detached outside the mode: inside it, detach would convert
                # the real tensor to a fake one first, and the alias again.
                with self._real():
                    plain = t.detach()
            out = self._convert(plain)
        else:
            out = torch.empty_strided(
                tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=self.device
            )
        if isinstance(t, nn.Parameter):
            # (its detach answered from the fake mode's cache through the
            # cheaper key, as every simulated step's calls are)
            with self._caller:
                out = nn.Parameter(out, requires_grad=t.requires_grad)
        elif t.requires_grad and t.is_leaf:
            out.requires_grad_(True)
        self._memo[id(t)] = out
        self._keep.append(t)  # its id stays unique while it is in the memo
        return out

    def state_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A new tensor like ``t``, an optimizer's state tensor: a fake one
        of the same layout (through the fake-call memo) for a fake ``t``;
        for a real one (a step counter, a small value) a real copy the
        pass's calls may write, as the one made in the pass is."""
        if self._is_fake(t):
            return self._empty_like(t)
        return self.small.real_copy(t)

    def _empty_like(self, t: torch.Tensor) -> torch.Tensor:
        """A fresh fake tensor of ``t``'s shape, strides, dtype and device,
        made through the fake-call memo: called directly, as the fake
        caller calls it, without a mode of its own for torch to hand the
        call to (the memo dispatches it as usual when a mode other than
        the fake one is on the stack: a step's tracker)."""
        if self.calls is None:
            with self._caller:
                return torch.empty_strided(
                    tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=t.device
                )
        # (sizes as lists, as torch hands them to a mode: FakeTensorMode
        # does not cache a call given tuples)
        return self.calls(
            _EMPTY_STRIDED,
            (list(t.shape), list(t.stride())),
            {"dtype": t.dtype, "device": t.device},
        )

    def fake_tree(self, obj: Any) -> Any:
        """``obj`` with its tensors faked but the small values that stay
        real (:mod:`memscale._smallvalues`): real copies of those, made
        once per tensor (the model may change them in place, and the
        caller's batch must stay as it is)."""
        if isinstance(obj, torch.Tensor):
            if self.small.keeps(obj, self.device.type):
                if id(obj) not in self._real_copies:
                    self._real_copies[id(obj)] = (obj, self.small.real_copy(obj))
                    self._keep.append(obj)
                return self._real_copies[id(obj)][1]
            return self.fake(obj)
        if isinstance(obj, tuple):
            return tuple(self.fake_tree(o) for o in obj)
        if isinstance(obj, list):
            return [self.fake_tree(o) for o in obj]
        if isinstance(obj, dict):
            return {k: self.fake_tree(v) for k, v in obj.items()}
        return obj

    def refill_inputs(self) -> None:
        """The real copies of the inputs as the caller's inputs are: before
        each simulated forward (a forward may change them in place, and
        the next must start from the batch as it is)."""
        for original, copy in self._real_copies.values():
            self.small.refill(copy, original)

    def __enter__(self) -> FakeWorld:
        self.mode.__enter__()
        try:
            seen_p: set[int] = set()
            seen_b: set[int] = set()
            alone = _alone(self.model, self._inputs)
            for module in self.model.modules():
                self._training.append((module, module.training))
            self._attrs = _model.attributes(self.model)
            for module in self.model.modules():
                tables = _torch_compat.module_tensor_tables(module)
                if tables is None:
                    raise RuntimeError(
                        "memscale's OOM predictor swaps a module's parameters "
                        "for fake ones through its parameter tables, which "
                        f"torch {torch.__version__} does not expose"
                    )
                for table, seen, out in (
                    (tables[0], seen_p, self.params),
                    (tables[1], seen_b, self.buffers),
                ):
                    for name, real in list(table.items()):
                        if real is None:
                            continue
                        twin = self.fake(real, id(real) in alone)
                        if id(real) not in seen:
                            seen.add(id(real))
                            out.append(twin)
                            if table is tables[0]:
                                self.param_of[id(real)] = twin
                        self._swapped.append((table, name, real))
                        table[name] = twin
            self.model.train()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            for table, name, real in reversed(self._swapped):
                table[name] = real
            self._swapped.clear()
            for module, flag in self._training:
                module.training = flag
            self._training.clear()
            self._restore_attributes()
        finally:
            self.mode.__exit__(None, None, None)

    def _restore_attributes(self) -> None:
        """A forward may store a tensor on a module (a cache, a mask): one
        stored in the simulation must not outlive it
        (:func:`memscale._model.restore_attributes`)."""
        for module, key in _model.restore_attributes(self._attrs):
            logger.debug(
                "memscale: restoring %s.%s after the simulation", type(module).__name__, key
            )
        self._attrs.clear()


def _alone(model: nn.Module, inputs: Any = ()) -> set[int]:
    """ids of the parameters and buffers of ``model`` whose storage no
    other tensor the world may fake shares: none of the others, no tensor
    a module keeps in a plain attribute, none of ``inputs`` (a tied weight
    is one tensor: alone).  The converter gives such a view the storage of
    the twin it made; a twin made apart would not be it."""
    holders: dict[int, set[int]] = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.layout is torch.strided and not t.is_meta:
            holders.setdefault(_torch_compat.storage_key(t), set()).add(id(t))
    others = [inputs]
    for module in model.modules():
        others += [
            v
            for k, v in vars(module).items()
            if k not in ("_parameters", "_buffers", "_modules") and not k.endswith("hooks")
        ]
    try:
        viewers = list(tensors_in(others))
    except RecursionError:  # an attribute that holds itself: trust none
        return set()
    for t in viewers:
        if t.layout is torch.strided and not t.is_meta:
            ids = holders.get(_torch_compat.storage_key(t))
            if ids is not None and id(t) not in ids:
                ids.add(id(t))
    return {ids.pop() for ids in holders.values() if len(ids) == 1}


def _whole_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain strided tensor that spans its storage
    exactly from its start (what ``empty_strided`` of its shape and
    strides allocates), without conjugate or negative bits: its fake twin
    is an ``empty_strided`` of the same layout."""
    if type(t) not in (torch.Tensor, nn.Parameter) or t.layout is not torch.strided:
        return False
    if t.is_meta or t.is_quantized or t.is_conj() or t.is_neg() or t.storage_offset():
        return False
    if t.is_inference():  # (an empty_strided twin would not be one)
        return False
    if t.requires_grad and not t.is_leaf:
        return False
    extent = 0
    if t.numel():
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() == extent * t.element_size()
