"""Attention tiled over query positions, for Hugging Face models.

A transformer block is not row-independent along the sequence (every
query attends to every key), so memscale tiles whole blocks along the
batch.  Inside a block, attention itself can be tiled along the queries:
each tile of queries attends to the full keys and values, and its scores
(``batch x heads x tile x keys``) are recomputed in backward under
``torch.utils.checkpoint``, so only one tile's scores are alive at once.

It works through transformers' attention interface: memscale registers an
attention function (``memscale_query_tiles``) and points the model's
``config._attn_implementation`` at it while wrapped, remembering the
implementation it replaces (eager, sdpa, ...), which computes each tile.
``detach`` puts the original back.  The attention mask is sliced with the
queries; a causal model without a mask (sdpa's ``is_causal`` path) gets an
explicit causal mask per tile, offset to the tile's first query.

Only models without attention dropout are tiled this way: a tile would
draw its own dropout mask, and the result would change.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)

NAME = "memscale_query_tiles"
_STATE = "_memscale_query_tiles"  # on the config: (original implementation, tiles)


def _interface() -> Any:
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
    except ImportError:  # transformers not installed, or without the interface
        return None
    if NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, _query_tiled)
    return ALL_ATTENTION_FUNCTIONS


def _inner(module: nn.Module, original: str) -> Any:
    """The attention function the model would have used."""
    if original == "eager":
        # Each model file defines its own eager attention (grouped KV heads
        # included): use the one of the module's model.
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"memscale: no eager attention found for {type(module).__name__}")
        return fn
    return _interface().get_interface(original, None)


def _query_tiled(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    original, tiles = getattr(module.config, _STATE, ("sdpa", 1))
    inner = _inner(module, original)
    q_len = query.shape[2]
    tiles = min(tiles, q_len)
    if tiles < 2 or not torch.is_grad_enabled():
        return inner(module, query, key, value, attention_mask, **kwargs)
    causal = attention_mask is None and getattr(module, "is_causal", False)
    k_len = key.shape[2]
    outs = []
    base, rem = divmod(q_len, tiles)
    start = 0
    for j in range(tiles):
        size = base + (1 if j < rem else 0)
        q = query.narrow(2, start, size)
        if (
            attention_mask is not None
            and attention_mask.dim() == 4
            and attention_mask.shape[2] == q_len
        ):
            mask = attention_mask.narrow(2, start, size)
        elif causal:
            # Query i of the tile sits at position start + i (keys end
            # aligned with the queries).
            rows = torch.arange(start, start + size, device=query.device) + (k_len - q_len)
            cols = torch.arange(k_len, device=query.device)
            mask = torch.zeros(size, k_len, dtype=query.dtype, device=query.device)
            mask.masked_fill_(cols[None, :] > rows[:, None], torch.finfo(query.dtype).min)
            mask = mask[None, None]
        else:
            mask = attention_mask  # type: ignore[assignment]

        def run(q: torch.Tensor, mask: Any = mask) -> torch.Tensor:
            return inner(module, q, key, value, mask, **kwargs)[0]

        outs.append(checkpoint(run, q, use_reentrant=False))
        start += size
    return torch.cat(outs, dim=1), None  # (batch, queries, heads, head dim)


def _dropout_free(model: nn.Module) -> bool:
    cfg = model.config
    for name in ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob"):
        if float(getattr(cfg, name, 0.0) or 0.0) > 0.0:
            return False
    return True


def attach(executor: Any, model: nn.Module, tiles: int) -> bool:
    """Tile ``model``'s attention over queries in ``tiles`` while wrapped.
    False (nothing changed) when the model has no attention interface to
    hook, uses attention dropout, or tiles < 2."""
    cfg = getattr(model, "config", None)
    original = getattr(cfg, "_attn_implementation", None)
    if tiles < 2 or cfg is None or not isinstance(original, str) or original == NAME:
        return False
    if original not in ("eager", "sdpa"):
        logger.info(
            "memscale: attention implementation %r is not tiled over queries (eager and sdpa are)",
            original,
        )
        return False
    if not _dropout_free(model):
        logger.info(
            "memscale: attention is not tiled over queries: the model "
            "uses attention dropout, whose masks tiles would change"
        )
        return False
    if _interface() is None:
        return False
    setattr(cfg, _STATE, (original, int(tiles)))
    cfg._attn_implementation = NAME

    def restore(cfg: Any = cfg, original: str = original) -> None:
        cfg._attn_implementation = original
        cfg.__dict__.pop(_STATE, None)

    executor.on_detach(restore)
    executor.on_copy(lambda copy_of, cfg=cfg: restore(copy_of(cfg)))
    logger.info("memscale: attention tiled over queries in %d tiles (%s for each)", tiles, original)
    return True
