"""Tests of memscale.benchmarks.measure (CPU, a few seconds)."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from memscale.benchmarks.measure import (
    MemoryReport,
    TimeReport,
    format_bytes,
    live_storage_bytes,
    measure_peak,
    peak_rss_subprocess,
    time_ratio,
)

MiB = 1024 * 1024


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- measure_peak ----------------------------------------------------------


def test_same_step_twice_gives_the_same_bytes() -> None:
    model = _mlp()
    x = torch.randn(32, 64)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = measure_peak(step, model=model, inputs=(x,), warmup=1)
        second = measure_peak(step, model=model, inputs=(x,), warmup=2)
    assert first == second
    assert first.start_bytes == 2 * _param_bytes(model) + x.numel() * 4
    assert first.peak_delta_bytes > 0
    # The old grads are freed and new ones allocated: no net change.
    assert first.end_delta_bytes == 0


def test_freeing_unprofiled_tensors_without_warmup_warns() -> None:
    model = _mlp()
    x = torch.randn(32, 64)
    model(x).sum().backward()  # grads allocated outside any profiler

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    with pytest.warns(UserWarning, match="warmup"):
        measure_peak(step, model=model, inputs=(x,))


@pytest.mark.parametrize("nbytes", [1, 1001, 4096, 3 * MiB + 7])
def test_one_tensor_allocated_and_freed_is_exact(nbytes: int) -> None:
    def step() -> None:
        t = torch.empty(nbytes, dtype=torch.uint8)
        del t

    report = measure_peak(step)
    # The allocator reports the requested size: no alignment rounding.
    assert report == MemoryReport(0, nbytes, 0)


def test_overlapping_tensors_give_the_analytic_peak() -> None:
    a_bytes, b_bytes, c_bytes = 4 * 1000, 8 * 333, 2 * 5001

    def step() -> torch.Tensor:
        a = torch.ones(1000, dtype=torch.float32)
        b = torch.ones(333, dtype=torch.float64)
        del a
        c = torch.ones(5001, dtype=torch.float16)
        del b
        return c  # dropped inside the measured range

    report = measure_peak(step)
    assert report.peak_delta_bytes == max(a_bytes + b_bytes, b_bytes + c_bytes)
    assert report.end_delta_bytes == 0

    kept: list[torch.Tensor] = []
    report = measure_peak(lambda: kept.append(torch.empty(250)))
    assert report.peak_delta_bytes == report.end_delta_bytes == 1000


def test_forward_backward_counts_parameters_inputs_and_grads() -> None:
    model = _mlp()
    x = torch.randn(32, 64)
    params = _param_bytes(model)
    input_bytes = x.numel() * x.element_size()

    def step() -> None:
        model(x).sum().backward()

    report = measure_peak(step, model=model, inputs=(x,))
    assert report.start_bytes == params + input_bytes
    assert report.peak_delta_bytes > 0
    assert report.peak_bytes == report.start_bytes + report.peak_delta_bytes
    # Activations die with the step; the new .grad tensors stay.
    assert report.end_delta_bytes == params

    # After a warm-up backward the grads exist when the step starts, and the
    # accumulating step allocates no new grads.
    report = measure_peak(step, model=model, inputs={"x": x}, warmup=1)
    assert report.start_bytes == 2 * params + input_bytes
    assert report.end_delta_bytes == 0


def test_step_that_raises_stops_the_profiler() -> None:
    def step() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError):
        measure_peak(step)
    assert measure_peak(lambda: torch.empty(10)).peak_delta_bytes == 40


def test_active_profiler_is_refused() -> None:
    calls: list[int] = []
    with profile(activities=[ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="already active|profiler is"):
            measure_peak(lambda: calls.append(1))
    assert calls == []
    assert measure_peak(lambda: None).peak_delta_bytes == 0


def test_measure_peak_validates_arguments() -> None:
    with pytest.raises(TypeError, match="step_fn"):
        measure_peak(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup"):
        measure_peak(lambda: None, warmup=-1)
    with pytest.raises(TypeError, match="warmup"):
        measure_peak(lambda: None, warmup=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model"):
        measure_peak(
            lambda: None,
            model=torch.zeros(2),  # type: ignore[arg-type]
        )


# -- live_storage_bytes ----------------------------------------------------


def test_live_storage_bytes_dedupes_views_and_nesting() -> None:
    base = torch.zeros(100)  # 400 bytes
    views = [base[10:], base.view(10, 10).t(), base[::3], base.unsqueeze(0)]
    assert live_storage_bytes(base) == 400
    assert live_storage_bytes(*views) == 400
    other = torch.zeros(10, dtype=torch.float64)  # 80 bytes
    nested = {"a": [base, (views[0], {"b": other})], "c": other[2:], "d": None}
    assert live_storage_bytes(nested, base, "text", 3) == 480
    # A view counts the whole storage it keeps alive.
    assert live_storage_bytes(base[:1].clone()) == 4
    assert live_storage_bytes(torch.zeros(1000)[:1]) == 4000


def test_live_storage_bytes_skips_meta_and_empty() -> None:
    assert live_storage_bytes() == 0
    assert live_storage_bytes(torch.empty(1000, device="meta")) == 0
    assert live_storage_bytes(torch.empty(0), []) == 0
    with torch.device("meta"):
        meta_model = torch.nn.Linear(1000, 1000)
    assert live_storage_bytes(meta_model) == 0


def test_live_storage_bytes_of_a_module() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    params = _param_bytes(model)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert live_storage_bytes(model) == params + buffers
    model(torch.randn(4, 8)).sum().backward()
    assert live_storage_bytes(model) == 2 * params + buffers

    # Tied weights count once.
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    assert live_storage_bytes(torch.nn.ModuleList([emb, head])) == 160


# -- peak_rss_subprocess ---------------------------------------------------


def test_peak_rss_subprocess_sees_a_64_mib_tensor() -> None:
    idle = peak_rss_subprocess("import torch")
    big = peak_rss_subprocess(
        "import torch\n"
        "t = torch.ones(64 * 1024 * 1024, dtype=torch.uint8)\n"
        "print(int(t.sum()), end='')\n"  # output without a newline is fine
    )
    assert idle > 10 * MiB
    assert big > 10 * MiB
    # Touched pages of 64 MiB show up in the child's RSS.
    assert big - idle > 32 * MiB


def test_peak_rss_subprocess_reports_failures() -> None:
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        peak_rss_subprocess("x = 1\n1 / 0\n")
    with pytest.raises(RuntimeError, match="code 3"):
        peak_rss_subprocess("import sys; sys.stderr.write('bad'); sys.exit(3)")
    # A clean sys.exit still reports, and __name__ is __main__.
    assert peak_rss_subprocess("import sys\nassert __name__ == '__main__'\nsys.exit(0)") > 0
    with pytest.raises(RuntimeError, match="did not finish"):
        peak_rss_subprocess("import time; time.sleep(30)", timeout=0.5)


def test_peak_rss_subprocess_passes_env() -> None:
    code = "import os\nassert os.environ['MEMSCALE_TEST_VAR'] == 'on'\n"
    env = {"MEMSCALE_TEST_VAR": "on", "PATH": "/usr/bin:/bin"}
    assert peak_rss_subprocess(code, env=env) > 0
    with pytest.raises(RuntimeError, match="KeyError"):
        peak_rss_subprocess(code, env={"PATH": "/usr/bin:/bin"})


# -- time_ratio ------------------------------------------------------------


def test_time_ratio_interleaves_and_counts() -> None:
    order: list[str] = []
    report = time_ratio(
        lambda: order.append("b"),
        lambda: order.append("v"),
        repeats=4,
        warmup=2,
    )
    assert order == ["b", "v"] * 6
    assert len(report.baseline_s) == len(report.variant_s) == 4
    assert all(s >= 0 for s in report.baseline_s + report.variant_s)
    assert report.ratio > 0


def test_time_report_medians_and_ratio() -> None:
    report = TimeReport(baseline_s=(1.0, 3.0, 2.0), variant_s=(4.0, 5.0, 3.0))
    assert report.baseline_median == 2.0
    assert report.variant_median == 4.0
    assert report.ratio == 2.0
    with pytest.raises(ValueError, match="baseline_s"):
        TimeReport(baseline_s=(), variant_s=(1.0,))
    with pytest.raises(ValueError, match="repeats"):
        time_ratio(lambda: None, lambda: None, repeats=0)


# -- format_bytes ----------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (512 * MiB, "512.0 MiB"),
        (int(1.25 * 1024 * MiB), "1.25 GiB"),
        (1024 * MiB - 1, "1.0 GiB"),
        (-2 * MiB, "-2.0 MiB"),
        (-100, "-100 B"),
        (5 * 1024**4, "5.0 TiB"),
        (float(3 * MiB), "3.0 MiB"),
    ],
)
def test_format_bytes(n: int | float, text: str) -> None:
    assert format_bytes(n) == text


def test_format_bytes_rejects_non_numbers() -> None:
    with pytest.raises(TypeError):
        format_bytes("12")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        format_bytes(True)
    with pytest.raises(ValueError):
        format_bytes(float("inf"))


def test_module_imports_only_torch_and_stdlib() -> None:
    module = sys.modules[measure_peak.__module__]
    roots = {
        value.__name__.split(".")[0] for value in vars(module).values() if type(value) is type(sys)
    }
    allowed = set(sys.stdlib_module_names) | {"torch"}
    assert roots <= allowed, roots - allowed


def test_peak_rss_subprocess_is_the_childs_own_peak():
    # Linux carries ru_maxrss across exec(): a large parent must not leak
    # its size into the child's figure.
    import torch

    hold = torch.ones(256 * 2**20 // 4)  # 256 MiB touched in this process
    child = peak_rss_subprocess("x = 1")
    assert child < hold.numel() * 4
