"""Selective checkpointing on CUDA, where the fused attention kernels run.

On the CPU, SDPA runs a kernel torch's FLOP counter has no formula for,
so no CPU plan ever keeps an attention output; on CUDA the flash and
memory-efficient kernels have one, and at ``dropout_p == 0`` a selective
level may keep their outputs (``_selective.draws_random``).  These tests
check, on the device: that the fake-tensor pass that profiles a layer
picks the attention kernel a real forward runs (the plan counts the
kernel's outputs); that a kept attention output is not recomputed and the
gradients are the plain layer's, with dropout too (the recompute sets the
device's generator to the state the kernel left it in, so a dropout after
it draws the forward's mask); and that a Hugging Face
Llama's selective plan fits its budget with the predicted peak within 2%
of the device's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from conftest import Attention, tiny_gpt2, tiny_llama
from gpu_helpers import DEV, fresh_device, grads, record
from torch.utils._python_dispatch import TorchDispatchMode

import memscale
from memscale import _planning, _selective, _torch_compat
from memscale.config import GIB

pytestmark = pytest.mark.cuda

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@contextlib.contextmanager
def _deterministic_where_possible() -> Iterator[None]:
    """Deterministic kernels where torch has them (warnings elsewhere): a
    bitwise comparison below has its control, the plain layer run twice."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


class _Calls(TorchDispatchMode):
    """The names of the calls made under it, and each attention kernel's
    call (func, args, kwargs)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.attention: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        if _attention_ops([str(func)]):
            self.attention.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _selective_or_skip() -> None:
    if not _torch_compat.selective_supported():
        pytest.skip(f"torch {torch.__version__} cannot run memscale's selective checkpointing")


def _attention_ops(names: list[str]) -> list[str]:
    return [n for n in names if "scaled_dot_product" in n and "backward" not in n]


def _max_diff(a: list, b: list) -> float:
    return max(
        (float((x.float() - y.float()).abs().max()) for x, y in zip(a, b) if x is not None),
        default=0.0,
    )


# Seen on an H100 with torch 2.11 and transformers 5.17 (2026-11-27), before
# the fake pass kept small values real: in float32 it ran the
# memory-efficient kernel with a mask and the keys and values expanded to
# every head (Hugging Face builds the mask when the position ids it made
# with torch.arange are fake: it takes them for a trace), while the real
# forward passes no mask and enable_gqa=True, which that torch's efficient
# kernel does not take, so SDPA falls back to its math path (59.9 MB saved
# per layer of llama-12l against the fake pass's 45.2 MB).
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_fake_pass_picks_the_attention_kernel_a_real_forward_runs(dtype):
    """The profile is made on fake tensors; the attention kernel it records
    per layer must be the one the real forward runs, else the plan counts
    another kernel's outputs than the step keeps."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    fresh_device()
    model = tiny_llama(num_hidden_layers=2, attn_implementation="sdpa").to(DEV, DTYPES[dtype])
    model.train()
    ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(1)).to(DEV)
    fake_calls, real_calls = _Calls(), _Calls()
    # As the profile's fake pass runs the model (_planning._profile_static).
    with _planning.fake_pass(model, (), {"input_ids": ids}) as (_, kwargs, _):
        with fake_calls:
            model(**kwargs)
    with real_calls:
        model(input_ids=ids)
    fake = _attention_ops(fake_calls.names)
    real = _attention_ops(real_calls.names)
    record(f"selective_attention_kernel_{dtype}", {"fake": fake, "real": real})
    assert fake == real
    if dtype == "bf16":  # (in float32, torch 2.11 runs SDPA's math path: no kernel)
        assert len(real) == 2, real


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_a_selective_attention_block_on_cuda(dtype, p):
    """The first level keeps the attention kernel's outputs, with dropout
    too (the kernel draws from the device's default generator, which the
    recompute sets past it): the recompute does not run the kernel again,
    and the gradients are bitwise the plain block's (control: the plain
    block run twice)."""
    _selective_or_skip()
    fresh_device()
    x = torch.randn(8, 128, 64, generator=torch.Generator().manual_seed(4))
    x = x.to(DEV, DTYPES[dtype])
    block = Attention(p, width=64).to(DEV, DTYPES[dtype])
    plain = Attention(p, width=64).to(DEV, DTYPES[dtype])
    for m in (block, plain):
        m.train()
    calls = _Calls()
    with _selective.OpRecorder([block]) as rec, calls:
        block(x)
    rec.close()
    ops = rec.ops[0]
    kernels = _attention_ops(ops.names)
    assert len(kernels) == 1, ops.names
    at = ops.names.index(kernels[0])
    flops, nbytes, _, random = ops.calls[at]
    (func, args, kwargs), *_ = calls.attention
    record(
        f"selective_attention_kernel_{dtype}_p{p:g}",
        {
            "kernel": kernels[0],
            "flops": flops,
            "bytes": nbytes,
            "random": random,
            "tags": [str(t) for t in func.tags],
            "dropout_p": repr(_torch_compat.op_argument(func, args, kwargs, "dropout_p")),
            "schema": str(func._schema),
        },
    )
    # cuDNN's kernel counts as random at dropout 0 too (_selective.draws_random);
    # to the policy none is (its generator is the device's default one).
    assert _selective.draws_random(func, args, kwargs) == (p > 0.0 or "cudnn" in kernels[0])
    assert not random
    assert flops > 0.0, f"torch's FLOP counter has no formula for {kernels[0]}"
    levels = _selective.layer_profile(ops, flops=1e12, saved_bytes=10**12)
    assert levels
    threshold = levels[0][0]
    kept = _selective.keeps(threshold, flops, nbytes, random)

    def step(module, seed):
        module.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        torch.manual_seed(seed)
        out = _selective.run(block.forward, threshold, (xi,), {}) if module is block else module(xi)
        calls = _Calls()
        with calls:
            out.float().pow(2).mean().backward()
        return [xi.grad, *grads(module)], calls.names

    with _deterministic_where_possible():
        first, _ = step(plain, 11)
        again, _ = step(plain, 11)
        ours, backward_calls = step(block, 11)
    rerun = [n for n in backward_calls if n == kernels[0]]
    record(
        f"selective_attention_{dtype}_p{p:g}",
        {
            "kernel": kernels[0],
            "kept": kept,
            "kernel_reruns_in_backward": len(rerun),
            "plain_vs_plain_max_diff": _max_diff(first, again),
            "selective_vs_plain_max_diff": _max_diff(ours, first),
        },
    )
    assert kept
    assert not rerun
    assert _max_diff(first, again) == 0.0, "the plain block is not reproducible on this device"
    assert _max_diff(ours, first) == 0.0


