"""The example's own tables, kept in the same database as celery-duraflow's.

* ``<prefix>ledger``: one row per card charge made by the fake airline;
* ``<prefix>refunds``: one row per cancelled booking, whose charge was refunded;
* ``<prefix>mail_log``: every message the fake mailer was asked to send;
* ``<prefix>mail_outages``: trips for which the fake mailer refuses every
  message (the demo's ``--mailer-down``);
* ``<prefix>trace``: what each attempt of a trip did at each step (ran, cached
  or failed), written by the task so the demo can print it afterwards, even
  when the task ran in another process.

The prefix is ``example_`` unless ``app.conf.example_table_prefix`` (env
``EXAMPLE_TABLE_PREFIX``) says otherwise. Plain SQLAlchemy Core, no ORM.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    Boolean,
    Column,
    DateTime,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    func,
    insert,
    select,
)
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import IntegrityError, ProgrammingError

DEFAULT_PREFIX = "example_"
# Used only when the app has no duraflow_database_url; the library falls back to the same file.
FALLBACK_DATABASE_URL = "sqlite:///duraflow.sqlite3"

_PREFIX_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,39}$")


@dataclass(frozen=True)
class Tables:
    """The example's tables for one prefix."""

    metadata: MetaData
    ledger: Table
    refunds: Table
    mail_log: Table
    mail_outages: Table
    trace: Table


@functools.cache
def build_tables(prefix: str = DEFAULT_PREFIX) -> Tables:
    """Declare the tables under ``prefix`` (letters, digits and underscores)."""
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"example table prefix {prefix!r} must be letters, digits, underscores")
    metadata = MetaData()
    ledger = Table(
        f"{prefix}ledger",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        # What a real payment API deduplicates on: one charge per key.
        Column("idempotency_key", String(64), nullable=False, unique=True),
        Column("trip_id", String(255), nullable=False, index=True),
        Column("user_id", String(255), nullable=False),
        Column("flight_id", String(32), nullable=False),
        Column("amount_cents", Integer, nullable=False),
        Column("booking_ref", String(32), nullable=False),
        Column("charged_at", DateTime(timezone=True), nullable=False),
    )
    refunds = Table(
        f"{prefix}refunds",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        # A booking is refunded at most once, however often it is cancelled.
        Column("booking_ref", String(32), nullable=False, unique=True),
        Column("trip_id", String(255), nullable=False, index=True),
        Column("amount_cents", Integer, nullable=False),
        Column("refunded_at", DateTime(timezone=True), nullable=False),
    )
    mail_log = Table(
        f"{prefix}mail_log",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("trip_id", String(255), nullable=False, index=True),
        Column("user_id", String(255), nullable=False),
        Column("subject", String(200), nullable=False),
        Column("delivered", Boolean, nullable=False),
        Column("at", DateTime(timezone=True), nullable=False),
    )
    mail_outages = Table(
        f"{prefix}mail_outages",
        metadata,
        # A row here: the mail server refuses every message of this trip.
        Column("trip_id", String(255), primary_key=True),
        Column("since", DateTime(timezone=True), nullable=False),
    )
    trace = Table(
        f"{prefix}trace",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("trip_id", String(255), nullable=False, index=True),
        Column("attempt", Integer, nullable=False),
        Column("step_key", String(255), nullable=False),
        Column("outcome", String(16), nullable=False),
        Column("detail", Text, nullable=False),
    )
    return Tables(metadata=metadata, ledger=ledger, refunds=refunds, mail_log=mail_log,
                  mail_outages=mail_outages, trace=trace)


def normalize_url(raw: str) -> URL:
    """Parse a database URL the way celery-duraflow does: bare ``postgresql`` means psycopg 3."""
    url = make_url(raw)
    if url.drivername in ("postgres", "postgresql"):
        url = url.set(drivername="postgresql+psycopg")
    return url


