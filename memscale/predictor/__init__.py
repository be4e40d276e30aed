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

* Warm-up, untracked: the forward runs under the C profiler exactly as
  ``wrap()``'s static profiling runs it (``_planning.fake_pass``), so the
  plan made from it is the plan ``wrap`` makes; a zero gradient for every parameter
  the loss reaches and one optimizer step create the optimizer state, as
  in a steady-state step.
* The unoptimized step, tracked from the state a steady-state step starts
  in (parameters, buffers, gradients, optimizer state, inputs).
* The step under the plan, tracked, with the real C executor attached to
  the model: checkpointed layers are really recomputed in backward, on
  fake tensors.  The RNG state each checkpoint frame keeps (a real tensor
  made outside any operator; one per segment, none in the device's memory
  on CUDA) is stood in for by a fake tensor of its size, and so is the
  copy of the caller's RNG state a recompute holds while it runs.

Three things a pure fake step would get wrong are handled:

* Model code that branches on tensor values (Hugging Face attention masks
  check the position ids): small integer inputs stay real, and operators
  whose arguments are all real run for real when their result is small
  (``REAL_VALUE_LIMIT``, ``memscale._smallvalues``), so the branch a real
  step takes is taken; in every fake pass, the profile's too.
* Kernels that keep scratch memory inside one operator call (oneDNN
  convolutions) or return a storage larger than their result (CPU
  ``mse_loss`` returns its elementwise buffer): each distinct call of the
  operators in ``_workspace._WORKSPACE_OPS`` (on CUDA: of every aten
  operator but views and random ones, ``_workspace.probe_on_device``) is
  run once for real on zero-filled tensors of its device under the memory
  profiler, and what it really allocates is put into the event sequence
  (where the device's runtime is here; ``PROBE_LIMIT``).  On CUDA the
  cuBLAS workspaces a step keeps (one per thread that runs matmuls) are
  measured once per process and device and added to every peak
  (``PeakPrediction.library_workspace_bytes``).
* Python's garbage collector is off during a tracked step, so frees happen
  at refcount zero only and the figure is the same every run.

What keeps it cheap, without changing one event: most of a simulated
step's time is FakeTensorMode's Python dispatch.  The storage tracker
answers ``prim.device`` (which torch's autograd engine asks a fake tensor
some 25 times per layer of backward) with the fake tensor's device itself,
and calls every other operator through ``_torch_compat.fake_calls``, which
reads FakeTensorMode's own dispatch cache through a cheaper key (the same
values: each tensor's metadata, the other arguments, the same global
state) and makes the output with FakeTensorMode's own method; the
warm-up's operators go the same way (``_tracker.FakeCaller``, below the
profiler's modes), and the caller counts their FLOPs for the profiler
(``_tracker.FlopTally``: FlopCounterMode's formulas, without its mode).  The steady-state optimizer step is simulated once and
replayed in later steps (``StorageTracker.recorded``); for torch's Adam and
AdamW it is the warm-up's first update less the state that update made
(``StorageTracker.recorded_less_kept``), so the optimizer runs once in all.

What the prediction counts is what ``memscale._measure``
measures: the bytes of live tensor storages, and on CUDA the libraries'
workspaces, each storage in the caching allocator's block (its bytes
rounded up to 512) and host tensors not at all, as
``torch.cuda.max_memory_allocated`` counts them.  Not counted: other
memory that is not a tensor, scratch memory of kernels outside those,
and on CUDA the caching allocator's unsplit blocks (a request served by a
cached block up to 1 MiB larger counts the whole block) and reserve.

One file per job: ``_device`` (the device predicted for), ``_results`` (what
a prediction returns), ``_tree`` (tensors in nested containers),
``_workspace`` (kernel scratch memory), ``_tracker`` (the dispatch mode
that counts storages), ``_fake`` (the fake world), ``_step`` (one
simulated step) and ``_session`` (the simulated steps of one model and
batch).
"""

from ._device import DeviceSpec, resolve_device
from ._fake import REAL_VALUE_LIMIT
from ._results import (
    CATEGORIES,
    PHASES,
    PeakBreakdown,
    PeakPrediction,
    SavingsEstimate,
    predicted_time_ratio,
)
from ._session import SimulationSession
from ._step import default_loss, rebuild_optimizer
from ._workspace import PROBE_LIMIT, library_workspace_bytes

__all__ = [
    "CATEGORIES",
    "PHASES",
    "PROBE_LIMIT",
    "REAL_VALUE_LIMIT",
    "DeviceSpec",
    "PeakBreakdown",
    "PeakPrediction",
    "SavingsEstimate",
    "SimulationSession",
    "default_loss",
    "library_workspace_bytes",
    "predicted_time_ratio",
    "rebuild_optimizer",
    "resolve_device",
]
