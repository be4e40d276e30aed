"""Offload: checkpointed layers' inputs to the disk tier (CPU), sync and async.

Gradients must be bitwise those of the unwrapped model; spill files are
private and never outlive what they hold; failures leave tensors in memory
(never wrong data) or raise clearly.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import (
    CNN,
    assert_same_grads,
    assert_same_step,
    hook_count,
    loss_of,
    mlp,
    spill_fds,
    tiny_bert,
    tiny_gpt2,
    token_batch,
    twins,
)

import memscale
from memscale import _core
from memscale.offload import HostTier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def offload_config(async_offload=False, **settings):
    settings.setdefault("min_offload_bytes", 0)
    return memscale.Config(
        mode="balanced",
        force_optimize=True,
        async_offload=async_offload,
        enable_logging=False,
        async_config=memscale.AsyncOffloadConfig(**settings),
    )


MODELS = {
    "mlp": (lambda: mlp(depth=4, width=32, p=0.1), lambda: torch.randn(4, 8, 32)),
    "gpt2": (tiny_gpt2, token_batch),
    "bert": (tiny_bert, token_batch),
    "cnn": (CNN, lambda: torch.randn(2, 3, 8, 8)),
}


@pytest.mark.parametrize("async_offload", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_bitwise_with_offload(name, async_offload):
    factory, make_input = MODELS[name]
    a, b = twins(factory)
    inp = make_input()
    memscale.wrap(a, offload_config(async_offload, debug=True), sample_input=inp)
    ex = a._memscale_executor
    assert ex.offload_store is not None and ex.offload_store.async_io is async_offload
    tiers = [layer.tier for layer in ex.plan.layers]
    assert "disk" in tiers and set(tiers) <= {"disk", "device"}
    for step in range(2):  # dropout: the recompute replays the same masks
        assert_same_step(a, b, inp, seed=step)
    stats = ex.offload_store.stats
    assert stats["tensors_written"] > 0
    assert stats["write_failures"] == 0
    # Every spilled tensor came back (or was still in memory, async).
    assert stats["tensors_read"] + stats["reused_in_flight"] == stats["tensors_written"]
    assert stats["verified"] == stats["tensors_read"]  # debug checksums
    assert stats["bytes_on_disk"] == 0
    path = ex.offload_store.path
    memscale.detach(a)
    assert not os.path.exists(path)
    assert hook_count(a) == 0


def test_async_prefetches_in_backward():
    a, b = twins(lambda: mlp(depth=6, width=32))
    inp = torch.randn(4, 8, 32)
    memscale.wrap(a, offload_config(True, prefetch_depth=2), sample_input=inp)
    assert_same_step(a, b, inp)
    stats = a._memscale_executor.offload_store.stats
    assert stats["prefetched"] > 0
    memscale.detach(a)


def test_offloaded_inputs_leave_memory_until_backward():
    """Between forward and backward the frames hold records, not tensors."""
    model = mlp(depth=4, width=64)
    inp = torch.randn(8, 16, 64)
    memscale.wrap(model, offload_config(), sample_input=inp)
    store = model._memscale_executor.offload_store
    loss = loss_of(model, inp)
    stats = store.stats
    # Layers 1..3 take a non-leaf input (layer 0 takes the user's tensor).
    assert stats["tensors_written"] == 3
    assert stats["bytes_on_disk"] == 3 * 8 * 16 * 64 * 4
    assert len(spill_fds(store.path)) == 1  # one file, a slot per tensor
    loss.backward()
    assert store.stats["bytes_on_disk"] == 0
    assert spill_fds(store.path) == []
    memscale.detach(model)


def test_retain_graph_second_backward():
    a, b = twins(lambda: mlp(depth=3, width=32))
    inp = torch.randn(4, 8, 32)
    memscale.wrap(a, offload_config(True), sample_input=inp)
    la, lb = loss_of(a, inp), loss_of(b, inp)
    la.backward(retain_graph=True)
    lb.backward(retain_graph=True)
    la.backward()
    lb.backward()
    assert_same_grads(a, b)
    memscale.detach(a)


def test_conservative_and_no_checkpointing_never_offload():
    model = mlp()
    inp = torch.randn(4, 8, 32)
    cfg = offload_config().replace(mode="conservative")
    memscale.wrap(model, cfg, sample_input=inp)
    assert all(layer.tier == "device" for layer in model._memscale_executor.plan.layers)
    assert model._memscale_executor.offload_store is None
    memscale.detach(model)
    memscale.wrap(model, offload_config().replace(enable_offloading=False), sample_input=inp)
    assert model._memscale_executor.plan.technique_counts["offload"] == 0
    memscale.detach(model)


def test_min_offload_bytes_keeps_small_inputs():
    model = mlp(depth=3, width=32)
    inp = torch.randn(4, 8, 32)  # inputs of 4 KiB
    memscale.wrap(model, offload_config(min_offload_bytes=4097), sample_input=inp)
    assert model._memscale_executor.plan.technique_counts["offload"] == 0
    memscale.detach(model)
    memscale.wrap(model, offload_config(min_offload_bytes=4096), sample_input=inp)
    assert model._memscale_executor.plan.technique_counts["offload"] == 3
    memscale.detach(model)


def test_plan_table_shows_the_tier(caplog):
    model = mlp(depth=2)
    with caplog.at_level(logging.DEBUG, logger="memscale"):
        memscale.wrap(
            model, offload_config().replace(enable_logging=True), sample_input=torch.randn(4, 8, 32)
        )
    assert "tier" in caplog.text and "checkpoint+offload" in caplog.text
    assert "disk" in caplog.text
    assert "memscale offload: sync" in caplog.text
    memscale.detach(model)


def test_spill_files_are_private_and_unlinked():
    model = mlp(depth=3, width=32)
    inp = torch.randn(4, 8, 32)
    memscale.wrap(model, offload_config(), sample_input=inp)
    path = model._memscale_executor.offload_store.path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    loss = loss_of(model, inp)
    fds = spill_fds(path)
    assert fds and os.listdir(path) == []  # unlinked at creation
    for fd in fds:
        st = os.fstat(fd)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.getuid()
    loss.backward()
    memscale.detach(model)


class Boom(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("boom")
        return self.inner(x)


def test_files_released_when_forward_raises():
    torch.manual_seed(0)
    blocks = mlp(depth=3, width=32)
    model = torch.nn.Sequential(*blocks, Boom(torch.nn.Linear(32, 32)))
    inp = torch.randn(4, 8, 32)
    memscale.wrap(model, offload_config(), sample_input=inp)
    path = model._memscale_executor.offload_store.path
    model[3].fail = True
    with pytest.raises(RuntimeError, match="boom"):
        model(inp)
    gc.collect()
    assert spill_fds(path) == []
    model[3].fail = False
    loss_of(model, inp).backward()  # still works afterwards
    memscale.detach(model)
    assert not os.path.exists(path)


def test_files_released_when_backward_raises():
    model = mlp(depth=3, width=32)
    inp = torch.randn(4, 8, 32)
    memscale.wrap(model, offload_config(), sample_input=inp)
    path = model._memscale_executor.offload_store.path
    loss = loss_of(model, inp)

    def fail(grad):
        raise RuntimeError("backward failed")

    loss.register_hook(fail)
    with pytest.raises(RuntimeError, match="backward failed"):
        loss.backward()
    del loss
    gc.collect()
    assert spill_fds(path) == []
    memscale.detach(model)


def test_directory_removed_when_model_is_collected():
    model = mlp(depth=3, width=32)
    inp = torch.randn(4, 8, 32)
    memscale.wrap(model, offload_config(True), sample_input=inp)
    path = model._memscale_executor.offload_store.path
    loss = loss_of(model, inp)
    del model, loss
    gc.collect()
    assert not os.path.exists(path)


def test_directory_removed_at_interpreter_exit(tmp_path):
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
        import memscale
        from conftest import mlp
        model = mlp(depth=3, width=32)
        inp = torch.randn(4, 8, 32)
        memscale.wrap(model, memscale.Config(
            mode="balanced", force_optimize=True, async_offload=True,
            async_config=memscale.AsyncOffloadConfig(
                min_offload_bytes=0, spill_dir={str(tmp_path)!r})),
            sample_input=inp)
        loss = model(inp).pow(2).mean()  # spilled, never backward, never detached
        print(model._memscale_executor.offload_store.path, flush=True)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip().splitlines()[-1]
    assert path.startswith(str(tmp_path))
    assert not os.path.exists(path)
    assert os.listdir(tmp_path) == []


def test_unwritable_spill_dir_is_an_error_at_wrap(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    model = mlp(depth=3, width=32)
    with pytest.raises(ValueError, match="spill directory.*spill_dir"):
        memscale.wrap(
            model,
            offload_config(spill_dir=str(not_a_dir / "sub")),
            sample_input=torch.randn(4, 8, 32),
        )
    assert hook_count(model) == 0
    assert "_memscale_executor" not in model.__dict__


def test_not_enough_disk_is_an_error_at_wrap(monkeypatch, tmp_path):
    import memscale._offload as offload

    class Tiny:
        f_bavail, f_frsize = 1, 512

    monkeypatch.setattr(offload.os, "statvfs", lambda path: Tiny)
    model = mlp(depth=3, width=32)
    with pytest.raises(ValueError, match="GiB free.*max_disk_gb"):
        memscale.wrap(
            model, offload_config(spill_dir=str(tmp_path)), sample_input=torch.randn(4, 8, 32)
        )
    assert hook_count(model) == 0
    assert os.listdir(tmp_path) == []  # the directory made for it is gone


def test_disk_cap_keeps_the_rest_in_memory(caplog):
    a, b = twins(lambda: mlp(depth=4, width=32))
    inp = torch.randn(4, 8, 32)  # 4 KiB inputs
    memscale.wrap(a, offload_config(max_disk_gb=6000 / (1 << 30)), sample_input=inp)
    with caplog.at_level(logging.INFO, logger="memscale"):
        for _ in range(2):
            loss_of(a, inp).backward()
            loss_of(b, inp).backward()
    assert_same_grads(a, b)
    stats = a._memscale_executor.offload_store.stats
    assert stats["tensors_written"] == 2 and stats["refused_over_cap"] == 4
    assert caplog.text.count("disk cap") == 1  # reported once
    memscale.detach(a)


def test_no_disk_tier_means_no_offload_on_cpu():
    model = mlp()
    memscale.wrap(model, offload_config(max_disk_gb=0), sample_input=torch.randn(4, 8, 32))
    assert model._memscale_executor.plan.technique_counts["offload"] == 0
    assert model._memscale_executor.offload_store is None
    memscale.detach(model)


def test_failed_writes_keep_tensors_in_memory(tmp_path):
    """A real write failure: a file-size limit below the tensor size."""
    code = textwrap.dedent(f"""
        import logging, resource, signal, sys, torch
        sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
        import memscale
        from conftest import mlp, twins, assert_same_grads
        logging.basicConfig(level=logging.WARNING)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
        for async_offload in (False, True):
            a, b = twins(lambda: mlp(depth=4, width=32))
            inp = torch.randn(4, 8, 32)
            memscale.wrap(a, memscale.Config(
                mode="balanced", force_optimize=True, enable_logging=False,
                async_offload=async_offload,
                async_config=memscale.AsyncOffloadConfig(
                    min_offload_bytes=0, spill_dir={str(tmp_path)!r})),
                sample_input=inp)
            for m in (a, b):
                m(inp).pow(2).mean().backward()
            assert_same_grads(a, b)
            s = a._memscale_executor.offload_store.stats
            assert s["write_failures"] == 3 and s["tensors_written"] == 0, s
            memscale.detach(a)
        print("OK")
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("OK")
    assert out.stderr.count("writing to the spill directory") == 2  # once per store
    assert "File too large" in out.stderr


