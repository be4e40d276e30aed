"""Copying and pickling a wrapped model (issue 20, item 3).

The decision: any copy of a wrapped model (``copy.deepcopy``,
``copy.copy``, ``pickle``, ``torch.save(model)``) is an *unwrapped* model
with the original's weights, buffers and settings as they would be after
``memscale.detach``; one log line says so.  The original stays wrapped and
working, and the copy shares no executor, hook, spill store or metrics
server with it.  Wrap the copy to optimize it too.

``wrap`` installs :class:`_Copier` as the model instance's ``__deepcopy__``
and ``__reduce_ex__`` (``copy`` and ``pickle`` look these up on the
instance); ``detach`` removes them.  A copy is made with ``deepcopy``
whose memo maps every object of memscale's found on the model (the
executor, its hooks, the tiled forwards, the copier itself) to a marker,
which is then removed from the copy; the ``on_copy`` fixups the executor
collected (a Hugging Face config's ``use_cache``, the attention
implementation) then undo on the copy what ``detach`` would undo.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

_INSTALLED = ("__deepcopy__", "__reduce_ex__")
_EXECUTOR_ATTR = "_memscale_executor"  # memscale.api.ATTR


class _Dropped:
    """What memscale's objects become in the copy, before removal."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict[int, Any]) -> _Dropped:
        return self

    def __repr__(self) -> str:
        return "<dropped memscale object>"


_DROPPED = _Dropped()


_NO_FORWARD = object()


def set_forward(executor: Any, unit: torch.nn.Module, make: Callable[[Any], Any]) -> None:
    """Give ``unit`` the instance ``forward`` ``make(previous)`` returns
    (``previous``: the instance's own forward before, or None when it had
    none), put back by detach; a copy of the model gets the user's own
    instance forward, never one of memscale's."""
    previous = unit.__dict__.get("forward", _NO_FORWARD)
    unit.__dict__["forward"] = make(None if previous is _NO_FORWARD else previous)

    def restore() -> None:
        if previous is _NO_FORWARD:
            unit.__dict__.pop("forward", None)
        else:
            unit.__dict__["forward"] = previous

    executor.on_detach(restore)
    if previous is not _NO_FORWARD and not is_ours(previous):

        def restore_copy(copy_of: Any) -> None:
            copy_of(unit).__dict__["forward"] = copy_of(previous)

        executor.on_copy(restore_copy)


def is_ours(obj: Any) -> bool:
    """Whether ``obj`` is one of memscale's objects (an executor, a hook or
    forward it installed): its type, its function or its ``__self__`` is
    defined in the memscale package."""
    for candidate in (obj, getattr(obj, "__self__", None), getattr(obj, "func", None)):
        if candidate is None:
            continue
        for name in (type(candidate).__module__, getattr(candidate, "__module__", None)):
            if isinstance(name, str) and (name == "memscale" or name.startswith("memscale.")):
                return True
    return False


def _hook_tables(module: torch.nn.Module) -> list[tuple[str, dict[Any, Any]]]:
    """The module's hook dicts (``_forward_pre_hooks``, ``_forward_hooks``,
    their ``_with_kwargs`` / ``_always_called`` companions, ...)."""
    return [(k, v) for k, v in vars(module).items() if "hooks" in k and isinstance(v, dict)]


def unwrapped_copy(
    model: torch.nn.Module, executor: Any, memo: dict[int, Any] | None = None
) -> torch.nn.Module:
    """A deep copy of the wrapped ``model`` without anything memscale put on
    it.  ``memo`` is ``copy.deepcopy``'s when called from it."""
    if memo is None:
        memo = {}
    dropped: list[Any] = []  # keeps the ids in memo valid while copying

    def drop(obj: Any) -> None:
        if id(obj) not in memo:
            memo[id(obj)] = _DROPPED
            dropped.append(obj)

    drop(executor)
    for module in model.modules():
        for key, value in list(vars(module).items()):
            # Only what memscale sets on a module: the executor, the copier,
            # a tiled forward.  (A user's own memscale.Config attribute, say,
            # is copied like anything else.)
            if key in (*_INSTALLED, _EXECUTOR_ATTR) or (key == "forward" and is_ours(value)):
                drop(value)
        for _, table in _hook_tables(module):
            for hook in list(table.values()):
                if is_ours(hook):
                    drop(hook)
    # Around the deepcopy, the copier is not visible on the model, so that
    # deepcopy copies the model as a plain module.
    saved = {k: model.__dict__.pop(k) for k in _INSTALLED if k in model.__dict__}
    try:
        clone = copy.deepcopy(model, memo)
    finally:
        model.__dict__.update(saved)
    for module in clone.modules():
        for key, value in list(vars(module).items()):
            if value is _DROPPED:
                del module.__dict__[key]
        removed: set[Any] = set()
        tables = _hook_tables(module)
        for _, table in tables:
            for hook_id, hook in list(table.items()):
                if hook is _DROPPED:
                    del table[hook_id]
                    removed.add(hook_id)
        for _, table in tables:  # the companions keyed by the same hook ids
            for hook_id in removed & set(table):
                del table[hook_id]

    def copy_of(obj: Any) -> Any:
        return copy.deepcopy(obj, memo)

    for fixup in getattr(executor, "_copy_fixups", ()):
        fixup(copy_of)
    logger.info(
        "memscale: copied a wrapped %s; the copy is not wrapped "
        "(memscale.wrap it to optimize it too)",
        type(model).__name__,
    )
    return clone


class _Copier:
    """``__deepcopy__`` and ``__reduce_ex__`` of one wrapped model.  Holds
    the model weakly: the model holds it."""

    def __init__(self, model: torch.nn.Module, executor: Any, kind: str) -> None:
        self._model = weakref.ref(model)
        self._executor = weakref.ref(executor)
        self._kind = kind

    def _copy(self, memo: dict[int, Any] | None) -> torch.nn.Module:
        model, executor = self._model(), self._executor()
        if model is None or executor is None:  # pragma: no cover - defensive
            raise TypeError("memscale: this model's wrapper is gone; detach it")
        return unwrapped_copy(model, executor, memo)

    def __call__(self, arg: Any) -> Any:
        if self._kind == "__deepcopy__":
            return self._copy(arg)
        # __reduce_ex__(protocol): pickle (and copy.copy) the unwrapped copy.
        return self._copy(None).__reduce_ex__(arg)


def install(model: torch.nn.Module, executor: Any) -> Callable[[], None]:
    """Make copies of ``model`` unwrapped; returns the undo (for detach)."""
    for kind in _INSTALLED:
        model.__dict__[kind] = _Copier(model, executor, kind)
    ref = weakref.ref(model)  # the executor keeps no reference to the model

    def remove() -> None:
        target = ref()
        if target is None:
            return
        for kind in _INSTALLED:
            if isinstance(target.__dict__.get(kind), _Copier):
                del target.__dict__[kind]

    return remove
