"""Attention over query tiles: the exact peak of one forward+backward of a
small GPT-2 (2 layers, hidden 32, 8 heads, eager attention) at batch 1 x
256 tokens, wrapped AGGRESSIVE (blocks checkpointed; batch 1 leaves nothing
to tile along the batch), with attention untiled and in 2, 4 and 8 query
tiles.

    .venv/bin/python scripts/attention_tiles_bench.py
"""

from __future__ import annotations

import logging
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import memscale  # noqa: E402
from memscale import _attention as attention  # noqa: E402
from memscale.benchmarks.measure import format_bytes, measure_peak  # noqa: E402


def build() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=8,
            vocab_size=128,
            n_positions=256,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
        )
    )
    model.config._attn_implementation = "eager"
    return model


def main() -> None:
    logging.getLogger("memscale").setLevel(logging.ERROR)
    ids = torch.randint(0, 128, (1, 256))
    config = memscale.Config(
        mode="aggressive", force_optimize=True, enable_offloading=False, enable_logging=False
    )
    real = attention.attach
    print("| query tiles | peak above the model |")
    print("| --- | --- |")
    try:
        for tiles in (1, 2, 4, 8):
            attention.attach = (
                (lambda ex, m, t, n=tiles: real(ex, m, n)) if tiles > 1 else (lambda *a: False)
            )
            model = build()
            memscale.wrap(model, config, sample_input={"input_ids": ids})

            def step(model: GPT2LMHeadModel = model) -> None:
                model(input_ids=ids, labels=ids).loss.backward()

            model.zero_grad(set_to_none=True)
            peak = measure_peak(step, model=model, inputs=(ids,), warmup=1)
            print(
                f"| {tiles if tiles > 1 else 'untiled'} | {format_bytes(peak.peak_delta_bytes)} |"
            )
            memscale.detach(model)
    finally:
        attention.attach = real


if __name__ == "__main__":
    main()
