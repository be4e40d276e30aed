"""The benchmark models, built from code or configs (never downloaded).

Each entry of ``BENCHMARK_MODELS`` builds a model and a fixed batch from a
seed, so every variant of a benchmark trains identical weights on identical
inputs.  ``quick`` entries are the default run (small enough for a laptop
CPU); ``full`` entries match the published reference rows of the product
(BERT-Base/Large at 16x128, GPT-2 Medium/Large/XL at batch x 512).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Batch:
    """One training batch: call ``model(*args, **kwargs)``; the loss is
    ``loss_fn(output)``."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[[Any], torch.Tensor]

    @property
    def sample_input(self) -> Any:
        return self.kwargs if self.kwargs else self.args


@dataclass(frozen=True)
class BenchmarkModel:
    """A registry entry."""

    name: str
    family: str  # mlp, cnn, gpt2, bert, llama
    size: str  # "quick" or "full"
    description: str
    params: dict[str, Any] = field(default_factory=dict)
    sequential: bool = False  # checkpoint_sequential applies
    hf: bool = False  # a Hugging Face model
    reference: str | None = None  # the published row it matches

    def build(self, seed: int = 0, device: torch.device | str = "cpu") -> tuple[nn.Module, Batch]:
        """The model and its batch, made on the CPU from ``seed`` (the same
        weights and inputs whatever the device), then moved to ``device``."""
        device = torch.device(device)
        torch.manual_seed(seed)
        model, batch = _BUILDERS[self.family](**self.params, device=device)
        if device.type != "cpu":
            model.to(device)
        model.train()
        return model, batch

    def estimated_training_bytes(self) -> int:
        """Parameters x 16 (fp32 weights, grads, Adam): a floor used to skip
        full-size rows this machine cannot hold."""
        with torch.device("meta"):
            torch.manual_seed(0)
            model, _ = _BUILDERS[self.family](**self.params, meta=True)
        return 16 * sum(p.numel() for p in model.parameters())

    def predicted_peak_bytes(self) -> int:
        """The unoptimized step's peak as memscale.predict_peak gives it, on
        fake tensors (seconds, no memory): used to skip full-size rows this
        machine cannot measure."""
        from .. import predict_peak

        model, batch = self.build(seed=0)
        prediction = predict_peak(model, batch.sample_input, optimizer=None, loss_fn=batch.loss_fn)
        return int(prediction.unoptimized.peak_bytes)


# ---- builders ------------------------------------------------------------