def test_debug_checksum_catches_a_changed_file():
    model = mlp(depth=3, width=32)
    inp = torch.randn(4, 8, 32)
    memscale.wrap(model, offload_config(debug=True), sample_input=inp)
    path = model._memscale_executor.offload_store.path
    loss = loss_of(model, inp)
    fd = spill_fds(path)[0]
    os.pwrite(fd, b"\x7f" * 16, 0)  # what a faulty disk would do
    with pytest.raises(RuntimeError, match="different checksum"):
        loss.backward()
    memscale.detach(model)


def test_async_precedence(monkeypatch):
    model = mlp(depth=3)
    inp = torch.randn(4, 8, 32)

    def store_async(**kwargs):
        memscale.wrap(model, sample_input=inp, **kwargs)
        try:
            return model._memscale_executor.offload_store.async_io
        finally:
            memscale.detach(model)

    sync_cfg = offload_config(False)
    async_cfg = offload_config(True)
    monkeypatch.delenv("MEMSCALE_ASYNC_OFFLOAD", raising=False)
    assert store_async(config=async_cfg) is True
    assert store_async(config=sync_cfg) is False
    monkeypatch.setenv("MEMSCALE_ASYNC_OFFLOAD", "1")
    assert store_async(config=sync_cfg) is True  # the variable beats Config
    assert store_async(config=sync_cfg, async_offload=False) is False  # wrap() wins
    monkeypatch.setenv("MEMSCALE_ASYNC_OFFLOAD", "0")
    assert store_async(config=async_cfg) is False


