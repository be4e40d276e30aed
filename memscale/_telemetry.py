"""Opt-in, anonymous, local telemetry: schema-v2 events in a JSON Lines file.

Off unless the user opts in, in one of two ways:

* ``memscale._telemetry.enable(path)`` (``disable()`` turns it off again;
  either one overrides the environment for the rest of the process);
* the environment: ``MEMSCALE_TELEMETRY=1`` and
  ``MEMSCALE_TELEMETRY_FILE=/some/file.jsonl``.  ``MEMSCALE_TELEMETRY=1``
  without a file writes nothing and logs a warning once.

Events are appended to that file, one JSON object a line.  A new file is
created with mode 0600; a symbolic link (or anything but a regular file)
at the path is refused, and the event dropped with a logged warning.  memscale never
sends them anywhere: there is no network code here, and nothing else reads
the file.  Emitting is wrapped so that it can never break ``wrap()``: any
error (an unwritable file, a bug) is logged once at WARNING (then at DEBUG)
and the event is dropped.

Schema version 2.  Every event has exactly these keys, and every value is
from a closed vocabulary (or a version number or a date), checked before
writing, so no path, module or class name, host name, user name or tensor
value can appear in one:

=====================  ==============================================================
key                    values
=====================  ==============================================================
schema                 2
event                  "wrap_called" (at wrap) or "plan_built" (when a plan made after
                       the warm-up steps is applied)
date                   UTC day, "YYYY-MM-DD"
memscale_version       e.g. "0.1.0"
torch_version          major.minor, e.g. "2.13"
python_version         major.minor, e.g. "3.11"
os                     "linux", "darwin", "windows" or "other"
device_type            "cpu", "cuda", "mps", "xpu" or "other"
device_count_bucket    "1", "2-4", "5-8", ">8"
device_memory_bucket   "<8GiB", "8-16GiB", "16-32GiB", "32-64GiB", "64-128GiB", ">=128GiB"
arch_class             "transformer", "cnn", "rnn", "mlp" or "other" (from module types)
param_bucket           "<1M", "1M-10M", "10M-100M", "100M-1B", "1B-10B", ">=10B"
layer_count_bucket     planning units: "0", "1-4", "5-16", "17-64", ">64"
mode                   the effective mode: "conservative", "balanced", "aggressive"
profiling              "static", "empirical", "warmup" or "first_step" (until planned)
planned                whether a plan exists yet (false while warming up)
techniques             techniques the plan applies, sorted, subset of
                       ["checkpoint", "offload", "tiling"]; null until planned
skipped                smart-skip (bool); null until planned
fits                   the projected peak fits the budget (bool); null until planned
pressure_bucket        "<0.5", "0.5-1", "1-1.5", "1.5-3", ">=3"; null until planned
auto_policy            bool
decision_source        "user_config", "ml", "rule_fallback", "rule"; null if pending
strategy               "as_configured", "conservative", "balanced", "aggressive"; null
                       if pending
metrics_enabled        observability_port is set (bool)
async_offload          bool
=====================  ==============================================================
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import platform
import re
import stat
import sys
import threading
from typing import Any

from .config import GIB

__all__ = [
    "ENV_ENABLE",
    "ENV_FILE",
    "SCHEMA",
    "SCHEMA_VERSION",
    "disable",
    "emit",
    "enable",
    "is_enabled",
    "sink_path",
]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2
ENV_ENABLE = "MEMSCALE_TELEMETRY"
ENV_FILE = "MEMSCALE_TELEMETRY_FILE"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

_BOOL = (True, False)
_OPT_BOOL = (True, False, None)
_VERSION = re.compile(r"^\d{1,4}\.\d{1,4}(\.\d{1,4})?$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_TECHNIQUES = ("checkpoint", "offload", "tiling")
_BYTES_BUCKETS = (
    (8, "<8GiB"),
    (16, "8-16GiB"),
    (32, "16-32GiB"),
    (64, "32-64GiB"),
    (128, "64-128GiB"),
)
_PARAM_BUCKETS = (
    (1e6, "<1M"),
    (1e7, "1M-10M"),
    (1e8, "10M-100M"),
    (1e9, "100M-1B"),
    (1e10, "1B-10B"),
)
_PRESSURE_BUCKETS = ((0.5, "<0.5"), (1.0, "0.5-1"), (1.5, "1-1.5"), (3.0, "1.5-3"))

# key -> allowed values (a tuple), or a compiled pattern for strings.
SCHEMA: dict[str, Any] = {
    "schema": (SCHEMA_VERSION,),
    "event": ("wrap_called", "plan_built"),
    "date": _DATE,
    "memscale_version": _VERSION,
    "torch_version": _VERSION,
    "python_version": _VERSION,
    "os": ("linux", "darwin", "windows", "other"),
    "device_type": ("cpu", "cuda", "mps", "xpu", "other"),
    "device_count_bucket": ("1", "2-4", "5-8", ">8"),
    "device_memory_bucket": tuple(b for _, b in _BYTES_BUCKETS) + (">=128GiB",),
    "arch_class": ("transformer", "cnn", "rnn", "mlp", "other"),
    "param_bucket": tuple(b for _, b in _PARAM_BUCKETS) + (">=10B",),
    "layer_count_bucket": ("0", "1-4", "5-16", "17-64", ">64"),
    "mode": ("conservative", "balanced", "aggressive"),
    "profiling": ("static", "empirical", "warmup", "first_step"),
    "planned": _BOOL,
    "techniques": "techniques",  # a sorted list, checked below
    "skipped": _OPT_BOOL,
    "fits": _OPT_BOOL,
    "pressure_bucket": tuple(b for _, b in _PRESSURE_BUCKETS) + (">=3", None),
    "auto_policy": _BOOL,
    "decision_source": ("user_config", "ml", "rule_fallback", "rule", None),
    "strategy": ("as_configured", "conservative", "balanced", "aggressive", None),
    "metrics_enabled": _BOOL,
    "async_offload": _BOOL,
}

_lock = threading.Lock()
_state: dict[str, Any] = {"explicit": None, "path": None}  # set by enable()/disable()
_warned: set[str] = set()


# --------------------------------------------------------------------------
# Opting in and out.


def enable(path: str | os.PathLike[str]) -> None:
    """Write telemetry events to the JSON Lines file ``path`` (appended;
    its directory must exist).  Overrides the environment."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(
            "memscale._telemetry.enable(path) needs a non-empty str or "
            f"os.PathLike path to a local file, got {path!r}"
        )
    with _lock:
        _state["explicit"] = True
        _state["path"] = os.fspath(path)


