"""What makes ``wrap`` with a budget cheap, without changing what it
predicts: the steady-state optimizer step is simulated once per session and
replayed in every later simulated step, event for event."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import mlp, tiny_gpt2, token_batch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import memscale
from memscale import _planner, _smallvalues, _torch_compat
from memscale.benchmarks.models import BENCHMARK_MODELS
from memscale.benchmarks.runner import prepare
from memscale.config import GIB

FORCE = memscale.Config(mode="conservative", force_optimize=True, enable_logging=False)


def _gpt2():
    model = tiny_gpt2(dropout=0.0)
    return model, {"input_ids": token_batch(), "labels": token_batch()}, None


def _mlp():
    target = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    return mlp(depth=6, width=32), x, lambda out: nn.functional.mse_loss(out, target)


class _Steps:
    """Counts optimizer.step() calls (of any optimizer) while installed."""

    def __enter__(self):
        self.count = 0

        def hook(*_):
            self.count += 1

        self._handle = register_optimizer_step_pre_hook(hook)
        return self

    def __exit__(self, *exc):
        self._handle.remove()


def _budget_config(session, share=0.5):
    """A budget half way between the unoptimized step's peak and what is
    held before it starts: the planner checkpoints, so the session
    simulates the step with every layer checkpointed alone and the plan."""
    plan = session.plan(FORCE)
    unopt = session._steps.breakdowns(plan, FORCE)[0]
    held = unopt.parameters + unopt.gradients + unopt.optimizer_state + unopt.inputs
    budget = held + share * (unopt.peak_bytes - held)
    return memscale.Config(mode="conservative", memory_budget_gb=budget / GIB, enable_logging=False)


@pytest.mark.parametrize("optimizer, runs", [("adamw", 1), ("sgd-momentum", 2), ("adagrad", 2)])
def test_the_optimizer_step_is_simulated_once_per_session(optimizer, runs):
    model, x, loss_fn = _mlp()
    opt = None  # AdamW, the default
    if optimizer == "sgd-momentum":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif optimizer == "adagrad":
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    with _Steps() as steps:
        with _planner.PredictionSession(model, x, opt, loss_fn=loss_fn) as session:
            # The warm-up makes the state; the steady-state step is its
            # update less that state (Adam, AdamW), or else the unoptimized
            # step runs it once more (SGD's first step makes no momentum
            # temporaries where later ones pass the momentum as a number).
            assert steps.count == runs
            config = _budget_config(session)
            plan = session.plan(config)
            assert plan.technique_counts["checkpoint"]
            assert session.forced_peak is not None
            simulated = session._steps._traces
            assert len(simulated) >= 2, list(simulated)  # forced and the plan
    # Every later step replays it (before: one more step per simulation).
    assert steps.count == runs


@pytest.mark.parametrize(
    "case, optimizer",
    [
        (_mlp, None),
        (_gpt2, None),
        (_mlp, "sgd-momentum"),
        (_mlp, "sgd-nesterov"),
        (_mlp, "sgd-foreach"),
        (_mlp, "sgd"),
    ],
)
def test_a_replayed_optimizer_step_is_the_step_run_again(case, optimizer):
    model, x, loss_fn = case()
    opt = None
    if optimizer == "sgd-momentum":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif optimizer == "sgd-nesterov":
        opt = torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01
        )
    elif optimizer == "sgd-foreach":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _planner.PredictionSession(model, x, opt, loss_fn=loss_fn) as session:
        steps = session._steps
        step = steps._sim.step
        assert step.optimizer_replay is not None
        plan = session.plan(FORCE)
        replayed = steps._trace(plan, FORCE)[1]
        # The same step with the optimizer run for real.
        step.optimizer_replay, step.replays_optimizer = None, False
        run = steps._sim.under(plan, FORCE, steps.hardware)
    assert replayed.tracker.events == run.tracker.events
    assert replayed.tracker.phase_marks == run.tracker.phase_marks
    assert replayed.tracker.sizes_at_birth == run.tracker.sizes_at_birth
    assert list(replayed.tracker.categories) == run.tracker.categories
    assert replayed.tracker.kernel_calls == run.tracker.kernel_calls
    assert replayed.breakdown({}) == run.breakdown({})
    assert any(phase == "optimizer" for _, phase in run.tracker.phase_marks)


def test_step_counters_and_rng_stand_ins_are_real_and_made_at_once(monkeypatch):
    """The warm-up's AdamW makes its step counters real (small values:
    ``+= 1`` and ``item()`` on them run for real, not through the fake
    mode's constant propagation), and each simulated step makes the RNG
    states its checkpoint frames keep without a call through the small
    values (their size is known)."""
    calls = []
    run = _smallvalues.SmallValues.run

    def counted(self, func, args, kwargs):
        calls.append(str(func))
        return run(self, func, args, kwargs)

    monkeypatch.setattr(_smallvalues.SmallValues, "run", counted)
    model, x, loss_fn = _mlp()
    with _planner.PredictionSession(model, x, None, loss_fn=loss_fn) as session:
        opt = session._steps._sim.step.optimizer
        steps = [state["step"] for state in opt.state.values()]
        assert len(steps) == len(list(model.parameters()))
        assert not any(_torch_compat.is_fake(s) for s in steps)
        calls.clear()
        plan = session.plan(_budget_config(session))
        assert plan.technique_counts["checkpoint"]
        assert len(session._steps._traces) >= 2
    assert "aten.empty.memory_format" not in calls, calls
    assert [float(s) for s in steps] == [1.0] * len(steps)  # the warm-up's update


class _Momentum(torch.optim.Optimizer):
    """A hand-written optimizer whose state is made by a factory call that
    takes no tensor (``torch.zeros(shape)``), as third-party ones are."""

    def __init__(self, params, lr=0.01, beta=0.9):
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["buf"] = torch.zeros(p.shape, device=p.device, dtype=p.dtype)
                state["buf"].mul_(group["beta"]).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])


def test_optimizer_state_made_by_a_factory_call_stays_fake_and_is_predicted():
    """Only one-element calls run for real in the warm-up's update (the
    step counters): state an optimizer makes with ``torch.zeros(shape)``
    stays fake, allocating nothing, and the step's predicted peak is the
    measured one (a real buffer would be updated on a fake twin the
    tracker counts, a phantom buffer in the optimizer phase)."""
    from memscale.autotuning import measure_step

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    x = torch.randn(8, 64)
    opt = _Momentum(model.parameters())
    with _planner.PredictionSession(model, x, opt) as session:
        state = session._steps._sim.step.optimizer.state
        assert len(state) == 12
        assert all(_torch_compat.is_fake(s["buf"]) for s in state.values())
        predicted = session.unoptimized_peak()
    measured = measure_step(model, x, None, opt).peak_bytes
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


def test_a_step_that_keeps_what_its_optimizer_made_is_not_replayed():
    """An optimizer whose step leaves a new tensor alive (here: a fresh
    buffer each step) depends on the step it runs in: it is run again."""

    class Fresh(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self.state[p]["last"] = p.grad.clone()
            return super().step(closure)

    model, x, loss_fn = _mlp()
    opt = Fresh(model.parameters(), lr=0.1)
    with _Steps() as steps:
        with _planner.PredictionSession(model, x, opt, loss_fn=loss_fn) as session:
            assert session._steps._sim.step.optimizer_replay is None
            before = steps.count
            session.predict(FORCE)
            assert steps.count > before


def test_the_benchmark_reports_the_cpu_time_of_wrap():
    entry = BENCHMARK_MODELS["mlp"]
    wrapped = prepare(entry, "conservative")
    try:
        assert wrapped.wrap_cpu_seconds is not None and wrapped.wrap_cpu_seconds > 0
    finally:
        wrapped.close()
    assert prepare(entry, "torch-checkpoint").wrap_cpu_seconds is None


def _trace_of(session):
    return _step_record(session._steps._unoptimized)[:5]


def _unguarded_devices(monkeypatch):
    """The fake modes' guards without their own answer to prim.device: the
    method is called for it (and answers it in Python)."""
    from memscale import _core
    from memscale.predictor._tracker import FakeCaller, StorageTracker

    for cls in (FakeCaller, StorageTracker):
        guard = cls.__dict__["__torch_dispatch__"]
        assert guard.fake_cls is _torch_compat.fake_tensor_class(), cls
        monkeypatch.setattr(cls, "__torch_dispatch__", _core.DispatchGuard(guard.fast, guard.safe))


@pytest.mark.parametrize("case", [_mlp, _gpt2])
def test_the_tracker_answers_prim_device_as_fake_tensors_do(case, monkeypatch):
    """The fake modes answer ``prim.device`` (which torch's autograd engine
    asks a fake tensor many times per layer) with the fake tensor's
    device, without dispatching it on: in C, in their dispatch guard,
    before the method is called; in the method (in Python) where the
    guard does not.  The simulated step is the same, event for event, as
    with the operator dispatched to FakeTensorMode."""
    from memscale.predictor._tracker import StorageTracker

    guard = StorageTracker.__dict__["__torch_dispatch__"]
    seen = []

    def fast(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return guard.fast(self, func, types, args, kwargs)

    monkeypatch.setattr(
        StorageTracker,
        "__torch_dispatch__",
        type(guard)(
            fast, guard.safe, (torch.ops.prim.device.default, guard.fake_cls, torch.device)
        ),
    )
    model, x, loss_fn = case()
    with _planner.PredictionSession(model, x, loss_fn=loss_fn) as session:
        in_c = _trace_of(session)
        in_c_peak = session.unoptimized_peak()
    assert len(seen) > 100 and torch.ops.prim.device.default not in seen

    reader = _torch_compat.fake_device_reader()
    assert reader is not None
    answers = []

    def counted():
        def read(t):
            device = reader(t)
            if device is not None:
                answers.append((device, t.device))
            return device

        return read

    _unguarded_devices(monkeypatch)
    monkeypatch.setattr(_torch_compat, "fake_device_reader", counted)
    model, x, loss_fn = case()
    with _planner.PredictionSession(model, x, loss_fn=loss_fn) as session:
        assert _trace_of(session) == in_c
        assert session.unoptimized_peak() == in_c_peak
    assert len(answers) > 100  # the backward asks many times
    assert all(device == reported for device, reported in answers)
    assert reader(torch.zeros(1)) is None  # a real tensor: dispatched as usual
    monkeypatch.setattr(_torch_compat, "fake_device_reader", lambda: None)
    model, x, loss_fn = case()
    with _planner.PredictionSession(model, x, loss_fn=loss_fn) as session:
        assert _trace_of(session) == in_c
        assert session.unoptimized_peak() == in_c_peak


def test_the_dispatch_guard_answers_a_fake_tensors_device_as_the_reader_does():
    """``DispatchGuard(fast, safe, devices)`` answers ``prim.device`` of
    one fake tensor outside a fake kernel with its ``fake_device``, and
    calls the method for everything else: another operator, a real
    tensor, a fake tensor inside a kernel or without a mode, a
    ``fake_device`` that is not a device.  An error reading an attribute,
    other than its absence, is raised, as ``getattr(t, name, None)``
    raises it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memscale import _core

    device_op = torch.ops.prim.device.default
    fake_cls = _torch_compat.fake_tensor_class()
    calls = []

    def fast(self, func, types, args=(), kwargs=None):
        calls.append(func)
        return "the method"

    guard = _core.DispatchGuard(fast, fast, (device_op, fake_cls, torch.device))
    mode = FakeTensorMode()
    with mode:
        t = torch.empty(2, device="cpu")
    reader = _torch_compat.fake_device_reader()
    assert guard(None, device_op, (), (t,), {}) == torch.device("cpu") == reader(t)
    assert calls == []
    assert guard(None, torch.ops.aten.add.Tensor, (), (t,), {}) == "the method"
    assert guard(None, device_op, (), (torch.zeros(1),), {}) == "the method"
    assert guard(None, device_op, (), (t, t), {}) == "the method"
    mode.in_kernel_invocation = True
    assert reader(t) is None and guard(None, device_op, (), (t,), {}) == "the method"
    mode.in_kernel_invocation = False
    t.fake_mode = None
    assert reader(t) is None and guard(None, device_op, (), (t,), {}) == "the method"
    del t.fake_mode
    assert reader(t) is None and guard(None, device_op, (), (t,), {}) == "the method"

    def made(cls):
        return cls.__new__(cls, mode, torch.empty(1, device="meta"), torch.device("cpu"))

    class NotADevice(fake_cls):
        @property
        def fake_device(self):
            return "cpu"

        @fake_device.setter
        def fake_device(self, value):
            pass

    odd = made(NotADevice)
    assert reader(odd) is None and guard(None, device_op, (), (odd,), {}) == "the method"
    assert len(calls) == 7

    class Refuses(fake_cls):
        @property
        def fake_mode(self):
            raise RuntimeError("not now")

        @fake_mode.setter
        def fake_mode(self, value):
            pass

    odd = made(Refuses)
    with pytest.raises(RuntimeError, match="not now"):
        reader(odd)
    with pytest.raises(RuntimeError, match="not now"):
        guard(None, device_op, (), (odd,), {})
    with pytest.raises(TypeError, match="devices must be None or"):
        _core.DispatchGuard(fast, fast, (device_op, fake_cls))
    with pytest.raises(TypeError, match="devices must be None or"):
        _core.DispatchGuard(fast, fast, (device_op, "FakeTensor", torch.device))
    assert _core.DispatchGuard(fast, fast).fake_cls is None


