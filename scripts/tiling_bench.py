"""Activation tiling on a layer with a large intermediate: peak tensor
bytes of one forward+backward, and agreement with the untiled layer.

The model is two MLP blocks (LayerNorm, Linear h -> 4h, GELU, Linear
4h -> h, residual) at batch 2 x sequence 2048 x hidden 256.  Rows:
unoptimized, checkpointing alone (CONSERVATIVE, forced), and tiling at
four memory budgets between the least one checkpointing alone reaches and
the least one tiling reaches, the engine choosing the tiles.  The peak is
exact (allocator events, ``memscale.benchmarks.measure``).

    .venv/bin/python scripts/tiling_bench.py
"""

from __future__ import annotations

import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import memscale  # noqa: E402
from memscale import _core  # noqa: E402
from memscale.benchmarks.measure import format_bytes, measure_peak  # noqa: E402

B, S, H = 2, 2048, 256


class MLP(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.up = nn.Linear(h, 4 * h)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.ln(x))))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(MLP(H), MLP(H))


def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    out.square().mean().backward()
    return out.detach()


def run(model: nn.Module, x: torch.Tensor) -> tuple[int, float, torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    report = measure_peak(lambda: step(model, x), model=model, inputs=(x,), warmup=1)
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out = step(model, x)
    seconds = time.perf_counter() - t0
    return report.peak_delta_bytes, seconds, out, [p.grad.clone() for p in model.parameters()]


def main() -> None:
    x = torch.randn(B, S, H)
    base = build()
    peak0, t0, out0, grads0 = run(base, x)
    print(f"model: 2 x MLP(h={H}, 4x), input {B}x{S}x{H} float32")
    print(
        f"{'variant':32} {'tiles':>5} {'peak above start':>17} {'ratio':>6} "
        f"{'max rel err out':>15} {'max rel err grad':>16} {'step s':>7}"
    )

    def row(name: str, tiles: str, peak: int, secs: float, out: torch.Tensor, grads: list) -> None:
        e_out = float((out - out0).abs().max() / out0.abs().max())
        e_grad = max(float((g - g0).abs().max() / g0.abs().max()) for g, g0 in zip(grads, grads0))
        print(
            f"{name:32} {tiles:>5} {format_bytes(peak):>17} {peak / peak0:6.2f} "
            f"{e_out:15.2e} {e_grad:16.2e} {secs:7.3f}"
        )

    row("unoptimized", "-", peak0, t0, out0, grads0)
    model = build()
    memscale.wrap(
        model,
        memscale.Config(mode=memscale.OptimizationMode.CONSERVATIVE, force_optimize=True),
        sample_input=x,
    )
    row("checkpointing", "-", *run(model, x))
    memscale.detach(model)

    # The budgets: from the smallest one checkpointing alone reaches down to
    # the smallest one tiling reaches (both as wrap's budget check finds
    # them, by asking for a budget nothing fits), in four steps; the engine
    # chooses the tiles at each.
    def least(tiling: bool) -> int:
        cfg = memscale.Config(
            enable_tiling=tiling, enable_offloading=False, memory_budget_gb=1 / 1024
        )
        try:
            memscale.wrap(build(), cfg, sample_input=x)
        except memscale.MemoryBudgetError as err:
            return err.min_budget_bytes
        raise AssertionError("a 1 MiB budget fitted")

    top, bottom = least(False), least(True)
    for frac in (0.75, 0.5, 0.25, 0.0):
        budget = bottom + int((top - bottom) * frac)
        model = build()
        cfg = memscale.Config(
            enable_tiling=True, enable_offloading=False, memory_budget_gb=budget / 2**30
        )
        memscale.wrap(model, cfg, sample_input=x)
        plan = model._memscale_executor.plan
        chosen = [layer.tiles for layer in plan.layers]
        row(f"tiling (budget {format_bytes(budget)})", "/".join(map(str, chosen)), *run(model, x))
        assert model._memscale_executor.stats["tiled_calls"] > 0
        memscale.detach(model)
    print(
        f"(least budget with checkpointing alone {format_bytes(top)}, with tiling "
        f"{format_bytes(bottom)}; max tiles {_core.MAX_TILES})"
    )


if __name__ == "__main__":
    main()
