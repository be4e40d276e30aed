"""memscale._core as a module: multi-phase init and re-import, signatures,
hardware detection, planning-unit discovery, and leaks over many
wrap/detach cycles (in a subprocess)."""

from __future__ import annotations

import gc
import importlib
import importlib.util
import inspect
import json
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import memscale
from memscale import _core

ROOT = pathlib.Path(__file__).resolve().parent.parent

os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PLAN_ARGS = dict(
    mode="balanced",
    allowed=1,
    force=False,
    budget_bytes=100,
    fixed_bytes=10,
    activation_bytes=200,
    total_flops=3.0,
    device="cpu",
    device_count=1,
    capacity_bytes=1000,
)
PLAN_LAYERS = [("a", "L", 0, 100, 10, 1.0, 0), ("b", "L", 0, 100, 10, 2.0, 0)]


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


def names(units):
    return [name for name, _ in units]


def _exercise(mod) -> str:
    """find_units, build_plan and detect_hardware of one module object."""
    stack = nn.Sequential(Block(), Block(), Block())
    units = mod.find_units(stack)
    assert names(units) == ["0", "1", "2"]
    assert all(m is stack[i] for i, (_, m) in enumerate(units))
    plan = mod.build_plan(PLAN_LAYERS, **PLAN_ARGS)
    assert type(plan) is mod.Plan
    assert type(plan.layers[0]) is mod.LayerPlan
    hw = mod.detect_hardware("cpu")
    assert hw["device"] == "cpu" and hw["capacity_bytes"] > 0
    return plan.to_json()


# ------------------------------------------------------- multi-phase init


def test_reimport_gives_a_fresh_working_module():
    old = sys.modules["memscale._core"]
    assert old is _core
    reference = _exercise(old)
    try:
        del sys.modules["memscale._core"]
        new = importlib.import_module("memscale._core")
        assert new is not old
        assert sys.modules["memscale._core"] is new
        # Per-module state: the heap types are created again, not shared.
        assert new.Plan is not old.Plan
        assert new.LayerPlan is not old.LayerPlan
        assert new.Executor is not old.Executor
        assert _exercise(new) == reference
        plan = new.build_plan(PLAN_LAYERS, **PLAN_ARGS)
        assert not isinstance(plan, old.Plan)
        assert new.TECH_CHECKPOINT == old.TECH_CHECKPOINT
    finally:
        sys.modules["memscale._core"] = old
        memscale._core = old
    # The new module goes away; a plan it made keeps its type (and the
    # module state behind it) alive and usable.
    del new
    gc.collect()
    assert plan.to_json() == reference
    assert plan.layers[1].name == "b"
    del plan
    gc.collect()
    # The original module is untouched by all of this.
    assert _exercise(old) == reference


def test_module_from_spec_twice():
    spec = importlib.util.find_spec("memscale._core")
    assert spec is not None and spec.origin is not None
    mods = []
    for _ in range(2):
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mods.append(mod)
    a, b = mods
    assert a is not b and a is not _core
    assert a.Plan is not b.Plan
    assert _exercise(a) == _exercise(b) == _exercise(_core)
    assert sys.modules["memscale._core"] is _core
    del a, b, mods, mod
    gc.collect()


def test_module_constants():
    assert _core.ABI == "cpython-c-api"
    assert (_core.TECH_CHECKPOINT, _core.TECH_OFFLOAD, _core.TECH_TILING) == (1, 2, 4)


# ---------------------------------------------------------- signatures


