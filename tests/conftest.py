"""Shared test models, all built from code or configs (never downloaded)."""

from __future__ import annotations

import copy
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import warnings

import pytest
import torch
from torch import nn

import memscale

os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", message=".*bos_token_id.*")
warnings.filterwarnings("ignore", message=".*eos_token_id.*")


def pytest_configure(config) -> None:
    # One intra-op thread in the test session and the interpreters its tests
    # start: the tests' tensors are tiny, so a second OpenMP thread only adds
    # barrier waits (on a loaded 2-core machine it doubles the suite's time
    # and CPU).  OMP_NUM_THREADS=2 (or more) tests under intra-op threads.
    # A hook, not an import-time setting: scripts/model_zoo.py imports this
    # module through tests/zoo_models.py and keeps torch's threads.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # Plans in tests use the default cost constants, whatever this machine
    # has measured (python -m memscale.costs): an empty cache of their own.
    os.environ["MEMSCALE_CACHE_DIR"] = tempfile.mkdtemp(prefix="memscale-test-costs-")


def pytest_unconfigure(config) -> None:
    shutil.rmtree(os.environ.get("MEMSCALE_CACHE_DIR", ""), ignore_errors=True)


def cuda_skip_reason() -> str | None:
    """Why a test marked ``cuda`` cannot run here (None when it can)."""
    if torch.cuda.is_available():
        return None
    return (
        "needs a CUDA device: torch.cuda.is_available() is False (torch "
        f"{torch.__version__}, built for CUDA {torch.version.cuda or 'none'}); "
        "run bash scripts/gpu-check.sh on a GPU machine"
    )


def pytest_collection_modifyitems(config, items) -> None:
    # Tests marked cuda (tests/gpu) are skipped, each with the reason, where
    # there is no CUDA device: the suite stays green on CPU machines and
    # says what it did not run.
    reason = cuda_skip_reason()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


class Block(nn.Module):
    def __init__(self, width: int = 32, p: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(self.drop(self.act(self.fc1(x))))


def mlp(depth: int = 4, width: int = 32, p: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width, p) for _ in range(depth)])


class ConvBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)
        self.bn = nn.BatchNorm2d(ch)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x))) + x


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvBlock(8) for _ in range(3)])
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


class LossChain(nn.Module):
    """``depth`` blocks made by ``block()`` in a row, returning the mean
    square of their output (a scalar loss)."""

    def __init__(self, block, depth: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[block() for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x).pow(2).mean()


class Attention(nn.Module):
    """A qkv projection, causal SDPA (dropout ``p`` in training), an output
    projection and the residual, with 4 heads of ``width / 4``."""

    def __init__(self, p: float, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.p = p

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, w // 4).permute(2, 0, 3, 1, 4)
        p = self.p if self.training else 0.0
        a = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(b, s, w))


def tiny_gpt2(dropout: float = 0.1, **config):
    """A 3-block GPT-2 (64 wide, 256 tokens); ``config`` overrides any
    GPT2Config field (``n_layer=4``, ``n_positions=128``...)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    fields = dict(
        n_layer=3,
        n_embd=64,
        n_head=4,
        vocab_size=256,
        n_positions=64,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
    )
    return GPT2LMHeadModel(GPT2Config(**{**fields, **config}))


def tiny_llama(**config):
    """A 2-block Llama (64 wide, 256 tokens, grouped-query attention);
    ``config`` overrides any LlamaConfig field."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    fields = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(LlamaConfig(**{**fields, **config}))


def tiny_bert(dropout: float = 0.1):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return BertForMaskedLM(cfg)


def token_batch(vocab: int = 256, batch: int = 2, seq: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, seq), generator=g)


class TokenDataset(torch.utils.data.Dataset):
    """Language-model examples for a Trainer: each row of ``ids`` with its
    labels (the row itself unless ``labels`` is given)."""

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        self.ids = ids
        self.labels = ids if labels is None else labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def hf_training_args(output_dir, **settings):
    """Hugging Face TrainingArguments for a quiet CPU run that saves and
    reports nothing; ``settings`` add to or override these."""
    from transformers import TrainingArguments

    fields = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    with warnings.catch_warnings():
        # transformers 5 renamed gradient_checkpointing (the old name still
        # works, with a FutureWarning); 4.x knows only that one.
        warnings.simplefilter("ignore", FutureWarning)
        return TrainingArguments(**{**fields, **settings})


