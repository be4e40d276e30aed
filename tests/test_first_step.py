"""Optimized from the first step without ``sample_input`` (issue 21).

``wrap`` without ``sample_input`` plans inside the first training forward,
from that forward's own inputs (profiled on fake tensors), and that same
forward already runs under the plan.  The first step's exact peak of live
tensor bytes (``memscale._measure.measure_peak``: the allocator's events
under torch's memory profiler) is the one a ``sample_input`` run has, below
the unwrapped step's, with the same gradients bit for bit; the same holds
for the Hugging Face Trainer and Lightning callbacks.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import TokenDataset, hf_training_args, hook_count, lightning_trainer, tiny_gpt2

import memscale
from memscale._measure import measure_peak

BATCH, SEQ = 4, 64


def gpt2(dropout: float = 0.1):
    model = tiny_gpt2(dropout, n_layer=4, n_positions=SEQ)
    model.train()
    return model


def ids(n: int = BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (n, SEQ), generator=g)


# A budget under the unoptimized step (about 14 MiB) that a plan reaches.
# CONSERVATIVE: whole layers checkpointed, whose recomputes the executor
# counts (BALANCED would run them selective: tests/test_selective.py).
BUDGET = memscale.Config(memory_budget_gb=10 / 1024, mode="conservative", enable_logging=False)


def first_step(model, x):
    """The first training step's exact peak, the loss and the gradients."""
    out = {}

    def step():
        torch.manual_seed(5)  # dropout
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        out["loss"] = loss.detach()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the profiler's notes on earlier blocks
        report = measure_peak(step, model=model, inputs=(x,))
    grads = [p.grad.clone() for p in model.parameters()]
    return report.peak_bytes, out["loss"], grads


def test_first_step_is_planned_and_below_the_unwrapped_step():
    x = ids()
    plain_peak, plain_loss, plain_grads = first_step(gpt2(), x)

    with_sample = gpt2()
    memscale.wrap(with_sample, BUDGET, sample_input={"input_ids": x, "labels": x})
    sample_peak, _, _ = first_step(with_sample, x)
    sample_hash = with_sample._memscale_executor.plan.hash
    memscale.detach(with_sample)

    model = gpt2()
    memscale.wrap(model, BUDGET)
    ex = model._memscale_executor
    assert ex.plan is None
    peak, loss, grads = first_step(model, x)
    # Planned inside the first forward, which ran under the plan.
    assert ex.state == "applied" and ex.profiling == "static"
    assert ex.plan.technique_counts["checkpoint"] > 0
    assert ex.stats["recomputes"] > 0 and ex.stats["training_forwards"] == 1
    assert ex.plan.hash == sample_hash
    assert peak == sample_peak < plain_peak
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    memscale.detach(model)


def test_evaluation_forwards_do_not_plan_and_detach_removes_the_hooks():
    model = gpt2()
    before = hook_count(model)
    memscale.wrap(model, BUDGET)
    ex = model._memscale_executor
    x = ids(2)
    with torch.no_grad():
        model(input_ids=x)
    model.eval()
    model(input_ids=x)
    model.train()
    assert ex.plan is None and ex.plans_on_first_forward
    memscale.detach(model)  # never planned: the first-forward hooks go too
    assert hook_count(model) == before


def test_a_first_forward_that_cannot_be_planned_leaves_nothing():
    model = gpt2()
    before = hook_count(model)
    memscale.wrap(model, BUDGET.replace(memory_budget_gb=1 / 1024))  # nothing fits
    x = ids()
    with pytest.raises(memscale.MemoryBudgetError, match="memory_budget_gb"):
        model(input_ids=x, labels=x)
    assert "_memscale_executor" not in model.__dict__
    assert hook_count(model) == before
    model(input_ids=x, labels=x).loss.backward()  # the model runs as before


def test_a_submodule_holding_every_layer_plans_the_first_step():
    # Lightning-style: the outer module's forward never runs; the GPT-2
    # inside it, which holds every planned layer, is called directly.
    outer = torch.nn.ModuleDict({"model": gpt2()})
    memscale.wrap(outer, BUDGET)
    ex = outer._memscale_executor
    x = ids()
    outer["model"](input_ids=x, labels=x).loss.backward()
    assert ex.state == "applied" and ex.stats["recomputes"] > 0
    memscale.detach(outer)


