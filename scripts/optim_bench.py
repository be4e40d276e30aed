"""Step time and state size of memscale's 8-bit AdamW against torch's AdamW
(foreach and single-tensor) on the parameters of the benchmark GPT-2 model.

Only optimizer.step() is timed: the same fixed random gradients, 3 warm-up
steps, then the median of 20.

    .venv/bin/python scripts/optim_bench.py [--model gpt2-12l]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from memscale.benchmarks.models import BENCHMARK_MODELS  # noqa: E402
from memscale.optim import AdamW8bit  # noqa: E402


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-12l")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    model, _ = BENCHMARK_MODELS[args.model].build(seed=0)
    params = list(model.parameters())
    torch.manual_seed(0)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    print(
        f"{args.model}: {n:,} parameters, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads\n"
    )
    print("| optimizer | state | step time (median) |")
    print("| --- | --- | --- |")
    makers = {
        "torch.optim.AdamW (foreach)": lambda: torch.optim.AdamW(params, lr=1e-4, foreach=True),
        "torch.optim.AdamW (single tensor)": lambda: torch.optim.AdamW(
            params, lr=1e-4, foreach=False
        ),
        "memscale AdamW8bit (C kernel)": lambda: AdamW8bit(params, lr=1e-4),
    }
    for name, make in makers.items():
        saved = [p.detach().clone() for p in params]
        opt = make()
        for _ in range(3):
            opt.step()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        print(
            f"| {name} | {state_bytes(opt) / 2**20:.1f} MiB | "
            f"{statistics.median(times) * 1e3:.1f} ms |"
        )
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


if __name__ == "__main__":
    main()