class _AttentionThenDropout(Attention):
    """The attention block, then a dropout: a random call after the kernel."""

    def __init__(self, p: float, width: int) -> None:
        super().__init__(p, width)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(super().forward(x))


def test_a_kept_attention_kernel_with_dropout_leaves_later_draws_as_in_the_forward():
    """The kernel with dropout is kept; the recompute sets the CUDA
    generator to the state the forward's kernel left it in, so the dropout
    after it (recomputed) draws the forward's mask: the gradients are
    bitwise the plain block's, and the caller's generator ends where the
    plain step leaves it."""
    _selective_or_skip()
    fresh_device()
    x = torch.randn(8, 128, 64, generator=torch.Generator().manual_seed(4)).to(DEV)
    block = _AttentionThenDropout(0.1, width=64).to(DEV)
    plain = _AttentionThenDropout(0.1, width=64).to(DEV)
    plain.load_state_dict(block.state_dict())
    with _selective.OpRecorder([block]) as rec:
        block(x)
    rec.close()
    levels = _selective.layer_profile(rec.ops[0], flops=1e12, saved_bytes=10**12)
    threshold = levels[0][0]

    def step(module):
        module.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        torch.manual_seed(11)
        out = (
            _selective.run(module.forward, threshold, (xi,), {}) if module is block else module(xi)
        )
        calls = _Calls()
        with calls:
            out.pow(2).mean().backward()
        return [xi.grad, *grads(module)], calls.names, torch.cuda.get_rng_state()

    with _deterministic_where_possible():
        first, _, first_state = step(plain)
        again, _, _ = step(plain)
        ours, names, our_state = step(block)
    kernels = _attention_ops(names)
    record(
        "selective_attention_dropout_after",
        {
            "kernel_reruns_in_backward": len(kernels),
            "plain_vs_plain_max_diff": _max_diff(first, again),
            "selective_vs_plain_max_diff": _max_diff(ours, first),
        },
    )
    assert not kernels
    assert _max_diff(first, again) == 0.0, "the plain block is not reproducible on this device"
    assert _max_diff(ours, first) == 0.0
    assert torch.equal(our_state, first_state)


