"""memscale in a real Hugging Face ``Trainer``: ``wrap(trainer)`` and
``callbacks=[MemScaleCallback()]``.

Tiny GPT-2 and BERT models built from configs train for a few steps on CPU
(no download).  A memscale run must log the same per-step losses as an
unwrapped run with the same seed, have its plan applied (hooks on the
model, checkpoint recomputes) during training, and leave nothing on the
model once ``train()`` returns.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import (
    FORCE,
    TokenDataset,
    hf_training_args,
    hook_count,
    run_blocked,
    saved_tensor_hooks,
    tiny_bert,
    tiny_gpt2,
    token_batch,
)
from transformers import Trainer, TrainerCallback

import memscale
from memscale.integrations.hf import MemScaleCallback

STEPS = 4  # the plan is made in step 1's forward and applies from it on
LAYERS = 3  # transformer blocks of the tiny models


def token_data(masked: bool) -> TokenDataset:
    """16 fixed sequences; BERT's labels mask every other position."""
    ids = token_batch(batch=16, seq=16)
    labels = ids.clone()
    if masked:
        labels[:, ::2] = -100
    return TokenDataset(ids, labels)


MODELS = {"gpt2": (tiny_gpt2, False), "bert": (tiny_bert, True)}


class Probe(TrainerCallback):
    """Records, at the end of each step, what memscale has on the model."""

    def __init__(self) -> None:
        self.steps = []
        self.begin = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # Hugging Face's checkpointing settings as its Trainer made them
        # (this callback runs before one that memscale.wrap adds).
        self.begin = hf_checkpointing_settings(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        ex = model.__dict__.get("_memscale_executor")
        self.steps.append(
            {
                "state": ex.state if ex is not None else None,
                "recomputes": ex.stats["recomputes"] if ex is not None else 0,
                "hooks": hook_count(model),
                "hf_checkpointing": any(
                    getattr(m, "gradient_checkpointing", False) for m in model.modules()
                ),
            }
        )


def hf_checkpointing_settings(model):
    # transformers 5 flags every layer, 4.x the base model only.
    return [
        (name, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func"))
        for name, m in model.named_modules()
        if hasattr(m, "gradient_checkpointing")
    ]


class FailAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError("stop here")


def make_trainer(name, tmp_path, callbacks=(), gc=False, steps=STEPS):
    factory, masked = MODELS[name]
    model = factory()
    extra = {"gradient_checkpointing": True} if gc else {}
    args = hf_training_args(
        tmp_path / "out",
        max_steps=steps,
        per_device_train_batch_size=2,
        logging_steps=1,
        seed=0,
        **extra,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=token_data(masked), callbacks=list(callbacks)
    )
    return trainer


def losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def memscale_hooks_gone(model):
    return "_memscale_executor" not in model.__dict__


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Per model: the losses of an unwrapped run and its model's hook count
    after train()."""
    out = {}
    for name in MODELS:
        trainer = make_trainer(name, tmp_path_factory.mktemp(name))
        trainer.train()
        out[name] = (losses(trainer), hook_count(trainer.model), trainer.model.config.use_cache)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["wrap", "callback"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_trainer_trains_with_memscale(name, how, baseline, tmp_path):
    ref_losses, ref_hooks, ref_use_cache = baseline[name]
    probe = Probe()
    if how == "wrap":
        trainer = make_trainer(name, tmp_path, [probe])
        assert memscale.wrap(trainer, FORCE) is trainer
    else:
        trainer = make_trainer(name, tmp_path, [MemScaleCallback(FORCE), probe])
    callback = next(
        cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MemScaleCallback)
    )
    model = trainer.model
    trainer.train()

    assert len(ref_losses) == STEPS
    assert losses(trainer) == ref_losses  # bitwise: dropout is replayed
    # The plan was applied during training: hooks on the model the Trainer
    # ran, and the checkpointed layers recomputed in backward.
    # From the first step on (no sample_input: planned inside its forward).
    assert [s["state"] for s in probe.steps] == ["applied"] * STEPS
    assert all(s["hooks"] > ref_hooks for s in probe.steps)
    assert probe.steps[0]["recomputes"] == LAYERS
    assert probe.steps[-1]["recomputes"] == LAYERS * STEPS
    # The figures went into the logs from the first step on.
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert "memscale/peak_projected_bytes" in logged[0]
    last = logged[-1]
    assert last["memscale/checkpointed_layers"] == LAYERS
    assert (
        last["memscale/bytes_saved"]
        == (last["memscale/peak_unoptimized_bytes"] - last["memscale/peak_projected_bytes"])
        > 0
    )
    # Nothing is left after train() returns.
    assert memscale_hooks_gone(model)
    assert hook_count(model) == ref_hooks
    assert model.config.use_cache == ref_use_cache
    assert callback.executor is None
    # detach(trainer) takes the callback off; after that, nothing to do.
    memscale.detach(trainer)
    assert not any(isinstance(cb, MemScaleCallback) for cb in trainer.callback_handler.callbacks)
    with pytest.warns(RuntimeWarning, match="nothing to do"):
        memscale.detach(trainer)


@pytest.mark.slow
def test_callback_with_sample_input_plans_before_the_first_step(baseline, tmp_path):
    ids = token_data(masked=False).ids[:2]
    probe = Probe()
    callback = MemScaleCallback(FORCE, sample_input={"input_ids": ids})
    trainer = make_trainer("gpt2", tmp_path, [callback, probe])
    trainer.train()
    assert losses(trainer) == baseline["gpt2"][0]
    assert [s["state"] for s in probe.steps] == ["applied"] * STEPS
    assert probe.steps[-1]["recomputes"] == LAYERS * STEPS
    assert memscale_hooks_gone(trainer.model)


@pytest.mark.slow
def test_hf_gradient_checkpointing_is_taken_over(baseline, tmp_path, caplog):
    ref_losses = baseline["gpt2"][0]
    hf = make_trainer("gpt2", tmp_path / "hf", gc=True)
    hf.train()
    assert losses(hf) == ref_losses

    probe = Probe()
    trainer = make_trainer("gpt2", tmp_path / "ms", [probe], gc=True)
    memscale.wrap(trainer, FORCE)
    with caplog.at_level(logging.INFO, logger="memscale"):
        trainer.train()
    model = trainer.model
    assert "takes over" in caplog.text
    assert losses(trainer) == ref_losses
    # During training Hugging Face's checkpointing was off and memscale's
    # plan ran: each checkpointed layer recomputed exactly once per step.
    assert not any(s["hf_checkpointing"] for s in probe.steps)
    assert probe.steps[-1]["recomputes"] == LAYERS * STEPS
    # Afterwards Hugging Face's checkpointing is on again, exactly as it was.
    assert any(flag for _, flag, _ in probe.begin)
    assert hf_checkpointing_settings(model) == probe.begin
    assert memscale_hooks_gone(model)
    assert hook_count(model) == hook_count(hf.model)


def test_hf_gradient_checkpointing_kept_without_memscale_checkpointing(tmp_path, caplog):
    probe = Probe()
    config = memscale.Config(enable_checkpointing=False)
    trainer = make_trainer("gpt2", tmp_path, [MemScaleCallback(config), probe], gc=True, steps=3)
    with caplog.at_level(logging.INFO, logger="memscale"):
        trainer.train()
    assert "leaves it on" in caplog.text
    assert all(s["hf_checkpointing"] for s in probe.steps)
    assert probe.steps[-1]["recomputes"] == 0
    last = [e for e in trainer.state.log_history if "loss" in e][-1]
    assert last["memscale/checkpointed_layers"] == 0
    assert memscale_hooks_gone(trainer.model)


@pytest.mark.slow
def test_train_that_raises_is_cleaned_up(baseline, tmp_path):
    trainer = make_trainer("gpt2", tmp_path, [FailAt(3)])
    memscale.wrap(trainer, FORCE)
    model = trainer.model
    with pytest.raises(RuntimeError, match="stop here"):
        trainer.train()
    # transformers calls no callback after an exception: memscale is still
    # on the model (its hooks are idle), until the next train() ...
    assert model._memscale_executor.state == "applied"
    assert model._memscale_executor.stats["active_frames"] == 0
    trainer.remove_callback(FailAt)
    trainer.train()  # re-plans instead of failing as "already wrapped"
    assert memscale_hooks_gone(model)
    assert hook_count(model) == baseline["gpt2"][1]
    # ... or memscale.detach(trainer).
    trainer.add_callback(FailAt(1))
    with pytest.raises(RuntimeError, match="stop here"):
        trainer.train()
    assert model._memscale_executor.state == "applied"
    memscale.detach(trainer)
    assert memscale_hooks_gone(model)
    assert hook_count(model) == baseline["gpt2"][1]
    assert saved_tensor_hooks() is None


def test_wrap_trainer_misuse(tmp_path):
    trainer = make_trainer("gpt2", tmp_path)
    with pytest.raises(TypeError, match="optimizer the Trainer builds"):
        memscale.wrap(trainer, optimizer=torch.optim.SGD(trainer.model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="computes its own loss"):
        memscale.wrap(trainer, loss_fn=lambda out: out.loss)
    with pytest.raises(TypeError, match="Config"):
        memscale.wrap(trainer, {"mode": "balanced"})
    with pytest.warns(RuntimeWarning, match="nothing to do"):
        memscale.detach(trainer)
    memscale.wrap(trainer)
    with pytest.raises(RuntimeError, match="already has a memscale"):
        memscale.wrap(trainer)
    memscale.detach(trainer)
    # A model wrapped by hand: wrapping the trainer too is refused.
    memscale.wrap(trainer.model, FORCE)
    with pytest.raises(RuntimeError, match="already wrapped"):
        memscale.wrap(trainer)
    memscale.detach(trainer)  # detaches trainer.model
    assert memscale_hooks_gone(trainer.model)
    with pytest.raises(TypeError, match="memscale.Config"):
        MemScaleCallback({"mode": "balanced"})


def test_model_wrapped_by_hand_is_left_alone(tmp_path, caplog):
    trainer = make_trainer("gpt2", tmp_path, [MemScaleCallback(FORCE)], steps=1)
    memscale.wrap(trainer.model, FORCE)
    executor = trainer.model._memscale_executor
    with caplog.at_level(logging.WARNING, logger="memscale"):
        trainer.train()
    assert "leaves that wrapping" in caplog.text
    assert trainer.model._memscale_executor is executor
    memscale.detach(trainer.model)


def test_other_processes_wrap_quietly(tmp_path, caplog):
    # What a process other than world process zero does at on_train_begin,
    # with the TrainerState that process has.
    from transformers import TrainerControl, TrainerState

    log_file = tmp_path / "memscale.log"
    callback = MemScaleCallback(FORCE.replace(log_file=str(log_file)))
    model = tiny_gpt2()
    state = TrainerState(is_world_process_zero=False)
    with caplog.at_level(logging.INFO, logger="memscale"):
        callback.on_train_begin(None, state, TrainerControl(), model=model, optimizer=None)
        config = model._memscale_executor.config
        callback.on_train_end(None, state, TrainerControl(), model=model)
    assert not config.enable_logging and config.log_file is None
    assert "memscale" not in caplog.text and not log_file.exists()
    assert memscale_hooks_gone(model)


def test_import_error_names_the_extra_without_transformers():
    out = run_blocked(
        ["transformers", "accelerate"],
        """
        import torch, memscale
        assert "transformers" not in sys.modules
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        memscale.detach(memscale.wrap(model))  # the core works without it
        try:
            from memscale.integrations.hf import MemScaleCallback
        except ImportError as exc:
            print("ERROR:", exc)
    """,
    )
    assert "ERROR:" in out and "pip install 'memscale[hf]'" in out
    assert "transformers" in out
