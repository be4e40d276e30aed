"""wrap/detach lifecycle: reversibility, errors, and misuse."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from conftest import (
    FORCE,
    assert_same_grads,
    hook_count,
    mlp,
    saved_tensor_hooks,
    tiny_gpt2,
    token_batch,
    twins,
)
from torch import nn

import memscale


@pytest.mark.parametrize("with_sample", [True, False])
def test_detach_restores_exactly(with_sample):
    model, ref = twins(lambda: mlp(p=0.1))
    x = torch.randn(4, 32)
    before = hook_count(model)
    memscale.wrap(model, FORCE, sample_input=x if with_sample else None)
    for _ in range(3):
        model(x).sum().backward()
    assert hook_count(model) > before
    memscale.detach(model)
    assert hook_count(model) == before
    assert not hasattr(model, "_memscale_executor")
    model.zero_grad(set_to_none=True)
    model.load_state_dict(ref.state_dict())
    torch.manual_seed(0)
    out = model(x)
    out.sum().backward()
    torch.manual_seed(0)
    expected = ref(x)
    expected.sum().backward()
    assert torch.equal(out, expected)
    assert_same_grads(model, ref)


def test_detach_restores_hf_use_cache():
    model = tiny_gpt2()
    model.config.use_cache = True
    memscale.wrap(model, FORCE, sample_input={"input_ids": token_batch()})
    assert model.config.use_cache is False
    memscale.detach(model)
    assert model.config.use_cache is True


@pytest.mark.parametrize("with_sample", [True, False])
def test_model_is_freed_after_detach(with_sample):
    model = mlp()
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE, sample_input=x if with_sample else None)
    for _ in range(3):
        model(x).sum().backward()
    executor = model._memscale_executor
    memscale.detach(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    assert executor.model is None
    assert executor.state == "detached"


def test_wrapped_model_is_collectable_without_detach():
    model = mlp()
    memscale.wrap(model, FORCE, sample_input=torch.randn(2, 32))
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_graph_outliving_detach_still_backpropagates():
    model, ref = twins(lambda: mlp(p=0.2))
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE, sample_input=x)
    torch.manual_seed(0)
    loss = model(x).sum()
    memscale.detach(model)  # the graph still holds checkpoint frames
    loss.backward()
    torch.manual_seed(0)
    ref(x).sum().backward()
    assert_same_grads(model, ref)


class Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fail = False

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.fail:
            raise ValueError("boom")
        return h


def test_forward_raising_mid_layer_leaves_nothing_active():
    torch.manual_seed(0)
    model = nn.Sequential(Boom(), Boom(), Boom())
    x = torch.randn(2, 8)
    memscale.wrap(model, FORCE, sample_input=x)
    ex = model._memscale_executor
    model[1].fail = True
    with pytest.raises(ValueError, match="boom"):
        model(x)
    assert ex.stats["active_frames"] == 0
    assert saved_tensor_hooks() is None
    # A plain model trains and matches afterwards.
    other, other_ref = twins(lambda: mlp(depth=2))
    y = torch.randn(3, 32)
    other(y).sum().backward()
    other_ref(y).sum().backward()
    assert_same_grads(other, other_ref)
    # And the wrapped model trains normally afterwards.
    model[1].fail = False
    model(x).sum().backward()
    assert ex.stats["active_frames"] == 0
    memscale.detach(model)


class Interrupt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.interrupt = False

    def forward(self, x):
        if self.interrupt:
            raise KeyboardInterrupt  # skips torch's always_call hooks
        return torch.tanh(self.lin(x))


def test_interrupted_forward_is_cleaned_up():
    torch.manual_seed(0)
    model = nn.Sequential(Interrupt(), Interrupt())
    x = torch.randn(2, 8)
    memscale.wrap(model, FORCE, sample_input=x)
    model[1].interrupt = True
    with pytest.raises(KeyboardInterrupt):
        model(x)
    # The model's call guard left what the interrupted forward entered.
    assert saved_tensor_hooks() is None
    # A layer called on its own has no guard: its frame is left until the
    # model's next forward.
    with pytest.raises(KeyboardInterrupt):
        model[1](x)
    assert saved_tensor_hooks() is not None  # left by the interrupt
    model[1].interrupt = False
    with pytest.warns(RuntimeWarning, match="interrupted"):
        model(x).sum().backward()
    assert saved_tensor_hooks() is None
    model[1].interrupt = True
    with pytest.raises(KeyboardInterrupt):
        model(x)
    memscale.detach(model)  # detach cleans up too
    assert saved_tensor_hooks() is None


def test_profiling_forward_that_raises_is_not_counted():
    torch.manual_seed(0)
    model = nn.Sequential(Boom(), Boom())
    x = torch.randn(2, 8)
    memscale.wrap(model, FORCE.replace(warmup_steps=1))
    model[0].fail = True
    with pytest.raises(ValueError):
        model(x)
    ex = model._memscale_executor
    assert ex.state == "profiling" and ex.stats["steps"] == 0
    model[0].fail = False
    model(x).sum().backward()
    assert ex.state == "applied"
    memscale.detach(model)


def test_wrap_failure_leaves_no_hooks():
    model = mlp()
    before = hook_count(model)
    with pytest.raises(RuntimeError, match="could not profile"):
        memscale.wrap(model, FORCE, sample_input=torch.randn(4, 7))  # wrong width
    assert hook_count(model) == before
    assert not hasattr(model, "_memscale_executor")


def test_wrap_twice_raises_and_keeps_the_first():
    model = mlp()
    memscale.wrap(model, FORCE, sample_input=torch.randn(2, 32))
    first = model._memscale_executor
    with pytest.raises(RuntimeError, match="already wrapped"):
        memscale.wrap(model, FORCE)
    assert model._memscale_executor is first and first.state == "applied"
    memscale.detach(model)


@pytest.mark.parametrize("bad", [None, 3, "model", torch.randn(2)])
def test_wrap_non_module_raises_type_error(bad):
    with pytest.raises(TypeError, match="torch.nn.Module"):
        memscale.wrap(bad)


def test_wrap_trainer_without_callbacks_is_a_type_error():
    class FakeTrainer:
        def __init__(self):
            self.model = mlp()

        def train(self):
            return None

    with pytest.raises(TypeError, match="Trainer"):
        memscale.wrap(FakeTrainer())


def test_detach_unwrapped_warns():
    with pytest.warns(RuntimeWarning, match="not wrapped"):
        memscale.detach(mlp())


def test_wrap_returns_the_same_object():
    model = mlp()
    assert memscale.wrap(model, FORCE, sample_input=torch.randn(2, 32)) is model
    memscale.detach(model)


def test_bad_sample_input_type():
    with pytest.raises(TypeError, match="sample_input"):
        memscale.wrap(mlp(), FORCE, sample_input=3.0)


def test_a_sample_input_made_under_inference_mode_is_named_where_the_step_saves_it():
    """A batch made under ``torch.inference_mode()`` that the step saves for
    backward (a linear layer's input) cannot be recorded by autograd: wrap
    and predict_peak say which input it is and how to make one that works,
    and nothing is attached; its clone is wrapped as usual.  One the step
    never saves (uint8 images cast first) is wrapped as any other batch."""
    model = mlp()
    with torch.inference_mode():
        x = torch.randn(2, 32)
        images = torch.randint(0, 256, (2, 32), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"positional input 0 .*inference_mode.*clone"):
        memscale.wrap(model, FORCE, sample_input=(x,))
    assert not hasattr(model, "_memscale_executor")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with pytest.raises(ValueError, match=r"positional input 0 .*inference_mode"):
        memscale.predict_peak(model, (x,), FORCE)
    memscale.wrap(model, FORCE, sample_input=x.clone())
    assert model._memscale_executor.plan.technique_counts["checkpoint"]
    memscale.detach(model)

    class Images(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = mlp()

        def forward(self, pixels):
            return self.body(pixels.float().div(255))

    cast = Images()
    assert memscale.predict_peak(cast, images, FORCE).optimized.peak_bytes > 0
    memscale.wrap(cast, FORCE, sample_input=images)
    cast(images.clone()).sum().backward()
    memscale.detach(cast)


def test_bad_config_type():
    with pytest.raises(TypeError, match="Config"):
        memscale.wrap(mlp(), {"mode": "balanced"})


def test_async_offload_env(monkeypatch):
    monkeypatch.setenv("MEMSCALE_ASYNC_OFFLOAD", "1")
    model = mlp()
    memscale.wrap(model, FORCE, sample_input=torch.randn(2, 32))
    assert model._memscale_executor.config.async_offload is True
    memscale.detach(model)
    # An explicit argument wins over the environment.
    memscale.wrap(model, FORCE, sample_input=torch.randn(2, 32), async_offload=False)
    assert model._memscale_executor.config.async_offload is False
    memscale.detach(model)
    monkeypatch.setenv("MEMSCALE_ASYNC_OFFLOAD", "yes")
    with pytest.raises(ValueError, match="MEMSCALE_ASYNC_OFFLOAD"):
        memscale.wrap(model, FORCE)
    assert not hasattr(model, "_memscale_executor")


def test_config_is_never_mutated():
    config = memscale.Config(mode="conservative", force_optimize=True)
    before = config.to_dict()
    model = mlp()
    memscale.wrap(model, config, sample_input=torch.randn(2, 32), async_offload=True)
    assert config.to_dict() == before
    memscale.detach(model)


def test_8bit_optimizer_without_an_optimizer_says_how_to_get_one(caplog):
    model = mlp()
    with caplog.at_level(logging.WARNING, logger="memscale"):
        memscale.wrap(
            model, FORCE.replace(use_8bit_optimizer=True), sample_input=torch.randn(2, 32)
        )
    text = caplog.text
    assert "use_8bit_optimizer" in text
    assert "memscale.optim.make_8bit_adamw" in text  # how to get one
    assert "apply_all_optimizations" in text
    assert model._memscale_executor.optimizer is None
    memscale.detach(model)


def test_aggressive_mode_tiles_and_detach_restores_forward(caplog):
    model = mlp()
    forwards = [m.forward for m in model]
    with caplog.at_level(logging.INFO, logger="memscale"):
        memscale.wrap(
            model,
            memscale.Config(mode="aggressive", force_optimize=True),
            # 64 rows: enough for tiles to lower a block's recompute (on 2
            # rows the calibrated plan rightly tiles nothing).
            sample_input=torch.randn(64, 32),
        )
    plan = model._memscale_executor.plan
    assert "not available" not in caplog.text
    assert plan.technique_counts["checkpoint"] == 4
    assert plan.technique_counts["tiling"] == 4
    assert all("forward" in m.__dict__ for m in model)
    memscale.detach(model)
    assert all("forward" not in m.__dict__ for m in model)
    assert [m.forward for m in model] == forwards


def test_plan_is_logged_as_a_table(caplog):
    model = mlp()
    with caplog.at_level(logging.DEBUG, logger="memscale"):
        memscale.wrap(model, FORCE, sample_input=torch.randn(2, 32))
    assert "memscale hardware: cpu" in caplog.text
    assert "force-all" in caplog.text and "bytes saved" in caplog.text
    # Each layer names the segment it is recomputed with (itself, alone).
    rows = [line.split() for line in caplog.text.splitlines() if line.startswith("  ")]
    assert rows[0][:5] == ["layer", "kind", "technique", "segment", "tier"]
    assert all(row[3] == row[0] for row in rows[1:]), rows
    memscale.detach(model)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="memscale"):
        memscale.wrap(model, FORCE.replace(enable_logging=False), sample_input=torch.randn(2, 32))
    assert "force-all" not in caplog.text
    memscale.detach(model)


def test_optimize_context_manager_detaches_on_error():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(KeyError):
        with memscale.optimize(model, opt, FORCE, torch.randn(2, 32)) as ex:
            assert ex.state == "applied"
            model(torch.randn(2, 32)).sum().backward()
            raise KeyError("x")
    assert not hasattr(model, "_memscale_executor")
    assert hook_count(model) == 0


def test_plan_does_not_change_once_the_optimizer_has_stepped():
    model = mlp()
    x = torch.randn(4, 32)
    opt = torch.optim.AdamW(model.parameters())
    with memscale.optimize(model, opt, FORCE, x) as ex:
        before = ex.plan.hash
    model(x).sum().backward()
    opt.step()
    with memscale.optimize(model, opt, FORCE, x) as ex:
        assert ex.plan.hash == before


def test_optimizer_sharpens_the_estimate():
    model = mlp()
    x = torch.randn(2, 32)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with memscale.optimize(model, sgd, FORCE, x) as ex:
        fixed_sgd = ex.plan.fixed_bytes
    with memscale.optimize(model, None, FORCE, x) as ex:
        fixed_adam = ex.plan.fixed_bytes
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert fixed_adam - fixed_sgd == 2 * params


def test_smart_skip_leaves_small_models_alone():
    model = mlp()
    memscale.wrap(model, memscale.Config(), sample_input=torch.randn(2, 32))
    plan = model._memscale_executor.plan
    assert plan.skipped and plan.technique_counts["checkpoint"] == 0
    assert {l.rule for l in plan.layers} == {"smart-skip"}
    memscale.detach(model)


def test_smart_skip_says_why_and_what_changes_it(caplog):
    model = mlp()
    with caplog.at_level(logging.INFO, logger="memscale"):
        memscale.wrap(model, memscale.Config(), sample_input=torch.randn(2, 32))
    memscale.detach(model)
    (line,) = [r.getMessage() for r in caplog.records if "smart-skip" in r.getMessage()]
    # Why: the peak, the budget and where the budget comes from (85% of
    # this host's RAM); what changes it: the one setting.
    assert "left alone" in line and "fits comfortably in the budget of" in line
    assert "85% of" in line and "host RAM, Config.target_gpu_utilization" in line
    assert "Config(force_optimize=True)" in line


def test_profile_reports_every_layer_measurement():
    model = mlp()
    memscale.wrap(model, FORCE, sample_input=torch.randn(8, 32))
    profile = model._memscale_executor.profile
    assert profile.method == "static" and len(profile.details) == 4
    for d in profile.details:
        assert d["kind"] == "Block" and d["calls"] == 1
        assert d["output_bytes"] == 8 * 32 * 4
        assert d["saved_bytes"] > d["input_bytes"] > 0 and d["flops"] > 0
    memscale.detach(model)


def test_stats_count_training_forwards_and_recompute_time():
    model = mlp()
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE, sample_input=x)
    ex = model._memscale_executor
    assert ex.stats["training_forwards"] == 0  # profiling is not counted
    for _ in range(2):
        model(x).sum().backward()
    with torch.no_grad():
        model(x)
    stats = ex.stats
    assert stats["training_forwards"] == 2
    assert stats["recomputes"] == 8 and stats["recompute_seconds"] > 0
    memscale.detach(model)
