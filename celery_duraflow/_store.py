"""The step store: every SQL statement celery-duraflow issues lives here.

One :class:`Store` per (database URL, table prefix, engine options) and
process. The engine is created on first use and belongs to the process that
created it: after a fork (prefork pool) the child disposes the inherited pool
with ``close=False`` and opens its own connections.

Single-row writes on PostgreSQL run in autocommit, so each one costs one round
trip and one commit; there is no BEGIN/COMMIT pair around them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, case, create_engine, event, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.exc import (
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    NoSuchModuleError,
    OperationalError,
)
from sqlalchemy.exc import (
    TimeoutError as PoolTimeoutError,
)

from ._config import Config
from ._schema import LATEST_VERSION, Tables, build_tables, current_version, migrate
from .errors import ConfigurationError, StoreUnavailable

logger = logging.getLogger("celery_duraflow.store")

# Run statuses.
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
RUN_STATUSES = ("running", "sleeping", "waiting", "succeeded", "failed", "compensated", "cancelled")

# Step statuses.
STEP_RUNNING = "running"
STEP_COMPLETED = "completed"
STEP_FAILED = "failed"

_UNAVAILABLE = (OperationalError, InterfaceError, DisconnectionError, PoolTimeoutError)


def _utc(value: datetime | None) -> datetime | None:
    # SQLite hands timestamps back without a zone; they were written in UTC.
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


@dataclass(frozen=True)
class RunRecord:
    """One row of the runs table."""

    task_id: str
    task_name: str
    status: str
    attempts: int
    result: str | None
    serializer: str | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: Any) -> RunRecord:
        m = row._mapping
        return cls(
            task_id=m["task_id"],
            task_name=m["task_name"],
            status=m["status"],
            attempts=m["attempts"],
            result=m["result"],
            serializer=m["serializer"],
            error=m["error"],
            created_at=_utc(m["created_at"]),  # type: ignore[arg-type]
            updated_at=_utc(m["updated_at"]),  # type: ignore[arg-type]
            finished_at=_utc(m["finished_at"]),
        )


@dataclass(frozen=True)
class StepRecord:
    """One row of the steps table."""

    id: int
    task_id: str
    key: str
    status: str
    attempts: int
    output: str | None
    serializer: str | None
    error: str | None
    started_at: datetime
    completed_at: datetime | None

    @classmethod
    def from_row(cls, row: Any) -> StepRecord:
        m = row._mapping
        return cls(
            id=m["id"],
            task_id=m["task_id"],
            key=m["step_key"],
            status=m["status"],
            attempts=m["attempts"],
            output=m["output"],
            serializer=m["serializer"],
            error=m["error"],
            started_at=_utc(m["started_at"]),  # type: ignore[arg-type]
            completed_at=_utc(m["completed_at"]),
        )


def _now() -> datetime:
    return datetime.now(UTC)


def _sqlite_engine_events(engine: Engine) -> None:
    """Make pysqlite behave: real transactions, WAL, foreign keys, patience."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the driver, decide when a transaction begins.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # Take the write lock at the start, so that two writers queue on busy_timeout
        # instead of failing with "database is locked" when one upgrades its lock.
        conn.exec_driver_sql("BEGIN IMMEDIATE")


