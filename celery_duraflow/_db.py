"""The database under the store: one engine per process, its connections and errors.

The engine is created on first use and belongs to the process that created it:
after a fork (prefork pool) the child disposes the inherited pool with
``close=False`` and opens its own connections. Every statement goes through
:meth:`Database._write`, :meth:`Database._read` or a transaction, which turn the
driver's connection errors into :class:`~celery_duraflow.errors.StoreUnavailable`
(or, for those that waiting cannot cure, ``StoreMisconfigured``). The differences
between PostgreSQL and SQLite in how a connection is set up and how a write
commits live here.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import select as select_module
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import Engine, Select, create_engine, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    NoSuchModuleError,
    OperationalError,
)
from sqlalchemy.exc import (
    TimeoutError as PoolTimeoutError,
)

from . import _atomic, _clock
from ._schema import LATEST_VERSION, Tables, build_tables, current_version, migrate
from .errors import ConfigurationError, StoreMisconfigured, StoreUnavailable

if TYPE_CHECKING:
    from ._config import Config

logger = logging.getLogger("celery_duraflow.store")

# The parsed form of duraflow_database_url (SQLAlchemy's URL), for the configuration.
__all__ = ["DUPLICATE_KEY", "LIKE_ESCAPE", "URL", "Database", "Executed", "Prepared",
           "like_literal", "parse_database_url"]


def parse_database_url(raw: Any, *, key: str = "duraflow_database_url") -> URL:
    """Parse a SQLAlchemy URL; bare ``postgresql://`` means psycopg 3."""
    if isinstance(raw, URL):
        url = raw
    elif isinstance(raw, str) and raw.strip():
        try:
            url = make_url(raw.strip())
        except ArgumentError as exc:
            raise ConfigurationError(
                f"{key} = {raw!r} is not a database URL ({exc}). Use a SQLAlchemy URL such as "
                "'postgresql+psycopg://user:password@host:5432/dbname' or "
                "'sqlite:///duraflow.sqlite3'."
            ) from None
    else:
        raise ConfigurationError(
            f"{key} must be a non-empty string URL, got {raw!r}. Use a SQLAlchemy URL such as "
            "'postgresql+psycopg://user:password@host:5432/dbname'."
        )
    backend = url.get_backend_name()
    if url.drivername in ("postgresql", "postgres"):
        # No driver named: psycopg 3, the only Postgres driver we depend on.
        url = url.set(drivername="postgresql+psycopg")
    elif backend not in ("postgresql", "sqlite"):
        raise ConfigurationError(
            f"{key} uses the {backend!r} database, which celery-duraflow does not support. "
            "Use PostgreSQL ('postgresql+psycopg://...') or SQLite ('sqlite:///file.sqlite3')."
        )
    if backend == "postgresql":
        _check_hosts(url, key)
    return url


# One "name:port" entry of a host list (a host name or IPv4 address with a port; an IPv6
# address has more than one colon and a socket directory starts with a slash).
_HOST_WITH_PORT = re.compile(r"[^:/\[\]]+:[0-9]*")


def _check_hosts(url: URL, key: str) -> None:
    """Refuse a multi-host URL in a form the driver cannot connect with.

    ``?host=a:5511,b:5512`` reaches libpq as one host list whose names carry
    the ports, and every connection then fails as if the servers were down:
    a configuration error would be retried as an outage forever.
    """
    hosts = url.query.get("host")
    values = hosts if isinstance(hosts, tuple) else (hosts,) if hosts else ()
    for value in values:
        entries = [entry.strip() for entry in str(value).split(",")]
        if len(entries) > 1 and any(_HOST_WITH_PORT.fullmatch(e) for e in entries):
            shown = "&".join(f"host={entry}" for entry in entries)
            raise ConfigurationError(
                f"{key} = {url.render_as_string(hide_password=True)!r} gives several "
                f"servers with their ports in one host= parameter (host={value}), which the "
                f"PostgreSQL driver cannot connect with. Give one host= per server instead: "
                f"?{shown}.")


# The escape character of every LIKE pattern built with like_literal().
LIKE_ESCAPE = "\\"


