"""Observability: logging (``logs``) and optional Prometheus metrics
(``metrics``, needs ``pip install 'memscale[metrics]'``).

``wrap`` uses both per its Config (``enable_logging``, ``log_file``,
``observability_port``); these names are for users who want more control,
such as serving metrics on another address.
"""

from .logs import ROOT_LOGGER, application_configured_logging, attach_logging
from .metrics import (
    DEFAULT_HOST,
    HOST_ENV,
    MetricsPortInUseError,
    MetricsServer,
    render_metrics,
    start_metrics_server,
)

__all__ = [
    "DEFAULT_HOST",
    "HOST_ENV",
    "MetricsPortInUseError",
    "MetricsServer",
    "ROOT_LOGGER",
    "application_configured_logging",
    "attach_logging",
    "render_metrics",
    "start_metrics_server",
]