class Store:
    """Reads and writes runs and steps for one configuration."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.tables: Tables = build_tables(config.table_prefix)
        self._engine: Engine | None = None
        self._engine_pid: int | None = None
        self._schema_ready = False
        self._lock = threading.Lock()

    # -- engine and schema ---------------------------------------------------------------

    @property
    def dialect(self) -> str:
        return self.config.database_url.get_backend_name()

    @property
    def engine(self) -> Engine:
        engine = self._engine
        if engine is not None and self._engine_pid == os.getpid():
            return engine
        with self._lock:
            if self._engine is not None and self._engine_pid != os.getpid():
                # Inherited across a fork: never touch the parent's connections.
                self._engine.dispose(close=False)
                self._engine = None
            if self._engine is None:
                self._engine = self._create_engine()
                self._engine_pid = os.getpid()
            return self._engine

    def _create_engine(self) -> Engine:
        url = self.config.database_url
        options: dict[str, Any] = dict(self.config.engine_options)
        if self.dialect == "sqlite":
            connect_args = dict(options.pop("connect_args", {}))
            connect_args.setdefault("check_same_thread", False)
            connect_args.setdefault("timeout", 30)
            options["connect_args"] = connect_args
        try:
            engine = create_engine(url, **options)
        except (NoSuchModuleError, ImportError, TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"cannot create a database engine for duraflow_database_url "
                f"{url.render_as_string(hide_password=True)!r}: {exc}. Check the URL's driver "
                "and duraflow_engine_options."
            ) from None
        if self.dialect == "sqlite":
            _sqlite_engine_events(engine)
        return engine

    def dispose_after_fork(self) -> None:
        """Drop connections inherited from a parent process without closing them."""
        with self._lock:
            if self._engine is not None:
                self._engine.dispose(close=False)
                self._engine = None
                self._engine_pid = None

    def close(self) -> None:
        """Close every pooled connection (tests, shutdown)."""
        with self._lock:
            if self._engine is not None:
                self._engine.dispose()
                self._engine = None
                self._engine_pid = None
            self._schema_ready = False

    def ensure_schema(self, task_id: str | None = None, step_key: str | None = None) -> None:
        """Create or upgrade the schema once per process (``duraflow_auto_migrate``)."""
        if self._schema_ready:
            return
        with self._unavailable("preparing the schema", task_id, step_key):
            if self.config.auto_migrate:
                migrate(self.engine, self.tables, self.config.table_prefix)
            else:
                with self.engine.connect() as conn:
                    version = current_version(conn, self.tables)
                if version < LATEST_VERSION:
                    raise ConfigurationError(
                        f"the celery-duraflow schema with prefix {self.config.table_prefix!r} is "
                        f"at version {version}, this release needs {LATEST_VERSION}, and "
                        "duraflow_auto_migrate is off: apply the migrations first."
                    )
        self._schema_ready = True

    def migrate(self) -> list[int]:
        """Apply pending migrations now; return the versions applied."""
        with self._unavailable("migrating the schema"):
            applied = migrate(self.engine, self.tables, self.config.table_prefix)
        self._schema_ready = True
        return applied

    # -- connections ---------------------------------------------------------------------

    @contextmanager
    def _unavailable(self, action: str, task_id: str | None = None,
                     step_key: str | None = None) -> Iterator[None]:
        try:
            yield
        except _UNAVAILABLE as exc:
            where = f" for task {task_id}" if task_id else ""
            if step_key:
                where += f", step {step_key!r}"
            raise StoreUnavailable(
                f"the step store is unavailable while {action}{where}: {_short(exc)}. Nothing "
                "was run for this step; the attempt can be retried safely (add StoreUnavailable "
                "to autoretry_for).",
                task_id=task_id,
                step_key=step_key,
            ) from exc

    @contextmanager
    def _write(self, action: str, task_id: str | None = None,
               step_key: str | None = None) -> Iterator[Connection]:
        """A connection for one write that is durable when the block ends."""
        self.ensure_schema(task_id, step_key)
        with self._unavailable(action, task_id, step_key):
            if self.dialect == "postgresql":
                # One statement, committed by the server on its own: no BEGIN, no COMMIT.
                with self.engine.connect() as conn:
                    yield conn.execution_options(isolation_level="AUTOCOMMIT")
            else:
                with self.engine.begin() as conn:
                    yield conn

    @contextmanager
    def _read(self, action: str, task_id: str | None = None,
              step_key: str | None = None) -> Iterator[Connection]:
        self.ensure_schema(task_id, step_key)
        with self._unavailable(action, task_id, step_key), self.engine.connect() as conn:
            if self.dialect == "postgresql":
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            yield conn

    def _insert(self, table: Any) -> Any:
        dialect = postgresql if self.dialect == "postgresql" else sqlite
        return dialect.insert(table)

    # -- runs ----------------------------------------------------------------------------

    def begin_attempt(self, task_id: str, task_name: str) -> RunRecord:
        """Record an attempt of a run (creating the run on its first) and return the row.

        A run that already succeeded is returned unchanged, so the caller can
        hand back its result without running anything.
        """
        runs = self.tables.runs
        now = _now()
        finished = runs.c.status == SUCCEEDED
        stmt = (
            self._insert(runs)
            .values(task_id=task_id, task_name=task_name, status=RUNNING, attempts=1,
                    created_at=now, updated_at=now)
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[runs.c.task_id],
            set_={
                "attempts": case((finished, runs.c.attempts), else_=runs.c.attempts + 1),
                "status": case((finished, runs.c.status), else_=RUNNING),
                "error": case((finished, runs.c.error), else_=None),
                "finished_at": case((finished, runs.c.finished_at), else_=None),
                "updated_at": now,
            },
        ).returning(*runs.c)
        with self._write("starting an attempt", task_id) as conn:
            row = conn.execute(stmt).one()
        return RunRecord.from_row(row)

    def finish_run(self, task_id: str, status: str, *, result: str | None = None,
                   serializer: str | None = None, error: str | None = None) -> bool:
        """Record the end of a run. A run that already succeeded is never changed."""
        runs = self.tables.runs
        now = _now()
        stmt = (
            update(runs)
            .where(runs.c.task_id == task_id, runs.c.status != SUCCEEDED)
            .values(status=status, result=result, serializer=serializer, error=error,
                    updated_at=now, finished_at=now)
        )
        with self._write(f"recording the run as {status}", task_id) as conn:
            return bool(conn.execute(stmt).rowcount)

    def get_run(self, task_id: str) -> RunRecord | None:
        runs = self.tables.runs
        with self._read("reading a run", task_id) as conn:
            row = conn.execute(select(runs).where(runs.c.task_id == task_id)).first()
        return RunRecord.from_row(row) if row is not None else None

    # -- steps ---------------------------------------------------------------------------

    def load_steps(self, task_id: str) -> dict[str, StepRecord]:
        """Every recorded step of a run, by key, in one query."""
        steps = self.tables.steps
        stmt = select(steps).where(steps.c.task_id == task_id).order_by(steps.c.id)
        with self._read("loading the recorded steps", task_id) as conn:
            rows = conn.execute(stmt).all()
        return {record.key: record for record in map(StepRecord.from_row, rows)}

    def get_step(self, task_id: str, step_key: str) -> StepRecord | None:
        steps = self.tables.steps
        stmt = select(steps).where(steps.c.task_id == task_id, steps.c.step_key == step_key)
        with self._read("reading a step", task_id, step_key) as conn:
            row = conn.execute(stmt).first()
        return StepRecord.from_row(row) if row is not None else None

    def claim_step(self, task_id: str, step_key: str,
                   prior: StepRecord | None) -> StepRecord | None:
        """Take ownership of a step before its body runs.

        With no earlier row this is ``INSERT ... ON CONFLICT DO NOTHING
        RETURNING``; a failed or interrupted row is re-claimed only if it is
        still exactly as this attempt saw it. ``None`` means another attempt
        got there first.
        """
        steps = self.tables.steps
        now = _now()
        if prior is None:
            stmt = (
                self._insert(steps)
                .values(task_id=task_id, step_key=step_key, status=STEP_RUNNING, attempts=1,
                        started_at=now)
                .on_conflict_do_nothing(index_elements=[steps.c.task_id, steps.c.step_key])
                .returning(*steps.c)
            )
        else:
            stmt = (
                update(steps)
                .where(steps.c.id == prior.id, steps.c.status == prior.status,
                       steps.c.attempts == prior.attempts)
                .values(status=STEP_RUNNING, attempts=prior.attempts + 1, started_at=now,
                        completed_at=None, error=None)
                .returning(*steps.c)
            )
        with self._write("claiming the step", task_id, step_key) as conn:
            row = conn.execute(stmt).first()
        return StepRecord.from_row(row) if row is not None else None

    def complete_step(self, claim: StepRecord, output: str, serializer: str) -> bool:
        """Store a step's output; False if the claim was taken over meanwhile."""
        steps = self.tables.steps
        stmt = (
            update(steps)
            .where(steps.c.id == claim.id, steps.c.status == STEP_RUNNING,
                   steps.c.attempts == claim.attempts)
            .values(status=STEP_COMPLETED, output=output, serializer=serializer,
                    completed_at=_now(), error=None)
        )
        with self._write("recording the step output", claim.task_id, claim.key) as conn:
            return bool(conn.execute(stmt).rowcount)

    def fail_step(self, claim: StepRecord, error: str) -> bool:
        """Mark a claimed step failed with the error text."""
        steps = self.tables.steps
        stmt = (
            update(steps)
            .where(steps.c.id == claim.id, steps.c.status == STEP_RUNNING,
                   steps.c.attempts == claim.attempts)
            .values(status=STEP_FAILED, error=error)
        )
        with self._write("recording the step failure", claim.task_id, claim.key) as conn:
            return bool(conn.execute(stmt).rowcount)


def _short(exc: BaseException) -> str:
    original = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    first_line = str(original).strip().splitlines()[0] if str(original).strip() else ""
    return f"{type(original).__name__}: {first_line}" if first_line else type(original).__name__


_stores: dict[tuple[Any, ...], Store] = {}
_stores_lock = threading.Lock()


def store_for(config: Config) -> Store:
    """The process-wide :class:`Store` for a configuration."""
    key = (
        config.database_url.render_as_string(hide_password=False),
        config.table_prefix,
        config.auto_migrate,
        tuple(sorted((k, repr(v)) for k, v in config.engine_options.items())),
    )
    store = _stores.get(key)
    if store is None:
        with _stores_lock:
            store = _stores.setdefault(key, Store(config))
    return store


def all_stores() -> list[Store]:
    with _stores_lock:
        return list(_stores.values())


def close_all_stores() -> None:
    """Close every store's connections and forget them (tests, shutdown)."""
    with _stores_lock:
        stores = list(_stores.values())
        _stores.clear()
    for store in stores:
        store.close()