def like_literal(text: str) -> str:
    """``text`` as the literal part of a LIKE pattern (use ``escape=LIKE_ESCAPE``)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


_UNAVAILABLE: tuple[type[Exception], ...] = (
    OperationalError, InterfaceError, DisconnectionError, PoolTimeoutError)
# A unique key violated by a statement run on the driver's own connection.
DUPLICATE_KEY: tuple[type[Exception], ...] = ()
try:  # the hot path runs some statements on the psycopg connection itself
    import psycopg
    from psycopg import pq

    _UNAVAILABLE += (psycopg.OperationalError, psycopg.InterfaceError)
    DUPLICATE_KEY += (psycopg.errors.UniqueViolation,)
except ImportError:  # pragma: no cover - psycopg is a dependency
    pass

# SQLSTATE invalid_sql_statement_name: "prepared statement ... does not exist".
_NO_SUCH_STATEMENT = "26000"
# Names of the statements prepared for the raw path: one per Prepared, in this process.
_raw_names = itertools.count(1)
_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")
# The raw-path statements prepared on each psycopg connection (see _write_raw).
_RAW_PREPARED: weakref.WeakKeyDictionary[Any, set[bytes]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Prepared:
    """A statement of the attempt's path, built once with bound parameters.

    ``sql`` is the statement compiled once for the driver (PostgreSQL, where
    it runs on the psycopg connection itself; no expanding IN lists) and
    ``defaults`` the values of the parameters the statement fixes; both are
    empty where the statement runs through SQLAlchemy, whose compiled cache
    then holds it.
    """

    statement: Any
    sql: str = ""
    defaults: dict[str, Any] | None = None
    #: For a write run straight on libpq (a step's record, a run's end): its name as a
    #: server-side prepared statement, its text with ``$n`` placeholders, and the
    #: parameter names in their order (see Database.write_prepared). Rows it returns come
    #: back as text; through a transaction pooler the same statement runs on psycopg's
    #: cursor, and they come back typed: a caller converts with int(), float() or str().
    raw_name: bytes = b""
    raw_sql: bytes = b""
    raw_names: tuple[str, ...] = ()
    #: ``raw_names`` with each parameter's fixed value (None where the caller gives it).
    raw_params: tuple[tuple[str, Any], ...] = ()


class Executed(NamedTuple):
    """What one prepared statement returned: column names, rows, rows affected."""

    names: Sequence[str]
    rows: Sequence[Sequence[Any]]
    rowcount: int


def _sqlite_engine_events(engine: Engine) -> None:
    """Make pysqlite behave: real transactions, WAL, foreign keys, patience."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the driver, decide when a transaction begins.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA busy_timeout=30000")
        _use_wal(cursor)
        cursor.execute("PRAGMA foreign_keys=ON")
        # Every commit reaches the disk before it returns, as PostgreSQL's does with
        # synchronous_commit=on: in WAL mode NORMAL would let a power cut or an OS crash
        # take back the last steps recorded, and their bodies would run again.
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # Take the write lock at the start, so that two writers queue on busy_timeout
        # instead of failing with "database is locked" when one upgrades its lock.
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _use_wal(cursor: Any) -> None:
    """Put the database in WAL mode, once, even when several connections open it at once.

    Changing the journal mode needs the database to itself, and SQLite answers
    "database is locked" at once, without waiting on busy_timeout, while another
    connection is changing it too (processes or threads starting together on a
    new file). Once the file is in WAL mode, every later connection only reads it.
    """
    for attempt in range(100):
        if str(cursor.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
            return
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == 99:
                raise
            time.sleep(0.05)


def _hung_up(dbapi_conn: Any, poller: Any = None) -> str | None:
    """Why a psycopg connection is visibly unusable, at the cost of one select(); or None.

    When PostgreSQL restarts it tells every connection so and closes it; an
    idle connection then has data or EOF waiting on its socket. ``poller``, a
    poll object made once for the connection's socket (:func:`_idle_poller`),
    replaces the select(): the attempt's held connection is checked twice per
    step, and building select()'s lists each time costs more than the check.
    """
    try:
        if dbapi_conn.closed or dbapi_conn.broken:
            return "the connection is closed"
        if poller is not None:
            ready = poller.poll(0)
        else:
            ready, _, _ = select_module.select([dbapi_conn.pgconn.socket], [], [], 0)
    except Exception as exc:
        return f"the connection is unusable: {exc}"
    return "the server closed the connection while it was idle" if ready else None


def _idle_poller(dbapi_conn: Any) -> Any:
    """A poll object watching a held connection's socket for input, for
    :func:`_hung_up`; None where poll() is not available."""
    poll = getattr(select_module, "poll", None)
    if poll is None:  # pragma: no cover - every platform the tests run on has poll()
        return None
    poller = poll()
    poller.register(dbapi_conn.pgconn.socket, select_module.POLLIN)
    return poller


def _postgres_engine_events(engine: Engine) -> None:
    """Notice, at no cost, pooled connections the server closed while they sat idle.

    A zero-timeout select() at checkout (see :func:`_hung_up`) makes the pool
    open a fresh connection instead, so the first statement after an outage
    succeeds, without the extra round trip of ``pool_pre_ping``.
    """

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        problem = _hung_up(dbapi_conn)
        if problem:
            raise DisconnectionError(problem)


def _server_pid_and_clock(dbapi_conn: Any) -> int:
    """The process id of the server session that answers, in one round trip that also
    measures the server's clock (see :mod:`celery_duraflow._clock`)."""
    row: Any = None

    def server_epoch() -> float:
        nonlocal row
        with dbapi_conn.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid(), "
                           "extract(epoch FROM clock_timestamp())::float8")
            row = cursor.fetchone()
        return float(row[1])

    _clock.measure(server_epoch)
    if dbapi_conn.info.transaction_status != pq.TransactionStatus.IDLE:
        dbapi_conn.rollback()  # the engine's connections autocommit; a user's may not
    return int(row[0])


