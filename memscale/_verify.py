"""``Config(verify_correctness=True)``: check the first optimized step.

On the first training forward that memscale optimizes, the step is checked
against the same step without memscale, and ``backward`` raises
:class:`VerificationError` when they differ beyond the tolerance.

How, without changing the user's training:

1. A forward pre-hook on the model (registered after the executor's)
   records what the forward starts from: the inputs (and their versions),
   the RNG state (torch CPU and CUDA, Python's ``random`` and NumPy's when
   NumPy is loaded) and a copy of every buffer.
2. A forward hook keeps the outputs and puts a gradient hook on each output
   tensor that requires grad, so that backward reports the gradient the
   user's loss sends into the model, whatever that loss is; and one
   ``torch.autograd.graph.register_multi_grad_hook`` over the parameters,
   which runs once backward has computed every parameter's gradient (before
   they are accumulated into ``.grad``).
3. In that hook the forward is replayed with memscale's hooks suspended
   (every other hook still runs), from the recorded RNG state and buffers,
   and ``torch.autograd.grad`` takes the replay's outputs back to the
   parameters with the captured output gradients.  That is the same loss's
   gradient, computed unoptimized; ``.grad`` is not touched.
4. Outputs and gradients are compared; the largest absolute and relative
   differences are logged.  The RNG state and buffers are put back to what
   they were before the replay, so parameters, ``.grad``, optimizer state,
   RNG streams and buffers are exactly as without verification.

It costs one more forward and backward, and the memory of the unoptimized
step on top of the optimized one: it is for a debugging run, off by
default.  Only the first optimized step is checked.
"""

from __future__ import annotations

import logging
import math
import random
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from . import _torch_compat

logger = logging.getLogger(__name__)

__all__ = ["TOLERANCES", "VerificationError", "attach"]

# (absolute, relative) tolerance per technique; a step is checked with the
# loosest tolerance among the techniques its plan applies.  Checkpointing
# (and offload) replay the same kernels on the same values: bitwise equal,
# on CPU and on CUDA with torch.use_deterministic_algorithms(True).  On
# CUDA without deterministic algorithms, atomics make two runs of the
# same backward differ in the last bits; 1e-5 relative covers that.
# Mixed precision and tiling change the arithmetic itself.
TOLERANCES: dict[str, tuple[float, float]] = {
    "checkpoint": (0.0, 0.0),
    "offload": (0.0, 0.0),
    "selective": (0.0, 0.0),
    "tiling": (1e-5, 1e-4),
    "mixed_precision": (1e-3, 1e-2),
}
NONDETERMINISTIC_CUDA = (0.0, 1e-5)


class VerificationError(RuntimeError):
    """The optimized step differs from the unoptimized replay beyond the
    tolerance."""


def named_tensors(obj: Any, path: str = "output") -> list[tuple[str, torch.Tensor]]:
    """Tensors of a forward's output, with a path each, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            name = key if path == "output" and isinstance(key, str) else f"{path}[{key!r}]"
            out += named_tensors(value, name)
    elif isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            out += named_tensors(value, f"{path}[{i}]")
    return out


def max_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Largest absolute and relative difference (inf when shapes differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return math.inf, math.inf
    if not (a.is_floating_point() or a.is_complex()):
        return (0.0, 0.0) if torch.equal(a, b) else (math.inf, math.inf)
    a64, b64 = a.detach().double(), b.detach().double()
    if torch.equal(a64, b64) or (
        torch.isnan(a64).equal(torch.isnan(b64))
        and torch.equal(torch.nan_to_num(a64), torch.nan_to_num(b64))
    ):
        return 0.0, 0.0
    delta = (a64 - b64).abs()
    absolute = float(torch.nan_to_num(delta, nan=math.inf).max())
    scale = b64.abs().clamp_min(torch.finfo(torch.float64).tiny)
    relative = float(torch.nan_to_num(delta / scale, nan=math.inf).max())
    return absolute, relative


def rng_state() -> dict[str, Any]:
    """Every RNG stream a step can draw from: torch (CPU, CUDA once
    initialized), Python's ``random``, NumPy's when NumPy is loaded."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


