"""Per-rank peak memory of the GPT-2-shaped benchmark model under DDP and
FSDP2, with and without memscale: two real processes (gloo, CPU).

Each configuration runs in fresh processes (so each rank's VmHWM is its
own), with MALLOC_MMAP_THRESHOLD_=65536 as the benchmark suite's RSS
children (freed tensors go back to the system).  Every rank trains two
AdamW steps on the benchmark batch; the peak of those steps is reported
(the high-water mark is reset after set-up: /proc/self/clear_refs), and
the set-up's own peak beside it.

    .venv/bin/python scripts/dist_memory.py [--model gpt2-12l]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def _vmhwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def rank_main(
    rank: int, world: int, port: int, model_name: str, mode: str, use_memscale: bool, out: str
) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import memscale
    from memscale.benchmarks.models import BENCHMARK_MODELS

    entry = BENCHMARK_MODELS[model_name]
    model, batch = entry.build(seed=0)
    model.train()
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    plan = None
    if use_memscale:
        memscale.wrap(
            model,
            memscale.Config(mode="conservative", force_optimize=True, enable_logging=False),
            sample_input=batch.sample_input,
        )
        plan = model._memscale_executor.plan.hash
    target = model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        target = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    setup_peak = _vmhwm()
    # Reset the high-water mark: what follows is training only.  (wrap
    # profiles on fake tensors, under FSDP2 the unsharded model; before
    # issue 21 it profiled FSDP2 with one real forward, whose peak was that
    # of an unoptimized forward; setup_peak reports set-up's peak.)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        loss = batch.loss_fn(target(*batch.args, **batch.kwargs))
        loss.backward()
        optimizer.step()
    result = {
        "rank": rank,
        "rss_peak_bytes": _vmhwm(),
        "setup_peak_bytes": setup_peak,
        "plan": plan,
        "loss": float(loss.detach()),
    }
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-12l")
    parser.add_argument("--out", default="/tmp/memscale-dist")
    parser.add_argument("--rank-of", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        import torch.multiprocessing as mp

        port, model, mode, use, out, _ = args.rank_of
        mp.spawn(rank_main, args=(2, int(port), model, mode, use == "1", out), nprocs=2)
        return
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    rows = []
    for mode in ("ddp", "fsdp2"):
        for use in ("0", "1"):
            out = f"{args.out}-{mode}-{use}"
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--rank-of",
                    str(_free_port()),
                    args.model,
                    mode,
                    use,
                    out,
                    "x",
                ],
                check=True,
                env=env,
            )
            ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
            rows.append((mode, use, ranks))
    print(
        "| mode | variant | rank 0 RSS peak, training | rank 1 | set-up peak (rank 0) "
        "| plan hash (both ranks) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, use, ranks in rows:
        gib = [f"{r['rss_peak_bytes'] / 2**20:.1f} MiB" for r in ranks]
        hashes = {r["plan"] for r in ranks}
        print(
            f"| {mode} | {'memscale CONSERVATIVE' if use == '1' else 'unoptimized'} | "
            f"{gib[0]} | {gib[1]} | {ranks[0]['setup_peak_bytes'] / 2**20:.1f} MiB | "
            f"{'-' if None in hashes else ', '.join(h[:12] for h in hashes)} |"
        )


if __name__ == "__main__":
    main()
