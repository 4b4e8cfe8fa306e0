"""Profile fresh or replayed durable runs with pyinstrument.

``python -m benchmarks.profile [--steps 100] [--runs 20] [--replay] [--html FILE]``
``python -m benchmarks.profile --attempt [--runs 300] [--tree]``

Applies the benchmark's durable task in this process, as the ``fresh`` (or ``replay``)
benchmark does, under pyinstrument's sampling profiler (wall clock, so time spent
waiting for PostgreSQL shows up as the frames that wait), prints the call tree, and
prints the share of time spent in a few places that matter for the per-step cost.
Uses its own tables, dropped at the end.

``--attempt`` splits one attempt instead: wall and CPU time of an empty durable task and
of a 10-step one, made of Celery's apply machinery (a plain task), each ``Store`` call
(its wait on PostgreSQL and its client-side time) and the rest of the library, so that a
change that adds fixed cost to every attempt shows where it went (``python -m benchmarks
--profile`` prints the same table).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .common import (
    DuraflowBench,
    default_database_url,
    drop_prefixed_tables,
    new_prefix,
    telemetry_off,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--steps", type=int, default=100, help="steps per run (default 100)")
    parser.add_argument("--runs", type=int, default=20, help="profiled runs (default 20)")
    parser.add_argument("--replay", action="store_true",
                        help="profile resumed runs whose steps are all completed")
    parser.add_argument("--database-url", default=default_database_url())
    parser.add_argument("--interval", type=float, default=0.001,
                        help="sampling interval in seconds (default 0.001)")
    parser.add_argument("--html", metavar="FILE", help="also write pyinstrument's HTML report")
    parser.add_argument("--show-all", action="store_true",
                        help="show library frames pyinstrument hides by default")
    parser.add_argument("--driver-time", action="store_true",
                        help="instead of profiling, split the per-step cost into time waiting "
                             "on PostgreSQL (libpq trace timestamps) and client-side time")
    parser.add_argument("--sampler", choices=("pyinstrument", "none"), default="pyinstrument",
                        help="'none' runs the loop unprofiled, for a sampler outside the "
                             "process: py-spy record --idle --format raw -o stacks.txt -- "
                             "python -m benchmarks.profile --sampler none")
    parser.add_argument("--summarize", metavar="STACKS",
                        help="summarize a py-spy --format raw (collapsed stacks) file")
    parser.add_argument("--anatomy", type=int, default=0, metavar="COUNT",
                        help="instead of profiling, time COUNT single-row writes of growing "
                             "complexity on scratch tables (what a step row costs the server), "
                             "then COUNT starts and ends of a run as the store writes them")
    parser.add_argument("--attempt", action="store_true",
                        help="instead of profiling, split one attempt (an empty durable task "
                             "and a 10-step one) into Celery's apply machinery, each Store "
                             "call (server wait vs client) and the rest of the library; "
                             "--runs empty attempts (a third as many 10-step ones)")
    parser.add_argument("--tree", action="store_true",
                        help="with --attempt: also print pyinstrument call trees of them")
    args = parser.parse_args(argv)
    telemetry_off()
    if args.attempt:
        return _attempt_main(args.database_url, args.runs, args.tree, args.interval)
    if args.anatomy:
        print(anatomy(args.database_url, args.anatomy))
        print()
        print(run_row_anatomy(args.database_url, args.anatomy))
        return 0
    if args.driver_time:
        return _sql_main(args.database_url, args.runs, args.steps)
    if args.summarize:
        print(summarize_collapsed(args.summarize))
        return 0
    profiler: Any = None
    if args.sampler == "pyinstrument":
        try:
            from pyinstrument import Profiler
        except ImportError:
            print("pyinstrument is not installed: pip install -e '.[bench]'", file=sys.stderr)
            return 2
        profiler = Profiler(interval=args.interval)

    prefix = new_prefix()
    bench = DuraflowBench.create(args.database_url, prefix)
    try:
        task_id = bench.run(args.steps)
        for _ in range(5):  # warm up: connections, compiled statements, prepared statements
            if args.replay:
                bench.reset_to_running(task_id)
                bench.run(args.steps, task_id)
            else:
                bench.run(args.steps)
        measured = 0.0
        for _ in range(args.runs):
            if args.replay:
                bench.reset_to_running(task_id)  # outside the profile
            start = time.perf_counter()
            if profiler is not None:
                profiler.start()
            bench.run(args.steps, task_id if args.replay else None)
            if profiler is not None:
                profiler.stop()
            measured += time.perf_counter() - start
        kind = "replayed" if args.replay else "fresh"
        print(f"# {args.runs} {kind} runs of {args.steps} steps: {measured:.3f} s "
              f"({args.sampler}), {measured / args.runs * 1000:.2f} ms per run, "
              f"{measured / args.runs / max(args.steps, 1) * 1000:.3f} ms per step")
        if profiler is not None:
            print(profiler.output_text(unicode=True, color=False, show_all=args.show_all))
            print(breakdown(profiler))
            if args.html:
                with open(args.html, "w") as out:
                    out.write(profiler.output_html())
    finally:
        bench.close()
        bench.engine.dispose()
        drop_prefixed_tables(bench.conninfo, prefix)
    return 0


# (label, frame function names, file path fragment) of the places worth a total.
_PLACES = [
    ("waiting for PostgreSQL (psycopg wait)", {"wait", "wait_c", "_wait"}, "psycopg"),
    ("SQLAlchemy Connection.execute", {"execute"}, "sqlalchemy/engine/base.py"),
    ("SQLAlchemy pool checkout/checkin", {"_checkout", "_checkin", "_finalize_fairy",
                                          "checkout", "_return_conn"}, "sqlalchemy/pool"),
    ("isolation level switching", {"set_isolation_level", "reset_isolation_level",
                                   "_set_autocommit", "autocommit"}, ""),
    ("statement compilation / cache key", {"_compile_w_cache", "_generate_cache_key",
                                           "compile"}, "sqlalchemy"),
    ("row processing", {"from_row", "_mapping"}, ""),
    ("serialization", {"dumps", "loads", "decode"}, ""),
]


def breakdown(profiler: Any) -> str:
    """Total time (inclusive, outermost frame only) under a few named places."""
    session = profiler.last_session
    root = session.root_frame() if session else None
    if root is None:
        return ""
    total = root.time
    lines = ["", "Time inclusive under (outermost matching frame, share of profiled time):"]
    for label, names, fragment in _PLACES:
        seconds = _inclusive(root, names, fragment)
        lines.append(f"  {label:<42} {seconds * 1000:9.1f} ms  {seconds / total:6.1%}")
    return "\n".join(lines)


def _inclusive(frame: Any, names: set[str], fragment: str) -> float:
    if frame.function in names and fragment in (frame.file_path or ""):
        return float(frame.time)
    return sum(_inclusive(child, names, fragment) for child in frame.children)


def _sql_main(database_url: str, runs: int, steps: int) -> int:
    prefix = new_prefix()
    bench = DuraflowBench.create(database_url, prefix)
    try:
        print(driver_time(bench, runs, steps))
    finally:
        bench.close()
        bench.engine.dispose()
        drop_prefixed_tables(bench.conninfo, prefix)
    return 0


def driver_time(bench: DuraflowBench, runs: int, steps: int) -> str:
    """Split the per-step cost into waiting on PostgreSQL and client-side Python.

    Runs fresh runs of ``steps`` steps and empty runs, taking turns, with libpq's protocol
    trace on (with timestamps): for each round trip, the time from the first message sent
    to the server's ReadyForQuery is time spent waiting on the server (loopback, parse,
    execute, WAL flush); the rest of a run is client-side (Celery, celery-duraflow,
    SQLAlchemy, psycopg's Python). Whatever path the library takes to the driver, every
    round trip is in the trace. The floor INSERT is timed in the same loop.
    The traced runs give the waits; untraced runs, taking turns with them, give the total.
    """
    import statistics
    import tempfile
    import threading

    from .common import Floor, RoundTrips, parse_trace

    def measured(n: int) -> tuple[float, float, int]:
        counter = RoundTrips(bench.engine, timed=True)
        with counter.counting():
            total = _timed(lambda: bench.run(n))
        me = threading.get_ident()
        return total, counter.wire_seconds[me], counter.wire[me]

    floor = Floor(bench.conninfo, f"{bench.prefix}floor")
    floor_times: list[float] = []
    floor_waits: list[float] = []
    full: list[tuple[float, float, int]] = []
    empty: list[tuple[float, float, int]] = []
    untraced_full: list[float] = []
    untraced_empty: list[float] = []
    try:
        for _ in range(5):
            measured(steps)
            measured(0)
        for _ in range(runs):
            # Back to back, as the harness times the floor (a lone INSERT after an idle
            # spell is slower: the server process has to wake up).
            floor_times.extend(_timed(floor.insert) for _ in range(20))
            # The floor traced like the runs: its own wait on the server.
            with tempfile.TemporaryFile() as trace:
                floor.conn.pgconn.trace(trace.fileno())
                for _ in range(20):
                    floor.insert()
                floor.conn.pgconn.untrace()
                trace.seek(0)
                count, waited = parse_trace(trace.read().decode(errors="replace"), True)
            floor_waits.append(waited / max(count, 1))
            empty.append(measured(0))
            full.append(measured(steps))
            untraced_empty.append(_timed(lambda: bench.run(0)))
            untraced_full.append(_timed(lambda: bench.run(steps)))
    finally:
        floor.close()
    floor_median = statistics.median(floor_times)
    floor_wait = statistics.median(floor_waits)
    n = max(steps, 1)
    per_step = (statistics.median(untraced_full) - statistics.median(untraced_empty)) / n
    traced_step = (statistics.median(t for t, _, _ in full)
                   - statistics.median(t for t, _, _ in empty)) / n
    wait_step = (statistics.median(w for _, w, _ in full)
                 - statistics.median(w for _, w, _ in empty)) / n
    trips_step = (statistics.median(c for _, _, c in full)
                  - statistics.median(c for _, _, c in empty)) / n
    return "\n".join([
        f"{runs} fresh runs of {steps} steps and {runs} empty runs, taking turns, traced; "
        f"floor INSERT median {floor_median * 1000:.3f} ms untraced, of which "
        f"{floor_wait * 1000:.3f} ms waiting on PostgreSQL (traced the same way).",
        f"Round trips per run: {statistics.median(c for _, _, c in full):.0f} "
        f"({statistics.median(c for _, _, c in empty):.0f} for the empty run), "
        f"{trips_step:.2f} per step.",
        f"Per step, untraced: {per_step * 1000:.3f} ms = {per_step / floor_median:.2f}x the "
        f"floor (traced: {traced_step * 1000:.3f} ms), made of:",
        f"  {wait_step * 1000:.3f} ms waiting on PostgreSQL "
        f"({wait_step / floor_wait:.2f}x the floor INSERT's own wait)",
        f"  {(per_step - wait_step) * 1000:.3f} ms client-side Python (the rest)",
    ])


def run_row_anatomy(database_url: str, count: int) -> str:
    """What an empty attempt's two statements cost the server, without the library's Python.

    The store's own first-delivery insert and its finish, prepared on a raw libpq
    connection and run with ``PQexecPrepared`` (as the store runs them), ``count`` runs
    of each taking turns with the floor INSERT prepared the same way (a new row of three
    columns into a table with a primary key only). The same two statements run against
    the store's runs table and against a copy of it with its primary key only, which
    tells what the indexes cost the two writes (the copy's finish can be a HOT update:
    it changes no indexed column). Reported: medians, ratios to the floor, and how many
    of each table's updates were HOT (``pg_stat_user_tables``).
    """
    import uuid
    from datetime import UTC, datetime

    import psycopg

    from .common import libpq_url

    prefix = new_prefix()
    bench = DuraflowBench.create(database_url, prefix)
    statements = bench.store._attempt_statements
    first, finish = statements["first"], statements["finish"]
    runs, bare = f"{prefix}runs", f"{prefix}runs_key_only"
    conn = psycopg.connect(libpq_url(database_url), autocommit=True)
    pgconn = conn.pgconn
    try:
        conn.execute(f'CREATE TABLE "{prefix}floor" (task_id varchar(255) PRIMARY KEY, '
                     "a integer NOT NULL, b text NOT NULL)")
        conn.execute(f'CREATE TABLE "{bare}" (LIKE "{runs}" INCLUDING DEFAULTS '
                     "INCLUDING CONSTRAINTS, PRIMARY KEY (task_id)) "
                     "WITH (fillfactor = 80)")
        pgconn.prepare(b"floor", f'INSERT INTO "{prefix}floor" VALUES ($1, 1, \'x\')'.encode())
        variants = {"floor": b"floor"}
        for table in (runs, bare):
            for label, prepared in (("start", first), ("finish", finish)):
                key = f"{label} {table}".encode()
                pgconn.prepare(key, prepared.raw_sql.replace(runs.encode(), table.encode()))
                variants[f"{label} {table}"] = key

        def text(value: object) -> bytes | None:
            return None if value is None else str(value).encode()

        def values(prepared: Any, given: dict[str, Any]) -> list[Any]:
            return [text(given.get(name, fixed)) for name, fixed in prepared.raw_params]

        times: dict[str, list[float]] = {name: [] for name in variants}
        for i in range(count + 100):
            task_id = f"anatomy-{uuid.uuid4()}"
            now = datetime.now(UTC).isoformat()
            start_params = {"p_task_id": task_id, "p_task_name": "bench.durable_steps",
                            "p_updated_at": now, "p_lease_owner": "anatomy-owner",
                            "p_lease_expires_at": now, "p_args": "[[0], {}]",
                            "p_args_fingerprint": "0" * 16, "p_exchange": "",
                            "p_routing_key": "celery", "p_retries": 0,
                            "interrupted": "f", "p_code_fingerprint": None}
            end_params = {"p_status": "succeeded", "p_result": "0", "p_serializer": "json",
                          "p_updated_at": now, "interrupted": "f", "p_task_id": task_id,
                          "p_owner": "anatomy-owner"}
            calls: list[tuple[str, list[Any]]] = [("floor", [text(task_id)])]
            for table in (runs, bare):
                calls.append((f"start {table}", values(first, start_params)))
                calls.append((f"finish {table}", values(finish, end_params)))
            for label, args in calls:
                began = time.perf_counter()
                result = pgconn.exec_prepared(variants[label], args)
                took = time.perf_counter() - began
                if result.status != psycopg.pq.ExecStatus.COMMAND_OK or (
                        result.command_tuples != 1):
                    raise RuntimeError(f"{label}: {result.error_message.decode()!r}")
                if i >= 100:  # the first hundred warm up
                    times[label].append(took)
        # This backend's counts reach pg_stat_user_tables once they are flushed (PostgreSQL
        # 15 flushes at most once a second unless asked to).
        if conn.info.server_version >= 150000:
            conn.execute("SELECT pg_stat_force_next_flush()")
            conn.execute("SELECT 1")
        hot = {table: conn.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                                   "WHERE relname = %s", (table,)).fetchone()
               for table in (runs, bare)}
    finally:
        conn.close()
        drop_prefixed_tables(bench.conninfo, prefix)
    floor = statistics.median(times["floor"])
    lines = [f"{count} empty attempts' statements on libpq (PQexecPrepared), taking turns "
             "with the floor INSERT (median ms, x floor):"]
    both: dict[str, float] = {}
    described = {runs: "the store's runs table", bare: "a copy with its primary key only"}
    for label, samples in times.items():
        median = statistics.median(samples)
        table = label.partition(" ")[2]
        if table:
            both[table] = both.get(table, 0.0) + median
        shown = label if not table else f"{label.partition(' ')[0]}, {described[table]}"
        lines.append(f"  {median * 1000:7.3f} ms {median / floor:5.2f}x  {shown}")
    for table, total in both.items():
        updates = hot[table]
        lines.append(f"  start + finish, {described[table]}: {total / floor:.2f}x the floor; "
                     f"HOT updates {updates[1] if updates else '?'} of "
                     f"{updates[0] if updates else '?'}")
    return "\n".join(lines)


def anatomy(database_url: str, count: int) -> str:
    """What makes a step row dearer than the floor INSERT, one feature at a time.

    Scratch tables shaped like the step store, written through a raw psycopg autocommit
    connection, one row per statement, each variant taking turns with the others, a new
    task id every 100 rows (as in runs of 100 steps). For each variant: the median time
    and the WAL the server wrote per row (``pg_current_wal_insert_lsn()`` before and after
    each batch of 100, read on a second connection):

    * floor: ``INSERT INTO t (a, b) VALUES (...)`` into a table with a bigserial key;
    * step row, surrogate key: the step store before schema version 5 (a bigserial ``id``,
      its sequence, and ``UNIQUE (task_id, step_key)``), with the fenced insert below;
    * step row, plain INSERT: the current table (primary key ``(task_id, step_key)``);
    * fenced INSERT, DO NOTHING: the statement the store sends for a new step, ``INSERT ...
      SELECT ... WHERE EXISTS (the run's lease) ON CONFLICT (task_id, step_key) DO NOTHING``.
    """
    import statistics
    import uuid

    import psycopg

    from .common import libpq_url

    prefix = new_prefix()
    runs, old, new = f"{prefix}aruns", f"{prefix}asteps_id", f"{prefix}asteps"
    columns = ("task_id varchar(255) NOT NULL, step_key varchar(1024) NOT NULL, "
               "status varchar(16) NOT NULL, attempts integer NOT NULL, output text, "
               "serializer varchar(100), error text, started_at timestamptz NOT NULL, "
               "completed_at timestamptz, position integer")
    conn = psycopg.connect(libpq_url(database_url), autocommit=True)
    lsn = psycopg.connect(libpq_url(database_url), autocommit=True)
    try:
        conn.execute(f"CREATE TABLE {prefix}floor (id bigserial PRIMARY KEY, a integer NOT "
                     "NULL, b text NOT NULL)")
        conn.execute(f"CREATE TABLE {runs} (task_id varchar(255) PRIMARY KEY, "
                     "lease_owner varchar(200))")
        conn.execute(f"CREATE TABLE {old} (id bigserial PRIMARY KEY, {columns}, "
                     "UNIQUE (task_id, step_key))")
        conn.execute(f"CREATE TABLE {new} ({columns}, PRIMARY KEY (task_id, step_key))")
        owner = "owner-1"
        values = ("%(t)s::varchar, %(k)s::varchar, 'completed', 1, %(o)s::text, 'json', NULL, "
                  "now(), now(), %(n)s::integer")
        names = ("task_id, step_key, status, attempts, output, serializer, error, started_at, "
                 "completed_at, position")
        fenced = (f"SELECT {values} WHERE EXISTS (SELECT 1 FROM {runs} "
                  "WHERE task_id = %(t)s::varchar AND lease_owner = %(lease)s)")
        do_nothing = " ON CONFLICT (task_id, step_key) DO NOTHING"
        variants = {
            "floor INSERT": f"INSERT INTO {prefix}floor (a, b) VALUES (%(n)s, 'x')",
            "step row, surrogate key + UNIQUE, fenced": (
                f"INSERT INTO {old} ({names}) {fenced}{do_nothing}"),
            "step row, plain INSERT": f"INSERT INTO {new} ({names}) VALUES ({values})",
            "fenced INSERT, DO NOTHING (the store's)": (
                f"INSERT INTO {new} ({names}) {fenced}{do_nothing}"),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        wal: dict[str, list[float]] = {name: [] for name in variants}
        batches = max(1, count // 100) + 1
        for batch in range(batches):
            task_id = f"anatomy-{uuid.uuid4()}"
            conn.execute(f"INSERT INTO {runs} VALUES (%s, %s)", (task_id, owner))
            for v, (name, sql) in enumerate(variants.items()):
                before = lsn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
                for i in range(100):
                    # A key of each variant's own: every variant inserts a new row.
                    params = {"t": task_id, "k": f"v{v}/step#{i}", "o": str(i),
                              "lease": owner, "n": i}
                    start = time.perf_counter()
                    conn.execute(sql, params)
                    if batch:  # the first batch warms up (and prepares) every statement
                        times[name].append(time.perf_counter() - start)
                row = lsn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)",
                                  (before[0] if before else None,)).fetchone()
                if batch and row:
                    wal[name].append(float(row[0]) / 100)
        floor = statistics.median(times["floor INSERT"])
        lines = [f"{len(times['floor INSERT'])} single-row autocommit writes each, taking turns "
                 "(median ms, x floor, WAL bytes per row):"]
        for name, values_ in times.items():
            median = statistics.median(values_)
            lines.append(f"  {median * 1000:7.3f} ms {median / floor:5.2f}x "
                         f"{statistics.median(wal[name]):6.0f} B  {name}")
        return "\n".join(lines)
    finally:
        for table in (new, old, runs, f"{prefix}floor"):
            conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.close()
        lsn.close()


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# Buckets for py-spy samples, first match wins: (label, [(function, file fragment)]).
# An empty function matches any function in the file.
_BUCKETS: list[tuple[str, list[tuple[str, str]]]] = [
    ("waiting on PostgreSQL (psycopg/libpq: send, server, receive)",
     [("wait", "psycopg/"), ("wait_c", "psycopg"), ("_wait", "psycopg"), ("", "psycopg_c"),
      ("", "psycopg_binary")]),
    ("connection per statement: checkout, autocommit option, return to pool",
     [("", "sqlalchemy/pool/"), ("connect", "sqlalchemy/engine/base.py"),
      ("execution_options", "sqlalchemy/engine/base.py"),
      ("close", "sqlalchemy/engine/base.py"), ("__exit__", "sqlalchemy/engine/base.py"),
      ("_on_checkout", "celery_duraflow/_store.py"),
      ("_write", "celery_duraflow/_store.py"), ("_read", "celery_duraflow/_store.py")]),
    ("SQLAlchemy execute: cache key, compiled cache, parameters, result rows",
     [("", "sqlalchemy/engine/"), ("", "sqlalchemy/dialects/")]),
    ("building the statement (SQLAlchemy Core expressions)",
     [("", "sqlalchemy/sql/"), ("", "sqlalchemy/util/"), ("", "<sqlalchemy generated")]),
    ("celery-duraflow's own code (context, keys, serialization, records)",
     [("", "celery_duraflow/"), ("", "kombu/utils/json")]),
    ("Celery apply and trace", [("", "celery/"), ("", "kombu/"), ("", "billiard/")]),
]


def summarize_collapsed(path: str) -> str:
    """Split py-spy's collapsed stacks into the buckets above (exclusive, by samples)."""
    import re

    frame_re = re.compile(r"^(?P<fn>[^ ]+) \((?P<file>[^:]*)(?::\d+)?\)$")
    totals: dict[str, int] = {}
    all_samples = 0
    with open(path) as stacks:
        for line in stacks:
            line = line.rstrip()
            if not line:
                continue
            stack, _, count_text = line.rpartition(" ")
            count = int(count_text)
            frames = []
            for raw in stack.split(";"):
                match = frame_re.match(raw.strip())
                frames.append((match["fn"], match["file"]) if match else (raw, ""))
            # Only the samples inside a run (not the setup, not the interpreter start).
            if not any(fn.split(".")[-1] == "run" and "benchmarks/common.py" in f
                       for fn, f in frames):
                continue
            all_samples += count
            label = "other (benchmark loop, interpreter)"
            for bucket, patterns in _BUCKETS:
                if any((not pfn or fn.split(".")[-1] == pfn) and frag in f
                       for fn, f in frames for pfn, frag in patterns):
                    label = bucket
                    break
            totals[label] = totals.get(label, 0) + count
    if not all_samples:
        return "no samples inside DuraflowBench.run (was it recorded with --idle?)"
    lines = [f"{all_samples} samples inside the runs:"]
    for label, count in sorted(totals.items(), key=lambda item: -item[1]):
        lines.append(f"  {count / all_samples:6.1%}  {label}")
    return "\n".join(lines)


# -- per attempt ---------------------------------------------------------------------------

# The store calls every attempt makes, in this order in the table; any other Store method
# that an attempt calls gets a row of its own after them.
_KEY_CALLS = ("begin_attempt", "record_step", "finish_run")


class StoreTimers:
    """Wall and CPU time of each public ``Store`` method, in this process and thread.

    Installed by replacing the methods on the class at runtime (the benchmark process
    only; :meth:`remove` puts them back). A store method called from another one counts
    in its caller's time only. With :attr:`keep_intervals`, the wall-clock interval
    (``time.time()``) of each call is kept too, to attribute libpq's round trips to it.
    """

    def __init__(self) -> None:
        from celery_duraflow._store import Store

        self.cls: Any = Store
        self.thread = threading.get_ident()
        self.keep_intervals = False
        self.calls: dict[str, list[float]] = {}  # name -> [count, wall, cpu]
        self.intervals: list[tuple[str, float, float]] = []
        self._local = threading.local()
        self._originals: dict[str, Any] = {}

    def install(self) -> StoreTimers:
        seen: set[str] = set()
        for klass in self.cls.__mro__:
            if klass is object:
                continue
            for name, attr in vars(klass).items():
                if name in seen:
                    continue
                seen.add(name)
                if name.startswith("_") or not inspect.isfunction(attr):
                    continue
                self._originals[name] = vars(self.cls).get(name, _ABSENT)
                setattr(self.cls, name, self._wrap(name, attr))
        return self

    def remove(self) -> None:
        for name, original in self._originals.items():
            if original is _ABSENT:
                delattr(self.cls, name)
            else:
                setattr(self.cls, name, original)
        self._originals.clear()

    def reset(self) -> None:
        self.calls = {}
        self.intervals = []

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        timers = self

        @functools.wraps(fn)
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            local = timers._local
            if getattr(local, "busy", False) or threading.get_ident() != timers.thread:
                return fn(*args, **kwargs)
            local.busy = True
            began = time.time()
            cpu = time.thread_time()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                wall = time.perf_counter() - start
                used = time.thread_time() - cpu
                local.busy = False
                entry = timers.calls.setdefault(name, [0.0, 0.0, 0.0])
                entry[0] += 1
                entry[1] += wall
                entry[2] += used
                if timers.keep_intervals:
                    timers.intervals.append((name, began, time.time()))

        return timed_call


_ABSENT = object()


def attempt_profile(bench: DuraflowBench, runs: dict[int, int],
                    traced: dict[int, int]) -> tuple[list[str], dict[str, Any]]:
    """Where one attempt's time goes, for each N in ``runs`` (0: the empty durable task).

    Untraced attempts, durable and plain taking turns, give the wall and CPU time of the
    whole attempt, of Celery's apply machinery (the plain task: same app, same work, no
    DurableTask) and of each Store call (wrapped, see :class:`StoreTimers`); medians over
    the attempts. Traced attempts (libpq's protocol trace with timestamps) then give the
    time spent waiting on PostgreSQL inside each Store call: a round trip belongs to the
    call whose interval holds its first message. Client time = wall - that wait.
    """
    from .common import RoundTrips, cpu_timed, timed, trace_intervals

    timers = StoreTimers().install()
    me = threading.get_ident()
    lines = [
        "Attempts applied in this process; durable and plain attempts take turns. Wall and "
        "CPU (time.thread_time()) per attempt, medians; every public Store method is "
        "wrapped at runtime (a nested Store call counts in its caller). Rest of the "
        "library = durable attempt - plain task - Store calls. Server wait: libpq trace "
        "timestamps of separate traced attempts, from a round trip's first message to its "
        "ReadyForQuery, attributed to the Store call it happened in; client = wall - wait.",
    ]
    data: dict[str, Any] = {}
    try:
        for n in runs:
            for _ in range(5):
                bench.run(n)
                bench.run_plain(n)
            attempts: list[dict[str, list[float]]] = []
            totals: list[tuple[float, float]] = []
            plain: list[tuple[float, float]] = []
            for _ in range(runs[n]):
                timers.reset()
                totals.append(cpu_timed(lambda n=n: bench.run(n)))  # type: ignore[misc]
                attempts.append(timers.calls)
                plain.append(cpu_timed(lambda n=n: bench.run_plain(n)))  # type: ignore[misc]
            waits: dict[str, float] = {}
            trips: dict[str, int] = {}
            # Wall time of the traced attempts: the whole attempt ("") and each Store call.
            traced_walls: dict[str, float] = {}
            whole_wait = 0.0
            timers.keep_intervals = True
            for _ in range(traced[n]):
                timers.reset()
                counter = RoundTrips(bench.engine, timed=True, keep=True)
                with counter.counting():
                    wall = timed(lambda n=n: bench.run(n))  # type: ignore[misc]
                traced_walls[""] = traced_walls.get("", 0.0) + wall
                for name, (_, call_wall, _) in timers.calls.items():
                    traced_walls[name] = traced_walls.get(name, 0.0) + call_wall
                for text in counter.traces[me]:
                    for first, last in trace_intervals(text):
                        owner = _owner(timers.intervals, first)
                        waits[owner] = waits.get(owner, 0.0) + last - first
                        trips[owner] = trips.get(owner, 0) + 1
                        whole_wait += last - first
            timers.keep_intervals = False
            lines += ["", *_attempt_table(n, attempts, totals, plain,
                                          Traced(traced[n], traced_walls, waits, trips))]
            data[str(n)] = {
                "attempts": len(totals),
                "durable_wall_s": statistics.median(w for w, _ in totals),
                "durable_cpu_s": statistics.median(c for _, c in totals),
                "plain_wall_s": statistics.median(w for w, _ in plain),
                "plain_cpu_s": statistics.median(c for _, c in plain),
                "store_calls": {name: {"calls": statistics.median(a.get(name, [0, 0, 0])[0]
                                                                  for a in attempts),
                                       "wall_s": statistics.median(a.get(name, [0, 0, 0])[1]
                                                                   for a in attempts),
                                       "cpu_s": statistics.median(a.get(name, [0, 0, 0])[2]
                                                                  for a in attempts),
                                       "server_wait_s": waits.get(name, 0.0) / traced[n],
                                       "round_trips": trips.get(name, 0) / traced[n]}
                                for name in sorted({k for a in attempts for k in a})},
                "server_wait_s": whole_wait / traced[n],
            }
    finally:
        timers.remove()
    return lines, data


@dataclass
class Traced:
    """What the traced attempts of one N measured, summed over them."""

    attempts: int
    walls: dict[str, float]  # "" is the whole attempt; else a Store method's name
    waits: dict[str, float]  # server wait per Store method, or "outside Store calls"
    trips: dict[str, int]

    def wait(self, name: str) -> float:
        return self.waits.get(name, 0.0) / self.attempts

    def client(self, name: str) -> float:
        return self.walls.get(name, 0.0) / self.attempts - self.wait(name)

    def round_trips(self, name: str) -> float:
        return self.trips.get(name, 0) / self.attempts


_OUTSIDE = "outside Store calls"


def _owner(intervals: list[tuple[str, float, float]], moment: float) -> str:
    """The Store call whose interval holds ``moment``; else the one within 50 us of it."""
    for name, began, ended in intervals:
        if began <= moment <= ended:
            return name
    near = [(min(abs(moment - began), abs(moment - ended)), name)
            for name, began, ended in intervals]
    distance, name = min(near, default=(1.0, _OUTSIDE))
    return name if distance <= 50e-6 else _OUTSIDE


def _attempt_table(n: int, attempts: list[dict[str, list[float]]],
                   totals: list[tuple[float, float]], plain: list[tuple[float, float]],
                   traced: Traced) -> list[str]:
    median = statistics.median
    names = [k for k in _KEY_CALLS if any(k in a for a in attempts)]
    names += sorted({k for a in attempts for k in a} - set(names))

    def part(name: str, index: int) -> float:
        return median(a.get(name, [0.0, 0.0, 0.0])[index] for a in attempts)

    plain_wall = median(w for w, _ in plain)
    plain_cpu = median(c for _, c in plain)
    rest_wall = median(w - sum(v[1] for v in a.values()) - plain_wall
                       for (w, _), a in zip(totals, attempts, strict=True))
    rest_cpu = median(c - sum(v[2] for v in a.values()) - plain_cpu
                      for (_, c), a in zip(totals, attempts, strict=True))
    whole_wait = sum(traced.waits.values()) / traced.attempts
    whole_trips = sum(traced.trips.values()) / traced.attempts
    traced_rest = (traced.walls.get("", 0.0)
                   - sum(v for k, v in traced.walls.items() if k)) / traced.attempts

    def row(label: str, calls: object, wall: float, cpu: float, wait: float, client: float,
            rts: float) -> list[object]:
        return [label, calls, _ms(wall), _ms(cpu), _ms(wait), _ms(client), f"{rts:g}"]

    rows = [row("durable attempt, total (Task.apply)", 1, median(w for w, _ in totals),
                median(c for _, c in totals), whole_wait,
                traced.walls.get("", 0.0) / traced.attempts - whole_wait, whole_trips),
            row("Celery apply machinery (the plain task)", 1, plain_wall, plain_cpu, 0.0,
                plain_wall, 0)]
    for name in names:
        calls = part(name, 0)
        wall = part(name, 1)
        label = f"Store.{name}"
        if name == "record_step" and calls:
            label += f" ({wall / calls * 1000:.3f} ms per step)"
        rows.append(row(label, f"{calls:g}", wall, part(name, 2), traced.wait(name),
                        traced.client(name), traced.round_trips(name)))
    rows.append(row("rest of the library (total - plain - Store calls)", "-", rest_wall,
                    rest_cpu, traced.wait(_OUTSIDE),
                    traced_rest - plain_wall - traced.wait(_OUTSIDE),
                    traced.round_trips(_OUTSIDE)))
    title = "empty durable task (no step)" if n == 0 else f"durable task of {n} steps"
    return [f"{title}: {len(totals)} attempts untraced (wall, CPU: medians), "
            f"{traced.attempts} traced (server wait, client: means)",
            "",
            _table(["part", "calls", "wall ms", "CPU ms", "server wait ms", "client ms",
                    "round trips"], rows)]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f}"


def _table(headers: Sequence[str], rows: list[list[object]]) -> str:
    from .common import table

    return table(headers, rows)


def attempt_tree(bench: DuraflowBench, runs: dict[int, int], interval: float) -> str:
    """pyinstrument call trees of the attempts (one profile per N), or why not."""
    try:
        from pyinstrument import Profiler
    except ImportError:
        return "pyinstrument is not installed: pip install -e '.[bench]'"
    out = []
    for n, count in runs.items():
        for _ in range(5):
            bench.run(n)
        profiler = Profiler(interval=interval)
        profiler.start()
        for _ in range(count):
            bench.run(n)
        profiler.stop()
        out.append(f"# pyinstrument, {count} attempts of {n} steps (divide by {count} for one)")
        out.append(profiler.output_text(unicode=True, color=False))
    return "\n".join(out)


def _attempt_main(database_url: str, runs: int, tree: bool, interval: float) -> int:
    prefix = new_prefix()
    bench = DuraflowBench.create(database_url, prefix)
    try:
        sizes = {0: runs, 10: max(1, runs // 3)}
        lines, _ = attempt_profile(bench, sizes, {n: max(1, c // 5) for n, c in sizes.items()})
        print("\n".join(lines))
        if tree:
            print()
            print(attempt_tree(bench, {n: max(1, c // 2) for n, c in sizes.items()}, interval))
    finally:
        bench.close()
        bench.engine.dispose()
        drop_prefixed_tables(bench.conninfo, prefix)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
