"""The selective levels of a benchmark model's layers, as wrap profiles
them: per level, its threshold (FLOPs per byte), the bytes it keeps
besides the layer's input, what its recompute costs, and the calls its
recompute does not run (nothing saved reads their outputs).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python scripts/selective_levels.py \\
        [--model gpt2-12l]

Layers with the same levels are printed once, with their names.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import memscale
from memscale.benchmarks import runner

MIB = float(1 << 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-12l")
    args = parser.parse_args()
    logging.getLogger("memscale").setLevel(logging.ERROR)
    model, batch = runner.lookup(args.model).build(seed=0)
    memscale.wrap(
        model,
        memscale.Config(memory_budget_gb=1024.0, force_optimize=True, enable_logging=False),
        sample_input=batch.sample_input,
    )
    profile: Any = model._memscale_executor.profile  # type: ignore[union-attr]
    groups: dict[tuple, list[str]] = {}
    for layer, detail in zip(profile.layers, profile.details):
        levels = layer.selective_levels
        if levels is None:
            continue
        skips = dict(detail.get("skips", ()))
        key = (layer.flops, tuple((t, kept, cost, skips.get(t, ())) for t, kept, cost in levels))
        groups.setdefault(key, []).append(layer.name)
    memscale.detach(model)
    for (flops, levels), names in groups.items():
        print(f"{', '.join(names)}: forward {flops / 1e9:.2f} GFLOPs")
        print("| threshold (FLOPs per byte) | kept | recompute | not run |")
        print("| --- | --- | --- | --- |")
        for t, kept, cost, skip in levels:
            calls = ", ".join(f"call {nth + 1} of {name}" for name, nth in skip) or "-"
            print(f"| {t:g} | {kept / MIB:.2f} MiB | {cost / 1e9:.2f} GFLOPs | {calls} |")
        print()


if __name__ == "__main__":
    main()
