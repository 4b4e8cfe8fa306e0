"""Shared pieces of the harness: settings, statistics, the raw-commit floor, round trips.

Nothing here times anything on its own behalf; each benchmark in :mod:`benchmarks.harness`
takes its baseline in the same process and the same run as what it compares.
"""

from __future__ import annotations

import os
import re
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import IO, Any

import psycopg
from celery import Celery
from sqlalchemy import Engine, event
from sqlalchemy.engine import make_url

from celery_duraflow import DurableTask
from celery_duraflow._config import config_for_app
from celery_duraflow._store import all_stores, store_for

from . import workload

DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/9"
DEFAULT_RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"

DURABLE_TASK_NAME = "bench.durable_steps"
PLAIN_TASK_NAME = "bench.plain_steps"
HANDWRITTEN_TASK_NAME = "bench.handwritten_steps"
RSS_TASK_NAME = "bench.rss"


def default_database_url() -> str:
    return (os.environ.get("DURAFLOW_BENCH_DATABASE_URL")
            or os.environ.get("DURAFLOW_TEST_DATABASE_URL") or DEFAULT_DATABASE_URL)


def default_broker_url() -> str:
    return (os.environ.get("DURAFLOW_BENCH_BROKER_URL")
            or os.environ.get("DURAFLOW_TEST_BROKER_URL") or DEFAULT_BROKER_URL)


def default_rabbitmq_url() -> str:
    return os.environ.get("DURAFLOW_BENCH_RABBITMQ_URL") or DEFAULT_RABBITMQ_URL


def is_postgres(sqlalchemy_url: str) -> bool:
    return make_url(sqlalchemy_url).get_backend_name() == "postgresql"


def libpq_url(sqlalchemy_url: str) -> str:
    """The same database as a plain ``postgresql://`` URL for psycopg (and DBOS)."""
    url = make_url(sqlalchemy_url)
    if url.get_backend_name() != "postgresql":
        raise SystemExit(
            f"the benchmarks measure PostgreSQL only; {url.render_as_string()} is "
            f"{url.get_backend_name()!r}. Pass --database-url postgresql://..."
        )
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


TELEMETRY_SWITCH = "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"


def telemetry_off() -> None:
    """Measure the library as a plain install runs it: without OpenTelemetry.

    Its switch-on is automatic wherever its API is installed (as in this
    repository's development environment, where Pydantic AI brings it too). This
    switches it off in this process and, through the environment, in every worker
    the harness starts. The ``telemetry`` section switches it on and off itself and
    prints what it costs.
    """
    from celery_duraflow._telemetry import INSTRUMENTATION_NAME

    names = [name.strip() for name in os.environ.get(TELEMETRY_SWITCH, "").split(",")
             if name.strip()]
    if INSTRUMENTATION_NAME not in names:
        os.environ[TELEMETRY_SWITCH] = ",".join([*names, INSTRUMENTATION_NAME])
    if "celery_duraflow.contrib.opentelemetry" in sys.modules:
        from celery_duraflow.contrib import opentelemetry

        opentelemetry.uninstrument()


def log(message: str) -> None:
    """Progress goes to stderr, results to stdout."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# -- statistics ------------------------------------------------------------------------------


@dataclass
class Samples:
    """Durations in seconds of one measured operation, all rounds together."""

    values: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> None:
        self.values.append(seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def minimum(self) -> float:
        return min(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    def __len__(self) -> int:
        return len(self.values)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cpu_timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds and CPU seconds of this thread (``time.thread_time``) of one call.

    Thread time: the eagerly applied task runs in this thread, and whatever other
    threads of the process do meanwhile (none of it is the call's) is left out.
    """
    cpu = time.thread_time()
    start = time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    return wall, time.thread_time() - cpu


