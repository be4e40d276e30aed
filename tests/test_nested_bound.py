"""scripts/nested_bound.py: the two-level and nested (rotor) optima under
memscale's memory model, on chains small enough to check by hand."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "nested_bound.py"
_spec = importlib.util.spec_from_file_location("nested_bound", _PATH)
assert _spec is not None and _spec.loader is not None
nb = importlib.util.module_from_spec(_spec)
sys.modules["nested_bound"] = nb  # its dataclass looks itself up there
_spec.loader.exec_module(nb)


def _chain(n: int, saved: int, inp: int) -> object:
    return nb.Chain(
        saved=(saved,) * n,
        inputs=(inp,) * n,
        flops=(1.0,) * n,
        step_flops=3.0 * n,
        base=0,
        fixed=0,
    )


def test_three_layers_by_hand():
    # Three layers saving 10 bytes each (their input among them), inputs
    # of 1 byte.  Two levels: layers 0 and 1 each a segment, layer 2 kept:
    # 1 + 1 + 10 = 12 bytes at the end of the forward, 2 layer recomputes.
    chain = _chain(3, 10, 1)
    assert nb.least(chain, nested=False) == 12
    assert nb.optimum(chain, 12, nested=False) == 2.0
    assert nb.optimum(chain, 11, nested=False) == math.inf
    # Nested: layers 0..1 one segment, layer 2 kept (11 bytes at the end of
    # the forward); the segment's recompute runs layer 0 unsaved, then
    # layer 1 (its 10 bytes), then layer 0 again: 3 layer recomputes.
    assert nb.least(chain, nested=True) == 11
    assert nb.optimum(chain, 11, nested=True) == 3.0
    assert nb.optimum(chain, 10, nested=True) == math.inf
    # Everything kept: no recompute at 30 bytes.
    assert nb.optimum(chain, 30, nested=False) == 0.0


@pytest.mark.parametrize("n", [4, 7])
def test_nested_is_never_worse_and_reaches_lower(n):
    chain = _chain(n, 20, 3)
    low2, lown = nb.least(chain, False), nb.least(chain, True)
    assert lown < low2
    for budget in range(lown, 20 * n + 1, 7):
        assert nb.optimum(chain, budget, True) <= nb.optimum(chain, budget, False)
