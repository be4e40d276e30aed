"""Planning on the first training forward, when ``wrap`` has no ``sample_input``.

The first training forward's own inputs are the sample: a forward pre-hook
profiles them (on fake tensors, as ``sample_input`` is profiled), makes the
plan, and returns, so that the same forward already runs under the plan.
No training step runs unoptimized.

The hook sits on the model and on each module between the model and the
planning units' closest common ancestor: a Lightning ``training_step`` that
calls ``self.model(...)`` instead of ``self(...)`` still reaches one of
them, and that module's inputs are then the sample.  The first of them to
run a training forward (train mode, gradients on, memscale not paused)
removes them all, whatever happens next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _torch_compat


def chain(model: torch.nn.Module, unit_names: list[str]) -> list[torch.nn.Module]:
    """``model`` and its descendants down to the units' closest common
    ancestor (the modules one of which every forward that runs all the
    units passes through), outermost first."""
    if not unit_names:
        return [model]
    parts = [name.split(".") for name in unit_names]
    common: list[str] = []
    for level in zip(*parts):
        if any(p != level[0] for p in level):
            break
        common.append(level[0])
    if len(unit_names) == 1:
        common = common[:-1]  # the unit itself is planned, not a chain module
    modules = [model]
    current = model
    for part in common:
        child = current._modules.get(part)
        if child is None:
            break
        modules.append(child)
        current = child
    return modules


class FirstForward:
    """The pre-hooks that plan on the first training forward.

    ``plan(module, args, kwargs)`` does the planning with ``module`` (the
    module whose forward fired) and its inputs; it runs at most once.
    ``is_paused()`` says whether the executor is paused (its hooks do
    nothing then, so neither does this one).
    """

    def __init__(
        self,
        modules: list[torch.nn.Module],
        plan: Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any]], None],
        is_paused: Callable[[], bool],
    ) -> None:
        self._plan = plan
        self._is_paused = is_paused
        self._handles: list[Any] = []
        # Planning runs eagerly, also under torch.compile (Dynamo does not
        # trace the profiling and planning into the user's graph).
        hook = torch.compiler.disable(self._hook)
        try:
            for module in modules:
                self._handles.append(
                    _torch_compat.register_first_pre_hook(module, hook, with_kwargs=True)
                )
        except BaseException:
            self.remove()
            raise

    @property
    def pending(self) -> bool:
        """Whether the first training forward has not run yet."""
        return bool(self._handles)

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        while self._handles:
            self._handles.pop().remove()

    def _hook(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if (
            not self._handles
            or not module.training
            or not torch.is_grad_enabled()
            or self._is_paused()
        ):
            return None  # evaluation, or memscale paused: not the first step
        self.remove()  # once, also when planning raises
        self._plan(module, args, dict(kwargs))
        return None
