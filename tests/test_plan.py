"""The Plan: canonical JSON and hash, determinism, immutability, the rules
as a Config drives them, and build_plan's argument checks.

Plans are made two ways: directly through ``memscale._core.build_plan``
(engine inputs given by hand) and through ``memscale.wrap`` on a small MLP
stack (engine inputs measured by the profiler).
"""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from torch import nn

import memscale
from memscale import Config, _core

GIB = 1 << 30

PLAN_KEYS = [
    "format",
    "mode",
    "allowed",
    "device",
    "device_count",
    "capacity_bytes",
    "budget_bytes",
    "fixed_bytes",
    "activation_bytes",
    "peak_offset_bytes",
    "plan_offset_bytes",
    "peak_unoptimized_bytes",
    "peak_projected_bytes",
    "pressure",
    "total_flops",
    "recompute_ratio",
    "predicted_slowdown",
    "skipped",
    "fits",
    "min_budget_bytes",
    "layers",
]
LAYER_KEYS = [
    "index",
    "name",
    "kind",
    "techniques",
    "rule",
    "tier",
    "tiles",
    "segment",
    "selective_level",
    "selective_threshold",
    "bytes_saved",
    "param_bytes",
    "saved_bytes",
    "input_bytes",
    "flops",
]
TECHNIQUES = ["checkpoint", "offload", "tiling", "selective"]
MODES = ("conservative", "balanced", "aggressive")

# (name, kind, param_bytes, saved_bytes, input_bytes, flops, flags)
LAYERS = [
    ("blocks.0", "Block", 1000, 400, 40, 100.0, 0),
    ("blocks.1", "Block", 1000, 400, 40, 50.0, 0),
    ("blocks.2", "Block", 1000, 400, 400, 50.0, 0),  # no savings
    ("blocks.3", "Block", 1000, 400, 40, 25.0, 1),  # in place
    ("blocks.4", "Block", 1000, 400, 40, 25.0, 2),  # not called
    ("blocks.5", "Block", 1000, 400, 40, 0.0, 0),
]


def plan_kwargs(**changes):
    kw = dict(
        mode="balanced",
        allowed=_core.TECH_CHECKPOINT,
        force=False,
        budget_bytes=1 << 20,
        fixed_bytes=3000,
        activation_bytes=2500,
        total_flops=300.0,
        device="cpu",
        device_count=1,
        capacity_bytes=1 << 21,
    )
    kw.update(changes)
    return kw


def build(layers=LAYERS, **changes):
    return _core.build_plan(layers, **plan_kwargs(**changes))


def ordered(text: str):
    """JSON with every object as a list of (key, value) pairs, in order."""
    return json.loads(text, object_pairs_hook=list)


def mlp_stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)]
    )


SAMPLE = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))


def wrapped_plan(config: Config, model: nn.Module | None = None):
    """The plan wrap() makes for the MLP stack, and the stats of its hooks."""
    model = mlp_stack() if model is None else model
    memscale.wrap(model, config, sample_input=SAMPLE)
    try:
        executor = model._memscale_executor
        return executor.plan, executor.stats
    finally:
        memscale.detach(model)


def quiet(**kw) -> Config:
    return Config(enable_logging=False, **kw)


# ------------------------------------------------------- the memory model


def ref_peak(fixed, activation, layers, chosen):
    """The memory model of csrc/engine.c, for the checkpoint set `chosen`."""
    in_layers = sum(l[3] for l in layers)
    rest = max(0, activation - in_layers)
    h = [l[4] if i in chosen else l[3] for i, l in enumerate(layers)]
    worst = sum(h)
    for i in chosen:
        worst = max(worst, sum(h[:i]) + layers[i][3])
    return fixed + rest + worst


def ref_greedy(fixed, activation, budget, layers, offset=0):
    """Layer indices the engine should pick under pressure, in order
    (``offset``: the predictor's correction, added to every peak)."""
    eligible = [i for i, l in enumerate(layers) if not l[6] & 3 and l[3] > l[4]]
    eligible.sort(key=lambda i: (-(layers[i][3] - layers[i][4]) / max(layers[i][5], 1.0), i))
    chosen: list[int] = []
    peak = ref_peak(fixed, activation, layers, set()) + offset
    for i in eligible:
        if peak <= budget:
            break
        chosen.append(i)
        peak = ref_peak(fixed, activation, layers, set(chosen)) + offset
    return chosen, peak


