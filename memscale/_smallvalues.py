"""Small values stay real in a fake-tensor pass.

Model code reads some tensors' values to choose what to run: a Hugging
Face model asks whether its attention mask is all ones, or whether the
position ids it made with ``torch.arange`` hold several packed sequences,
and builds an attention mask only if so, or if the tensor is fake (it then
assumes it is being traced).  A pass on fake tensors alone therefore takes
another path than the real forward (a mask, keys and values expanded to
every head, another attention kernel), and what it measures is another
model's.  Every fake pass of memscale (the profile, the simulated steps)
keeps such values real instead:

* inputs that are not floating point and at most ``REAL_VALUE_LIMIT``
  bytes (token ids, masks, positions) stay real, as copies
  (:meth:`SmallValues.input`);
* an operator whose tensor arguments are all real (or that has none, as
  ``torch.arange``) runs for real when what it returns is at most that
  many bytes (:meth:`SmallValues.run`), so that its values exist.

Everything else is fake.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import _torch_compat
from ._tree import tensor_list, tensors_in

REAL_VALUE_LIMIT = 8 << 20
_DispatchMode: type = _torch_compat.dispatch_mode_base() or object


class SmallValues:
    """Which calls of a fake pass run for real (``limit`` bytes at most;
    0, or a torch without the fake-tensor tools: none), and running them."""

    def __init__(self, limit: int = REAL_VALUE_LIMIT) -> None:
        tools = _torch_compat.fake_tensor_tools() if limit else None
        self.limit = limit if tools is not None else 0
        if tools is not None:
            self._is_fake, self._unset_fake, self._value_errors = tools
            # The class is_fake answers True for at once.
            self._fake_cls = _torch_compat.fake_tensor_class()

    def all_real(self, args: Any, kwargs: Any) -> bool:
        """Whether no tensor argument of a call is fake (False without a
        limit)."""
        if not self.limit:
            return False
        for a in args:  # most calls: a fake tensor is the first tensor
            if type(a) is self._fake_cls:
                return False
            if isinstance(a, (torch.Tensor, tuple, list, Mapping)):
                break
        is_fake = self._is_fake
        for t in tensor_list(args):
            if is_fake(t):
                return False
        if kwargs:
            for t in tensor_list(kwargs):
                if is_fake(t):
                    return False
        return True

    def run(self, func: Any, args: Any, kwargs: Any) -> Any:
        """A call on real tensors only (or none), inside the fake mode: its
        result's size is learnt on fake tensors first; a small result is
        computed for real, so its values exist, and so is a call that
        returns no tensor (``_foreach_add_``: what it writes is real)."""
        try:
            out = func(*args, **kwargs)
        except self._value_errors:
            out = None  # it reads values (item(), nonzero(), ...)
        else:
            sizes = [t.untyped_storage().nbytes() for t in tensors_in(out)]
            if sizes and sum(sizes) > self.limit:
                return out
        with self._unset_fake():
            return func(*args, **kwargs)

    def keeps(self, t: torch.Tensor, device_type: str) -> bool:
        """Whether the input ``t`` stays real in a pass on ``device_type``."""
        return (
            bool(self.limit)
            and not t.is_meta
            and not t.is_floating_point()
            and not t.is_complex()
            and not t.requires_grad
            and t.device.type == device_type
            and not self._is_fake(t)
            and t.untyped_storage().nbytes() <= self.limit
        )

    def real_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A real copy of the real input ``t``, made inside the fake mode
        (the model may change it in place; the caller's stays as it is)."""
        with self._unset_fake():
            return t.clone()


@_torch_compat.guard_dispatch
class SmallValuesMode(_DispatchMode):
    """Above a FakeTensorMode: the calls :class:`SmallValues` says run for
    real do; every other call goes on to the fake mode."""

    def __init__(self, values: SmallValues) -> None:
        super().__init__()
        self._values = values

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._values.all_real(args, kwargs):
            return self._values.run(func, args, kwargs)
        return func(*args, **kwargs)
