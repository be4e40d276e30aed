"""Activation tiling's public names.

:func:`declare_row_independent` tells memscale that a module, or every
module of a class, computes each output row from its input row alone, so
that it may run in tiles without being checked first; :func:`is_candidate`
says whether a layer may be tiled at all (see docs/tiling.md).  The
implementation is the internal ``memscale._tiling``.
"""

from ._tiling import declare_row_independent, is_candidate

__all__ = ["declare_row_independent", "is_candidate"]
