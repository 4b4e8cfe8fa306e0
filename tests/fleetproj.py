"""The Celery app of the schedule fleet test (tests/test_schedule_fleet.py).

``celery -A tests.fleetproj beat -S celery_duraflow.beat:DurableScheduler`` and
``celery -A tests.fleetproj worker`` run it; everything comes from the environment:

* ``FLEET_BROKER_URL``: the broker (Redis); required.
* ``FLEET_DATABASE_URL``: the PostgreSQL database of the store and of the ledger; required.
* ``FLEET_TABLE_PREFIX``: the duraflow table prefix; the ledger is
  ``<prefix>fleet_ledger``, which the test creates and drops; required.
* ``FLEET_QUEUE``: the queue of the scheduled runs (and the default queue); required.
* ``FLEET_SCHEDULE``: the name of the one ``beat_schedule`` entry; required.
* ``FLEET_EVERY``: its interval in seconds (default 1).
* ``FLEET_CATCHUP_WINDOW``: its ``catchup_window`` in seconds (default 3600).
* ``FLEET_LEASE_SECONDS``: ``duraflow_lease_seconds`` (default 3).
* ``FLEET_PUBLISH_LOG`` and ``FLEET_ROLE``: a file every message this process publishes
  is noted in, one line ``<time> <pid> <role> sent <task id>`` once it is sent
  (``O_APPEND``, so lines of several processes never interleave): which scheduler sent
  a slot's run, and whether the recovery sweep sent it again.
* ``FLEET_HOLD_FILE``: while this file exists, a scheduler (a role ``beat...``) about
  to publish a message notes ``<time> <pid> <role> hold <task id>`` and waits (up to
  ten seconds) for it to go away: the run's row is committed and its message not yet
  sent, the moment the test kills it in.

The scheduled task :func:`tick` adds one row to the ledger per execution of its body,
with no unique key: a run executed twice shows as two rows.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from celery import Celery
from celery.signals import after_task_publish, before_task_publish
from sqlalchemy import Engine, create_engine, text

from celery_duraflow import DurableTask


def _required(name: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise RuntimeError(f"tests.fleetproj needs the environment variable {name}")
    return value


BROKER_URL = _required("FLEET_BROKER_URL")
DATABASE_URL = _required("FLEET_DATABASE_URL")
TABLE_PREFIX = _required("FLEET_TABLE_PREFIX")
QUEUE = _required("FLEET_QUEUE")
SCHEDULE = _required("FLEET_SCHEDULE")
LEDGER = f"{TABLE_PREFIX}fleet_ledger"
TASK_NAME = "fleet.tick"
PUBLISH_LOG = os.environ.get("FLEET_PUBLISH_LOG")
ROLE = os.environ.get("FLEET_ROLE", "?")
HOLD_FILE = os.environ.get("FLEET_HOLD_FILE")
HOLD_AT_MOST = 10.0

app = Celery("fleet", broker=BROKER_URL, set_as_current=False)
app.conf.update(
    duraflow_database_url=DATABASE_URL,
    duraflow_table_prefix=TABLE_PREFIX,
    duraflow_lease_seconds=float(os.environ.get("FLEET_LEASE_SECONDS") or 3),
    task_default_queue=QUEUE,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    worker_enable_remote_control=False,
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    accept_content=["json"],
    beat_schedule={
        SCHEDULE: {
            "task": TASK_NAME,
            "schedule": float(os.environ.get("FLEET_EVERY") or 1),
            "catchup": "all",
            "catchup_window": float(os.environ.get("FLEET_CATCHUP_WINDOW") or 3600),
            "overlap": "allow_all",
            "options": {"queue": QUEUE},
        },
    },
)

_engine: Engine | None = None
_engine_pid: int | None = None
_lock = threading.Lock()


def _ledger_engine() -> Engine:
    """This process's engine (a pool process forked from the worker makes its own)."""
    global _engine, _engine_pid
    with _lock:
        if _engine is None or _engine_pid != os.getpid():
            _engine = create_engine(DATABASE_URL, pool_size=1)
            _engine_pid = os.getpid()
        return _engine


@app.task(base=DurableTask, bind=True, name=TASK_NAME, ignore_result=True)
def tick(self: Any) -> str:
    """Add one ledger row for this execution: the run's task id, the pid, the time."""
    with _ledger_engine().begin() as conn:
        conn.execute(text(f'INSERT INTO "{LEDGER}" (task_id, pid, ran_at) '
                          "VALUES (:task_id, :pid, clock_timestamp())"),
                     {"task_id": self.request.id, "pid": os.getpid()})
    return str(self.request.id)


def _note(event: str, headers: dict[str, Any] | None) -> None:
    if not PUBLISH_LOG:
        return
    line = f"{time.time():.6f} {os.getpid()} {ROLE} {event} {(headers or {}).get('id')}\n"
    fd = os.open(PUBLISH_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@before_task_publish.connect
def _hold(headers: dict[str, Any] | None = None, **_kwargs: Any) -> None:
    if not (HOLD_FILE and ROLE.startswith("beat") and os.path.exists(HOLD_FILE)):
        return
    _note("hold", headers)
    deadline = time.monotonic() + HOLD_AT_MOST
    while os.path.exists(HOLD_FILE) and time.monotonic() < deadline:
        time.sleep(0.005)


@after_task_publish.connect
def _sent(headers: dict[str, Any] | None = None, **_kwargs: Any) -> None:
    _note("sent", headers)
