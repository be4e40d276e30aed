"""Prometheus metrics for one wrapped model (``Config(observability_port=N)``).

``wrap`` starts an HTTP server on ``127.0.0.1:N`` (another address with the
environment variable ``MEMSCALE_METRICS_HOST`` (an IP address or "localhost"), or ``host=`` of
:func:`start_metrics_server`), in a daemon thread, serving its own
``CollectorRegistry`` (never the global one) at ``/metrics`` (any other path
is a 404).  ``detach`` stops it and frees the port, and so does the
executor's garbage collection (a model dropped without ``detach``).  At most
``MAX_CONNECTIONS`` connections are served at once (more are answered 503
and closed), and a connection idle for ``IDLE_TIMEOUT_S`` seconds is
closed.  The listening socket is close-on-exec, and a forked child (a
DataLoader worker) closes its copy at once, so the port is free again when
the parent detaches.  Every value is read from the executor when it is
scraped, so the counters follow training.  It needs ``prometheus_client``
(``pip install 'memscale[metrics]'``).

Metrics, following Prometheus naming (all gauges unless they end in
``_total``; bytes and seconds are base units).  Every metric is exported
from the first scrape on, before the plan exists: counters start at 0, and
a gauge whose value is not known yet (a figure of the plan, or a memory
figure this host does not have) is ``NaN``.

============================================== ==================================
``memscale_build_info``                        version, core ABI, torch and
                                               Python versions
``memscale_plan_info``                         plan hash, mode, device, profiling
                                               method, strategy, decision_source
                                               (empty strings until planned)
``memscale_executor_state``                    1 for the current state (label
                                               ``state``: profiling, applied,
                                               idle, detached)
``memscale_plan_layers``                       planning units per technique
                                               (label ``technique``: checkpoint,
                                               offload, tiling, none); 0 until
                                               planned
``memscale_predicted_peak_bytes``              the engine's peak of a training
                                               step (label ``plan``: unoptimized,
                                               optimized)
``memscale_memory_budget_bytes``               usable memory the plan is made for
``memscale_device_capacity_bytes``             detected capacity of one device
``memscale_memory_pressure_ratio``             predicted unoptimized peak / budget
``memscale_activation_saved_bytes``            activation bytes the plan frees
                                               (predicted)
``memscale_profiled_activation_bytes``         activation bytes the profiler
                                               measured
``memscale_device_peak_allocated_bytes``       peak bytes allocated on the device
                                               (``torch.cuda.max_memory_allocated``);
                                               NaN on a CPU host
``memscale_process_peak_resident_bytes``       peak resident memory of this
                                               process (VmHWM)
``memscale_offloaded_bytes_total``             bytes offloaded (label ``tier``:
                                               cpu, the host RAM of a GPU; disk,
                                               spill files)
``memscale_recompute_seconds_total``           time spent recomputing in backward
``memscale_layer_recomputes_total``            layer forwards run again in
                                               backward (a tiled layer: once per
                                               tile)
``memscale_segment_recomputes_total``          checkpoint segments recomputed in
                                               backward (a segment: one layer or
                                               several consecutive ones)
``memscale_checkpoint_segments_total``         checkpoint segments run in forward
``memscale_training_forwards_total``           training forward passes of the
                                               model (grad on, train mode)
``memscale_optimizer_steps_total``             ``step()`` calls of the optimizer
                                               memscale was given (0 without one)
``memscale_profiled_passes_total``             forwards measured for real before
                                               planning (``warmup_steps``)
``memscale_hooks``                             hooks memscale has attached
``memscale_active_checkpoint_segments``        checkpoint segments open right now
============================================== ==================================
"""

from __future__ import annotations

import errno
import logging
import os
import platform
import socket
import socketserver
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

if TYPE_CHECKING:
    from .._hardware import Hardware

__all__ = [
    "DEFAULT_HOST",
    "HOST_ENV",
    "MetricsPortInUseError",
    "MetricsServer",
    "render_metrics",
    "start_metrics_server",
]

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
HOST_ENV = "MEMSCALE_METRICS_HOST"
STATES = ("profiling", "applied", "idle", "detached")
TECHNIQUES = ("checkpoint", "offload", "tiling", "selective")
OFFLOAD_TIERS = ("cpu", "disk")
MAX_CONNECTIONS = 8  # served at once; more are answered 503
IDLE_TIMEOUT_S = 10.0  # a connection that sends nothing for this long is closed
PATH = "/metrics"


class MetricsPortInUseError(OSError):
    """``Config.observability_port`` is already taken on that address."""


def _require_prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(
            "Config(observability_port=...) needs the prometheus_client "
            "package: pip install 'memscale[metrics]' (or pip install "
            "prometheus_client), or leave observability_port=None"
        ) from exc
    return prometheus_client