def test_spill_store_round_trip_and_stats(tmp_path):
    logged = []
    store = _core.SpillStore(
        str(tmp_path),
        async_io=True,
        min_bytes=64,
        prefetch_depth=1,
        log=lambda *a: logged.append(a),
    )
    w = torch.randn(32, 32, requires_grad=True)
    acts = [w * i for i in range(4)]
    small = (w[:2, :2] * 2).contiguous()
    assert store.put(small) is None  # under min_bytes
    assert store.put(w) is None  # a leaf: a parameter, never spilled
    assert store.put(acts[0][:, :3]) is None  # not contiguous
    assert store.put(acts[0][:4]) is None  # a view of a larger storage
    recs = [store.put(t) for t in acts]
    expected = [t.detach().clone() for t in acts]
    store.flush()
    assert [r.state for r in recs] == ["disk"] * 4
    back = recs[3].get()
    assert torch.equal(back, expected[3]) and back.requires_grad
    assert recs[2].state == "reading"  # prefetched, depth 1
    for r, e in zip(recs, expected):
        assert torch.equal(r.get(), e)
    assert recs[0].get() is recs[0].get()  # loaded once
    store.close()
    assert store.closed and store.put(acts[0]) is None
    assert logged == []


def test_spilled_prefetch_starts_a_read_on_the_io_thread(tmp_path):
    """_Spilled.prefetch(): the optimizer-state tier reads the next
    parameter's state ahead by hand (any tensor, put_copy)."""
    store = _core.SpillStore(str(tmp_path), async_io=True, min_bytes=0)
    state = torch.randn(64, 64)
    expected = state.clone()
    rec = store.put_copy(state)
    del state
    store.flush()
    assert rec.state == "disk"
    assert rec.prefetch() is True
    assert rec.state in ("reading", "loaded")
    assert rec.prefetch() is False  # nothing left to start
    assert torch.equal(rec.get(), expected)
    assert store.stats["prefetched"] == 1
    assert rec.prefetch() is False  # loaded
    sync = _core.SpillStore(str(tmp_path), async_io=False, min_bytes=0)
    other = sync.put_copy(torch.randn(8))
    assert other.state == "disk" and other.prefetch() is False  # no I/O thread
    store.close()
    sync.close()
    late = _core.SpillStore(str(tmp_path), async_io=True, min_bytes=0)
    kept = late.put_copy(torch.randn(8))
    late.flush()
    late.close()
    assert kept.prefetch() is False  # a closed store starts nothing


