"""The first optimizer update of a deep model, recorded from a few of its
parameters.

torch's Adam and AdamW without foreach or fused kernels
(``torch.optim.adam._single_tensor_adam``) update one parameter at a
time: an iteration of a Python loop reads the i-th parameter, gradient and
state tensors, and keeps nothing past the next iteration but the locals
it rebinds there (``denom``; ``grad`` with ``maximize``).  So the events
of iteration i (what it makes and frees, what it frees of the iteration
before) depend only on the layouts of the parameters i - 1 and i, and the
update of a 1,000-layer chain, 26,000 simulated calls, repeats a handful
of iterations.

:func:`recorded_update` runs the first update of an optimizer of the same
class and settings over a few of the parameters, one pair per distinct
(layout before, layout) and the last pair, tracked and cut at the start
of each iteration, and splices the steady update's events of the whole
loop from those iterations; the state of every parameter is a copy of the
state its layout's representative got.  It checks what it relies on as it
reads the iterations (nothing before the loop but the state, nothing
freed that is older than the iteration before, the same events wherever a
pair came twice) and declines (None) where any check fails, or where the
optimizer is not one it knows: then the update runs whole.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from .._tree import tensor_list
from ._tracker import Recording

# The loop of one parameter group: (layout, layout before) per parameter.
_Key = tuple[Any, Any]

# Fewer parameters than this in a group: all of the group's are run (the
# other groups' may still be spliced).
MIN_PARAMETERS = 16


def _layout(p: torch.Tensor) -> tuple[Any, ...]:
    """What an iteration's events can depend on of its parameter: the
    parameter's and its gradient's layout and storage (its state is made
    like it, ``zeros_like``)."""
    g = p.grad
    assert g is not None
    return (
        tuple(p.shape),
        p.stride(),
        p.storage_offset(),
        p.dtype,
        p.device,
        p.untyped_storage().nbytes(),
        p.is_complex(),
        tuple(g.shape),
        g.stride(),
        g.storage_offset(),
        g.dtype,
        g.untyped_storage().nbytes(),
        g.layout,
    )


def _global_hooks() -> bool | None:
    """Whether optimizer step hooks are registered for every optimizer
    (``torch.optim.optimizer.register_optimizer_step_pre_hook`` and
    ``_post_hook``: they would run over the few parameters only); None
    when this torch keeps them where this does not look."""
    module = sys.modules.get("torch.optim.optimizer")
    tables = [getattr(module, name, None) for name in _GLOBAL_HOOKS]
    if any(not isinstance(t, dict) for t in tables):
        return None
    return any(tables)


_GLOBAL_HOOKS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


def supported(optimizer: Any) -> bool:
    """Whether ``optimizer`` runs torch's one-parameter-at-a-time Adam loop
    (Adam or AdamW themselves, each group without foreach, fused,
    capturable or differentiable, its betas and learning rate numbers,
    each parameter once), has the ``_init_group`` this module cuts at, and
    no hook of its own or of every optimizer runs around its step."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    if not callable(getattr(optimizer, "_init_group", None)):
        return False
    if _global_hooks() is not False:
        return False
    for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        if getattr(optimizer, name, None):
            return False
    ids = [id(p) for group in optimizer.param_groups for p in group["params"]]
    if len(ids) != len(set(ids)):
        return False  # (torch steps a parameter given twice twice)
    for group in optimizer.param_groups:
        if group.get("foreach") is not False or group.get("fused"):
            return False
        if group.get("capturable") or group.get("differentiable"):
            return False
        if any(isinstance(v, torch.Tensor) for v in (group.get("lr"), *group.get("betas", ()))):
            return False
    return True


def _chosen(layouts: list[Any]) -> list[int]:
    """Indices of the parameters whose update is run: each (layout before,
    layout) pair where it first comes, with the parameter before it, and
    the last two (the loop's last iteration, and what follows it)."""
    n = len(layouts)
    keep = {0, n - 2, n - 1}
    seen: set[_Key] = set()
    for i in range(n):
        key = (layouts[i - 1] if i else None, layouts[i])
        if key not in seen:
            seen.add(key)
            keep.update((i - 1, i) if i else (i,))
    return sorted(keep)