class _Pending:
    """What one optimized step needs kept until its backward."""

    def __init__(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        rng: dict[str, Any],
        buffers: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        self.args = args
        self.kwargs = kwargs
        self.versions = [(t, _torch_compat.tensor_version(t)) for t in _all_tensors((args, kwargs))]
        self.rng = rng
        self.buffers = buffers
        self.outputs: list[tuple[str, torch.Tensor]] = []
        self.output_grads: dict[int, torch.Tensor] = {}
        self.handles: list[Any] = []

    def release(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.args, self.kwargs, self.outputs, self.buffers = (), {}, [], []
        self.output_grads.clear()


def _all_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _all_tensors(item)]
    return []


def _reach(tensor: torch.Tensor) -> set[int]:
    """ids of the autograd nodes ``tensor``'s gradient flows through."""
    return {id(node) for node in _torch_compat.autograd_nodes(tensor)}


def _external_grads(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """From each output's total gradient to the part the loss sent it
    directly.

    A gradient hook on an output sees everything that flows into it,
    including what comes from another output computed from it inside the
    model (a Hugging Face model's ``loss`` is computed from its
    ``logits``).  Starting from the outputs nothing else is computed from,
    the part that comes through the other outputs is taken back out (it is
    recomputed in the replay's graph), so that each gradient counts once.
    """
    if len(pairs) < 2:
        return pairs
    nodes = [t.grad_fn for t, _ in pairs]
    reach = [_reach(t) for t, _ in pairs]
    # downstream[i]: the outputs computed from output i.
    downstream = [
        [
            j
            for j in range(len(pairs))
            if j != i
            and nodes[i] is not None
            and nodes[j] is not nodes[i]
            and id(nodes[i]) in reach[j]
        ]
        for i in range(len(pairs))
    ]
    external: dict[int, torch.Tensor] = {}
    todo = list(range(len(pairs)))
    while todo:
        ready = [i for i in todo if all(j in external for j in downstream[i])]
        if not ready:  # pragma: no cover - autograd graphs have no cycles
            raise VerificationError("memscale verify_correctness: cannot order the model's outputs")
        for i in ready:
            tensor, total = pairs[i]
            below = downstream[i]
            if below:
                inner = torch.autograd.grad(
                    [pairs[j][0] for j in below],
                    tensor,
                    grad_outputs=[external[j] for j in below],
                    retain_graph=True,
                    allow_unused=True,
                )[0]
                if inner is not None:
                    total = total - inner
            external[i] = total
            todo.remove(i)
    return [(pairs[i][0], external[i]) for i in range(len(pairs))]


class Verifier:
    """Checks the first optimized training step of one wrapped model."""

    def __init__(self, model: nn.Module, executor: Any) -> None:
        self._model_ref = weakref.ref(model)
        self.executor = executor
        self.done = False
        self.report: dict[str, Any] | None = None
        self._pending: _Pending | None = None
        self._replaying = False
        self._handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, always_call=True),
        ]

    def remove(self) -> None:
        if self._pending is not None:
            self._pending.release()
            self._pending = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ---- the optimized forward -----------------------------------------

    def _applied_techniques(self) -> list[str]:
        plan = self.executor.plan
        if self.executor.state != "applied" or plan is None:
            return []
        return [name for name, count in plan.technique_counts.items() if count]

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.done or self._replaying:
            return
        if not (torch.is_grad_enabled() and module.training and self._applied_techniques()):
            return
        if self._pending is not None:
            logger.info(
                "memscale verify_correctness: the previous forward had "
                "no backward; verifying this one instead"
            )
            self._pending.release()
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
        self._pending = _Pending(args, dict(kwargs), rng_state(), buffers)

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        pending = self._pending
        if pending is None or self._replaying or pending.outputs:
            return
        named = named_tensors(output)
        if not named:
            pending.release()
            self._pending = None
            return
        pending.outputs = [(name, t.detach()) for name, t in named]
        hooked: set[int] = set()
        for i, (_, t) in enumerate(named):
            if t.requires_grad and id(t) not in hooked:  # a tensor twice: once
                hooked.add(id(t))
                pending.handles.append(t.register_hook(self._capture(pending, i)))
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            pending.release()
            self._pending = None
            return
        pending.handles.append(
            torch.autograd.graph.register_multi_grad_hook(
                params, lambda grads: self._on_grads(pending, params, grads), mode="all"
            )
        )

    @staticmethod
    def _capture(pending: _Pending, index: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            pending.output_grads[index] = grad.detach()

        return hook

    # ---- after backward: the replay --------------------------------------

    def _on_grads(self, pending: _Pending, params: Sequence[torch.Tensor], grads: Any) -> None:
        if pending is not self._pending or self.done:
            return
        self.done = True
        self._pending = None
        # Off before the replay: its autograd.grad must not reach them.
        for handle in pending.handles:
            handle.remove()
        pending.handles.clear()
        try:
            self._verify(pending, params, list(grads))
        finally:
            pending.release()
            self.remove()

    def _suspended(self, model: nn.Module) -> Any:
        """memscale's hooks off for the replay (and nothing else)."""
        return self.executor.paused()

    def _verify(
        self, pending: _Pending, params: Sequence[torch.Tensor], grads: list[torch.Tensor | None]
    ) -> None:
        model = self._model_ref()
        if model is None:
            return
        changed = [t for t, v in pending.versions if _torch_compat.tensor_version(t) != v]
        if changed:
            logger.warning(
                "memscale verify_correctness: an input of the model "
                "was modified in place after the forward; the step "
                "cannot be replayed, and is not verified"
            )
            return
        picked = sorted(pending.output_grads)
        now_rng = rng_state()
        now_buffers = [(b, b.detach().clone()) for b, _ in pending.buffers]
        self._replaying = True
        try:
            with torch.no_grad():
                for buf, value in pending.buffers:
                    buf.copy_(value)
            set_rng_state(pending.rng)
            with self._suspended(model), torch.enable_grad():
                replay = model(*pending.args, **pending.kwargs)
                outputs = named_tensors(replay)
                if len(outputs) != len(pending.outputs):
                    raise VerificationError(
                        "memscale verify_correctness: the unoptimized replay "
                        f"returned {len(outputs)} tensors where the optimized "
                        f"forward returned {len(pending.outputs)}"
                    )
                wanted = _external_grads(
                    [
                        (outputs[i][1], pending.output_grads[i])
                        for i in picked
                        if outputs[i][1].requires_grad
                    ]
                )
                ref = (
                    torch.autograd.grad(
                        [o for o, _ in wanted],
                        params,
                        grad_outputs=[g for _, g in wanted],
                        allow_unused=True,
                    )
                    if wanted
                    else [None] * len(params)
                )
        finally:
            self._replaying = False
            with torch.no_grad():
                for buf, value in now_buffers:
                    buf.copy_(value)
            set_rng_state(now_rng)
        self._compare(model, pending, outputs, params, grads, list(ref))

    def _compare(
        self,
        model: nn.Module,
        pending: _Pending,
        outputs: list[tuple[str, torch.Tensor]],
        params: Sequence[torch.Tensor],
        grads: list[torch.Tensor | None],
        ref: list[torch.Tensor | None],
    ) -> None:
        names = {id(p): n for n, p in model.named_parameters()}
        worst_out = ("", 0.0, 0.0)
        for (name, got), (_, want) in zip(pending.outputs, outputs):
            a, r = max_difference(got, want)
            if (a, r) > worst_out[1:]:
                worst_out = (name, a, r)
        worst_grad = ("", 0.0, 0.0)
        for p, got_grad, want_grad in zip(params, grads, ref):
            if got_grad is None and want_grad is None:
                continue
            if got_grad is None or want_grad is None:
                a = r = math.inf
            else:
                a, r = max_difference(got_grad, want_grad)
            if (a, r) > worst_grad[1:]:
                worst_grad = (names.get(id(p), "?"), a, r)
        techniques = self._applied_techniques() or ["checkpoint"]
        atol = max(TOLERANCES.get(t, (0.0, 0.0))[0] for t in techniques)
        rtol = max(TOLERANCES.get(t, (0.0, 0.0))[1] for t in techniques)
        on_cuda = any(p.is_cuda for p in params)
        if on_cuda and not torch.are_deterministic_algorithms_enabled():
            atol = max(atol, NONDETERMINISTIC_CUDA[0])
            rtol = max(rtol, NONDETERMINISTIC_CUDA[1])
        self.report = {
            "techniques": techniques,
            "atol": atol,
            "rtol": rtol,
            "output": worst_out[0],
            "output_abs": worst_out[1],
            "output_rel": worst_out[2],
            "gradient": worst_grad[0],
            "gradient_abs": worst_grad[1],
            "gradient_rel": worst_grad[2],
        }
        ok = all(a <= atol or r <= rtol for _, a, r in (worst_out, worst_grad))
        summary = (
            f"outputs: largest difference {worst_out[1]:.3g} absolute, "
            f"{worst_out[2]:.3g} relative ({worst_out[0] or '-'}); "
            f"gradients: {worst_grad[1]:.3g} absolute, {worst_grad[2]:.3g} "
            f"relative ({worst_grad[0] or '-'}); tolerance for "
            f"{'+'.join(techniques)}: "
            + (
                "bitwise equal"
                if atol == rtol == 0.0
                else f"{atol:g} absolute or {rtol:g} relative"
            )
        )
        if ok:
            logger.info(
                "memscale verify_correctness: the optimized step matches "
                "the unoptimized replay; %s",
                summary,
            )
            return
        logger.error("memscale verify_correctness: MISMATCH; %s", summary)
        raise VerificationError(
            "memscale verify_correctness: the optimized step differs from the "
            f"same step without memscale; {summary}. A checkpointed layer that "
            "gives different results when recomputed (random numbers drawn "
            "outside torch's RNG, or global state it reads or changes) does "
            "this: make its forward deterministic or exclude it from "
            "checkpointing."
        )


def attach(model: nn.Module, executor: Any) -> Verifier | None:
    """Set up verification of the first optimized step of ``model``; the
    executor's detach removes it."""
    plan = executor.plan
    if executor.state == "applied" and plan is not None and not any(plan.technique_counts.values()):
        logger.info(
            "memscale verify_correctness: the plan applies nothing, so there is nothing to verify"
        )
        return None
    verifier = Verifier(model, executor)
    executor.on_detach(verifier.remove)
    executor.verifier = verifier
    logger.info(
        "memscale verify_correctness: the first optimized training step "
        "will be replayed without memscale and compared (slow)"
    )
    return verifier
