"""The AutoTuner: which Config fits, and how large a batch.

``AutoTuner(model, sample_input, optimizer=None, budget_bytes=None)``
predicts a training step under each candidate Config with the OOM
predictor (:func:`memscale.predict_peak`, on fake tensors), picks the
cheapest one whose predicted peak fits (least predicted slowdown), and
confirms it with one measured step on the real model
(:func:`measure_step`), whose state is restored afterwards.
``AutoTuner.max_batch_size(make_input)`` finds the largest batch that fits
under a Config the same way.
"""

from .trial import measure_step
from .tuner import AutoTuner, BatchSizeResult, Choice, NoConfigFits, TuneResult

__all__ = ["AutoTuner", "BatchSizeResult", "Choice", "NoConfigFits", "TuneResult", "measure_step"]
