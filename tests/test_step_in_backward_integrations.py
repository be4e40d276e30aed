"""Config.optimizer_in_backward through the integrations: a real Hugging
Face Trainer and a real Lightning Trainer train a tiny GPT-2 with the
update inside backward and the state on disk, bit for bit as without
memscale; the settings the step in backward would silently change are
refused before anything is attached."""

from __future__ import annotations

import warnings

import lightning.pytorch as L
import pytest
import torch
from conftest import TokenDataset, hf_training_args, lightning_trainer, tiny_gpt2, token_batch
from transformers import Trainer

import memscale
from memscale.integrations.hf import MemScaleCallback as HFCallback
from memscale.integrations.lightning import MemScaleCallback as LCallback

STEPS = 3
FLOOR = memscale.Config(
    force_optimize=True,
    enable_logging=False,
    optimizer_in_backward=True,
    offload_optimizer_state="disk",
)


def _hf_trainer(tmp_path, callbacks=(), **settings):
    model = tiny_gpt2(dropout=0.0)
    fields = dict(
        max_steps=STEPS,
        per_device_train_batch_size=2,
        logging_steps=1,
        seed=0,
        max_grad_norm=0.0,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=1,
    )
    args = hf_training_args(tmp_path / "out", **{**fields, **settings})
    data = TokenDataset(token_batch(batch=8, seq=16))
    return Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))


def _hf_losses(trainer):
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


@pytest.mark.slow
def test_hf_trainer_trains_bitwise_with_the_step_in_backward(tmp_path):
    ref = _hf_trainer(tmp_path / "ref")
    ref.train()
    trainer = _hf_trainer(tmp_path / "ms", callbacks=[HFCallback(FLOOR)])
    seen = []

    class Probe(HFCallback.__mro__[1]):  # transformers.TrainerCallback
        def on_step_end(self, args, state, control, model=None, **kwargs):
            ex = model.__dict__["_memscale_executor"]
            seen.append(
                (
                    all(p.grad is None for p in model.parameters()),
                    ex.step_in_backward.stats["tier"]["bytes_on_disk"],
                )
            )

    trainer.add_callback(Probe())
    trainer.train()
    assert _hf_losses(trainer) == _hf_losses(ref)
    for p, q in zip(trainer.model.parameters(), ref.model.parameters()):
        assert torch.equal(p, q)
    assert len(seen) == STEPS
    assert all(no_grads and on_disk > 0 for no_grads, on_disk in seen)
    assert "_memscale_executor" not in trainer.model.__dict__  # released at train end
    assert "step" not in trainer.optimizer.optimizer.__dict__  # the step restored


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"max_grad_norm": 1.0}, "max_grad_norm=1.0"),
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps=2"),
    ],
)
def test_hf_trainer_refuses_what_the_step_in_backward_would_change(tmp_path, settings, match):
    trainer = _hf_trainer(tmp_path, callbacks=[HFCallback(FLOOR)], **settings)
    with pytest.raises(ValueError, match=match):
        trainer.train()
    assert "_memscale_executor" not in trainer.model.__dict__
    assert all(not p._post_accumulate_grad_hooks for p in trainer.model.parameters())


class LitGPT2(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_gpt2(dropout=0.0)
        self.losses = []

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids).loss

    def training_step(self, batch, batch_idx):
        loss = self(batch)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(callbacks=(), **settings):
    L.seed_everything(0, verbose=False)
    module = LitGPT2()
    trainer = lightning_trainer(L, max_steps=STEPS, callbacks=list(callbacks), **settings)
    data = torch.utils.data.DataLoader(token_batch(batch=8, seq=16), batch_size=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*treespec")
        trainer.fit(module, data)
    return module, trainer


@pytest.mark.slow
def test_lightning_trains_bitwise_with_the_step_in_backward():
    ref, _ = _fit()
    module, trainer = _fit([LCallback(FLOOR)])
    assert len(module.losses) == STEPS
    assert all(torch.equal(a, b) for a, b in zip(module.losses, ref.losses))
    for p, q in zip(module.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert all(p.grad is None for p in module.parameters())
    assert "_memscale_executor" not in module.__dict__
    # The ordinary step is back (behind the lr scheduler's wrapper, made
    # before memscale was attached).
    opt = trainer.optimizers[0]
    module(token_batch(batch=2, seq=16)).backward()
    before = [p.detach().clone() for p in module.parameters()]
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, module.parameters()))


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"gradient_clip_val": 1.0}, "gradient_clip_val"),
        ({"accumulate_grad_batches": 2}, "accumulate_grad_batches"),
    ],
)
def test_lightning_refuses_what_the_step_in_backward_would_change(settings, match):
    with pytest.raises(ValueError, match=match):
        _fit([LCallback(FLOOR)], **settings)