class _Keyworded(torch.nn.Module):
    """A block whose forward takes its input by keyword only, with dropout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.fc = torch.nn.Linear(64, 64)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, *, x):
        return x + self.drop(torch.relu(self.fc(x)))


def test_a_selective_layer_called_by_keyword_draws_the_forwards_masks_on_cuda():
    """torch's checkpoint restores the RNG state of the CUDA devices it
    finds among its positional arguments only; ``_selective.run`` hands it
    the keyword arguments positionally, so a layer called as
    ``layer(x=...)`` recomputes its dropout with the forward's masks: the
    gradients are bitwise the plain block's."""
    _selective_or_skip()
    fresh_device()
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(4)).to(DEV)
    block, plain = _Keyworded().to(DEV), _Keyworded().to(DEV)

    def step(module):
        module.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        torch.manual_seed(11)
        if module is block:
            out = _selective.run(module.forward, float("inf"), (), {"x": xi})
        else:
            out = module(x=xi)
        out.pow(2).mean().backward()
        return [xi.grad, *grads(module)]

    first, ours = step(plain), step(block)
    record("selective_keyword_dropout", {"max_diff": _max_diff(ours, first)})
    assert _max_diff(ours, first) == 0.0


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_llama_selective_plan_fits_on_cuda(dtype):
    """A 4-block Llama (SDPA) planned a fifth of its predicted activations
    below its unoptimized peak: some blocks run selective, the step's device peak is within the
    budget and within 2% of the plan's prediction, and the gradients are
    the unwrapped twin's."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    _selective_or_skip()
    fresh_device()

    def build():
        m = tiny_llama(num_hidden_layers=4, attn_implementation="sdpa").to(DEV, DTYPES[dtype])
        m.train()
        return m

    ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(1)).to(DEV)
    batch = {"input_ids": ids, "labels": ids}
    base = memscale.predict_peak(build(), batch, config=memscale.Config(memory_budget_gb=100))
    fresh_device()
    model = build()
    config = memscale.Config(
        mode="balanced",
        enable_offloading=False,
        # A fifth of the activations less (on CUDA the peak holds the
        # libraries' workspaces too, so not a share of the whole peak).
        memory_budget_gb=(base.unoptimized.peak_bytes - base.unoptimized.activations // 5) / GIB,
        enable_logging=False,
    )
    memscale.wrap(model, config, sample_input=batch)
    try:
        plan = model._memscale_executor.plan
        runs = [layer.name for layer in plan.layers if "selective" in layer.techniques]

        def stepper(m):
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

            def step():
                opt.zero_grad(set_to_none=True)
                torch.manual_seed(5)
                m(**batch).loss.backward()
                opt.step()

            return step

        from memscale.benchmarks.device import CudaMemory, measure_device_peak

        # One model on the device at a time: its peak is the whole
        # device's.  Each runs two steps (a warm-up and the measured one).
        with _deterministic_where_possible():
            ours = measure_device_peak(stepper(model), CudaMemory(DEV), warmup=1)
            ours_grads = [None if g is None else g.cpu() for g in grads(model)]
            memscale.detach(model)
            model = None
            fresh_device()
            ref = build()
            theirs = measure_device_peak(stepper(ref), CudaMemory(DEV), warmup=1)
            same_grads = _max_diff(ours_grads, [None if g is None else g.cpu() for g in grads(ref)])
        record(
            f"selective_llama_{dtype}",
            {
                "selective_layers": runs,
                "budget": plan.budget_bytes,
                "predicted": plan.peak_projected_bytes,
                "device_peak": ours.peak_bytes,
                "unwrapped_device_peak": theirs.peak_bytes,
                "error": (plan.peak_projected_bytes - ours.peak_bytes) / ours.peak_bytes,
                "grad_max_diff_vs_unwrapped": same_grads,
            },
        )
        assert runs
        assert ours.peak_bytes <= plan.budget_bytes
        assert abs(plan.peak_projected_bytes - ours.peak_bytes) <= 0.02 * ours.peak_bytes
        assert same_grads == 0.0
    finally:
        if model is not None:
            memscale.detach(model)


def _allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(DEV)


def test_gpt2s_dead_projection_is_left_to_cudas_fused_dropout():
    """On CUDA, dropout is torch's fused kernel (``native_dropout``), which
    draws its mask from the RNG alone: the MLP's output projection (each
    block's fourth addmm) is read only by it, and every level of every
    block leaves the projection unrun and unkept (the dropout runs on it
    unwritten, drawing its mask as in the forward).  Each block run
    selective at the level keeping least, with the skip: its recompute
    makes one addmm fewer than a whole one, the forward holds the
    projection's output less than without the skip, and the gradients are
    bitwise the plain model's (control: the plain model twice)."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    _selective_or_skip()
    fresh_device()

    def build():
        m = tiny_gpt2(dropout=0.1, n_layer=4, n_positions=256).to(DEV)
        m.train()
        return m

    model, plain = build(), build()
    ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(1)).to(DEV)
    units = [(f"transformer.h.{i}", block) for i, block in enumerate(model.transformer.h)]
    profile = _planning.profile_upfront(model, units, {"input_ids": ids}, memscale.Config())
    calls = _Calls()
    with calls:
        plain(input_ids=ids)
    dropouts = sorted({n for n in calls.names if "dropout" in n or "bernoulli" in n})
    skips = [sorted({s for _, s in d.get("skips", ())}) for d in profile.details]
    record("gpt2_dead_calls_cuda", {"dropout_ops": dropouts, "skips": [str(s) for s in skips]})
    assert "aten.native_dropout.default" in dropouts
    # The dropout reading the projection runs on it unwritten: its mask is
    # drawn from the RNG alone, and the tail's residual add alone reads it.
    dead = (("aten.addmm.default", 3), ("aten.native_dropout.default", 1))
    assert skips == [[dead]] * len(units)
    originals = [block.forward for _, block in units]

    def run_selective(level: str) -> None:
        for (_, block), layer, detail, forward in zip(
            units, profile.layers, profile.details, originals
        ):
            # The level keeping least (its largest threshold), with or
            # without its skip; or a threshold that keeps nothing.
            threshold = max(t for t, _, _ in layer.selective_levels)
            skip = _planning.skips_from(detail, threshold) if level == "skip" else ()
            if level == "nothing":
                threshold = 1e30
            tail = _planning.tail_from(detail)

            def selective(*args, _f=forward, _t=threshold, _s=skip, _u=block, _tail=tail, **kw):
                return _selective.run(_f, _t, args, kw, _tail, _u, _s)

            block.forward = selective

    def step(m, seed):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        before = _allocated()
        loss = m(input_ids=ids, labels=ids).loss
        held = _allocated() - before
        backward = _Calls()
        with backward:
            loss.backward()
        return loss.detach(), grads(m), backward.names.count("aten.addmm.default"), held

    runs = {}
    try:
        with _deterministic_where_possible():
            loss0, first, _, _ = step(plain, 7)
            _, again, _, _ = step(plain, 7)
            for level in ("skip", "noskip", "nothing"):
                run_selective(level)
                runs[level] = step(model, 7)
    finally:
        for (_, block), forward in zip(units, originals):
            block.forward = forward
    projection = ids.numel() * model.config.n_embd * 4  # float32
    record(
        "gpt2_dead_calls_cuda_run",
        {
            "plain_vs_plain_max_diff": _max_diff(first, again),
            **{f"{k}_vs_plain_max_diff": _max_diff(v[1], first) for k, v in runs.items()},
            **{f"{k}_addmm_in_backward": v[2] for k, v in runs.items()},
            **{f"{k}_forward_holds": v[3] for k, v in runs.items()},
            "projection_bytes": projection,
        },
    )
    assert _max_diff(first, again) == 0.0, "the plain model is not reproducible on this device"
    for level, (loss, ours, _, _) in runs.items():
        assert torch.equal(loss, loss0), level
        assert _max_diff(ours, first) == 0.0, level
    assert runs["nothing"][2] - runs["skip"][2] == len(units)
    assert runs["noskip"][2] == runs["skip"][2]
    assert runs["noskip"][3] - runs["skip"][3] == len(units) * projection
