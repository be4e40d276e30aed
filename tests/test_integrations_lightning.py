"""memscale in a real PyTorch Lightning ``Trainer`` through
``memscale.integrations.lightning.MemScaleCallback``.

A small LightningModule (MLP blocks with dropout) fits for a few steps on
CPU.  A memscale run must give the same per-step losses as an unwrapped
run with the same seed, have its plan applied during training, leave
nothing on the module after ``fit`` (also when it raises), and a run
resumed from a Lightning checkpoint must re-plan to the same plan hash.
"""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as L
import pytest
import pytorch_lightning as PL
import torch
import torch.nn.functional as F
from conftest import FORCE, Block, hook_count, lightning_trainer, run_blocked, saved_tensor_hooks
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import memscale
from memscale.integrations.lightning import MemScaleCallback

STEPS = 4
BLOCKS = 4


def module_class(pkg):
    class Lit(pkg.LightningModule):
        """MLP blocks and a head; training_step calls ``self(x)`` or, with
        ``via_forward=False``, the submodules directly (with "blockwise",
        each block)."""

        def __init__(self, via_forward: bool | str = True, fail_at: int | None = None):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*[Block(32, p=0.1) for _ in range(BLOCKS)])
            self.head = nn.Linear(32, 1)
            self.via_forward = via_forward
            self.fail_at = fail_at
            self.losses: list[float] = []
            self.seen: list[tuple] = []

        def forward(self, x):
            return self.head(self.net(x))

        def training_step(self, batch, batch_idx):
            if batch_idx == self.fail_at:
                raise ValueError("boom")
            x, y = batch
            if self.via_forward == "blockwise":  # no module holds every block's call
                for block in self.net:
                    x = block(x)
                out = self.head(x)
            else:
                out = self(x) if self.via_forward else self.head(self.net(x))
            loss = F.mse_loss(out, y)
            ex = self.__dict__.get("_memscale_executor")
            self.seen.append(
                (
                    ex.state if ex is not None else None,
                    ex.stats["recomputes"] if ex is not None else 0,
                    hook_count(self),
                )
            )
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Lit


Lit = module_class(L)


def loader(batch_size=8):
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g)
    )
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


def fit(module, callbacks=(), steps=STEPS, pkg=L, ckpt_path=None, batch_size=8, **kwargs):
    pkg.seed_everything(0, verbose=False)
    trainer = lightning_trainer(pkg, max_steps=steps, callbacks=list(callbacks))
    with warnings.catch_warnings():
        # Lightning's own notes about its pytree use and resuming mid-epoch.
        warnings.filterwarnings("ignore", message=".*treespec")
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint")
        trainer.fit(module, loader(batch_size), ckpt_path=ckpt_path, **kwargs)
    return trainer


def no_contexts_left():
    return saved_tensor_hooks() is None and not _get_current_dispatch_mode_stack()


@pytest.fixture(scope="module")
def baseline():
    """Per via_forward: the losses of an unwrapped fit."""
    out = {}
    for via_forward in (True, False, "blockwise"):
        module = Lit(via_forward)
        fit(module)
        out[via_forward] = module.losses
    return out


@pytest.mark.parametrize("via_forward", [True, False], ids=["self-call", "submodule-call"])
def test_fit_with_memscale(via_forward, baseline):
    module = Lit(via_forward)
    hooks_before = hook_count(module)
    callback = MemScaleCallback(FORCE)
    fit(module, [callback])

    assert len(baseline[via_forward]) == STEPS
    assert module.losses == baseline[via_forward]  # bitwise, dropout replayed
    states = [state for state, _, _ in module.seen]
    # self(x), or self.net(x) (which holds every block): planned inside the
    # first forward, applied from it on.
    assert states == ["applied"] * STEPS
    assert all(hooks > hooks_before for state, _, hooks in module.seen if state == "applied")
    # Checkpointed blocks recomputed in backward.
    figures = callback.figures()
    assert figures["memscale/checkpointed_layers"] == BLOCKS
    assert figures["memscale/recomputes"] > 0
    assert callback.plan_hash is not None
    # Nothing is left after fit().
    assert "_memscale_executor" not in module.__dict__
    assert hook_count(module) == hooks_before
    assert callback.executor is None
    assert no_contexts_left()


