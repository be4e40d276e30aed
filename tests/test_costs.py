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
from torch import nn
from torch.utils.flop_counter import flop_registry

import memscale
from memscale import _core, _costs, _model, _planner, _planning, _selective, costs
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
    measured = json.loads(files[0].read_text())["costs"]
    for name in CLASS_RATES:
        assert f"{name}: {measured[name]:.3g} " in shown.stdout
    assert "elements/s" in shown.stdout and "in matmul FLOPs:" in shown.stdout


# ---- rates per class of op ------------------------------------------------

CLASS_RATES = ("conv_rate", "attention_rate", "element_rate")


def test_a_measurement_has_a_rate_per_class_of_op(cache):
    table = costs.measure("cpu", save=True)
    record = json.loads(costs.cache_path("cpu").read_text())
    for name in CLASS_RATES:
        value = getattr(table, name)
        assert value > 1e6, name  # FLOP/s, or elements/s: none is a default
        assert value == float(f"{value:.2g}")  # two digits, like the others
        assert record["costs"][name] == value
    assert costs.for_device("cpu") == table
    conv, attention, element = table.weights()
    assert conv == table.flop_rate / table.conv_rate
    assert attention == table.flop_rate / table.attention_rate
    assert element == table.flop_rate / table.element_rate


def test_the_default_rates_charge_what_the_planner_always_charged(cache):
    for table in costs.DEFAULTS.values():
        assert table.conv_rate == table.attention_rate == table.element_rate == table.flop_rate
        assert table.weights() == (1.0, 1.0, 1.0)
    # Unmeasured rates are flop_rate's.
    table = costs.CostTable(flop_rate=2e9, host_bw=0.0, disk_bw=1e8, tile_overhead=1e-5)
    assert (table.conv_rate, table.attention_rate, table.element_rate) == (2e9, 2e9, 2e9)


def test_an_old_cache_without_the_class_rates_still_loads(cache):
    path = _write(SLOW_DISK)  # the four constants of the first release
    table = costs.for_device("cpu")
    assert table.source == str(path)
    assert table.disk_bw == 1e3
    assert table.conv_rate == table.attention_rate == table.element_rate == 5e10
    assert table.weights() == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("name", CLASS_RATES)
@pytest.mark.parametrize("bad", [-1.0, 0.0, "fast", None, True])
def test_a_bad_class_rate_in_the_cache_is_refused_by_name(cache, caplog, name, bad):
    _write(dict(SLOW_DISK, **{name: bad}))
    with caplog.at_level(logging.WARNING, logger="memscale.costs"):
        assert costs.for_device("cpu") == costs.DEFAULTS["cpu"]
    (warning,) = [r.getMessage() for r in caplog.records if "cost cache" in r.getMessage()]
    assert f"CostTable.{name}" in warning


@pytest.mark.parametrize("name", CLASS_RATES)
def test_a_bad_class_rate_is_refused_naming_the_field(name):
    with pytest.raises(ValueError, match=rf"CostTable\.{name} must be a finite float > 0"):
        costs.CostTable(flop_rate=1.0, host_bw=0.0, disk_bw=1.0, tile_overhead=1.0, **{name: 0.0})
    with pytest.raises(ValueError, match=rf"CostTable\.{name}"):
        costs.CostTable(
            flop_rate=1.0, host_bw=0.0, disk_bw=1.0, tile_overhead=1.0, **{name: float("nan")}
        )


def test_ops_are_classed_as_flop_counter_counts_them():
    aten = torch.ops.aten
    assert _selective.op_class(aten.mm.default) == _selective.MATMUL
    assert _selective.op_class(aten.addmm.default) == _selective.MATMUL
    assert _selective.op_class(aten.bmm.default) == _selective.MATMUL
    assert _selective.op_class(aten.convolution.default) == _selective.CONV
    assert _selective.op_class(aten._scaled_dot_product_flash_attention.default) == (
        _selective.ATTENTION
    )
    assert _selective.op_class(aten._efficient_attention_forward.default) == _selective.ATTENTION
    # Every forward op torch counts FLOPs of falls in a class by its name.
    for packet in flop_registry:
        name = getattr(packet, "__name__", str(packet))
        if "backward" in name or not hasattr(packet, "default"):
            continue
        want = (
            _selective.CONV
            if "conv" in name
            else _selective.ATTENTION
            if "attention" in name
            else _selective.MATMUL
        )
        assert _selective.op_class(packet.default) == want, name


def test_the_element_rate_counts_the_elements_the_profile_charges():
    """The chain ``measure`` times writes ELEMENT_CHAIN_OPS tensors the size
    of its input, all by ops without a FLOP formula: what the recorder of
    the planning pass charges per element."""

    class Chain(nn.Module):
        def forward(self, x):
            return _costs._element_chain(x)

    chain = Chain()
    recorder = _selective.OpRecorder([chain])
    x = torch.randn(4, 1024)
    try:
        with recorder:
            chain(x)
    finally:
        recorder.close()
    calls = recorder.ops[0].calls
    assert all(flops == 0.0 for flops, _, _, _ in calls)
    assert sum(numel for _, _, numel, _ in calls) == _costs.ELEMENT_CHAIN_OPS * x.numel()