def _step_record(trace):
    tracker = trace.tracker
    return (
        tracker.events,
        tracker.phase_marks,
        tracker.sizes_at_birth,
        tracker.categories,
        tracker.kernel_calls,
        [(at, type(m).__name__) for at, m in tracker.forward_marks],
        [(at, type(m).__name__) for at, m in tracker.recompute_marks],
    )


def _session_record(model, x, loss_fn, device=None):
    """What a session simulates: the profile, the unoptimized step and the
    step with every layer checkpointed (event for event), and the plan."""
    with _planner.PredictionSession(model, x, loss_fn=loss_fn, device=device) as session:
        plan = session.plan(FORCE)
        steps = session._steps
        return (
            session.profile,
            _step_record(steps._unoptimized),
            _step_record(steps._trace(plan, FORCE)[1]),
            steps.simulated_peak(plan, FORCE),
            plan.hash,
        )


def _llama():
    from conftest import tiny_llama

    batch = token_batch(batch=4, seq=64)
    return tiny_llama(), {"input_ids": batch, "labels": batch}, None


@pytest.mark.parametrize("case", [_mlp, _gpt2, _llama])
def test_fake_calls_from_the_memo_are_the_calls_dispatched(case, monkeypatch):
    """The simulated steps call operators through _torch_compat.fake_calls
    (FakeTensorMode's cache read through a cheaper key): the profile, the
    unoptimized step and the step with every layer checkpointed are the
    same, event for event, as with every call dispatched to FakeTensorMode."""
    made = []

    def counted(mode):
        real = original(mode)
        assert real is not None
        made.append(real)
        return real

    original = _torch_compat.fake_calls
    monkeypatch.setattr(_torch_compat, "fake_calls", counted)
    results = []
    for _ in range(2):
        results.append(_session_record(*case()))
        monkeypatch.setattr(_torch_compat, "fake_calls", lambda mode: None)
    assert len(made) == 1 and made[0].hits > 100  # the memo answered
    assert results[0] == results[1]