def disable() -> None:
    """Turn telemetry off for this process (overrides the environment)."""
    with _lock:
        _state["explicit"] = False
        _state["path"] = None


def _use_environment() -> None:
    """Forget enable()/disable(); the environment decides again (tests)."""
    with _lock:
        _state["explicit"] = None
        _state["path"] = None
        _warned.clear()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key in _warned:
        logger.debug(msg, *args)
        return
    _warned.add(key)
    logger.warning(msg, *args)


def sink_path() -> str | None:
    """The file events go to now, or None when telemetry is off."""
    with _lock:
        explicit, path = _state["explicit"], _state["path"]
    if explicit is not None:
        return path if explicit else None
    flag = os.environ.get(ENV_ENABLE, "").strip().lower()
    if flag in _FALSE:
        return None
    if flag not in _TRUE:
        _warn_once(
            "flag",
            "memscale telemetry: %s=%r is not one of 1/0 (true/false, "
            "yes/no, on/off); telemetry stays off",
            ENV_ENABLE,
            flag,
        )
        return None
    path = os.environ.get(ENV_FILE)
    if not path:
        _warn_once(
            "file",
            "memscale telemetry: %s=1 but %s is not set; no event is "
            "written (memscale never sends telemetry over the network)",
            ENV_ENABLE,
            ENV_FILE,
        )
        return None
    return path


def is_enabled() -> bool:
    return sink_path() is not None


# --------------------------------------------------------------------------
# Buckets (everything here is coarse on purpose).


def _bucket(value: float, buckets: tuple[tuple[float, str], ...], top: str) -> str:
    for limit, name in buckets:
        if value < limit:
            return name
    return top


def _count_bucket(n: int) -> str:
    return "1" if n <= 1 else "2-4" if n <= 4 else "5-8" if n <= 8 else ">8"


def _layer_bucket(n: int) -> str:
    if n == 0:
        return "0"
    return "1-4" if n <= 4 else "5-16" if n <= 16 else "17-64" if n <= 64 else ">64"


def _major_minor(version: str) -> str:
    match = re.match(r"(\d+)\.(\d+)", version)
    return f"{match.group(1)}.{match.group(2)}" if match else "0.0"


def _os() -> str:
    name = platform.system().lower()
    return name if name in ("linux", "darwin", "windows") else "other"


def arch_class(model: Any) -> str:
    """A coarse class from the module types alone (never their names)."""
    import torch.nn as nn

    attention = conv = rnn = linear = False
    for module in model.modules():
        kind = type(module).__name__.lower()
        if isinstance(module, nn.MultiheadAttention) or "attention" in kind:
            attention = True
        elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            conv = True
        elif isinstance(module, nn.RNNBase):
            rnn = True
        elif isinstance(module, nn.Linear):
            linear = True
    if attention:
        return "transformer"
    if conv:
        return "cnn"
    if rnn:
        return "rnn"
    return "mlp" if linear else "other"


def _param_count(model: Any) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


# --------------------------------------------------------------------------
# Events.


