"""Logging and Prometheus metrics: a real HTTP scrape during training, port
conflicts, the host option, log files, and cleanup after errors."""

from __future__ import annotations

import logging
import math
import os
import socket
import subprocess
import sys
import textwrap
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import free_port, hook_count, mlp

import memscale
from memscale import _planning, observability
from memscale._solve import solve
from memscale.observability import MetricsPortInUseError

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

FORCE = dict(mode="conservative", force_optimize=True)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """GET the endpoint; {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def metrics_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("memscale-metrics")]


def port_is_free(port: int) -> bool:
    """Whether a server (SO_REUSEADDR, as servers set it) can listen there."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


def test_scrape_during_training():
    model = mlp()
    x = torch.randn(8, 32)
    port = free_port()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    memscale.wrap(
        model,
        memscale.Config(**FORCE, observability_port=port),
        sample_input=x,
        optimizer=optimizer,
    )
    executor = model._memscale_executor
    server = executor.metrics_server
    assert server.url == f"http://127.0.0.1:{port}/metrics" and server.running

    before = scrape(server.url)
    assert value(before, "memscale_training_forwards_total") == 0
    assert value(before, "memscale_optimizer_steps_total") == 0
    assert value(before, "memscale_plan_layers", technique="checkpoint") == 4
    assert value(before, "memscale_plan_layers", technique="none") == 0
    assert value(before, "memscale_executor_state", state="applied") == 1
    assert value(before, "memscale_offloaded_bytes_total", tier="cpu") == 0
    assert value(before, "memscale_offloaded_bytes_total", tier="disk") == 0
    assert (
        value(before, "memscale_predicted_peak_bytes", plan="unoptimized")
        == executor.plan.peak_unoptimized_bytes
    )
    assert (
        value(before, "memscale_predicted_peak_bytes", plan="optimized")
        == executor.plan.peak_projected_bytes
    )
    assert (
        value(before, "memscale_activation_saved_bytes")
        == sum(layer.bytes_saved for layer in executor.plan.layers)
        > 0
    )
    # Process and device memory apart: a CPU host has no device allocator.
    assert value(before, "memscale_process_peak_resident_bytes") > 0
    assert math.isnan(value(before, "memscale_device_peak_allocated_bytes"))
    assert not any(k[0] == "memscale_measured_peak_bytes" for k in before)
    info = [k for k in before if k[0] == "memscale_build_info"]
    assert dict(info[0][1])["version"] == memscale.__version__
    plan_info = dict(next(k for k in before if k[0] == "memscale_plan_info")[1])
    assert plan_info["hash"] == executor.plan.hash
    assert plan_info["decision_source"] == "user_config"

    # A scrape from inside each training step (a forward hook of the whole
    # model, before backward): the values are read at that moment.
    during = []
    handle = model.register_forward_hook(lambda *args: during.append(scrape(server.url)))
    for _ in range(3):
        model(x).sum().backward()
        optimizer.step()
    handle.remove()
    assert [value(s, "memscale_training_forwards_total") for s in during] == [1, 2, 3]
    assert [value(s, "memscale_optimizer_steps_total") for s in during] == [0, 1, 2]
    assert value(during[0], "memscale_active_checkpoint_segments") == 0
    assert value(during[0], "memscale_checkpoint_segments_total") == 4

    after = scrape(server.url)
    assert value(after, "memscale_training_forwards_total") == 3
    assert value(after, "memscale_optimizer_steps_total") == 3
    assert value(after, "memscale_checkpoint_segments_total") == 12
    # Every layer alone: a segment per layer, one layer per recompute.
    assert value(after, "memscale_segment_recomputes_total") == 12
    assert value(after, "memscale_layer_recomputes_total") == 12
    assert value(after, "memscale_recompute_seconds_total") > 0
    assert value(after, "memscale_recompute_seconds_total") == pytest.approx(
        executor.stats["recompute_seconds"]
    )

    assert metrics_threads() == [f"memscale-metrics:{port}"]
    memscale.detach(model)
    assert not server.running and metrics_threads() == []
    with pytest.raises(urllib.error.URLError):
        scrape(server.url)
    assert port_is_free(port)