# ------------------------------------------------------------ integrations


def hf_first_step(tmp_path, callbacks):
    from transformers import Trainer

    model = gpt2()
    args = hf_training_args(
        tmp_path,
        per_device_train_batch_size=BATCH,
        max_steps=1,
        logging_strategy="no",
        seed=0,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=TokenDataset(ids(8)), callbacks=callbacks
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = measure_peak(trainer.train, model=model)
    return report.peak_delta_bytes, [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_hf_callback_without_sample_input_lowers_the_first_step(tmp_path):
    from memscale.integrations.hf import MemScaleCallback

    plain_peak, plain_params = hf_first_step(tmp_path, [])
    callback = MemScaleCallback(BUDGET)
    peak, params = hf_first_step(tmp_path, [callback])
    assert peak < plain_peak
    # One AdamW step from the same start: the same weights, bit for bit.
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))


def lightning_first_step(callbacks):
    import lightning.pytorch as pl

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt2()

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = Lit()
    pl.seed_everything(0, verbose=False)
    trainer = lightning_trainer(pl, max_steps=1, callbacks=callbacks)
    loader = torch.utils.data.DataLoader(ids(8), batch_size=BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = measure_peak(lambda: trainer.fit(module, loader), model=module)
    return report.peak_delta_bytes, [p.detach().clone() for p in module.parameters()]


@pytest.mark.slow
def test_lightning_callback_without_sample_input_lowers_the_first_step():
    from memscale.integrations.lightning import MemScaleCallback

    plain_peak, plain_params = lightning_first_step([])
    callback = MemScaleCallback(BUDGET)
    peak, params = lightning_first_step([callback])
    assert peak < plain_peak
    assert callback.plan_hash is not None
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))


def test_under_torch_compile_the_first_forward_plans_eagerly():
    from conftest import FORCE, mlp

    model, ref = mlp(depth=2), mlp(depth=2)  # two blocks: half the tracing
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE.replace(enable_logging=False))
    compiled = torch.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(x).sum().backward()
    # Dynamo did not trace into the planning (it warns on each C call of
    # memscale's it cannot trace).
    assert not [w for w in caught if "memscale._core" in str(w.message)]
    torch._dynamo.reset()
    ref(x).sum().backward()
    ex = model._memscale_executor
    # The plan ran as checkpoint regions in the graph, not as the C
    # executor's frames (tests/test_compile.py).
    assert ex.state == "applied" and ex.plan.technique_counts["checkpoint"] == 2
    assert ex.stats["checkpoint_frames"] == 0
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))
    memscale.detach(model)


@pytest.mark.parametrize("trained", [False, True], ids=["before", "after"])
def test_a_model_dropped_without_detach_is_collected(trained):
    import gc
    import weakref

    from conftest import FORCE, mlp

    model = mlp()
    memscale.wrap(model, FORCE.replace(enable_logging=False))
    if trained:  # the first forward planned
        model(torch.randn(2, 32)).sum().backward()
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def lightning_split_step(callbacks):
    """A LightningModule whose training_step calls two submodules in turn
    (never the module's own forward, and no single submodule holds every
    planned layer), and logs its loss."""
    import lightning.pytorch as pl
    from conftest import mlp

    class Split(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.encoder = mlp(depth=2, width=64)
            self.decoder = mlp(depth=2, width=64)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.decoder(self.encoder(x)), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Split()
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(8, 64, generator=g), torch.randn(8, 64))
    trainer = lightning_trainer(pl, max_steps=1, callbacks=callbacks)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return trainer, [p.detach().clone() for p in module.parameters()]


@pytest.mark.slow
def test_lightning_training_step_calling_submodules_is_planned_from_the_first_batch():
    # Issue 21: no forward of the module saw the whole model, so the first
    # batch ran unoptimized (then warmup_steps more were measured); asked
    # to, the callback plans from the batch at on_train_batch_start by
    # running training_step on fake tensors.
    from memscale.integrations.lightning import MemScaleCallback

    plain_trainer, plain = lightning_split_step([])
    config = memscale.Config(force_optimize=True, enable_logging=False)
    callback = MemScaleCallback(config, plan_from_training_step=True)
    trainer, params = lightning_split_step([callback])
    assert callback.plan_hash is not None  # planned within the one step
    figures = callback.figures()
    assert figures["memscale/checkpointed_layers"] == 4
    assert figures["memscale/recomputes"] > 0  # the first batch ran under it
    assert all(torch.equal(a, b) for a, b in zip(params, plain))
    # What training_step logged is the real step's, not the fake pass's.
    assert torch.equal(
        trainer.callback_metrics["train_loss"], plain_trainer.callback_metrics["train_loss"]
    )


