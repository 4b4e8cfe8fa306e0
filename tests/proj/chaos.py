"""A booking task instrumented for fault-injection tests.

Every body of a step appends ``start`` and ``end`` events to a plain file
(``PROJ_EVENT_LOG``), one line per event, written with ``O_APPEND`` so lines
from many processes never interleave. The file, unlike the database, keeps
working while PostgreSQL is down, and a killed process simply has no ``end``
line: the test knows when it killed which pid. From the file the test can tell
whether any step body ever ran twice at the same time, or ran again after it
had completed.

Charges go to ``<prefix>chaos_charges`` with the step's idempotency key as a
unique key, the way a payment API deduplicates: a step re-run because it was
in doubt (its process died after charging) does not charge twice.
"""

from __future__ import annotations

import os
import random
import time
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Column, DateTime, Integer, MetaData, String, Table
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import OperationalError

from celery_duraflow import DurableTask, StoreUnavailable, step

from .app import TABLE_PREFIX, app
from .ledger import engine

EVENT_LOG = os.environ.get("PROJ_EVENT_LOG")

METADATA = MetaData()
CHARGES = Table(
    f"{TABLE_PREFIX}chaos_charges",
    METADATA,
    Column("idempotency_key", String(64), primary_key=True),
    Column("task_id", String(255), nullable=False),
    Column("charged_at", DateTime(timezone=True), nullable=False),
)
# Rows the atomic chaos task writes inside its steps. No unique key: a row written twice
# for one (task, step) would be visible as two rows.
LEDGER = Table(
    f"{TABLE_PREFIX}chaos_ledger",
    METADATA,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("task_id", String(255), nullable=False),
    Column("step", String(50), nullable=False),
)
MAIL_FAILURES = Table(
    f"{TABLE_PREFIX}chaos_mail_failures",
    METADATA,
    Column("task_id", String(255), primary_key=True),
)


class MailerUnavailable(Exception):
    """The simulated mailer fails the first time each run reaches it."""


def log_event(*fields: object) -> None:
    """Append one line ``<time> <pid> <fields...>`` to the event log."""
    if not EVENT_LOG:
        return
    line = " ".join(str(f) for f in (f"{time.time():.6f}", os.getpid(), *fields)) + "\n"
    fd = os.open(EVENT_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def create_tables() -> None:
    METADATA.create_all(engine(), checkfirst=True)


def _charge(task_id: str, key: str) -> None:
    with engine().begin() as conn:
        conn.execute(insert(CHARGES).values(idempotency_key=key, task_id=task_id,
                                            charged_at=datetime.now(UTC))
                     .on_conflict_do_nothing())


def _mail_fails_first(task_id: str) -> bool:
    with engine().begin() as conn:
        inserted = conn.execute(insert(MAIL_FAILURES).values(task_id=task_id)
                                .on_conflict_do_nothing()
                                .returning(MAIL_FAILURES.c.task_id)).first()
    return inserted is not None


@app.task(base=DurableTask, bind=True, name="proj.chaos_trip",
          autoretry_for=(MailerUnavailable, StoreUnavailable, OperationalError),
          max_retries=50, retry_backoff=False, default_retry_delay=0.2)
def chaos_trip(self: Any, n: int, fail_notify: bool = True) -> str:
    """Four steps; book charges, notify fails once. Every body logs start and end."""
    task_id = self.request.id
    log_event("deliver", task_id, self.request.retries,
              int(bool((self.request.delivery_info or {}).get("redelivered"))))
    for name in ("search", "pick", "book", "notify"):
        with step(name) as s:
            log_event("start", task_id, name, int(s.in_doubt))
            outcome = "error"
            try:
                time.sleep(random.uniform(0.01, 0.08))
                if name == "book":
                    _charge(task_id, s.idempotency_key)
                if name == "notify" and fail_notify and _mail_fails_first(task_id):
                    raise MailerUnavailable(f"mailer down for {task_id}")
                s.result = f"{name}-{n}"
                outcome = "ok"
            finally:
                log_event("end", task_id, name, outcome)
    return str(s.result)


@app.task(base=DurableTask, bind=True, name="proj.chaos_ledger",
          autoretry_for=(StoreUnavailable, OperationalError),
          max_retries=50, retry_backoff=False, default_retry_delay=0.2)
def chaos_ledger(self: Any, n: int) -> str:
    """Four atomic steps, each writing its ledger row on the step's own transaction.

    The body sleeps after its write: a process killed there has written the row
    but not recorded the step, the window in which a step that is not atomic
    would run again and write a second row.
    """
    task_id = self.request.id
    log_event("deliver", task_id, self.request.retries,
              int(bool((self.request.delivery_info or {}).get("redelivered"))))
    for name in ("debit", "credit", "fee", "receipt"):
        with step(name, atomic=True) as s:
            log_event("start", task_id, name, int(s.in_doubt))
            outcome = "error"
            try:
                s.connection.execute(LEDGER.insert().values(task_id=task_id, step=name))
                time.sleep(random.uniform(0.02, 0.1))
                s.result = f"{name}-{n}"
                outcome = "ok"
            finally:
                log_event("end", task_id, name, outcome)
    return str(s.result)


@app.task(base=DurableTask, bind=True, name="proj.outage_steps",
          autoretry_for=(ConnectionError,), max_retries=3, retry_backoff=False,
          default_retry_delay=0.2)
def outage_steps(self: Any, n: int, steps: int = 5, seconds: float = 0.3,
                 at_most_once: int = -1) -> str:
    """``steps`` steps of ``seconds`` each that touch nothing but the event log; the step
    numbered ``at_most_once`` (none by default) is ``on_in_doubt="raise"``.

    ``autoretry_for=(ConnectionError,)`` catches StoreUnavailable too, as a user's
    broad retry list would: a store outage must still spend none of these retries.
    """
    task_id = self.request.id
    log_event("deliver", task_id, self.request.retries,
              int(bool((self.request.delivery_info or {}).get("redelivered"))))
    for index in range(steps):
        with step(f"s{index}",
                  on_in_doubt="raise" if index == at_most_once else "rerun") as s:
            log_event("start", task_id, f"s{index}", int(s.in_doubt))
            outcome = "error"
            try:
                time.sleep(seconds)
                s.result = f"s{index}-{n}"
                outcome = "ok"
            finally:
                log_event("end", task_id, f"s{index}", outcome)
        # Past the block: the step's record was written (or it was replayed from it).
        log_event("recorded", task_id, f"s{index}")
    return str(s.result)