def test_spill_store_rejects_bad_arguments(tmp_path):
    with pytest.raises(OSError):
        _core.SpillStore(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="min_bytes"):
        _core.SpillStore(str(tmp_path), min_bytes=-1)
    with pytest.raises(TypeError, match="log must be callable"):
        _core.SpillStore(str(tmp_path), log=3)
    ex = _core.Executor(mlp(), [])
    with pytest.raises(TypeError, match="SpillStore or None"):
        ex.set_offload("nope", None)
    ex.detach()


def test_host_tier_accounting_on_cpu(tmp_path):
    """The CUDA host tier's bookkeeping (pool, pageable, cap, disk), run on
    CPU tensors; the copies themselves need a GPU and are not tested here."""
    store = _core.SpillStore(str(tmp_path), min_bytes=0)
    tier = HostTier(
        pool_bytes=3000, cap_bytes=5000, min_bytes=0, store=store, async_copy=False, pin=False
    )
    w = torch.randn(16, 16, requires_grad=True)  # 1 KiB tensors
    acts = [w * i for i in range(6)]
    recs = [tier._put_host(t, 1024) for t in acts]
    assert tier.stats == {"to_pool": 2, "to_pageable": 2, "to_disk": 2, "kept": 0}
    assert tier.used == 4 * 1024
    for r, t in zip(recs, acts):
        out = r.get()
        assert torch.equal(out, t.detach()) and out.requires_grad
    del r, out
    recs.clear()
    gc.collect()
    assert tier.used == 0 and tier._pool_offset == 0
    no_disk = HostTier(
        pool_bytes=0, cap_bytes=1024, min_bytes=0, store=None, async_copy=False, pin=False
    )
    kept = [no_disk._put_host(t, 1024) for t in acts[:2]]
    assert kept[1] is None and no_disk.stats["kept"] == 1
    assert no_disk.put(acts[0]) is None  # a CPU tensor is not its business
    store.close()