# ------------------------------------- measured steps refine the first plan


def static_profile(x, config=BUDGET):
    """The profile a first forward on ``x`` is planned from (fake tensors)."""
    model = gpt2()
    memscale.wrap(model, config)
    model(input_ids=x, labels=x).loss.backward()
    ex = model._memscale_executor
    profile, plan_hash = ex.profile, ex.plan.hash
    memscale.detach(model)
    return profile, plan_hash


def test_without_static_profiling_the_first_step_runs_under_a_plan():
    # Issue 21: use_static_profiling=False measured the first warmup_steps
    # forwards unoptimized.  Now the first forward runs under the plan made
    # from its inputs on fake tensors, as without the setting, and the
    # measured steps only refine it.
    x = ids()
    plain_peak, plain_loss, plain_grads = first_step(gpt2(), x)
    _, static_hash = static_profile(x)
    model = gpt2()
    memscale.wrap(model, BUDGET.replace(use_static_profiling=False, warmup_steps=2))
    ex = model._memscale_executor
    peak, loss, grads = first_step(model, x)
    assert ex.plan is not None and ex.plan.hash == static_hash
    assert ex.stats["recomputes"] > 0 and ex.stats["training_forwards"] == 1
    assert ex.state == "profiling"  # measuring, under the plan
    assert peak < plain_peak
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    memscale.detach(model)


def measured_unoptimized(batches, config):
    """The profile of ``batches`` measured for real without a plan (the
    executor's ``measure_real_steps``: what use_static_profiling=False did
    before issue 21)."""
    model = gpt2()
    memscale.wrap(model, config.replace(warmup_steps=len(batches)))
    ex = model._memscale_executor
    ex.measure_real_steps()
    for x in batches:
        model(input_ids=x, labels=x).loss.backward()
    assert ex.profiling == "warmup" and ex.state == "applied"
    profile = ex.profile
    memscale.detach(model)
    return profile


def test_measured_steps_count_what_checkpointed_layers_save():
    # Steps measured under the plan see every layer as steps without one
    # do: a checkpointed layer's saved tensors (taken by the checkpoint
    # frame's hook, not the profiler's) and its FLOPs (not those of the
    # recompute check's second run at the first step).
    x = ids()
    model = gpt2()
    memscale.wrap(model, BUDGET.replace(use_static_profiling=False, warmup_steps=2))
    ex = model._memscale_executor
    for _ in range(2):
        model.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
    assert ex.state == "applied" and ex.profiling == "warmup"
    assert ex.recompute_check is not None and ex.recompute_check.passed  # it ran
    assert ex.plan.technique_counts["checkpoint"] > 0
    reference = measured_unoptimized([x, x], BUDGET)
    assert ex.profile.layers == reference.layers
    assert ex.profile.activation_bytes == reference.activation_bytes
    assert ex.profile.total_flops == reference.total_flops
    memscale.detach(model)


def test_a_larger_batch_measured_under_the_plan_is_planned_for():
    # The first batch is short; the measured steps see a longer one, and
    # the plan is made again from what they measured (what the fake pass of
    # the first batch could not know), applied from the next forward on.
    short = torch.randint(0, 256, (BATCH, SEQ // 2))
    x = ids()
    config = BUDGET.replace(memory_budget_gb=7 / 1024)  # under both steps' peaks
    _, short_hash = static_profile(short, config)
    model = gpt2()
    memscale.wrap(model, config.replace(use_static_profiling=False, warmup_steps=2))
    ex = model._memscale_executor
    model(input_ids=short, labels=short).loss.backward()
    assert ex.plan.hash == short_hash
    first = ex.plan
    assert first.technique_counts["checkpoint"] > 0  # measured under it
    model(input_ids=x, labels=x).loss.backward()
    assert ex.profiling == "warmup"
    assert ex.profile.layers == measured_unoptimized([short, x], config).layers
    assert ex.plan.technique_counts["checkpoint"] > first.technique_counts["checkpoint"]
    ref = gpt2()
    model.zero_grad()
    torch.manual_seed(3)
    model(input_ids=x, labels=x).loss.backward()  # under the new plan
    torch.manual_seed(3)
    ref(input_ids=x, labels=x).loss.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))
    memscale.detach(model)


