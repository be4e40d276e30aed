"""Peak RSS of a fresh process training GPT-2 6x256 (batch 4x256) with the
Hugging Face Trainer and with PyTorch Lightning: plain, Hugging Face's
``gradient_checkpointing_enable()``, and memscale's callback without
``sample_input`` at a budget (and with ``use_static_profiling=False``: the
first forward's plan refined from real steps measured under it).

Each run is a fresh interpreter (``memscale._measure.peak_rss_subprocess``,
with ``MALLOC_MMAP_THRESHOLD_=65536`` as the benchmark suite's RSS children,
so that freed tensors go back to the system).  It trains ``--steps`` AdamW
steps and reports its VmHWM twice: at the end of the first training step
(the first step's peak, set-up included) and at the end of the run.

    .venv/bin/python scripts/first_step_memory.py [--steps 3] [--budget-gb 0.2] [--breakdown]
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import os, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {root!r})
import torch
from transformers import GPT2Config, GPT2LMHeadModel

def vmhwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")

torch.manual_seed(0)
torch.set_num_threads(1)
model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=8192,
                                   n_positions=256, use_cache=False))
if {variant!r}.startswith("hf-checkpointing"):
    model.gradient_checkpointing_enable()
g = torch.Generator().manual_seed(1)
ids = [torch.randint(0, 8192, (256,), generator=g) for _ in range(4 * {steps})]
first = []
if {variant!r} in ("hf-checkpointing+imports", "hf-checkpointing+prediction"):
    # The breakdown: memscale's modules imported, and (+prediction) its
    # fake-tensor machinery run once on this model and batch before
    # training, with Hugging Face's checkpointing doing the work.
    import memscale
    import memscale.integrations.hf
    if {variant!r} == "hf-checkpointing+prediction":
        batch = torch.stack(ids[:4])
        memscale.predict_peak(model, {{"input_ids": batch, "labels": batch}},
                              memscale.Config(memory_budget_gb={budget}))
if {variant!r}.startswith("memscale"):
    import memscale
    config = memscale.Config(memory_budget_gb={budget}, enable_logging=False)
    if {variant!r} == "memscale-measured":
        # The plan the first forward makes on fake tensors is refined from
        # the next warmup_steps steps, measured for real under it.
        config = config.replace(use_static_profiling=False)
    if {variant!r} == "memscale-no-check":
        # The breakdown only: without the first step's recompute check.
        from memscale import _recompute_check
        _recompute_check.install = lambda *args, **kwargs: None

if {framework!r} == "hf":
    import logging
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)
        def __getitem__(self, i):
            return {{"input_ids": ids[i], "labels": ids[i]}}

    class FirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if not first:
                first.append(vmhwm())

    callbacks = [FirstStep()]
    if {variant!r}.startswith("memscale"):
        from memscale.integrations.hf import MemScaleCallback
        callbacks.insert(0, MemScaleCallback(config))
    args = TrainingArguments(output_dir=os.environ["OUT_DIR"], per_device_train_batch_size=4,
                             max_steps={steps}, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, use_cpu=True,
                             dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=Data(), callbacks=callbacks).train()
else:
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class FirstStep(pl.Callback):
        def on_train_batch_end(self, *a, **k):
            if not first:
                first.append(vmhwm())

    callbacks = [FirstStep()]
    if {variant!r}.startswith("memscale"):
        from memscale.integrations.lightning import MemScaleCallback
        callbacks.insert(0, MemScaleCallback(config))
    loader = torch.utils.data.DataLoader(torch.stack(ids), batch_size=4)
    pl.Trainer(max_steps={steps}, accelerator="cpu", devices=1, logger=False,
               enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=callbacks,
               default_root_dir=os.environ["OUT_DIR"]).fit(Module(), loader)
with open(os.path.join(os.environ["OUT_DIR"], "first_step_vmhwm"), "w") as f:
    f.write(str(first[0]))
"""