def test_engine_host_tier_when_the_device_has_one():
    layers = [(f"l{i}", "Block", 0, 1000, 100, 10.0, 0) for i in range(4)]
    common = dict(
        mode="balanced",
        allowed=_core.TECH_CHECKPOINT | _core.TECH_OFFLOAD,
        force=True,
        budget_bytes=1 << 30,
        fixed_bytes=0,
        activation_bytes=4000,
        total_flops=40.0,
        device="cuda",
        device_count=1,
        capacity_bytes=1 << 30,
    )
    plan = _core.build_plan(layers, **common, host_tier=True, host_cap_bytes=250)
    assert [l.tier for l in plan.layers] == ["host", "host", "disk", "disk"]
    plan = _core.build_plan(layers, **common, host_tier=True, host_cap_bytes=250, disk_tier=False)
    assert [l.tier for l in plan.layers] == ["host", "host", "device", "device"]
    assert plan.layers[3].techniques == ("checkpoint",)
    with pytest.raises(ValueError, match="host_cap_bytes"):
        _core.build_plan(layers, **common, host_cap_bytes=-5)
    with pytest.raises(TypeError, match="disk_tier must be a bool"):
        _core.build_plan(layers, **common, disk_tier=1)


def test_async_cap_counts_writes_in_flight(tmp_path):
    store = _core.SpillStore(str(tmp_path), async_io=True, min_bytes=0, max_bytes=3 * 4096)
    w = torch.randn(32, 32, requires_grad=True)  # 4 KiB activations
    recs = [store.put(w * i) for i in range(6)]
    assert sum(r is not None for r in recs) == 3  # reserved at put()
    store.flush()
    assert store.stats["peak_bytes_on_disk"] <= 3 * 4096
    store.close()


def test_async_write_raced_by_in_place_update_is_refused(tmp_path):
    store = _core.SpillStore(str(tmp_path), async_io=True, min_bytes=0)
    w = torch.randn(512, 512, requires_grad=True)
    for _ in range(20):
        t = w * 2
        rec = store.put(t)
        with torch.no_grad():
            t.add_(1.0)  # while (or after) it is written
        with pytest.raises(RuntimeError, match="modified in place"):
            rec.get()
        with pytest.raises(RuntimeError, match="modified in place"):
            rec.get()  # and again: never the torn bytes
        assert rec.state == "stale"
    store.close()


def test_lazy_views_are_not_spilled(tmp_path):
    store = _core.SpillStore(str(tmp_path), min_bytes=0)
    w = torch.randn(16, 16, requires_grad=True)
    assert store.put(torch._neg_view(w * 2)) is None
    z = torch.randn(16, 16, dtype=torch.complex64, requires_grad=True)
    assert store.put((z * 2).conj()) is None
    assert store.put((w * 2).to_sparse()) is None
    store.close()


def test_concurrent_gets_of_one_record(tmp_path):
    import threading

    store = _core.SpillStore(str(tmp_path), async_io=True, min_bytes=0, prefetch_depth=2)
    w = torch.randn(256, 256, requires_grad=True)
    for trial in range(20):
        acts = [w * (i + trial) for i in range(4)]
        expected = [a.detach().clone() for a in acts]
        recs = [store.put(a) for a in acts]
        del acts
        store.flush()
        results: list = [None] * 8

        def reader(k, results=results, recs=recs):
            results[k] = recs[k % 4].get()

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for k, got in enumerate(results):
            assert torch.equal(got, expected[k % 4])
    store.close()