def interleaved(variants: dict[str, Callable[[], object]], per_round: dict[str, int],
                rounds: int, warmup: int,
                bursts: dict[str, int] | None = None,
                cpu: dict[str, Samples] | None = None) -> dict[str, Samples]:
    """Time each variant ``per_round[name]`` times per round, the variants taking turns.

    Within a round the calls are spread evenly, one at a time (or in bursts of
    ``bursts[name]`` calls back to back), so that slow drift on a shared machine
    (autovacuum, another process, the page cache, the CPU's own speed) reaches every
    variant alike instead of whichever ran in the slow spell. The floor INSERT runs in
    bursts: back to back is its best case, and a step's write is always preceded by
    the same connection's previous statement.

    With ``cpu`` (a dict, filled here), each call's CPU time in this thread is kept too.
    """
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    bursts = bursts or {}
    schedule: list[tuple[float, str, int]] = []
    for name, count in per_round.items():
        size = max(1, min(bursts.get(name, 1), count))
        units = -(-count // size)
        for i in range(units):
            schedule.append(((i + 0.5) / units, name, min(size, count - i * size)))
    schedule.sort()
    samples = {name: Samples() for name in variants}
    if cpu is not None:
        cpu.update({name: Samples() for name in variants})
    for _ in range(rounds):
        for _, name, size in schedule:
            fn = variants[name]
            for _ in range(size):
                if cpu is None:
                    samples[name].add(timed(fn))
                else:
                    wall, used = cpu_timed(fn)
                    samples[name].add(wall)
                    cpu[name].add(used)
    return samples


def ms(seconds: float | None, digits: int = 3) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.{digits}f}"


