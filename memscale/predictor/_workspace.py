"""Kernel workspace probing: the scratch memory a kernel keeps inside one
operator call, which a fake tensor cannot show, measured by running each
distinct call once for real on zero-filled tensors (on the device the
step is simulated on) under the memory profiler; and on CUDA the
libraries' persistent workspaces (cuBLAS keeps one per handle, and a
training step uses two: the forward's thread and autograd's)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint

from .. import _measure as measure
from .. import _torch_compat
from .._tree import tensors_in

logger = logging.getLogger(__name__)

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
# The CUDA caching allocator's least block and rounding (kMinBlockSize in
# c10/cuda/CUDACachingAllocator.cpp): a request of n bytes takes a block of
# n rounded up to a multiple of it, and the allocator's statistics and the
# profiler's memory events count the block.
CUDA_GRANULE = 512


def in_blocks(nbytes: int, granule: int = CUDA_GRANULE) -> int:
    """``nbytes`` rounded up to a multiple of ``granule``: the block a
    request of that many bytes takes."""
    return -(-nbytes // granule) * granule


# A call is run for real only if its inputs and outputs take at most this
# many bytes (and at most 1/8 of the device's capacity); larger ones are not
# probed, and PeakPrediction.unprobed_calls counts them.
PROBE_LIMIT = 256 << 20

# On CUDA the kernels that keep scratch memory are many and vary with the
# library versions (cuDNN's convolution workspaces, reductions' staging
# buffers, attention backward, a loss's elementwise buffer: measured on an
# H100 with torch 2.11, scripts/gpu_scratch.py), so every distinct call of
# an aten operator is probed there, except views (they allocate nothing),
# random operators (running one would advance the device's generator),
# operators whose output depends on the values (on zeros they measure an
# empty result, and they synchronize), assertions (a zero condition fails
# on the device, and a device-side assert ends the process's CUDA context)
# and operators that read indices a zero cannot stand for (LU pivots are
# 1-based).
_NEVER_PROBED = frozenset(
    (
        "_local_scalar_dense",
        "equal",
        "record_stream",
        "set_",
        "resize_",
        "lu_unpack",
        "lu_solve",
        "linalg_lu_solve",
        "linalg_ldl_solve",
    )
)
_VALUE_TAGS = tuple(
    getattr(torch.Tag, name)
    for name in ("nondeterministic_seeded", "dynamic_output_shape", "data_dependent_output")
    if hasattr(torch.Tag, name)
)


def probe_on_device(func: Any) -> bool:
    """Whether a CUDA step's call of ``func`` is probed (see above)."""
    try:
        if func.namespace != "aten" or func.is_view:
            return False
        if any(tag in func.tags for tag in _VALUE_TAGS):
            return False
        name = func._schema.name.partition("::")[2]
    except AttributeError:  # not an OpOverload
        return False
    return "assert" not in name and name not in _NEVER_PROBED


_WORKSPACE_OP_SET: frozenset[Any] | None = None


def workspace_ops() -> frozenset[Any]:
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
    device: str = "cpu"

    @property
    def nbytes(self) -> int:
        if not self.shape:
            return self.dtype.itemsize
        span = 1 + sum((n - 1) * st for n, st in zip(self.shape, self.stride) if n)
        return span * self.dtype.itemsize if all(self.shape) else 0

    def make(self) -> torch.Tensor:
        return torch.empty_strided(
            self.shape, self.stride, dtype=self.dtype, device=self.device
        ).zero_()