def test_a_real_tensor_is_made_fake_once_with_its_storage(monkeypatch):
    """The fake world converts each real parameter and buffer that shares
    its storage once (its detached alias made outside the fake mode, where
    detaching would convert it a first time), to a twin of the same shape,
    strides, offset and storage bytes; tensors that share a storage share
    a fake one.  One with a storage of its own is not converted (it is an
    empty_strided: test_a_tensor_alone_gets_the_twin_the_converter_makes)."""
    from torch._subclasses.fake_tensor import FakeTensorConverter

    from memscale.predictor._fake import FakeWorld

    converted = []
    original = FakeTensorConverter.from_real_tensor

    def counted(self, mode, t, *args, **kwargs):
        converted.append(tuple(t.shape))
        return original(self, mode, t, *args, **kwargs)

    monkeypatch.setattr(FakeTensorConverter, "from_real_tensor", counted)
    base = torch.randn(4, 8)
    model = nn.Linear(8, 4)
    model.register_buffer("whole", base)
    model.part = nn.Parameter(base[1:3])  # a view of the buffer's storage
    real = {"weight": model.weight, "bias": model.bias, "part": model.part, "whole": base}
    with FakeWorld(model, torch.device("cpu")) as world:
        fake = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        assert sorted(converted) == [(2, 8), (4, 8)]  # part and whole
        for name, t in real.items():
            twin = fake[name]
            assert _torch_compat.is_fake(twin) and twin is world.fake(t)
            assert (twin.shape, twin.stride(), twin.storage_offset()) == (
                t.shape,
                t.stride(),
                t.storage_offset(),
            )
            assert twin.untyped_storage().nbytes() == t.untyped_storage().nbytes()
        assert _torch_compat.storage_key(fake["part"]) == _torch_compat.storage_key(fake["whole"])
        assert isinstance(fake["part"], nn.Parameter) and fake["part"].requires_grad
    assert model.part is real["part"]


def test_a_tensor_alone_gets_the_twin_the_converter_makes():
    """A parameter or buffer whose storage no other shares, spanned
    exactly from its start, gets an empty_strided twin with every property
    the converter's twin has (dtype, strides, storage bytes, flags,
    dispatch keys, attributes); one whose storage it spans only in part,
    or shares, or a subclass, is converted as before."""
    from memscale.predictor import _fake
    from memscale.predictor._fake import FakeWorld

    def tensors():
        torch.manual_seed(0)
        with torch.inference_mode():
            inference = torch.ones(3)
        return {
            "contiguous": nn.Parameter(torch.randn(4, 8)),
            "transposed": nn.Parameter(torch.randn(8, 4).t()),
            "frozen": nn.Parameter(torch.randn(3), requires_grad=False),
            "empty": nn.Parameter(torch.randn(0, 8)),
            "halves": nn.Parameter(torch.randn(2, 3).half()),
            "counts": torch.arange(6).view(2, 3),
            "flags": torch.zeros(5, dtype=torch.bool),
            "scalar": torch.tensor(2.0),
            "expanded": torch.randn(1, 4).expand(3, 4),
            "tail": torch.randn(10)[:5],
            "offset": torch.randn(10)[2:],
            "inference": inference,
        }

    def twins(fast):
        model = nn.Module()
        real = tensors()
        for name, t in real.items():
            if isinstance(t, nn.Parameter):
                model.register_parameter(name, t)
            else:
                model.register_buffer(name, t)
        alone = _fake._alone
        if not fast:
            _fake._alone = lambda *args: set()
        try:
            with FakeWorld(model, torch.device("cpu")) as world:
                found = {**dict(model.named_parameters()), **dict(model.named_buffers())}
                # (each world has its own fake mode: compared by presence)
                return {name: _made(found[name], mode=world.mode) for name in real}, {
                    name: _fake._whole_storage(t) for name, t in real.items()
                }
        finally:
            _fake._alone = alone

    fast, whole = twins(True)
    converted, _ = twins(False)
    assert fast == converted
    assert [n for n, w in whole.items() if not w] == ["tail", "offset", "inference"]
    assert not _fake._whole_storage(torch.randn(2, 2, dtype=torch.cfloat).conj())
    shared = nn.Linear(2, 2)
    shared.register_buffer("alias", shared.weight.detach())
    assert _fake._alone(shared) == {id(shared.bias)}
    shared.kept = [shared.bias[:1]]  # a plain attribute viewing the bias
    assert _fake._alone(shared) == set()
    del shared.kept
    assert _fake._alone(shared, ({"x": shared.bias.view(2, 1)},)) == set()


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.register_buffer("mask", torch.zeros(64, 64))

    def forward(self, x, mask):
        return (self.fc(x) @ mask[0]).pow(2).mean()


def test_an_input_that_views_a_buffer_shares_its_twin():
    """An input that is a view of a buffer (or parameter) is faked onto
    the storage of that buffer's twin, as the converter does: its bytes
    count once, with the buffers, the same as with every twin converted."""
    from memscale.predictor import _fake

    def breakdown(fast):
        torch.manual_seed(0)
        model = _Masked()
        with pytest.MonkeyPatch.context() as mp:
            if not fast:
                mp.setattr(_fake, "_alone", lambda *args: set())
            x = (torch.randn(8, 64), model.mask[None])
            with _planner.PredictionSession(model, x, loss_fn=lambda out: out) as session:
                steps = session._steps
                return steps._breakdown(steps._unoptimized)

    fast = breakdown(True)
    assert fast == breakdown(False)
    assert fast.inputs < 64 * 64 * 4


