"""The model zoo: transformers architectures built tiny from their configs
(never downloaded), and the check each must pass under memscale.

Used by tests/test_zoo.py and by scripts/model_zoo.py, which writes the
table in docs/model-zoo.md.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from conftest import hook_count, train_step
from torch import nn

import memscale
from memscale import _hf_cache

os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", message=".*bos_token_id.*")
warnings.filterwarnings("ignore", message=".*eos_token_id.*")

VOCAB = 256
BATCH = 2
SEQ = 16


def _ids(seq: int = SEQ, seed: int = 1, low: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, VOCAB, (BATCH, seq), generator=g)


def _lm_batch() -> dict[str, Any]:
    ids = _ids()
    return {"input_ids": ids, "labels": ids}


def _mlm_batch() -> dict[str, Any]:
    ids = _ids()
    return {"input_ids": ids, "labels": _ids(seed=2)}


def _seq2seq_batch() -> dict[str, Any]:
    return {"input_ids": _ids(32), "labels": _ids(16, seed=2)}


def _image_batch(size: int = 32) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "pixel_values": torch.randn(BATCH, 3, size, size, generator=g),
        "labels": torch.randint(0, 4, (BATCH,), generator=g),
    }


def _decoder(config_cls: str, model_cls: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_cls)(vocab_size=VOCAB, **kw)
        return getattr(transformers, model_cls)(cfg)

    return build


_LLAMA_LIKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _whisper() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=16,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=32,
        max_target_positions=32,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        suppress_tokens=[],
        begin_suppress_tokens=[],
    )
    return WhisperForConditionalGeneration(cfg)


def _whisper_batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {"input_features": torch.randn(BATCH, 16, 64, generator=g), "labels": _ids(16, seed=2)}


def _clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    text = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        eos_token_id=2,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32))


def _clip_batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "input_ids": _ids(),
        "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g),
        "return_loss": True,
    }


@dataclass(frozen=True)
class Arch:
    name: str
    family: str
    build: Callable[[], nn.Module]
    batch: Callable[[], dict[str, Any]]
    note: str = ""


def _hf(config_cls: str, model_cls: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kw))

    return build


_BERT_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=64,
)
_T5 = dict(
    vocab_size=VOCAB,
    d_model=64,
    d_ff=128,
    num_layers=2,
    num_heads=4,
    d_kv=16,
    decoder_start_token_id=0,
    pad_token_id=0,
)
_BART_LIKE = dict(
    vocab_size=VOCAB,
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=2,
)

ZOO: tuple[Arch, ...] = (
    # --- decoder-only
    Arch(
        "gpt2",
        "decoder",
        _decoder("GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=64, n_head=4, n_positions=64),
        _lm_batch,
        "dropout 0.1 (its default), tied embeddings",
    ),
    Arch(
        "llama",
        "decoder",
        _decoder("LlamaConfig", "LlamaForCausalLM", **_LLAMA_LIKE),
        _lm_batch,
        "grouped-query attention, rotary",
    ),
    Arch(
        "mistral",
        "decoder",
        _decoder("MistralConfig", "MistralForCausalLM", **_LLAMA_LIKE),
        _lm_batch,
    ),
    Arch("qwen2", "decoder", _decoder("Qwen2Config", "Qwen2ForCausalLM", **_LLAMA_LIKE), _lm_batch),
    Arch(
        "gemma",
        "decoder",
        _decoder("GemmaConfig", "GemmaForCausalLM", head_dim=16, **_LLAMA_LIKE),
        _lm_batch,
        "tied embeddings",
    ),
    Arch(
        "gpt_neox",
        "decoder",
        _decoder(
            "GPTNeoXConfig",
            "GPTNeoXForCausalLM",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
        _lm_batch,
    ),
    Arch(
        "opt",
        "decoder",
        _decoder(
            "OPTConfig",
            "OPTForCausalLM",
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
            dropout=0.1,
        ),
        _lm_batch,
        "dropout 0.1",
    ),
    Arch(
        "phi",
        "decoder",
        _decoder(
            "PhiConfig",
            "PhiForCausalLM",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
        _lm_batch,
    ),
    Arch(
        "falcon",
        "decoder",
        _decoder(
            "FalconConfig",
            "FalconForCausalLM",
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
        ),
        _lm_batch,
    ),
    Arch(
        "mixtral",
        "moe",
        _decoder(
            "MixtralConfig",
            "MixtralForCausalLM",
            num_local_experts=4,
            num_experts_per_tok=2,
            **_LLAMA_LIKE,
        ),
        _lm_batch,
        "mixture of experts (4 experts, top 2)",
    ),
    # --- encoder-only
    Arch(
        "bert",
        "encoder",
        _hf("BertConfig", "BertForMaskedLM", **_BERT_LIKE),
        _mlm_batch,
        "dropout 0.1 (its default), tied embeddings",
    ),
    Arch(
        "roberta",
        "encoder",
        _hf("RobertaConfig", "RobertaForMaskedLM", pad_token_id=0, **_BERT_LIKE),
        _mlm_batch,
        "dropout 0.1 (its default)",
    ),
    Arch(
        "distilbert",
        "encoder",
        _hf(
            "DistilBertConfig",
            "DistilBertForMaskedLM",
            vocab_size=VOCAB,
            dim=64,
            n_layers=2,
            n_heads=4,
            hidden_dim=128,
            max_position_embeddings=64,
        ),
        _mlm_batch,
        "dropout 0.1 (its default)",
    ),
    Arch(
        "albert",
        "encoder",
        _hf(
            "AlbertConfig",
            "AlbertForMaskedLM",
            vocab_size=VOCAB,
            embedding_size=32,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
        ),
        _mlm_batch,
        "one layer shared by 4 positions",
    ),
    Arch(
        "electra",
        "encoder",
        _hf("ElectraConfig", "ElectraForMaskedLM", embedding_size=32, **_BERT_LIKE),
        _mlm_batch,
        "dropout 0.1 (its default)",
    ),
    # --- encoder-decoder
    Arch(
        "t5",
        "encoder-decoder",
        _hf("T5Config", "T5ForConditionalGeneration", dropout_rate=0.0, **_T5),
        _seq2seq_batch,
        "relative position bias passed between blocks; use_cache on",
    ),
    Arch(
        "mt5",
        "encoder-decoder",
        _hf("MT5Config", "MT5ForConditionalGeneration", dropout_rate=0.1, **_T5),
        _seq2seq_batch,
        "dropout 0.1, untied head",
    ),
    Arch(
        "bart",
        "encoder-decoder",
        _hf("BartConfig", "BartForConditionalGeneration", dropout=0.1, **_BART_LIKE),
        _seq2seq_batch,
        "dropout 0.1",
    ),
    Arch(
        "pegasus",
        "encoder-decoder",
        _hf("PegasusConfig", "PegasusForConditionalGeneration", **_BART_LIKE),
        _seq2seq_batch,
    ),
    Arch(
        "whisper",
        "encoder-decoder",
        _whisper,
        _whisper_batch,
        "audio encoder (convolutions) + text decoder",
    ),
    # --- vision
    Arch(
        "vit",
        "vision",
        _hf(
            "ViTConfig",
            "ViTForImageClassification",
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            image_size=32,
            patch_size=8,
            num_labels=4,
        ),
        _image_batch,
    ),
    Arch(
        "resnet",
        "vision",
        _hf(
            "ResNetConfig",
            "ResNetForImageClassification",
            embedding_size=16,
            hidden_sizes=[16, 32],
            depths=[1, 1],
            num_labels=4,
        ),
        _image_batch,
        "batch norm",
    ),
    Arch(
        "convnext",
        "vision",
        _hf(
            "ConvNextConfig",
            "ConvNextForImageClassification",
            num_stages=2,
            hidden_sizes=[16, 32],
            depths=[1, 1],
            num_labels=4,
        ),
        _image_batch,
    ),
    # --- multimodal
    Arch("clip", "multimodal", _clip, _clip_batch, "text + vision towers, contrastive loss"),
)

BY_NAME = {a.name: a for a in ZOO}
MODES = ("conservative", "balanced")


def _loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return model(**batch).loss


def build(arch: Arch) -> nn.Module:
    torch.manual_seed(0)
    model = arch.build()
    model.train()
    return model


def check(arch: Arch, mode: str, sample: bool, steps: int = 3) -> dict[str, Any]:
    """Wrap a tiny ``arch`` in ``mode`` with ``force_optimize=True`` (with
    the batch as ``sample_input`` or profiled over one warm-up step) and
    train ``steps`` steps beside an unwrapped twin: every loss and every
    gradient must be bitwise equal, state_dict keys unchanged while
    wrapped, nothing left after detach.  Returns what the plan applied;
    raises AssertionError on the first difference."""
    model = build(arch)
    ref = copy.deepcopy(model)
    batch = arch.batch()
    keys = list(model.state_dict())
    hooks = hook_count(model)
    caches = [(c, getattr(c, "use_cache", None)) for c in _hf_cache.hf_configs(model)]
    config = memscale.Config(mode=mode, force_optimize=True, warmup_steps=1, enable_logging=False)
    memscale.wrap(model, config, sample_input=batch if sample else None)
    try:
        for step in range(steps):
            a = train_step(model, batch, seed=step, loss_fn=_loss)
            b = train_step(ref, batch, seed=step, loss_fn=_loss)
            assert torch.equal(a, b), f"step {step}: loss {a.item()!r} != {b.item()!r}"
            for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                if p.grad is None or q.grad is None:
                    assert p.grad is None and q.grad is None, f"step {step}: {name}"
                    continue
                assert torch.equal(p.grad, q.grad), (
                    f"step {step}: gradient of {name} differs by "
                    f"{(p.grad - q.grad).abs().max().item():.3g}"
                )
            assert list(model.state_dict()) == keys, "state_dict keys changed"
        plan = model._memscale_executor.plan
        counts = dict(plan.technique_counts)
        ineligible = sorted({layer.rule for layer in plan.layers if not layer.techniques})
    finally:
        memscale.detach(model)
    assert "_memscale_executor" not in model.__dict__
    assert hook_count(model) == hooks, "hooks left after detach"
    assert list(model.state_dict()) == keys
    for cfg, value in caches:
        assert getattr(cfg, "use_cache", None) == value, "use_cache not restored"
    for (name, t), (_, u) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(t, u), f"{name} differs from the twin after detach"
    return {"layers": len(plan.layers), "counts": counts, "ineligible": ineligible}