def test_signatures():
    P = inspect.Parameter
    sig = inspect.signature(_core.find_units)
    assert [(p.name, p.kind) for p in sig.parameters.values()] == [("model", P.POSITIONAL_ONLY)]

    sig = inspect.signature(_core.detect_hardware)
    params = list(sig.parameters.values())
    assert [p.name for p in params] == ["device_type", "index"]
    assert params[0].default is P.empty
    assert params[1].default == 0

    sig = inspect.signature(_core.build_plan)
    params = list(sig.parameters.values())
    assert params[0].name == "layers"
    assert params[0].kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
    keyword = {p.name for p in params[1:]}
    optional = {
        "min_offload_bytes": 0,
        "host_tier": False,
        "host_cap_bytes": -1,
        "disk_tier": True,
        "peak_offset_bytes": 0,
        "plan_offset_bytes": None,
        "solver": False,
        "async_offload": False,
        "flop_rate": 0.0,
        "offload_bandwidth": 0.0,
        "tile_overhead": 0.0,
        "max_segment": 64,
        "resolution": 512,
    }
    assert keyword == set(PLAN_ARGS) | set(optional)
    assert all(p.kind is P.KEYWORD_ONLY for p in params[1:])
    assert {p.name: p.default for p in params[1:] if p.name in optional} == optional
    # The signature says what the function accepts.
    sig.bind(PLAN_LAYERS, **PLAN_ARGS)
    _core.build_plan(PLAN_LAYERS, **PLAN_ARGS)
    # Every documented default is the one the parser applies.
    defaults = {p.name: p.default for p in params[1:] if p.name in optional}
    assert (
        _core.build_plan(PLAN_LAYERS, **PLAN_ARGS, **defaults).to_json()
        == _core.build_plan(PLAN_LAYERS, **PLAN_ARGS).to_json()
    )

    assert str(inspect.signature(_core.Plan.to_json)) == "(self, /)"


def test_docstrings():
    for fn in (_core.find_units, _core.detect_hardware, _core.build_plan):
        assert fn.__doc__ and fn.__text_signature__


# ------------------------------------------------------------ hardware