def test_the_fake_parameters_are_made_through_the_cheaper_key(monkeypatch):
    """A deep model's fake parameters: each is a Parameter over its fake
    twin with the real one's requires_grad, and the twin, and the detach
    that makes it a Parameter, are answered through the cheaper key (one
    dispatch to FakeTensorMode per shape, not per parameter)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memscale.predictor._fake import FakeWorld

    dispatched = []
    original = FakeTensorMode.dispatch

    def counted(self, func, *args, **kwargs):
        dispatched.append(str(func))
        return original(self, func, *args, **kwargs)

    monkeypatch.setattr(FakeTensorMode, "dispatch", counted)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(40)])
    model[3].weight.requires_grad_(False)
    with FakeWorld(model, torch.device("cpu")):
        params = list(model.parameters())
        assert len(params) == 80
        assert all(isinstance(p, nn.Parameter) and _torch_compat.is_fake(p) for p in params)
        assert [p.requires_grad for p in params] == [i != 6 for i in range(80)]
    assert dispatched.count("aten.detach.default") <= 4, dispatched
    # and the twins themselves too (empty_strided, sizes given as lists)
    assert dispatched.count("aten.empty_strided.default") <= 4, dispatched


def _made(t, mode=None):
    """What a fake output is: every property the simulated steps read, and
    the attributes FakeTensor keeps, in their order (``mode``, when given,
    shown as "the mode")."""
    if not isinstance(t, torch.Tensor):
        return ("value", t)
    return (
        type(t),
        t.shape,
        t.stride(),
        t.storage_offset(),
        t.dtype,
        t.device,
        t.fake_device,
        t.layout,
        t.requires_grad,
        t.is_leaf,
        t.is_conj(),
        t.is_neg(),
        t.untyped_storage().nbytes(),
        str(torch._C._dispatch_keys(t)),
        [(k, "the mode" if mode is not None and v is mode else v) for k, v in t.__dict__.items()],
    )


# The lean build of fake outputs is checked against torch 2.13's
# FakeTensor only (_torch_compat.LEAN_TORCH); another torch leaves every
# output to FakeTensorMode, and these tests of the build do not apply.
needs_lean = pytest.mark.skipif(
    _torch_compat.torch_version() not in _torch_compat.LEAN_TORCH,
    reason=f"the lean fake-output build is only for torch {_torch_compat.LEAN_TORCH}",
)


@needs_lean
@pytest.mark.parametrize("case", [_mlp, _gpt2, _llama])
def test_a_lean_output_is_the_output_fake_tensor_mode_makes(case, monkeypatch):
    """Every output _LeanOutputs makes from a cache entry's recipe is the
    tensor FakeTensorMode's own method makes from the entry: the same
    shape, strides, offset, dtype, device, flags, storage bytes, dispatch
    keys and attributes; a view shares its base's storage as that one
    does, and an in-place call returns the same argument."""
    from torch._subclasses.fake_tensor import _CacheKeyState

    compared = []
    made = []

    def checked_calls(mode):
        calls = original(mode)
        assert calls is not None
        made.append(calls)

        def checked(func, args, kwargs):
            key = calls.key(func, args, kwargs)
            known = calls.memo.get(key) if key is not None else None
            lean = calls.lean_hits
            out = calls(func, args, kwargs)
            if calls.lean_hits == lean:
                return out
            assert known is not None and known[2] is not None
            ref = calls.mode._output_from_cache_entry(
                _CacheKeyState(None), known[1], known[0], func, args
            )
            outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
            assert isinstance(out, tuple) == isinstance(ref, tuple)
            assert len(outs) == len(refs)
            for o, r in zip(outs, refs):
                assert _made(o) == _made(r), func
                if not isinstance(r, torch.Tensor):
                    continue
                if any(r is a for a in args):  # in place: the argument itself
                    assert o is r
                elif func.is_view:
                    assert _torch_compat.storage_key(o) == _torch_compat.storage_key(r)
                else:
                    assert _torch_compat.storage_key(o) != _torch_compat.storage_key(r)
            compared.append(func)
            return out

        return checked

    original = _torch_compat.fake_calls
    monkeypatch.setattr(_torch_compat, "fake_calls", checked_calls)
    model, x, loss_fn = case()
    with _planner.PredictionSession(model, x, loss_fn=loss_fn) as session:
        plan = session.plan(FORCE)
        session._steps.simulated_peak(plan, FORCE)
        assert len(made) == 1 and made[0].lean_hits == len(compared)
    assert len(compared) > 100  # the lean build answered
    assert any(f.is_view for f in compared)


@needs_lean
def test_a_lean_build_that_does_not_fit_is_answered_by_fake_tensor_mode():
    """A recipe whose view base or in-place argument is not a FakeTensor,
    or a mode inside a kernel, gets no lean output: FakeTensorMode's own
    method answers."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode()
    lean = _torch_compat._lean_outputs(mode, FakeTensor)
    calls = _torch_compat.fake_calls(mode)
    assert lean is not None and calls is not None
    with mode:
        a = torch.empty(4, 4)
        a.t()
        a.add_(1)
    entries = {}
    for key, entry in type(mode).cache.items():
        func = key.key[0] if isinstance(key.key, tuple) else None
        if func in (torch.ops.aten.t.default, torch.ops.aten.add_.Tensor):
            entries[func] = entry
    real = torch.empty(4, 4)
    view = lean.recipe(entries[torch.ops.aten.t.default], torch.ops.aten.t.default)
    inplace = lean.recipe(entries[torch.ops.aten.add_.Tensor], torch.ops.aten.add_.Tensor)
    assert view is not None and inplace is not None
    made = calls.build(view, (a,))
    assert (made.shape, made.stride()) == ((4, 4), (1, 4))
    assert _torch_compat.storage_key(made) == _torch_compat.storage_key(a)
    assert calls.build(inplace, (a, 1)) is a
    assert calls.build(view, (real,)) is _torch_compat._UNSEEN
    assert calls.build(inplace, (real, 1)) is _torch_compat._UNSEEN
    mode.in_kernel_invocation = True
    try:
        assert calls.build(view, (a,)) is _torch_compat._UNSEEN
    finally:
        mode.in_kernel_invocation = False


