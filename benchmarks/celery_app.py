"""The Celery app that benchmark workers load: ``celery -A benchmarks.celery_app worker``.

Everything comes from the environment, which :mod:`benchmarks.workers` sets for each
worker it starts:

* ``BENCH_BROKER_URL``: the broker (Redis or RabbitMQ);
* ``BENCH_BACKEND_URL``: the result backend (default: the broker's URL);
* ``BENCH_DATABASE_URL``: the PostgreSQL database of the step store;
* ``BENCH_TABLE_PREFIX``: the step store's table prefix (the run's own).

Tasks:

* ``bench.durable_steps(n)``: :func:`benchmarks.workload.durable_steps` as a ``DurableTask``;
* ``bench.plain_steps(n)``: the same work as a plain Celery task;
* ``bench.handwritten_steps(n)``: a plain Celery task that records the same run by hand
  (:class:`benchmarks.workload.HandWritten`), with one psycopg connection per process;
* ``bench.rss()``: the resident set size of the process that runs tasks, after a
  garbage collection;
* ``bench.flow_free``, ``bench.flow_keyed``, ``bench.flow_wide`` ``(tenant, steps,
  sleep_ms)``: :func:`benchmarks.flow.flow_work` as a ``DurableTask`` with no limit and
  with the Concurrency limits of :data:`benchmarks.flow.TASK_LIMITS`.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import psycopg
from celery import Celery

from celery_duraflow import DurableTask

from . import flow, workload
from .common import (
    DURABLE_TASK_NAME,
    HANDWRITTEN_TASK_NAME,
    PLAIN_TASK_NAME,
    RSS_TASK_NAME,
    is_postgres,
    libpq_url,
)


def _required(name: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise RuntimeError(f"benchmarks.celery_app needs the environment variable {name}")
    return value


BROKER_URL = _required("BENCH_BROKER_URL")
BACKEND_URL = os.environ.get("BENCH_BACKEND_URL", "").strip() or BROKER_URL
DATABASE_URL = _required("BENCH_DATABASE_URL")
TABLE_PREFIX = _required("BENCH_TABLE_PREFIX")

app = Celery("duraflow-bench", broker=BROKER_URL, backend=BACKEND_URL)
app.conf.update(
    duraflow_database_url=DATABASE_URL,
    duraflow_table_prefix=TABLE_PREFIX,
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_expires=3600,
    worker_hijack_root_logger=False,
)

durable_steps = app.task(base=DurableTask, name=DURABLE_TASK_NAME)(workload.durable_steps)
plain_steps = app.task(name=PLAIN_TASK_NAME)(workload.plain_steps)
flow_tasks = {name: app.task(base=DurableTask, name=name, duraflow_limits=limits)(flow.flow_work)
              for name, limits in flow.TASK_LIMITS.items()}

# This process's connection for the hand-written runs (a pool process opens its own).
_hand: dict[int, workload.HandWritten] = {}


@app.task(bind=True, name=HANDWRITTEN_TASK_NAME)
def handwritten_steps(self: Any, n: int) -> int:
    hand = _hand.get(os.getpid())
    if hand is None:
        if not is_postgres(DATABASE_URL):
            raise RuntimeError("the hand-written task writes to PostgreSQL only")
        _hand.clear()  # a connection inherited from the parent is not this process's
        conn = psycopg.connect(libpq_url(DATABASE_URL), autocommit=True)
        hand = _hand[os.getpid()] = workload.HandWritten(conn, TABLE_PREFIX)
    return hand.run(self.request.id, n)


def read_rss() -> int:
    """Resident set size of this process in bytes (``VmRSS`` on Linux, else psutil)."""
    try:
        with open(f"/proc/{os.getpid()}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.Process().memory_info().rss)


@app.task(name=RSS_TASK_NAME)
def rss() -> dict[str, int]:
    gc.collect()
    return {"pid": os.getpid(), "rss": read_rss(), "bodies_run": workload.BODIES_RUN[0]}
