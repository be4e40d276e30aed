"""The tensors inside nested tuples, lists and mappings (operator
arguments and results, model inputs and outputs)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from tensors_in(item)


def tensor_list(obj: Any) -> list[torch.Tensor]:
    """The tensors of :func:`tensors_in`, in the same order, as a list
    (the storage tracker calls it for every operator: no generators)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    out: list[torch.Tensor] = []
    _collect(obj, out)
    return out


def _collect(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, (tuple, list)):
        for item in obj:
            if isinstance(item, torch.Tensor):
                out.append(item)
            elif isinstance(item, (tuple, list, dict, Mapping)):
                _collect(item, out)
    elif isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            _collect(item, out)
