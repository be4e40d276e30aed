"""The budget planner's cost constants, measured once per machine (the
public face is :mod:`memscale.costs`).

The planner weighs recomputation against offloading with constants per
device: the rate of the FLOPs its profile counts per class of op (matrix
products, convolutions, attention kernels: what ``torch.utils.flop_counter``
has a formula for), the rate of the ops without a formula in elements
written per second (pointwise ops, norms, softmax), the bandwidth of a copy
to pinned host memory and back, the bandwidth of the disk tier, and the
cost of one more module call (a tile).  Without a measurement the planner
uses :data:`DEFAULTS`, fixed per device type, where convolutions and
attention run at the matmul rate and an element costs one matmul FLOP
(``CostTable.weights``: what the planner charged before it measured
them).

``python -m memscale.costs`` (or :func:`measure` with ``save=True``) times
them on this machine and stores them in a cache file named by a
fingerprint of the machine: the device's name, torch's version and, on a
CPU, the number of threads torch computes with.  From then on every plan
made on a machine with that fingerprint uses the measured constants.  The
planner never times anything itself, so a given machine, cache and Config
always give the same plan.

The cache lives in ``$MEMSCALE_CACHE_DIR``, else
``$XDG_CACHE_HOME/memscale``, else ``~/.cache/memscale``.  Set
``MEMSCALE_COSTS=default`` to plan with the defaults even where a
measurement exists.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import sdpa_flop_count

from . import _torch_compat
from ._version import __version__

logger = logging.getLogger(__name__)

__all__ = ["DEFAULTS", "UNITS", "CostTable", "cache_path", "fingerprint", "for_device", "measure"]


@dataclass(frozen=True, slots=True)
class CostTable:
    """The planner's constants for one device.  ``host_bw`` is 0 where
    there is no host tier (a CPU model's memory already is host memory).
    The rates of convolutions, attention and elements default to
    ``flop_rate`` (None: not measured)."""

    flop_rate: float  # counted FLOPs per second of a matrix product
    host_bw: float  # bytes per second, device -> pinned host -> device
    disk_bw: float  # bytes per second, written and read back through a file
    tile_overhead: float  # seconds per extra module call
    conv_rate: float | None = None  # counted FLOPs per second of a convolution
    attention_rate: float | None = None  # ... of scaled_dot_product_attention's kernels
    element_rate: float | None = None  # elements per second an op without a formula writes
    source: str = "default"  # "default", or the cache file it was read from

    def __post_init__(self) -> None:
        for name in _CLASS_RATES:
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.flop_rate)
        for f in fields(self):
            if f.name == "source":
                continue
            value = getattr(self, f.name)
            floor_ok = value >= 0 if f.name == "host_bw" else value > 0
            if not isinstance(value, float) or not math.isfinite(value) or not floor_ok:
                raise ValueError(
                    f"CostTable.{f.name} must be a finite float "
                    f"{'>= 0' if f.name == 'host_bw' else '> 0'}, got {value!r}"
                )

    def constants(self) -> dict[str, float]:
        """The constants, without where they came from."""
        return {k: v for k, v in asdict(self).items() if k != "source"}

    def weights(self) -> tuple[float, float, float]:
        """What a convolution FLOP, an attention FLOP and an element an op
        without a FLOP formula writes cost in matmul FLOPs (flop_rate over
        each rate): the planner's recompute costs are in matmul FLOPs.
        (1.0, 1.0, 1.0) with the default rates."""
        return (
            self.flop_rate / float(self.conv_rate or self.flop_rate),
            self.flop_rate / float(self.attention_rate or self.flop_rate),
            self.flop_rate / float(self.element_rate or self.flop_rate),
        )


# The rates per class of op: optional in a cache file (one written before
# they were measured stays valid: they are flop_rate's then).
_CLASS_RATES = ("conv_rate", "attention_rate", "element_rate")

# What each constant is measured in (``python -m memscale.costs`` shows it).
UNITS = {
    "flop_rate": "FLOP/s",
    "conv_rate": "FLOP/s",
    "attention_rate": "FLOP/s",
    "element_rate": "elements/s",
    "host_bw": "bytes/s",
    "disk_bw": "bytes/s",
    "tile_overhead": "s/call",
}


# The CPU row is this project's 2-core test machine in float32; the CUDA
# row an Ampere-class GPU on PCIe 4 (until measured).  Only their ratios
# matter to the planner: what one recomputed FLOP costs against one
# offloaded byte.
DEFAULTS: dict[str, CostTable] = {
    "cpu": CostTable(flop_rate=5e10, host_bw=0.0, disk_bw=7e8, tile_overhead=3e-5),
    "cuda": CostTable(flop_rate=3e13, host_bw=1.2e10, disk_bw=2e9, tile_overhead=1e-4),
}


def _default(device_type: str) -> CostTable:
    return DEFAULTS.get(device_type, DEFAULTS["cuda"])


@functools.cache
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def fingerprint(device_type: str, index: int = 0) -> dict[str, Any]:
    """What identifies this machine's costs for ``device_type``: the
    device's name and count of cores or threads, and torch's version."""
    fp: dict[str, Any] = {"device": device_type, "torch": torch.__version__}
    if device_type == "cuda":
        fp["name"] = torch.cuda.get_device_name(index)
        fp["cuda"] = torch.version.cuda
    elif device_type == "cpu":
        fp["name"] = _cpu_name()
        fp["threads"] = torch.get_num_threads()
    else:
        raise ValueError(f"memscale measures costs on 'cpu' or 'cuda', not {device_type!r}")
    return fp


def _key(fp: dict[str, Any]) -> str:
    text = json.dumps(fp, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cache_dir() -> Path:
    explicit = os.environ.get("MEMSCALE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "memscale"


def cache_path(device_type: str, index: int = 0) -> Path:
    """The file this machine's measured costs for ``device_type`` are
    kept in (it may not exist)."""
    return _cache_dir() / f"costs-{device_type}-{_key(fingerprint(device_type, index))}.json"


# Cache files already found unreadable (warned about once each).
_BAD: set[str] = set()


def for_device(device_type: str, index: int = 0) -> CostTable:
    """The constants the planner uses for ``device_type`` on this machine:
    the measured ones when this machine's cache file exists, else
    :data:`DEFAULTS`."""
    if os.environ.get("MEMSCALE_COSTS", "").lower() == "default":
        return _default(device_type)
    if device_type not in DEFAULTS or (device_type == "cuda" and not torch.cuda.is_available()):
        return _default(device_type)
    path = cache_path(device_type, index)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return _default(device_type)
    except OSError as e:
        return _unreadable(path, device_type, str(e))
    try:
        data = json.loads(text)
        if data.get("fingerprint") != fingerprint(device_type, index):
            raise ValueError("its fingerprint is another machine's")
        table = CostTable(**_read_constants(data["costs"]), source=str(path))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return _unreadable(path, device_type, str(e))
    return table


def _unreadable(path: Path, device_type: str, why: str) -> CostTable:
    if str(path) not in _BAD:
        _BAD.add(str(path))
        logger.warning(
            "memscale: ignoring the cost cache %s (%s); planning with the default "
            "costs. Run python -m memscale.costs to measure them again",
            path,
            why,
        )
    return _default(device_type)


_CONSTANTS = tuple(f.name for f in fields(CostTable) if f.name != "source")


def _read_constants(raw: Any) -> dict[str, float]:
    """The constants of a cache file's ``costs`` record: each a number; the
    rates per class of op may be missing (flop_rate's then)."""
    if not isinstance(raw, dict):
        raise TypeError(f"its costs are not a record: {raw!r}")
    out: dict[str, float] = {}
    for name in _CONSTANTS:
        if name not in raw:
            if name in _CLASS_RATES:
                continue
            raise KeyError(f"it has no {name}")
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"CostTable.{name} must be a number, got {value!r}")
        out[name] = float(value)
    return out


def _round(value: float) -> float:
    """Two significant digits: a second measurement on the same machine
    usually gives the same constants, so the same plans."""
    if value <= 0:
        return 0.0
    return float(f"{value:.2g}")


def _best_seconds(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    sync()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _flop_rate(device: torch.device, sync: Callable[[], None]) -> float:
    n = 1024 if device.type == "cpu" else 4096
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    seconds = _best_seconds(lambda: torch.mm(a, b), sync, 5)
    return 2.0 * n**3 / seconds


def _host_bw(device: torch.device, sync: Callable[[], None]) -> float:
    if device.type != "cuda":
        return 0.0
    nbytes = 256 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def round_trip() -> None:
        host.copy_(src, non_blocking=True)
        src.copy_(host, non_blocking=True)

    return 2.0 * nbytes / _best_seconds(round_trip, sync, 3)


def _disk_bw(directory: str | None, nbytes: int = 64 << 20) -> float:
    """Bytes per second written (to the disk, not the page cache) and read
    back from a temporary file in ``directory``."""
    data = os.urandom(1 << 20) * (nbytes >> 20)
    fd, name = tempfile.mkstemp(prefix="memscale-costs-", dir=directory)
    try:
        t0 = time.perf_counter()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        written = time.perf_counter() - t0
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            chunk = os.read(fd, min(left, 8 << 20))
            if not chunk:
                raise OSError(f"{name} was cut short while memscale read it back")
            left -= len(chunk)
        read = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(name)
    return 2.0 * nbytes / (written + read)


# Each op class's timing is the best of this many runs (each takes about
# 10 ms on a CPU): on a loaded machine fewer let another process's turn
# into every run.
_CLASS_REPEATS = 15


def _counted_flops(fn: Callable[[], object]) -> float:
    """The FLOPs ``torch.utils.flop_counter`` counts for ``fn()`` (what the
    planner's profile counts for the same op)."""
    with _torch_compat.flop_counter() as counter:
        fn()
    return float(counter.get_total_flops())


def _conv_rate(device: torch.device, sync: Callable[[], None]) -> float:
    """A 3x3 convolution, 64 channels in and out, padded (a ResNet
    stage's)."""
    batch, side = (8, 32) if device.type == "cpu" else (32, 56)
    x = torch.randn(batch, 64, side, side, device=device)
    w = torch.randn(64, 64, 3, 3, device=device)

    def conv() -> object:
        return torch.nn.functional.conv2d(x, w, padding=1)

    return _counted_flops(conv) / _best_seconds(conv, sync, _CLASS_REPEATS)


def _attention_rate(device: torch.device, sync: Callable[[], None]) -> float:
    """``scaled_dot_product_attention``, 8 heads of 64 over 256 positions
    (1024 on a GPU), causal, through whichever kernel torch picks.  Its
    FLOPs are torch's formula for the kernels it has one for; on a CPU,
    whose kernel it counts none for, the same formula (two matrix products
    per head)."""
    batch, seq = (4, 256) if device.type == "cpu" else (8, 1024)
    q, k, v = (torch.randn(batch, 8, seq, 64, device=device) for _ in range(3))

    def attention() -> object:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    flops = _counted_flops(attention) or float(sdpa_flop_count(q.shape, k.shape, v.shape))
    return flops / _best_seconds(attention, sync, _CLASS_REPEATS)


# The element rate's chain: five ops without a FLOP formula, each writing
# one tensor the size of its input.
ELEMENT_CHAIN_OPS = 5


def _element_chain(x: torch.Tensor) -> torch.Tensor:
    y = torch.nn.functional.gelu(x)
    y = torch.softmax(y, dim=-1)
    y = y * x
    y = y + x
    return torch.tanh(y)


def _element_rate(device: torch.device, sync: Callable[[], None]) -> float:
    """Elements written per second by ops without a FLOP formula (what the
    planner charges per element): the chain above, on 2**21 elements
    (2**26 on a GPU) in rows of 1024."""
    x = torch.randn((1 << 21 if device.type == "cpu" else 1 << 26) // 1024, 1024, device=device)
    written = ELEMENT_CHAIN_OPS * x.numel()
    return written / _best_seconds(lambda: _element_chain(x), sync, _CLASS_REPEATS)


def _tile_overhead(device: torch.device, sync: Callable[[], None]) -> float:
    layer = torch.nn.Linear(8, 8).to(device)
    x = torch.randn(1, 8, device=device)
    calls = 200

    def many() -> None:
        with torch.no_grad():
            for _ in range(calls):
                layer(x)

    return _best_seconds(many, sync, 3) / calls


def measure(
    device_type: str = "cpu",
    index: int = 0,
    *,
    disk_dir: str | None = None,
    save: bool = False,
) -> CostTable:
    """Time the planner's constants for ``device_type`` on this machine
    (a few seconds on a CPU) and, with ``save=True``, keep them for every
    later plan on this machine (see :func:`cache_path`).  ``disk_dir`` is
    where the disk tier writes (``Config.spill_dir``; default: the system's
    temporary directory)."""
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "memscale.costs.measure('cuda'): torch.cuda.is_available() is False on this machine"
        )
    fp = fingerprint(device_type, index)  # also refuses other device types
    device = torch.device(device_type, index) if device_type == "cuda" else torch.device("cpu")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    values = {
        "flop_rate": _flop_rate(device, sync),
        "host_bw": _host_bw(device, sync),
        "disk_bw": _disk_bw(disk_dir),
        "tile_overhead": _tile_overhead(device, sync),
        "conv_rate": _conv_rate(device, sync),
        "attention_rate": _attention_rate(device, sync),
        "element_rate": _element_rate(device, sync),
    }
    table = CostTable(**{k: _round(v) for k, v in values.items()}, source="measured")
    if save:
        path = cache_path(device_type, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "fingerprint": fp,
            "costs": table.constants(),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "memscale": __version__,
        }
        # Written whole, then renamed: a reader never sees half a file.
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=2, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        _BAD.discard(str(path))
        table = CostTable(**table.constants(), source=str(path))
    return table