def engine_layers(plan):
    return [
        (l.name, l.kind, l.param_bytes, l.saved_bytes, l.input_bytes, l.flops, 0)
        for l in plan.layers
    ]


# ------------------------------------------------------------ JSON & hash


def test_json_is_valid_with_fixed_key_order():
    plan = build(budget_bytes=5000)
    doc = ordered(plan.to_json())
    assert [k for k, _ in doc] == PLAN_KEYS
    top = dict(doc)
    assert top["format"] == "memscale-plan/1"
    assert len(top["layers"]) == len(LAYERS)
    for i, entry in enumerate(top["layers"]):
        assert [k for k, _ in entry] == LAYER_KEYS
        assert dict(entry)["index"] == i


def test_json_matches_the_attributes():
    plan = build(budget_bytes=5000)
    doc = json.loads(plan.to_json())
    for key in PLAN_KEYS:
        if key in ("format", "layers", "allowed"):
            continue
        assert doc[key] == getattr(plan, key), key
    assert doc["allowed"] == ["checkpoint"]
    for entry, layer in zip(doc["layers"], plan.layers):
        for key in LAYER_KEYS:
            want = getattr(layer, key)
            assert entry[key] == (list(want) if key == "techniques" else want), key


def test_json_is_canonical():
    """Compact separators, repr() floats: json.dumps gives the same bytes."""
    for changes in (
        {},
        {"budget_bytes": 5000},
        {"force": True},
        {"total_flops": 1.0 / 3.0, "budget_bytes": 4321},
    ):
        text = build(**changes).to_json()
        again = json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
        assert again == text


def test_json_escapes_names():
    weird = 'a"b\\c\nd\te\x01f é 字'
    plan = build([(weird, 'K"ind', 0, 10, 1, 1.0, 0)], activation_bytes=10)
    doc = json.loads(plan.to_json())
    assert doc["layers"][0]["name"] == weird
    assert doc["layers"][0]["kind"] == 'K"ind'
    assert plan.layers[0].name == weird
    assert "\n" not in plan.to_json()


def test_hash_is_sha256_of_json():
    for changes in ({}, {"budget_bytes": 5000}, {"mode": "aggressive"}):
        plan = build(**changes)
        digest = hashlib.sha256(plan.to_json().encode("utf-8")).hexdigest()
        assert plan.hash == digest
        assert len(plan.hash) == 64


def test_two_builds_identical():
    a, b = build(budget_bytes=5000), build(budget_bytes=5000)
    assert a is not b
    assert a.to_json() == b.to_json()
    assert a.to_json().encode() == b.to_json().encode()
    assert a.hash == b.hash
    assert a.to_json() is a.to_json()  # cached, not rebuilt


@pytest.mark.parametrize(
    "change",
    [
        {"mode": "aggressive"},
        {"budget_bytes": 5000},
        {"force": True},
        {"fixed_bytes": 3001},
        {"device": "cuda"},
        {"capacity_bytes": 1 << 22},
        {"allowed": 0},
    ],
)
def test_any_input_change_changes_the_hash(change):
    assert build(**change).hash != build().hash


def test_wrap_twice_on_identical_models_gives_identical_plans():
    cfg = quiet(force_optimize=True)
    a, _ = wrapped_plan(cfg, mlp_stack())
    b, _ = wrapped_plan(cfg, mlp_stack())
    assert a is not b
    assert a.to_json() == b.to_json()
    assert a.hash == b.hash
    assert a.hash == hashlib.sha256(a.to_json().encode()).hexdigest()
    assert [k for k, _ in ordered(a.to_json())] == PLAN_KEYS
    # Default Config too (smart-skip), and the same model wrapped again.
    model = mlp_stack()
    c, _ = wrapped_plan(quiet(), model)
    d, _ = wrapped_plan(quiet(), model)
    assert c.to_json() == d.to_json()


# ------------------------------------------------- rules through a Config


