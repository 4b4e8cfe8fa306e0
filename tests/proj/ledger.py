"""The project's own database tables, next to the duraflow ones.

``<prefix>charges`` is a plain ledger: every call of :func:`charge_card` adds a
row, with no uniqueness at all, so a card charged twice for one run shows up as
two rows. ``<prefix>notify_outages`` remembers, across processes, which runs
have already hit the simulated mailer outage (one row per task id).
"""

from __future__ import annotations

import os
import threading
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    insert,
)
from sqlalchemy.exc import IntegrityError

from .app import DATABASE_URL, TABLE_PREFIX


def build_tables(prefix: str) -> tuple[MetaData, Table, Table]:
    """The ledger tables for a table prefix: (metadata, charges, notify_outages)."""
    metadata = MetaData()
    charges = Table(
        f"{prefix}charges",
        metadata,
        Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
               autoincrement=True),
        Column("task_id", String(255), nullable=False, index=True),
        Column("user_id", String(100), nullable=False),
        Column("flight", String(100), nullable=False),
        Column("amount_cents", Integer, nullable=False),
        Column("idempotency_key", String(64), nullable=False),
        Column("charged_at", DateTime(timezone=True), nullable=False),
    )
    outages = Table(
        f"{prefix}notify_outages",
        metadata,
        Column("task_id", String(255), primary_key=True),
        Column("failed_at", DateTime(timezone=True), nullable=False),
    )
    return metadata, charges, outages


METADATA, CHARGES, NOTIFY_OUTAGES = build_tables(TABLE_PREFIX)

_engine: Engine | None = None
_engine_pid: int | None = None
_lock = threading.Lock()


def engine() -> Engine:
    """This process's engine, created on first use."""
    global _engine, _engine_pid
    with _lock:
        if _engine is None or _engine_pid != os.getpid():
            _engine = create_engine(DATABASE_URL, pool_size=2, **_engine_options())
            _engine_pid = os.getpid()
        return _engine


def reset_engine() -> None:
    """Drop an engine inherited through fork without closing the parent's connections."""
    global _engine, _engine_pid
    with _lock:
        if _engine is not None:
            _engine.dispose(close=False)
        _engine = None
        _engine_pid = None


def _engine_options() -> dict[str, object]:
    """Behind PgBouncer (transaction pooling), the project's own connections must not let
    psycopg prepare statements on the server either: the store's rules are its users'."""
    if DATABASE_URL.startswith("postgresql+psycopg"):
        return {"connect_args": {"prepare_threshold": None}}
    return {}


def create_tables() -> None:
    temporary = create_engine(DATABASE_URL, **_engine_options())
    try:
        METADATA.create_all(temporary, checkfirst=True)
    finally:
        temporary.dispose()


def charge_card(task_id: str, user_id: str, flight: dict[str, Any],
                idempotency_key: str) -> dict[str, Any]:
    """Record a charge for ``flight``; every call adds one row, as a careless API would."""
    with engine().begin() as conn:
        charge_id = conn.execute(
            insert(CHARGES)
            .values(task_id=task_id, user_id=user_id, flight=flight["code"],
                    amount_cents=flight["price_cents"], idempotency_key=idempotency_key,
                    charged_at=datetime.now(UTC))
            .returning(CHARGES.c.id)
        ).scalar_one()
    return {"charge_id": charge_id, "flight": flight["code"],
            "amount_cents": flight["price_cents"]}


def first_notify_of_run(task_id: str) -> bool:
    """True exactly once per task id, whichever process asks first."""
    try:
        with engine().begin() as conn:
            conn.execute(insert(NOTIFY_OUTAGES).values(task_id=task_id,
                                                       failed_at=datetime.now(UTC)))
    except IntegrityError:
        return False
    return True
