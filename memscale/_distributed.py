"""memscale under ``torch.distributed``: one plan for every rank.

memscale composes with PyTorch's own engines (DistributedDataParallel,
FSDP2's ``fully_shard``); it never distributes anything itself.  What it
adds is agreement: the engine's inputs can differ slightly between ranks
(free memory, a budget set per rank), and ranks that checkpoint or offload
different layers would differ in memory and speed for no reason.  So, when a
process group is initialized with more than one rank, ``wrap`` decides the
plan once:

1. every rank reaches a ``monitored_barrier`` (gloo) with a timeout, so a
   rank that never calls ``wrap`` is named in the error instead of hanging
   the others;
2. the ranks' budgets are gathered and the smallest is used;
3. rank 0 sends its planning problem (``_solve.PlanProblem``, plain data:
   the profiled layers and the figures) with that budget; every rank builds
   the plan from it, so the plan and its hash are the same on every rank,
   and each rank logs it.

Under FSDP2 the engine counts what a rank holds: parameter, gradient and
optimizer-state shards (the DTensors' local storage) plus the largest
FSDP unit's parameters unsharded, which are all-gathered while it runs.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from ._solve import PlanProblem, solve

logger = logging.getLogger(__name__)

# Seconds every rank has to reach memscale's plan exchange
# (MEMSCALE_DIST_TIMEOUT overrides).
DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 86400.0


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def active() -> bool:
    """A process group with more than one rank is initialized."""
    if not torch.distributed.is_available():
        return False
    dist = _dist()
    return dist.is_initialized() and dist.get_world_size() > 1


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or a submodule."""
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def is_fsdp2_module(module: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` itself."""
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (as FSDP2's sharded parameters are)."""
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def _full_bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()  # a DTensor's numel is the global one


def fsdp2_in_flight_bytes(model: torch.nn.Module) -> int:
    """The largest FSDP unit's parameters, unsharded: what the all-gather of
    the unit that runs holds on top of the shards."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    largest = 0
    for unit in units:
        nested = [m for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)]
        own = {id(p): p for p in unit.parameters()}
        for child in nested:
            for p in child.parameters():
                own.pop(id(p), None)
        largest = max(largest, sum(_full_bytes(p) for p in own.values()))
    return largest


def timeout_seconds() -> float:
    raw = os.environ.get("MEMSCALE_DIST_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    # Finite and at most a day: the barrier's timedelta and the process
    # group's timeout take no infinity or NaN (and a week-long hang helps
    # no one); unset the variable for the default.
    if not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(
            f"MEMSCALE_DIST_TIMEOUT must be a number of seconds > 0 and at most "
            f"{MAX_TIMEOUT_S:g} (a day), got {raw!r}; unset it for the default "
            f"({DEFAULT_TIMEOUT_S:g} s)"
        )
    return value


def _barrier(timeout: float) -> None:
    dist = _dist()
    rank = dist.get_rank()
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
        else:
            # NCCL has no monitored barrier: the process group's own timeout
            # applies.  (Unverified: this project has no GPU.)
            dist.barrier()
    except RuntimeError as exc:
        raise RuntimeError(
            f"memscale: rank {rank}: not every rank reached memscale's plan "
            f"exchange within {timeout:g} s ({exc}). Every rank must call "
            "memscale.wrap on its model at the same point (and, without "
            "sample_input, train the same number of warm-up steps); "
            "MEMSCALE_DIST_TIMEOUT sets the time allowed."
        ) from exc


def union_of_ranks(indices: set[int]) -> set[int]:
    """The union of every rank's ``indices`` (a collective: every rank must
    call it at the same point); not distributed: ``indices``."""
    if not active():
        return set(indices)
    dist = _dist()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(indices))
    return {int(i) for part in gathered for i in part}


def shared_plan(
    problem: PlanProblem,
    *,
    timeout: float | None = None,
    build: Callable[[PlanProblem], Any] = solve,
) -> Any:
    """The plan every rank uses: rank 0's planning problem, with the
    smallest budget of all ranks.  ``problem`` is this rank's.  Not
    distributed (or one rank): the plan of ``problem``.  ``build`` makes
    the plan of a problem (a test's seam)."""
    if not active():
        return build(problem)
    dist = _dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    _barrier(timeout_seconds() if timeout is None else timeout)
    budgets: list[Any] = [None] * world
    dist.all_gather_object(budgets, problem.budget_bytes)
    smallest = min(int(b) for b in budgets)
    payload = [problem.replace(budget_bytes=smallest) if rank == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    chosen = payload[0]
    assert chosen is not None  # broadcast_object_list filled it
    plan = build(chosen)
    logger.info(
        "memscale: rank %d of %d: plan %s, decided on rank 0 with the "
        "smallest budget of all ranks (%d bytes; this rank's: %d)",
        rank,
        world,
        plan.hash[:12],
        smallest,
        problem.budget_bytes,
    )
    return plan
