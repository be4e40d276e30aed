"""Where a CUDA training step's memory goes beyond its tensors: a
diagnostic for the predictor (docs/gpu.md).  On a machine with CUDA it

1. measures the libraries' persistent workspaces: the allocator bytes a
   matmul forward (the calling thread's cuBLAS handle) and its backward
   (autograd's device thread, a handle of its own) leave allocated, each in
   a fresh process, and what torch._C._cuda_clearCublasWorkspaces gives back;
2. checks that torch's memory profiler sees CUDA allocations (so the
   predictor's kernel probe can measure scratch on the device);
3. runs one training step of each quick benchmark model (AdamW) under a
   dispatch mode that measures, per operator call, the allocator's peak
   inside the call above what it held before and what the call returned
   (torch.cuda.reset_peak_memory_stats around each call), and prints every
   operator with scratch memory.

    python scripts/gpu_scratch.py [--json PATH] [--models NAME ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PERSISTENT = r"""
import json, sys, torch
dev = torch.device("cuda")
dtype = getattr(torch, sys.argv[1])
x = torch.zeros(64, 64, device=dev, dtype=dtype, requires_grad=True)
lin = torch.nn.Linear(64, 64, device=dev, dtype=dtype)
torch.cuda.synchronize()
out = {"start": torch.cuda.memory_allocated()}
with torch.no_grad():
    y = lin(x)
    z = x @ x
del y, z
torch.cuda.synchronize()
out["after_forward"] = torch.cuda.memory_allocated()
def backward():
    lin(x).sum().backward()
    torch.cuda.synchronize()
    x.grad = lin.weight.grad = lin.bias.grad = None
    return torch.cuda.memory_allocated()
out["after_backward"] = backward()
torch._C._cuda_clearCublasWorkspaces()
out["after_clear"] = torch.cuda.memory_allocated()
out["after_second_backward"] = backward()
print(json.dumps(out))
"""


def persistent() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for config in (None, ":4096:8"):
        env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
        if config:
            env["CUBLAS_WORKSPACE_CONFIG"] = config
        for dtype in ("float32", "bfloat16"):
            proc = subprocess.run(
                [sys.executable, "-c", _PERSISTENT, dtype],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            key = f"{dtype} CUBLAS_WORKSPACE_CONFIG={config or 'unset'}"
            try:
                results[key] = json.loads(proc.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                results[key] = {"error": (proc.stdout + proc.stderr)[-1500:]}
            print(f"persistent {key}: {results[key]}", flush=True)
    return results


def profiler_sees_cuda() -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.zeros(8, 16, 64, 64, device="cuda")
    w = torch.zeros(32, 16, 3, 3, device="cuda")
    torch.nn.functional.conv2d(x, w)
    torch.cuda.synchronize()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.start()
    y = torch.nn.functional.conv2d(x, w)
    torch.cuda.synchronize()
    prof.stop()
    del y
    events = []
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]":
            row: dict[str, Any] = {"nbytes": e.nbytes()}
            for attr in ("device_type", "device_index"):
                try:
                    row[attr] = str(getattr(e, attr)())
                except Exception as exc:  # noqa: BLE001 - a diagnostic
                    row[attr] = f"n/a ({type(exc).__name__})"
            events.append(row)
    print(f"profiler [memory] events around a CUDA conv2d: {events}", flush=True)
    return {"events": events}


def _step(model: Any, batch: Any, optimizer: Any) -> None:
    optimizer.zero_grad(set_to_none=True)
    batch.loss_fn(model(*batch.args, **batch.kwargs)).backward()
    optimizer.step()


def step_scratch(names: list[str]) -> dict[str, Any]:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    import memscale
    from memscale.benchmarks.models import BENCHMARK_MODELS

    class Scratch(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
            self.bytes: dict[tuple[str, str], int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            flat, _ = tree_flatten((args, kwargs))
            held = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = func(*args, **kwargs)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            outs, _ = tree_flatten(out)
            new = {}
            for t in outs:
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    st = t.untyped_storage()
                    if st.data_ptr() not in held:
                        new[st.data_ptr()] = st.nbytes()
            scratch = peak - before - sum(new.values())
            if scratch > 0:
                shapes = ",".join(
                    "x".join(map(str, t.shape)) for t in flat if isinstance(t, torch.Tensor)
                )[:120]
                key = (str(func), shapes)
                self.calls[key] += 1
                self.bytes[key] = max(self.bytes.get(key, 0), scratch)
            return out

    conservative = memscale.Config(mode="conservative", force_optimize=True, enable_logging=False)
    results: dict[str, Any] = {}
    for name in names:
        entry = BENCHMARK_MODELS[name]
        for variant in ("unoptimized", "conservative"):
            model, batch = entry.build(seed=0, device=torch.device("cuda"))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            if variant == "conservative":
                memscale.wrap(
                    model, conservative, sample_input=batch.sample_input, optimizer=optimizer
                )

            _step(model, batch, optimizer)
            mode = Scratch()
            with mode:
                _step(model, batch, optimizer)
            rows = sorted(
                ((mode.bytes[k], mode.calls[k], k[0], k[1]) for k in mode.bytes), reverse=True
            )
            results[f"{name}/{variant}"] = rows
            print(f"== {name} {variant}: {len(rows)} operator calls with scratch", flush=True)
            for nbytes, count, op, shapes in rows[:25]:
                print(f"  {nbytes:>12,d} B  x{count:<3d} {op}  [{shapes}]", flush=True)
            if variant == "conservative":
                memscale.detach(model)
            del model, batch, optimizer, mode
            torch.cuda.empty_cache()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json")
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "gpt2", "bert", "llama"])
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_scratch: no CUDA device here")
        return 3
    print(
        f"torch {torch.__version__}, preferred BLAS "
        f"{torch.backends.cuda.preferred_blas_library()}, "
        f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}",
        flush=True,
    )
    result = {"persistent": persistent(), "profiler": profiler_sees_cuda()}
    result["scratch"] = step_scratch(args.models)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
