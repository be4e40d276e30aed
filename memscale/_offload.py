"""Activation offload: where checkpointed layers' inputs wait for backward.

The plan marks layers ``offload`` with a tier (``LayerPlan.tier``).  After
such a layer's forward the executor (C) hands each of its tensor inputs to
a tier and keeps only a record; the layer's recompute in backward reads
them back first.

- **disk** (``memscale._core.SpillStore``, C): a slot per tensor in one
  anonymous file (so one descriptor, however many tensors are spilled) in
  a private ``0700`` directory, created ``0600`` and unlinked at once; a
  slot's space is freed when its record is read back or dropped.  Synchronous
  stores write in the calling thread with the GIL released; asynchronous
  ones (``Config.async_offload``) write on a C thread, finish what is in
  flight at the end of the forward, and prefetch ``prefetch_depth`` layers
  ahead in backward.  On a host whose device is its own RAM (CPU
  training), disk is the first offload tier.
- **host** (``HostTier``, CUDA only): device tensors copied into a reusable
  pinned pool (one allocation; pageable memory beyond it), on a side
  stream when async, up to ``max_cpu_offload_gb``; beyond the cap they go
  on to disk if allowed, else stay on the device.  Unverified: this
  project's machines have no GPU.

``attach`` sets this up for a plan and registers the clean-up: on
``detach``, when the executor is garbage-collected, and at interpreter
exit the spill directory is removed, by the process that created it only
(a forked child that exits leaves its parent's directory alone).

``fork()``: before it, every live store waits for its I/O thread's jobs in
flight; in the child, the stores have no I/O thread and do their I/O
synchronously, in spill files of their own (``os.register_at_fork``).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from typing import Any

import torch

from . import _core
from ._hardware import Hardware
from ._solve import OffloadInputs
from .config import GIB, AsyncOffloadConfig, Config

logger = logging.getLogger(__name__)


def async_settings(config: Config) -> AsyncOffloadConfig:
    """The offload tuning in force (also for synchronous offload)."""
    return config.async_config if config.async_config is not None else AsyncOffloadConfig()


def disk_cap_bytes(config: Config) -> int | None:
    """Cap on spilled bytes, None for none (0: no disk tier)."""
    cap = async_settings(config).max_disk_gb
    return None if cap is None else int(cap * GIB)


def host_cap_bytes(config: Config) -> int:
    """Cap on host RAM for offload from a GPU, -1 for none."""
    if config.max_cpu_offload_gb is None:
        return -1
    return int(config.max_cpu_offload_gb * GIB)


def plan_inputs(config: Config, hardware: Hardware) -> OffloadInputs:
    """The engine's offload inputs: the tiers ``config`` allows on
    ``hardware``."""
    cap = disk_cap_bytes(config)
    return OffloadInputs(
        min_offload_bytes=async_settings(config).min_offload_bytes,
        host_tier=hardware.device not in ("cpu",),
        host_cap_bytes=host_cap_bytes(config),
        disk_tier=cap is None or cap > 0,
    )


def offloaded_bytes(plan: Any, tier: str) -> int:
    """Input bytes per step the plan sends to ``tier``."""
    return sum(layer.input_bytes for layer in plan.layers if layer.tier == tier)


def make_spill_dir(parent: str | None) -> str:
    try:
        return tempfile.mkdtemp(prefix="memscale-spill-", dir=parent)  # 0700
    except OSError as exc:
        where = parent if parent is not None else tempfile.gettempdir()
        raise ValueError(
            f"memscale offload: cannot create a private spill directory in "
            f"{where!r} ({exc.strerror or exc}). Give a writable directory: "
            "Config(async_config=AsyncOffloadConfig(spill_dir=...)), or turn "
            "the disk tier off with AsyncOffloadConfig(max_disk_gb=0)"
        ) from exc


def _check_free_space(path: str, need: int, cap: int | None) -> None:
    want = need if cap is None else min(need, cap)
    stat = os.statvfs(path)
    free = stat.f_bavail * stat.f_frsize
    if free < want:
        raise ValueError(
            f"memscale offload: the spill directory {path!r} has "
            f"{free / GIB:.2f} GiB free, and the plan spills up to "
            f"{want / GIB:.2f} GiB per step. Free space there, choose another "
            "directory (AsyncOffloadConfig(spill_dir=...)), or cap the disk "
            "tier (AsyncOffloadConfig(max_disk_gb=...); 0 turns it off)"
        )


def remove_dir(path: str, creator: int) -> None:
    # Only by the process that made it: a forked child's exit (its
    # finalizers run too) must not take the directory from its parent.
    # Files are unlinked when created, so the directory is normally empty.
    if os.getpid() == creator:
        shutil.rmtree(path, ignore_errors=True)


# Every live SpillStore of this process, for the fork hooks.
_STORES: weakref.WeakSet[Any] = weakref.WeakSet()


def register_store(store: Any) -> None:
    """Have ``store`` wait for its I/O before a fork and reset in the child."""
    _STORES.add(store)


def _before_fork() -> None:
    for store in list(_STORES):
        store._prepare_fork()


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._after_fork_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def log_event(level: str, message: str) -> None:
    logger.log(logging.WARNING if level == "warning" else logging.INFO, "%s", message)


def attach(executor: Any, config: Config, plan: Any) -> None:
    """Give ``executor`` the tiers ``plan`` uses; clean-up on detach, GC and
    exit.  Raises ``ValueError`` (and leaves nothing behind) when the disk
    tier is needed and unusable."""
    disk = offloaded_bytes(plan, "disk")
    host = offloaded_bytes(plan, "host")
    if not disk and not host:
        return
    settings = async_settings(config)
    cap = disk_cap_bytes(config)
    # The disk tier (also where the host tier spills beyond its cap).
    path = make_spill_dir(settings.spill_dir)
    creator = os.getpid()
    try:
        if disk:
            _check_free_space(path, disk, cap)
        store = _core.SpillStore(
            path,
            async_io=config.async_offload,
            min_bytes=settings.min_offload_bytes,
            max_bytes=-1 if cap is None else cap,
            prefetch_depth=settings.prefetch_depth,
            debug=settings.debug,
            log=log_event,
        )
    except BaseException:
        remove_dir(path, creator)
        raise
    register_store(store)
    finalizer = weakref.finalize(executor, remove_dir, path, creator)
    host_tier = None
    if host:
        host_tier = HostTier(
            pool_bytes=settings.pinned_pool_mb << 20,
            cap_bytes=host_cap_bytes(config),
            min_bytes=settings.min_offload_bytes,
            store=store,
            async_copy=config.async_offload,
        )
    executor.set_offload(store, host_tier)
    executor.offload_store = store
    executor.offload_host = host_tier

    def close() -> None:
        executor.set_offload(None, None)
        if store is not None:
            store.close()
        finalizer()  # removes the directory, once

    executor.on_detach(close)
    if config.enable_logging:
        logger.info(
            "memscale offload: %s, %s; spill directory %s (min tensor %d bytes, disk cap %s)%s",
            f"async (C I/O thread, prefetch depth {settings.prefetch_depth})"
            if config.async_offload
            else "sync",
            ", ".join(f"{n} layers -> {t}" for t, n in _tier_counts(plan).items()),
            path,
            settings.min_offload_bytes,
            "none" if cap is None else f"{cap} bytes",
            "; max_cpu_offload_gb does not apply: on this host the device is "
            "host RAM, so offload goes to disk"
            if config.max_cpu_offload_gb is not None and not host
            else "",
        )


def _tier_counts(plan: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for layer in plan.layers:
        if layer.tier != "device":
            counts[layer.tier] = counts.get(layer.tier, 0) + 1
    return counts


class _HostRecord:
    """A device tensor waiting in host memory (or on disk) for backward."""

    def __init__(
        self,
        tier: HostTier,
        host: Any,
        nbytes: int,
        in_pool: bool,
        device: torch.device,
        requires_grad: bool,
        event: Any,
    ) -> None:
        self._tier = tier
        self._host = host  # a CPU tensor, or a SpillStore record
        self._nbytes = nbytes
        self._in_pool = in_pool
        self._device = device
        self._requires_grad = requires_grad
        self._event = event

    def get(self) -> torch.Tensor:
        host = self._host
        if not isinstance(host, torch.Tensor):
            host = host.get()
        if self._event is not None:
            self._event.synchronize()
        out = host.to(self._device, non_blocking=False)
        return out.requires_grad_(self._requires_grad)

    def __del__(self) -> None:
        tier = getattr(self, "_tier", None)
        if tier is not None:
            tier._release(self._nbytes, self._in_pool)


def copy_out(t: torch.Tensor, dst: torch.Tensor, stream: Any) -> Any:
    """Copy ``t`` into the host tensor ``dst``: on a CUDA ``stream``, after
    the work queued on ``t``'s stream and without blocking (``t`` is kept
    until the copy is done), returning the event that marks its end; else
    at once, returning None."""
    if stream is None:
        dst.copy_(t.detach())
        return None
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        dst.copy_(t.detach(), non_blocking=True)
        t.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
    return event


class HostTier:
    """The host tier for device (CUDA) tensors: a reusable pinned pool, then
    pageable memory, up to ``cap_bytes`` (-1: none); beyond the cap, the
    disk tier (``store``) if there is one, else the tensor stays."""

    ALIGN = 512

    def __init__(
        self,
        pool_bytes: int,
        cap_bytes: int,
        min_bytes: int,
        store: Any,
        async_copy: bool,
        pin: bool | None = None,
    ) -> None:
        if pin is None:
            pin = torch.cuda.is_available()
        self.pool = (
            torch.empty(pool_bytes, dtype=torch.uint8, pin_memory=pin) if pool_bytes > 0 else None
        )
        self.cap_bytes = cap_bytes
        self.min_bytes = min_bytes
        self.store = store
        self.stream = torch.cuda.Stream() if async_copy and torch.cuda.is_available() else None
        self.used = 0  # host bytes held by live records
        self._pool_offset = 0  # bump allocation; reset when the pool empties
        self._pool_live = 0
        self.stats = {"to_pool": 0, "to_pageable": 0, "to_disk": 0, "kept": 0}
        self.bytes_to_host = 0  # counted over the tier's life
        self._warned = False

    def put(self, t: torch.Tensor) -> _HostRecord | None:
        if t.device.type == "cpu" or t.grad_fn is None or not t.is_contiguous():
            return None
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or nbytes == 0:
            return None
        return self._put_host(t, nbytes)

    def _put_host(self, t: torch.Tensor, nbytes: int) -> _HostRecord | None:
        if self.cap_bytes >= 0 and self.used + nbytes > self.cap_bytes:
            return self._spill(t, nbytes)
        start = self._pool_offset
        if self.pool is not None and start + nbytes <= self.pool.numel():
            dst = self.pool[start : start + nbytes].view(t.dtype).view(t.shape)
            self._pool_offset = -(-(start + nbytes) // self.ALIGN) * self.ALIGN
            self._pool_live += 1
            in_pool = True
            self.stats["to_pool"] += 1
        else:
            dst = torch.empty(t.shape, dtype=t.dtype)
            in_pool = False
            self.stats["to_pageable"] += 1
        event = copy_out(t, dst, self.stream)
        self.used += nbytes
        self.bytes_to_host += nbytes
        return _HostRecord(self, dst, nbytes, in_pool, t.device, t.requires_grad, event)

    def _spill(self, t: torch.Tensor, nbytes: int) -> _HostRecord | None:
        rec = None
        if self.store is not None:
            rec = self.store.put_copy(t.detach().to("cpu"))
        if rec is None:
            self.stats["kept"] += 1
            if not self._warned:
                self._warned = True
                logger.info(
                    "memscale offload: max_cpu_offload_gb (%d bytes) is "
                    "reached%s; further tensors stay on the device",
                    self.cap_bytes,
                    "" if self.store is None else " and the disk tier refused",
                )
            return None
        self.stats["to_disk"] += 1
        return _HostRecord(self, rec, 0, False, t.device, t.requires_grad, None)

    def _release(self, nbytes: int, in_pool: bool) -> None:
        self.used -= nbytes
        if in_pool:
            self._pool_live -= 1
            if self._pool_live == 0:
                self._pool_offset = 0


def spillable_bytes(t: torch.Tensor, min_bytes: int) -> int:
    """The bytes the disk tier would take for ``t``, 0 if it keeps it: the
    rule of SpillStore.put (an activation, contiguous, owning its storage,
    at least ``min_bytes``)."""
    if t.grad_fn is None or not t.is_contiguous():
        return 0
    nbytes = t.numel() * t.element_size()
    if nbytes == 0 or nbytes < min_bytes or t.untyped_storage().nbytes() > nbytes:
        return 0
    return nbytes


class _SimulatedRecord:
    def __init__(self, tier: SimulatedTier, t: torch.Tensor) -> None:
        self._tier = tier
        self._proto = t.new_empty((0,))  # same tensor kind (fake), no bytes
        self._layout = (tuple(t.shape), t.stride(), t.requires_grad)
        self.tensor: torch.Tensor | None = None  # once read back (or prefetched)
        self.got = False

    def load(self) -> None:
        if self.tensor is None:
            shape, stride, requires_grad = self._layout
            out = self._proto.new_empty_strided(shape, stride)
            self.tensor = out.requires_grad_(requires_grad)

    def get(self) -> torch.Tensor:
        self.load()
        self.got = True
        self._tier._prefetch_before(self)
        assert self.tensor is not None
        return self.tensor


class SimulatedTier:
    """What offload does to memory, for the predictor's fake tensors: the
    same tensors leave (the executor drops them) and come back as new ones
    of the same layout when the layer is recomputed, with the async
    store's prefetch (the ``prefetch_depth`` records put before, read as
    the record is); no bytes are moved."""

    def __init__(self, min_bytes: int, prefetch_depth: int = 0) -> None:
        self.min_bytes = min_bytes
        self.prefetch_depth = prefetch_depth
        self.bytes_offloaded = 0
        self._order: list[weakref.ref[_SimulatedRecord]] = []

    def put(self, t: torch.Tensor) -> _SimulatedRecord | None:
        nbytes = spillable_bytes(t, self.min_bytes)
        if not nbytes:
            return None
        self.bytes_offloaded += nbytes
        record = _SimulatedRecord(self, t)
        self._order.append(weakref.ref(record))
        return record

    def _prefetch_before(self, record: _SimulatedRecord) -> None:
        """The rule of the C store's prefetch: walking back from ``record``,
        start reading records still on disk, counting those being read,
        until ``prefetch_depth`` are."""
        if self.prefetch_depth <= 0:
            return
        alive = [r() for r in self._order]
        at = next((i for i, r in enumerate(alive) if r is record), None)
        if at is None:
            return
        counted = 0
        for earlier in reversed(alive[:at]):
            if counted >= self.prefetch_depth:
                break
            if earlier is None or earlier.got:
                continue
            earlier.load()
            counted += 1