class _Marks(torch.utils._python_dispatch.TorchDispatchMode):
    """Above the tracker during the update: the event index where each
    iteration of each group's loop starts (its first call touching the
    iteration's parameter, gradient or state), after that group's
    ``_init_group``."""

    def __init__(self, tracker: Any, optimizer: Any, chosen: list[list[torch.Tensor]]) -> None:
        super().__init__()
        self.tracker = tracker
        self.optimizer = optimizer
        self.chosen = chosen
        self.group = -1
        self.owner: dict[int, int] = {}
        self.starts: list[list[int]] = [[] for _ in chosen]
        self.inits: list[int] = []

    def begin_group(self) -> None:
        """The next group's ``_init_group`` starts."""
        self.group += 1
        self.inits.append(len(self.tracker.events))
        self.owner = {}

    def end_init(self) -> None:
        """Its ``_init_group`` made the state: the loop comes next."""
        owner: dict[int, int] = {}
        for k, p in enumerate(self.chosen[self.group]):
            tensors = [p, p.grad, *self.optimizer.state[p].values()]
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    owner.setdefault(id(t), k)
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.owner:
            starts = self.starts[self.group]
            for t in tensor_list((args, kwargs)):
                k = self.owner.get(id(t))
                if k is not None and k == len(starts):
                    starts.append(len(self.tracker.events))
                    break
        return func(*args, **(kwargs or {}))


def _subset(optimizer: Any, chosen: list[list[torch.Tensor]]) -> Any:
    """An optimizer of ``optimizer``'s class and settings over the
    ``chosen`` parameters of each group (torch.optim.Optimizer keeps
    settings in the groups)."""
    cls = type(optimizer)
    groups = []
    for group, params in zip(optimizer.param_groups, chosen):
        new = {k: v for k, v in group.items() if k != "params"}
        new["params"] = params
        groups.append(new)
    sig = inspect.signature(cls.__init__)
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in sig.parameters}
    return cls(groups, **kwargs)


def recorded_update(
    optimizer: Any,
    make_tracker: Callable[[], Any],
    world: Any,
    copy_state: Callable[[torch.Tensor], torch.Tensor],
) -> Recording | None:
    """The steady update's events of ``optimizer`` (its first update, less
    the state it makes), made from the first update of a few of its
    parameters (see the module), and the state of every parameter put in
    ``optimizer.state`` as its first update would leave it (each tensor a
    copy, ``copy_state``, of its layout's representative's).  None, and
    ``optimizer`` untouched: not an optimizer this module knows, too few
    parameters to gain, or a check failed (run the update whole).
    ``make_tracker()``: a StorageTracker for the update, with the
    parameters and gradients of ``world`` tracked and its phase set."""
    if not supported(optimizer) or optimizer.state:
        return None
    params = [[p for p in g["params"] if p.grad is not None] for g in optimizer.param_groups]
    for p in (p for ps in params for p in ps):
        assert p.grad is not None
        if p.grad.is_sparse or not p.numel() or not p.grad.numel():
            # (a zero-byte storage is a serial without events: not spliced)
            return None
    layouts = [[_layout(p) for p in ps] for ps in params]
    picks = [_chosen(ls) if len(ls) >= MIN_PARAMETERS else list(range(len(ls))) for ls in layouts]
    if sum(map(len, picks)) * 2 > sum(map(len, params)):
        return None
    chosen = [[ps[i] for i in pick] for ps, pick in zip(params, picks)]
    small = _subset(optimizer, chosen)
    tracker = make_tracker()
    marks = _Marks(tracker, small, chosen)
    init = small._init_group

    def init_group(*args: Any, **kwargs: Any) -> Any:
        marks.begin_group()
        out = init(*args, **kwargs)
        marks.end_init()
        return out

    small._init_group = init_group
    try:
        with tracker:
            since = tracker.mark()
            with world.small.narrowed(), marks:
                small.step()
            spliced = _splice(tracker, since, marks, layouts, picks)
    finally:
        tracker.close()
        del small._init_group
    if spliced is None:
        return None
    for state in small.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and getattr(v, "constant", None) is not None:
                # A fake step counter whose value the fake mode propagates
                # (no real small values): a copy would not carry it.
                return None
    for ps, pick, ls in zip(params, picks, layouts):
        rep = {ls[i]: ps[i] for i in pick}
        for p, layout in zip(ps, ls):
            source = small.state[rep[layout]]
            if p is rep[layout]:
                optimizer.state[p] = source
            else:
                optimizer.state[p] = {
                    k: copy_state(v) if isinstance(v, torch.Tensor) else v
                    for k, v in source.items()
                }
    return spliced


