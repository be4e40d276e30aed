"""Below the floor on the benchmark GPT-2 (12 layers x 256, batch 8 x 256):
what ``optimizer_in_backward=True`` with ``offload_optimizer_state="disk"``
saves and costs.

1. Peak: the exact peak tensor memory of a steady-state training step
   (allocator events, ``memscale.benchmarks.measure``), with
   ``apply_all_optimizations`` alone and with the floor options added.
2. Losses over ``--steps`` steps, bit for bit: the unwrapped model with
   float32 ``torch.optim.AdamW`` against memscale (checkpointing and
   offload, BALANCED, forced) with the floor options and the same AdamW;
   and ``apply_all_optimizations`` (8-bit AdamW, BF16) with and without
   them.
3. Cost: step time of apply-all, apply-all + floor (prefetch depth 2, the
   default) and apply-all + floor without prefetch, interleaved in one
   process (``--repeats`` rounds, each variant once per round, after
   warm-up steps), median and spread; disk bytes per step; the time the
   step waited for the disk against the time the I/O took.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/below_floor_cost.py [--steps 20] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

import memscale  # noqa: E402
from memscale.benchmarks.measure import format_bytes, measure_peak  # noqa: E402
from memscale.benchmarks.models import BENCHMARK_MODELS  # noqa: E402

MODEL = "gpt2-12l"
APPLY_ALL = memscale.Config(mode="balanced", force_optimize=True, enable_logging=False)


def floor(depth: int = 2) -> memscale.Config:
    return APPLY_ALL.replace(
        optimizer_in_backward=True,
        offload_optimizer_state="disk",
        async_config=memscale.AsyncOffloadConfig(prefetch_depth=depth),
    )


def build(kind: str, config: memscale.Config | None):
    model, batch = BENCHMARK_MODELS[MODEL].build(seed=0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if kind == "apply-all":
        model, opt = memscale.apply_all_optimizations(model, opt, config=config)
    elif kind == "wrap":
        memscale.wrap(model, config, optimizer=opt)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        loss = batch.loss_fn(model(*batch.args, **batch.kwargs))
        loss.backward()
        opt.step()
        return loss.detach()

    return model, opt, batch, step


def tier_stats(model) -> dict:
    sib = model._memscale_executor.step_in_backward
    return dict(sib.stats["tier"], steps=sib.steps_completed)


def peaks() -> None:
    print("## 1. Peak tensor memory of a steady-state step")
    for name, config in (("apply_all_optimizations", APPLY_ALL), ("+ floor (disk)", floor())):
        model, opt, batch, step = build("apply-all", config)
        step()
        step()  # planned, state built (and on disk)
        report = measure_peak(
            step, model=model, inputs=(batch.args, batch.kwargs, opt.state), warmup=1
        )
        print(f"- {name}: {format_bytes(report.peak_bytes)} ({report.peak_bytes} bytes)")
        memscale.detach(model)


def losses(steps: int) -> None:
    print(f"## 2. Losses over {steps} steps")
    pairs = (
        ("unwrapped, fp32 AdamW", "none", None, "memscale + floor, fp32 AdamW", "wrap", floor()),
        ("apply_all", "apply-all", APPLY_ALL, "apply_all + floor", "apply-all", floor()),
    )
    for a_name, a_kind, a_cfg, b_name, b_kind, b_cfg in pairs:
        ma, _, _, step_a = build(a_kind, a_cfg)
        mb, _, _, step_b = build(b_kind, b_cfg)
        la = [step_a() for _ in range(steps)]
        lb = [step_b() for _ in range(steps)]
        same = all(torch.equal(x, y) for x, y in zip(la, lb))
        params = all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))
        print(
            f"- {a_name} vs {b_name}: losses bitwise equal: {same}; parameters "
            f"bitwise equal after {steps} steps: {params}; first/last loss "
            f"{la[0].item():.6f} / {la[-1].item():.6f}"
        )
        for m in (ma, mb):
            if "_memscale_executor" in m.__dict__:
                memscale.detach(m)


def cost(repeats: int) -> None:
    print(
        f"## 3. Step time, interleaved, {repeats} rounds (torch threads {torch.get_num_threads()})"
    )
    variants = {
        "apply_all": build("apply-all", APPLY_ALL),
        "+ floor, prefetch 2": build("apply-all", floor(2)),
        "+ floor, no prefetch": build("apply-all", floor(0)),
    }
    for _, _, _, step in variants.values():
        step()
        step()
    before = {k: tier_stats(v[0]) for k, v in variants.items() if k != "apply_all"}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for k, (_, _, _, step) in variants.items():
            t0 = time.perf_counter()
            step()
            times[k].append(time.perf_counter() - t0)
    base = statistics.median(times["apply_all"])
    for k, ts in times.items():
        med = statistics.median(ts)
        line = (
            f"- {k}: median {med * 1e3:.0f} ms (min {min(ts) * 1e3:.0f}, max "
            f"{max(ts) * 1e3:.0f}), {med / base:.2f}x apply_all"
        )
        if k in before:
            now = tier_stats(variants[k][0])
            n = now["steps"] - before[k]["steps"]
            line += (
                f"; disk per step: {format_bytes((now['bytes_written'] - before[k]['bytes_written']) / n)}"
                f" written, {format_bytes((now['bytes_read'] - before[k]['bytes_read']) / n)} read;"
                f" I/O {(now['io_seconds'] - before[k]['io_seconds']) / n * 1e3:.1f} ms/step,"
                f" waited {(now['wait_seconds'] - before[k]['wait_seconds']) / n * 1e3:.1f} ms/step"
                f" ({now['prefetched'] - before[k]['prefetched']} reads prefetched)"
            )
        print(line)
    for model, *_ in variants.values():
        memscale.detach(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", choices=("peaks", "losses", "cost"), default=None)
    args = ap.parse_args()
    print(
        f"# {MODEL} ({BENCHMARK_MODELS[MODEL].description}); torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}"
    )
    if args.only in (None, "peaks"):
        peaks()
    if args.only in (None, "losses"):
        losses(args.steps)
    if args.only in (None, "cost"):
        cost(args.repeats)


if __name__ == "__main__":
    main()
