"""Attention tiled over query positions, for Hugging Face models.

A transformer block is not row-independent along the sequence (every
query attends to every key), so memscale tiles whole blocks along the
batch.  Inside a block, attention itself can be tiled along the queries:
each tile of queries attends to the full keys and values, and its scores
(``batch x heads x tile x keys``) are recomputed in backward from the
tile's saved queries, keys and values (``_Recomputed``), so only one
tile's scores are alive at once.

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

import contextlib
import logging
import sys
from typing import Any

import torch
from torch import nn

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


class _Tile:
    """One tile of queries: the inner attention on ``q`` (rows ``start`` to
    ``start + q.shape[2]`` of the queries), with its causal mask made here
    when the model gave none.  It holds no activation (``kwargs`` are the
    model's small extras: scaling, dropout 0, position ids)."""

    def __init__(
        self, module: nn.Module, inner: Any, causal: bool, start: int, q_len: int, kwargs: dict
    ):
        self.module, self.inner, self.kwargs = module, inner, kwargs
        self.causal, self.start, self.q_len = causal, start, q_len

    def extras(self) -> list[torch.Tensor]:
        """The trainable tensors the tile reads besides its queries, keys,
        values and mask: the attention module's own parameters that require
        grad (GPT-OSS reads ``module.sinks``) and the grad-requiring tensors
        among ``kwargs``, each once."""
        found: dict[int, torch.Tensor] = {}
        params = self.module.parameters(recurse=False) if self.module is not None else ()
        for t in (*params, *self.kwargs.values()):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                found.setdefault(id(t), t)
        return list(found.values())

    def __call__(
        self,
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: Any,
        swap: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if self.causal:
            # Query i of the tile sits at position start + i (keys end
            # aligned with the queries).
            size, k_len = q.shape[2], key.shape[2]
            rows = torch.arange(self.start, self.start + size, device=q.device) + (
                k_len - self.q_len
            )
            cols = torch.arange(k_len, device=q.device)
            mask = torch.zeros(size, k_len, dtype=q.dtype, device=q.device)
            mask.masked_fill_(cols[None, :] > rows[:, None], torch.finfo(q.dtype).min)
            mask = mask[None, None]
        kwargs = self.kwargs
        if swap:  # backward: kwargs tensors replaced by their stand-ins
            kwargs = {k: swap.get(id(v), v) for k, v in kwargs.items()}
        return self.inner(self.module, q, key, value, mask, **kwargs)[0]


class _Recomputed(torch.autograd.Function):
    """A query tile whose scores are recomputed in backward.

    Its tensor inputs are saved with ``save_for_backward``, so they pass
    through the saved-tensor hooks around it: inside a memscale checkpoint
    frame they are dropped after the forward and brought back by the
    frame's recompute, and the tile holds nothing until backward.
    (``torch.utils.checkpoint``'s non-reentrant recompute closure keeps its
    inputs, the block's keys and values among them, alive until backward
    whatever frame it runs in: a tiled block then held more after its
    forward than the same block checkpointed whole.)  Backward runs the
    tile again under the forward's autocast state and differentiates it on
    its own (``torch.autograd.grad``), so the step's own backward may be
    ``torch.autograd.grad`` too.  Besides the queries, keys, values and
    mask, the trainable tensors the tile reads (the attention module's own
    parameters, such as GPT-OSS's ``sinks``, and grad-requiring kwargs
    tensors) are inputs too, and get their gradients, summed over tiles.
    Backward is differentiable (``create_graph``, a gradient penalty): then
    it differentiates the saved tensors themselves, and refuses a read
    tensor that is also upstream of the queries, keys or values (its
    gradient would be counted twice).  No random numbers are drawn: models
    with attention dropout are not tiled over queries."""

    @staticmethod
    def forward(
        ctx: Any,
        tile: _Tile,
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: Any,
        *extras: torch.Tensor,
    ) -> torch.Tensor:
        ctx.tile = tile
        devices = ("cpu",) if q.device.type == "cpu" else ("cpu", q.device.type)
        ctx.autocast = [
            (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices
        ]
        ctx.save_for_backward(q, key, value, mask if isinstance(mask, torch.Tensor) else None)
        ctx.mask = None if isinstance(mask, torch.Tensor) else mask
        # The tile reads these itself (module attributes, kwargs); they are
        # inputs so that they get their gradients.
        ctx.extras = extras
        return tile(q, key, value, mask)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, key, value, mask = ctx.saved_tensors
        if mask is None:
            mask = ctx.mask
        # With create_graph (a gradient penalty), the recompute reads the
        # saved tensors themselves, so that the gradients it returns stay
        # functions of the tensors upstream and can be differentiated
        # again.  Otherwise it reads detached copies.
        create = torch.is_grad_enabled()
        # A mask may be a learned bias: it gets its gradient too.
        needs = [bool(n) for n in ctx.needs_input_grad[1:5]]
        needs[3] = needs[3] and isinstance(mask, torch.Tensor)
        tensors = (q, key, value, mask)
        inputs = [
            (t if create and t.requires_grad else t.detach().requires_grad_(True)) if n else t
            for t, n in zip(tensors, needs)
        ]
        extras = list(ctx.extras)
        extra_needs = [bool(n) for n in ctx.needs_input_grad[5:]]
        swap: dict[int, torch.Tensor] = {}
        if not create:
            # A computed (non-leaf) kwargs tensor is read through a leaf
            # stand-in, so its gradient does not also reach the parameters
            # it was computed from (they get it from autograd, through it).
            for i, t in enumerate(extras):
                if t.grad_fn is not None:
                    extras[i] = swap[id(t)] = t.detach().requires_grad_(True)
        wanted = [t for t, n in zip(inputs, needs) if n]
        wanted += [t for t, n in zip(extras, extra_needs) if n]
        if create:
            _check_disjoint(wanted)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            for device, enabled, dtype in ctx.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            out = ctx.tile(*inputs, swap=swap)
        got = iter(
            torch.autograd.grad(out, wanted, grad, allow_unused=True, create_graph=create)
            if wanted
            else ()
        )
        return (
            None,
            *(next(got) if n else None for n in needs),
            *(next(got) if n else None for n in extra_needs),
        )


def _check_disjoint(wanted: list[torch.Tensor]) -> None:
    """Differentiating w.r.t. the saved tensors themselves, a wanted tensor
    upstream of another would get its gradient twice (here, and again
    through the other): refuse that rather than return a wrong gradient."""
    targets = {id(t): t for t in wanted}
    seen: set[int] = set()
    stack = [t.grad_fn for t in wanted if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None and id(var) in targets:
                raise RuntimeError(
                    "memscale: double backward through attention query tiles: a trainable "
                    "tensor the attention reads is also upstream of its queries, keys or "
                    "values, so its gradient would be counted twice (not supported)"
                )
            if any(t.grad_fn is nxt for t in wanted):
                raise RuntimeError(
                    "memscale: double backward through attention query tiles: a tensor "
                    "the attention reads is computed from another it reads (not supported)"
                )
            stack.append(nxt)


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
    outs = []
    base, rem = divmod(q_len, tiles)
    start = 0
    for j in range(tiles):
        size = base + (1 if j < rem else 0)
        q = query.narrow(2, start, size)
        mask: Any = attention_mask
        if (
            attention_mask is not None
            and attention_mask.dim() == 4
            and attention_mask.shape[2] == q_len
        ):
            mask = attention_mask.narrow(2, start, size)
        tile = _Tile(module, inner, causal, start, q_len, kwargs)
        outs.append(_Recomputed.apply(tile, q, key, value, mask, *tile.extras()))
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
