"""The OOM predictor: the peak memory of one training step, before it runs.

A simulation runs one whole training step --
``zero_grad(set_to_none=True)``, forward, loss, backward and the optimizer
step -- on fake tensors (``torch._subclasses.FakeTensorMode``, reached
through :mod:`memscale._torch_compat`): every tensor has its shape, dtype,
strides and device, and no memory.  A dispatch mode below autograd sees
every operator, registers the storage of each tensor an operator returns
(views share one, so a storage counts once) and hears, through a weak
reference, the moment the storage is freed.  The running sum of those
events is the live tensor memory of the step, as the allocator sees it,
and its maximum is the predicted peak.  The plan the step runs under is
made by ``memscale._planner``, which also holds ``predict_peak`` and the
calibration of the engine on these peaks.

How a step is simulated:

* Warm-up, untracked: the forward runs under the C profiler on all-fake
  inputs, exactly as ``wrap()``'s static profiling does, so the plan made
  from it is the plan ``wrap`` makes; a zero gradient for every parameter
  the loss reaches and one optimizer step create the optimizer state, as
  in a steady-state step.
* The unoptimized step, tracked from the state a steady-state step starts
  in (parameters, buffers, gradients, optimizer state, inputs).
* The step under the plan, tracked, with the real C executor attached to
  the model: checkpointed layers are really recomputed in backward, on
  fake tensors.  The RNG state each checkpoint frame keeps (a real tensor
  made outside any operator) is stood in for by a fake tensor of its size.

Three things a pure fake step would get wrong are handled:

* Model code that branches on tensor values (Hugging Face attention masks
  check the position ids): small integer inputs stay real, and operators
  whose arguments are all real run for real when their result is small
  (``REAL_VALUE_LIMIT``), so the branch a real step takes is taken.
* Kernels that keep scratch memory inside one operator call (oneDNN
  convolutions) or return a storage larger than their result (CPU
  ``mse_loss`` returns its elementwise buffer): each distinct call of the
  operators in ``_WORKSPACE_OPS`` is run once for real on zero-filled
  tensors under the memory profiler, and what it really allocates is put
  into the event sequence (CPU only; ``PROBE_LIMIT``).
* Python's garbage collector is off during a tracked step, so frees happen
  at refcount zero only and the figure is the same every run.

What the prediction counts is what ``memscale._measure``
measures: the bytes of live tensor storages.  Not counted: memory that is
not a tensor, scratch memory of kernels outside ``_WORKSPACE_OPS``, and on
CUDA the caching allocator's rounding and reserve.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import logging
import math
import numbers
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from . import _core, _hf_cache, _model, _torch_compat, _verify
from ._format import format_bytes
from .config import GIB, Config

logger = logging.getLogger(__name__)

__all__ = [
    "DeviceSpec",
    "PeakBreakdown",
    "PeakPrediction",
    "SavingsEstimate",
    "SimulationSession",
    "default_loss",
    "predicted_time_ratio",
    "rebuild_optimizer",
    "resolve_device",
]

# Categories of the breakdown, in the order they are printed.
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "inputs", "workspace")
_CATEGORY_HELP = {
    "parameters": "parameters + buffers",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "inputs": "inputs",
    "workspace": "transient workspace",
}
PHASES = ("start", "forward", "backward", "optimizer")
_EQUAL = torch.ops.aten.equal.default
_MISSING = object()
# Tensors up to this size that are not floating point (token ids, masks,
# positions) keep real values in the simulated step, and operators whose
# tensor arguments are all real run for real when their result is this
# small, so that model code that branches on such values takes the branch
# a real step takes.  Everything else is fake.
REAL_VALUE_LIMIT = 8 << 20

# CPU kernels that allocate scratch memory of their own inside one operator
# call (oneDNN convolutions reorder activations into blocked layouts; some
# losses and normalizations build an input-sized temporary).  A fake
# tensor cannot show it, so each distinct call (operator, shapes, strides,
# dtypes, arguments) is run once for real on zero-filled tensors: the
# allocator's peak inside it, minus what it returns, is added at that point
# of the step, and what it returns counts at its real storage size (CPU
# mse_loss returns a scalar whose storage is its whole elementwise buffer).
# Measured on torch 2.13 CPU: the other operators of the benchmark and test
# models allocate nothing of their own above a few bytes.
_WORKSPACE_OPS = (
    "convolution.default",
    "convolution_backward.default",
    "native_batch_norm_backward.default",
    "native_group_norm_backward.default",
    "max_pool2d_with_indices_backward.default",
    "upsample_nearest2d.default",
    "upsample_nearest2d_backward.default",
    "upsample_bilinear2d.default",
    "upsample_bilinear2d_backward.default",
    "mse_loss.default",
    "smooth_l1_loss.default",
    "huber_loss.default",
    "binary_cross_entropy.default",
    "binary_cross_entropy_with_logits.default",
    "_safe_softmax.default",
    "embedding_dense_backward.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
    "_scaled_dot_product_flash_attention_for_cpu_backward.default",
)
# A call is run for real only if its inputs and outputs take at most this
# many bytes (and at most 1/8 of the device's capacity); larger ones are not
# probed, and PeakPrediction.unprobed_calls counts them.
PROBE_LIMIT = 256 << 20


# --------------------------------------------------------------------------
# The device a prediction is for
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """A device to predict for, given by hand: for a device this machine does
    not have (``DeviceSpec("cuda", capacity_bytes=24 * 2**30)``), or to
    override the detected capacity.  The step is simulated with fake tensors
    on ``type`` ("cpu" or "cuda"), so kernels and optimizer defaults are the
    ones torch picks for that device type; without a CUDA runtime here, a
    "cuda" target is simulated with CPU kernels (and the optimizer's
    CUDA defaults), against its capacity.
    """

    # Device type: "cpu" or "cuda".
    type: str
    # Total memory of one device, in bytes (> 0).
    capacity_bytes: int
    # Free-form name shown in reports; "" = the device type.
    name: str = ""
    # Number of devices (>= 1); the plan records it.
    count: int = 1
    # Device index (>= 0).
    index: int = 0
    # Whether the device supports bfloat16.
    bf16: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.type, str) or self.type not in ("cpu", "cuda"):
            raise ValueError(f"DeviceSpec.type must be 'cpu' or 'cuda', got {self.type!r}")
        cap = self.capacity_bytes
        if (
            isinstance(cap, bool)
            or not isinstance(cap, numbers.Real)
            or not math.isfinite(cap)
            or cap < 1
        ):
            raise ValueError(
                f"DeviceSpec.capacity_bytes must be a number of bytes >= 1, got {cap!r}"
            )
        object.__setattr__(self, "capacity_bytes", int(cap))
        if not isinstance(self.name, str):
            raise TypeError(f"DeviceSpec.name must be a str, got {self.name!r}")
        for field, low in (("count", 1), ("index", 0)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"DeviceSpec.{field} must be an int >= {low}, got {value!r}")
        if not isinstance(self.bf16, bool):
            raise TypeError(f"DeviceSpec.bf16 must be a bool, got {self.bf16!r}")

    def hardware(self) -> dict[str, Any]:
        """The description the decision engine plans with."""
        return {
            "device": self.type,
            "index": self.index,
            "count": self.count,
            "capacity_bytes": self.capacity_bytes,
            "bf16": self.bf16,
            "name": self.name or self.type,
        }


def resolve_device(
    model: nn.Module, device: Any, config: Config
) -> tuple[dict[str, Any], torch.device]:
    """(hardware description, device the fake tensors live on)."""
    if isinstance(device, Mapping):
        device = DeviceSpec(**dict(device))
    if isinstance(device, DeviceSpec):
        return device.hardware(), _simulation_device(device.type)
    if device is None:
        dev = _model.model_device(model)
        if dev.type == "meta":
            raise ValueError(
                "the model is on the meta device, so there is no device to "
                "predict for; pass device=DeviceSpec('cuda', capacity_bytes=...) "
                "(memscale.predictor.DeviceSpec) or device='cpu'"
            )
    elif isinstance(device, (str, torch.device)):
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"device must name a torch device, got {device!r}: {exc}") from None
    else:
        raise TypeError(
            "device must be None, a str or torch.device, a "
            "memscale.predictor.DeviceSpec or a dict of its fields, "
            f"got {type(device).__name__}"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"memscale predicts for 'cpu' and 'cuda' devices, not "
            f"{dev.type!r}; pass device=DeviceSpec(...)"
        )
    try:
        hardware = _core.detect_hardware(dev.type, dev.index or 0)
    except RuntimeError as exc:
        if config.memory_budget_gb is None:
            raise ValueError(
                f"cannot detect the {dev} device here ({exc}); pass its size: "
                f"device=DeviceSpec({dev.type!r}, capacity_bytes=...) or "
                "Config(memory_budget_gb=...)"
            ) from None
        cap = int(config.memory_budget_gb * GIB)
        hardware = {
            "device": dev.type,
            "index": dev.index or 0,
            "count": 1,
            "capacity_bytes": cap,
            "bf16": False,
            "name": dev.type,
        }
    return hardware, _simulation_device(dev.type)


def _simulation_device(device_type: str) -> torch.device:
    """The device the fake tensors live on: the target's type when this
    torch can run it (autograd needs the device's runtime even for fake
    tensors: a CPU-only build aborts the process on a fake CUDA backward),
    else the CPU, whose kernels and optimizer defaults are then simulated."""
    if device_type == "cuda" and not torch.cuda.is_available():
        logger.info(
            "memscale: CUDA is not available here; the step is "
            "simulated with CPU kernels, against the given capacity"
        )
        return torch.device("cpu")
    return torch.device(device_type)


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------


def _fmt(n: float) -> str:
    return format_bytes(n, digits=1)


@dataclasses.dataclass(frozen=True)
class PeakBreakdown:
    """The live tensor bytes at the highest point of one simulated training
    step, by what they are.  The categories sum to ``peak_bytes``."""

    # Peak live tensor bytes of the step.
    peak_bytes: int
    # Parameters and buffers.
    parameters: int
    # Parameter gradients (.grad), alive or being built.
    gradients: int
    # Optimizer state (e.g. Adam's two moments and step counters).
    optimizer_state: int
    # Tensors made in forward (and by recomputes) and still alive: what
    # backward needs, outputs, the loss.
    activations: int
    # The sample input.
    inputs: int
    # Temporaries of backward and of the optimizer step (gradients of
    # activations, optimizer intermediates).
    workspace: int
    # Where the peak falls: "start" (before zero_grad), "forward",
    # "backward" or "optimizer".
    phase: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PeakPrediction:
    """What :func:`predict_peak` returns; ``str()`` prints it as a table."""

    # The model as it is.
    unoptimized: PeakBreakdown
    # Under the plan memscale.wrap() would apply with this Config (equal to
    # ``unoptimized`` when the plan applies nothing, e.g. smart-skip).
    optimized: PeakBreakdown
    # Device type, name and total memory the prediction is for, and the
    # device type whose kernels were simulated (the CPU's when the target
    # device's runtime is not available here).
    device: str
    device_name: str
    capacity_bytes: int
    simulated_on: str
    # Usable memory: Config.memory_budget_gb, else capacity x
    # Config.target_gpu_utilization.
    budget_bytes: int
    # The plan: hash, whether smart-skip left the model alone, the layers
    # it checkpoints, and the share of forward FLOPs recomputed in backward.
    plan_hash: str
    plan_skipped: bool
    checkpointed_layers: tuple[str, ...]
    layer_count: int
    recompute_ratio: float
    # Forward FLOPs of the model (from the profile), and the decision
    # engine's own estimates of the unoptimized and the planned peak (its
    # memory model, csrc/engine.c), which its decisions rest on.
    forward_flops: float
    engine_unoptimized_bytes: int
    engine_projected_bytes: int
    # The optimizer simulated, and whether its step could run on fake
    # tensors (False: its state was estimated from its class, no workspace).
    optimizer: str
    optimizer_simulated: bool
    # Kernel calls whose scratch memory was not measured (see PROBE_LIMIT;
    # always 0 off CPU, where no kernel is probed).
    unprobed_calls: int
    # Wall time of the prediction, in seconds (not part of equality).
    seconds: float = dataclasses.field(compare=False)
    # The Plan object itself (not part of equality or the dict).
    plan: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def fits_unoptimized(self) -> bool:
        """Whether the unoptimized step's peak fits the usable memory."""
        return self.unoptimized.peak_bytes <= self.budget_bytes

    @property
    def fits(self) -> bool:
        """Whether the step fits the usable memory under memscale's plan."""
        return self.optimized.peak_bytes <= self.budget_bytes

    @property
    def saved_bytes(self) -> int:
        return self.unoptimized.peak_bytes - self.optimized.peak_bytes

    @property
    def time_ratio(self) -> float:
        """Predicted step time under the plan over the unoptimized step:
        ``1 + recompute_ratio / 3`` (see :func:`estimate_savings`)."""
        return predicted_time_ratio(self.recompute_ratio)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        out["unoptimized"] = self.unoptimized.to_dict()
        out["optimized"] = self.optimized.to_dict()
        out["checkpointed_layers"] = list(self.checkpointed_layers)
        out.update(
            fits_unoptimized=self.fits_unoptimized,
            fits=self.fits,
            saved_bytes=self.saved_bytes,
            time_ratio=self.time_ratio,
        )
        return out

    def __str__(self) -> str:
        rows = [("", "unoptimized", "memscale plan")]
        for cat in CATEGORIES:
            rows.append(
                (
                    _CATEGORY_HELP[cat],
                    _fmt(getattr(self.unoptimized, cat)),
                    _fmt(getattr(self.optimized, cat)),
                )
            )
        rows.append(("peak", _fmt(self.unoptimized.peak_bytes), _fmt(self.optimized.peak_bytes)))
        rows.append(("peak falls in", self.unoptimized.phase, self.optimized.phase))
        rows.append(
            ("fits", "yes" if self.fits_unoptimized else "NO", "yes" if self.fits else "NO")
        )
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [
            f"memscale predicted peak of one training step (forward, backward, "
            f"{self.optimizer} step) on {self.device} '{self.device_name}': "
            f"capacity {_fmt(self.capacity_bytes)}, usable {_fmt(self.budget_bytes)}"
            + (
                ""
                if self.simulated_on == self.device
                else f" (simulated with {self.simulated_on} kernels)"
            )
        ]
        for r in rows:
            lines.append(
                "  "
                + r[0].ljust(widths[0])
                + "  "
                + r[1].rjust(widths[1])
                + "  "
                + r[2].rjust(widths[2])
            )
        if self.plan_skipped:
            what = "smart-skip: the model fits, the plan applies nothing"
        else:
            what = (
                f"{len(self.checkpointed_layers)} of {self.layer_count} layers "
                f"checkpointed, recompute {self.recompute_ratio:.0%} of forward, "
                f"predicted step time x{self.time_ratio:.2f}"
            )
        lines.append(f"  plan {self.plan_hash[:12]}: {what}")
        lines.append(f"  predicted in {self.seconds:.2f} s on fake tensors")
        return "\n".join(lines)


