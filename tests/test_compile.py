"""memscale under torch.compile (memscale/_compiled.py, docs/compile.md).

The quick tests compile with ``backend="aot_eager"``: dynamo and AOT
autograd (the tracing and the partition the plan must survive) without
inductor's code generation, which takes seconds per graph on this host.
The ``slow`` ones use the default inductor backend, the Hugging Face
Trainer's ``torch_compile=True`` and a compiled LightningModule.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from conftest import (
    FORCE,
    assert_same_grads,
    hf_training_args,
    lightning_trainer,
    mlp,
    tiny_gpt2,
    token_batch,
    twins,
)

import memscale
from memscale import Config
from memscale.benchmarks.runner import _checkpoint_every_unit


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    yield
    torch._dynamo.reset()


class Graphs:
    """A dynamo backend that keeps every graph it is given, then hands it to
    ``inner`` (a backend name or callable)."""

    def __init__(self, inner: str = "aot_eager") -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.inner = lookup_backend(inner)
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self.inner(gm, example_inputs)

    def regions(self) -> int:
        """Checkpoint regions (dynamo's checkpoint higher-order op) in the graphs."""
        return sum(
            1
            for gm in self.graphs
            for node in gm.graph.nodes
            if node.op == "call_function" and "checkpoint" in str(node.target).lower()
        )


def graph_breaks(but_planning: bool = False) -> int:
    """Graph breaks dynamo counted; ``but_planning``: not counting the
    planning on the first training forward (wrap without sample_input),
    which runs eagerly by design, once."""
    return sum(
        n
        for reason, n in dynamo_utils.counters["graph_break"].items()
        if not (but_planning and "FirstForward._hook" in reason)
    )


def step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss = (out if isinstance(out, torch.Tensor) else out.logits).square().mean()
    loss.backward()
    return loss.detach()


def test_wrap_then_compile_runs_the_plan_as_checkpoint_regions():
    model, ref = twins(lambda: mlp(depth=2, p=0.0))
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE, sample_input=x)
    executor = model._memscale_executor
    backend = Graphs()
    compiled = torch.compile(model, backend=backend)
    loss = step(compiled, x)
    # One graph, one checkpoint region per checkpointed layer, no break.
    assert len(backend.graphs) == 1
    assert backend.regions() == 2
    assert graph_breaks() == 0
    # The C executor's hooks stayed out of it: no eager frame was opened.
    assert executor.stats["checkpoint_frames"] == 0
    assert executor.stats["training_forwards"] == 0
    # The same gradients as the unwrapped model, and as torch's own
    # checkpointing of the same layers compiled the same way.
    assert torch.equal(loss, step(ref, x))
    assert_same_grads(model, ref)
    # A second step reuses the compiled code.
    step(compiled, x)
    assert len(backend.graphs) == 1
    torch._dynamo.reset()
    _checkpoint_every_unit(ref)
    peer = Graphs()
    step(torch.compile(ref, backend=peer), x)
    step(model, x)  # eager, as wrapped: the executor's frames
    assert_same_grads(model, ref)
    assert peer.regions() == backend.regions()
    memscale.detach(model)


def test_memscales_first_pre_hooks_are_first_in_the_dicts_own_order_too():
    """memscale's root pre-hooks that must run first (the recompute check's,
    first-step planning's) are first both in the OrderedDict's order, which
    ``Module.__call__`` runs, and in the plain dict's (``dict.keys``), which
    torch 2.11's dynamo read into a guard: with ``prepend=True`` alone the
    two disagreed, and compiling a wrapped model failed dynamo's own guard
    check there.  The other hooks keep their order and ids."""
    from memscale import _torch_compat

    model = mlp(depth=2, p=0.0)
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append("user"))
    handle = _torch_compat.register_first_pre_hook(model, lambda m, a: seen.append("first"))
    hooks = model._forward_pre_hooks
    assert next(iter(hooks)) == next(iter(dict.keys(hooks))) == handle.id
    model(torch.randn(2, 32))
    assert seen == ["first", "user"]
    handle.remove()
    assert len(hooks) == 1
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE, sample_input=x)  # the recompute check's hook
    hooks = model._forward_pre_hooks
    assert len(hooks) >= 2 and list(hooks) == list(dict.keys(hooks))
    memscale.detach(model)


