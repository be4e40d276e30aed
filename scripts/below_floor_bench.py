"""Below the floor: the largest GPT-2 that trains on this machine.

One full training step (forward, backward, optimizer update) of GPT-2
Medium, Large and XL (built from configs, random weights) at batch 1 x 512,
under five set-ups, each in a fresh process:

- ``unoptimized``: the model and ``torch.optim.AdamW``;
- ``hf-checkpointing``: Hugging Face's ``gradient_checkpointing_enable()``;
- ``memscale``: ``memscale.wrap(model, optimizer=opt)``, the defaults;
- ``apply-all``: ``memscale.apply_all_optimizations(model, opt)``;
- ``apply-all+floor``: the same with ``optimizer_in_backward=True`` and
  ``offload_optimizer_state="disk"``.

A row's lower bound (weights, gradients and optimizer state as the set-up
places them; activations left out) is computed first; a row whose bound is
over the memory available when the row starts (``MemAvailable``) is
skipped, with the figure and the machine's RAM beside it.
Each row reports the child's peak RSS (``ru_maxrss``), the step's wall
time (it includes memscale's planning, which happens in the first
forward) and whether it completed.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/below_floor_bench.py \
        [--models medium,large,xl] [--setups ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
import warnings

GIB = 1 << 30
SIZES = {
    # name: (n_layer, n_embd, n_head)
    "medium": (24, 1024, 16),
    "large": (36, 1280, 20),
    "xl": (48, 1600, 25),
}
SETUPS = ("unoptimized", "hf-checkpointing", "memscale", "apply-all", "apply-all+floor")
VOCAB, POSITIONS, SEQ = 50257, 1024, 512


def param_count(n_layer: int, n_embd: int) -> int:
    """GPT-2's parameters (tied embedding): embeddings, blocks, final norm."""
    per_block = 12 * n_embd * n_embd + 13 * n_embd
    return VOCAB * n_embd + POSITIONS * n_embd + n_layer * per_block + 2 * n_embd


def lower_bound(setup: str, n_layer: int, n_embd: int) -> int:
    """Bytes the set-up holds whatever the activations: fp32 weights, and
    fp32 gradients and AdamW state (16 B/param), 8-bit AdamW state
    (~2.03 B/param) with apply-all; with the floor, the gradient and state
    of the largest parameter (the tied embedding) only."""
    n = param_count(n_layer, n_embd)
    if setup == "apply-all+floor":
        return 4 * n + VOCAB * n_embd * (4 + 2)
    if setup == "apply-all":
        return 4 * n + 4 * n + int(2.03 * n)
    return 16 * n


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def total_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def child(size: str, setup: str) -> dict:
    """One training step in this process; its figures."""
    warnings.filterwarnings("ignore")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import memscale

    n_layer, n_embd, n_head = SIZES[size]
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=POSITIONS, use_cache=False
    )
    model = GPT2LMHeadModel(cfg)
    model.train()
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rss_model = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    if setup == "hf-checkpointing":
        model.gradient_checkpointing_enable()
    elif setup == "memscale":
        memscale.wrap(model, optimizer=opt)
    elif setup == "apply-all":
        model, opt = memscale.apply_all_optimizations(model, opt)
    elif setup == "apply-all+floor":
        config = memscale.Config(
            mode="balanced",
            force_optimize=True,
            optimizer_in_backward=True,
            offload_optimizer_state="disk",
        )
        model, opt = memscale.apply_all_optimizations(model, opt, config=config)
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    seconds = time.perf_counter() - t0
    out = {
        "loss": float(loss.item()),
        "step_seconds": seconds,
        "rss_after_model_bytes": rss_model,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "parameters": sum(p.numel() for p in model.parameters()),
        "optimizer": type(opt).__name__,
    }
    ex = model.__dict__.get("_memscale_executor")
    if ex is not None and ex.step_in_backward is not None:
        tier = ex.step_in_backward.stats.get("tier", {})
        out["disk_bytes_written"] = tier.get("bytes_written")
        out["disk_peak_bytes"] = tier.get("peak_bytes_on_disk")
    return out


def run_row(size: str, setup: str, timeout: float) -> dict:
    n_layer, n_embd, _ = SIZES[size]
    row: dict = {
        "model": f"gpt2-{size}",
        "setup": setup,
        "parameters": param_count(n_layer, n_embd),
        "lower_bound_bytes": lower_bound(setup, n_layer, n_embd),
    }
    avail = available_bytes()
    row["available_bytes"] = avail
    row["machine_bytes"] = total_bytes()
    if row["lower_bound_bytes"] > avail:
        row["status"] = "skipped: predicted not to fit"
        return row
    cmd = [sys.executable, __file__, "--child", size, setup]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        row["status"] = f"timeout after {timeout:.0f} s"
        return row
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-3:]
        row["status"] = f"failed (exit {done.returncode}): {' | '.join(tail)}"
        return row
    row.update(json.loads(done.stdout.strip().splitlines()[-1]))
    row["status"] = "completed"
    return row


def fmt(row: dict) -> str:
    gib = lambda b: f"{b / GIB:6.2f} GiB"  # noqa: E731
    head = f"{row['model']:<12} {row['setup']:<17} {row['parameters'] / 1e9:5.2f} B params"
    if row["status"] != "completed":
        return (
            f"{head}  {row['status']}: lower bound {gib(row['lower_bound_bytes'])}"
            f" vs {gib(row.get('machine_bytes', 0))} RAM ({gib(row['available_bytes'])} available)"
        )
    extra = ""
    if row.get("disk_bytes_written"):
        extra = f", state on disk {gib(row['disk_peak_bytes'])}"
    return (
        f"{head}  completed: peak RSS {gib(row['peak_rss_bytes'])}, step "
        f"{row['step_seconds']:6.1f} s (first step, planning included){extra}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="medium,large,xl")
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(*args.child)))
        return
    import torch

    header = (
        f"# {platform.node() or 'host'}: {os.cpu_count()} CPUs, "
        f"{total_bytes() / GIB:.1f} GiB RAM, Python {platform.python_version()}, "
        f"torch {torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}"
    )
    print(header, flush=True)
    rows = []
    for size in args.models.split(","):
        for setup in args.setups.split(","):
            row = run_row(size, setup, args.timeout)
            rows.append(row)
            print(fmt(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