def predicted_time_ratio(recompute_ratio: float) -> float:
    """Step time with checkpointing over the step time without.

    A training step costs about three forwards (the backward about two);
    checkpointing adds the recomputed share of one forward:
    ``1 + recompute_ratio / 3``.  FLOPs are counted by torch's FLOP counter
    (matrix products and convolutions); the optimizer step and memory-bound
    operators are left out, so read it as an estimate.
    """
    return 1.0 + max(0.0, float(recompute_ratio)) / 3.0


@dataclasses.dataclass(frozen=True)
class SavingsEstimate:
    """What :func:`estimate_savings` returns: prints as a table."""

    peak_unoptimized_bytes: int
    peak_optimized_bytes: int
    saved_bytes: int
    saved_fraction: float
    time_ratio: float
    recompute_ratio: float
    device: str
    capacity_bytes: int
    budget_bytes: int
    fits_unoptimized: bool
    fits_optimized: bool
    plan_hash: str
    checkpointed_layers: int
    layer_count: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        rows = [
            ("", "peak", "fits", "step time"),
            (
                "unoptimized",
                _fmt(self.peak_unoptimized_bytes),
                "yes" if self.fits_unoptimized else "NO",
                "x1.00",
            ),
            (
                "memscale plan",
                _fmt(self.peak_optimized_bytes),
                "yes" if self.fits_optimized else "NO",
                f"x{self.time_ratio:.2f}",
            ),
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            f"memscale estimate on {self.device}: usable "
            f"{_fmt(self.budget_bytes)} of {_fmt(self.capacity_bytes)}"
        ]
        for r in rows:
            lines.append(
                "  "
                + r[0].ljust(widths[0])
                + "  "
                + "  ".join(c.rjust(w) for c, w in zip(r[1:], widths[1:]))
            )
        lines.append(
            f"  saved {_fmt(self.saved_bytes)} ({self.saved_fraction:.1%}); "
            f"{self.checkpointed_layers} of {self.layer_count} layers "
            f"checkpointed, recompute {self.recompute_ratio:.0%} of forward"
        )
        return "\n".join(lines)