def test_the_regions_save_only_their_inputs():
    """What the compiled graph keeps for backward: each checkpointed block
    its input, none of its intermediates (the forward graph's outputs)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    saved: list[int] = []

    def backend(gm, example_inputs):
        def fw(g, inputs):
            # The forward graph's outputs: the loss path plus what backward needs.
            saved.append(len(next(iter(reversed(g.graph.nodes))).args[0]))
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

    def saved_by(model, x):
        saved.clear()
        torch._dynamo.reset()
        step(torch.compile(model, backend=backend), x)
        return saved[0]

    x = torch.randn(4, 32)
    plain, wrapped = twins(lambda: mlp(depth=4, p=0.0))
    memscale.wrap(wrapped, FORCE, sample_input=x)
    assert saved_by(wrapped, x) < saved_by(plain, x)
    memscale.detach(wrapped)


def test_compile_then_wrap_keeps_the_users_compiled_object():
    model, ref = twins(lambda: mlp(depth=2, p=0.0))
    x = torch.randn(4, 32)
    backend = Graphs()
    compiled = torch.compile(model, backend=backend)
    assert memscale.wrap(compiled, FORCE, sample_input=x) is compiled
    assert "_memscale_executor" in model.__dict__  # the module it compiles
    assert compiled._memscale_executor is model._memscale_executor
    step(compiled, x)
    assert backend.regions() == 2 and graph_breaks() == 0
    step(ref, x)
    assert_same_grads(model, ref)
    with pytest.raises(RuntimeError, match="already wrapped"):
        memscale.wrap(compiled, FORCE, sample_input=x)
    memscale.detach(compiled)
    assert "_memscale_executor" not in model.__dict__
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_detach_restores_the_eager_model_and_recompiles_unwrapped():
    model, ref = twins(lambda: mlp(depth=2, p=0.0))
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE, sample_input=x)
    backend = Graphs()
    compiled = torch.compile(model, backend=backend)
    step(compiled, x)
    assert backend.regions() == 2
    memscale.detach(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert "_compiled_call_impl" not in model.__dict__
    step(compiled, x)  # recompiles: the graph is the unwrapped model's
    assert len(backend.graphs) == 2
    assert not any("checkpoint" in str(n.target).lower() for n in backend.graphs[-1].graph.nodes)
    step(ref, x)
    assert_same_grads(model, ref)
    # The eager model is the unwrapped one: no hook of memscale's.
    step(model, x)
    assert_same_grads(model, ref)


def test_detaching_the_compiled_object_frees_the_executor():
    # torch.compile(model) after wrap copies the module's __dict__ (and so
    # memscale's executor) into the wrapper functions it makes around the
    # module; detach through the compiled object drops those copies.
    import gc
    import weakref

    model = mlp(depth=2, p=0.0)
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE, sample_input=x)
    executor = weakref.ref(model._memscale_executor)
    compiled = torch.compile(model, backend="eager")
    step(compiled, x)
    memscale.detach(compiled)
    gc.collect()
    assert executor() is None
    assert not hasattr(model, "_memscale_executor")
    step(compiled, x)  # still runs, unwrapped


def test_blocks_compiled_one_by_one_share_one_graph():
    # block.compile() on each of 12 blocks: blocks planned alike must not
    # recompile per block (dynamo's recompile limit is 8; past it the
    # remaining blocks run uncompiled).
    model, ref = twins(lambda: mlp(depth=12, p=0.0))
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE, sample_input=x)
    dynamo_utils.counters.clear()
    backend = Graphs()
    calls = []

    def counting(gm, example_inputs):
        compiled = backend(gm, example_inputs)

        def run(*args):
            calls.append(1)
            return compiled(*args)

        return run

    for block in model:
        block.compile(backend=counting)
    step(model, x)
    step(model, x)
    assert not dynamo_utils.counters["unimplemented"], dict(dynamo_utils.counters["unimplemented"])
    assert len(backend.graphs) <= 2  # one graph (and one more at most for the first step)
    assert len(calls) == 2 * 12  # every block ran compiled, both steps
    assert all(
        any("checkpoint" in str(n.target).lower() for n in g.graph.nodes) for g in backend.graphs
    )
    step(ref, x)
    assert_same_grads(model, ref)
    memscale.detach(model)


def test_a_new_plan_recompiles_with_its_regions():
    model = mlp(depth=2, p=0.0)
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE, sample_input=x)
    executor = model._memscale_executor
    backend = Graphs()
    compiled = torch.compile(model, backend=backend)
    step(compiled, x)
    assert backend.regions() == 2
    # The same layers, the first left un-checkpointed: the graph follows.
    executor._compile_regions.units[0].checkpoint = False
    step(compiled, x)
    assert len(backend.graphs) == 2
    last = backend.graphs[-1]
    assert sum("checkpoint" in str(n.target).lower() for n in last.graph.nodes) == 1
    memscale.detach(model)


def test_evaluation_and_no_grad_run_without_regions():
    model = mlp(depth=2, p=0.0)
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE, sample_input=x)
    backend = Graphs()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        compiled(x)
    model.eval()
    compiled(x)
    assert backend.regions() == 0
    memscale.detach(model)


def test_first_forward_planning_then_regions_under_compile():
    model, ref = twins(lambda: mlp(depth=2, p=0.0))
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE)  # no sample_input: planned in the first forward
    backend = Graphs()
    compiled = torch.compile(model, backend=backend)
    step(compiled, x)
    assert model._memscale_executor.plan is not None
    assert backend.regions() == 2
    step(ref, x)
    assert_same_grads(model, ref)
    memscale.detach(model)


def test_what_cannot_run_compiled_is_listed_and_logged_once_per_layer(caplog):
    model, ref = twins(lambda: mlp(depth=2, p=0.0))
    x = torch.randn(4, 8, 32)
    config = Config(
        mode="balanced",
        force_optimize=True,
        use_mixed_precision=True,
        async_config=memscale.AsyncOffloadConfig(min_offload_bytes=0),
    )
    memscale.wrap(model, config, sample_input=x)
    executor = model._memscale_executor
    plan = executor.plan
    offloaded = [layer.name for layer in plan.layers if "offload" in layer.techniques]
    assert offloaded, plan  # the host's disk tier: offload on every layer
    fallbacks = executor.compile_fallbacks
    assert ("", "mixed_precision") in [(f.layer, f.technique) for f in fallbacks]
    assert sorted(f.layer for f in fallbacks if f.technique == "offload") == sorted(offloaded)
    backend = Graphs()
    compiled = torch.compile(model, backend=backend)
    with caplog.at_level(logging.INFO, logger="memscale"):
        step(compiled, x)
        step(compiled, x)
    lines = [r.getMessage() for r in caplog.records if "under torch.compile" in r.getMessage()]
    assert len(lines) == len(fallbacks)  # once each, not per trace or step
    for name in offloaded:
        assert any(f"offload of layer {name!r} is not applied" in line for line in lines)
    assert any("mixed_precision of the model" in line for line in lines)
    # The fallback: each layer checkpointed, in full precision, nothing
    # spilled, and the gradients those of the model as it is.
    assert backend.regions() == len(plan.layers)
    assert executor.offload_store.stats["bytes_written"] == 0
    assert graph_breaks() == 0
    step(ref, x)
    assert_same_grads(model, ref)
    memscale.detach(model)


def test_a_segment_is_one_region_per_layer_when_compiled():
    from test_segments import Chain, X, segment_plan, segments

    model, ref = twins(lambda: Chain(depth=4))
    for m in (model, ref):
        for module in m.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    executor, plan = segment_plan(model, X, frac=0.9, inflate=20)
    executor.apply(plan)
    checkpointed = [layer for layer in plan.layers if "checkpoint" in layer.techniques]
    groups = [s for s in set(segments(plan)) if segments(plan).count(s) > 1 and s >= 0]
    assert groups, segments(plan)
    notes = [f for f in executor.compile_fallbacks if f.technique == "segment"]
    assert len(notes) == len(groups)
    backend = Graphs()
    step(torch.compile(model, backend=backend), X)
    assert backend.regions() == len(checkpointed)
    assert graph_breaks() == 0
    step(ref, X)
    assert_same_grads(model, ref)
    memscale.detach(model)


def test_tiled_layers_run_whole_and_checkpointed_when_compiled():
    model, ref = twins(lambda: mlp(depth=2, p=0.0))
    x = torch.randn(16, 32)
    memscale.wrap(
        model,
        Config(mode="aggressive", force_optimize=True, enable_offloading=False),
        sample_input=x,
    )
    executor = model._memscale_executor
    tiled = [layer.name for layer in executor.plan.layers if layer.tiles > 1]
    if not tiled:
        pytest.skip("the plan tiles no layer of this model")
    assert {f.layer for f in executor.compile_fallbacks if f.technique == "tiling"} == set(tiled)
    backend = Graphs()
    step(torch.compile(model, backend=backend), x)
    assert executor.stats["tiled_calls"] == 0
    assert graph_breaks() == 0
    step(ref, x)
    assert_same_grads(model, ref)
    memscale.detach(model)


@pytest.mark.slow
def test_graph_breaks_of_gpt2_no_more_than_torch_checkpointing():
    model, ref = twins(lambda: tiny_gpt2(dropout=0.0))
    ids = token_batch()
    memscale.wrap(model, FORCE, sample_input=ids)
    ours = Graphs()
    step(torch.compile(model, backend=ours), ids)
    breaks = graph_breaks()
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    with warnings.catch_warnings():  # transformers 5 renamed it (FutureWarning)
        warnings.simplefilter("ignore", FutureWarning)
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref.config.use_cache = False
    theirs = Graphs()
    step(torch.compile(ref, backend=theirs), ids)
    assert breaks <= graph_breaks()
    assert len(ours.graphs) <= len(theirs.graphs)
    assert ours.regions() == theirs.regions() == len(model.transformer.h)
    assert_same_grads(model, ref)
    memscale.detach(model)


# ---- inductor and the frameworks (slow) ------------------------------------


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.slow
def test_inductor_gradients_match_the_compiled_unwrapped_model():
    model, ref = twins(lambda: tiny_gpt2(dropout=0.0))
    ids = token_batch()
    memscale.wrap(model, FORCE, sample_input=ids)
    loss = step(torch.compile(model), ids)
    ref_loss = step(torch.compile(ref), ids)
    assert rel(loss, ref_loss) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) <= 1e-5, name
    memscale.detach(model)


@pytest.mark.slow
def test_hf_trainer_with_torch_compile(tmp_path, monkeypatch):
    from conftest import TokenDataset
    from torch._dynamo.backends import registry
    from transformers import Trainer, TrainerCallback

    # aot_eager (AOT autograd's partition, quicker than inductor), seen by us.
    backend = Graphs()
    monkeypatch.setitem(registry._COMPILER_FNS, "aot_eager", backend)
    seen = []

    class Spy(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            ex = model.__dict__["_memscale_executor"]
            seen.append((ex.plan.technique_counts["checkpoint"], ex.stats["checkpoint_frames"]))

    model = tiny_gpt2(dropout=0.0)
    args = hf_training_args(
        tmp_path,
        torch_compile=True,
        torch_compile_backend="aot_eager",
        max_steps=2,
        per_device_train_batch_size=2,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(token_batch(batch=4)))
    memscale.wrap(trainer, FORCE)
    trainer.add_callback(Spy())
    trainer.train()
    # Planned from the first batch, then carried out as checkpoint regions
    # in the compiled graph: every block checkpointed, no eager frame.
    layers = len(model.transformer.h)
    assert seen == [(layers, 0), (layers, 0)]
    assert backend.regions() == layers
    # Breaks: the first step's planning (eager by design) and transformers'
    # own logger.warning_once in the model's loss, none of memscale's.
    others = [
        reason
        for reason in dynamo_utils.counters["graph_break"]
        if "FirstForward._hook" not in reason and "<Logger transformers." not in reason
    ]
    assert others == []
    assert "_memscale_executor" not in model.__dict__  # the callback detached
    memscale.detach(trainer)


@pytest.mark.slow
def test_compiled_lightning_module():
    pl = pytest.importorskip("lightning.pytorch")
    from memscale.integrations.lightning import MemScaleCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(depth=2, p=0.0)

        def training_step(self, batch, _):
            return self.net(batch).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    seen = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args, **kwargs):
            ex = pl_module.__dict__["_memscale_executor"]
            seen.append((ex.plan.technique_counts["checkpoint"], ex.stats["checkpoint_frames"]))

    torch.manual_seed(0)
    module = Module()
    data = torch.utils.data.DataLoader(torch.randn(8, 32), batch_size=4)
    backend = Graphs()
    compiled = torch.compile(module, backend=backend)
    trainer = lightning_trainer(pl, max_steps=2, callbacks=[MemScaleCallback(FORCE), Spy()])
    trainer.fit(compiled, data)
    assert seen == [(2, 0), (2, 0)]
    assert backend.regions() == 2
    # The one break: the first step's planning, which runs eagerly.
    assert graph_breaks(but_planning=True) == 0


def test_a_class_forward_patched_after_wrap_is_seen():
    """Each unit carries memscale's compiled-path forward from wrap to
    detach; a library that patches the layer's class after the model was
    built (and wrapped) must still be the forward that runs."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x)

    model = torch.nn.Sequential(Block(), Block())
    x = torch.randn(4, 8)
    memscale.wrap(model, FORCE, sample_input=x)
    try:
        Block.forward = lambda self, x: self.lin(x) * 2.0  # type: ignore[method-assign]
        out = model(x)
        memscale.detach(model)
        assert torch.equal(out, model(x))
    finally:
        if "_memscale_executor" in model.__dict__:
            memscale.detach(model)