def test_default_config_smart_skips_a_tiny_model():
    plan, stats = wrapped_plan(Config())
    assert plan.skipped is True
    assert plan.fits is True
    assert len(plan) == 4
    assert [l.name for l in plan.layers] == ["0", "1", "2", "3"]
    assert all(l.rule == "smart-skip" for l in plan.layers)
    assert all(l.techniques == () for l in plan.layers)
    assert plan.peak_projected_bytes == plan.peak_unoptimized_bytes
    assert plan.technique_counts == {"checkpoint": 0, "offload": 0, "tiling": 0, "selective": 0}
    assert plan.recompute_ratio == 0.0
    assert stats["hooks"] == 2  # the two root hooks, no layer hooks
    assert plan.pressure < 1.0


def test_force_optimize_checkpoints_every_layer():
    plan, stats = wrapped_plan(quiet(force_optimize=True))
    assert plan.skipped is False
    assert all(l.rule == "force-all" for l in plan.layers)
    assert all(l.techniques == ("checkpoint",) for l in plan.layers)
    assert all(l.bytes_saved == l.saved_bytes - l.input_bytes > 0 for l in plan.layers)
    assert plan.technique_counts == {"checkpoint": 4, "offload": 0, "tiling": 0, "selective": 0}
    assert plan.recompute_ratio == 1.0  # the units are the whole forward
    assert plan.peak_projected_bytes < plan.peak_unoptimized_bytes
    assert stats["hooks"] == 2 + 2 * 4


@pytest.mark.parametrize("mode", MODES)
def test_mode_changes_the_plan_not_the_decision(mode):
    base, _ = wrapped_plan(quiet(force_optimize=True, mode="conservative"))
    plan, _ = wrapped_plan(quiet(force_optimize=True, mode=mode))
    assert plan.mode == mode
    assert json.loads(plan.to_json())["mode"] == mode
    # The layers' inputs are under min_offload_bytes (1 MiB by default), so
    # offload has nothing to move and every mode checkpoints the same;
    # AGGRESSIVE tiles on top, where tiles lower the peak: here (its plan
    # calibrated per layer on the simulated step) every block's recompute
    # makes the peak in turn.
    assert [(tuple(t for t in l.techniques if t != "tiling"), l.rule) for l in plan.layers] == [
        (l.techniques, l.rule) for l in base.layers
    ]
    tiles = [l.tiles for l in plan.layers]
    assert all(t > 1 for t in tiles) if mode == "aggressive" else tiles == [1] * 4, tiles
    if mode == "aggressive":
        assert plan.peak_projected_bytes < base.peak_projected_bytes
    assert (plan.hash == base.hash) == (mode == "conservative")


def test_checkpointing_disabled():
    plan, stats = wrapped_plan(quiet(force_optimize=True, enable_checkpointing=False))
    assert json.loads(plan.to_json())["allowed"] == []
    assert all(l.rule == "disabled" for l in plan.layers)
    assert plan.technique_counts["checkpoint"] == 0
    assert stats["hooks"] == 2


def test_memory_budget_sets_the_budget():
    plan, _ = wrapped_plan(quiet(memory_budget_gb=2.0))
    assert plan.budget_bytes == 2 * GIB
    assert plan.skipped is True
    assert plan.pressure == plan.peak_unoptimized_bytes / (2 * GIB)
    default, _ = wrapped_plan(quiet())
    assert default.budget_bytes == int(default.capacity_bytes * 0.85)
    assert default.hash != plan.hash


def test_tiny_budget_raises_with_the_least_budget_and_what_lowers_it():
    model = mlp_stack()
    with pytest.raises(memscale.MemoryBudgetError) as info:
        memscale.wrap(model, quiet(memory_budget_gb=1e-9), sample_input=SAMPLE)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.budget_bytes == 1
    # The least budget is feasible, and 3% less is not (the planner counts
    # memory in buckets of budget / 512 bytes: it is exact to about that).
    least = err.min_budget_bytes
    assert least > 1
    text = str(err)
    assert "no plan fits the memory budget of 1 B (Config.memory_budget_gb)" in text
    assert "smallest budget memscale can reach" in text
    # Only changes that lower the least budget are suggested, each with a
    # figure below it (tiling, off in BALANCED unless asked for, lowers
    # nothing on this MLP and was once suggested anyway); a smaller batch
    # lowers it.
    tips = dict(err.suggestions)
    assert tips and all(b < least for b in tips.values()), tips
    assert all(what in text for what in tips)
    assert tips["half the batch size (activations scale with it)"] < least
    assert "half the batch size" in text
    # Nothing is left behind.
    assert "_memscale_executor" not in model.__dict__
    assert not model._forward_hooks and not model._forward_pre_hooks
    fits = memscale.wrap(
        model, quiet(memory_budget_gb=(least + 1) / GIB), sample_input=SAMPLE
    )._memscale_executor.plan
    assert fits.fits and fits.peak_projected_bytes <= least
    memscale.detach(model)
    with pytest.raises(memscale.MemoryBudgetError):
        memscale.wrap(model, quiet(memory_budget_gb=0.97 * least / GIB), sample_input=SAMPLE)


