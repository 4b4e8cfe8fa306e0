"""Shared pieces of the harness: settings, statistics, the raw-commit floor, round trips.

Nothing here times anything on its own behalf; each benchmark in :mod:`benchmarks.harness`
takes its baseline in the same process and the same run as what it compares.
"""

from __future__ import annotations

import os
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
from typing import IO, Any

import psycopg
from celery import Celery
from sqlalchemy import Engine, event
from sqlalchemy.engine import make_url

from celery_duraflow import DurableTask
from celery_duraflow._config import config_for_app
from celery_duraflow._store import store_for

from . import workload

DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/9"

DURABLE_TASK_NAME = "bench.durable_steps"
PLAIN_TASK_NAME = "bench.plain_steps"
RSS_TASK_NAME = "bench.rss"


def default_database_url() -> str:
    return (os.environ.get("DURAFLOW_BENCH_DATABASE_URL")
            or os.environ.get("DURAFLOW_TEST_DATABASE_URL") or DEFAULT_DATABASE_URL)


def default_broker_url() -> str:
    return (os.environ.get("DURAFLOW_BENCH_BROKER_URL")
            or os.environ.get("DURAFLOW_TEST_BROKER_URL") or DEFAULT_BROKER_URL)


def libpq_url(sqlalchemy_url: str) -> str:
    """The same database as a plain ``postgresql://`` URL for psycopg (and DBOS)."""
    url = make_url(sqlalchemy_url)
    if url.get_backend_name() != "postgresql":
        raise SystemExit(
            f"the benchmarks measure PostgreSQL only; {url.render_as_string()} is "
            f"{url.get_backend_name()!r}. Pass --database-url postgresql://..."
        )
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


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


def interleaved(variants: dict[str, Callable[[], object]], per_round: dict[str, int],
                rounds: int, warmup: int,
                bursts: dict[str, int] | None = None) -> dict[str, Samples]:
    """Time each variant ``per_round[name]`` times per round, the variants taking turns.

    Within a round the calls are spread evenly, one at a time (or in bursts of
    ``bursts[name]`` calls back to back), so that slow drift on a shared machine
    (autovacuum, another process, the page cache, the CPU's own speed) reaches every
    variant alike instead of whichever ran in the slow spell. The floor INSERT runs in
    bursts: back to back is its best case, and a step's write is always preceded by
    the same connection's previous statement.
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
    for _ in range(rounds):
        for _, name, size in schedule:
            fn = variants[name]
            for _ in range(size):
                samples[name].add(timed(fn))
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

    def __init__(self, engine: Engine, *, timed: bool = False) -> None:
        self.engine = engine
        self.timed = timed
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
        count, waited = parse_trace(stream.read().decode(errors="replace"), self.timed)
        stream.close()
        self.wire[thread] += count
        self.wire_seconds[thread] += waited

    @contextmanager
    def counting(self) -> Iterator[RoundTrips]:
        event.listen(self.engine, "before_cursor_execute", self._on_statement)
        event.listen(self.engine.pool, "checkout", self._on_checkout)
        event.listen(self.engine.pool, "checkin", self._on_checkin)
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


def count_round_trips(engine: Engine, fn: Callable[[], object]) -> tuple[int, int | None]:
    """Statements and wire round trips that ``fn()`` causes in this thread."""
    counter = RoundTrips(engine)
    with counter.counting():
        fn()
    return counter.of(threading.get_ident())


# -- celery-duraflow in this process ---------------------------------------------------------


@dataclass
class DuraflowBench:
    """An in-process Celery app with the durable task, on the benchmark's own tables."""

    app: Celery
    task: Any
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
        store = store_for(config_for_app(app))
        store.migrate()
        return cls(app=app, task=task, engine=store.engine, conninfo=libpq_url(database_url),
                   prefix=prefix)

    def run(self, n: int, task_id: str | None = None) -> str:
        """Apply the durable task in this process (a new task id unless given)."""
        task_id = task_id or f"bench-{uuid.uuid4()}"
        result = self.task.apply(args=(n,), task_id=task_id)
        if not result.successful():
            raise RuntimeError(f"durable run {task_id} of {n} steps failed:\n{result.traceback}")
        if result.result != workload.expected_result(n):
            raise RuntimeError(f"durable run {task_id} returned {result.result!r}")
        return task_id

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
