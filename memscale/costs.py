"""The budget planner's cost constants, measured once per machine.

``python -m memscale.costs`` times them on this machine (the matmul,
convolution and attention FLOP rates, the element rate of the ops without
a FLOP formula, the host and disk bandwidths, the cost of a module call)
and keeps them in a cache file named by the machine's fingerprint; every
later plan made on this machine uses them (``--show`` prints what is in
use).  See
docs/planning.md, "The cost model".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ._costs import DEFAULTS, UNITS, CostTable, cache_path, fingerprint, for_device, measure

__all__ = [
    "DEFAULTS",
    "UNITS",
    "CostTable",
    "cache_path",
    "fingerprint",
    "for_device",
    "main",
    "measure",
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m memscale.costs",
        description="Measure the budget planner's cost constants on this machine "
        "and keep them for every later plan made here.",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--index", type=int, default=0, help="CUDA device index")
    parser.add_argument("--disk-dir", default=None, help="where the disk tier writes")
    parser.add_argument(
        "--show", action="store_true", help="print the constants in use, measure nothing"
    )
    args = parser.parse_args(argv)
    before = for_device(args.device, args.index)
    if args.show:
        table = before
    else:
        table = measure(args.device, args.index, disk_dir=args.disk_dir, save=True)
    print(f"machine: {json.dumps(fingerprint(args.device, args.index), sort_keys=True)}")
    print(f"source: {table.source}")
    for name, value in table.constants().items():
        old = before.constants()[name]
        change = "" if args.show or old == value else f"   (was {old:.3g}, {before.source})"
        print(f"{name:>14}: {value:.3g} {UNITS[name]}{change}")
    conv, attention, element = table.weights()
    print(
        f"in matmul FLOPs: a convolution FLOP costs {conv:.3g}, an attention "
        f"FLOP {attention:.3g}, an element written {element:.3g}"
    )
    return 0


if __name__ == "__main__":  # exercised through a subprocess in tests/test_costs.py
    sys.exit(main())