# --------------------------------------------------------------------------
# Counting live storages
# --------------------------------------------------------------------------


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors_in(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from _tensors_in(item)


_WORKSPACE_OP_SET: frozenset[Any] | None = None


def _workspace_ops() -> frozenset[Any]:
    global _WORKSPACE_OP_SET
    if _WORKSPACE_OP_SET is None:
        found = []
        for name in _WORKSPACE_OPS:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
            if op is not None:
                found.append(op)
        _WORKSPACE_OP_SET = frozenset(found)
    return _WORKSPACE_OP_SET


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        if not self.shape:
            return self.dtype.itemsize
        span = 1 + sum((n - 1) * st for n, st in zip(self.shape, self.stride) if n)
        return span * self.dtype.itemsize if all(self.shape) else 0

    def make(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype).zero_()


def _spec(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _TensorSpec(tuple(obj.shape), tuple(obj.stride()), obj.dtype)
    if isinstance(obj, (tuple, list)):
        return tuple(_spec(o) for o in obj)
    hash(obj)  # TypeError for anything a signature cannot hold
    return obj


def _signature(func: Any, args: Any, kwargs: Mapping[str, Any]) -> Any:
    """A hashable description of one operator call; None if it has an
    argument that cannot be described."""
    try:
        return (func, _spec(tuple(args)), tuple(sorted((k, _spec(v)) for k, v in kwargs.items())))
    except TypeError:
        return None


def _build(spec: Any) -> Any:
    if isinstance(spec, _TensorSpec):
        return spec.make()
    if isinstance(spec, tuple):
        return [_build(s) for s in spec]
    return spec


def _call_of(sig: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The operator and real, zero-filled arguments of a recorded call."""
    func, args, kwargs = sig
    return func, tuple(_build(a) for a in args), {k: _build(v) for k, v in kwargs}


def _input_bytes(sig: Any) -> int:
    total = 0
    stack = [sig[1], tuple(v for _, v in sig[2])]
    while stack:
        item = stack.pop()
        if isinstance(item, _TensorSpec):
            total += item.nbytes
        elif isinstance(item, tuple):
            stack.extend(item)
    return total


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """What one kernel call really allocates beyond its fake twin."""

    scratch: int  # peak bytes inside the call, not returned
    returned: tuple[int, ...]  # storage bytes of each tensor returned


# (signature, threads) -> _Kernel, for this process.
_PROBED: dict[tuple[Any, int], _Kernel] = {}


def _probe_workspace(signatures: Mapping[Any, int], limit: int) -> tuple[dict[Any, _Kernel], int]:
    """Scratch bytes of each kernel call, measured by running it once on
    real zero-filled CPU tensors under the memory profiler (as
    memscale._measure does): the allocator's peak inside the
    call minus the bytes it returns.  Returns the figures and the number of
    calls not probed (inputs and outputs above ``limit`` bytes, or a
    profiler is already running).  ``signatures`` maps each call to the
    bytes its fake twin returned."""
    from . import _measure as measure  # torch and the standard library only

    threads = torch.get_num_threads()
    out: dict[Any, _Kernel] = {}
    todo = []
    skipped = 0
    for sig in sorted(signatures, key=repr):
        key = (sig, threads)
        if key in _PROBED:
            out[sig] = _PROBED[key]
        elif _input_bytes(sig) + signatures[sig] > limit:
            skipped += 1
        else:
            todo.append(sig)
    if not todo:
        return out, skipped
    if measure._profiler_active():
        logger.info(
            "memscale: a torch profiler is running; kernel scratch "
            "memory of %d operator calls is not measured",
            len(todo),
        )
        return out, skipped + len(todo)
    from torch.profiler import ProfilerActivity, profile, record_function

    tools = _torch_compat.fake_tensor_tools()
    real = tools[1]() if tools is not None else contextlib.nullcontext()
    calls: list[tuple[int, tuple[int, ...]]] = []
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with measure._quiet("probe start"):
        prof.start()
    try:
        with real, torch.no_grad():  # real tensors, also inside a fake world
            for i, sig in enumerate(todo):
                func, args, kwargs = _call_of(sig)
                func(*args, **kwargs)  # first call: caches, lazy init
                with record_function(f"memscale::probe{i}"):
                    result = func(*args, **kwargs)
                sizes = {}
                per_output = []
                for t in _tensors_in(result):
                    st = t.untyped_storage()
                    sizes[id(st)] = st.nbytes()
                    per_output.append(st.nbytes())
                calls.append((sum(sizes.values()), tuple(per_output)))
                del result, args, kwargs
    finally:
        with measure._quiet("probe stop"):
            prof.stop()
    raw = _torch_compat.profiler_memory_events(prof)
    if raw is None:  # pragma: no cover - depends on the torch build
        return out, skipped + len(todo)
    windows: dict[int, tuple[int, int]] = {}
    memory = []
    for name, begin, end, nbytes in raw:
        if name.startswith("memscale::probe"):
            windows[int(name[len("memscale::probe") :])] = (begin, end)
        elif name == "[memory]":
            memory.append((begin, nbytes))
    memory.sort(key=lambda e: e[0])
    for i, sig in enumerate(todo):
        begin, end = windows[i]
        peak, _ = measure._running_peak(e for e in memory if begin <= e[0] <= end)
        returned, returned_each = calls[i]
        kernel = _Kernel(max(0, peak - returned), returned_each)
        _PROBED[(sig, threads)] = out[sig] = kernel
    return out, skipped


_TRACKER_CLASS: type | None = None


def _tracker_class() -> type:
    global _TRACKER_CLASS
    if _TRACKER_CLASS is not None:
        return _TRACKER_CLASS
    base = _torch_compat.dispatch_mode_base()
    if base is None:
        raise RuntimeError(
            f"memscale's OOM predictor needs torch's TorchDispatchMode, which "
            f"torch {torch.__version__} does not provide; install torch >= 2.4"
        )

    class StorageTracker(base):  # type: ignore[misc, valid-type]
        """Registers the storage of every tensor an operator returns and
        records an event when it is allocated and when it is freed."""

        def __init__(self, real_limit: int = 0) -> None:
            super().__init__()
            tools = _torch_compat.fake_tensor_tools() if real_limit else None
            self._real_limit = real_limit if tools is not None else 0
            if tools is not None:
                self._is_fake, self._unset_fake, self._value_errors = tools
            # id(storage) -> (weakref, serial); the weakref's callback
            # records the free.
            self._known: dict[int, tuple[weakref.ref, int]] = {}
            self.sizes: list[int] = []  # per serial, current bytes
            self.sizes_at_birth: list[int] = []
            self.categories: list[str] = []  # per serial
            self.events: list[tuple[int, int]] = []  # (serial, +/- bytes)
            self.phase_marks: list[tuple[int, str]] = [(0, "start")]
            self.phase = "start"
            self.recompute_depth = 0
            self.active = True
            # (event index, call signature, serials of the new storages it
            # returned) of operators whose kernels keep scratch memory (see
            # _WORKSPACE_OPS); None: not recorded.
            self.kernel_calls: list[tuple[int, Any, tuple[int | None, ...]]] | None = None

        def set_phase(self, phase: str) -> None:
            self.phase = phase
            self.phase_marks.append((len(self.events), phase))

        def _category(self) -> str:
            if self.phase == "forward" or self.recompute_depth > 0:
                return "activations"
            return "workspace"

        def serial_of(self, t: torch.Tensor) -> int | None:
            st = t.untyped_storage()
            entry = self._known.get(id(st))
            if entry is not None and entry[0]() is st:
                return entry[1]
            return None

        def track(self, t: torch.Tensor, category: str | None = None) -> int | None:
            """Register the storage of ``t``; its serial if it is new."""
            st = t.untyped_storage()
            key = id(st)
            entry = self._known.get(key)
            if entry is not None and entry[0]() is st:
                serial = entry[1]
                nbytes = st.nbytes()
                if nbytes != self.sizes[serial]:  # resized in place
                    self.events.append((serial, nbytes - self.sizes[serial]))
                    self.sizes[serial] = nbytes
                return None
            nbytes = st.nbytes()
            serial = len(self.sizes)
            self.sizes.append(nbytes)
            self.sizes_at_birth.append(nbytes)
            self.categories.append(category or self._category())
            known = self._known
            events = self.events
            sizes = self.sizes

            def freed(ref: weakref.ref, key: int = key, serial: int = serial) -> None:
                if known.get(key, (None,))[0] is ref:
                    del known[key]
                if self.active and sizes[serial]:
                    events.append((serial, -sizes[serial]))
                    sizes[serial] = 0

            self._known[key] = (weakref.ref(st, freed), serial)
            if nbytes:
                self.events.append((serial, nbytes))
            return serial

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is _EQUAL and self.phase == "backward":
                # The executor compares a layer's buffers before and after
                # its recompute (csrc/frame.c, restore_buffers) to put
                # updated statistics back.  Fake tensors have no values; a
                # layer whose recompute can change its buffers does (e.g.
                # BatchNorm), so answer "changed": the executor copies the
                # snapshot back, as it does in a real step.
                return False
            kwargs = kwargs or {}
            if self._real_limit and self._all_real(args, kwargs):
                out = self._run_real(func, args, kwargs)
            else:
                out = func(*args, **kwargs)
            if self.active:
                serials = tuple(self.track(t) for t in _tensors_in(out))
                if self.kernel_calls is not None and func in _workspace_ops():
                    sig = _signature(func, args, kwargs)
                    if sig is not None:
                        self.kernel_calls.append((len(self.events), sig, serials))
            return out

        def _all_real(self, args: Any, kwargs: Any) -> bool:
            return not any(self._is_fake(t) for t in _tensors_in((args, kwargs)))

        def _run_real(self, func: Any, args: Any, kwargs: Any) -> Any:
            """An operator on real tensors only (or none): its result's size
            is learnt on fake tensors first; small results are computed for
            real, so their values exist."""
            try:
                out = func(*args, **kwargs)
            except self._value_errors:
                out = None  # it reads values (item(), nonzero(), ...)
            else:
                sizes = [t.untyped_storage().nbytes() for t in _tensors_in(out)]
                if not sizes or sum(sizes) > self._real_limit:
                    return out
            with self._unset_fake():
                return func(*args, **kwargs)

        def breakdown(
            self, recategorize: Mapping[int, str], workspace: Mapping[Any, _Kernel]
        ) -> PeakBreakdown:
            """The peak of the event sequence and what was alive then.
            ``workspace`` gives, per recorded kernel call, its scratch bytes
            (alive only during the call, on top of everything else) and the
            real storage sizes of what it returns (a CPU kernel may return a
            scalar whose storage is its whole elementwise buffer)."""
            cats = [recategorize.get(i, c) for i, c in enumerate(self.categories)]
            scratch: dict[int, int] = {}
            scale: dict[int, int] = {}  # serial -> real bytes
            for at, sig, serials in self.kernel_calls or ():
                kernel = workspace.get(sig)
                if kernel is None:
                    continue
                if kernel.scratch > scratch.get(at, 0):
                    scratch[at] = kernel.scratch
                for serial, real in zip(serials, kernel.returned):
                    if serial is not None and real > self.sizes_at_birth[serial]:
                        scale[serial] = real
            totals = dict.fromkeys(CATEGORIES, 0)
            level = peak = 0
            best = dict(totals)
            marks = iter(self.phase_marks[1:] + [(len(self.events) + 1, "")])
            phase, (next_at, next_phase) = "start", next(marks)
            peak_phase = "start"
            for i in range(len(self.events) + 1):
                while i >= next_at:
                    phase, (next_at, next_phase) = next_phase, next(marks)
                w = scratch.get(i, 0)
                if w and level + w > peak:
                    peak, peak_phase = level + w, phase
                    best = dict(totals)
                    best["workspace"] += w
                if i == len(self.events):
                    break
                serial, delta = self.events[i]
                if serial in scale:  # one alloc and one free, real size
                    delta = scale[serial] if delta > 0 else -scale[serial]
                totals[cats[serial]] += delta
                level += delta
                if level > peak:
                    peak, best, peak_phase = level, dict(totals), phase
            return PeakBreakdown(peak_bytes=peak, phase=peak_phase, **best)

    _TRACKER_CLASS = StorageTracker
    return StorageTracker


# --------------------------------------------------------------------------
# The fake model
# --------------------------------------------------------------------------


class _FakeWorld:
    """Swaps every parameter and buffer of ``model`` for a fake twin (same
    shape, dtype, strides; ties kept) inside one FakeTensorMode, and puts
    the real ones back on exit.  Also converts inputs, and keeps the model
    in training mode while it lasts."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        fake = _torch_compat.fake_tensor_mode(
            allow_non_fake_inputs=True, allow_fallback_kernels=False
        )
        if fake is None:
            raise RuntimeError(
                "memscale's OOM predictor runs the step on fake tensors, which "
                f"torch {torch.__version__} does not provide; install torch >= 2.4"
            )
        self.mode, self._convert = fake
        self.model = model
        self.device = device
        self._memo: dict[int, torch.Tensor] = {}
        self._real_copies: dict[int, torch.Tensor] = {}
        self._keep: list[torch.Tensor] = []
        tools = _torch_compat.fake_tensor_tools()
        self._real = tools[1] if tools is not None else contextlib.nullcontext
        self._swapped: list[tuple[dict[str, Any], str, Any]] = []
        self._training: list[tuple[nn.Module, bool]] = []
        self._attrs: list[tuple[nn.Module, dict[str, Any]]] = []
        self.params: list[torch.Tensor] = []  # unique fake parameters
        self.buffers: list[torch.Tensor] = []  # unique fake buffers
        self.param_of: dict[int, torch.Tensor] = {}  # id(real) -> fake

    def fake(self, t: torch.Tensor) -> torch.Tensor:
        """The fake twin of a real or meta tensor (memoized)."""
        got = self._memo.get(id(t))
        if got is not None:
            return got
        if t.device.type == self.device.type and not t.is_meta:
            out = self._convert(t.detach())
        else:
            out = torch.empty_strided(
                tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=self.device
            )
        if isinstance(t, nn.Parameter):
            out = nn.Parameter(out, requires_grad=t.requires_grad)
        elif t.requires_grad and t.is_leaf:
            out.requires_grad_(True)
        self._memo[id(t)] = out
        self._keep.append(t)  # its id stays unique while it is in the memo
        return out

    def fake_tree(self, obj: Any, keep_real: int = 0) -> Any:
        """``obj`` with its tensors faked; with ``keep_real``, tensors that
        are real, not floating point, on the simulated device and at most
        that many bytes stay real, as copies (their values can matter)."""
        if isinstance(obj, torch.Tensor):
            if (
                keep_real
                and not obj.is_meta
                and not obj.is_floating_point()
                and not obj.is_complex()
                and not obj.requires_grad
                and obj.device.type == self.device.type
                and obj.untyped_storage().nbytes() <= keep_real
            ):
                # A copy, made once per tensor: the model may change it in
                # place, and the caller's batch must stay as it is.
                if id(obj) not in self._real_copies:
                    with self._real():
                        self._real_copies[id(obj)] = obj.clone()
                    self._keep.append(obj)
                return self._real_copies[id(obj)]
            return self.fake(obj)
        if isinstance(obj, tuple):
            return tuple(self.fake_tree(o, keep_real) for o in obj)
        if isinstance(obj, list):
            return [self.fake_tree(o, keep_real) for o in obj]
        if isinstance(obj, dict):
            return {k: self.fake_tree(v, keep_real) for k, v in obj.items()}
        return obj

    def __enter__(self) -> _FakeWorld:
        self.mode.__enter__()
        try:
            seen_p: set[int] = set()
            seen_b: set[int] = set()
            for module in self.model.modules():
                self._training.append((module, module.training))
                self._attrs.append((module, dict(module.__dict__)))
            for module in self.model.modules():
                tables = _torch_compat.module_tensor_tables(module)
                if tables is None:
                    raise RuntimeError(
                        "memscale's OOM predictor swaps a module's parameters "
                        "for fake ones through its parameter tables, which "
                        f"torch {torch.__version__} does not expose"
                    )
                for table, seen, out in (
                    (tables[0], seen_p, self.params),
                    (tables[1], seen_b, self.buffers),
                ):
                    for name, real in list(table.items()):
                        if real is None:
                            continue
                        twin = self.fake(real)
                        if id(real) not in seen:
                            seen.add(id(real))
                            out.append(twin)
                            if table is tables[0]:
                                self.param_of[id(real)] = twin
                        self._swapped.append((table, name, real))
                        table[name] = twin
            self.model.train()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            for table, name, real in reversed(self._swapped):
                table[name] = real
            self._swapped.clear()
            for module, flag in self._training:
                module.training = flag
            self._training.clear()
            self._restore_attributes()
        finally:
            self.mode.__exit__(None, None, None)

    def _restore_attributes(self) -> None:
        """A forward may store a tensor on a module (a cache, a mask): one
        made in the simulation is fake, and must not outlive it.  Such
        attributes get their old value back, or are removed if new."""
        tools = _torch_compat.fake_tensor_tools()
        is_fake = tools[0] if tools is not None else (lambda _t: False)

        def holds_fake(value: Any) -> bool:
            if isinstance(value, (tuple, list, dict)):
                return any(is_fake(t) for t in _tensors_in(value))
            return isinstance(value, torch.Tensor) and is_fake(value)

        for module, before in self._attrs:
            for key, value in list(module.__dict__.items()):
                if key in ("_parameters", "_buffers", "_modules"):
                    continue
                if value is before.get(key, _MISSING) or not holds_fake(value):
                    continue
                logger.debug(
                    "memscale: restoring %s.%s after the simulation", type(module).__name__, key
                )
                if key in before:
                    module.__dict__[key] = before[key]
                else:
                    del module.__dict__[key]
        self._attrs.clear()


# --------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------


def default_loss(output: Any) -> torch.Tensor:
    """The loss of a model output when no ``loss_fn`` is given.

    ``output.loss`` or ``output["loss"]`` when the model computes its own
    loss (Hugging Face models given labels); a scalar output as is; else a
    stand-in: the mean of squares of every floating-point output tensor
    that requires grad (its backward, like a real loss's, makes one
    gradient the size of each output).  Pass ``loss_fn`` for the real one.
    """
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    if isinstance(output, torch.Tensor) and output.dim() == 0 and output.requires_grad:
        return output
    parts = [t for t in _tensors_in(output) if t.requires_grad and t.is_floating_point()]
    if not parts:
        raise ValueError(
            "the model's output holds no tensor that requires grad, so there "
            "is no training step to predict; pass loss_fn=... (a callable from "
            "the output to a scalar loss)"
        )
    total = parts[0].pow(2).mean()
    for t in parts[1:]:
        total = total + t.pow(2).mean()
    return total


def _foreach_default(device_type: str) -> bool:
    # torch.optim picks the foreach implementation by default only for
    # tensors on these device types (torch/optim/optimizer.py); fake
    # tensors are not of a foreach-supported type, so the choice is made here.
    return device_type in ("cuda", "xpu")


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer,
    param: Callable[[torch.Tensor], torch.Tensor] = lambda p: p,
    foreach: bool | None = None,
) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class with the same parameter
    groups and settings and no state; ``param`` maps each parameter to the
    one to use.  With ``foreach`` given, a group whose ``foreach`` is unset
    (None, torch's "decide for me") gets it.  Settings travel in the groups;
    the constructor gets the defaults it names (AdamW's records
    ``decoupled_weight_decay``, which its constructor does not take)."""
    cls = type(optimizer)
    groups = []
    for group in optimizer.param_groups:
        new = {k: v for k, v in group.items() if k != "params"}
        new["params"] = [param(p) for p in group["params"]]
        if (
            foreach is not None
            and "foreach" in new
            and new["foreach"] is None
            and not new.get("fused")
            and not new.get("differentiable")
        ):
            new["foreach"] = foreach
        groups.append(new)
    sig = inspect.signature(cls.__init__)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    kwargs = {k: v for k, v in optimizer.defaults.items() if takes_any or k in sig.parameters}
    return cls(groups, **kwargs)


def _fake_optimizer(
    optimizer: torch.optim.Optimizer | None, world: _FakeWorld, target_type: str
) -> tuple[torch.optim.Optimizer | None, str]:
    """An optimizer of the same class and settings over the fake parameters
    (AdamW with its defaults when none is given); None when the class cannot
    be rebuilt.  An unset ``foreach`` is decided as torch decides it for the
    target device type (the foreach kernels keep whole-model temporaries)."""
    foreach = _foreach_default(target_type)
    if optimizer is None:
        params = [p for p in world.params if p.requires_grad]
        return torch.optim.AdamW(params, foreach=foreach), "AdamW"
    cls = type(optimizer)
    try:
        return rebuild_optimizer(optimizer, world.fake, foreach), cls.__name__
    except Exception as exc:  # noqa: BLE001 - reported, estimated instead
        logger.info(
            "memscale: cannot rebuild %s on fake tensors (%s: %s); its "
            "state is estimated from its class",
            cls.__name__,
            type(exc).__name__,
            exc,
        )
        return None, cls.__name__


def _estimated_state(
    world: _FakeWorld, optimizer: torch.optim.Optimizer | None, model: nn.Module
) -> list[torch.Tensor]:
    """Fake state tensors for an optimizer that cannot run on fake tensors:
    as many parameter-sized tensors as ``_model.optimizer_state_bytes``
    counts."""
    trainable = [p for p in world.params if p.requires_grad]
    per = sum(p.untyped_storage().nbytes() for p in trainable)
    want = _model.optimizer_state_bytes(model, optimizer)
    copies = round(want / per) if per else 0
    return [torch.empty_like(p) for _ in range(copies) for p in trainable]


def _rng_state_bytes() -> int:
    """Bytes of the RNG state a checkpoint frame records (csrc/frame.c,
    ms_frame_new): the CPU generator's, plus every CUDA generator's once CUDA
    is initialized."""
    total = torch.get_rng_state().untyped_storage().nbytes()
    if torch.cuda.is_initialized():
        total += sum(s.untyped_storage().nbytes() for s in torch.cuda.get_rng_state_all())
    return total


def _leaves_reached(loss: torch.Tensor) -> set[int]:
    """ids of the leaf tensors backward from ``loss`` would accumulate a
    gradient into (the AccumulateGrad nodes of its graph)."""
    return {
        id(node.variable)
        for node in _torch_compat.autograd_nodes(loss)
        if isinstance(getattr(node, "variable", None), torch.Tensor)
    }


@dataclasses.dataclass
class _Trace:
    """One tracked step: its events, and the categories learnt at its end."""

    tracker: Any
    recategorize: dict[int, str]

    def signatures(self) -> dict[Any, int]:
        """Recorded kernel calls, each with the bytes it returned."""
        sizes = self.tracker.sizes_at_birth
        return {
            sig: sum(sizes[s] for s in serials if s is not None)
            for _, sig, serials in self.tracker.kernel_calls or ()
        }

    def breakdown(self, workspace: Mapping[Any, _Kernel]) -> PeakBreakdown:
        return self.tracker.breakdown(self.recategorize, workspace)


class _Step:
    """One simulated training step at a time over a _FakeWorld."""

    def __init__(
        self,
        world: _FakeWorld,
        inputs: tuple[Any, Any],
        strict_inputs: tuple[Any, Any],
        loss_fn: Callable[[Any], Any] | None,
        optimizer: torch.optim.Optimizer | None,
        fallback_state: list[torch.Tensor],
    ) -> None:
        self.world = world
        # Inputs of the tracked steps (small integer tensors real), and of
        # the warm-up, all fake as in wrap()'s static profiling.
        self.args, self.kwargs = inputs
        self.strict_args, self.strict_kwargs = strict_inputs
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.fallback_state = fallback_state

    def _loss(self, output: Any) -> torch.Tensor:
        loss = self.loss_fn(output) if self.loss_fn is not None else default_loss(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
        return loss

    def _zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            for p in self.world.params:
                p.grad = None

    def run(self, tracker: Any) -> None:
        """zero_grad, forward, loss, backward, optimizer step, each phase
        marked in ``tracker``'s events."""
        self._zero_grad()
        tracker.set_phase("forward")
        with torch.enable_grad():
            output = self.world.model(*self.args, **self.kwargs)
            loss = self._loss(output)
            del output
            tracker.set_phase("backward")
            loss.backward()
        tracker.set_phase("optimizer")
        if self.optimizer is not None:
            self.optimizer.step()
        del loss
        tracker.set_phase("end")

    def warm_up(self, on_forward: Callable[[], Any]) -> Any:
        """The first step, untracked: a steady-state step starts with
        gradients and optimizer state, so this one makes them.  The forward
        runs inside ``on_forward()`` (the profiler's pass, whose value is
        returned) on all-fake inputs, as wrap()'s static profiling does.
        Backward is not run: the parameters it would give a gradient are
        the ones the loss's graph reaches, and a zero gradient of each is
        enough for the optimizer to build its state."""
        self._zero_grad()
        with torch.enable_grad():
            with on_forward() as result:
                output = self.world.model(*self.strict_args, **self.strict_kwargs)
            loss = self._loss(output)
            del output
            reached = _leaves_reached(loss)
            del loss
        for p in self.world.params:
            if p.requires_grad and id(p) in reached:
                p.grad = torch.zeros_like(p)
        if self.optimizer is not None:
            self.optimizer.step()
        return result

    def existing(self) -> list[tuple[torch.Tensor, str]]:
        """Tensors alive when a step starts, with their category."""
        out: list[tuple[torch.Tensor, str]] = []
        out += [(t, "parameters") for t in self.world.params + self.world.buffers]
        out += [(p.grad, "gradients") for p in self.world.params if p.grad is not None]
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                out += [
                    (v, "optimizer_state") for v in state.values() if isinstance(v, torch.Tensor)
                ]
        out += [(t, "optimizer_state") for t in self.fallback_state]
        out += [(t, "inputs") for t in _tensors_in((self.args, self.kwargs))]
        return out

    def tracked(self, recompute_units: list[nn.Module]) -> _Trace:
        """Run one step under a StorageTracker; what it recorded."""
        tracker = _tracker_class()(REAL_VALUE_LIMIT)
        if self.world.device.type == "cpu":
            tracker.kernel_calls = []
        handles = []

        # The executor's checkpoint frame keeps the RNG state of its layer's
        # forward (a real ByteTensor made outside any operator, so the
        # tracker cannot see it) until backward is done with the layer,
        # which is when the next layer is recomputed, or backward ends: a
        # fake tensor of that size stands in for it over the same span.
        rng_bytes = _rng_state_bytes()
        held: dict[int, list[torch.Tensor]] = {}
        done: list[torch.Tensor] = []
        nesting = [0]

        def enter(module: nn.Module, *_: Any) -> None:
            if tracker.phase == "backward":
                if tracker.recompute_depth == 0:
                    done.clear()
                tracker.recompute_depth += 1
            elif tracker.phase == "forward":
                if nesting[0] == 0 and module.training and torch.is_grad_enabled():
                    held.setdefault(id(module), []).append(
                        torch.empty(rng_bytes, dtype=torch.uint8, device=self.world.device)
                    )
                nesting[0] += 1

        def leave(module: nn.Module, *_: Any) -> None:
            if tracker.phase == "backward" and tracker.recompute_depth > 0:
                tracker.recompute_depth -= 1
                if held.get(id(module)):
                    done.append(held[id(module)].pop(0))
            elif tracker.phase == "forward" and nesting[0] > 0:
                nesting[0] -= 1

        gc_was_enabled = gc.isenabled()
        # Frees at refcount zero only, the same every run: a collection in
        # the middle of the step would free cyclic garbage at a moment that
        # depends on what ran before.
        gc.disable()
        try:
            for unit in recompute_units:
                handles.append(unit.register_forward_pre_hook(enter))
                handles.append(unit.register_forward_hook(leave, always_call=True))
            for t, category in self.existing():
                tracker.track(t, category)
            mark = tracker.set_phase

            def set_phase(phase: str) -> None:
                if phase == "optimizer":  # the graph and its frames are gone
                    held.clear()
                    done.clear()
                mark(phase)

            tracker.set_phase = set_phase
            with tracker:
                self.run(tracker)
                held.clear()
                done.clear()
            tracker.active = False
            recategorize: dict[int, str] = {}
            for p in self.world.params:
                if p.grad is not None:
                    serial = tracker.serial_of(p.grad)
                    if serial is not None:
                        recategorize[serial] = "gradients"
            if self.optimizer is not None:
                for state in self.optimizer.state.values():
                    for v in state.values():
                        if isinstance(v, torch.Tensor):
                            serial = tracker.serial_of(v)
                            if serial is not None:
                                recategorize[serial] = "optimizer_state"
            return _Trace(tracker, recategorize)
        finally:
            tracker.active = False
            for h in handles:
                h.remove()
            if gc_was_enabled:
                gc.enable()


# --------------------------------------------------------------------------
# The session: simulated steps of one model and batch
# --------------------------------------------------------------------------


class _Simulation:
    """Everything the simulated steps need, set up once: the fake world, the
    fake optimizer warmed up, and the profile measured in the warm-up."""

    def __init__(
        self,
        model: nn.Module,
        sample_input: Any,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: Callable[[Any], Any] | None,
        device: torch.device,
        target_type: str,
        read_profile: Callable[[Any, list[tuple[str, nn.Module]]], Any],
    ) -> None:
        self.model = model
        self.target_type = target_type
        self.sample_input = sample_input
        self.real_optimizer = optimizer
        self.loss_fn = loss_fn
        self.device = device
        self.read_profile = read_profile
        self.units = _core.find_units(model)

    def __enter__(self) -> _Simulation:
        self._rng = _verify.rng_state()  # a model may draw from any stream
        self.world = _FakeWorld(self.model, self.device)
        self.world.__enter__()
        try:
            args, kwargs = _model.split_input(self.sample_input)
            strict = (self.world.fake_tree(args), self.world.fake_tree(kwargs))
            hybrid = (
                self.world.fake_tree(args, REAL_VALUE_LIMIT),
                self.world.fake_tree(kwargs, REAL_VALUE_LIMIT),
            )
            opt, self.optimizer_name = _fake_optimizer(
                self.real_optimizer, self.world, self.target_type
            )
            self.optimizer_simulated = opt is not None
            fallback = (
                []
                if opt is not None
                else _estimated_state(self.world, self.real_optimizer, self.model)
            )
            self.step = _Step(self.world, hybrid, strict, self.loss_fn, opt, fallback)
            self.profile = self._warm_up()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _warm_up(self) -> Any:
        """The untracked first step: it creates gradients and optimizer
        state (a steady-state step starts with both), and the C profiler
        measures its forward, as static profiling in wrap() does; what it
        measured, read by ``read_profile``."""
        units = self.units
        params = self.world.params + self.world.buffers
        holder: dict[str, Any] = {}

        class _Pass:
            def __enter__(self_inner) -> Any:
                prof = _core.Profiler([m for _, m in units], params, FlopCounterMode(display=False))
                prof.attach()
                holder["profiler"] = prof
                try:
                    prof.begin_pass()
                except BaseException:
                    prof.detach()
                    raise
                return prof

            def __exit__(self_inner, exc_type: Any, *_: Any) -> None:
                prof = holder["profiler"]
                try:
                    prof.end_pass(ok=exc_type is None)
                finally:
                    prof.detach()

        profiler = self.step.warm_up(_Pass)
        return self.read_profile(profiler, units)

    def __exit__(self, *exc: Any) -> None:
        try:
            self.world.__exit__(None, None, None)
        finally:
            _verify.set_rng_state(self._rng)

    def unoptimized(self) -> _Trace:
        return self.step.tracked([])

    def under(self, plan: Any, config: Config, hardware: dict[str, Any]) -> _Trace:
        """The step with the C executor applying ``plan`` to the model, and
        the settings wrap() makes with it (a Hugging Face model trains with
        ``config.use_cache=False`` under checkpointing)."""
        from .executor import Executor

        undo_cache = None
        executor = Executor(self.model, self.units, warmup_steps=config.warmup_steps)
        try:
            executor._init_python_state(config, hardware, "static")
            executor.apply(plan)
            if plan.technique_counts["offload"]:
                from .offload import SimulatedTier, async_settings

                settings = async_settings(config)
                executor.set_offload(
                    None,
                    SimulatedTier(
                        settings.min_offload_bytes,
                        settings.prefetch_depth if config.async_offload else 0,
                    ),
                )
            if plan.technique_counts["checkpoint"]:
                undo_cache = _hf_cache.disable_use_cache(self.model)[1]
            chosen = [m for (_, m), layer in zip(self.units, plan.layers) if layer.techniques]
            return self.step.tracked(chosen)
        finally:
            if undo_cache is not None:
                undo_cache()
            executor.detach()


class SimulationSession:
    """Simulated training steps of one model and batch, on fake tensors.

    Entering it sets up the fake world, runs the warm-up step (its forward
    measured by the C profiler, as ``wrap()``'s static profiling measures
    it; ``read_profile(profiler, units)`` makes :attr:`profile` of the
    measurement) and simulates the unoptimized step once; the step under a
    plan is simulated when first asked for (once per plan).  The model's
    parameters and buffers are fake while it is open.  Making the plans is
    the caller's job (``memscale._planner.PredictionSession``).
    """

    def __init__(
        self,
        model: nn.Module,
        sample_input: Any,
        optimizer: torch.optim.Optimizer | None,
        hardware: dict[str, Any],
        sim_device: torch.device,
        *,
        loss_fn: Callable[[Any], Any] | None,
        read_profile: Callable[[Any, list[tuple[str, nn.Module]]], Any],
    ) -> None:
        self.model = model
        self.hardware = hardware
        self._sim = _Simulation(
            model, sample_input, optimizer, loss_fn, sim_device, hardware["device"], read_profile
        )
        self._traces: dict[str, _Trace] = {}
        self._workspace: dict[Any, _Kernel] = {}
        self._unprobed: dict[str, int] = {}
        self.is_open = False

    def _guard(self, what: Callable[[], Any]) -> Any:
        try:
            return what()
        except (TypeError, ValueError):
            raise
        except Exception as exc:
            raise RuntimeError(
                f"memscale could not simulate a training step of "
                f"{type(self.model).__name__} on fake tensors ("
                f"{type(exc).__name__}: {exc}). Check that a real step runs "
                "with this sample_input; an operator without a fake "
                "implementation, or a model that reads tensor values to "
                "choose what to do, cannot be predicted"
            ) from exc

    def __enter__(self) -> SimulationSession:
        self._guard(self._sim.__enter__)
        self.is_open = True
        try:
            self._unoptimized = self._guard(self._sim.unoptimized)
            self._probe(self._unoptimized, "")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.is_open:
            self.is_open = False
            self._sim.__exit__(None, None, None)

    @property
    def profile(self) -> Any:
        """What the warm-up's forward measured, as ``read_profile`` read it."""
        return self._sim.profile

    @property
    def optimizer_name(self) -> str:
        """The class name of the optimizer simulated (AdamW without one)."""
        return self._sim.optimizer_name

    @property
    def optimizer_simulated(self) -> bool:
        """Whether the optimizer's step runs on fake tensors (False: its
        state is estimated from its class, and it has no workspace)."""
        return self._sim.optimizer_simulated

    def _probe(self, trace: _Trace, key: str) -> None:
        limit = min(PROBE_LIMIT, max(1, int(self.hardware["capacity_bytes"]) // 8))
        found, unprobed = _probe_workspace(trace.signatures(), limit)
        self._workspace.update(found)
        self._unprobed[key] = unprobed

    def _trace(self, plan: Any, config: Config) -> tuple[str, _Trace]:
        """The step simulated under ``plan`` (once per plan), and its key."""
        key = plan.hash
        if plan.technique_counts["offload"] and config.async_offload:
            # Same plan, another step: async prefetch reads ahead.
            from .offload import async_settings

            key += f"/prefetch{async_settings(config).prefetch_depth}"
        if key not in self._traces:
            self._traces[key] = self._guard(lambda: self._sim.under(plan, config, self.hardware))
            self._probe(self._traces[key], key)
        return key, self._traces[key]

    def simulated_peak(self, plan: Any, config: Config) -> int:
        """The peak bytes of the step under ``plan`` (made with ``config``)."""
        return int(self._trace(plan, config)[1].breakdown(self._workspace).peak_bytes)

    def unoptimized_peak(self) -> int:
        """The peak bytes of the unoptimized step."""
        return int(self._unoptimized.breakdown(self._workspace).peak_bytes)

    def breakdowns(self, plan: Any, config: Config) -> tuple[PeakBreakdown, PeakBreakdown, int]:
        """The unoptimized step and the step under ``plan`` (the unoptimized
        one when the plan checkpoints nothing), and the kernel calls of the
        two whose scratch memory was not measured."""
        key, trace = "", self._unoptimized
        if plan.technique_counts["checkpoint"]:
            key, trace = self._trace(plan, config)
        return (
            self._unoptimized.breakdown(self._workspace),
            trace.breakdown(self._workspace),
            self._unprobed[""] + self._unprobed.get(key, 0),
        )
