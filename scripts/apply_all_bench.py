"""``memscale.apply_all_optimizations`` on a benchmark model: the peak tensor
memory of a whole training step (zero_grad, forward, backward, optimizer
step) against the unoptimized model with ``torch.optim.AdamW``, next to
checkpointing alone, and the first steps' losses side by side.

The peak is exact (allocator events, ``memscale.benchmarks.measure``), in
a steady-state step (the optimizer state exists).  Each variant is built
from the same seed and trains on the same batch.

    .venv/bin/python scripts/apply_all_bench.py [--model gpt2-12l]
"""

from __future__ import annotations

import argparse
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

import memscale  # noqa: E402
from memscale.benchmarks.measure import format_bytes, measure_peak  # noqa: E402
from memscale.benchmarks.models import BENCHMARK_MODELS  # noqa: E402


def run(name: str, model_name: str, steps: int) -> dict:
    model, batch = BENCHMARK_MODELS[model_name].build(seed=0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if name == "apply_all_optimizations":
        model, opt = memscale.apply_all_optimizations(model, opt)
    elif name == "checkpointing (CONSERVATIVE)":
        memscale.wrap(
            model, memscale.Config(mode="conservative", force_optimize=True), optimizer=opt
        )

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = batch.loss_fn(model(*batch.args, **batch.kwargs))
        loss.backward()
        opt.step()
        return loss.item()

    losses = [step() for _ in range(steps)]  # warm-up profiling, state built
    report = measure_peak(step, model=model, inputs=(batch.args, batch.kwargs, opt.state), warmup=1)
    t0 = time.perf_counter()
    losses.append(step())
    seconds = time.perf_counter() - t0
    state = sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    if "_memscale_executor" in model.__dict__:
        memscale.detach(model)
    return {"peak": report.peak_bytes, "state": state, "losses": losses, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-12l")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    names = ["unoptimized (AdamW)", "checkpointing (CONSERVATIVE)", "apply_all_optimizations"]
    rows = {n: run(n, args.model, args.steps) for n in names}
    base = rows[names[0]]["peak"]
    print(f"{args.model}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        "| variant | peak of a training step | vs unoptimized | optimizer state "
        "| losses (steps 1..n) | last step |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for n in names:
        r = rows[n]
        print(
            f"| {n} | {format_bytes(r['peak'])} | {r['peak'] / base - 1:+.1%} | "
            f"{format_bytes(r['state'])} | "
            f"{' '.join(f'{v:.4f}' for v in r['losses'])} | {r['seconds']:.2f} s |"
        )


if __name__ == "__main__":
    main()
