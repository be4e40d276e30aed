"""Hugging Face's key/value cache off while memscale checkpoints.

A transformers model with ``use_cache`` on builds a cache object per
forward (``DynamicCache``, ``EncoderDecoderCache``) that each attention
layer appends its keys and values to.  Recomputing a checkpointed layer
runs its forward again on the same cache object, which by then already
holds that layer's keys and values: attention is computed over a longer
sequence and the recompute cannot match the forward.  transformers' own
``gradient_checkpointing_enable`` turns the cache off while training for
the same reason; memscale does it for the models it checkpoints.

``use_cache`` is read from the config of the module whose forward runs,
and a model can hold several distinct config objects: T5's encoder and
decoder stacks each keep a copy of the model's config, and a multimodal
model's language model keeps its ``text_config``.  Every distinct config
reachable from the model (each module's ``config`` and the configs nested
in it) is changed, and restored exactly by the returned undo.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

__all__ = ["disable_use_cache"]

_MISSING = object()


def _config_base() -> type | None:
    """transformers' config base class, when transformers is imported (a
    model built from it cannot exist otherwise)."""
    utils = sys.modules.get("transformers.configuration_utils")
    if utils is None:
        return None
    base = getattr(utils, "PreTrainedConfig", None) or getattr(utils, "PretrainedConfig", None)
    return base if isinstance(base, type) else None


def hf_configs(model: nn.Module) -> Iterator[Any]:
    """Every distinct transformers config object reachable from ``model``,
    in a fixed order (modules in ``named_modules`` order, each config before
    the configs nested in it)."""
    base = _config_base()
    if base is None:
        return
    seen: set[int] = set()

    def walk(cfg: Any) -> Iterator[Any]:
        if not isinstance(cfg, base) or id(cfg) in seen:
            return
        seen.add(id(cfg))
        yield cfg
        for value in list(vars(cfg).values()):
            yield from walk(value)

    for module in model.modules():
        yield from walk(module.__dict__.get("config"))


def disable_use_cache(model: nn.Module) -> tuple[list[Any], Callable[[], None]]:
    """Set ``use_cache=False`` on every config of ``model`` that has it
    True; return the configs changed and the undo (which puts back exactly
    what was there: the instance attribute, or the class default)."""
    changed: list[tuple[Any, Any]] = []
    for cfg in hf_configs(model):
        if getattr(cfg, "use_cache", None) is True:
            changed.append((cfg, vars(cfg).get("use_cache", _MISSING)))
    undone = False

    def undo() -> None:
        nonlocal undone
        if undone:
            return
        undone = True
        for cfg, previous in reversed(changed):
            if previous is _MISSING:
                vars(cfg).pop("use_cache", None)
            else:
                cfg.use_cache = previous

    try:
        for cfg, _ in changed:
            cfg.use_cache = False
    except BaseException:
        undo()
        raise
    return [cfg for cfg, _ in changed], undo
