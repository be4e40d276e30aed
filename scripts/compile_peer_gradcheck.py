"""Whether the budget sweep's compile min-cut peer computes the right
gradients on a model with dropout.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python scripts/compile_peer_gradcheck.py

A tiny GPT-2 (2 layers, hidden 64, float64, Hugging Face's default dropout
0.1) is compiled as the sweep compiles its peer
(``memscale.benchmarks.runner.memory_budget_backend``: AOT autograd's
min-cut partition under ``activation_memory_budget``, eager kernels) at
budgets 1.0 and 0.3.  For each, the directional derivative of the loss
along a random direction v, from the compiled step's gradients (g.v), is
set beside a central finite difference of the compiled forward's loss
along v, every forward from the same seed (so the same dropout masks):
where the backward draws new random numbers to recompute a dropout, the
two differ.  It also counts the random operators in the backward graphs.
"""

from __future__ import annotations

import functools

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import get_nop_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from memscale.benchmarks.models import _gpt2

RANDOM = ("rand", "bernoulli", "native_dropout")


def _backend(fraction: float, counts: list[int]):
    nop = get_nop_func()

    def backward(gm, inputs):
        counts.append(sum(1 for n in gm.graph.nodes if any(r in str(n.target) for r in RANDOM)))
        return nop(gm, inputs)

    from torch._inductor.compile_fx import select_decomp_table

    inner = aot_autograd(
        fw_compiler=nop,
        bw_compiler=backward,
        decompositions=select_decomp_table(),
        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
    )

    def compile_(gm, inputs):
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            return inner(gm, inputs)

    return compile_


def main() -> None:
    torch.manual_seed(0)
    model, batch = _gpt2(layers=2, hidden=64, heads=4, vocab=512, seq=64, batch=4)
    model.double().train()
    params = list(model.parameters())
    direction = [torch.randn_like(p) for p in params]

    def loss_of(m) -> torch.Tensor:
        torch.manual_seed(1)
        return batch.loss_fn(m(*batch.args, **batch.kwargs))

    def g_dot_v(m) -> float:
        for p in params:
            p.grad = None
        loss_of(m).backward()
        return float(sum((p.grad * d).sum() for p, d in zip(params, direction)))

    def finite_difference(m, eps: float = 1e-3) -> float:
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.add_(eps * d)
            plus = loss_of(m).item()
            for p, d in zip(params, direction):
                p.sub_(2 * eps * d)
            minus = loss_of(m).item()
            for p, d in zip(params, direction):
                p.add_(eps * d)
        return (plus - minus) / (2 * eps)

    print(f"eager: g.v {g_dot_v(model):.6f}, finite difference {finite_difference(model):.6f}")
    for fraction in (1.0, 0.3):
        torch._dynamo.reset()
        counts: list[int] = []
        compiled = torch.compile(model, backend=_backend(fraction, counts))
        gv = g_dot_v(compiled)
        fd = finite_difference(compiled)
        print(
            f"compile min-cut, activation_memory_budget={fraction}: g.v {gv:.6f}, "
            f"finite difference {fd:.6f}; random ops in the backward graphs: {counts}"
        )


if __name__ == "__main__":
    main()