class _Flagged(torch.nn.Module):
    """A block whose forward takes a keyword named as one of torch's
    checkpoint's own arguments (``debug``), default True."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, x, debug=True):
        y = x + torch.relu(self.fc(x))
        return y * 2 if debug else y


class _FlaggedStack(torch.nn.Sequential):
    def forward(self, x):
        for block in self:
            x = block(x, debug=False)
        return x


def test_a_keyword_named_as_a_checkpoint_argument_reaches_the_compiled_region():
    """Compiled, a checkpointed layer's region hands its keyword arguments
    to torch's checkpoint positionally (as the eager selective run does):
    ``debug=False`` reaches the forward, not the checkpoint (which took it
    as its own flag: the forward ran with ``debug=True``, or the
    compilation failed), in one graph with a region per layer, and the
    loss and gradients are the unwrapped model's."""

    def build():
        torch.manual_seed(0)
        return _FlaggedStack(*[_Flagged() for _ in range(3)]).train()

    model, ref = build(), build()
    x = torch.randn(4, 32)
    memscale.wrap(model, FORCE, sample_input=x)
    backend = Graphs()
    loss = step(torch.compile(model, backend=backend), x)
    assert backend.regions() == 3
    assert graph_breaks() == 0
    assert torch.equal(loss, step(ref, x))
    assert_same_grads(model, ref)
    memscale.detach(model)
