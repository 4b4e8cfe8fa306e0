"""Every Celery signal celery-duraflow listens to, connected in one place."""

from __future__ import annotations

import threading
from typing import Any

from celery.signals import worker_process_init

_installed = False
_lock = threading.Lock()


def _reset_engines_after_fork(**_kwargs: Any) -> None:
    # A prefork child inherits the parent's pool: drop it without closing the parent's sockets.
    from ._store import all_stores

    for store in all_stores():
        store.dispose_after_fork()


def install_signal_handlers() -> None:
    """Connect the handlers (idempotent); called when a DurableTask class is created."""
    global _installed
    if _installed:
        return
    with _lock:
        if not _installed:
            worker_process_init.connect(_reset_engines_after_fork, weak=False)
            _installed = True