def _on(device: torch.device | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` on ``device``: made on the CPU from a generator (the same
    values on every device), moved only when the device is another."""
    if device is None or device.type == "cpu":
        return tensors
    return tuple(t.to(device) for t in tensors)


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(self.act(self.fc1(x))))


def _mlp(
    width: int, depth: int, batch: int, meta: bool = False, device: torch.device | None = None
):
    model = nn.Sequential(*[MLPBlock(width) for _ in range(depth)])
    if meta:
        return model, None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=g)
    target = torch.randn(batch, width, generator=g)
    x, target = _on(device, x, target)
    return model, Batch((x,), {}, lambda out: nn.functional.mse_loss(out, target))


class ConvBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(h)))


def _cnn(
    channels: int,
    depth: int,
    image: int,
    batch: int,
    classes: int = 10,
    meta: bool = False,
    device: torch.device | None = None,
):
    model = nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1),
        *[ConvBlock(channels) for _ in range(depth)],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, classes),
    )
    if meta:
        return model, None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, image, image, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    x, y = _on(device, x, y)
    return model, Batch((x,), {}, lambda out: nn.functional.cross_entropy(out, y))


def _tokens(vocab: int, batch: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _hf_loss(out: Any) -> torch.Tensor:
    return out.loss


def _gpt2(
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    seq: int,
    batch: int,
    meta: bool = False,
    device: torch.device | None = None,
):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=heads,
        vocab_size=vocab,
        n_positions=max(seq, 128),
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg)
    if meta:
        return model, None
    (ids,) = _on(device, _tokens(vocab, batch, seq))
    return model, Batch((), {"input_ids": ids, "labels": ids}, _hf_loss)


def _bert(
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    seq: int,
    batch: int,
    meta: bool = False,
    device: torch.device | None = None,
):
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=max(seq, 128),
    )
    model = BertForMaskedLM(cfg)
    if meta:
        return model, None
    ids = _tokens(vocab, batch, seq)
    labels = ids.clone()
    labels[:, ::2] = -100  # score every other position, as masked LM does
    ids, labels = _on(device, ids, labels)
    return model, Batch((), {"input_ids": ids, "labels": labels}, _hf_loss)


def _llama(
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    seq: int,
    batch: int,
    meta: bool = False,
    device: torch.device | None = None,
):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 32 * 32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=max(seq, 128),
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg)
    if meta:
        return model, None
    (ids,) = _on(device, _tokens(vocab, batch, seq))
    return model, Batch((), {"input_ids": ids, "labels": ids}, _hf_loss)


_BUILDERS: dict[str, Callable[..., Any]] = {
    "mlp": _mlp,
    "cnn": _cnn,
    "gpt2": _gpt2,
    "bert": _bert,
    "llama": _llama,
}


def _entry(name, family, size, description, sequential=False, hf=False, reference=None, **params):
    return BenchmarkModel(name, family, size, description, params, sequential, hf, reference)


BENCHMARK_MODELS: dict[str, BenchmarkModel] = {
    m.name: m
    for m in [
        # Quick sizes: the default run (about a second a step or less on 2 cores).
        _entry(
            "mlp",
            "mlp",
            "quick",
            "MLP stack, 8 blocks of width 256, batch 2048",
            sequential=True,
            width=256,
            depth=8,
            batch=2048,
        ),
        _entry(
            "cnn",
            "cnn",
            "quick",
            "ResNet-style CNN, 6 blocks x 32 ch, 32x32, batch 16",
            sequential=True,
            channels=32,
            depth=6,
            image=32,
            batch=16,
        ),
        _entry(
            "gpt2",
            "gpt2",
            "quick",
            "GPT-2-shaped, 6 layers, hidden 256, 4 heads, vocab 8192, 4x128",
            hf=True,
            layers=6,
            hidden=256,
            heads=4,
            vocab=8192,
            seq=128,
            batch=4,
        ),
        _entry(
            "bert",
            "bert",
            "quick",
            "BERT-shaped, 6 layers, hidden 256, 4 heads, vocab 8192, 4x128",
            hf=True,
            layers=6,
            hidden=256,
            heads=4,
            vocab=8192,
            seq=128,
            batch=4,
        ),
        _entry(
            "llama",
            "llama",
            "quick",
            "Llama-shaped, 4 layers, hidden 256, 8 heads (4 KV), vocab 8192, 4x128",
            hf=True,
            layers=4,
            hidden=256,
            heads=8,
            vocab=8192,
            seq=128,
            batch=4,
        ),
        # The budget sweep's Llama-shaped model (--sweep), beside gpt2-12l.
        _entry(
            "llama-12l",
            "llama",
            "extra",
            "Llama-shaped, 12 layers, hidden 256, 8 heads (4 KV), vocab 8192, 8x256",
            hf=True,
            layers=12,
            hidden=256,
            heads=8,
            vocab=8192,
            seq=256,
            batch=8,
        ),
        # The foundation's reference shape: run it by name (--models gpt2-12l).
        _entry(
            "gpt2-12l",
            "gpt2",
            "extra",
            "GPT-2-shaped, 12 layers, hidden 256, 4 heads, vocab 8192, 8x256",
            hf=True,
            layers=12,
            hidden=256,
            heads=4,
            vocab=8192,
            seq=256,
            batch=8,
        ),
        # The budget sweep's BERT-shaped model (--sweep).
        _entry(
            "bert-12l",
            "bert",
            "extra",
            "BERT-shaped, 12 layers, hidden 256, 4 heads, vocab 8192, 8x256",
            hf=True,
            layers=12,
            hidden=256,
            heads=4,
            vocab=8192,
            seq=256,
            batch=8,
        ),
        # Full sizes: the published reference rows, where this machine can hold them.
        _entry(
            "bert-base",
            "bert",
            "full",
            "BERT-Base, 16x128",
            hf=True,
            reference="BERT-Base 16x128",
            layers=12,
            hidden=768,
            heads=12,
            vocab=30522,
            seq=128,
            batch=16,
        ),
        _entry(
            "bert-large",
            "bert",
            "full",
            "BERT-Large, 16x128",
            hf=True,
            reference="BERT-Large 16x128",
            layers=24,
            hidden=1024,
            heads=16,
            vocab=30522,
            seq=128,
            batch=16,
        ),
        _entry(
            "gpt2-medium",
            "gpt2",
            "full",
            "GPT-2 Medium, 4x512",
            hf=True,
            reference="GPT-2 Medium 4x512",
            layers=24,
            hidden=1024,
            heads=16,
            vocab=50257,
            seq=512,
            batch=4,
        ),
        _entry(
            "gpt2-large",
            "gpt2",
            "full",
            "GPT-2 Large, 2x512",
            hf=True,
            reference="GPT-2 Large 2x512",
            layers=36,
            hidden=1280,
            heads=20,
            vocab=50257,
            seq=512,
            batch=2,
        ),
        _entry(
            "gpt2-xl",
            "gpt2",
            "full",
            "GPT-2 XL, 1x512",
            hf=True,
            reference="GPT-2 XL 1x512",
            layers=48,
            hidden=1600,
            heads=25,
            vocab=50257,
            seq=512,
            batch=1,
        ),
    ]
}


def select(names: list[str] | None, full: bool) -> list[BenchmarkModel]:
    """The registry entries to run: by name, or every quick (or full) one."""
    if names:
        unknown = [n for n in names if n not in BENCHMARK_MODELS]
        if unknown:
            raise ValueError(
                f"unknown benchmark model(s) {unknown}; choose from {sorted(BENCHMARK_MODELS)}"
            )
        return [BENCHMARK_MODELS[n] for n in names]
    size = "full" if full else "quick"
    return [m for m in BENCHMARK_MODELS.values() if m.size == size]