def test_budget_error_suggests_only_what_lowers_the_least_budget():
    # Batch norm couples a batch's rows, so no layer here can be tiled: the
    # error once suggested enable_tiling=True anyway, with a figure below the
    # simulated least budget that was only the planner's own figure.
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU()) for _ in range(6)]
    )
    with pytest.raises(memscale.MemoryBudgetError) as info:
        memscale.wrap(model, quiet(memory_budget_gb=1e-9), sample_input=torch.randn(64, 64))
    err = info.value
    tips = dict(err.suggestions)
    assert "enable_tiling=True" not in tips and "enable_tiling" not in str(err)
    assert all(b < err.min_budget_bytes for b in tips.values()), tips


def test_budget_between_peaks_checkpoints_some_layers():
    # A batch whose activations matter (at SAMPLE's 8 rows the simulated
    # step's temporaries outweigh them and no plan lowers the peak).
    big = torch.randn(512, 16, generator=torch.Generator().manual_seed(3))
    prediction = memscale.predict_peak(mlp_stack(), big, config=quiet(force_optimize=True))
    all_ckpt = prediction.optimized.peak_bytes
    unopt = prediction.unoptimized.peak_bytes
    assert all_ckpt < unopt
    budget = (all_ckpt + unopt) // 2
    model = mlp_stack()
    # Whole-layer checkpointing, against the greedy rule of the same model
    # (selective layers, BALANCED's, are tests/test_selective.py's).
    memscale.wrap(
        model, quiet(memory_budget_gb=budget / GIB, mode="conservative"), sample_input=big
    )
    plan, stats = model._memscale_executor.plan, model._memscale_executor.stats
    memscale.detach(model)
    assert plan.budget_bytes == budget
    assert plan.skipped is False
    assert plan.fits is True
    assert plan.peak_projected_bytes <= budget < plan.peak_unoptimized_bytes
    chosen = [l.index for l in plan.layers if l.techniques]
    assert 0 < len(chosen) < len(plan)
    for l in plan.layers:
        assert l.rule == ("solver" if l.index in chosen else "fits")
    assert stats["hooks"] == 2 + 2 * len(chosen)
    # The budget planner recomputes no more than the greedy rule of the
    # documented memory model would (equal layers here: as many).
    want, _ = ref_greedy(
        plan.fixed_bytes, plan.activation_bytes, budget, engine_layers(plan), plan.peak_offset_bytes
    )
    assert len(chosen) <= len(want)
    assert plan.recompute_ratio == pytest.approx(len(chosen) / len(plan))
    assert plan.predicted_slowdown == pytest.approx(1 + len(chosen) / len(plan) / 3)


# --------------------------------------------- build_plan rules, by hand


def test_build_plan_rules_per_layer():
    plan = build(budget_bytes=1)  # nothing fits
    rules = [l.rule for l in plan.layers]
    assert rules == [
        "pressure",
        "pressure",
        "ineligible:no-savings",
        "ineligible:inplace-input",
        "ineligible:not-called",
        "pressure",
    ]
    assert plan.fits is False
    forced = build(force=True)
    assert [l.rule for l in forced.layers] == [
        "force-all",
        "force-all",
        "ineligible:no-savings",
        "ineligible:inplace-input",
        "ineligible:not-called",
        "force-all",
    ]
    skipped = build()
    assert skipped.skipped is True
    assert {l.rule for l in skipped.layers} == {"smart-skip"}


def test_build_plan_greedy_matches_the_model():
    fixed, acts = 3000, 2500
    unopt = ref_peak(fixed, acts, LAYERS, set())
    assert build(budget_bytes=unopt).skipped is True
    for budget in range(unopt - 1, fixed, -37):
        plan = build(budget_bytes=budget)
        want, peak = ref_greedy(fixed, acts, budget, LAYERS)
        assert [l.index for l in plan.layers if l.techniques] == sorted(want)
        assert plan.peak_projected_bytes == peak
        assert plan.fits == (peak <= budget)
        assert plan.peak_unoptimized_bytes == unopt
        assert plan.pressure == unopt / budget


def test_technique_counts():
    plan = build(budget_bytes=1)
    counts = plan.technique_counts
    assert list(counts) == TECHNIQUES
    assert counts == {"checkpoint": 3, "offload": 0, "tiling": 0, "selective": 0}
    counts["checkpoint"] = 99
    assert plan.technique_counts["checkpoint"] == 3  # a new dict each time
    assert plan.technique_counts is not plan.technique_counts
    assert build(allowed=0, budget_bytes=1).technique_counts == {
        "checkpoint": 0,
        "offload": 0,
        "tiling": 0,
        "selective": 0,
    }


def test_sequence_protocol_and_repr():
    plan = build()
    assert len(plan) == len(LAYERS)
    assert isinstance(plan.layers, tuple)
    assert [l.index for l in plan.layers] == list(range(len(LAYERS)))
    assert plan.hash[:12] in repr(plan)
    assert "blocks.0" in repr(plan.layers[0])
    empty = build([])
    assert len(empty) == 0 and empty.layers == ()
    assert json.loads(empty.to_json())["layers"] == []


def test_allowed_lists_techniques_in_order():
    plan = build(
        allowed=_core.TECH_SELECTIVE
        | _core.TECH_TILING
        | _core.TECH_CHECKPOINT
        | _core.TECH_OFFLOAD
    )
    assert json.loads(plan.to_json())["allowed"] == TECHNIQUES


# ------------------------------------------------------ immutability


PLAN_ATTRS = [
    "layers",
    "mode",
    "device",
    "hash",
    "device_count",
    "capacity_bytes",
    "budget_bytes",
    "fixed_bytes",
    "activation_bytes",
    "peak_unoptimized_bytes",
    "peak_projected_bytes",
    "pressure",
    "recompute_ratio",
    "skipped",
    "fits",
    "technique_counts",
]
LAYER_ATTRS = [
    "index",
    "name",
    "kind",
    "techniques",
    "rule",
    "bytes_saved",
    "param_bytes",
    "saved_bytes",
    "input_bytes",
    "flops",
]


@pytest.mark.parametrize("attr", PLAN_ATTRS)
def test_plan_is_read_only(attr):
    plan = build(budget_bytes=5000)
    before = plan.to_json()
    with pytest.raises(AttributeError):
        setattr(plan, attr, getattr(plan, attr))
    with pytest.raises(AttributeError):
        delattr(plan, attr)
    assert plan.to_json() == before


@pytest.mark.parametrize("attr", LAYER_ATTRS)
def test_layer_plan_is_read_only(attr):
    layer = build(budget_bytes=5000).layers[0]
    with pytest.raises(AttributeError):
        setattr(layer, attr, getattr(layer, attr))
    with pytest.raises(AttributeError):
        delattr(layer, attr)


def test_no_new_attributes():
    plan = build()
    with pytest.raises(AttributeError):
        plan.extra = 1
    with pytest.raises(AttributeError):
        plan.layers[0].extra = 1
    with pytest.raises(AttributeError):
        plan.to_json = lambda: "{}"
    assert not hasattr(plan, "__dict__")


def test_plan_types_cannot_be_instantiated():
    plan = build()
    for tp in (type(plan), type(plan.layers[0]), _core.Plan, _core.LayerPlan):
        with pytest.raises(TypeError):
            tp()
        with pytest.raises(TypeError):
            tp.__new__(tp)
    with pytest.raises(TypeError):

        class Sub(_core.Plan):  # noqa: F841 - immutable, final types
            pass

    with pytest.raises(TypeError):
        _core.Plan.extra = 1


# ---------------------------------------------------- argument errors


def test_bad_mode_names_the_allowed_modes():
    with pytest.raises(ValueError) as err:
        build(mode="fast")
    msg = str(err.value)
    for mode in MODES:
        assert mode in msg
    assert "fast" in msg
    with pytest.raises(ValueError):
        build(mode="Balanced")
    with pytest.raises(TypeError):
        build(mode=1)
    with pytest.raises(TypeError):
        build(mode=memscale.OptimizationMode.BALANCED.value.encode())