def test_weights_price_each_recomputed_op_at_its_class_rate():
    calls = [
        (800.0, 8, 2, False),  # a matmul: 100 FLOPs per byte
        (4000.0, 80, 20, False),  # a convolution: 50
        (100.0, 10, 3, False),  # attention: 10
        (0.0, 40, 10, False),  # no formula: 10 elements
    ]
    classes = [_selective.MATMUL, _selective.CONV, _selective.ATTENTION, _selective.MATMUL]
    ops = _selective.LayerOps(calls, classes=classes)
    plain = _selective.layer_profile(ops, flops=4900.0, saved_bytes=1000)
    weights = (3.0, 5.0, 7.0)
    weighted = _selective.layer_profile(ops, flops=4900.0, saved_bytes=1000, weights=weights)
    # The same levels, each recompute at the classes' rates.
    assert [lv[:2] for lv in weighted] == [lv[:2] for lv in plain]
    assert [lv[2] for lv in plain] == [4000.0 + 100.0 + 10, 100.0 + 10, 10.0]
    assert [lv[2] for lv in weighted] == [4000.0 * 3 + 100.0 * 5 + 70, 100.0 * 5 + 70, 70.0]
    # The whole layer: every op at its rate, less one FLOP per element.
    assert _selective.recompute_cost(ops, 4900.0) == 4900.0
    assert _selective.recompute_cost(ops, 4900.0, weights) == (
        800.0 + 4000.0 * 3 + 100.0 * 5 + 10 * (7.0 - 1.0)
    )


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)

    def forward(self, x):
        return torch.relu(self.conv(x))


class _Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(36, 36, bias=False)

    def forward(self, x):
        return torch.relu(self.fc(x))


def _conv_linear_chain():
    """Convolution and linear blocks of the same counted FLOPs and bytes:
    a 3x3 convolution of 4 channels and a 36 x 36 linear layer over the
    last dimension of the same (8, 4, 36, 36) tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(_Conv(), _Linear(), _Conv(), _Linear())
    return model, torch.randn(8, 4, 36, 36)


def _checkpointed(conv_rate: float | None, budget: int | None = None):
    model, x = _conv_linear_chain()
    if conv_rate is None:
        costs.cache_path("cpu").unlink(missing_ok=True)  # the defaults
    else:
        _write(dict(SLOW_DISK, disk_bw=7e8, conv_rate=conv_rate))
    config = memscale.Config(mode="conservative", memory_budget_gb=1.0)
    units = _core.find_units(model)
    profile = _planning.profile_upfront(model, units, x, config)
    fixed = _model.fixed_bytes(model, None)
    at = config.replace(memory_budget_gb=(budget or 1) / (1 << 30))
    plan = _planner.make_plan(profile, at, detect("cpu"), fixed)
    chosen = [
        stats.kind
        for stats, lay in zip(profile.layers, plan.layers)
        if "checkpoint" in lay.techniques
    ]
    return profile, plan, chosen


def test_a_slow_convolution_makes_the_planner_recompute_a_linear_block(cache):
    profile, least, _ = _checkpointed(None)
    flops = {lay.kind: lay.flops for lay in profile.layers}
    assert flops["_Conv"] == flops["_Linear"] > 0  # the same counted FLOPs
    assert len({lay.saved_bytes for lay in profile.layers}) == 1
    assert all(lay.recompute_cost is None for lay in profile.layers)  # default costs
    # The largest budget below the unoptimized peak, in tenths of the way
    # down to the least, that makes the planner recompute one block.
    lo, hi = least.min_budget_bytes, least.peak_unoptimized_bytes
    budget = next(
        b
        for b in (hi - (hi - lo) * k // 10 for k in range(1, 10))
        if len(_checkpointed(None, b)[2]) == 1
    )
    # Convolutions ten times slower than matrix products: the linear block.
    profile, plan, chosen = _checkpointed(5e9, budget)
    assert plan.fits and chosen == ["_Linear"]
    for lay in profile.layers:
        if lay.kind == "_Conv":
            assert lay.recompute_cost == 10 * lay.flops
        else:
            assert lay.recompute_cost is None
    # The predicted slowdown: one block's recompute over three forwards,
    # all at the weighted rates (two linear blocks of F, two conv blocks
    # of 10 F).
    assert plan.predicted_slowdown == pytest.approx(1 + 1 / (3 * 22), rel=1e-12)
    assert _checkpointed(5e9, budget)[1].hash == plan.hash  # deterministic
    # Ten times faster: the convolution block (0.1 F over 3 x 2.2 F).
    profile, plan, chosen = _checkpointed(5e11, budget)
    assert plan.fits and chosen == ["_Conv"]
    assert plan.predicted_slowdown == pytest.approx(1 + 0.1 / (3 * 2.2), rel=1e-12)
    # The default costs: F over 3 x 4 F.
    assert _checkpointed(None, budget)[1].predicted_slowdown == pytest.approx(1 + 1 / 12)
