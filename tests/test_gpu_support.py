"""What the CUDA check (tests/gpu, scripts/gpu-check.sh) relies on, tested
on the CPU: the device measurement behind a stand-in allocator, the
overlap arithmetic, the engine's decisions against a stand-in capacity,
the benchmark suite's --device flag (the CPU figures unchanged), the C
core against newer Pythons' headers, and the check script's answer on a
machine without CUDA.  (The 8-bit kernel's refusal of tensors off the CPU
is in test_optim.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import mlp
from device_checks import check_pressure, check_smart_skip

from memscale import _core
from memscale.benchmarks import __main__ as cli
from memscale.benchmarks import runner
from memscale.benchmarks.device import (
    device_intervals,
    device_memory,
    measure_device_peak,
    measure_step_peak,
    overlap_fraction,
    synchronizer,
)
from memscale.benchmarks.measure import measure_peak
from memscale.benchmarks.models import BENCHMARK_MODELS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class StandInMemory:
    """An allocator that a step drives by hand: what measure_device_peak
    reads from a CUDA device, in the order it must read it."""

    def __init__(self, start: int) -> None:
        self.now = start
        self.peak = start
        self.calls: list[str] = []

    def alloc(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def synchronize(self) -> None:
        self.calls.append("sync")

    def allocated(self) -> int:
        self.calls.append("allocated")
        return self.now

    def reset_peak(self) -> None:
        self.calls.append("reset")
        self.peak = self.now

    def max_allocated(self) -> int:
        self.calls.append("max")
        return self.peak


def test_device_peak_is_the_allocator_s_after_warmup_and_reset():
    memory = StandInMemory(start=1000)

    def step():
        memory.alloc(500)  # activations
        memory.alloc(300)
        memory.alloc(-800)  # freed in backward
        memory.alloc(40)  # 40 bytes more alive after each step

    step()  # before the measurement: a warm-up that raised the peak to 1800
    report = measure_device_peak(step, memory, warmup=1)
    assert memory.calls == ["sync", "allocated", "reset", "sync", "max", "allocated"]
    # Start 1080 (two steps' state), peak 1080 + 800, end 40 above the start.
    assert (report.start_bytes, report.peak_delta_bytes, report.end_delta_bytes) == (1080, 800, 40)
    assert report.peak_bytes == 1880
    with pytest.raises(ValueError, match="warmup"):
        measure_device_peak(step, memory, warmup=-1)


def test_the_cpu_is_measured_as_before():
    assert device_memory(torch.device("cpu")) is None
    assert synchronizer(torch.device("cpu"))() is None
    with pytest.raises(ValueError, match="'cpu' and 'cuda'"):
        device_memory(torch.device("meta"))
    model = mlp()
    x = torch.randn(64, 32)
    opt = torch.optim.AdamW(model.parameters())

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    ours = measure_step_peak(step, torch.device("cpu"), model=model, inputs=(x, opt.state))
    again = measure_peak(step, model=model, inputs=(x, opt.state), warmup=1)
    assert ours == again


@pytest.mark.parametrize(
    "copies, kernels, expected",
    [
        ([(0, 10)], [], 0.0),
        ([(0, 10)], [(0, 10)], 1.0),
        ([(0, 10)], [(5, 20)], 0.5),
        ([(0, 10), (20, 30)], [(8, 22)], 0.2),  # 2 of the first, 2 of the second
        ([(0, 10), (5, 15)], [(0, 3), (2, 6), (14, 40)], 7 / 15),  # unions on both sides
        ([], [(0, 10)], None),
    ],
)
def test_overlap_fraction(copies, kernels, expected):
    got = overlap_fraction(copies, kernels)
    assert got == expected if expected is None else abs(got - expected) < 1e-12


class Event:
    def __init__(self, name, start, end, device=torch.autograd.DeviceType.CUDA):
        self._name, self._start, self._end, self._device = name, start, end, device

    def name(self):
        return self._name

    def start_ns(self):
        return self._start

    def end_ns(self):
        return self._end

    def device_type(self):
        return self._device


def test_device_intervals_sort_a_trace():
    events = [
        Event("Memcpy DtoH (Device -> Pinned)", 0, 10),
        Event("Memcpy HtoD (Pinned -> Device)", 10, 20),
        Event("Memset (Device)", 20, 21),
        Event("ampere_sgemm_128x64_nn", 5, 30),
        Event("aten::mm", 0, 40, torch.autograd.DeviceType.CPU),
    ]
    assert device_intervals(events) == ([(0, 10)], [(5, 30)])


def _stand_in_capacity(monkeypatch, capacity: int) -> None:
    real = _core.detect_hardware

    def detect(*args, **kwargs):
        return {**real(*args, **kwargs), "capacity_bytes": capacity}

    monkeypatch.setattr(_core, "detect_hardware", detect)


def test_smart_skip_against_a_stand_in_capacity(monkeypatch):
    _stand_in_capacity(monkeypatch, 1 << 30)
    check_smart_skip(mlp(), torch.randn(8, 32), 1 << 30)


def test_pressure_against_a_stand_in_capacity(monkeypatch):
    _stand_in_capacity(monkeypatch, 1 << 30)
    check_pressure(mlp(depth=6, width=64), torch.randn(4096, 64), 1 << 30)


def test_benchmark_device_cuda_without_cuda_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--device", "cuda", "--models", "mlp"])
    assert exc.value.code == 2
    assert "--device cuda: no CUDA device here" in capsys.readouterr().err


def _peaks(path) -> dict[tuple[str, str], int]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return {(r["model"], r["variant"]): r["peak_bytes"] for r in data["results"]}


def _run_suite(tmp_path, models, variants):
    path = tmp_path / "cpu.json"
    argv = ["--models", *models, "--variants", *variants, "--no-rss", "--repeats", "1"]
    assert cli.main([*argv, "--device", "cpu", "--no-plot", "--json", str(path)]) == 0
    return _peaks(path)


def _same_peaks_as_without_a_device(tmp_path, models, variants):
    """The suite with --device cpu measures every variant to the byte as
    the suite measured it before devices existed: prepare() without a
    device, measure_peak after one warm-up step."""
    with_flag = _run_suite(tmp_path, models, variants)
    assert len(with_flag) == len(models) * len(variants)
    for (model, variant), peak in with_flag.items():
        prepared = runner.prepare(BENCHMARK_MODELS[model], variant)
        inputs = (prepared.batch.args, prepared.batch.kwargs, prepared.optimizer.state)
        report = measure_peak(prepared.step, model=prepared.model, inputs=inputs, warmup=1)
        prepared.close()
        assert report.peak_bytes == peak, (model, variant)


@pytest.mark.slow
def test_device_cpu_gives_the_same_peaks_on_every_quick_model(tmp_path):
    models = ["mlp", "cnn", "gpt2", "bert", "llama"]
    _same_peaks_as_without_a_device(tmp_path, models, ["unoptimized", "balanced-async"])


def _gpu_check(tmp_path, *args, timeout=300):
    return subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu-check.sh"), "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env=dict(os.environ, PYTHON=sys.executable),
    )


def test_gpu_check_without_cuda_stops_at_once_and_says_why(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    start = time.perf_counter()
    proc = _gpu_check(tmp_path)
    took = time.perf_counter() - start
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stdout
    assert "--dry-run" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "no CUDA device"
    assert summary["environment"]["cuda_available"] is False
    assert not (tmp_path / "junit.xml").exists()  # nothing was built or run
    print(f"gpu-check without CUDA answered in {took:.1f} s")


def _run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", name), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_the_scratch_diagnostic_without_cuda_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = _run_script("gpu_scratch.py", "--json", str(tmp_path / "s.json"))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stdout
    assert not (tmp_path / "s.json").exists()


@pytest.mark.slow
def test_gpu_check_dry_run_collects_and_skips_every_cuda_test(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = _gpu_check(tmp_path, "--dry-run", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    tests = summary["tests"]
    assert tests["total"] >= 15 and tests["skipped"] == tests["total"]
    assert tests["failed"] == tests["errors"] == tests["passed"] == 0
    assert all("needs a CUDA device" in reason for reason in tests["skip_reasons"])
    assert summary["bench"]["status"] == "refused: no CUDA device"
    assert (tmp_path / "junit.xml").exists()


def _newer_python_headers() -> list[str]:
    """Include folders of CPython 3.12 and later on this machine (the GPU
    machine's Python is 3.12): pyenv's versions beside this one, and the
    system's."""
    import glob

    roots = [os.path.dirname(sys.base_prefix), "/usr", "/usr/local"]
    found = set()
    for root in roots:
        for pattern in ("*/include/python3.*", "include/python3.*"):
            for folder in glob.glob(os.path.join(root, pattern)):
                minor = os.path.basename(folder).removeprefix("python3.").rstrip("dmu")
                if minor.isdigit() and int(minor) >= 12 and os.path.exists(f"{folder}/Python.h"):
                    found.add(os.path.realpath(folder))
    return sorted(found)


@pytest.mark.slow
def test_c_core_compiles_against_newer_pythons_headers():
    """Every C file compiles, warnings as errors, against CPython 3.12+
    headers: 3.11's structmember.h brings <stddef.h> with it, 3.12's
    Python.h does not (spill.c used offsetof without it)."""
    folders = _newer_python_headers()
    if not folders:
        pytest.skip("no CPython 3.12+ headers on this machine")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    sources = sorted(str(p) for p in (Path(ROOT) / "csrc").glob("*.c"))
    flags = ["-fsyntax-only", "-std=c11", "-D_POSIX_C_SOURCE=200809L", "-pthread"]
    flags += ["-Wall", "-Wextra", "-Werror"]
    failed = []
    for folder in folders:
        for source in sources:
            proc = subprocess.run(
                [cc, *flags, f"-I{folder}", source], capture_output=True, text=True, check=False
            )
            if proc.returncode != 0:
                failed.append(f"{folder}: {os.path.basename(source)}: {proc.stderr[-800:]}")
    assert not failed, "\n".join(failed)


def test_benchmark_keep_going_names_a_failed_model_and_goes_on(tmp_path, monkeypatch, capsys):
    """The GPU check runs the suite with --keep-going, so that one model
    failing on the device does not lose the others' figures."""
    ran = []

    def run_model(entry, variants, **kwargs):
        ran.append(entry.name)
        raise RuntimeError(f"{entry.name} broke")

    monkeypatch.setattr(cli, "run_model", run_model)
    path = tmp_path / "out.json"
    argv = ["--models", "mlp", "cnn", "--no-rss", "--no-plot", "--json", str(path)]
    assert cli.main([*argv, "--keep-going"]) == 1
    assert ran == ["mlp", "cnn"]
    out = capsys.readouterr().out
    assert (
        "FAILED mlp: RuntimeError: mlp broke" in out
        and "failed cnn: RuntimeError: cnn broke" in out
    )
    assert json.loads(path.read_text())["failed"] == [
        {"model": "mlp", "error": "RuntimeError: mlp broke"},
        {"model": "cnn", "error": "RuntimeError: cnn broke"},
    ]
    with pytest.raises(
        RuntimeError, match="mlp broke"
    ):  # without it, the first error stops the run
        cli.main(argv)


def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_reads_outcomes_from_the_log_of_a_killed_run(tmp_path):
    """A pytest run killed at the timeout writes no JUnit file: the summary
    counts what its -v lines say ran."""
    log = tmp_path / "pytest.log"
    log.write_text(
        "tests/gpu/test_a.py::test_x PASSED [ 5%]\n"
        "tests/gpu/test_a.py::test_y[sync] FAILED [ 9%]\n"
        "E   assert 1 == 2\n"
        "tests/gpu/test_b.py::test_z SKIPPED (needs two GPUs) [14%]\n"
    )
    got = _gpu_check_module()._from_log(str(log))
    assert (got["total"], got["passed"], got["failed"], got["skipped"]) == (3, 1, 1, 1)
    assert got["failures"] == ["tests/gpu/test_a.py::test_y[sync]"]


def test_the_step_memory_diagnostic_without_cuda_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = _run_script("gpu_step_memory.py")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stderr
