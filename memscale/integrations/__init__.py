"""Adapters for training frameworks.

- :mod:`memscale.integrations.hf`: ``MemScaleCallback`` for the Hugging Face
  ``transformers.Trainer`` (also what ``memscale.wrap(trainer)`` adds).
- :mod:`memscale.integrations.lightning`: ``MemScaleCallback`` for a
  PyTorch Lightning ``Trainer`` (``lightning`` or ``pytorch_lightning``).

Importing this package imports neither framework; each submodule imports
its framework when it is imported itself, and raises an ``ImportError``
naming the extra to install (``memscale[hf]``, ``memscale[lightning]``)
when the framework is missing.  What both share is in ``_common``.
"""

from __future__ import annotations

__all__: list[str] = []