@pytest.mark.parametrize(
    "position,value",
    [
        (2, -1),
        (3, -1),
        (4, -1),
        (5, -1.0),
        (5, math.nan),
        (3, -(1 << 40)),
    ],
)
def test_negative_layer_sizes(position, value):
    layer = list(LAYERS[0])
    layer[position] = value
    with pytest.raises(ValueError, match=">= 0"):
        build([tuple(layer)])


@pytest.mark.parametrize(
    "change",
    [
        {"fixed_bytes": -1},
        {"activation_bytes": -1},
        {"total_flops": -1.0},
        {"total_flops": math.nan},
        {"budget_bytes": 0},
        {"budget_bytes": -5},
    ],
)
def test_bad_problem_figures(change):
    with pytest.raises(ValueError):
        build(**change)


@pytest.mark.parametrize(
    "layer",
    [
        ("a", "L", 0, 1, 0, 1.0),  # 6 items
        ("a", "L", 0, 1, 0, 1.0, 0, 0, 0),  # 9 items (8: with backward_bytes)
        (),
        (1, "L", 0, 1, 0, 1.0, 0),  # name not a str
        ("a", "L", "0", 1, 0, 1.0, 0),  # size not an int
        ("a", "L", 0, 1, 0, "1.0", 0),  # flops not a number
    ],
)
def test_wrong_layer_shape(layer):
    with pytest.raises(TypeError):
        build([layer])


@pytest.mark.parametrize("layers", [5, None, object()])
def test_layers_not_a_sequence(layers):
    with pytest.raises(TypeError, match="sequence"):
        build(layers)


@pytest.mark.parametrize("item", [list(LAYERS[0]), 5, "abc"])
def test_layer_not_a_tuple_is_a_type_error(item):
    with pytest.raises(TypeError):
        build([item])


def test_missing_and_positional_arguments():
    kw = plan_kwargs()
    del kw["mode"]
    with pytest.raises(TypeError):
        _core.build_plan(LAYERS, **kw)
    with pytest.raises(TypeError):
        _core.build_plan(
            LAYERS, "balanced", **{k: v for k, v in plan_kwargs().items() if k != "mode"}
        )
    with pytest.raises(TypeError):
        _core.build_plan(LAYERS, **plan_kwargs(), unknown=1)
    with pytest.raises(TypeError):
        _core.build_plan(layers=LAYERS)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_infinite_or_nan_flops_are_rejected(bad):
    # A FLOP count that is not a finite number would make every cost, and
    # the plan's JSON, meaningless: the engine refuses it, in the model's
    # total and in a layer's.
    with pytest.raises(ValueError, match=r"total_flops must be a finite number >= 0"):
        build(
            [("a", "L", 0, 100, 10, 1.0, 0)], total_flops=bad, activation_bytes=100, budget_bytes=50
        )
    with pytest.raises(ValueError, match=r"flops must be a finite number >= 0"):
        build([("a", "L", 0, 100, 10, bad, 0)], activation_bytes=100, budget_bytes=50)


def test_sizes_beyond_2_pow_50_are_rejected_and_the_largest_do_not_wrap_around():
    # Byte counts are capped at 2**50 (1 PiB) so that sums of them cannot
    # overflow; beyond it the engine refuses, at it the sums are exact.
    with pytest.raises(ValueError, match=r"fixed_bytes must be >= 0 and <= 2\*\*50 bytes"):
        build(
            [("a", "L", 0, 100, 0, 1.0, 0)] * 2,
            fixed_bytes=1 << 62,
            activation_bytes=0,
            budget_bytes=1000,
        )
    with pytest.raises(ValueError, match=r"saved_bytes must be >= 0 and <= 2\*\*50 bytes"):
        build([("a", "L", 0, 1 << 62, 0, 1.0, 0)] * 2, activation_bytes=0, budget_bytes=1000)
    top = 1 << 50
    plan = build(
        [("a", "L", 0, top, 0, 1.0, 0)] * 2, fixed_bytes=top, activation_bytes=0, budget_bytes=1000
    )
    assert plan.peak_unoptimized_bytes == 3 * top
    assert plan.skipped is False
    assert plan.fits is False


@pytest.mark.parametrize("change", [{"capacity_bytes": -1}, {"device_count": -1}])
def test_negative_device_figures(change):
    with pytest.raises(ValueError):
        build(**change)