def _expected_host_memory() -> tuple[int, bool]:
    """Host RAM, lowered to a cgroup limit: (bytes, limited by a cgroup)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limited = False
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = pathlib.Path(path).read_text().split()
            limit = int(text[0]) if text else 0
        except (OSError, ValueError):  # absent, or "max"
            continue
        if 0 < limit < total:
            total, limited = limit, True
    return total, limited


def _mem_total() -> int | None:
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def test_detect_hardware_cpu():
    hw = _core.detect_hardware("cpu")
    assert set(hw) == {"device", "index", "count", "capacity_bytes", "bf16", "name"}
    assert hw["device"] == "cpu" and hw["index"] == 0 and hw["count"] == 1
    assert isinstance(hw["capacity_bytes"], int) and hw["capacity_bytes"] > 0
    expected, limited = _expected_host_memory()
    assert hw["capacity_bytes"] == expected
    mem_total = _mem_total()
    if mem_total is not None:
        assert hw["capacity_bytes"] <= mem_total * 1.01
        if not limited:
            assert hw["capacity_bytes"] == pytest.approx(mem_total, rel=0.01)
    assert _core.detect_hardware("cpu") == hw
    assert _core.detect_hardware(device_type="cpu", index=0) == hw


def test_detect_hardware_rejects_other_devices():
    for device in ("tpu", "mps", "", "CPU"):
        with pytest.raises(ValueError) as err:
            _core.detect_hardware(device)
        msg = str(err.value)
        assert "'cpu'" in msg and "'cuda'" in msg
        assert repr(device) in msg
    with pytest.raises(TypeError):
        _core.detect_hardware(5)
    with pytest.raises(TypeError):
        _core.detect_hardware()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host")
def test_detect_hardware_cuda_without_devices():
    with pytest.raises(RuntimeError, match="not available"):
        _core.detect_hardware("cuda")


def test_detect_hardware_bad_device_by_keyword():
    code = (
        "import memscale._core as C\n"
        "try:\n"
        "    C.detect_hardware(device_type='tpu')\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_child_env(),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "'tpu'" in out.stdout


# ---------------------------------------------------------- find_units


def test_find_units_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=128, n_positions=32)
    )
    units = _core.find_units(model)
    assert names(units) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert [m for _, m in units] == list(model.transformer.h)
    assert all(type(m).__name__ == "GPT2Block" for _, m in units)


def test_find_units_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(
        BertConfig(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        )
    )
    units = _core.find_units(model)
    assert names(units) == ["encoder.layer.0", "encoder.layer.1"]
    assert [m for _, m in units] == list(model.encoder.layer)


def test_find_units_sequential_of_blocks():
    model = nn.Sequential(*[Block() for _ in range(4)])
    units = _core.find_units(model)
    assert names(units) == ["0", "1", "2", "3"]
    assert [m for _, m in units] == list(model)
    assert all(isinstance(pair, tuple) and len(pair) == 2 for pair in units)
    assert isinstance(units, list)


def test_find_units_nested_repeating_container():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(8, 8)
            self.blocks = nn.ModuleList([Block() for _ in range(3)])
            self.head = nn.Linear(8, 2)

    model = Net()
    assert names(_core.find_units(model)) == ["blocks.0", "blocks.1", "blocks.2"]


def test_find_units_shared_block_is_one_unit():
    shared = Block()
    model = nn.ModuleList([shared, Block(), shared])
    units = _core.find_units(model)
    assert [m for _, m in units] == [shared, model[1]]


class Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 512)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(512, 8)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class NoRepeats(nn.Module):
    def __init__(self, big: nn.Module) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.body = big
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.norm(self.body(self.stem(x))))


def test_find_units_without_repeats_splits_the_biggest_child():
    model = NoRepeats(Big())
    total = sum(p.numel() for p in model.parameters())
    assert 2 * sum(p.numel() for p in model.body.parameters()) > total
    units = _core.find_units(model)
    assert names(units) == ["stem", "body.fc1", "body.act", "body.fc2", "norm", "head"]
    assert units[1][1] is model.body.fc1


def test_find_units_without_repeats_top_level_children():
    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(8, 4)
            self.fc2 = nn.Linear(4, 8)

    model = NoRepeats(Small())  # no child holds more than half
    assert 2 * sum(p.numel() for p in model.body.parameters()) <= sum(
        p.numel() for p in model.parameters()
    )
    assert names(_core.find_units(model)) == ["stem", "body", "norm", "head"]


def test_find_units_leaf_module():
    assert _core.find_units(nn.Linear(2, 2)) == []


@pytest.mark.parametrize("obj", [5, None, "model", nn.Linear, [nn.Linear(2, 2)]])
def test_find_units_of_a_non_module(obj):
    with pytest.raises(TypeError, match="torch.nn.Module"):
        _core.find_units(obj)


def test_find_units_arity():
    with pytest.raises(TypeError):
        _core.find_units()
    with pytest.raises(TypeError):
        _core.find_units(nn.Linear(2, 2), nn.Linear(2, 2))


# --------------------------------------------------------------- leaks


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    return env


LEAK_SCRIPT = textwrap.dedent("""
    import gc, json, weakref
    import torch
    from torch import nn
    import memscale
    from memscale import Config

    torch.set_num_threads(1)  # tiny tensors: threads only add noise

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(*[
            nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
            for _ in range(3)])

    x = torch.randn(4, 16)
    configs = [
        Config(enable_logging=False),                      # smart-skip
        Config(enable_logging=False, force_optimize=True,  # checkpointing
               mode="conservative"),
        Config(enable_logging=False, force_optimize=True,
               use_static_profiling=False),                # empirical
    ]
    model = mlp()
    counts = {}
    frames = 0
    for cycle in range(1, 201):
        memscale.wrap(model, configs[cycle % 3], sample_input=x)
        loss = model(x).sum()
        loss.backward()
        frames += model._memscale_executor.stats["checkpoint_frames"]
        del loss
        model.zero_grad(set_to_none=True)
        memscale.detach(model)
        if cycle in (20, 200):
            gc.collect()
            counts[cycle] = len(gc.get_objects())

    # A wrapped, used and detached model is freed once dropped.
    victim = mlp()
    ref = weakref.ref(victim)
    memscale.wrap(victim, configs[1], sample_input=x)
    executor = victim._memscale_executor
    victim(x).sum().backward()
    memscale.detach(victim)
    del victim
    gc.collect()
    print(json.dumps({"counts": counts, "frames": frames,
                      "freed": ref() is None,
                      "executor_model_none": executor.model is None,
                      "executor_state": executor.state}))
