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
