"""The benchmark suite's measuring tools.

They live in the library (``memscale._measure``: the predictor and the
AutoTuner measure with them at ``wrap`` time; ``memscale._format`` writes
sizes); this module is their public name for the suite, the scripts and
users.
"""

from .._format import format_bytes
from .._measure import (
    MemoryReport,
    TimeReport,
    live_storage_bytes,
    measure_peak,
    peak_rss_subprocess,
    time_ratio,
)

__all__ = [
    "MemoryReport",
    "TimeReport",
    "format_bytes",
    "live_storage_bytes",
    "measure_peak",
    "peak_rss_subprocess",
    "time_ratio",
]