@needs_lean
@pytest.mark.parametrize(
    "change",
    [
        {"requires_grad": True},
        {"is_conj": True, "dtype": torch.complex64},
        {"is_neg": True},
        {"dtype": torch.float16},
        {"shape": (2, 8), "stride": (1, 2)},
    ],
)
@pytest.mark.parametrize("op", ["t", "mul"])
def test_a_lean_output_keeps_every_field_of_the_entry(op, change):
    """Entries whose outputs require grad, are conjugate or negative, of
    another dtype or other strides (made by hand from a cached view and a
    cached new tensor): the lean output is the one FakeTensorMode's own
    method makes from the same entry."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, _CacheKeyState

    func = {"t": torch.ops.aten.t.default, "mul": torch.ops.aten.mul.Tensor}[op]
    mode = FakeTensorMode()
    lean = _torch_compat._lean_outputs(mode, FakeTensor)
    calls = _torch_compat.fake_calls(mode)
    assert lean is not None and calls is not None
    with mode:
        a = torch.empty(4, 4)
        args = (a,) if op == "t" else (a, a)
        func(*args)
    key, entry = next(
        (k, e) for k, e in type(mode).cache.items() if isinstance(k.key, tuple) and k.key[0] is func
    )
    info = entry.output_infos[0]
    info = dataclasses.replace(info, metadata=dataclasses.replace(info.metadata, **change))
    entry = dataclasses.replace(entry, output_infos=(info,))
    recipe = lean.recipe(entry, func)
    assert recipe is not None
    try:
        ref = mode._output_from_cache_entry(_CacheKeyState(None), entry, key, func, args)
    except RuntimeError as exc:  # a view that requires grad: set_ refuses it
        assert op == "t" and "requires_grad" in change, exc
        with pytest.raises(type(exc)):
            calls.build(recipe, args)
        return
    made = calls.build(recipe, args)
    assert _made(made) == _made(ref)
    for field, value in change.items():
        got = {
            "requires_grad": made.requires_grad,
            "is_conj": made.is_conj(),
            "is_neg": made.is_neg(),
            "dtype": made.dtype,
            "shape": tuple(made.shape),
            "stride": made.stride(),
        }[field]
        assert got == value


def test_memscale_modes_skip_the_dynamo_wrapper_outside_compiled_code():
    """memscale's dispatch modes call their raw __torch_dispatch__ while no
    compiled function runs, and torch's dynamo-disabling wrapper of it
    otherwise (_torch_compat.guard_dispatch)."""
    from memscale import _core, _selective
    from memscale.predictor._tracker import FakeCaller, StorageTracker

    for cls in (FakeCaller, StorageTracker, _selective.OpRecorder):
        guard = cls.__dict__["__torch_dispatch__"]
        assert isinstance(guard, _core.DispatchGuard), cls
        assert guard.safe.__wrapped__ is guard.fast
        assert guard.is_fast()


def _graph_broken(x):
    y = x + 1
    torch._dynamo.graph_break()
    return torch.sin(y * 2)


def test_a_guarded_mode_is_never_traced_by_dynamo():
    """Under a compiled function (its eager part after a graph break, where
    dynamo's frame evaluator is in place) a guarded mode's operators go
    through torch's wrapper, and dynamo compiles none of its frames; the
    same mode without a wrapper is compiled (what the guard prevents)."""
    import sys

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.utils._python_dispatch import TorchDispatchMode

    callers = []

    @_torch_compat.guard_dispatch
    class Guarded(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            callers.append(sys._getframe(1).f_code)
            return func(*args, **(kwargs or {}))

    class Unwrapped(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls):
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    guard = Guarded.__dict__["__torch_dispatch__"]
    wrapper_code = {guard.safe.__code__, guard.safe.__wrapped__.__code__}
    torch._dynamo.reset()
    try:
        with Guarded():
            torch.ones(2) + 1
        assert callers and not any(c in wrapper_code for c in callers)
        assert all(c.co_name != "_fn" for c in callers)  # the raw method
        callers.clear()
        with Guarded():
            torch.compile(_graph_broken, backend="eager")(torch.ones(3))
        assert any(c.co_name == "_fn" for c in callers)  # torch's wrapper
        assert _debug_get_cache_entry_list(guard.fast.__code__) == []
        torch._dynamo.reset()
        with Unwrapped():
            torch.compile(_graph_broken, backend="eager")(torch.ones(3))
        raw = Unwrapped.__dict__["__torch_dispatch__"]
        assert _debug_get_cache_entry_list(raw.__code__) != []
    finally:
        torch._dynamo.reset()


class _CompiledInside(nn.Module):
    """An MLP whose activation is a compiled function with a graph break."""

    def __init__(self, act):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.act = act

    def forward(self, x):
        for layer in self.layers:
            x = self.act(layer(x))
        return x


def _act(x):
    x = torch.relu(x)
    torch._dynamo.graph_break()
    return x * 2


@pytest.mark.parametrize("compiled", [True, False])
def test_guarded_modes_simulate_as_torch_wrapped_ones(compiled, monkeypatch):
    """With memscale's modes guarded (raw __torch_dispatch__ while no
    compiled function runs) the simulated steps are the same, event for
    event, as with torch's dynamo-disabling wrapper on every call, for a
    model that calls a compiled function (with a graph break) and one that
    does not; dynamo compiles none of the storage tracker's frames."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from memscale import _selective
    from memscale.predictor._tracker import FakeCaller, StorageTracker

    target = torch.randn(16, 32, generator=torch.Generator().manual_seed(5))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    modes = (FakeCaller, StorageTracker, _selective.OpRecorder)
    results = []
    torch._dynamo.reset()
    try:
        for guarded in (True, False):
            if not guarded:
                for cls in modes:
                    safe = cls.__dict__["__torch_dispatch__"].safe
                    monkeypatch.setattr(cls, "__torch_dispatch__", safe)
            torch.manual_seed(0)
            act = torch.compile(_act, backend="eager") if compiled else _act
            model = _CompiledInside(act)
            loss_fn = lambda out: nn.functional.mse_loss(out, target)  # noqa: E731
            results.append(_session_record(model, x, loss_fn))
        monkeypatch.undo()
        for cls in modes:
            raw = cls.__dict__["__torch_dispatch__"].fast
            assert _debug_get_cache_entry_list(raw.__code__) == []
    finally:
        torch._dynamo.reset()
    assert results[0] == results[1]


