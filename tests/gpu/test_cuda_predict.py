"""The OOM predictor against the device: memscale.predict_peak of one
training step of each quick benchmark model, unoptimized and under the
CONSERVATIVE plan, against torch.cuda.max_memory_allocated of that step.

Two measured figures per step: the device's own peak, against the
prediction; and the tensors' (the bytes of the tensors the step starts
with, counted from their storages, plus the allocator's rise during the
step), against the prediction less the libraries' workspaces it counts
(PeakPrediction.library_workspace_bytes: cuBLAS keeps them from the first
step on, outside any tensor).  The target is 5% error on both; the
figures are recorded either way."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEV, fresh_device, record

import memscale
from memscale.benchmarks.device import CudaMemory, measure_device_peak
from memscale.benchmarks.measure import live_storage_bytes
from memscale.benchmarks.models import BENCHMARK_MODELS

pytestmark = pytest.mark.cuda

TARGET = 0.05
QUICK = sorted(name for name, m in BENCHMARK_MODELS.items() if m.size == "quick")
CONSERVATIVE = memscale.Config(mode="conservative", force_optimize=True, enable_logging=False)


def _measure(model, batch, optimizer) -> dict[str, int]:
    def step():
        optimizer.zero_grad(set_to_none=True)
        batch.loss_fn(model(*batch.args, **batch.kwargs)).backward()
        optimizer.step()

    step()  # gradients and optimizer state exist, as the prediction assumes
    torch.cuda.synchronize()
    tensors = live_storage_bytes(model, (batch.args, batch.kwargs, optimizer.state))
    report = measure_device_peak(step, CudaMemory(DEV), warmup=0)
    return {
        "device_peak": report.peak_bytes,
        "tensor_peak": tensors + report.peak_delta_bytes,
        "device_start": report.start_bytes,
        "tensor_start": tensors,
    }


def _error(predicted: int, measured: int) -> float:
    return (predicted - measured) / measured


@pytest.mark.parametrize("name", QUICK)
def test_predicted_peak_within_target_of_the_device(name):
    fresh_device()
    entry = BENCHMARK_MODELS[name]
    if entry.hf:
        pytest.importorskip("transformers", reason="transformers is not installed")
    rows = {}
    for variant in ("unoptimized", "conservative"):
        model, batch = entry.build(seed=0, device=DEV)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        prediction = memscale.predict_peak(
            model, batch.sample_input, CONSERVATIVE, optimizer, loss_fn=batch.loss_fn
        )
        assert prediction.device == "cuda" and prediction.simulated_on.startswith("cuda")
        if variant == "conservative":
            memscale.wrap(model, CONSERVATIVE, sample_input=batch.sample_input, optimizer=optimizer)
            plan = model._memscale_executor.plan
            chosen = tuple(layer.name for layer in plan.layers if layer.techniques)
            assert chosen == prediction.checkpointed_layers
            predicted = prediction.optimized.peak_bytes
        else:
            predicted = prediction.unoptimized.peak_bytes
        measured = _measure(model, batch, optimizer)
        libraries = prediction.library_workspace_bytes
        rows[variant] = {
            "predicted": predicted,
            "libraries": libraries,
            "unprobed_calls": prediction.unprobed_calls,
            **measured,
            "error_vs_device": _error(predicted, measured["device_peak"]),
            "error_vs_tensors": _error(predicted - libraries, measured["tensor_peak"]),
        }
        if variant == "conservative":
            memscale.detach(model)
        del model, batch, optimizer
        fresh_device()
    record(f"predict_{name}", rows)
    for variant, row in rows.items():
        assert abs(row["error_vs_tensors"]) <= TARGET, (variant, row)
    for variant, row in rows.items():
        assert abs(row["error_vs_device"]) <= TARGET, (variant, row)


class _Odd(torch.nn.Module):
    """Elementwise only (no library workspace), every tensor under 512
    bytes or of an odd size: each takes a block of the caching allocator
    rounded up to 512 bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(37))
        self.b = torch.nn.Parameter(torch.randn(37))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x * self.w).tanh() + self.b).sigmoid()


def test_small_tensors_are_predicted_as_the_allocators_blocks():
    # torch.cuda.max_memory_allocated counts the caching allocator's
    # blocks (multiples of 512 bytes) and no host tensor (AdamW's step
    # counters): the prediction counts the same, to the byte.
    fresh_device()
    torch.manual_seed(0)
    model = _Odd().to(DEV)
    x = torch.randn(5, 37, device=DEV)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.sum()

    prediction = memscale.predict_peak(model, x, optimizer=optimizer, loss_fn=loss_fn)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x)).backward()
        optimizer.step()

    measured = measure_device_peak(step, CudaMemory(DEV), warmup=1).peak_bytes
    predicted = prediction.unoptimized.peak_bytes
    record("predict_small_tensors", {"predicted": predicted, "measured": measured})
    assert predicted % 512 == 0
    assert predicted == measured