def lightning_trainer(pkg, **settings):
    """A quiet one-device CPU Trainer of ``pkg`` (``lightning.pytorch`` or
    ``pytorch_lightning``): no logger, checkpoints, progress bar or
    summary; ``settings`` add to or override these."""
    fields = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    return pkg.Trainer(**{**fields, **settings})


def twins(factory):
    """Two identical copies of a model: one to wrap, one as reference."""
    model = factory()
    model.train()
    return model, copy.deepcopy(model)


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if p.grad is None or q.grad is None:
            assert p.grad is None and q.grad is None, name
            continue
        assert torch.equal(p.grad, q.grad), (
            f"{name}: max diff {(p.grad - q.grad).abs().max().item()}"
        )


def hook_count(model: nn.Module) -> int:
    """Every module hook on ``model`` and its submodules."""
    return sum(
        len(m._forward_pre_hooks)
        + len(m._forward_hooks)
        + len(m._backward_hooks)
        + len(m._backward_pre_hooks)
        for m in model.modules()
    )


def saved_tensor_hooks():
    """The innermost saved-tensor hooks installed on autograd's stack (None
    when there are none); test-only use of a private torch function."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spill_fds(path: str, directory: bool = False) -> list[int]:
    """This process's descriptors open on files in the spill directory
    ``path`` (and with ``directory``, on the directory itself, which a live
    store holds open)."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the descriptor listdir itself had open
        if target.startswith(path + "/") or (directory and target == path):
            fds.append(int(name))
    return fds


# Checkpointing on every eligible layer, whatever the memory pressure.
FORCE = memscale.Config(mode="conservative", force_optimize=True)


# ------------------------------------------------------- training steps


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The tests' training loss: a language model's own loss on token ids
    (the inputs as labels), else the mean square of the output, in float32."""
    if x.dtype == torch.long:
        return model(input_ids=x, labels=x).loss
    return model(x).float().pow(2).mean()


def train_step(
    model: nn.Module, x: torch.Tensor, seed: int = 0, loss_fn=loss_of, retain_graph: bool = False
) -> torch.Tensor:
    """One forward and backward from cleared gradients and RNG seed ``seed``
    (dropout draws the same masks in twins); with ``retain_graph`` backward
    runs twice through the same graph.  Returns the loss, detached."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(model, x)
    loss.backward(retain_graph=retain_graph)
    if retain_graph:
        loss.backward()
    return loss.detach()


def adamw_step_peak(model: nn.Module, batch, loss_fn, report: bool = False):
    """The exact peak of one training step of ``model`` (zero_grad,
    ``loss_fn(model, batch)``, backward, an AdamW step) after a warm-up
    step, with the batch and the optimizer's state counted from the start
    (``memscale._measure.measure_peak``); with ``report``, its whole
    MemoryReport (the bytes the step starts from too)."""
    from memscale._measure import measure_peak

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        optimizer.step()

    step()
    measured = measure_peak(step, model=model, inputs=(batch, optimizer.state), warmup=1)
    return measured if report else measured.peak_bytes


def assert_same_step(
    model: nn.Module,
    ref: nn.Module,
    x: torch.Tensor,
    seed: int = 0,
    loss_fn=loss_of,
    retain_graph: bool = False,
) -> None:
    """The same training step on a wrapped model and its unwrapped twin
    gives the same loss and the same gradients, bit for bit."""
    a = train_step(model, x, seed, loss_fn, retain_graph)
    b = train_step(ref, x, seed, loss_fn, retain_graph)
    assert torch.equal(a, b), f"loss {a.item()} != {b.item()}"
    assert_same_grads(model, ref)


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_blocked(blocked, code):
    """Run ``code`` in a fresh interpreter where importing any of the
    ``blocked`` top-level packages fails as if they were not installed."""
    prelude = textwrap.dedent(f"""
        import sys
        from importlib.abc import MetaPathFinder
        BLOCKED = {tuple(blocked)!r}
        class Block(MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"No module named {{name!r}}")
                return None
        sys.meta_path.insert(0, Block())
    """)
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": _ROOT},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout
