"""How memscale writes sizes and plans for people: byte counts in binary
units, and the per-layer plan table of the log and of
``Executor.describe()``.

A leaf: the standard library only, so that every module (the planner, the
executor, the predictor, the benchmark suite) can format without importing
another part of memscale.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["format_bytes", "plan_table"]

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: int | float, digits: int = 2) -> str:
    """Human-readable size in binary units.

    Below 1 KiB the exact count: ``"0 B"``, ``"1000 B"``.  Above, ``digits``
    decimals without trailing zeros but at least one: ``"1.5 KiB"``,
    ``"512.0 MiB"``, ``"1.25 GiB"`` (``digits=1``, as memscale's log and
    messages write sizes: ``"1.2 GiB"``).  Negative sizes keep their sign:
    ``"-2.0 MiB"``.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise TypeError(f"n must be a number of bytes, got {type(n).__name__}: {n!r}")
    if not math.isfinite(n):
        raise ValueError(f"n must be finite, got {n}")
    if isinstance(digits, bool) or not isinstance(digits, int) or digits < 1:
        raise ValueError(f"digits must be an int >= 1, got {digits!r}")
    sign = "-" if n < 0 else ""
    value = abs(n)
    if value < 1024:
        if float(value).is_integer():
            return f"{sign}{int(value)} B"
        return f"{sign}{value:.{digits}f} B"
    unit_index = 0
    while unit_index < len(_BINARY_UNITS) - 1 and round(value, digits) >= 1024:
        value /= 1024
        unit_index += 1
    text = f"{value:.{digits}f}".rstrip("0")
    if text.endswith("."):
        text += "0"
    return f"{sign}{text} {_BINARY_UNITS[unit_index]}"


def _size(n: float) -> str:
    return format_bytes(n, digits=1)


def plan_table(plan: Any) -> str:
    """The plan as the log shows it at DEBUG: a header, then one row per
    layer.  ``segment`` names the first layer of the checkpoint segment a
    layer is recomputed with (itself when recomputed alone, "(nested)"
    after it when that segment is nested), "-" when it is not
    recomputed."""
    names = [layer.name for layer in plan.layers]
    rows = [("layer", "kind", "technique", "segment", "tier", "bytes saved", "rule")]
    for layer in plan.layers:
        technique = "+".join(layer.techniques) or "-"
        if layer.tiles > 1:
            technique += f" x{layer.tiles}"
        segment = names[layer.segment] if 0 <= layer.segment < len(names) else "-"
        if layer.nested:
            segment += " (nested)"
        rows.append(
            (
                layer.name,
                layer.kind,
                technique,
                segment,
                layer.tier,
                _size(layer.bytes_saved),
                layer.rule,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        f"memscale plan {plan.hash[:12]}: mode={plan.mode} device={plan.device} "
        f"budget={_size(plan.budget_bytes)} "
        f"peak {_size(plan.peak_unoptimized_bytes)} -> "
        f"{_size(plan.peak_projected_bytes)} "
        f"(pressure {plan.pressure:.2f}, recompute {plan.recompute_ratio:.0%} "
        f"of forward){' [smart-skip]' if plan.skipped else ''}"
    ]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return "\n".join(lines)