def _measure_clock(dbapi_conn: Any) -> None:
    """Measure the clock's offset again on a connection outside any transaction."""
    if dbapi_conn.info.transaction_status == pq.TransactionStatus.IDLE:
        _server_pid_and_clock(dbapi_conn)


def _connect_events(engine: Engine, database: Database) -> None:
    """At each new connection, measure the server's clock, and find out whether a pooler
    stands in between (one round trip for both).

    The clock: see :mod:`celery_duraflow._clock`. The pooler: behind PgBouncer in
    transaction pooling mode consecutive transactions of one client connection
    may run on different server connections, so a statement prepared on the
    server (psycopg prepares a query it has run five times; the step records
    are prepared by :meth:`Database._write_raw`) may be missing, or already
    there under the same name, on the next one. A pooler hands its clients a
    backend process id of its own making (they cannot cancel a query through a
    server session they do not own): when the id the connection was given is
    not the one of the session that answers, prepared statements are turned
    off for good. A proxy that only forwards bytes passes the server's id on
    and changes nothing. ``duraflow_pooler`` says it outright.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        if database.transaction_pooled:
            dbapi_conn.prepare_threshold = None
        server_pid = _server_pid_and_clock(dbapi_conn)
        given_pid = dbapi_conn.info.backend_pid
        if (database.transaction_pooled or database.config.pooler != "auto"
                or server_pid == given_pid):
            return
        database.transaction_pooled = True
        dbapi_conn.prepare_threshold = None
        logger.info(
            "celery-duraflow: the PostgreSQL session that answers (process %s) is not the "
            "one the connection was given (%s): a connection pooler is assumed in between, "
            "and server-side prepared statements are off. Set duraflow_pooler = "
            "'transaction' to say so, or 'none' if there is no pooler.", server_pid,
            given_pid)


class Database:
    """The engine, connections and schema of one store configuration."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.tables: Tables = build_tables(config.table_prefix)
        self.dialect: str = config.database_url.get_backend_name()
        # What the statements may rely on, decided here once from the dialect rather than
        # in each statement. PostgreSQL (psycopg) can run a data-modifying statement
        # inside a CTE, so an attempt takes its run and reads its steps in one round
        # trip; reports the rows an INSERT ... ON CONFLICT DO NOTHING inserted in its
        # rowcount; takes the hot path's precompiled statements on the driver's own
        # connection; and can skip the wait for the WAL flush of one statement.
        postgres = self.dialect == "postgresql"
        self.modifying_ctes = postgres
        self.insert_rowcount = postgres
        self.driver_statements = postgres
        self.asynchronous_commit = postgres
        # Behind a transaction pooler nothing may be prepared on the server (see
        # _pooler_events): configured, or found at the first connection.
        self.transaction_pooled = postgres and config.pooler == "transaction"
        self._engine: Engine | None = None
        self._engine_pid: int | None = None
        self._schema_ready = False
        self._lock = threading.Lock()
        # The connection a thread holds for the attempt it is running (see held_connection).
        self._held = threading.local()
        if postgres and config.database_url.get_driver_name() == "psycopg":
            _clock.measure_first_with(self.measure_clock)

    # -- engine and schema ---------------------------------------------------------------

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
        # A statement's parameters are step outputs, signal payloads and task arguments:
        # keep them out of database error messages and SQL logs, where they would reach
        # exception text, a result backend and log files.
        options.setdefault("hide_parameters", True)
        if self.dialect == "sqlite":
            connect_args = dict(options.pop("connect_args", {}))
            connect_args.setdefault("check_same_thread", False)
            connect_args.setdefault("timeout", 30)
            options["connect_args"] = connect_args
        if self.dialect == "postgresql":
            # Every write is one statement that commits on its own: autocommit, so there
            # is no BEGIN or COMMIT round trip. Migrations ask for transactions explicitly.
            options.setdefault("isolation_level", "AUTOCOMMIT")
        try:
            engine = create_engine(url, **options)
        except (NoSuchModuleError, ArgumentError, ImportError, TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"cannot create a database engine for duraflow_database_url "
                f"{url.render_as_string(hide_password=True)!r}: {exc}. Check the URL's driver "
                "and duraflow_engine_options."
            ) from None
        if self.dialect == "sqlite":
            _sqlite_engine_events(engine)
        elif self.dialect == "postgresql" and url.get_driver_name() == "psycopg":
            _postgres_engine_events(engine)
            _connect_events(engine, self)
        _atomic.guard_engine(engine)
        return engine

    def _transactional(self) -> Engine:
        """The engine with real transactions, for migrations (the hot path autocommits)."""
        if self.dialect == "postgresql":
            return self.engine.execution_options(isolation_level="READ COMMITTED")
        return self.engine

    def measure_clock(self) -> None:
        """Measure the database server's clock against this host's (see ``_clock``)."""
        with self.engine.connect() as conn:
            _server_pid_and_clock(conn.connection.driver_connection)

    def dispose_after_fork(self) -> None:
        """Drop connections inherited from a parent process without closing them."""
        with self._lock:
            if self._engine is not None:
                self._engine.dispose(close=False)
                self._engine = None
                self._engine_pid = None

    def close(self) -> None:
        """Close every pooled connection, and the one this thread keeps (tests, shutdown)."""
        if getattr(self._held, "conn", None) is not None and not getattr(
                self._held, "depth", 0) and self._held.pid == os.getpid():
            self._drop_held(invalidate=False)
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
            with self.engine.connect() as conn:
                version = current_version(conn, self.tables)
            if version > LATEST_VERSION:
                raise StoreMisconfigured(
                    f"the celery-duraflow schema with prefix {self.config.table_prefix!r} in "
                    f"{self._shown_url} is at version {version}, newer than this release knows "
                    f"({LATEST_VERSION}): a newer celery-duraflow migrated it. Upgrade "
                    "celery-duraflow on this worker too.", task_id=task_id, step_key=step_key)
            if self.config.auto_migrate:
                if version < LATEST_VERSION:
                    migrate(self._transactional(), self.tables, self.config.table_prefix)
            elif version < LATEST_VERSION:
                alias = getattr(self.config, "django_alias", None)
                how = (f"python manage.py migrate --database {alias}" if alias is not None
                       else "celery -A proj duraflow migrate")
                raise StoreMisconfigured(
                    f"the celery-duraflow schema with prefix {self.config.table_prefix!r} in "
                    f"{self._shown_url} is at version {version}, this release needs "
                    f"{LATEST_VERSION}, and duraflow_auto_migrate is off: apply the migrations "
                    f"first ({how}).", task_id=task_id, step_key=step_key)
        self._schema_ready = True

    def migrate(self) -> list[int]:
        """Apply pending migrations now; return the versions applied."""
        with self._unavailable("migrating the schema"):
            applied = migrate(self._transactional(), self.tables, self.config.table_prefix)
        self._schema_ready = True
        return applied

    # -- connections ---------------------------------------------------------------------

    @property
    def _shown_url(self) -> str:
        return self.config.database_url.render_as_string(hide_password=True)

    @contextmanager
    def _unavailable(self, action: str, task_id: str | None = None,
                     step_key: str | None = None) -> Iterator[None]:
        """Turn the driver's connection errors into StoreUnavailable (waiting may help)
        or StoreMisconfigured (it will not: the database said no for good)."""
        try:
            yield
        except _UNAVAILABLE as exc:
            error = self._store_error(exc, action, task_id, step_key)
            if isinstance(error, StoreMisconfigured):
                raise error from None
            raise error from exc

    def _store_error(self, exc: BaseException, action: str, task_id: str | None,
                     step_key: str | None) -> StoreUnavailable | StoreMisconfigured:
        """The error a connection error while ``action`` becomes (see _unavailable)."""
        where = f" for task {task_id}" if task_id else ""
        if step_key:
            where += f", step {step_key!r}"
        fix = self._permanent(exc)
        if fix is not None:
            return StoreMisconfigured(
                f"the step store {self._shown_url} refused the connection while {action}"
                f"{where}: {_short(exc)}. Waiting will not change that: {fix}. Nothing was "
                "run or recorded.",
                task_id=task_id,
                step_key=step_key,
            )
        # What ran before this is for the caller to say (a step knows whether its body
        # did); here only the store's side is known.
        return StoreUnavailable(
            f"the step store is unavailable while {action}{where}: {_short(exc)}.",
            task_id=task_id,
            step_key=step_key,
        )

    @contextmanager
    def held_connection(self) -> Iterator[None]:
        """Let this thread keep one pooled connection until the block ends (an attempt).

        Every statement of an attempt then goes to the same connection
        without a trip through the pool, which costs about as much Python
        time per statement as the rest of a step's client side. Before each
        use the connection is checked like a pool checkout (one select()) and
        replaced if the server closed it, and it is dropped after an error
        that makes the store unavailable. Nested blocks share the outer
        block's connection. PostgreSQL only: SQLite writes are transactions.
        A worker therefore holds one connection per running attempt; size
        ``pool_size`` in ``duraflow_engine_options`` to the worker's concurrency
        when it runs more than five attempts at once in one process.

        The main thread keeps its connection after the block, for its next
        attempt: a prefork or solo worker process runs every task there, one
        after the other, and a check-out and check-in of a pooled connection
        per task costs about a tenth of an empty attempt's client time. Every
        other thread (a thread or greenlet pool's, which may not live long)
        gives it back when its outermost block ends.
        """
        if self.dialect != "postgresql":
            yield
            return
        held = self._held
        depth = getattr(held, "depth", 0)
        held.depth = depth + 1
        try:
            yield
        finally:
            held.depth = depth
            if depth == 0 and threading.current_thread() is not threading.main_thread():
                self._drop_held(invalidate=False)

    def _drop_held(self, *, invalidate: bool) -> None:
        held = self._held
        conn: Connection | None = getattr(held, "conn", None)
        held.conn = held.cursor = held.driver = held.poller = None
        if conn is None:
            return
        try:
            if invalidate:
                conn.invalidate()
            conn.close()
        except Exception:  # pragma: no cover - a broken connection's last words
            logger.debug("closing a held connection failed", exc_info=True)

    @contextmanager
    def _connect(self) -> Iterator[Connection]:
        """A connection for one statement: the thread's held one, or one from the pool."""
        conn = self._held_conn()
        if conn is None:
            with self.engine.connect() as pooled:
                yield pooled
            return
        try:
            yield conn
        except _UNAVAILABLE:
            self._drop_held(invalidate=True)
            raise

    def _held_conn(self) -> Connection | None:
        """The thread's held connection, checked (and replaced if the server closed it);
        None outside :meth:`held_connection`."""
        held = self._held
        if not getattr(held, "depth", 0):
            return None
        conn: Connection | None = getattr(held, "conn", None)
        if (conn is not None and held.engine is self._engine and held.pid == os.getpid()
                and _hung_up(held.driver, held.poller) is None):
            if _clock.due():  # at most once a minute: the database's clock, measured again
                _measure_clock(held.driver)
            return conn  # the usual case, checked like a pool checkout, in a poll()
        engine = self.engine
        if conn is not None and held.pid != os.getpid():
            # Inherited across a fork with the main thread's memory: the connection is
            # the parent's. Forget it without a word to the server (closing it would
            # end the parent's session); psycopg does not close it when collected.
            held.conn = held.cursor = held.driver = held.poller = None
            conn = None
        if conn is not None and (conn.closed or conn.invalidated
                                 or getattr(held, "engine", None) is not engine
                                 or _hung_up(conn.connection.driver_connection)):
            self._drop_held(invalidate=True)
            conn = None
        if conn is None:
            conn = engine.connect()
            held.conn, held.engine, held.pid = conn, engine, os.getpid()
            held.driver = conn.connection.driver_connection
            held.poller = _idle_poller(held.driver)
            held.cursor = held.driver.cursor()
        return conn

    def write_prepared(self, prepared: Prepared, params: dict[str, Any], action: str,
                       task_id: str, step_key: str | None = None) -> Executed:
        """One prepared write, durable when it returns: :meth:`_write` and :meth:`execute`
        in one call, without their layers on the attempt's held PostgreSQL connection.

        That is the path of every step record, where each layer of context
        managers costs a few microseconds of the step's fixed cost.
        """
        if not self._schema_ready:
            self.ensure_schema(task_id, step_key)
        if _atomic._OPEN.get():
            routed = _atomic.routed(self)
            if routed is not None:  # inside an atomic step's transaction (SQLite, Django)
                with self._unavailable(action, task_id, step_key):
                    return self.execute(routed, prepared, params)
        if prepared.sql:
            try:
                conn = self._held_conn()
                if conn is not None:
                    if prepared.raw_name and not self.transaction_pooled:
                        return self._write_raw(prepared, params)
                    cursor = self._held.cursor
                    cursor.execute(prepared.sql, {**(prepared.defaults or {}), **params})
                    return _executed(cursor, prepared)
            except _UNAVAILABLE as exc:
                self._drop_held(invalidate=True)
                error = self._store_error(exc, action, task_id, step_key)
                if isinstance(error, StoreMisconfigured):
                    raise error from None
                raise error from exc
        with self._write(action, task_id, step_key) as conn:
            return self.execute(conn, prepared, params)

    @contextmanager
    def _write(self, action: str, task_id: str | None = None,
               step_key: str | None = None) -> Iterator[Connection]:
        """A connection for one write that is durable when the block ends."""
        self.ensure_schema(task_id, step_key)
        with self._unavailable(action, task_id, step_key):
            routed = _atomic.routed(self)
            if routed is not None:
                # Inside an atomic step's transaction: the write commits with it.
                yield routed
            elif self.dialect == "postgresql":
                # One statement, committed by the server on its own (an autocommit engine).
                with self._connect() as conn:
                    yield conn
            else:
                with self.engine.begin() as conn:
                    yield conn

    @contextmanager
    def _read(self, action: str, task_id: str | None = None,
              step_key: str | None = None) -> Iterator[Connection]:
        self.ensure_schema(task_id, step_key)
        with self._unavailable(action, task_id, step_key):
            routed = _atomic.routed(self)
            if routed is not None:
                yield routed  # an atomic step's transaction sees its own writes
            elif self.dialect == "postgresql":
                with self._connect() as conn:
                    yield conn
            else:
                with self.engine.connect() as conn:
                    yield conn

    # -- for queries written outside the store (the operator commands in _admin) ---------

    @contextmanager
    def reading(self, action: str) -> Iterator[Connection]:
        """A connection for the reads of one query, once the schema is ready.

        The driver's connection errors become StoreUnavailable (or
        StoreMisconfigured) saying what failed while ``action`` (``"listing
        runs"``), as they do for the store's own reads.
        """
        with self._read(action) as conn:
            yield conn

    @contextmanager
    def transaction(self, action: str, task_id: str | None = None,
                    step_key: str | None = None) -> Iterator[Connection]:
        """A connection in one transaction, committed when the block ends, rolled back if
        it raises; connection errors are mapped as by :meth:`reading`.

        It is a real transaction on PostgreSQL too (whose other writes
        autocommit), so that rows selected ``FOR UPDATE`` stay locked until the
        end of the block.
        """
        self.ensure_schema(task_id, step_key)
        with (self._unavailable(action, task_id, step_key),
              self._transactional().begin() as conn):
            yield conn

    def atomic(self, task_id: str, step_key: str) -> _atomic.AtomicTransaction:
        """Open the transaction of an atomic step's body (see :mod:`._atomic`).

        In a Django project whose store is one of its database aliases, it is
        ``transaction.atomic()`` on that alias, on Django's connection.
        """
        self.ensure_schema(task_id, step_key)
        _atomic.refuse_other_store(self, task_id, step_key)
        with self._unavailable("starting the atomic step's transaction", task_id, step_key):
            alias = getattr(self.config, "django_alias", None)
            if alias is not None:
                from .contrib.django._atomic import begin_django

                return begin_django(self, alias, task_id, step_key)
            return _atomic.begin_native(self, task_id, step_key)

    def for_update(self, query: Select[Any], **options: Any) -> Select[Any]:
        """``query`` locking the rows it selects until the transaction ends: FOR UPDATE
        (with ``options`` such as ``skip_locked``) on PostgreSQL; unchanged on SQLite,
        whose transactions take the database's write lock when they begin."""
        return query.with_for_update(**options) if self.dialect == "postgresql" else query

    def _permanent(self, exc: BaseException) -> str | None:
        """What to fix, when a connection error is one that waiting cannot cure."""
        original = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
        text = str(original).lower()
        if self.dialect == "sqlite":
            path = self.config.database_url.database or ""
            folder = os.path.dirname(os.path.abspath(path)) if path else ""
            if "unable to open database file" in text and folder and not os.path.isdir(folder):
                return (f"the folder {folder} does not exist; create it or point "
                        "duraflow_database_url at a file in an existing folder")
            return None
        for phrase, fix in _PERMANENT:
            if phrase in text:
                return fix
        return None

    def check_reachable(self, task_id: str, step_key: str) -> None:
        """Raise StoreUnavailable if the database is visibly gone, before a step's body runs.

        The attempt's connection is checked as a pool checkout checks it: a
        server that shut down or restarted has closed it, and if a new one
        cannot be opened the step stops here, with nothing run. It costs no
        round trip. A network that fails silently is only
        noticed when the step's end is written; that step is then in doubt.
        """
        if self.dialect != "postgresql":
            return
        if not self._schema_ready:
            self.ensure_schema(task_id, step_key)
        with self._unavailable("checking the connection", task_id, step_key):
            try:
                if self._held_conn() is not None:
                    return
            except _UNAVAILABLE:
                self._drop_held(invalidate=True)
                raise
            with self._connect():
                pass

    def prepare(self, statement: Any, *, raw: bool = False) -> Prepared:
        """Build what executing ``statement`` many times needs, once.

        On PostgreSQL the statement is compiled here to the driver's SQL text,
        so an execution costs psycopg's own parameter handling and nothing of
        SQLAlchemy's; psycopg keeps the converted query while its text is at
        most 4,096 characters, and prepares it on the server after a few
        executions.
        """
        if not self.driver_statements:
            return Prepared(statement)
        compiled = statement.compile(dialect=self.engine.dialect)
        required = {key: None for key, bind in compiled.binds.items() if bind.required}
        defaults = compiled.construct_params(required)
        if not raw:
            return Prepared(statement, compiled.string, defaults)
        names: list[str] = []

        def placeholder(match: re.Match[str]) -> str:
            if match.group(1) is None:
                return "%"  # a literal percent sign, doubled for the pyformat style
            if match.group(1) not in names:
                names.append(match.group(1))
            return f"${names.index(match.group(1)) + 1}"

        numbered = _PLACEHOLDER.sub(placeholder, compiled.string)
        return Prepared(statement, compiled.string, defaults,
                        raw_name=f"duraflow_{os.getpid()}_{next(_raw_names)}".encode(),
                        raw_sql=numbered.encode(), raw_names=tuple(names),
                        raw_params=tuple((name, defaults.get(name)) for name in names))

    def _write_raw(self, prepared: Prepared, params: dict[str, Any]) -> Executed:
        """Run a write straight on libpq: its row count, and the rows it returns, each value
        as PostgreSQL's text (str) or None.

        The statement is prepared on the held connection once, then each
        execution is one ``PQexecPrepared`` with the parameters as text: about
        25 us of client CPU less per step record than psycopg's cursor, whose
        conversion, preparation bookkeeping and wait loop written in Python
        run on every execution. The call waits with the GIL released. Errors
        are psycopg's own exception classes, built from the server's answer.
        """
        driver = self._held.driver
        pgconn = driver.pgconn
        # What is prepared belongs to the server session, which outlives a thread's
        # hold on it: a pooled connection comes back with its statements.
        done = _RAW_PREPARED.get(driver)
        if done is None:
            done = _RAW_PREPARED[driver] = set()
        if prepared.raw_name not in done:
            _check(pgconn, pgconn.prepare(prepared.raw_name, prepared.raw_sql))
            done.add(prepared.raw_name)
        given = params.get
        args = [_as_text(given(name, fixed)) for name, fixed in prepared.raw_params]
        result = pgconn.exec_prepared(prepared.raw_name, args)
        if (result.status == pq.ExecStatus.FATAL_ERROR
                and result.error_field(pq.DiagnosticField.SQLSTATE) == _NO_SUCH_STATEMENT
                and pgconn.transaction_status == pq.TransactionStatus.IDLE):
            # Deallocated behind our back: psycopg sends DEALLOCATE ALL after a rollback
            # (an atomic step's) or DDL on the connection once it has prepared anything.
            # Outside a transaction nothing was aborted: prepare it again, once.
            _check(pgconn, pgconn.prepare(prepared.raw_name, prepared.raw_sql))
            result = pgconn.exec_prepared(prepared.raw_name, args)
        result = _check(pgconn, result)
        if not result.nfields:
            return Executed((), (), int(result.command_tuples or 0))
        value = result.get_value
        rows = [tuple(None if (raw := value(row, column)) is None else raw.decode()
                      for column in range(result.nfields))
                for row in range(result.ntuples)]
        names = tuple(result.fname(i).decode() for i in range(result.nfields))
        return Executed(names, rows, int(result.command_tuples or 0))

    def execute(self, conn: Connection, prepared: Prepared,
                params: dict[str, Any]) -> Executed:
        """Run a prepared statement on ``conn`` (inside ``_write`` or ``_read``)."""
        if prepared.sql:
            driver: Any = conn.connection.driver_connection
            return _executed(driver.execute(prepared.sql,
                                            {**(prepared.defaults or {}), **params}), prepared)
        result = conn.execute(prepared.statement, params)
        if not result.returns_rows:
            return Executed((), (), result.rowcount)
        rows = result.all()
        return Executed(list(result.keys()), rows, result.rowcount)

    def _insert(self, table: Any) -> Any:
        dialect = postgresql if self.dialect == "postgresql" else sqlite
        return dialect.insert(table)