def ratio(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A plain, aligned text table (also valid Markdown)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
                     + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# -- the floor: one durable single-row INSERT ------------------------------------------------


class Floor:
    """A raw psycopg 3 connection in autocommit, inserting one row per statement.

    ``synchronous_commit`` is left at the server's setting (``on`` by default), so each
    INSERT is one round trip and one WAL flush: the least a durable step can cost.
    """

    def __init__(self, conninfo: str, table_name: str) -> None:
        self.table_name = table_name
        self.conn = psycopg.connect(conninfo, autocommit=True)
        self.conn.execute(
            f'CREATE TABLE IF NOT EXISTS "{table_name}" '
            "(id bigserial PRIMARY KEY, a integer NOT NULL, b text NOT NULL)"
        )
        row = self.conn.execute("SHOW synchronous_commit").fetchone()
        self.synchronous_commit = str(row[0]) if row else "?"
        self._sql = f'INSERT INTO "{table_name}" (a, b) VALUES (%s, %s)'
        self.samples = Samples()
        self._i = 0

    def insert(self) -> None:
        self._i += 1
        self.conn.execute(self._sql, (self._i, "x"))

    def measure(self, count: int) -> None:
        """Time ``count`` single-row INSERTs, one by one, into :attr:`samples`."""
        for _ in range(count):
            start = time.perf_counter()
            self.insert()
            self.samples.add(time.perf_counter() - start)

    def close(self) -> None:
        try:
            self.conn.execute(f'DROP TABLE IF EXISTS "{self.table_name}"')
        finally:
            self.conn.close()


class SqliteFloor:
    """The floor on SQLite: ``BEGIN IMMEDIATE; INSERT one row; COMMIT`` on a raw connection.

    A ``sqlite3`` connection with ``isolation_level=None`` (no implicit transactions) and
    the settings the library gives its own connections (``celery_duraflow._db``): WAL
    journal, ``synchronous=FULL``, a busy timeout, foreign keys; the transaction opened
    the way the library opens its own, with ``BEGIN IMMEDIATE``.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA busy_timeout=30000")
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA foreign_keys=ON")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute("CREATE TABLE IF NOT EXISTS floor "
                          "(id INTEGER PRIMARY KEY, a INTEGER NOT NULL, b TEXT NOT NULL)")
        self.settings = sqlite_settings(self.conn)
        self._i = 0

    def insert(self) -> None:
        self._i += 1
        execute = self.conn.execute
        execute("BEGIN IMMEDIATE")
        execute("INSERT INTO floor (a, b) VALUES (?, ?)", (self._i, "x"))
        execute("COMMIT")

    def close(self) -> None:
        self.conn.close()


def sqlite_settings(conn: Any) -> str:
    """journal_mode, synchronous and busy_timeout of a sqlite3 connection, for the output."""
    values = []
    for name in ("journal_mode", "synchronous", "busy_timeout"):
        row = conn.execute(f"PRAGMA {name}").fetchone()
        values.append(f"{name}={row[0] if row else '?'}")
    return ", ".join(values)


class SqliteStatements:
    """Every statement SQLite runs for this thread on an engine's connections.

    ``sqlite3.Connection.set_trace_callback`` on each connection while it is checked out
    of the engine's pool (the ``checkout`` event, rather than ``connect``: the store's
    connections may already be open when counting starts). The callback sees what the
    library sends through SQLAlchemy and what it sends to the driver itself, ``BEGIN
    IMMEDIATE`` included.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.statements: list[str] = []
        self._me = threading.get_ident()

    def _seen(self, statement: str) -> None:
        if threading.get_ident() == self._me:
            self.statements.append(statement)

    def _on_checkout(self, dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        dbapi_conn.set_trace_callback(self._seen)

    def _on_checkin(self, dbapi_conn: Any, _record: Any) -> None:
        if dbapi_conn is not None:
            dbapi_conn.set_trace_callback(None)

    @contextmanager
    def counting(self) -> Iterator[SqliteStatements]:
        self._me = threading.get_ident()
        event.listen(self.engine.pool, "checkout", self._on_checkout)
        event.listen(self.engine.pool, "checkin", self._on_checkin)
        try:
            yield self
        finally:
            event.remove(self.engine.pool, "checkout", self._on_checkout)
            event.remove(self.engine.pool, "checkin", self._on_checkin)

    def count(self, keyword: str) -> int:
        """Statements that start with ``keyword`` (``BEGIN``, ``COMMIT``, ...)."""
        return sum(1 for s in self.statements if s.lstrip().upper().startswith(keyword))


# -- counting round trips --------------------------------------------------------------------


class RoundTrips:
    """What threads send to PostgreSQL through one SQLAlchemy engine, counted two ways.

    * ``statements``: ``before_cursor_execute`` events, i.e. every statement SQLAlchemy
      hands to the driver.
    * ``wire``: ReadyForQuery messages in libpq's protocol trace of every connection
      while a thread has it checked out. The client waits for each of them, so this is
      the number of round trips, including those the driver sends on its own (the
      ``BEGIN`` and ``COMMIT`` of a non-autocommit transaction, psycopg's one-time
      ``PREPARE``), which no statement event sees.

    Counts are kept per thread; :meth:`of` reads one thread, or all of them. With
    ``timed=True`` the trace keeps libpq's timestamps, and :attr:`wire_seconds` adds up,
    per thread, the time from the first message of each round trip to its ReadyForQuery:
    the time spent waiting on the server (network, execution, commit), without Python.
    """

    def __init__(self, engine: Engine, *, timed: bool = False, keep: bool = False) -> None:
        self.engine = engine
        self.timed = timed
        # keep=True: the trace text itself, per thread, for trace_statements() and
        # trace_intervals().
        self.keep = keep
        self.traces: dict[int, list[str]] = defaultdict(list)
        self.statements: Counter[int] = Counter()
        self.wire: Counter[int] = Counter()
        self.wire_seconds: dict[int, float] = defaultdict(float)
        self.wire_available = True
        self.texts: list[str] = []
        self._open: dict[int, tuple[Any, IO[bytes], int]] = {}
        self._lock = threading.Lock()

    # SQLAlchemy event handlers
    def _on_statement(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        self.statements[threading.get_ident()] += 1
        self.texts.append(" ".join(statement.split())[:100])

    def _on_checkout(self, dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        pgconn = getattr(dbapi_conn, "pgconn", None)
        if pgconn is None or not hasattr(pgconn, "trace"):
            self.wire_available = False
            return
        stream = tempfile.TemporaryFile()  # noqa: SIM115 - closed in _collect()
        try:
            pgconn.trace(stream.fileno())
            if not self.timed:
                pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        except Exception:
            stream.close()
            self.wire_available = False
            return
        with self._lock:
            self._open[id(dbapi_conn)] = (pgconn, stream, threading.get_ident())

    def _on_checkin(self, dbapi_conn: Any, _record: Any) -> None:
        with self._lock:
            entry = self._open.pop(id(dbapi_conn), None)
        if entry is not None:
            self._collect(*entry)

    def _collect(self, pgconn: Any, stream: IO[bytes], thread: int) -> None:
        pgconn.untrace()  # flushes libpq's buffer into the file
        stream.seek(0)
        text = stream.read().decode(errors="replace")
        stream.close()
        count, waited = parse_trace(text, self.timed)
        if self.keep:
            self.traces[thread].append(text)
        self.wire[thread] += count
        self.wire_seconds[thread] += waited

    @contextmanager
    def counting(self) -> Iterator[RoundTrips]:
        event.listen(self.engine, "before_cursor_execute", self._on_statement)
        event.listen(self.engine.pool, "checkout", self._on_checkout)
        event.listen(self.engine.pool, "checkin", self._on_checkin)
        # The main thread keeps its connection between attempts: it is already checked
        # out, so trace it from here on as if it had just been.
        for kept in kept_connections(self.engine):
            self._on_checkout(kept, None, None)
        try:
            yield self
        finally:
            event.remove(self.engine, "before_cursor_execute", self._on_statement)
            event.remove(self.engine.pool, "checkout", self._on_checkout)
            event.remove(self.engine.pool, "checkin", self._on_checkin)
            with self._lock:
                still_open = list(self._open.values())
                self._open.clear()
            for entry in still_open:
                self._collect(*entry)

    def of(self, thread: int | None = None) -> tuple[int, int | None]:
        """(statements, wire round trips) of one thread, or of all threads."""
        if thread is None:
            statements, wire = sum(self.statements.values()), sum(self.wire.values())
        else:
            statements, wire = self.statements[thread], self.wire[thread]
        return statements, (wire if self.wire_available else None)


def kept_connections(engine: Engine) -> list[Any]:
    """The DBAPI connection this thread keeps checked out of ``engine`` between attempts."""
    kept = []
    for store in all_stores():
        held = store._held
        conn = getattr(held, "conn", None)
        if conn is not None and getattr(held, "engine", None) is engine and not conn.closed:
            kept.append(conn.connection.dbapi_connection)
    return kept


def parse_trace(text: str, timed: bool) -> tuple[int, float]:
    """Round trips in a libpq trace, and (with timestamps) the seconds spent in them.

    A round trip ends with the server's ReadyForQuery; it starts with the first message
    the client sent after the previous one ended.
    """
    count = 0
    waited = 0.0
    first_sent: float | None = None
    for line in text.splitlines():
        fields = line.split("\t")
        if timed:
            if len(fields) < 4:
                continue
            stamp, direction, message = fields[0], fields[1], fields[3]
        else:
            if len(fields) < 3:
                continue
            stamp, direction, message = "", fields[0], fields[2]
        if direction == "F" and first_sent is None and stamp:
            first_sent = _trace_time(stamp)
        elif direction == "B" and message.startswith("ReadyForQuery"):
            count += 1
            if first_sent is not None:
                waited += _trace_time(stamp) - first_sent
                first_sent = None
    return count, waited


def _trace_time(stamp: str) -> float:
    """Seconds since midnight of a libpq trace timestamp ("2026-01-02 10:11:12.123456")."""
    clock = stamp.rsplit(" ", 1)[-1]
    hours, minutes, seconds = clock.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


# A message's first line in libpq's trace: [timestamp TAB] direction TAB length TAB type.
_MESSAGE = re.compile(r"^(?:(?P<stamp>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\t)?"
                      r"(?P<dir>[FB])\t(?P<length>\d+)\t(?P<type>[A-Za-z]+)(?P<body>.*)$")
_PARSE_BODY = re.compile(r'^\s*"[^"]*" "(?P<query>.*)" (?P<params>\d+)(?: -?\d+)*\s*$', re.S)
_QUERY_BODY = re.compile(r'^\s*"(?P<query>.*)"\s*$', re.S)


@dataclass(frozen=True)
class TraceMessage:
    stamp: str
    direction: str  # "F" (frontend, the client) or "B" (backend, the server)
    length: int
    type: str
    body: str


def trace_messages(text: str) -> list[TraceMessage]:
    """The messages of a libpq protocol trace (a message's text may span several lines)."""
    messages: list[TraceMessage] = []
    current: dict[str, Any] | None = None
    for line in text.split("\n"):
        match = _MESSAGE.match(line)
        if match:
            if current is not None:
                messages.append(TraceMessage(**current))
            current = {"stamp": match["stamp"] or "", "direction": match["dir"],
                       "length": int(match["length"]), "type": match["type"],
                       "body": match["body"]}
        elif current is not None:
            current["body"] += "\n" + line
    if current is not None:
        messages.append(TraceMessage(**current))
    return messages


@dataclass(frozen=True)
class SentStatement:
    """A statement as the server received it: its text ($n placeholders) and parameters."""

    text: str
    params: int

    @property
    def chars(self) -> int:
        return len(self.text)


def trace_statements(text: str) -> list[SentStatement]:
    """Every SQL text the client sent (``Parse`` and ``Query`` messages) in a trace."""
    sent = []
    for message in trace_messages(text):
        if message.direction != "F":
            continue
        if message.type == "Parse":
            match = _PARSE_BODY.match(message.body)
            if match:
                sent.append(SentStatement(match["query"], int(match["params"])))
        elif message.type == "Query":
            match = _QUERY_BODY.match(message.body)
            if match:
                sent.append(SentStatement(match["query"], 0))
    return sent


def trace_intervals(text: str) -> list[tuple[float, float]]:
    """(start, end) of each round trip in a timed trace, as Unix times (``time.time()``).

    libpq writes local wall-clock time, as ``datetime.timestamp()`` reads a naive one.
    """
    intervals = []
    first: str | None = None
    for message in trace_messages(text):
        if not message.stamp:
            continue
        if message.direction == "F" and first is None:
            first = message.stamp
        elif message.direction == "B" and message.type == "ReadyForQuery" and first:
            intervals.append((_epoch(first), _epoch(message.stamp)))
            first = None
    return intervals


def _epoch(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").timestamp()


@dataclass(frozen=True)
class ExecutedStatement:
    """A statement as psycopg's ``Cursor.execute`` received it, before conversion."""

    chars: int  # the length psycopg compares with MAX_CACHED_STATEMENT_LENGTH (bytes)
    params: int  # the number of parameters it compares with MAX_CACHED_STATEMENT_PARAMS
    text: str
    # "psycopg": through Cursor.execute; "libpq": the store's leanest path (prepared on
    # the connection once, then PQexecPrepared), where psycopg converts nothing.
    path: str = "psycopg"


@contextmanager
def psycopg_statements() -> Iterator[list[ExecutedStatement]]:
    """What this thread hands to ``psycopg.Cursor.execute``, whoever calls it, and the
    statements the store runs on libpq directly.

    SQLAlchemy and the statements the library sends to the psycopg connection directly
    both go through ``Cursor.execute`` (``Connection.execute`` opens a cursor). The query
    is recorded as psycopg sees it: the text with its ``%(name)s`` placeholders, whose
    encoded length decides whether psycopg caches its conversion. The store's leanest
    path (``Database._write_raw``: prepared once, then ``PQexecPrepared``) bypasses
    ``Cursor.execute``; its statements are recorded with ``path="libpq"``.
    """
    from celery_duraflow._db import Database

    seen: list[ExecutedStatement] = []
    me = threading.get_ident()
    original = psycopg.Cursor.execute
    original_raw = Database._write_raw

    def execute(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        if threading.get_ident() == me:
            seen.append(_executed(self, query, params))
        return original(self, query, params, **kwargs)

    def write_raw(self: Any, prepared: Any, params: Any) -> Any:
        if threading.get_ident() == me:
            raw = (prepared.sql or "").encode()
            seen.append(ExecutedStatement(len(raw), len(prepared.raw_names),
                                          raw.decode(errors="replace"), "libpq"))
        return original_raw(self, prepared, params)

    psycopg.Cursor.execute = execute  # type: ignore[method-assign]
    Database._write_raw = write_raw  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        psycopg.Cursor.execute = original  # type: ignore[method-assign]
        Database._write_raw = original_raw  # type: ignore[method-assign]


def _executed(cursor: Any, query: Any, params: Any) -> ExecutedStatement:
    if isinstance(query, bytes):
        raw = query
    elif isinstance(query, str):
        raw = query.encode()
    else:  # psycopg.sql.Composable and the like
        try:
            raw = query.as_bytes(cursor)
        except Exception:
            raw = str(query).encode()
    count = 0 if params is None else len(params)
    return ExecutedStatement(len(raw), count, raw.decode(errors="replace"))


def count_round_trips(engine: Engine, fn: Callable[[], object]) -> tuple[int, int | None]:
    """Statements and wire round trips that ``fn()`` causes in this thread."""
    counter = RoundTrips(engine)
    with counter.counting():
        fn()
    return counter.of(threading.get_ident())


# -- celery-duraflow in this process ---------------------------------------------------------


@dataclass
class DuraflowBench:
    """An in-process Celery app with the durable task, on the benchmark's own tables.

    The same app also has the plain task (the same work, no ``base=DurableTask``): what
    Celery's ``Task.apply()`` costs by itself. The store may be PostgreSQL or SQLite
    (``conninfo`` is empty then, and there is no :attr:`admin` connection).
    """

    app: Celery
    task: Any
    plain: Any
    engine: Engine
    conninfo: str
    prefix: str
    _admin: psycopg.Connection[Any] | None = None

    @classmethod
    def create(cls, database_url: str, prefix: str) -> DuraflowBench:
        app = Celery(f"duraflow-bench-{uuid.uuid4().hex[:6]}", broker="memory://",
                     backend="cache+memory://", set_as_current=False)
        app.conf.update(
            duraflow_database_url=database_url,
            duraflow_table_prefix=prefix,
            task_eager_propagates=False,
        )
        task = app.task(base=DurableTask, name=DURABLE_TASK_NAME,
                        shared=False)(workload.durable_steps)
        plain = app.task(name=PLAIN_TASK_NAME, shared=False)(workload.plain_steps)
        store = store_for(config_for_app(app))
        store.migrate()
        conninfo = libpq_url(database_url) if is_postgres(database_url) else ""
        return cls(app=app, task=task, plain=plain, engine=store.engine, conninfo=conninfo,
                   prefix=prefix)

    @property
    def store(self) -> Any:
        """The library's process-wide store of this app's configuration."""
        return store_for(config_for_app(self.app))

    def run(self, n: int, task_id: str | None = None, retries: int = 0) -> str:
        """Apply the durable task in this process (a new task id unless given); with
        ``retries``, as Celery delivers a retry of it."""
        task_id = task_id or f"bench-{uuid.uuid4()}"
        result = self.task.apply(args=(n,), task_id=task_id, retries=retries)
        if not result.successful():
            raise RuntimeError(f"durable run {task_id} of {n} steps failed:\n{result.traceback}")
        if result.result != workload.expected_result(n):
            raise RuntimeError(f"durable run {task_id} returned {result.result!r}")
        return task_id

    def run_plain(self, n: int) -> None:
        """Apply the plain task in this process: Celery's own apply machinery."""
        result = self.plain.apply(args=(n,), task_id=f"bench-{uuid.uuid4()}")
        if not result.successful() or result.result != workload.expected_result(n):
            raise RuntimeError(f"plain task of {n} steps failed: {result.traceback}")

    @property
    def admin(self) -> psycopg.Connection[Any]:
        """A connection of the harness's own, outside every measurement."""
        if self._admin is None:
            self._admin = psycopg.connect(self.conninfo, autocommit=True)
        return self._admin

    def reset_to_running(self, task_id: str) -> None:
        """Make a finished run look like one whose worker died after its last step.

        The run row goes back to ``running`` (no end time; any lease the library keeps
        is released, as when it expires); the step rows stay completed.
        """
        runs = f"{self.prefix}runs"
        assignments = ["status = 'running'"]
        for column in self._nullable_run_columns():
            if column == "finished_at" or "lease" in column or "owner" in column:
                assignments.append(f'"{column}" = NULL')
        cur = self.admin.execute(
            f'UPDATE "{runs}" SET {", ".join(assignments)} WHERE task_id = %s', (task_id,)
        )
        if cur.rowcount != 1:
            raise RuntimeError(f"run {task_id} not found in {runs}")

    _columns: list[str] | None = None

    def _nullable_run_columns(self) -> list[str]:
        if self._columns is None:
            rows = self.admin.execute(
                "SELECT column_name FROM information_schema.columns "
                "WHERE table_name = %s AND is_nullable = 'YES'",
                (f"{self.prefix}runs",),
            ).fetchall()
            self._columns = [str(r[0]) for r in rows]
        return self._columns

    def close(self) -> None:
        if self._admin is not None:
            self._admin.close()
            self._admin = None


def drop_prefixed_tables(conninfo: str, prefix: str) -> None:
    """Drop every table whose name starts with the benchmark's prefix."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT table_schema, table_name FROM information_schema.tables "
            "WHERE table_name LIKE %s",
            (prefix.replace("_", r"\_") + "%",),
        ).fetchall()
        for schema, name in rows:
            conn.execute(f'DROP TABLE IF EXISTS "{schema}"."{name}" CASCADE')


def new_prefix() -> str:
    """A table prefix of this run's own: runs never see each other's rows."""
    return f"bench_{uuid.uuid4().hex[:8]}_"