def _splice(
    tracker: Any,
    since: tuple[int, int, int],
    marks: _Marks,
    layouts: list[list[Any]],
    picks: list[list[int]],
) -> Recording | None:
    """The whole loop's steady events from the iterations run (see
    :func:`recorded_update`), or None where a check fails."""
    at, first, calls = since
    if (tracker.kernel_calls or [])[calls:]:
        return None
    events = tracker.events
    if any(serial < first for serial, _ in events[at:]):
        return None
    transient = {s for s in range(first, len(tracker.sizes)) if not tracker.sizes[s]}
    bounds = marks.inits + [len(events)]
    segments: list[list[list[tuple[int, int]]]] = []
    if len(marks.inits) != len(picks):
        return None
    for g, pick in enumerate(picks):
        starts = marks.starts[g]
        if len(starts) != len(pick):
            return None
        # Nothing before the loop but the state it makes (kept); nothing
        # in a group without a parameter to update.
        loop_at = starts[0] if starts else bounds[g + 1]
        if any(s in transient for s, _ in events[bounds[g] : loop_at]):
            return None
        ends = starts[1:] + [bounds[g + 1]]
        segments.append(
            [[(s, d) for s, d in events[lo:hi] if s in transient] for lo, hi in zip(starts, ends)]
        )
    if any(s in transient for s, _ in events[at : bounds[0]]):
        return None
    out_events: list[tuple[int, int]] = []
    sizes: list[int] = []
    categories: list[str] = []
    for g, (ls, pick) in enumerate(zip(layouts, picks)):
        if not pick:
            continue
        runs = _roles(segments[g], tracker)
        if runs is None:
            return None
        n = len(ls)
        source: dict[_Key, Any] = {}
        for k, i in enumerate(pick):
            if k == len(pick) - 1:
                break
            key = (ls[pick[k - 1]] if k else None, ls[i])
            if k and pick[k - 1] != i - 1:
                continue  # not run after the parameter before it
            if key in source and source[key] != runs[k]:
                return None  # the same pair, other events
            source.setdefault(key, runs[k])
        last = runs[-1]
        before: list[int] = []
        for i in range(n):
            key = (ls[i - 1] if i else None, ls[i])
            run = last if i == n - 1 else source.get(key)
            if run is None:
                return None
            own_events, births = run
            mine: list[int] = []
            for size, category in births:
                mine.append(len(sizes))
                sizes.append(size)
                categories.append(category)
            for older, role, delta in own_events:
                if older:
                    if role >= len(before):
                        return None
                    serial = before[role]
                    if -delta != sizes[serial]:
                        return None
                else:
                    serial = mine[role]
                out_events.append((serial, delta))
            before = mine
    return Recording(
        events=tuple(out_events),
        sizes_at_birth=tuple(sizes),
        categories=tuple(categories),
        kernel_calls=(),
    )


def _roles(
    segments: list[list[tuple[int, int]]], tracker: Any
) -> list[tuple[tuple[tuple[bool, int, int], ...], tuple[tuple[int, str], ...]]] | None:
    """Each iteration's events by role: (older, the role of the storage
    among those its iteration made, in birth order, delta), with the
    (bytes, category) of each it made; None where one frees a storage made
    before the iteration before it."""
    out = []
    previous: dict[int, int] = {}
    for segment in segments:
        own: dict[int, int] = {}
        births: list[tuple[int, str]] = []
        events = []
        for serial, delta in segment:
            if serial in own:
                events.append((False, own[serial], delta))
            elif serial in previous:
                if delta > 0:
                    return None  # an older storage grown
                events.append((True, previous[serial], delta))
            elif delta == tracker.sizes_at_birth[serial]:
                own[serial] = len(births)
                births.append((delta, tracker.categories[serial]))
                events.append((False, own[serial], delta))
            else:
                return None  # made before the iteration before
        out.append((tuple(events), tuple(births)))
        previous = own
    return out