# What the server says when the answer will not change by waiting (psycopg reports no
# SQLSTATE for a refused connection, so the server's message is all there is), and what
# to do about it.
_PERMANENT = (
    ("does not exist", "check the database name and the user in duraflow_database_url, or "
                       "create them"),
    ("password authentication failed", "check the user and password in duraflow_database_url"),
    ("authentication failed", "check the user and password in duraflow_database_url"),
    ("no pg_hba.conf entry", "allow this host and user in the server's pg_hba.conf"),
    ("permission denied", "grant the user of duraflow_database_url access to the database"),
    ("sslmode value", "fix the sslmode in duraflow_database_url"),
    ("invalid dsn", "fix duraflow_database_url"),
    ("invalid connection option", "fix the options in duraflow_database_url"),
)


def _as_text(value: Any) -> bytes | None:
    """A parameter in PostgreSQL's text format, for the raw path (the statement's casts
    give each its type)."""
    if value is None:
        return None
    kind = type(value)
    if kind is str:
        return value.encode()  # type: ignore[no-any-return]
    if kind is int:
        return str(value).encode()
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        return b"true" if value else b"false"
    if isinstance(value, datetime):
        return value.isoformat().encode()
    return str(value).encode()


def _check(pgconn: Any, result: Any) -> Any:
    """``result`` if the statement succeeded; otherwise psycopg's exception for it."""
    if result.status in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
        return result
    if pgconn.status == pq.ConnStatus.BAD:
        raise psycopg.OperationalError(
            (pgconn.error_message or b"the connection was lost").decode(errors="replace"))
    raise psycopg.errors.error_from_result(result, encoding="utf-8")


def _executed(cursor: Any, prepared: Prepared) -> Executed:
    """What a psycopg cursor's last statement (``prepared``) returned."""
    result = cursor.pgresult
    if result is None or not result.nfields:
        return Executed((), (), cursor.rowcount)
    # The names straight from the result (cursor.description would build a column
    # object, with its type looked up, for each of them), once per statement and
    # width: a statement that selects * is wider once a migration added a column.
    key = (prepared.sql, result.nfields)
    names = _NAMES.get(key)
    if names is None:
        names = _NAMES[key] = tuple(result.fname(i).decode() for i in range(result.nfields))
    return Executed(names, cursor.fetchall(), cursor.rowcount)


# The column names each prepared statement's results have had (see _executed).
_NAMES: dict[tuple[str, int], tuple[str, ...]] = {}


def _short(exc: BaseException) -> str:
    original = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    first_line = str(original).strip().splitlines()[0] if str(original).strip() else ""
    return f"{type(original).__name__}: {first_line}" if first_line else type(original).__name__
