"""Type stubs for memscale._core, the C extension (internal API)."""

from typing import Any, Callable, Sequence

import torch

ABI: str
TECH_CHECKPOINT: int
TECH_OFFLOAD: int
TECH_TILING: int

def find_units(model: torch.nn.Module, /) -> list[tuple[str, torch.nn.Module]]: ...
def detect_hardware(device_type: str, index: int = 0) -> dict[str, Any]: ...
def build_plan(
    layers: Sequence[tuple[str, str, int, int, int, float, int]],
    *,
    mode: str,
    allowed: int,
    force: bool,
    budget_bytes: int,
    fixed_bytes: int,
    activation_bytes: int,
    total_flops: float,
    device: str,
    device_count: int,
    capacity_bytes: int,
) -> Plan: ...

class LayerPlan:
    index: int
    name: str
    kind: str
    techniques: tuple[str, ...]
    rule: str
    bytes_saved: int
    param_bytes: int
    saved_bytes: int
    input_bytes: int
    flops: float

class Plan:
    layers: tuple[LayerPlan, ...]
    mode: str
    device: str
    hash: str
    device_count: int
    capacity_bytes: int
    budget_bytes: int
    fixed_bytes: int
    activation_bytes: int
    peak_unoptimized_bytes: int
    peak_projected_bytes: int
    pressure: float
    total_flops: float
    recompute_ratio: float
    skipped: bool
    fits: bool
    @property
    def technique_counts(self) -> dict[str, int]: ...
    def to_json(self) -> str: ...
    def __len__(self) -> int: ...

class Profiler:
    total_saved_bytes: int
    total_flops: float
    passes: int
    in_pass: bool
    def __init__(self, units: Sequence[torch.nn.Module],
                 param_tensors: Sequence[torch.Tensor],
                 flop_counter: Any = None) -> None: ...
    def attach(self) -> None: ...
    def detach(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def begin_pass(self) -> None: ...
    def end_pass(self, ok: bool = True) -> None: ...
    def results(self) -> list[dict[str, Any]]: ...

class Executor:
    plan: Plan | None
    state: str
    model: torch.nn.Module | None
    stats: dict[str, int]
    layer_names: tuple[str, ...]
    def __init__(self, model: torch.nn.Module,
                 units: Sequence[tuple[str, torch.nn.Module]],
                 *, warmup_steps: int = 2) -> None: ...
    def apply(self, plan: Plan, /) -> None: ...
    def start_profiling(self, profiler: Profiler,
                        on_profiled: Callable[[Profiler], Plan], /) -> None: ...
    def detach(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
