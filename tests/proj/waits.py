"""Durable tasks that wait: a nap (a durable sleep) and a booking that needs approval.

Each step body adds a row to ``<prefix>wait_events``, so the tests can count how
often a body really ran, across worker processes and restarts.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import BigInteger, Column, DateTime, Integer, MetaData, String, Table, insert

from celery_duraflow import DurableTask, sleep, step, wait_for_signal

from .app import TABLE_PREFIX, app
from .ledger import engine

METADATA = MetaData()
EVENTS = Table(
    f"{TABLE_PREFIX}wait_events",
    METADATA,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
           autoincrement=True),
    Column("task_id", String(255), nullable=False, index=True),
    Column("event", String(100), nullable=False),
    Column("at", DateTime(timezone=True), nullable=False),
)


def create_tables() -> None:
    METADATA.create_all(engine())


def record(task_id: str, event: str) -> None:
    with engine().begin() as conn:
        conn.execute(insert(EVENTS).values(task_id=task_id, event=event,
                                           at=datetime.now(UTC)))


@app.task(base=DurableTask, bind=True, name="proj.nap")
def nap(self: DurableTask, seconds: float) -> float:
    """Sleep durably between two steps; return when the second step ran (epoch seconds)."""
    with step("before"):
        record(self.request.id, "before")
    sleep("nap", seconds)
    with step("after") as s:
        record(self.request.id, "after")
        s.result = time.time()
    return float(s.result)


@app.task(base=DurableTask, bind=True, name="proj.approve_booking")
def approve_booking(self: DurableTask, amount: int) -> dict[str, Any]:
    """Quote, wait for a person's decision (signal 'approval'), then book or not."""
    with step("quote") as s:
        record(self.request.id, "quote")
        s.result = amount
    decision = wait_for_signal("approval")
    with step("book") as s:
        record(self.request.id, "book")
        s.result = {"approved": bool(decision and decision.get("approved")), "amount": amount}
    return dict(s.result)