def test_a_layer_failing_the_recompute_check_while_measured_keeps_its_fake_figures():
    # Block 1 reads a counter its forward bumps: it fails the first step's
    # recompute check, which keeps its saved tensors (exact, no recompute),
    # so the measured step never counted them.  The plan made again after
    # that one measured step takes that layer's figures from the fake pass
    # (it would have planned it as saving nothing) and, from the next
    # forward on, does not checkpoint it.
    from conftest import FORCE, mlp

    def unrepeatable(model):
        calls = [0]

        def bump(module, args):
            calls[0] += 1
            return (args[0] * (1.0 + calls[0] / 64),)

        model[1].fc1.register_forward_pre_hook(bump)
        return model

    x = torch.randn(4, 32)
    config = FORCE.replace(enable_logging=False)
    fake = unrepeatable(mlp())
    memscale.wrap(fake, config, sample_input=x)
    static = fake._memscale_executor.profile.layers
    memscale.detach(fake)
    model = unrepeatable(mlp())
    memscale.wrap(model, config.replace(use_static_profiling=False, warmup_steps=1))
    ex = model._memscale_executor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(x).sum().backward()
    assert ex.profiling == "warmup" and set(ex.recompute_check.failed) == {1}
    assert ex.profile.layers[1] == static[1] and static[1].saved_bytes > 0
    assert ex.profile.layers[0] == static[0]  # measured, checkpointed
    model(x).sum().backward()
    assert "checkpoint" not in ex.plan.layers[1].techniques
    assert "checkpoint" in ex.plan.layers[0].techniques
    memscale.detach(model)


def test_layers_run_selective_while_measured_keep_their_figures_and_profile():
    # With use_static_profiling=False the refined plan is made from real
    # steps.  A layer the first plan runs selective saves through torch's
    # checkpoint, which the measuring does not see, and real steps record
    # no op profile: the layer keeps the fake pass's figures and selective
    # profile, so the refined plan is not built from its input alone.
    from conftest import mlp

    x = torch.randn(8, 64, 32, generator=torch.Generator().manual_seed(0))
    unoptimized = memscale.predict_peak(
        mlp(depth=4), x, config=memscale.Config(memory_budget_gb=100)
    )
    budget = unoptimized.unoptimized.peak_bytes * 0.8 / 2**30
    model = mlp(depth=4)
    config = memscale.Config(
        mode="balanced",
        enable_offloading=False,
        memory_budget_gb=budget,
        use_static_profiling=False,
        warmup_steps=2,
        enable_logging=False,
    )
    memscale.wrap(model, config)
    executor = model._memscale_executor
    model(x).pow(2).mean().backward()
    first = executor.plan
    selective = [i for i, layer in enumerate(first.layers) if "selective" in layer.techniques]
    assert selective, [layer.techniques for layer in first.layers]
    first_saved = [layer.saved_bytes for layer in first.layers]
    for _ in range(3):
        model.zero_grad()
        model(x).pow(2).mean().backward()
    refined = executor.plan
    assert refined is not first
    for i in selective:
        assert refined.layers[i].saved_bytes >= first_saved[i]
    assert executor.profile.layers[selective[0]].selective_levels is not None
    # ... and where its tail starts (the levels keep nothing from there on,
    # nor does the selective run: memscale._compiled gives it the position).
    from memscale import _planning

    tail = _planning.tail_from(executor.profile.details[selective[0]])
    assert tail == ("aten.addmm.default", 1)
    regions = executor.__dict__["_compile_regions"].units
    for i, layer in enumerate(refined.layers):
        assert regions[i].tail == (tail if "selective" in layer.techniques else None)
    # The refined plan keeps what the budget needs: its measured peak fits.
    model.zero_grad()
    report = measure_peak(lambda: model(x).pow(2).mean().backward(), model=model, inputs=(x,))
    assert report.peak_bytes <= refined.budget_bytes
    memscale.detach(model)