def _event(name: str, executor: Any, arch: str, params: int, plan: Any = None) -> dict[str, Any]:
    import torch

    from ._version import __version__

    config = executor.config
    hardware = executor.hardware
    if plan is None:
        plan = executor.plan
    decision = getattr(executor, "decision", None)
    device = hardware.device
    mode = plan.mode if plan is not None else config.mode.value
    event: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "event": name,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "memscale_version": __version__,
        "torch_version": _major_minor(torch.__version__),
        "python_version": f"{sys.version_info.major}.{sys.version_info.minor}",
        "os": _os(),
        "device_type": device if device in SCHEMA["device_type"] else "other",
        "device_count_bucket": _count_bucket(hardware.count),
        "device_memory_bucket": _bucket(hardware.capacity_bytes / GIB, _BYTES_BUCKETS, ">=128GiB"),
        "arch_class": arch,
        "param_bucket": _bucket(params, _PARAM_BUCKETS, ">=10B"),
        "layer_count_bucket": _layer_bucket(len(executor.layer_names)),
        "mode": mode,
        "profiling": str(executor.profiling),
        "planned": plan is not None,
        "techniques": (
            sorted(t for t, n in plan.technique_counts.items() if n) if plan is not None else None
        ),
        "skipped": bool(plan.skipped) if plan is not None else None,
        "fits": bool(plan.fits) if plan is not None else None,
        "pressure_bucket": (
            _bucket(plan.pressure, _PRESSURE_BUCKETS, ">=3") if plan is not None else None
        ),
        "auto_policy": bool(config.auto_policy),
        "decision_source": decision.decision_source if decision is not None else None,
        "strategy": decision.strategy if decision is not None else None,
        "metrics_enabled": config.observability_port is not None,
        "async_offload": bool(config.async_offload),
    }
    return event


def validate(event: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless ``event`` matches the schema exactly."""
    if set(event) != set(SCHEMA):
        raise ValueError(
            f"telemetry keys {sorted(set(event) ^ set(SCHEMA))} do not match the schema"
        )
    for key, allowed in SCHEMA.items():
        value = event[key]
        if allowed == "techniques":
            ok = value is None or (
                isinstance(value, list)
                and value == sorted(set(value))
                and all(v in _TECHNIQUES for v in value)
            )
        elif isinstance(allowed, re.Pattern):
            ok = isinstance(value, str) and bool(allowed.match(value))
        else:
            ok = any(value is a or (type(value) is type(a) and value == a) for a in allowed)
        if not ok:
            raise ValueError(f"telemetry field {key!r} has a value outside the schema")


# Appending, never through a symbolic link (one planted at the path must
# not redirect memscale's writes to another file), never blocking on a FIFO,
# and a new file readable by its owner only.
_OPEN_FLAGS = (
    os.O_WRONLY
    | os.O_APPEND
    | os.O_CREAT
    | os.O_NOFOLLOW
    | os.O_NONBLOCK
    | getattr(os, "O_CLOEXEC", 0)
)
FILE_MODE = 0o600


def _write(path: str, line: str) -> None:
    try:
        fd = os.open(path, _OPEN_FLAGS, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(
                exc.errno,
                f"{path} is a symbolic link, which memscale does not "
                "follow for its telemetry file; point it at a regular file",
            ) from None
        raise
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(
                errno.EINVAL,
                f"{path} is not a regular file; memscale appends telemetry to regular files only",
            )
        f.write(line)


def emit(event: dict[str, Any]) -> bool:
    """Validate and append ``event`` to the sink; True if written.  Never
    raises."""
    try:
        path = sink_path()
        if path is None:
            return False
        validate(event)
        line = json.dumps(event, sort_keys=True, separators=(",", ":")) + "\n"
        with _lock:
            _write(path, line)
        return True
    except Exception as exc:  # noqa: BLE001 - telemetry must never break wrap
        _warn_once(
            "emit", "memscale telemetry: an event was dropped (%s: %s)", type(exc).__name__, exc
        )
        return False


def _model_facts(model: Any) -> tuple[str, int]:
    return arch_class(model), _param_count(model)


def wrap_called(model: Any, executor: Any) -> None:
    """Emit ``wrap_called``; remembers the model's coarse facts on the
    executor for a later ``plan_built``.  Never raises."""
    try:
        if sink_path() is None:
            return
        arch, params = _model_facts(model)
        executor._telemetry_facts = (arch, params)
        emit(_event("wrap_called", executor, arch, params))
    except Exception as exc:  # noqa: BLE001
        _warn_once(
            "emit", "memscale telemetry: an event was dropped (%s: %s)", type(exc).__name__, exc
        )


def plan_built(executor: Any, plan: Any, model: Any = None) -> None:
    """Emit ``plan_built`` for ``plan``, made after the warm-up steps (the
    executor applies it right after).  Never raises."""
    try:
        if sink_path() is None:
            return
        facts = getattr(executor, "_telemetry_facts", None)
        if facts is None:
            if model is None:
                return
            facts = _model_facts(model)
        arch, params = facts
        emit(_event("plan_built", executor, arch, params, plan=plan))
    except Exception as exc:  # noqa: BLE001
        _warn_once(
            "emit", "memscale telemetry: an event was dropped (%s: %s)", type(exc).__name__, exc
        )