@pytest.mark.slow
@pytest.mark.parametrize("async_offload", [False, True], ids=["sync", "async"])
def test_a_deep_model_holds_one_descriptor_under_a_low_limit(async_offload):
    """Issue 20, item 5: one descriptor per spilled tensor ran a deep model
    out of RLIMIT_NOFILE in its forward (write failures, and the user's own
    open() failed with EMFILE).  The store now holds one file, a slot per
    tensor, however many tensors it spills."""
    import resource

    depth = 200
    torch.manual_seed(0)
    model = mlp(depth=depth, width=8)
    ref = copy.deepcopy(model)
    inp = torch.randn(2, 8)
    memscale.wrap(model, offload_config(async_offload), sample_input=inp)
    store = model._memscale_executor.offload_store
    opened = []

    def user_open(module, args, output):  # the user's own file, mid-forward
        with open(os.devnull) as f:
            opened.append(f.fileno())
        opened.append(len(spill_fds(store.path)))

    handle = model[depth - 1].register_forward_hook(user_open)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    limit = in_use + 32  # far fewer than the tensors spilled
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        a = loss_of(model, inp)
        a.backward()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        handle.remove()
    stats = store.stats
    assert stats["write_failures"] == 0
    assert stats["tensors_written"] >= depth - 1 > limit
    assert opened and opened[-1] <= 2  # spill descriptors at the peak
    b = loss_of(ref, inp)
    b.backward()
    assert torch.equal(a, b)
    assert_same_grads(model, ref)
    assert spill_fds(store.path) == []
    memscale.detach(model)


FORK_SCRIPT = textwrap.dedent("""
    import copy, os, sys, time
    import torch
    import memscale
    sys.path.insert(0, "tests")
    from conftest import assert_same_grads, mlp, train_step

    ASYNC = {async_offload}
    config = memscale.Config(
        mode="balanced", force_optimize=True, async_offload=ASYNC,
        enable_logging=False,
        async_config=memscale.AsyncOffloadConfig(min_offload_bytes=0,
                                                 prefetch_depth=2))
    model = mlp(depth=6, width=64)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16, 64)
    memscale.wrap(model, config, sample_input=x)
    store = model._memscale_executor.offload_store
    assert store.async_io is ASYNC
    path = store.path
    for seed in range(2):  # the I/O thread has run
        assert torch.equal(train_step(model, x, seed), train_step(ref, x, seed))
    loss = model(x).pow(2).mean()  # records alive (and writes in flight) at fork
    pid = os.fork()
    if pid == 0:
        # The child: trains the wrapped model to completion, exactly.  One
        # intra-op thread, as torch's DataLoader workers run: GNU OpenMP's
        # pool does not survive fork(), and torch's ops hang without this
        # (memscale or not).
        torch.set_num_threads(1)
        assert not store.async_io  # no I/O thread here: synchronous
        before = store.stats["tensors_written"]
        for seed in range(2, 4):
            a, b = train_step(model, x, seed), train_step(ref, x, seed)
            assert torch.equal(a, b)
            assert_same_grads(model, ref)
        assert store.stats["tensors_written"] > before
        loss.backward()  # the parent's records, read in the child
        sys.exit(0)  # a normal exit: finalizers and atexit run
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            sys.exit("the forked child hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0, status
    # The parent: its directory, records and I/O thread still work.
    assert os.path.isdir(path), "the child's exit removed the spill directory"
    loss.backward()
    ref.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    before = store.stats["tensors_written"]
    for seed in range(4, 6):
        a, b = train_step(model, x, seed), train_step(ref, x, seed)
        assert torch.equal(a, b)
        assert_same_grads(model, ref)
    assert store.stats["tensors_written"] > before and store.async_io is ASYNC
    assert store.stats["write_failures"] == 0
    memscale.detach(model)
    assert not os.path.exists(path)
    print("ok")
""")


@pytest.mark.slow
@pytest.mark.parametrize("async_offload", [False, True], ids=["sync", "async"])
def test_a_forked_child_trains_and_leaves_the_parent_working(async_offload):
    """Issue 20, item 4: a forked child that trained the wrapped model with
    async offload hung forever (the I/O thread does not exist in a child),
    and a child's normal exit removed the parent's spill directory (the
    finalizer ran in the child), after which offload was silently off."""
    out = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT.format(async_offload=async_offload)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