def test_metric_names_follow_prometheus_conventions():
    model = mlp()
    memscale.wrap(model, memscale.Config(**FORCE), sample_input=torch.randn(4, 32))
    text = observability.render_metrics(model._memscale_executor)
    memscale.detach(model)
    families = list(text_string_to_metric_families(text))
    assert len(families) >= 18
    for family in families:
        assert family.name.startswith("memscale_"), family.name
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples), family.name
        if "bytes" in family.name:
            assert family.name.endswith("_bytes"), family.name
        if "seconds" in family.name:
            assert family.name.endswith("_seconds"), family.name


def names(samples) -> set[tuple[str, tuple]]:
    return {(name, tuple(k for k, _ in labels)) for name, labels in samples}


def test_every_metric_is_exported_before_the_plan():
    model = mlp()
    x = torch.randn(8, 32)
    port = free_port()
    memscale.wrap(model, memscale.Config(**FORCE, observability_port=port))
    url = model._memscale_executor.metrics_server.url
    first = scrape(url)  # no sample_input: planned in the first forward
    assert value(first, "memscale_executor_state", state="idle") == 1
    assert value(first, "memscale_plan_layers", technique="checkpoint") == 0
    assert value(first, "memscale_training_forwards_total") == 0
    assert value(first, "memscale_layer_recomputes_total") == 0
    assert math.isnan(value(first, "memscale_predicted_peak_bytes", plan="optimized"))
    assert math.isnan(value(first, "memscale_memory_pressure_ratio"))
    assert value(first, "memscale_memory_budget_bytes") > 0  # known before the plan
    plan_info = dict(next(k for k in first if k[0] == "memscale_plan_info")[1])
    assert plan_info["hash"] == "" and plan_info["profiling"] == "first_step"
    for _ in range(3):
        model(x).sum().backward()
    later = scrape(url)
    assert names(later) == names(first)  # the same series, before and after
    assert value(later, "memscale_executor_state", state="applied") == 1
    assert value(later, "memscale_profiled_passes_total") == 0
    assert value(later, "memscale_plan_layers", technique="checkpoint") == 4
    assert value(later, "memscale_layer_recomputes_total") == 12
    memscale.detach(model)
    assert port_is_free(port)


def test_warmup_metrics_follow_the_executor():
    model = mlp()
    x = torch.randn(8, 32)
    port = free_port()
    memscale.wrap(model, memscale.Config(**FORCE, observability_port=port, warmup_steps=2))
    model._memscale_executor.measure_real_steps()  # real steps measured, unoptimized
    url = model._memscale_executor.metrics_server.url
    first = scrape(url)
    assert value(first, "memscale_executor_state", state="profiling") == 1
    for _ in range(3):
        model(x).sum().backward()
    later = scrape(url)
    assert value(later, "memscale_executor_state", state="applied") == 1
    assert value(later, "memscale_profiled_passes_total") == 2
    assert value(later, "memscale_plan_layers", technique="checkpoint") == 4
    assert value(later, "memscale_layer_recomputes_total") == 4  # the applied step
    memscale.detach(model)
    assert port_is_free(port)


