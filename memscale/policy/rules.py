"""The rule-based Stage 1 policy: the documented pressure guidance.

Memory pressure is the engine's predicted unoptimized peak over the usable
memory.  The guidance memscale gives users (spec, "Modes"):

===============  ==============
pressure         strategy
===============  ==============
<= 1.0           conservative
(1.0, 1.5]       balanced
> 1.5            aggressive
===============  ==============

Above about 3x nothing may fit; the rule still picks aggressive (the most
memory it can free) and says that a smaller batch is the remedy.
"""

from __future__ import annotations

from ._types import StrategyContext

__all__ = ["RulePolicy"]


class RulePolicy:
    """Picks a strategy from the memory pressure alone; deterministic, and
    always available (the fallback of the trained policy)."""

    name = "rules"
    balanced_above = 1.0
    aggressive_above = 1.5
    smaller_batch_above = 3.0

    def choose(self, context: StrategyContext) -> tuple[str, str]:
        """Return ``(strategy name, reason)`` for a profiled ``context``."""
        pressure = context.features()["pressure"]
        if pressure <= self.balanced_above:
            return "conservative", f"pressure {pressure:.2f} <= {self.balanced_above:g}"
        if pressure <= self.aggressive_above:
            return "balanced", (
                f"pressure {pressure:.2f} in ({self.balanced_above:g}, {self.aggressive_above:g}]"
            )
        reason = f"pressure {pressure:.2f} > {self.aggressive_above:g}"
        if pressure > self.smaller_batch_above:
            reason += "; above about 3x consider a smaller batch as well"
        return "aggressive", reason