def _spec(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.layout is not torch.strided:
            raise TypeError("only strided tensors can be remade")
        return _TensorSpec(tuple(obj.shape), tuple(obj.stride()), obj.dtype, str(obj.device))
    if isinstance(obj, (tuple, list)):
        return tuple(_spec(o) for o in obj)
    hash(obj)  # TypeError for anything a signature cannot hold
    return obj


def signature(func: Any, args: Any, kwargs: Mapping[str, Any]) -> Any:
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
class Kernel:
    """What one kernel call really allocates beyond its fake twin."""

    scratch: int  # peak bytes inside the call, not returned
    returned: tuple[int, ...]  # storage bytes of each tensor returned


# (signature, threads) -> Kernel, for this process.
_PROBED: dict[tuple[Any, int], Kernel] = {}


def probe_workspace(signatures: Mapping[Any, int], limit: int) -> tuple[dict[Any, Kernel], int]:
    """Scratch bytes of each kernel call, measured by running it once on
    real zero-filled tensors on its device under the memory profiler (as
    memscale._measure does): the allocator's peak inside the
    call minus the bytes it returns.  Returns the figures and the number of
    calls not probed (inputs and outputs above ``limit`` bytes, a call
    that fails on zero-filled inputs, or a profiler is already running).  ``signatures`` maps each call to the
    bytes its fake twin returned."""
    threads = torch.get_num_threads()
    out: dict[Any, Kernel] = {}
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
    if measure.profiler_active():
        logger.info(
            "memscale: a torch profiler is running; kernel scratch "
            "memory of %d operator calls is not measured",
            len(todo),
        )
        return out, skipped + len(todo)
    for device_type in sorted({_device_type(sig) for sig in todo}):
        batch = [sig for sig in todo if _device_type(sig) == device_type]
        found, failed = _probe_batch(batch, device_type, threads)
        out.update(found)
        skipped += failed
    return out, skipped


def _device_type(sig: Any) -> str:
    """The device type of a call's tensors (the first one's: "cpu" when it
    has none)."""
    stack = [sig[1], tuple(v for _, v in sig[2])]
    while stack:
        item = stack.pop(0)
        if isinstance(item, _TensorSpec):
            return torch.device(item.device).type
        if isinstance(item, tuple):
            stack[:0] = list(item)
    return "cpu"


@contextlib.contextmanager
def _rng_kept(device_type: str) -> Any:
    """Puts the generators back as they were: no probed call should draw
    from them (random operators are not probed), and a kernel that does
    anyway must not shift the user's random stream."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if device_type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _probe_batch(todo: list[Any], device_type: str, threads: int) -> tuple[dict[Any, Kernel], int]:
    """Probe the calls of ``todo`` (all on ``device_type``): the figures,
    and how many calls could not run on zero-filled inputs."""
    tools = _torch_compat.fake_tensor_tools()
    real = tools[1]() if tools is not None else contextlib.nullcontext()
    calls: dict[int, tuple[int, tuple[int, ...]]] = {}
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with measure.quiet_profiler("probe start"):
        prof.start()
    try:
        with real, torch.no_grad(), _rng_kept(device_type):  # real tensors, also in a fake world
            for i, sig in enumerate(todo):
                func, args, kwargs = _call_of(sig)
                held = {
                    id(t.untyped_storage()) for t in tensors_in((args, kwargs))
                }  # alive through the call: their storages are not returned
                try:
                    func(*args, **kwargs)  # first call: caches, lazy init, algorithm choice
                    with record_function(f"memscale::probe{i}"):
                        result = func(*args, **kwargs)
                except Exception as exc:  # noqa: BLE001 - a call that needs other values
                    logger.debug("memscale: %s not probed (%s: %s)", func, type(exc).__name__, exc)
                    continue
                sizes = {}
                per_output = []
                for t in tensors_in(result):
                    st = t.untyped_storage()
                    nbytes = 0 if id(st) in held else st.nbytes()
                    if device_type == "cuda" and nbytes:
                        # the block it took: the profiler's events count
                        # blocks, so the scratch is what is left above them
                        nbytes = in_blocks(nbytes)
                    sizes[id(st)] = nbytes
                    per_output.append(nbytes)
                calls[i] = (sum(sizes.values()), tuple(per_output))
                del result, args, kwargs
            if device_type == "cuda":
                torch.cuda.synchronize()
    finally:
        with measure.quiet_profiler("probe stop"):
            prof.stop()
    raw = _torch_compat.profiler_memory_events(prof, device_type)
    if raw is None:  # pragma: no cover - depends on the torch build
        return {}, len(todo)
    windows: dict[int, tuple[int, int]] = {}
    memory = []
    for name, begin, end, nbytes in raw:
        if name.startswith("memscale::probe"):
            windows[int(name[len("memscale::probe") :])] = (begin, end)
        elif name == "[memory]":
            memory.append((begin, nbytes))
    memory.sort(key=lambda e: e[0])
    out: dict[Any, Kernel] = {}
    for i, sig in enumerate(todo):
        if i not in calls:
            continue
        begin, end = windows[i]
        peak, _ = measure.running_peak(e for e in memory if begin <= e[0] <= end)
        returned, returned_each = calls[i]
        kernel = Kernel(max(0, peak - returned), returned_each)
        _PROBED[(sig, threads)] = out[sig] = kernel
    return out, len(todo) - len(calls)


# device index -> bytes, for this process (see library_workspace_bytes).
_LIBRARIES: dict[int, int] = {}


def library_workspace_bytes(device: torch.device) -> int:
    """The bytes the libraries keep allocated on a CUDA ``device`` once a
    training step has run: cuBLAS's workspace of the calling thread's
    handle (its matmuls in forward) and of autograd's device thread (its
    matmuls in backward), 2 x 32 MiB, plus cuBLASLt's 1 MiB for the
    products with a bias in forward, and 1 MiB more once a recompute has
    run such products on autograd's thread (66 MiB in all on an H200 with
    torch 2.11; a step without recompute keeps 65).  A checkpointed
    64-to-64 linear layer alone did not make that last MiB there, a
    checkpointed MLP of two products with a bias and a GELU between did
    (as GPT-2's): that is what this runs.  Measured once per device and
    process: the workspaces are given back
    (``torch._C._cuda_clearCublasWorkspaces``, as torch's own CUDA graph
    trees do; the next matmul makes them again), then the MLP runs forward
    and backward, plainly and checkpointed, and what stays allocated is
    the answer (so an unoptimized step is predicted 1 MiB high).  0 for
    any other device type."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _LIBRARIES:
        return _LIBRARIES[index]
    if torch.is_inference_mode_enabled() or torch.cuda.is_current_stream_capturing():
        # No backward can run (inference mode), or no host synchronization
        # may (a CUDA graph is being captured): not measured now.
        logger.info(
            "memscale: cuBLAS's workspaces on cuda:%d not measured (inference mode or a "
            "CUDA graph capture); predicted peaks leave them out",
            index,
        )
        return 0
    try:
        kept = _measure_libraries(index)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        logger.warning(
            "memscale: cuBLAS's workspaces on cuda:%d could not be measured (%s: %s); "
            "predicted peaks leave them out",
            index,
            type(exc).__name__,
            exc,
        )
        return 0
    _LIBRARIES[index] = kept
    return kept


def _saved_tensor_hooks_enabled() -> bool:
    check = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return True if check is None else bool(check())


def _measure_libraries(index: int) -> int:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    tools = _torch_compat.fake_tensor_tools()
    real = tools[1]() if tools is not None else contextlib.nullcontext()
    with real, torch.cuda.device(index), torch.enable_grad():
        # The workspaces of every device and stream are given back: none
        # may be in use by a kernel still running.
        for other in range(torch.cuda.device_count()):
            torch.cuda.synchronize(other)
        if clear is not None:
            clear()
        before = torch.cuda.memory_allocated(index)
        x = torch.zeros(4, 128, 64, device=f"cuda:{index}", requires_grad=True)
        w = torch.zeros(64, 256, device=f"cuda:{index}", requires_grad=True)
        b = torch.zeros(256, device=f"cuda:{index}", requires_grad=True)
        w2 = torch.zeros(256, 64, device=f"cuda:{index}", requires_grad=True)
        b2 = torch.zeros(64, device=f"cuda:{index}", requires_grad=True)

        def mlp(x: torch.Tensor, w=w, b=b, w2=w2, b2=b2) -> torch.Tensor:
            # GPT-2's MLP: two products with a bias, a GELU between.
            h = torch.nn.functional.gelu(torch.addmm(b, x.view(-1, 64), w), approximate="tanh")
            return torch.addmm(b2, h, w2).view(4, 128, 64)

        try:
            (mlp(x) @ w).sum().backward()
            if _saved_tensor_hooks_enabled():
                # (Where saved-tensor hooks are disabled no checkpoint can
                # run: the recompute's workspace is not counted.)
                recomputed = checkpoint(mlp, x, use_reentrant=False)
                (recomputed @ w).sum().backward()
                del recomputed
        finally:
            del x, w, b, w2, b2, mlp
        torch.cuda.synchronize(index)
        return max(0, torch.cuda.memory_allocated(index) - before)
