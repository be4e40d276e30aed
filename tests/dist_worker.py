"""Worker for tests/test_distributed.py: real torch.distributed processes
(gloo, CPU).  Usage: python dist_worker.py SCENARIO PORT OUT_DIR

With MEMSCALE_DIST_BACKEND=nccl (tests/gpu/test_cuda_distributed.py) each
rank trains on its own GPU, deterministically (eager attention,
torch.use_deterministic_algorithms), and offload goes to the host tier.

Each rank writes OUT_DIR/rank<r>.pt with what the test compares.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


BACKEND = os.environ.get("MEMSCALE_DIST_BACKEND", "gloo")


def _grads(model):
    out = []
    for p in model.parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out.append(g.detach().cpu().clone())
    return out


def _offloaded(executor):
    """Tensors the executor offloaded: to the host tier from a GPU, to
    disk on the CPU."""
    host = executor.offload_host
    if host is not None:
        return host.stats["to_pool"] + host.stats["to_pageable"] + host.stats["to_disk"]
    return executor.offload_store.stats["tensors_written"]


def _step(target, x):
    out = target(input_ids=x, labels=x)
    out.loss.backward()
    return out.loss.detach().item()


def _unrepeatable(model, rank):
    """On rank 1 only, block 1 reads a counter its forward bumps: run again,
    as its recompute would, it computes something else, so it fails the
    first-step recompute check there (and passes it on rank 0)."""
    if rank != 1:
        return
    calls = [0]

    def bump(module, args):
        calls[0] += 1
        return (args[0] * (1.0 + calls[0] / 64),)

    model.transformer.h[1].mlp.register_forward_pre_hook(bump)


def _train(rank, scenario, use_memscale, budget_gb=None):
    # "-first": no sample_input; the plan is made in the first training forward.
    # "-measured": and use_static_profiling=False: the two steps are measured
    # under that plan, which is made again (and exchanged) after them.
    # "-unrepeatable": block 1 fails the recompute check on rank 1 only.
    unrepeatable = scenario.endswith("-unrepeatable")
    scenario = scenario.removesuffix("-unrepeatable")
    measured = scenario.endswith("-measured")
    scenario = scenario.removesuffix("-measured")
    first = scenario.endswith("-first")
    scenario = scenario.removesuffix("-first")
    from conftest import tiny_gpt2, token_batch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import memscale

    if BACKEND == "nccl":
        # Fused attention has no deterministic backward on CUDA.
        model = tiny_gpt2(dropout=0.0, attn_implementation="eager").to(f"cuda:{rank}")
    else:
        model = tiny_gpt2(dropout=0.0)  # same seed: same weights on every rank
    model.train()
    torch.manual_seed(100 + rank)  # each rank its own batch
    x = token_batch(batch=2, seq=32).to(next(model.parameters()).device)
    info = {}
    if unrepeatable:
        _unrepeatable(model, rank)
    if scenario == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    config = memscale.Config(
        mode="balanced",
        force_optimize=True,
        enable_logging=False,
        memory_budget_gb=budget_gb,
        async_config=memscale.AsyncOffloadConfig(min_offload_bytes=0),
        use_static_profiling=not measured,
    )
    wrapped = model
    if scenario == "ddp-outer":  # DDP first, then memscale on the DDP module
        model = DDP(model)
        wrapped = model
    if use_memscale:
        memscale.wrap(
            wrapped, config, sample_input=None if first else {"input_ids": x, "labels": x}
        )
    target = DDP(model) if scenario == "ddp" else model
    losses = [_step(target, x) for _ in range(2)]  # grads accumulate twice
    info.update(losses=losses, grads=_grads(model))
    if use_memscale:
        plan = wrapped._memscale_executor.plan
        info.update(
            hash=plan.hash,
            budget=plan.budget_bytes,
            fixed=plan.fixed_bytes,
            techniques=plan.technique_counts,
            layers=[list(layer.techniques) for layer in plan.layers],
        )
        info["recomputes"] = wrapped._memscale_executor.stats["recomputes"]
        info["profiling"] = wrapped._memscale_executor.profiling
        info["spilled"] = _offloaded(wrapped._memscale_executor)
        memscale.detach(wrapped)
    return info


# Scenarios trained without and with memscale, compared by the test.
SAME = (
    "ddp",
    "ddp-outer",
    "fsdp2",
    "ddp-first",
    "ddp-outer-first",
    "fsdp2-first",
    "ddp-first-measured",
    "fsdp2-first-measured",
)


def run(rank, world, scenario, port, out_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if BACKEND == "nccl":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(rank)
        torch.use_deterministic_algorithms(True)
    dist.init_process_group(BACKEND, rank=rank, world_size=world)
    result = {}
    try:
        if scenario in SAME:
            result["plain"] = _train(rank, scenario, False)
            result["memscale"] = _train(rank, scenario, True)
        elif scenario.endswith("-unrepeatable"):
            result["memscale"] = _train(rank, scenario, True)
        elif scenario == "budgets":
            # Rank 1 is told it has far less memory: the plan is still one.
            result["memscale"] = _train(
                rank,
                os.environ.get("DIST_SCENARIO", "ddp"),
                True,
                budget_gb=8.0 if rank == 0 else 0.001,
            )
        elif scenario == "absent":
            # Rank 1 never calls wrap: rank 0 must fail with a clear error.
            if rank == 0:
                try:
                    _train(rank, "ddp", True)
                except RuntimeError as exc:
                    result["error"] = str(exc)
            else:
                time.sleep(float(os.environ["MEMSCALE_DIST_TIMEOUT"]) + 5)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        # Each rank's own traceback, whole (the test shows it on failure:
        # the parent's stderr interleaves both ranks and is cut short).
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if scenario != "absent":
            dist.destroy_process_group()


if __name__ == "__main__":
    scenario, port, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mp.spawn(run, args=(2, scenario, port, out_dir), nprocs=2)