def _sqlite_setup(engine: Engine) -> None:
    # Let several processes share the file politely: wait for locks, and take the
    # write lock when a transaction starts so a read-then-write never deadlocks.
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


@dataclass(frozen=True)
class TraceRow:
    """One line of the trace: what one attempt did at one step."""

    attempt: int
    step_key: str
    outcome: str
    detail: str


class ExampleDB:
    """An engine plus the example's tables. One per database, prefix and process."""

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX) -> None:
        self.url = normalize_url(url)
        self.tables = build_tables(prefix)
        options: dict[str, Any] = {}
        if self.url.get_backend_name() == "sqlite":
            options["connect_args"] = {"check_same_thread": False, "timeout": 30}
        self.engine = create_engine(self.url, **options)
        if self.url.get_backend_name() == "sqlite":
            _sqlite_setup(self.engine)
        self._ready = False

    def create_tables(self) -> None:
        """Create the tables if they are missing (safe to call from many processes)."""
        if self._ready:
            return
        try:
            self.tables.metadata.create_all(self.engine, checkfirst=True)
        except (IntegrityError, ProgrammingError):
            # Another process created them between our check and our CREATE (PostgreSQL
            # reports that as a duplicate type or relation): they exist now.
            self.tables.metadata.create_all(self.engine, checkfirst=True)
        self._ready = True

    def drop_tables(self) -> None:
        """Drop the example's tables (tests)."""
        self.tables.metadata.drop_all(self.engine, checkfirst=True)
        self._ready = False

    def charges(self, trip_id: str) -> int:
        """How many times the card was charged for this trip."""
        ledger = self.tables.ledger
        stmt = select(func.count()).select_from(ledger).where(ledger.c.trip_id == trip_id)
        with self.engine.connect() as conn:
            return int(conn.execute(stmt).scalar_one())

    def refunds(self, trip_id: str) -> int:
        """How many charges of this trip were refunded (one per cancelled booking)."""
        refunds = self.tables.refunds
        stmt = select(func.count()).select_from(refunds).where(refunds.c.trip_id == trip_id)
        with self.engine.connect() as conn:
            return int(conn.execute(stmt).scalar_one())

    def add_trace(self, trip_id: str, row: TraceRow) -> None:
        with self.engine.begin() as conn:
            conn.execute(insert(self.tables.trace).values(
                trip_id=trip_id, attempt=row.attempt, step_key=row.step_key,
                outcome=row.outcome, detail=row.detail))

    def trace(self, trip_id: str) -> list[TraceRow]:
        """The trace of a trip, in the order it was written."""
        trace = self.tables.trace
        stmt = select(trace).where(trace.c.trip_id == trip_id).order_by(trace.c.id)
        with self.engine.connect() as conn:
            return [TraceRow(r.attempt, r.step_key, r.outcome, r.detail)
                    for r in conn.execute(stmt)]

    def dispose(self, *, close: bool = True) -> None:
        self.engine.dispose(close=close)


def now() -> datetime:
    return datetime.now(UTC)


_dbs: dict[tuple[str, str], tuple[int, ExampleDB]] = {}
_lock = threading.Lock()


def example_db(app: Any) -> ExampleDB:
    """The :class:`ExampleDB` for a Celery app's database and table prefix.

    The database is the one celery-duraflow uses (``duraflow_database_url``).
    Engines are never shared across a fork: a prefork child that inherited one
    drops it without closing the parent's connections and makes its own.
    """
    url = (app.conf.get("duraflow_database_url") or os.environ.get("DURAFLOW_DATABASE_URL")
           or FALLBACK_DATABASE_URL)
    prefix = app.conf.get("example_table_prefix") or DEFAULT_PREFIX
    key = (str(url), str(prefix))
    with _lock:
        entry = _dbs.get(key)
        if entry is not None and entry[0] == os.getpid():
            return entry[1]
        if entry is not None:
            entry[1].dispose(close=False)
        db = ExampleDB(str(url), str(prefix))
        _dbs[key] = (os.getpid(), db)
        return db