def test_layer_and_segment_recomputes_are_counted_apart():
    from conftest import tiny_gpt2, token_batch

    from memscale import _core

    model = tiny_gpt2(dropout=0.0).train()
    ids = token_batch()
    port = free_port()
    memscale.wrap(
        model, memscale.Config(enable_logging=False, observability_port=port), sample_input=ids
    )
    ex = model._memscale_executor
    # A plan with a segment of two blocks (the budget planner's, from the
    # profile with inflated inputs: see test_segments.py).
    problem = _planning.plan_problem(ex.profile, ex.config, ex.hardware, 0)
    rows = [
        _core.LayerStats((n, k, pb, sb, sb * 9 // 10, fl, fg))
        for (n, k, pb, sb, ib, fl, fg) in problem.layers
    ]
    total = sum(row.saved_bytes for row in rows)
    plan = solve(
        problem.replace(
            layers=tuple(rows),
            fixed_bytes=0,
            activation_bytes=total,
            peak_offset_bytes=0,
            budget_bytes=int(total * 0.7),
        )
    )
    assert [layer.segment for layer in plan.layers] == [0, 0, -1]
    ex.apply(plan)
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
    after = scrape(ex.metrics_server.url)
    assert value(after, "memscale_checkpoint_segments_total") == 2
    assert value(after, "memscale_segment_recomputes_total") == 2
    assert value(after, "memscale_layer_recomputes_total") == 4  # two blocks each
    memscale.detach(model)


@pytest.mark.parametrize("with_sample", [True, False])
def test_port_in_use_raises_and_leaves_nothing(with_sample):
    model = mlp()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = memscale.Config(**FORCE, observability_port=port)
        with pytest.raises(MetricsPortInUseError, match=f"127.0.0.1:{port}.*already in use") as err:
            memscale.wrap(model, config, sample_input=torch.randn(4, 32) if with_sample else None)
        assert isinstance(err.value, OSError)
        assert "observability_port" in str(err.value)
        assert hook_count(model) == 0
        assert not hasattr(model, "_memscale_executor")
        assert metrics_threads() == []
    # The model can be wrapped again (on a free port).
    memscale.wrap(model, config.replace(observability_port=free_port()))
    memscale.detach(model)
    assert hook_count(model) == 0


def test_two_models_on_one_port():
    first, second = mlp(), mlp()
    port = free_port()
    config = memscale.Config(**FORCE, observability_port=port)
    memscale.wrap(first, config)
    with pytest.raises(MetricsPortInUseError):
        memscale.wrap(second, config)
    assert hook_count(second) == 0
    assert value(scrape(f"http://127.0.0.1:{port}/metrics"), "memscale_hooks") > 0
    memscale.detach(first)


def test_failure_after_the_server_started_stops_it(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("planning failed")

    monkeypatch.setattr(_planning, "plan_problem", broken)
    model = mlp()
    port = free_port()
    with pytest.raises(RuntimeError, match="planning failed"):
        memscale.wrap(
            model,
            memscale.Config(**FORCE, observability_port=port),
            sample_input=torch.randn(4, 32),
        )
    assert hook_count(model) == 0 and not hasattr(model, "_memscale_executor")
    assert port_is_free(port)
    assert metrics_threads() == []


def test_metrics_host_option(monkeypatch):
    model = mlp()
    port = free_port("127.0.0.2")
    monkeypatch.setenv("MEMSCALE_METRICS_HOST", "127.0.0.2")
    memscale.wrap(model, memscale.Config(**FORCE, observability_port=port))
    server = model._memscale_executor.metrics_server
    assert server.host == "127.0.0.2"
    assert server.url == f"http://127.0.0.2:{port}/metrics"
    assert value(scrape(server.url), "memscale_hooks") > 0
    memscale.detach(model)

    # The explicit API: any executor, any local address.
    monkeypatch.delenv("MEMSCALE_METRICS_HOST")
    memscale.wrap(model, memscale.Config(**FORCE), sample_input=torch.randn(4, 32))
    server = observability.start_metrics_server(model._memscale_executor, free_port())
    try:
        assert server.host == "127.0.0.1"
        assert value(scrape(server.url), "memscale_plan_layers", technique="checkpoint") == 4
    finally:
        server.close()
        server.close()  # idempotent
        memscale.detach(model)


@pytest.mark.parametrize("host", ["metrics.example.com", "not an address"])
def test_host_names_are_refused(monkeypatch, host):
    monkeypatch.setenv("MEMSCALE_METRICS_HOST", host)
    model = mlp()
    with pytest.raises(ValueError, match="MEMSCALE_METRICS_HOST"):
        memscale.wrap(model, memscale.Config(**FORCE, observability_port=free_port()))
    assert hook_count(model) == 0 and not hasattr(model, "_memscale_executor")
    assert metrics_threads() == []


def test_missing_prometheus_client_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    model = mlp()
    with pytest.raises(ImportError, match=r"memscale\[metrics\]"):
        memscale.wrap(model, memscale.Config(**FORCE, observability_port=free_port()))
    assert hook_count(model) == 0 and not hasattr(model, "_memscale_executor")


# ---- logging ------------------------------------------------------------------


def ours(handler) -> bool:
    return getattr(handler, "_memscale_owned", False)


def test_log_file_gets_the_plan_and_is_closed_by_detach(tmp_path):
    path = tmp_path / "memscale.log"
    logger = logging.getLogger("memscale")
    level = logger.level
    model = mlp()
    memscale.wrap(
        model, memscale.Config(**FORCE, log_file=str(path)), sample_input=torch.randn(4, 32)
    )
    handlers = [h for h in logger.handlers if ours(h)]
    assert len(handlers) == 1
    memscale.detach(model)
    assert not [h for h in logger.handlers if ours(h)]
    assert logger.level == level
    text = path.read_text()
    assert "memscale hardware: cpu x1" in text
    assert "memscale plan " in text and "force-all" in text
    assert "decision_source=user_config" in text
    assert handlers[0].stream is None  # closed


def test_two_models_share_one_log_file(tmp_path):
    path = tmp_path / "shared.log"
    a, b = mlp(), mlp()
    config = memscale.Config(**FORCE, log_file=path)
    memscale.wrap(a, config, sample_input=torch.randn(4, 32))
    memscale.wrap(b, config, sample_input=torch.randn(4, 32))
    logger = logging.getLogger("memscale")
    assert len([h for h in logger.handlers if ours(h)]) == 1
    memscale.detach(a)
    assert len([h for h in logger.handlers if ours(h)]) == 1
    memscale.detach(b)
    assert not [h for h in logger.handlers if ours(h)]
    assert path.read_text().count("memscale plan ") == 2


def test_unwritable_log_file_raises_and_leaves_nothing(tmp_path):
    model = mlp()
    bad = tmp_path / "missing-dir" / "x.log"
    with pytest.raises(OSError, match="log_file"):
        memscale.wrap(
            model,
            memscale.Config(**FORCE, log_file=str(bad), observability_port=free_port()),
            sample_input=torch.randn(4, 32),
        )
    assert hook_count(model) == 0 and not hasattr(model, "_memscale_executor")
    assert not [h for h in logging.getLogger("memscale").handlers if ours(h)]


def test_log_file_without_logging_warns(tmp_path):
    path = tmp_path / "never.log"
    model = mlp()
    with pytest.warns(UserWarning, match="enable_logging=False"):
        memscale.wrap(model, memscale.Config(**FORCE, enable_logging=False, log_file=path))
    memscale.detach(model)
    assert not path.exists()


def test_stderr_unless_the_application_configured_logging(tmp_path):
    """In a fresh interpreter (pytest itself configures logging)."""
    script = textwrap.dedent("""
        import logging, sys, torch, memscale
        from torch import nn
        def run(**kw):
            model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
            memscale.wrap(model, memscale.Config(mode="conservative",
                          force_optimize=True, **kw), sample_input=torch.randn(2, 8))
            memscale.detach(model)
        print("== default", file=sys.stderr, flush=True)
        run()
        print("== disabled", file=sys.stderr, flush=True)
        run(enable_logging=False)
        print("== configured", file=sys.stderr, flush=True)
        logging.basicConfig(level=logging.WARNING)
        run()
        assert logging.getLogger("memscale").level == logging.NOTSET
        print("== end", file=sys.stderr, flush=True)
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(memscale.__file__).resolve().parent.parent)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    err = done.stderr
    default = err.split("== default")[1].split("== disabled")[0]
    disabled = err.split("== disabled")[1].split("== configured")[0]
    configured = err.split("== configured")[1].split("== end")[0]
    # Quiet by default: one INFO line for the plan, and where the table is.
    lines = [line for line in default.splitlines() if "memscale" in line]
    assert len(lines) == 1, default
    assert lines[0].startswith("INFO memscale.api: memscale: plan ")
    assert "describe()" in lines[0] and "mode conservative" in lines[0]
    assert "hardware" not in default and "decision_source" not in default
    assert "memscale" not in disabled
    assert "memscale" not in configured
    assert done.stdout == ""  # no print outside the CLI


def test_offloaded_bytes_are_scraped():
    model = mlp(depth=4)
    x = torch.randn(4, 8, 32)
    port = free_port()
    memscale.wrap(
        model,
        memscale.Config(
            mode="balanced",
            force_optimize=True,
            enable_logging=False,
            observability_port=port,
            async_config=memscale.AsyncOffloadConfig(min_offload_bytes=0),
        ),
        sample_input=x,
    )
    server = model._memscale_executor.metrics_server
    assert value(scrape(server.url), "memscale_offloaded_bytes_total", tier="disk") == 0
    model(x).pow(2).mean().backward()
    after = scrape(server.url)
    # Three blocks take a non-leaf input of 4 x 8 x 32 floats each.
    assert value(after, "memscale_offloaded_bytes_total", tier="disk") == 3 * 4 * 8 * 32 * 4
    assert value(after, "memscale_offloaded_bytes_total", tier="cpu") == 0
    memscale.detach(model)


def scrape_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("memscale-scrape")]


def http_get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def wait_for(condition, what: str, limit: float = 30.0) -> None:
    """Poll ``condition`` (a server thread finishing, a timeout firing); the
    limit only stops a test that would otherwise hang."""
    import time

    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


def test_only_the_metrics_path_is_served():
    """Issue 20, item 6: every GET path returned the metrics."""
    model = mlp()
    port = free_port()
    memscale.wrap(model, memscale.Config(**FORCE, observability_port=port))
    assert http_get(port, "/metrics") == 200
    for path in ("/", "/favicon.ico", "/metrics/extra", "/admin"):
        assert http_get(port, path) == 404, path
    assert http_get(port, "/metrics?name[]=memscale_hooks") == 200
    memscale.detach(model)


def test_idle_connections_are_capped_and_time_out(monkeypatch):
    """Issue 20, item 6: 300 idle connections made 302 threads that never
    timed out."""
    from memscale.observability import metrics

    monkeypatch.setattr(metrics, "IDLE_TIMEOUT_S", 600.0, raising=False)
    model = mlp()
    port = free_port()
    before = threading.active_count()
    memscale.wrap(model, memscale.Config(**FORCE, observability_port=port))
    idle = []
    try:
        for _ in range(2 * metrics.MAX_CONNECTIONS):  # twice the cap
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            idle.append(s)
            # The server thread and at most MAX_CONNECTIONS others.
            assert threading.active_count() <= before + 1 + metrics.MAX_CONNECTIONS
        # Beyond the cap, a connection is answered 503 and closed.
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert s.recv(1024).startswith(b"HTTP/1.0 503")
        s.close()
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: scrape_threads() == [], "closed connections' threads ended")
    # An idle connection is closed by the server after IDLE_TIMEOUT_S.
    monkeypatch.setattr(metrics, "IDLE_TIMEOUT_S", 0.2)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3)]
    try:
        for s in idle:
            assert s.recv(1) == b""  # the server closed it
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: scrape_threads() == [], "idle connections' threads ended")
    assert value(scrape(f"http://127.0.0.1:{port}/metrics"), "memscale_hooks") > 0
    memscale.detach(model)
    assert metrics_threads() == [] and port_is_free(port)


def test_a_model_dropped_without_detach_frees_the_port():
    """Issue 20, item 6: the server thread and the port outlived a model
    dropped without detach."""
    import gc

    model = mlp()
    port = free_port()
    memscale.wrap(model, memscale.Config(**FORCE, observability_port=port))
    assert http_get(port, "/metrics") == 200
    del model
    gc.collect()
    wait_for(lambda: metrics_threads() == [], "the server thread ended")
    assert port_is_free(port)
    again = mlp()
    memscale.wrap(again, memscale.Config(**FORCE, observability_port=port))
    memscale.detach(again)


def test_the_port_is_free_while_a_child_has_not_closed_its_copy_yet():
    """A forked child closes its copy of the listening socket in its fork
    hook, which runs only when the child is first scheduled: on a loaded
    machine the parent could detach before that and find the port still
    taken.  A descriptor duplicated here stands in for that copy."""
    model = mlp()
    port = free_port()
    memscale.wrap(model, memscale.Config(**FORCE, observability_port=port))
    server = model._memscale_executor.metrics_server
    copy = os.dup(server._httpd.socket.fileno())
    try:
        memscale.detach(model)
        assert port_is_free(port)
    finally:
        os.close(copy)


def test_a_forked_child_does_not_keep_the_port():
    """Issue 20, item 6: a forked DataLoader worker inherited the listening
    socket, so the port stayed bound after detach and a re-wrap failed."""
    model = mlp()
    port = free_port()
    memscale.wrap(model, memscale.Config(**FORCE, observability_port=port))
    server = model._memscale_executor.metrics_server
    assert not os.get_inheritable(server._httpd.socket.fileno())  # close-on-exec
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child waits, as a worker would, holding what it inherited
        try:
            os.close(write_end)
            os.read(read_end, 1)
        finally:
            os._exit(0)
    os.close(read_end)
    try:
        memscale.detach(model)
        assert port_is_free(port)
        again = mlp()
        memscale.wrap(again, memscale.Config(**FORCE, observability_port=port))
        assert http_get(port, "/metrics") == 200
        memscale.detach(again)
    finally:
        os.close(write_end)
        os.waitpid(pid, 0)
