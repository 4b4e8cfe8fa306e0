"""Every Celery signal celery-duraflow listens to, connected in one place."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from celery.signals import worker_process_init, worker_ready

from ._config import Config, config_for_app
from ._replication import read_replication, replication_warning
from ._store import all_stores, store_for
from .errors import ConfigurationError

logger = logging.getLogger("celery_duraflow.worker")

# Brokers that live in this process or on this host's disk: a SQLite store is no worse.
_LOCAL_BROKERS = ("memory", "filesystem", "")

_installed = False
_lock = threading.Lock()


def _reset_engines_after_fork(**_kwargs: Any) -> None:
    # A prefork child inherits the parent's pool: drop it without closing the parent's sockets.
    for store in all_stores():
        store.dispose_after_fork()


def _announce_store(sender: Any = None, **_kwargs: Any) -> None:
    """Say once, as the worker starts, which store its runs go to (and check the settings).

    The configuration is read here (after Celery set up its logging), so a
    misspelled ``duraflow_*`` key is reported at start, not only at the first task.
    """
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        config = config_for_app(app)
    except ConfigurationError as exc:
        logger.error("celery-duraflow cannot run this worker's durable tasks: %s", exc)
        return
    url = config.database_url
    if url.get_backend_name() == "sqlite":
        where = f"the SQLite file {os.path.abspath(url.database or '')}"
    else:
        where = url.render_as_string(hide_password=True)
    logger.info("celery-duraflow: runs are stored in %s (tables %s*)", where,
                config.table_prefix)
    if url.get_backend_name() == "postgresql":
        _check_replication(config)
    broker = str(app.conf.broker_url or "").partition("://")[0].split("+")[0]
    if url.get_backend_name() == "sqlite" and broker not in _LOCAL_BROKERS:
        logger.warning(
            "celery-duraflow stores runs in %s while this worker takes tasks from a %s broker "
            "that other hosts may share: the runs are durable on this host only, and a worker "
            "elsewhere would keep a store of its own. Set duraflow_database_url to one "
            "PostgreSQL database for every worker.", where, broker)


def _check_replication(config: Config) -> None:
    """Warn if the store's server streams to a standby a failover could lose steps to."""
    try:
        with store_for(config).engine.connect() as conn:
            warning = replication_warning(read_replication(conn))
    except Exception as exc:  # a store that is down now is reported at the first task
        logger.info("celery-duraflow could not read the store's replication settings: %s",
                    exc)
        return
    if warning is not None:
        logger.warning("celery-duraflow: %s", warning)


def install_signal_handlers() -> None:
    """Connect the handlers (idempotent); called when a DurableTask class is created."""
    global _installed
    if _installed:
        return
    with _lock:
        if not _installed:
            worker_process_init.connect(_reset_engines_after_fork, weak=False)
            worker_ready.connect(_announce_store, weak=False)
            _installed = True
