"""The Celery app of the test project, configured from environment variables.

* ``PROJ_BROKER_URL``: the broker (Redis); required.
* ``PROJ_RESULT_BACKEND``: the result backend; defaults to the broker URL.
* ``PROJ_DATABASE_URL``: the PostgreSQL (or SQLite) database that holds both the
  duraflow step store and the project's own ledger tables; required.
* ``PROJ_TABLE_PREFIX``: the duraflow table prefix, which the ledger tables
  share (``<prefix>charges``, ``<prefix>notify_outages``); default ``proj_``.
* ``PROJ_LEASE_SECONDS``: ``duraflow_lease_seconds`` (default 30).
* ``PROJ_EVENT_LOG``: a file the chaos task appends its events to (see :mod:`.chaos`).
* ``PROJ_FLOW_LOG``: a file the flow-limited tasks append their bodies' and attempts'
  starts and ends to (see :mod:`.flow`).
* ``PROJ_ETA_THRESHOLD``: ``duraflow_eta_threshold`` (default 60).
* ``PROJ_CONSUMER_TIMEOUT``: the broker's ``consumer_timeout`` in seconds, told to the
  library through ``broker_transport_options`` (RabbitMQ's is set on the server).
* ``PROJ_POOLER``: ``duraflow_pooler`` (``transaction`` behind PgBouncer's transaction mode).
* ``PROJ_DEFAULT_QUEUE``: ``task_default_queue``, for tasks that send other tasks
  (Task.replace, canvases) without naming a queue.
* ``PROJ_CLOCK_SHIFT``: seconds added to ``time.time()`` in every process of the
  worker: a host whose clock is that far ahead (negative: behind).
"""

from __future__ import annotations

import os
import time

from celery import Celery
from celery.signals import worker_init, worker_process_init


def _required(name: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise RuntimeError(f"tests.proj needs the environment variable {name}")
    return value


if os.environ.get("PROJ_CLOCK_SHIFT"):
    _shift = float(os.environ["PROJ_CLOCK_SHIFT"])
    _host_time = time.time
    time.time = lambda: _host_time() + _shift

BROKER_URL = _required("PROJ_BROKER_URL")
RESULT_BACKEND = os.environ.get("PROJ_RESULT_BACKEND") or BROKER_URL
DATABASE_URL = _required("PROJ_DATABASE_URL")
TABLE_PREFIX = os.environ.get("PROJ_TABLE_PREFIX") or "proj_"

app = Celery("proj", broker=BROKER_URL, backend=RESULT_BACKEND,
             include=[f"{__package__}.tasks", f"{__package__}.chaos", f"{__package__}.waits",
                      f"{__package__}.citizen", f"{__package__}.replay",
                      f"{__package__}.clocks", f"{__package__}.flow",
                      f"{__package__}.fanout"])
app.conf.update(
    duraflow_database_url=DATABASE_URL,
    duraflow_table_prefix=TABLE_PREFIX,
    duraflow_lease_seconds=float(os.environ.get("PROJ_LEASE_SECONDS") or 30),
    duraflow_eta_threshold=float(os.environ.get("PROJ_ETA_THRESHOLD") or 60),
    # A message is acknowledged only once its attempt has ended, so a worker that
    # dies mid-task leaves it to be delivered again.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_expires=3600,
)
if os.environ.get("PROJ_CONSUMER_TIMEOUT"):
    app.conf.broker_transport_options = {
        "consumer_timeout": float(os.environ["PROJ_CONSUMER_TIMEOUT"])}
if os.environ.get("PROJ_POOLER"):
    app.conf.duraflow_pooler = os.environ["PROJ_POOLER"]
if os.environ.get("PROJ_DEFAULT_QUEUE"):
    app.conf.task_default_queue = os.environ["PROJ_DEFAULT_QUEUE"]


@worker_init.connect
def _create_ledger_tables(**_kwargs: object) -> None:
    # The main worker process creates the ledger once, before the pool forks.
    from . import chaos, ledger, waits

    ledger.create_tables()
    chaos.create_tables()
    waits.create_tables()


@worker_process_init.connect
def _forget_inherited_engine(**_kwargs: object) -> None:
    # A forked pool process must not reuse the parent's database sockets.
    from .ledger import reset_engine

    reset_engine()