def test_the_fake_call_key_tells_apart_what_the_output_depends_on():
    """The extension's FakeCalls keys a call by every value of its fake
    arguments the output can depend on (dtype, shape, strides, device,
    offset, storage bytes, requires_grad, conjugate and negative bits), the
    other arguments with their types, the keyword names and the global
    state (the default dtype); the same values give the same key, and a
    call it cannot key (a real tensor, another mode's fake tensor, a value
    of another type) has none."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    calls = _torch_compat.fake_calls(mode)
    assert calls is not None
    add = torch.ops.aten.add.Tensor
    with mode:
        a = torch.empty(4, 4)
        variants = {
            "same": torch.empty(4, 4),
            "dtype": torch.empty(4, 4, dtype=torch.float64),
            "shape": torch.empty(4, 5),
            "stride": torch.empty(4, 4).t(),
            "offset": torch.empty(20)[4:].view(4, 4),
            "storage": torch.empty(32)[:16].view(4, 4),
            "grad": torch.empty(4, 4, requires_grad=True),
            "neg": torch.empty(4, 4)._neg_view(),
        }
        c = torch.empty(4, 4, dtype=torch.complex64)
        conj = c.conj()
        other = FakeTensorMode().from_tensor(torch.empty(4, 4))
    key = calls.key(add, (a, a), {})
    assert key is not None and calls.key(add, (a, variants["same"]), {}) == key
    for name, t in variants.items():
        got = calls.key(add, (a, t), {})
        assert got is not None, name
        assert (got == key) == (name == "same"), name
    assert calls.key(add, (c, conj), {}) != calls.key(add, (c, c), {})
    assert calls.key(add, (a, a), {"alpha": 2}) != key
    assert calls.key(add, (a, a), {"alpha": 2}) != calls.key(add, (a, a), {"alpha": 2.0})
    assert calls.key(torch.ops.aten.sub.Tensor, (a, a), {}) != key
    assert calls.key(torch.ops.aten.cat.default, ([a, a],), {}) != calls.key(
        torch.ops.aten.cat.default, ([a, a, a],), {}
    )
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert calls.key(add, (a, a), {}) != key
    finally:
        torch.set_default_dtype(old)
    assert calls.key(add, (a, torch.empty(4, 4)), {}) is None  # a real tensor
    assert calls.key(add, (a, other), {}) is None  # another mode's
    assert calls.key(add, (a, object()), {}) is None


def test_the_fake_caller_refuses_what_it_cannot_take():
    """FakeCalls is made from keyword arguments only, each of the kind it
    needs, and is called with (func, args, kwargs): anything else is a
    TypeError naming what was wrong; it is collected with its mode."""
    import gc
    import weakref

    from torch._subclasses.fake_tensor import FakeTensorMode

    from memscale import _core

    mode = FakeTensorMode()
    calls = _torch_compat.fake_calls(mode)
    assert calls is not None
    with pytest.raises(TypeError, match="keyword"):
        _core.FakeCalls(mode)
    with pytest.raises(TypeError, match="missing"):
        _core.FakeCalls(mode=mode)
    with pytest.raises(TypeError, match="args must be a tuple"):
        calls(torch.ops.aten.add.Tensor, [1, 2], {})
    with pytest.raises(TypeError, match="kwargs must be a dict"):
        calls(torch.ops.aten.add.Tensor, (1, 2), [])
    with pytest.raises(TypeError, match="takes"):
        calls(torch.ops.aten.add.Tensor, (1, 2))
    with mode:
        a = torch.empty(2)
        out = calls(torch.ops.aten.add.Tensor, (a, a), None)
    assert out.shape == (2,)
    ref = weakref.ref(mode)
    del mode, calls, a, out
    gc.collect()
    assert ref() is None


def test_call_flops_remembers_a_shape_formula_by_shapes(monkeypatch):
    """_torch_compat.call_flops counts a call with its formula once per
    operator, formula, shapes and other values (torch's shape-wrapped
    formulas are given nothing else), counts a call of other shapes anew,
    counts every call of a formula that may read tensors' values, and uses
    a formula registered after it first counted."""
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    calls = []

    def mm_formula(a_shape, b_shape, *args, out_shape=None, **kwargs):
        calls.append((tuple(a_shape), tuple(b_shape)))
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    counter = _torch_compat._CallFlops()
    mm = torch.ops.aten.mm.default
    monkeypatch.setitem(flop_registry, torch.ops.aten.mm, shape_wrapper(mm_formula))
    a, b, c = torch.empty(4, 8), torch.empty(8, 2), torch.empty(8, 3)
    assert counter(mm, (a, b), {}, torch.empty(4, 2)) == 128
    assert counter(mm, (torch.empty(4, 8), torch.empty(8, 2)), {}, torch.empty(4, 2)) == 128
    assert len(calls) == 1  # the same shapes: remembered
    assert counter(mm, (a, c), {}, torch.empty(4, 3)) == 192
    assert len(calls) == 2
    raw = []

    def raw_formula(*args, out_val=None, **kwargs):
        raw.append(args)
        return 7

    monkeypatch.setitem(flop_registry, torch.ops.aten.mm, raw_formula)
    assert counter(mm, (a, b), {}, torch.empty(4, 2)) == 7  # registered later
    assert counter(mm, (a, b), {}, torch.empty(4, 2)) == 7
    assert len(raw) == 2  # may read values: counted every time
    assert counter(torch.ops.aten.relu.default, (a,), {}, a) is None


def test_a_list_that_holds_itself_is_a_recursion_error_in_the_key():
    """The key walks nested lists and tuples: one that holds itself raises
    RecursionError (the interpreter's limit), as walking it in Python
    would, instead of overflowing the C stack."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = _torch_compat.fake_calls(FakeTensorMode())
    assert calls is not None
    looped: list = []
    looped.append(looped)
    with pytest.raises(RecursionError):
        calls.key(torch.ops.aten.cat.default, (looped,), None)
    assert calls.key(torch.ops.aten.cat.default, ([[1, 2], (3,)],), None) is not None


def test_call_flops_reads_the_attention_formula_and_symbolic_sizes(monkeypatch):
    """memscale's grouped-query wrapper reads torch's attention formula at
    each call: a formula put in its place later counts (the memo keys the
    one read), a formula that may read values is counted every time, and a
    call with symbolic sizes is counted by the formula, not remembered."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    op = torch.ops.aten._scaled_dot_product_efficient_attention
    func = op.default
    q = torch.empty(2, 4, 8, 16)
    args = (q, q, q, None, False)
    out = (torch.empty(2, 4, 8, 16), torch.empty(2, 4, 8), torch.empty(2), torch.empty(2))
    counter = _torch_compat._CallFlops()
    first = counter(func, args, {}, out)
    assert first and first > 0
    monkeypatch.setitem(flop_registry, op, shape_wrapper(lambda *a, out_shape=None, **k: 12345))
    assert counter(func, args, {}, out) == 12345
    raw = []
    monkeypatch.setitem(flop_registry, op, lambda *a, out_val=None, **k: raw.append(a) or 7)
    assert counter(func, args, {}, out) == 7 and counter(func, args, {}, out) == 7
    assert len(raw) == 2

    mm = torch.ops.aten.mm.default
    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 2)
    a, b = (
        mode.from_tensor(torch.empty(*shape), symbolic_context=dynamic, source=ConstantSource(n))
        for n, shape in (("a", (4, 8)), ("b", (8, 2)))
    )
    with mode:
        c = torch.mm(a, b)
    assert not isinstance(a.shape[0], int)
    symbolic = _torch_compat._CallFlops()
    got = symbolic(mm, (a, b), {}, c)
    assert str(got) == str(flop_registry[torch.ops.aten.mm](a, b, out_val=c))
    assert not symbolic._memo  # counted, not remembered


def _python_track(self, t, category=None):
    """StorageTracker.track as it was in Python (before
    csrc/storage_track.c): the reference the extension's track is held
    to."""
    import weakref

    from memscale.predictor._workspace import in_blocks

    def allocated(st):
        nbytes = st.nbytes()
        if self.granule is not None and nbytes:
            granule, device_type = self.granule
            if t.device.type != device_type:
                return 0
            nbytes = in_blocks(nbytes, granule)
        return nbytes

    st = t.untyped_storage()
    key = id(st)
    entry = self._known.get(key)
    if entry is not None and entry[0]() is st:
        serial = entry[1]
        nbytes = allocated(st)
        if nbytes != self.sizes[serial]:
            self.events.append((serial, nbytes - self.sizes[serial]))
            self.sizes[serial] = nbytes
        return None
    serial = self._born(allocated(st), category)
    known = self._known

    def freed(ref, key=key, serial=serial):
        if known.get(key, (None,))[0] is ref:
            del known[key]
        self._died(serial)

    known[key] = (weakref.ref(st, freed), serial)
    return serial


@pytest.mark.parametrize("case", [_mlp, _gpt2, _llama])
@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_the_extension_tracks_storages_as_the_python_tracker_did(case, target, monkeypatch):
    """The storage tracker's per-output work is the extension's
    (csrc/storage_track.c): the profile, the unoptimized step and the step
    with every layer checkpointed are the same, event for event, with the
    Python reference in its place; also for a CUDA target simulated on the
    CPU (every storage rounded up to the allocator's blocks)."""
    from memscale.predictor import DeviceSpec, _tracker

    def record():
        device = DeviceSpec("cuda", capacity_bytes=1 << 30) if target == "cuda" else "cpu"
        return _session_record(*case(), device=device)

    extension = record()
    monkeypatch.setattr(_tracker, "_track", _python_track)
    assert record() == extension


class _Scaled(nn.Module):
    """Layers that give operators Python numbers (which the tracker counts
    on a CPU step) and call them without."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x) * 0.5 + 1) + x / 3
        return x


def _scaled():
    return _Scaled(), torch.randn(16, 32, generator=torch.Generator().manual_seed(3)), None


@pytest.mark.parametrize("case", [_mlp, _gpt2, _llama, _scaled])
@pytest.mark.parametrize("target", ["cpu", "cuda", "probed"])
def test_the_plain_path_makes_the_steps_the_full_path_makes(case, target, monkeypatch):
    """Calls that take the storage tracker's plain path (the memo, then
    its outputs tracked) leave the same steps: the profile, the
    unoptimized step and the step with every layer checkpointed are the
    same, event for event, with every call through the full path; also
    with Python numbers given, for a CUDA target, and with every call
    probed for kernel scratch (as a step on a real CUDA device is)."""
    from memscale.predictor import DeviceSpec, _step, _tracker

    if target == "probed":
        make = _step.Step._tracker

        def probed(self, small):
            tracker = make(self, small)
            tracker.probe_all = True
            return tracker

        monkeypatch.setattr(_step.Step, "_tracker", probed)

    def record():
        device = DeviceSpec("cuda", capacity_bytes=1 << 30) if target == "cuda" else "cpu"
        return _session_record(*case(), device=device)

    full = []
    dispatch = _tracker.StorageTracker._dispatch

    def counted(self, func, args, kwargs):
        full.append(func)
        return dispatch(self, func, args, kwargs)

    monkeypatch.setattr(_tracker.StorageTracker, "_dispatch", counted)
    plain = record()
    through_full = len(full)
    monkeypatch.setattr(_tracker.StorageTracker, "_is_plain", lambda self, func: False)
    full.clear()
    assert record() == plain
    if target == "probed":  # every call probed: none plain
        assert through_full == len(full)
    else:
        assert len(full) - through_full >= 50  # (calls that took the plain path)


@pytest.mark.parametrize("granule", [None, (512, "cpu"), (512, "cuda")])
def test_track_records_birth_resize_and_free_as_the_python_tracker(granule):
    """One storage born, seen again, resized in place, born under a
    recompute, freed while active and freed while not: the extension's
    track() records the same serials, sizes, categories and events as the
    Python reference, with and without the allocator's granule (a tensor of
    another device type than the granule's takes none)."""
    import gc

    from memscale.predictor._tracker import StorageTracker

    def scenario(track):
        tracker = StorageTracker()
        tracker.granule = granule
        a = torch.empty(4)
        got = [track(tracker, a, "inputs"), track(tracker, a)]
        a.resize_(300)  # the same storage, larger
        got.append(track(tracker, a))
        tracker.phase = "backward"
        b = torch.empty(2)
        got.append(track(tracker, b))
        tracker.recompute_depth = 1
        c = torch.empty(3)
        got.append(track(tracker, c))
        del a
        gc.collect()
        tracker.active = False
        del b
        gc.collect()
        return got, tracker.events, tracker.sizes, tracker.sizes_at_birth, tracker.categories

    from memscale import _core

    ours = scenario(_core.track)
    reference = scenario(_python_track)
    assert ours == reference
    got, events, sizes, _, categories = ours
    assert got == [0, None, None, 1, 2]
    assert categories == ["inputs", "workspace", "activations"]
    if granule is not None and granule[1] == "cuda":  # host tensors: none
        assert events == [] and sizes == [0, 0, 0]
    else:
        assert events[-1][0] == 0 and events[-1][1] < 0  # a's free
        assert sizes[0] == 0 and sizes[1] > 0  # b's free, inactive: not recorded
    with pytest.raises(TypeError, match="track"):
        _core.track(StorageTracker())
    broken = StorageTracker()
    broken.categories = ()  # not a list: named, not a SystemError
    with pytest.raises(TypeError, match="categories"):
        _core.track(broken, torch.empty(2))


def test_a_finished_step_leaves_its_tracker_in_no_cycle():
    """A tracked step closes its tracker: the weak references whose
    callbacks record frees (each refers to the tracker) are dropped, so
    the tracker and every list of its step go with the last reference to
    the trace, not at the collector's next full pass."""
    import gc
    import weakref

    model, x, loss_fn = _gpt2()
    with _planner.PredictionSession(model, x, loss_fn=loss_fn) as session:
        trace = session._steps._sim.unoptimized()
        tracker = weakref.ref(trace.tracker)
        assert trace.tracker.events and not trace.tracker._known
        enabled = gc.isenabled()
        gc.disable()
        try:
            del trace
            assert tracker() is None
        finally:
            if enabled:
                gc.enable()


def _breakdown_by_event(tracker, recategorize, scratch, scale):
    """The peak breakdown the simple way (the reference): every category's
    total copied at each new highest level."""
    from memscale.predictor._results import CATEGORIES

    cats = [recategorize.get(i, c) for i, c in enumerate(tracker.categories)]
    totals = dict.fromkeys(CATEGORIES, 0)
    level = peak = 0
    best = dict(totals)
    phase_at = dict(tracker.phase_marks)  # (the last mark at an index holds)
    phase = peak_phase = "start"
    for i in range(len(tracker.events) + 1):
        phase = phase_at.get(i, phase)
        w = scratch.get(i, 0)
        if w and level + w > peak:
            peak, peak_phase = level + w, phase
            best = dict(totals)
            best["workspace"] += w
        if i == len(tracker.events):
            break
        serial, delta = tracker.events[i]
        if serial in scale:
            delta = scale[serial] if delta > 0 else -scale[serial]
        totals[cats[serial]] += delta
        level += delta
        if level > peak:
            peak, best, peak_phase = level, dict(totals), phase
    return peak, peak_phase, best


def test_the_peak_breakdown_is_the_category_totals_at_the_first_highest_level(monkeypatch):
    """The breakdown of a step (the peak, its phase, and what of each
    category was alive there, found after the peak) is the one worked out
    event by event, on random steps with kernels' scratch and real sizes,
    ties and recategorized storages."""
    import random

    from memscale.predictor import _tracker
    from memscale.predictor._results import CATEGORIES

    rng = random.Random(7)
    for _ in range(300):
        tracker = _tracker.StorageTracker()
        tracker.close()
        alive = []
        names = ["start", "forward", "backward", "optimizer", "end"]
        tracker.phase_marks = [(0, "start")]
        n = rng.randrange(0, 40)
        cuts = sorted(rng.randrange(0, n + 1) for _ in range(4))
        for at, name in zip(cuts, names[1:]):
            tracker.phase_marks.append((at, name))
        for _ in range(n):
            if alive and rng.random() < 0.4:
                serial = alive.pop(rng.randrange(len(alive)))
                tracker.events.append((serial, -tracker.sizes_at_birth[serial]))
            else:
                serial = len(tracker.sizes_at_birth)
                size = rng.choice([4, 8, 16, 32])
                tracker.sizes.append(size)
                tracker.sizes_at_birth.append(size)
                tracker.categories.append(rng.choice(CATEGORIES))
                tracker.events.append((serial, size))
                alive.append(serial)
        serials = range(len(tracker.sizes_at_birth))
        scratch = {rng.randrange(0, n + 1): rng.choice([8, 24]) for _ in range(3)}
        scale = {s: 64 for s in serials if rng.random() < 0.1}
        recategorize = {s: "gradients" for s in serials if rng.random() < 0.2}
        sizes = (scratch, scale)
        monkeypatch.setattr(tracker, "_kernel_sizes", lambda _, sizes=sizes: sizes)
        got = tracker.breakdown(recategorize, {})
        peak, phase, best = _breakdown_by_event(tracker, recategorize, scratch, scale)
        assert (got.peak_bytes, got.phase) == (peak, phase)
        assert {c: getattr(got, c) for c in CATEGORIES} == best


class _SeesTheCollector(nn.Module):
    """Notes ``gc.get_freeze_count()`` in each forward, and raises in one
    while ``fail`` is set."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.frozen = []
        self.fail = False

    def forward(self, x):
        self.frozen.append(gc.get_freeze_count())
        if self.fail:
            raise ValueError("a forward that fails")
        return self.fc(x)


@pytest.fixture
def no_frozen_objects():
    assert gc.get_freeze_count() == 0, "a test before this one left objects frozen"
    yield
    gc.unfreeze()  # (a failure here must not leave the next test frozen)


def test_the_simulation_keeps_the_objects_alive_before_it_out_of_the_collector(
    no_frozen_objects,
):
    model = _SeesTheCollector()
    memscale.wrap(model, FORCE, sample_input=torch.randn(4, 8))
    try:
        # Every forward of wrap is simulated, with the process's objects
        # frozen (the model among them); thawed when wrap returns.
        assert model.frozen and min(model.frozen) > 0
        assert gc.get_freeze_count() == 0
        frozen_before = len(model.frozen)
        model(torch.randn(4, 8)).sum().backward()
        assert model.frozen[frozen_before:] == [0]
    finally:
        memscale.detach(model)


def test_a_process_that_froze_objects_itself_keeps_them_frozen(no_frozen_objects):
    model = _SeesTheCollector()
    theirs = object.__new__(_SeesTheCollector)  # (tracked by the collector)
    gc.freeze()
    count = gc.get_freeze_count()
    memscale.wrap(model, FORCE, sample_input=torch.randn(4, 8))
    try:
        # Nothing more frozen while simulating (frozen objects may die),
        # and theirs still frozen after.
        assert model.frozen and max(model.frozen) <= count
        assert gc.get_freeze_count() > 0
        assert not any(o is theirs for o in gc.get_objects())
    finally:
        memscale.detach(model)


class _FreezesInForward(_SeesTheCollector):
    """Drops many objects it held before (frozen by the simulation: the
    freeze count falls), then freezes what is alive."""

    def __init__(self):
        super().__init__()
        self.old = [[] for _ in range(100_000)]

    def forward(self, x):
        self.old = None
        gc.freeze()
        return super().forward(x)


def test_a_freeze_made_while_simulating_is_kept(no_frozen_objects):
    """The simulation thaws only its own freeze: code it runs that freezes
    objects (or another thread) keeps them frozen, also when as many
    frozen objects died meanwhile."""
    model = _FreezesInForward()
    memscale.predict_peak(model, torch.randn(4, 8))
    assert gc.get_freeze_count() > 0


def test_a_world_that_fails_to_enter_thaws_the_objects(no_frozen_objects, monkeypatch):
    from memscale.predictor import _fake

    def failing(self):
        assert gc.get_freeze_count() > 0  # (frozen by then)
        raise RuntimeError("no fake world today")

    monkeypatch.setattr(_fake.FakeWorld, "__enter__", failing)
    with pytest.raises(RuntimeError, match="no fake world today"):
        memscale.predict_peak(_SeesTheCollector(), torch.randn(4, 8))
    assert gc.get_freeze_count() == 0


def test_an_error_putting_the_hooks_away_still_thaws_and_restores_the_model(
    no_frozen_objects, monkeypatch
):
    from memscale import _step_in_backward

    def failing(self):
        raise RuntimeError("the tier would not close")

    monkeypatch.setattr(_step_in_backward.StepInBackward, "remove", failing)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params)
    with pytest.raises(RuntimeError, match="the tier would not close"):
        memscale.predict_peak(
            model,
            torch.randn(4, 8),
            memscale.Config(optimizer_in_backward=True),
            optimizer=optimizer,
        )
    assert gc.get_freeze_count() == 0
    assert list(model.parameters()) == params
    assert not any(_torch_compat.is_fake(p) for p in model.parameters())


def test_garbage_there_before_a_simulation_is_collected_first_where_cuda_is_used(
    no_frozen_objects, monkeypatch
):
    """A dropped model in a reference cycle, not yet collected when the
    simulation starts, is collected then where CUDA is in use (its memory
    would count against the first steps), not frozen with the rest."""
    import weakref

    class Cycle:
        pass

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    threshold = gc.get_threshold()
    gc.set_threshold(0)  # (no automatic collection meanwhile)
    try:
        dropped = Cycle()
        dropped.me = dropped
        ref = weakref.ref(dropped)
        del dropped
        model = _SeesTheCollector()
        memscale.predict_peak(model, torch.randn(4, 8))
        assert ref() is None
    finally:
        gc.set_threshold(*threshold)


def test_a_simulation_that_fails_thaws_the_objects(no_frozen_objects):
    model = _SeesTheCollector()
    model.fail = True
    with pytest.raises(ValueError, match="a forward that fails"):
        memscale.predict_peak(model, torch.randn(4, 8))
    assert model.frozen and min(model.frozen) > 0
    assert gc.get_freeze_count() == 0
