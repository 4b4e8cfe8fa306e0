"""Switching OpenTelemetry on when the ``otel`` extra is installed, at no cost when it is not.

Nothing here imports OpenTelemetry: :func:`install_telemetry` (called when the library
is imported) looks for the package without importing it, and only
when it is there loads :mod:`celery_duraflow.contrib.opentelemetry`, which connects
its receivers to the library's signals. OpenTelemetry's own switches keep it off:
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` naming ``celery_duraflow`` (a comma-separated
list, as ``opentelemetry-instrument`` reads it) or ``OTEL_SDK_DISABLED=true``; so does
:func:`celery_duraflow.contrib.opentelemetry.uninstrument`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading

logger = logging.getLogger("celery_duraflow.telemetry")

#: The name this instrumentation goes by in ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``.
INSTRUMENTATION_NAME = "celery_duraflow"

_checked = False
_lock = threading.Lock()


def wanted() -> bool:
    """Whether OpenTelemetry should be switched on automatically: the API is installed
    and the environment does not say no. Imports nothing."""
    disabled = os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "")
    if INSTRUMENTATION_NAME in {name.strip() for name in disabled.split(",")}:
        return False
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    try:
        return importlib.util.find_spec("opentelemetry") is not None
    except (ImportError, ValueError):
        return False


def install_telemetry() -> None:
    """Instrument runs with OpenTelemetry if :func:`wanted`; once per process."""
    global _checked
    if _checked:
        return
    with _lock:
        if _checked:
            return
        _checked = True
        if not wanted():
            return
        try:
            from .contrib import opentelemetry
        except ImportError:
            # A namespace package without the API (another distribution's module).
            logger.debug("opentelemetry is present but its API is not; no telemetry",
                         exc_info=True)
            return
        opentelemetry.auto_instrument()