""")


@pytest.mark.slow
def test_wrap_detach_cycles_do_not_leak():
    out = subprocess.run(
        [sys.executable, "-c", LEAK_SCRIPT],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_child_env(),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    counts = {int(k): v for k, v in result["counts"].items()}
    growth = counts[200] - counts[20]
    assert growth < 50, f"{growth} objects more after 180 further cycles"
    assert result["frames"] > 0, "checkpointing never ran"
    assert result["freed"], "the model outlived wrap/detach"
    assert result["executor_model_none"]
    assert result["executor_state"] == "detached"


# ---------------------------------------------------------- LayerStats

LAYER_FIELDS = ("name", "kind", "param_bytes", "saved_bytes", "input_bytes", "flops", "flags")


def test_layer_stats_is_a_named_tuple_of_the_seven_figures():
    stats = _core.LayerStats(("h.0", "Block", 8, 100, 10, 2.5, _core.LAYER_TILEABLE))
    assert isinstance(stats, tuple) and len(stats) == 7
    assert _core.LayerStats.n_sequence_fields == 7
    # Five more by name only, not in the tuple: backward_bytes (the
    # per-layer calibration), the selective levels, the recompute cost
    # and the tail (None without).
    assert _core.LayerStats.n_fields == 12 and stats.backward_bytes is None
    assert stats.selective_levels is None and stats.recompute_cost is None
    assert stats.tail_flops is None and stats.tail_cost is None
    assert _core.LayerStats.__match_args__ == LAYER_FIELDS
    assert tuple(getattr(stats, f) for f in LAYER_FIELDS) == tuple(stats)
    assert stats == ("h.0", "Block", 8, 100, 10, 2.5, _core.LAYER_TILEABLE)
    assert stats.saved_bytes == 100 and stats.flops == 2.5
    assert repr(stats).startswith("memscale._core.LayerStats(name='h.0', kind='Block'")
    assert _core.LayerStats.__module__ == "memscale._core"
    for field in LAYER_FIELDS:
        assert getattr(_core.LayerStats, field).__doc__, field
    with pytest.raises(AttributeError):
        stats.saved_bytes = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        _core.LayerStats(("h.0", "Block", 8))  # a LayerStats has 7 fields


def _forced_one_layer(total_flops: float) -> dict:
    """build_plan's arguments for one 100-byte layer checkpointed by force
    at a matmul rate of 1 FLOP/s."""
    return {
        **PLAN_ARGS,
        "allowed": _core.TECH_CHECKPOINT,
        "force": True,
        "budget_bytes": 10**9,
        "fixed_bytes": 0,
        "activation_bytes": 100,
        "total_flops": total_flops,
        "capacity_bytes": 10**9,
        "solver": True,
        "flop_rate": 1.0,
    }


def test_layer_stats_recompute_cost_by_name():
    row = ("h.0", "Block", 8, 100, 10, 2.5, 0)
    stats = _core.LayerStats(row, {"recompute_cost": 25.0})
    assert stats == row and stats.recompute_cost == 25.0
    assert _core.LayerStats.recompute_cost.__doc__
    assert pickle.loads(pickle.dumps(stats)).recompute_cost == 25.0
    kw = _forced_one_layer(2.5)
    # The predicted slowdown charges the recompute cost: ten times the
    # FLOPs over a forward of that cost (25 / (3 x 25)), not 2.5 / 7.5.
    plan = _core.build_plan([stats], **kw)
    assert plan.recompute_ratio == 1.0  # the counted FLOPs
    assert plan.predicted_slowdown == pytest.approx(1 + 1 / 3)
    for value, error in ((-1.0, ValueError), (float("inf"), ValueError), ("x", TypeError)):
        with pytest.raises(error, match=r"layers\[0\]\.recompute_cost must be"):
            _core.build_plan([_core.LayerStats(row, {"recompute_cost": value})], **kw)


def test_layer_stats_tail_by_name():
    """A unit's tail (what a recompute ending in it does not run) is taken
    off its recompute: in the counted FLOPs of recompute_ratio, and at the
    matmul rate (tail_cost, else tail_flops) in the predicted slowdown."""
    row = ("h.0", "Block", 8, 100, 10, 4.0, 0)
    stats = _core.LayerStats(row, {"tail_flops": 1.0, "tail_cost": 2.0})
    assert stats == row and stats.tail_flops == 1.0 and stats.tail_cost == 2.0
    assert _core.LayerStats.tail_flops.__doc__ and _core.LayerStats.tail_cost.__doc__
    again = pickle.loads(pickle.dumps(stats))
    assert (again.tail_flops, again.tail_cost) == (1.0, 2.0)
    kw = _forced_one_layer(4.0)
    plan = _core.build_plan([stats], **kw)
    assert plan.recompute_ratio == 0.75  # (4 - 1) / 4
    assert plan.predicted_slowdown == pytest.approx(1 + 2 / 12)  # (4 - 2) / (3 x 4)
    plan = _core.build_plan([_core.LayerStats(row, {"tail_flops": 1.0})], **kw)
    assert plan.predicted_slowdown == pytest.approx(1 + 3 / 12)  # tail_cost: tail_flops
    plan = _core.build_plan([row], **kw)
    assert plan.recompute_ratio == 1.0  # no tail: the whole unit
    for named, error, match in (
        ({"tail_flops": -1.0}, ValueError, r"tail_flops must be a finite number >= 0"),
        ({"tail_flops": float("nan")}, ValueError, r"tail_flops must be a finite"),
        ({"tail_flops": "x"}, TypeError, r"tail_flops must be a number"),
        ({"tail_flops": 5.0}, ValueError, r"tail_flops must be at most the unit's flops"),
        ({"tail_cost": 5.0}, ValueError, r"tail_cost must be at most the unit's recompute_cost"),
        ({"tail_cost": 5.0, "recompute_cost": 6.0}, None, None),
    ):
        layer = _core.LayerStats(row, named)
        if error is None:
            assert _core.build_plan([layer], **kw).predicted_slowdown == pytest.approx(1 + 1 / 18)
            continue
        with pytest.raises(error, match=r"layers\[0\]\." + match):
            _core.build_plan([layer], **kw)


def test_layer_stats_selective_levels_by_name():
    row = ("h.0", "Block", 8, 100, 10, 2.5, 0)
    levels = ((8.0, 30, 0.5), (2.0, 60, 0.25))
    stats = _core.LayerStats(row, {"selective_levels": levels})
    assert stats == row and len(stats) == 7
    assert stats.selective_levels == levels
    assert _core.LayerStats.selective_levels.__doc__
    again = pickle.loads(pickle.dumps(stats))
    assert again.selective_levels == levels
    kw = {
        **PLAN_ARGS,
        "allowed": _core.TECH_CHECKPOINT | _core.TECH_SELECTIVE,
        "budget_bytes": 10**9,
        "fixed_bytes": 0,
        "activation_bytes": 100,
        "total_flops": 2.5,
        "capacity_bytes": 10**9,
    }
    # With the profile, without it (a plain tuple, a LayerStats of seven
    # fields): both plan.
    for layers in ([stats], [row], [_core.LayerStats(row)]):
        assert len(_core.build_plan(layers, **kw)) == 1

    # A bad profile: errors naming the layer, the field and the level.
    def bad(value, error, match):
        stats = _core.LayerStats(row, {"selective_levels": value})
        with pytest.raises(error, match=match):
            _core.build_plan([stats], **kw)

    bad((), ValueError, r"layers\[0\].selective_levels must be None or a tuple of 1 to 8")
    bad(((1.0, 1, 1.0),) * 9, ValueError, r"tuple of 1 to 8")
    bad([(1.0, 1, 1.0)], ValueError, r"selective_levels must be None or a tuple")
    bad(((1.0, 1),), TypeError, r"layers\[0\].selective_levels\[0\] must be a tuple")
    bad(((1.0, -1, 0.0),), ValueError, r"selective_levels\[0\]: saved_bytes must be >= 0")
    bad(((1.0, "x", 0.0),), TypeError, r"layers\[0\].selective_levels must be an int")
    bad(((1.0, 1, float("nan")),), ValueError, r"selective_levels must be a finite")
    bad(((0.0, 1, 1.0),), ValueError, r"selective_levels\[0\]: the threshold must be")
    bad((("x", 1, 1.0),), TypeError, r"selective_levels\[0\]: the threshold must be a number")
    bad(((float("inf"), 1, 1.0),), ValueError, r"the threshold must be")
    # The levels keep more in turn: thresholds must decrease.
    bad(((2.0, 1, 1.0), (2.0, 2, 0.5)), ValueError, r"selective_levels\[1\]: the threshold")
    bad(((2.0, 1, 1.0), (4.0, 2, 0.5)), ValueError, r"below the previous level's")
    # The flag is the parser's, never the caller's.
    with pytest.raises(ValueError, match="unknown bits"):
        _core.build_plan([("h.0", "Block", 8, 100, 10, 2.5, 16)], **kw)


def test_layer_stats_pickles_by_name():
    # The plan inputs travel between ranks pickled (distributed.shared_plan).
    import pickle

    stats = _core.LayerStats(("h.0", "Block", 8, 100, 10, 2.5, 0))
    again = pickle.loads(pickle.dumps(stats))
    assert type(again) is _core.LayerStats and again == stats
    calibrated = _core.LayerStats(tuple(stats), {"backward_bytes": 7})
    assert pickle.loads(pickle.dumps(calibrated)).backward_bytes == 7


def test_build_plan_reads_layer_stats_and_plain_tuples_alike():
    stats = [_core.LayerStats(row) for row in PLAN_LAYERS]
    assert _core.build_plan(stats, **PLAN_ARGS).to_json() == (
        _core.build_plan(PLAN_LAYERS, **PLAN_ARGS).to_json()
    )
    plan = _core.build_plan(tuple(stats), **PLAN_ARGS)
    assert [layer.name for layer in plan.layers] == ["a", "b"]
    assert [layer.saved_bytes for layer in plan.layers] == [100, 100]


def _bad_second_layer(position: int, value: object) -> list:
    row = list(PLAN_LAYERS[1])
    row[position] = value
    return [PLAN_LAYERS[0], tuple(row)]


@pytest.mark.parametrize(
    "layers, error, message",
    [
        (
            [PLAN_LAYERS[0], ["b", "L", 0, 1, 0, 1.0, 0]],
            TypeError,
            r"layers\[1\] must be a LayerStats or a tuple",
        ),
        (
            [PLAN_LAYERS[0], ("b", "L", 0, 1, 0, 1.0)],
            TypeError,
            r"layers\[1\] has 6 fields; a layer has 7",
        ),
        ([PLAN_LAYERS[0], PLAN_LAYERS[1] + (0, 0)], TypeError, r"layers\[1\] has 9 fields"),
        (_bad_second_layer(0, 5), TypeError, r"layers\[1\]\.name must be a str, got int"),
        (_bad_second_layer(1, None), TypeError, r"layers\[1\]\.kind must be a str, got NoneType"),
        (_bad_second_layer(2, "0"), TypeError, r"layers\[1\]\.param_bytes must be an int, got str"),
        (
            _bad_second_layer(3, 1.5),
            TypeError,
            r"layers\[1\]\.saved_bytes must be an int, got float",
        ),
        (
            _bad_second_layer(4, -1),
            ValueError,
            r"layers\[1\]\.input_bytes must be >= 0 and <= 2\*\*50 bytes, got -1",
        ),
        (
            _bad_second_layer(3, 1 << 70),
            ValueError,
            r"layers\[1\]\.saved_bytes must be >= 0 .* got 1180591620717411303424",
        ),
        (_bad_second_layer(5, "1.0"), TypeError, r"layers\[1\]\.flops must be a number, got str"),
        (
            _bad_second_layer(5, float("nan")),
            ValueError,
            r"layers\[1\]\.flops must be a finite number >= 0",
        ),
        (_bad_second_layer(6, 1 << 9), ValueError, r"layers\[1\]\.flags has unknown bits: 512"),
        (_bad_second_layer(6, "0"), TypeError, r"layers\[1\]\.flags must be an int, got str"),
    ],
)
def test_build_plan_names_the_layer_and_the_field_it_refuses(layers, error, message):
    with pytest.raises(error, match=message):
        _core.build_plan(layers, **PLAN_ARGS)


def test_each_module_object_has_its_own_layer_stats_type():
    spec = importlib.util.find_spec("memscale._core")
    assert spec is not None and spec.loader is not None
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    assert other.LayerStats is not _core.LayerStats
    # Either module's planner reads the other's LayerStats: a tuple is enough.
    theirs = [other.LayerStats(row) for row in PLAN_LAYERS]
    assert (
        _core.build_plan(theirs, **PLAN_ARGS).hash
        == other.build_plan(PLAN_LAYERS, **PLAN_ARGS).hash
    )
    del other, theirs
    gc.collect()


def test_the_profile_holds_layer_stats_of_the_units():
    from memscale import _planning

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), Block())
    units = _core.find_units(model)
    profile = _planning.profile_upfront(
        model, units, torch.randn(4, 8), memscale.Config(enable_logging=False)
    )
    assert all(type(layer) is _core.LayerStats for layer in profile.layers)
    assert [layer.name for layer in profile.layers] == ["0", "1", "2"]
    assert {layer.kind for layer in profile.layers} == {"Block"}
    assert all(layer.saved_bytes > 0 and layer.flops > 0 for layer in profile.layers)
    assert profile.activation_bytes >= sum(layer.saved_bytes for layer in profile.layers)


# ---------------------------------------------------------- the stub


def _stub_names() -> dict[str, set[str] | None]:
    """Names memscale/_core.pyi declares: module level (None) and, for a
    class, the names in its body."""
    import ast

    tree = ast.parse((ROOT / "memscale" / "_core.pyi").read_text())
    out: dict[str, set[str] | None] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members: set[str] = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
            out[node.name] = members
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = None
    return out


def test_the_stub_declares_everything_the_module_has():
    # stubtest (scripts/lint.sh) checks the public names and signatures;
    # this also holds the private ones (the hooks torch calls) to the stub.
    stub = _stub_names()
    for name in dir(_core):
        if name.startswith("__"):
            continue
        assert name in stub, f"memscale/_core.pyi lacks _core.{name}"
        obj = getattr(_core, name)
        if not isinstance(obj, type):
            continue
        members = stub[name]
        assert members is not None
        # n_fields and its siblings come from _typeshed.structseq.
        inherited = {"n_fields", "n_sequence_fields", "n_unnamed_fields"}
        for attr in vars(obj):
            if attr.startswith("__") and attr not in ("__new__", "__len__", "__match_args__"):
                continue
            if attr in inherited and obj is _core.LayerStats:
                continue
            assert attr in members, f"memscale/_core.pyi lacks {name}.{attr}"