def test_submodule_call_profiles_through_the_callback(baseline, caplog):
    # training_step never calls self(...), nor one module that holds every
    # planned layer: the first batch shows it (a warning names the two
    # remedies), and the callback marks the next warm-up passes itself.
    module = Lit(via_forward="blockwise")
    with caplog.at_level(logging.WARNING, logger="memscale"):
        fit(module, [MemScaleCallback(FORCE)], steps=5)
    assert "the first batch ran unoptimized" in caplog.text
    assert "MemScaleCallback(plan_from_training_step=True)" in caplog.text
    assert [s for s, _, _ in module.seen] == [
        "idle",
        "profiling",
        "profiling",
        "applied",
        "applied",
    ]
    assert module.losses[:STEPS] == baseline["blockwise"]


def test_resume_replans_the_same_plan(tmp_path):
    callback = MemScaleCallback(FORCE)
    trainer = fit(Lit(), [callback])
    first = callback.plan_hash
    assert first is not None
    path = str(tmp_path / "run.ckpt")
    trainer.save_checkpoint(path)

    resumed = MemScaleCallback()  # the Config comes from the checkpoint
    module = Lit()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fit(module, [resumed], steps=2 * STEPS, ckpt_path=path, weights_only=True)
    assert resumed.config == FORCE
    assert resumed.plan_hash == first
    assert len(module.losses) == STEPS  # it did resume at step STEPS
    assert "_memscale_executor" not in module.__dict__

    # Other batch shapes give another plan: the resumed run says so.
    changed = MemScaleCallback()
    with pytest.warns(RuntimeWarning, match="differs from the plan stored"):
        fit(Lit(), [changed], steps=2 * STEPS, ckpt_path=path, batch_size=4, weights_only=True)
    assert changed.plan_hash != first


def test_callback_works_with_pytorch_lightning_package():
    assert issubclass(MemScaleCallback, L.Callback)
    assert issubclass(MemScaleCallback, PL.Callback)
    module = module_class(PL)()
    hooks_before = hook_count(module)
    callback = MemScaleCallback(FORCE)
    fit(module, [callback], pkg=PL)
    assert module.seen[-1][0] == "applied"
    assert callback.figures()["memscale/recomputes"] > 0
    assert "_memscale_executor" not in module.__dict__
    assert hook_count(module) == hooks_before


@pytest.mark.parametrize("fail_at", [0, 2], ids=["first-batch", "in-marked-pass"])
def test_fit_that_raises_leaves_nothing(fail_at):
    # via_forward=False: at batch 2 the failing forward runs inside a pass
    # the callback opened (profiler contexts entered).
    module = Lit(via_forward=False, fail_at=fail_at)
    hooks_before = hook_count(module)
    callback = MemScaleCallback(FORCE)
    with pytest.raises(ValueError, match="boom"):
        fit(module, [callback])
    assert "_memscale_executor" not in module.__dict__
    assert hook_count(module) == hooks_before
    assert callback.executor is None
    assert no_contexts_left()


def test_module_wrapped_by_hand_is_left_alone():
    module = Lit()
    memscale.wrap(module, FORCE)
    executor = module._memscale_executor
    fit(module, [MemScaleCallback(FORCE)], steps=1)
    assert module._memscale_executor is executor
    memscale.detach(module)


def test_bad_config_and_wrap_of_a_lightning_trainer():
    with pytest.raises(TypeError, match="memscale.Config"):
        MemScaleCallback({"mode": "balanced"})
    with pytest.raises(TypeError, match="plan_from_training_step"):
        MemScaleCallback(plan_from_training_step="yes")
    trainer = lightning_trainer(L)
    with pytest.raises(TypeError, match="MemScaleCallback"):
        memscale.wrap(trainer)


def test_import_error_names_the_extra_without_lightning():
    out = run_blocked(
        ["lightning", "pytorch_lightning"],
        """
        import memscale
        try:
            import memscale.integrations.lightning
        except ImportError as exc:
            print("ERROR:", exc)
    """,
    )
    assert "ERROR:" in out and "pip install 'memscale[lightning]'" in out


@pytest.mark.slow
@pytest.mark.parametrize(
    "present,missing", [("pytorch_lightning", "lightning"), ("lightning", "pytorch_lightning")]
)
def test_subclasses_the_callback_of_the_installed_package(present, missing):
    out = run_blocked(
        [missing],
        f"""
        import importlib
        from memscale.integrations.lightning import MemScaleCallback
        pkg = importlib.import_module(
            "lightning.pytorch" if {present!r} == "lightning" else {present!r})
        print([b.__module__.split(".")[0] for b in MemScaleCallback.__bases__],
              isinstance(MemScaleCallback(), pkg.Callback))
    """,
    )
    assert out.split() == [f"['{present}']", "True"]