RECLAIM = r"""
import ctypes, gc, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {root!r})
import torch
from transformers import GPT2Config, GPT2LMHeadModel
import memscale
from torch._subclasses.fake_tensor import FakeTensorMode

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")

torch.manual_seed(0)
torch.set_num_threads(1)
model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=8192,
                                   n_positions=256, use_cache=False))
ids = torch.randint(0, 8192, (4, 256), generator=torch.Generator().manual_seed(1))
rows = [("before planning", rss())]
memscale.predict_peak(model, {{"input_ids": ids, "labels": ids}},
                      memscale.Config(memory_budget_gb={budget}))
rows.append(("after memscale.predict_peak", rss()))
gc.collect()
rows.append(("after gc.collect()", rss()))
FakeTensorMode.cache_clear()
gc.collect()
rows.append(("after FakeTensorMode.cache_clear()", rss()))
ctypes.CDLL("libc.so.6").malloc_trim(0)
rows.append(("after malloc_trim(0)", rss()))
for name, value in rows:
    print(f"  {{name:<36}} RSS {{value:7.1f}} MiB")
"""


def _reclaim(budget: float) -> None:
    """Whether what the fake-tensor planning leaves in RSS can be given
    back: RSS of one fresh process after planning, garbage collection,
    clearing torch's fake-tensor cache and glibc's malloc_trim."""
    import subprocess

    print("What planning leaves in RSS (one process, GPT-2 6x256, batch 4x256):", flush=True)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONWARNINGS="ignore")
    code = RECLAIM.format(root=ROOT, budget=budget)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    print(proc.stdout, end="", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--budget-gb",
        type=float,
        default=0.2,
        help="memscale's Config(memory_budget_gb=...) (GiB of live tensors)",
    )
    parser.add_argument("--frameworks", default="hf,lightning")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also: Hugging Face's checkpointing with memscale's modules "
        "imported, then with its fake-tensor planning run once before "
        "training; memscale without the first step's recompute check; "
        "and what of planning's RSS gc, torch's fake-tensor cache and "
        "malloc_trim give back",
    )
    args = parser.parse_args()
    variants = ["plain", "hf-checkpointing", "memscale", "memscale-measured"]
    if args.breakdown:
        variants[2:2] = ["hf-checkpointing+imports", "hf-checkpointing+prediction"]
        variants.append("memscale-no-check")
    sys.path.insert(0, ROOT)
    import tempfile

    from memscale._measure import peak_rss_subprocess

    mib = 1 << 20
    print(
        f"GPT-2 6x256, vocab 8192, batch 4x256, {args.steps} AdamW steps, CPU; "
        f"memscale budget {args.budget_gb} GiB, no sample_input"
    )
    print(f"{'framework':<10} {'variant':<28} {'first step':>11} {'whole run':>10}")
    for framework in args.frameworks.split(","):
        for variant in variants:
            code = CHILD.format(
                root=ROOT,
                variant=variant,
                framework=framework,
                steps=args.steps,
                budget=args.budget_gb,
            )
            with tempfile.TemporaryDirectory() as out:
                env = dict(
                    os.environ, MALLOC_MMAP_THRESHOLD_="65536", OUT_DIR=out, PYTHONWARNINGS="ignore"
                )
                first = _run(peak_rss_subprocess, code, env)
            print(
                f"{framework:<10} {variant:<28} {first[0] / mib:>7.1f} MiB "
                f"{first[1] / mib:>6.1f} MiB",
                flush=True,
            )
    if args.breakdown:
        _reclaim(args.budget_gb)
    return 0


def _run(peak_rss_subprocess, code: str, env: dict[str, str]) -> tuple[int, int]:
    """(VmHWM at the end of the first step, VmHWM at the end) of one child."""
    whole = peak_rss_subprocess(code, env=env, timeout=1800)
    with open(os.path.join(env["OUT_DIR"], "first_step_vmhwm")) as f:
        return int(f.read()), whole


if __name__ == "__main__":
    sys.exit(main())