NAN = float("nan")


def _device_peak(hardware: Hardware | None) -> float:
    """``torch.cuda.max_memory_allocated`` of the device; NaN on a host
    without a device allocator (CPU), or before CUDA is initialized."""
    if hardware is None or hardware.device != "cuda":
        return NAN
    try:
        import torch

        if torch.cuda.is_initialized():
            return float(torch.cuda.max_memory_allocated(hardware.index))
    except Exception:  # noqa: BLE001 - a scrape must not fail
        logger.debug("memscale metrics: CUDA peak unavailable", exc_info=True)
    return NAN


def _process_peak_rss() -> float:
    """Peak resident memory of this process, bytes (NaN if unknown)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(rss if platform.system() == "Darwin" else rss * 1024)
    except (ImportError, OSError):
        return NAN


class _ExecutorCollector:
    """Reads one executor at every scrape (it holds it weakly)."""

    def __init__(self, executor: Any) -> None:
        self._executor = weakref.ref(executor)

    def describe(self) -> list[Any]:
        return []  # no collect() at registration

    def collect(self) -> Iterator[Any]:
        import torch
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        from .. import _core
        from .._version import __version__

        yield InfoMetricFamily(
            "memscale_build",
            "memscale build information",
            value={
                "version": __version__,
                "core_abi": str(_core.ABI),
                "torch_version": torch.__version__,
                "python_version": platform.python_version(),
            },
        )
        ex = self._executor()
        if ex is None:
            return
        stats = ex.stats
        plan = ex.plan
        hardware: Hardware | None = getattr(ex, "hardware", None)
        decision = getattr(ex, "decision", None)

        state = GaugeMetricFamily(
            "memscale_executor_state", "1 for the executor's current state", labels=["state"]
        )
        current = ex.state
        for name in STATES:
            state.add_metric([name], 1.0 if current == name else 0.0)
        yield state

        def known(value: Any) -> float:
            return NAN if value is None else float(value)

        config = getattr(ex, "config", None)
        yield InfoMetricFamily(
            "memscale_plan",
            "the plan being applied (empty until planned)",
            value={
                "hash": plan.hash if plan is not None else "",
                "mode": plan.mode if plan is not None else "",
                "device": plan.device if plan is not None else "",
                "profiling": str(getattr(ex, "profiling", "")),
                "strategy": decision.strategy if decision is not None else "",
                "decision_source": decision.decision_source if decision is not None else "",
            },
        )
        layers = GaugeMetricFamily(
            "memscale_plan_layers",
            "planning units per technique (0 until planned)",
            labels=["technique"],
        )
        counts = plan.technique_counts if plan is not None else {}
        for name in TECHNIQUES:
            layers.add_metric([name], float(counts.get(name, 0)))
        untouched = 0 if plan is None else sum(1 for lp in plan.layers if not lp.techniques)
        layers.add_metric(["none"], float(untouched))
        yield layers
        peak = GaugeMetricFamily(
            "memscale_predicted_peak_bytes",
            "the engine's predicted peak of a training step (NaN until planned)",
            labels=["plan"],
        )
        peak.add_metric(
            ["unoptimized"], known(None if plan is None else plan.peak_unoptimized_bytes)
        )
        peak.add_metric(["optimized"], known(None if plan is None else plan.peak_projected_bytes))
        yield peak
        budget = plan.budget_bytes if plan is not None else None
        if (
            budget is None
            and config is not None
            and hardware is not None
            and hardware.capacity_bytes
        ):
            from .._planning import budget_bytes

            budget = budget_bytes(config, hardware)
        yield GaugeMetricFamily(
            "memscale_memory_budget_bytes",
            "usable memory the plan is made for",
            value=known(budget),
        )
        yield GaugeMetricFamily(
            "memscale_memory_pressure_ratio",
            "predicted unoptimized peak / budget (NaN until planned)",
            value=known(None if plan is None else plan.pressure),
        )
        yield GaugeMetricFamily(
            "memscale_activation_saved_bytes",
            "activation bytes the plan frees, predicted (NaN until planned)",
            value=known(
                None if plan is None else sum(lp.bytes_saved for lp in plan.layers if lp.techniques)
            ),
        )
        yield GaugeMetricFamily(
            "memscale_device_capacity_bytes",
            "detected capacity of one device",
            value=known(None if hardware is None else hardware.capacity_bytes),
        )
        profile = getattr(ex, "profile", None)
        yield GaugeMetricFamily(
            "memscale_profiled_activation_bytes",
            "activation bytes saved for backward, as profiled (NaN until profiled)",
            value=known(None if profile is None else profile.activation_bytes),
        )
        yield GaugeMetricFamily(
            "memscale_device_peak_allocated_bytes",
            "peak bytes allocated on the device "
            "(torch.cuda.max_memory_allocated; NaN on a CPU host)",
            value=_device_peak(hardware),
        )
        yield GaugeMetricFamily(
            "memscale_process_peak_resident_bytes",
            "peak resident memory of this process (VmHWM)",
            value=_process_peak_rss(),
        )

        offloaded = CounterMetricFamily(
            "memscale_offloaded_bytes", "bytes offloaded, per tier", labels=["tier"]
        )
        store = getattr(ex, "offload_store", None)
        host = getattr(ex, "offload_host", None)
        by_tier = {
            "cpu": float(host.bytes_to_host) if host is not None else 0.0,
            "disk": float(store.stats["bytes_written"]) if store is not None else 0.0,
        }
        for tier in OFFLOAD_TIERS:
            offloaded.add_metric([tier], by_tier[tier])
        yield offloaded
        yield CounterMetricFamily(
            "memscale_recompute_seconds",
            "time spent recomputing in backward",
            value=float(stats["recompute_seconds"]),
        )
        yield CounterMetricFamily(
            "memscale_layer_recomputes",
            "layer forwards run again in backward",
            value=float(getattr(ex, "layer_recomputes", 0)),
        )
        yield CounterMetricFamily(
            "memscale_segment_recomputes",
            "checkpoint segments (one or more consecutive layers) recomputed in backward",
            value=float(stats["recomputes"]),
        )
        yield CounterMetricFamily(
            "memscale_checkpoint_segments",
            "checkpoint segments run in forward",
            value=float(stats["checkpoint_frames"]),
        )
        yield CounterMetricFamily(
            "memscale_training_forwards",
            "training forward passes of the model",
            value=float(stats["training_forwards"]),
        )
        yield CounterMetricFamily(
            "memscale_optimizer_steps",
            "step() calls of the optimizer memscale was given",
            value=float(getattr(ex, "optimizer_steps", 0)),
        )
        yield CounterMetricFamily(
            "memscale_profiled_passes",
            "forwards measured for real before planning",
            value=float(stats["steps"]),
        )
        yield GaugeMetricFamily(
            "memscale_hooks", "hooks memscale has attached", value=float(stats["hooks"])
        )
        yield GaugeMetricFamily(
            "memscale_active_checkpoint_segments",
            "checkpoint segments open right now",
            value=float(stats["active_frames"]),
        )


class _Server(WSGIServer):
    """One thread per connection, at most ``MAX_CONNECTIONS`` at once."""

    allow_reuse_address = True
    timeout = 0.05  # handle_request() returns this often to see a stop

    def release(self) -> None:
        """Stop listening and close: the port is free at once, even while a
        forked child still holds a copy of the socket it has not closed yet
        (its fork hook runs when the child is first scheduled).  Only the
        process that serves calls this: ``shutdown`` acts on the socket
        every copy shares, ``server_close`` on this process's descriptor."""
        try:
            self.socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not listening any more, or a platform that refuses it
        self.server_close()

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(), a name lookup that
        # may go to DNS; memscale never touches the network.
        self.socket.set_inheritable(False)  # close-on-exec (Python's default)
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = port
        self.setup_environ()
        self._active = 0
        self._count_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._count_lock:
            full = self._active >= MAX_CONNECTIONS
            if not full:
                self._active += 1
        if full:
            try:
                request.sendall(
                    b"HTTP/1.0 503 Service Unavailable\r\n"
                    b"Content-Length: 0\r\nConnection: close\r\n\r\n"
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        thread = threading.Thread(
            target=self._serve_connection,
            args=(request, client_address),
            name=f"memscale-scrape:{self.server_port}",
            daemon=True,
        )
        try:
            thread.start()
        except BaseException:
            with self._count_lock:
                self._active -= 1
            self.shutdown_request(request)
            raise

    def _serve_connection(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - a bad client must not stop the server
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            with self._count_lock:
                self._active -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("memscale metrics: error serving %s", client_address, exc_info=True)


def _only_metrics(app: Any) -> Any:
    """``app`` at ``PATH``; 404 everywhere else."""

    def serve(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO", "") != PATH:
            body = f"not found: memscale serves metrics at {PATH}\n".encode()
            start_response(
                "404 Not Found",
                [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))],
            )
            return [body]
        return app(environ, start_response)

    return serve


def _serve(httpd: _Server, stop: threading.Event) -> None:
    """The server thread: requests until ``stop``, then the socket closes."""
    try:
        while not stop.is_set():
            httpd.handle_request()
    finally:
        httpd.release()


def _stop(httpd: _Server, stop: threading.Event, thread: threading.Thread) -> None:
    """Stop serving and free the port (also run when the executor is
    collected, possibly on the server thread itself)."""
    stop.set()
    if thread is threading.current_thread():
        return  # the loop ends after this request and closes the socket
    if thread.is_alive():
        thread.join(timeout=5)
    httpd.release()  # idempotent; frees the port if the join timed out


# Every live server of this process, for the fork hook.
_SERVERS: weakref.WeakSet[MetricsServer] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The child has no server thread; its copy of the listening socket would
    # keep the port bound after the parent detaches (DataLoader workers).
    for server in list(_SERVERS):
        server._closed = True
        server._stop_event.set()
        server._httpd.server_close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _QuietHandler(WSGIRequestHandler):
    def setup(self) -> None:
        super().setup()
        # A connection that sends nothing for this long is closed (read at
        # connection time: tests lower it).
        self.connection.settimeout(IDLE_TIMEOUT_S)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        logger.debug("metrics request: " + format, *args)


def _resolve(host: str) -> tuple[str, int]:
    """``(address, family)`` for an IP literal or "localhost".  Host names
    are refused: resolving one may query DNS, and memscale makes no
    network call."""
    if host == "localhost":
        return DEFAULT_HOST, socket.AF_INET
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return host, family
        except (OSError, ValueError):
            continue
    raise ValueError(
        f"memscale serves metrics on an IP address, got host {host!r} (from "
        f"{HOST_ENV} or host=): use an IPv4 or IPv6 literal such as "
        f"{DEFAULT_HOST} (the default), ::1 or 0.0.0.0, or 'localhost'"
    )


class MetricsServer:
    """Serves one executor's metrics over HTTP until :meth:`close`."""

    def __init__(self, executor: Any, port: int, host: str | None = None) -> None:
        prometheus_client = _require_prometheus()
        if host is None:
            host = os.environ.get(HOST_ENV, "").strip() or DEFAULT_HOST
        host, family = _resolve(host)
        self.host = host
        self.registry = prometheus_client.CollectorRegistry(auto_describe=False)
        self.registry.register(_ExecutorCollector(executor))
        app = prometheus_client.make_wsgi_app(self.registry)

        class Server(_Server):
            address_family = family

        try:
            self._httpd = Server((host, port), _QuietHandler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise MetricsPortInUseError(
                    exc.errno,
                    f"memscale cannot serve metrics on {host}:{port}: the port is "
                    "already in use (by another program, or by another model "
                    "wrapped with the same observability_port). Choose a free "
                    "port with Config(observability_port=...), or detach the "
                    "model that serves it",
                ) from exc
            raise OSError(
                exc.errno,
                f"memscale cannot serve metrics on {host}:{port}: "
                f"{exc.strerror or exc}. Check Config.observability_port and "
                f"the {HOST_ENV} environment variable (default {DEFAULT_HOST})",
            ) from exc
        self._httpd.set_app(_only_metrics(app))
        self.port = int(self._httpd.server_address[1])
        self._closed = False
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._thread = threading.Thread(
            target=_serve,
            args=(self._httpd, self._stop_event),
            name=f"memscale-metrics:{self.port}",
            daemon=True,
        )
        try:
            self._thread.start()
        except BaseException:
            self._httpd.release()
            raise
        # Stopped with the executor: a model dropped without detach frees
        # the port and the thread when it is collected.
        self._finalizer = weakref.finalize(
            executor, _stop, self._httpd, self._stop_event, self._thread
        )
        _SERVERS.add(self)
        logger.info("memscale: Prometheus metrics at %s", self.url)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @property
    def running(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def close(self) -> None:
        """Stop serving and free the port; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()  # runs _stop once
        logger.info("memscale: stopped serving metrics on %s:%d", self.host, self.port)

    def __repr__(self) -> str:
        return f"<memscale MetricsServer {self.url} {'running' if self.running else 'closed'}>"


def start_metrics_server(executor: Any, port: int, host: str | None = None) -> MetricsServer:
    """Serve ``executor``'s metrics on ``host:port`` (host: ``host``, else
    ``$MEMSCALE_METRICS_HOST``, else 127.0.0.1).  ``wrap`` calls this for
    ``Config(observability_port=port)``.  Raises
    :class:`MetricsPortInUseError` when the port is taken, ``ImportError``
    without prometheus_client."""
    return MetricsServer(executor, port, host)


def render_metrics(executor: Any) -> str:
    """The metrics of ``executor`` in the Prometheus text format, without a
    server (for logs and tests)."""
    prometheus_client = _require_prometheus()
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(_ExecutorCollector(executor))
    return prometheus_client.generate_latest(registry).decode("utf-8")
