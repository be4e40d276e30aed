"""What a prediction returns: the peak's breakdown by category, the
prediction under a plan and the savings estimate, each printing as a
table."""

from __future__ import annotations

import dataclasses
from typing import Any

from .._format import format_bytes

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
    # activations, optimizer intermediates, kernels' scratch), and on CUDA
    # the libraries' persistent workspaces
    # (PeakPrediction.library_workspace_bytes).
    workspace: int
    # Where the peak falls: "start" (before zero_grad), "forward",
    # "backward" or "optimizer".
    phase: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_libraries(self, nbytes: int) -> PeakBreakdown:
        """This breakdown with ``nbytes`` of the libraries' workspaces,
        alive all step long, added to the peak (as workspace)."""
        if not nbytes:
            return self
        return dataclasses.replace(
            self, peak_bytes=self.peak_bytes + nbytes, workspace=self.workspace + nbytes
        )


@dataclasses.dataclass(frozen=True)
class PeakPrediction:
    """What :func:`predict_peak` returns; ``str()`` prints it as a table."""

    # The model as it is.
    unoptimized: PeakBreakdown
    # Under the plan memscale.wrap() would apply with this Config (equal to
    # ``unoptimized`` when the plan applies nothing, e.g. smart-skip).
    optimized: PeakBreakdown
    # The first training step after wrap() under the plan: no gradients or
    # optimizer state when it starts (unless the optimizer given has
    # state), and each checkpointed layer checked once (its saved tensors
    # held while it runs a second time; memscale._recompute_check).
    first_step: PeakBreakdown
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
    # always 0 where the simulated device's runtime is absent and no
    # kernel is probed).
    unprobed_calls: int
    # Bytes the libraries keep on the device once a step has run, included
    # in every breakdown's workspace and peak: on CUDA the cuBLAS
    # workspaces of the forward's and autograd's threads, measured on the
    # device (about 65 MiB on an H100 with torch 2.11); 0 on CPU.
    library_workspace_bytes: int
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
        """Whether the steps fit the usable memory under memscale's plan:
        the steady-state step and the first one."""
        return max(self.optimized.peak_bytes, self.first_step.peak_bytes) <= self.budget_bytes

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
        out["first_step"] = self.first_step.to_dict()
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
            (
                "first step's peak",
                "",
                _fmt(self.first_step.peak_bytes),
            )
        )
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
