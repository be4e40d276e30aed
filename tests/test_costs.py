"""The planner's cost constants: defaults, measured once per machine and
kept in a cache named by the machine's fingerprint (memscale.costs)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import mlp

import memscale
from memscale import _core, _costs, _model, _planner, _planning, costs
from memscale._hardware import detect
from memscale._solve import OffloadInputs


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MEMSCALE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MEMSCALE_COSTS", raising=False)
    _costs._BAD.clear()
    return tmp_path


def _write(constants: dict[str, float], fingerprint: dict | None = None) -> Path:
    path = costs.cache_path("cpu")
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"fingerprint": fingerprint or costs.fingerprint("cpu"), "costs": constants}
    path.write_text(json.dumps(record))
    return path


SLOW_DISK = {"flop_rate": 5e10, "host_bw": 0.0, "disk_bw": 1e3, "tile_overhead": 3e-5}


def _solver_inputs():
    return _planning.solver_inputs(memscale.Config(), detect("cpu"), OffloadInputs())


def test_without_a_measurement_the_planner_uses_the_defaults(cache):
    table = costs.for_device("cpu")
    assert table == costs.DEFAULTS["cpu"]
    assert table.source == "default"
    inputs = _solver_inputs()
    assert inputs.flop_rate == costs.DEFAULTS["cpu"].flop_rate
    assert inputs.offload_bandwidth == costs.DEFAULTS["cpu"].disk_bw


def test_a_measurement_is_kept_for_this_machine_and_used_by_the_planner(cache):
    table = costs.measure("cpu", save=True)
    path = costs.cache_path("cpu")
    assert path.parent == cache and path.exists()
    assert table.source == str(path)
    assert table.flop_rate > 1e8 and table.disk_bw > 1e6 and table.tile_overhead > 0
    assert table.host_bw == 0.0  # a CPU model has no host tier
    # Two significant digits, so a second measurement usually agrees.
    for value in (table.flop_rate, table.disk_bw, table.tile_overhead):
        assert value == float(f"{value:.2g}")
    again = costs.for_device("cpu")
    assert again == table
    inputs = _solver_inputs()
    assert (inputs.flop_rate, inputs.offload_bandwidth) == (table.flop_rate, table.disk_bw)
    record = json.loads(path.read_text())
    assert record["fingerprint"] == costs.fingerprint("cpu")
    assert not list(cache.glob("*.tmp"))


FAST_DISK = {"flop_rate": 1e8, "host_bw": 0.0, "disk_bw": 1e15, "tile_overhead": 3e-5}


def _solver_plan(budget_gb: float):
    """The budget planner's own plan (before any simulated check) for an
    8-block MLP whose inputs are worth offloading."""
    torch.manual_seed(0)
    model = mlp(depth=8, width=256)
    x = torch.randn(2048, 256)
    config = memscale.Config(
        memory_budget_gb=budget_gb, mode=memscale.OptimizationMode.BALANCED, async_offload=False
    )
    profile = _planning.profile_upfront(model, _core.find_units(model), x, config)
    return _planner.make_plan(profile, config, detect("cpu"), _model.fixed_bytes(model, None))


def test_measured_costs_change_the_plan_and_plans_stay_deterministic(cache):
    # A measurement where the disk is slow: nothing is offloaded (with the
    # default costs one input is, beside layers run selective).
    _write(SLOW_DISK)
    default = _solver_plan(0.1)
    assert default.fits and default.technique_counts["offload"] == 0
    # A measurement where recompute is slow and the disk free: the planner
    # offloads inputs instead of recomputing.
    _write(FAST_DISK)
    measured = _solver_plan(0.1)
    assert measured.fits and measured.technique_counts["offload"] > 0
    assert measured.hash != default.hash
    assert _solver_plan(0.1).hash == measured.hash  # same machine, cache, Config


def test_another_machines_measurement_is_ignored_with_one_warning(cache, caplog):
    other = dict(costs.fingerprint("cpu"), name="another CPU")
    _write(SLOW_DISK, fingerprint=other)
    with caplog.at_level(logging.WARNING, logger="memscale.costs"):
        assert costs.for_device("cpu") == costs.DEFAULTS["cpu"]
        assert costs.for_device("cpu") == costs.DEFAULTS["cpu"]
    warnings = [r for r in caplog.records if "cost cache" in r.getMessage()]
    assert len(warnings) == 1
    assert "another machine" in warnings[0].getMessage()
    assert "python -m memscale.costs" in warnings[0].getMessage()


@pytest.mark.parametrize(
    "text",
    ["{not json", json.dumps({"costs": SLOW_DISK}), "[]"],
    ids=["corrupt", "no-fingerprint", "not-a-record"],
)
def test_an_unreadable_cache_falls_back_to_the_defaults(cache, caplog, text):
    path = costs.cache_path("cpu")
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="memscale.costs"):
        assert costs.for_device("cpu") == costs.DEFAULTS["cpu"]
    assert any(str(path) in r.getMessage() for r in caplog.records)


def test_nonsense_constants_in_the_cache_are_refused(cache, caplog):
    _write(dict(SLOW_DISK, flop_rate=-1.0))
    with caplog.at_level(logging.WARNING, logger="memscale.costs"):
        assert costs.for_device("cpu") == costs.DEFAULTS["cpu"]
    assert any("flop_rate" in r.getMessage() for r in caplog.records)


def test_memscale_costs_default_ignores_the_measurement(cache, monkeypatch):
    _write(SLOW_DISK)
    assert costs.for_device("cpu").disk_bw == 1e3
    monkeypatch.setenv("MEMSCALE_COSTS", "default")
    assert costs.for_device("cpu") == costs.DEFAULTS["cpu"]


def test_the_fingerprint_names_the_cpu_and_its_threads(cache):
    fp = costs.fingerprint("cpu")
    assert fp["threads"] == torch.get_num_threads()
    assert fp["torch"] == torch.__version__ and fp["name"]
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        costs.fingerprint("mps")


def test_bad_tables_and_devices_are_refused(cache):
    with pytest.raises(ValueError, match=r"CostTable.disk_bw must be a finite float > 0"):
        costs.CostTable(flop_rate=1.0, host_bw=0.0, disk_bw=0.0, tile_overhead=1.0)
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        costs.measure("mps")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="torch.cuda.is_available"):
            costs.measure("cuda")
    assert not list(cache.iterdir())


def test_the_command_measures_and_shows(cache):
    env = {"MEMSCALE_CACHE_DIR": str(cache), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    root = str(Path(__file__).resolve().parents[1])
    run = subprocess.run(
        [sys.executable, "-m", "memscale.costs"],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": root},
        timeout=120,
        check=True,
    )
    assert "source: " + str(cache) in run.stdout
    assert "flop_rate: " in run.stdout and "disk_bw: " in run.stdout
    files = list(cache.glob("costs-cpu-*.json"))
    assert len(files) == 1
    shown = subprocess.run(
        [sys.executable, "-m", "memscale.costs", "--show"],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": root},
        timeout=120,
        check=True,
    )
    assert f"source: {files[0]}" in shown.stdout
