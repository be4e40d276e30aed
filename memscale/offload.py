"""Activation offload's public names.

``HostTier`` is the host tier of offload: a GPU's host RAM, a reusable
pinned pool where checkpointed layers' inputs wait for backward (see
docs/offload.md).  memscale creates and attaches it itself when a plan
offloads to the host; the implementation, with the disk tier, is the
internal ``memscale._offload``.
"""

from ._offload import HostTier

__all__ = ["HostTier"]
