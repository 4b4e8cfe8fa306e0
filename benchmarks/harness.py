"""The benchmark harness: ``python -m benchmarks [--quick] [--only NAMES] [--profile]``.

Benchmarks (``--only`` takes a comma-separated list of these names):

``fresh``
    Runs of N trivial steps (N = 1, 10, 100) applied in this process with a new task id
    each time, minus the same task with no step, per step, against a raw psycopg
    autocommit INSERT of one row (the floor) timed in the same rounds. In the same rounds,
    the empty durable task against a plain task of the same app (Celery's own apply):
    the attempt's fixed cost in wall and CPU time; and the statements of an empty run
    (length and parameters, against psycopg's conversion cache limits).
``replay``
    The same runs re-executed with every step completed (the run row set back to
    ``running``, as if the worker died after the last step): time, CPU, per-step cost, and
    the SQL round trips of one replay; and the re-delivery of a run that already succeeded.
``sqlite``
    The durable task on an SQLite store (a temporary file): per-step cost against a raw
    ``BEGIN IMMEDIATE; INSERT; COMMIT`` with the library's settings, and the statements
    and transactions SQLite runs for an empty and a 10-step run.
``wal``
    WAL bytes per durable 10-step task against the same run's twelve commits written by
    hand, batches after a CHECKPOINT, with ``pg_waldump --stats=record`` of one batch each.
``dbos``
    The same N-step workflow in DBOS Transact on the same server, fresh and replayed,
    taking turns with celery-duraflow and the floor in the same rounds.
``e2e``
    Tasks of 10 trivial steps through Redis and through RabbitMQ to a ``celery worker``
    (prefork, 2 processes): plain tasks, plain tasks writing the same twelve commits by
    hand, and DurableTask runs; throughput of each and the ratios.
``memory``
    The RSS of a prefork worker process before and after 10,000 durable runs (and, as a
    baseline, 10,000 plain tasks in the same process first).
``atomic``
    An atomic step whose body writes one row in the step's transaction against a plain
    step whose body writes the same row on its own autocommit connection, per step and
    as a ratio, on PostgreSQL and on SQLite (:mod:`benchmarks.atomic`).
``scale``
    The hot path and the operator side (listings, footer counts, prune, patch, the sweep)
    on empty tables and again after a bulk fill of a million runs and ten million steps,
    as ratios big / empty; a real prune in batches (:mod:`benchmarks.scale`).
``telemetry``
    The same N-step task with OpenTelemetry off, on without an SDK and on with the SDK
    (in-memory exporter), fresh and replayed, the modes taking turns in the same rounds;
    per step and as ratios to off (:mod:`benchmarks.telemetry`).
``flow``
    Durable tasks of a few trivial steps (and of the same steps, one sleeping 10 ms)
    through Redis and through RabbitMQ to a ``celery worker`` (prefork, 4 processes): no
    limit, ``Concurrency(2, key=...)`` over 64 keys and ``Concurrency(8)`` on one key
    (neither binds), and a limit that binds (one key, limit 2), taking turns; throughput
    and the ratios to no limit. In this process: what the limit adds to an attempt in
    time, statements, round trips and transactions, and each Store call's share
    (:mod:`benchmarks.flow`).
``fleet``
    Tasks of 10 trivial steps through Redis to one ``celery worker`` with 1, 2, 4 and 8
    prefork processes: the same commits written by hand, and DurableTask runs; throughput
    at each size and the ratio, with the write transactions per run and the share of
    backends waiting on locks (:mod:`benchmarks.fleet`).

``parallel``
    One run of a single 50 ms I/O step against runs of ten of them at once: with
    ``aparallel()``, with ``asyncio.gather`` of steps created first, and with
    ``parallel()`` in threads; the time of each over the single step's
    (:mod:`benchmarks.parallel`).

``--profile`` adds the per-attempt profile of :func:`benchmarks.profile.attempt_profile`
(Celery's apply, each Store call, the rest of the library).

Every benchmark ends with the targets of the performance issues, printed as met or NOT met.
Progress goes to stderr; results go to stdout (and to ``--json FILE``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import psycopg

from . import workload
from .common import (
    DURABLE_TASK_NAME,
    HANDWRITTEN_TASK_NAME,
    PLAIN_TASK_NAME,
    RSS_TASK_NAME,
    DuraflowBench,
    ExecutedStatement,
    Floor,
    RoundTrips,
    Samples,
    SentStatement,
    SqliteFloor,
    SqliteStatements,
    count_round_trips,
    cpu_timed,
    default_broker_url,
    default_database_url,
    default_rabbitmq_url,
    drop_prefixed_tables,
    interleaved,
    libpq_url,
    log,
    ms,
    new_prefix,
    psycopg_statements,
    ratio,
    sqlite_settings,
    table,
    telemetry_off,
    timed,
    trace_statements,
)
from .workload import HandWritten

BENCHMARKS = ("fresh", "replay", "sqlite", "wal", "dbos", "e2e", "memory", "atomic",
              "telemetry", "scale", "flow", "fleet", "parallel")
# The targets of the commit floor (issue 33): the empty task's fixed cost and a fresh step
# over one durable commit, and durable over hand-written throughput end to end.
EMPTY_LIMIT = 2.0
FRESH_LIMIT = 1.15
E2E_LIMIT = 1.0
# The floor INSERT is timed in bursts of this many back to back (its best case).
FLOOR_BURST = 20
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Sizes:
    """How much of everything one mode measures."""

    steps: tuple[int, ...]
    warmup: int
    # fresh: runs per round for each N (0 is the empty durable task), floor INSERTs per round
    fresh_rounds: int
    fresh_runs: dict[int, int]
    floor_per_round: int
    # replay
    replay_rounds: int
    replay_runs: dict[int, int]
    # dbos (each of DBOS and celery-duraflow), forks per N for the DBOS replay
    dbos_rounds: int
    dbos_runs: dict[int, int]
    dbos_forks: int
    dbos_fork_steps: tuple[int, ...]
    # sqlite: rounds, runs per round for each N (0 is the empty task), floor commits per round
    sqlite_rounds: int
    sqlite_runs: dict[int, int]
    sqlite_floor_per_round: int
    # wal: batches of each variant, tasks per batch, steps per task
    wal_batches: int
    wal_tasks: int
    wal_steps: int
    # e2e
    e2e_tasks: int
    e2e_steps: int
    e2e_rounds: int
    e2e_warmup: int
    # memory
    memory_runs: int
    memory_steps: int
    memory_warmup: int
    memory_samples: int
    # --profile: attempts per N (untraced, and traced for the waits on the server)
    profile_runs: dict[int, int]
    profile_traced: dict[int, int]
    # atomic: rounds, runs of each variant per round, steps per task
    atomic_rounds: int = 5
    atomic_runs: int = 20
    atomic_steps: int = 10
    # telemetry: rounds, runs of each mode per round and kind, steps per task
    telemetry_rounds: int = 10
    telemetry_runs: int = 50
    telemetry_steps: int = 10
    # flow: tasks per round of each variant and work, rounds, warm-up tasks of each; in
    # this process: attempts of each per round, rounds, traced attempts of each
    flow_tasks: int = 1000
    flow_rounds: int = 3
    flow_warmup: int = 50
    flow_runs: int = 100
    flow_local_rounds: int = 5
    flow_traced: int = 30
    # fleet: tasks per round of each kind at each size, rounds, warm-up tasks, steps per task
    fleet_tasks: int = 500
    fleet_rounds: int = 3
    fleet_warmup: int = 20
    fleet_steps: int = 10
    fleet_processes: tuple[int, ...] = (1, 2, 4, 8)
    # parallel: rounds of each kind of run (after one warm-up round)
    parallel_rounds: int = 20


FULL = Sizes(
    steps=(1, 10, 100), warmup=5,
    fresh_rounds=5, fresh_runs={0: 100, 1: 100, 10: 40, 100: 6}, floor_per_round=400,
    replay_rounds=5, replay_runs={0: 60, 1: 60, 10: 40, 100: 20},
    dbos_rounds=5, dbos_runs={0: 40, 1: 40, 10: 20, 100: 4}, dbos_forks=5,
    dbos_fork_steps=(1, 10, 100),
    sqlite_rounds=5, sqlite_runs={0: 100, 10: 30, 100: 4}, sqlite_floor_per_round=400,
    wal_batches=5, wal_tasks=200, wal_steps=10,
    e2e_tasks=1000, e2e_steps=10, e2e_rounds=3, e2e_warmup=50,
    memory_runs=10_000, memory_steps=10, memory_warmup=500, memory_samples=5,
    profile_runs={0: 300, 10: 100}, profile_traced={0: 50, 10: 20},
)
QUICK = Sizes(
    steps=(1, 10, 100), warmup=1,
    fresh_rounds=2, fresh_runs={0: 5, 1: 5, 10: 3, 100: 1}, floor_per_round=50,
    replay_rounds=2, replay_runs={0: 3, 1: 3, 10: 3, 100: 2},
    dbos_rounds=1, dbos_runs={0: 2, 1: 2, 10: 2, 100: 1}, dbos_forks=1,
    dbos_fork_steps=(100,),
    sqlite_rounds=2, sqlite_runs={0: 5, 10: 3, 100: 1}, sqlite_floor_per_round=40,
    wal_batches=2, wal_tasks=5, wal_steps=10,
    e2e_tasks=20, e2e_steps=10, e2e_rounds=1, e2e_warmup=4,
    memory_runs=50, memory_steps=10, memory_warmup=10, memory_samples=2,
    profile_runs={0: 5, 10: 3}, profile_traced={0: 3, 10: 2},
    atomic_rounds=1, atomic_runs=2, atomic_steps=3,
    telemetry_rounds=1, telemetry_runs=2, telemetry_steps=3,
    flow_tasks=12, flow_rounds=1, flow_warmup=4, flow_runs=3, flow_local_rounds=1,
    flow_traced=2,
    fleet_tasks=10, fleet_rounds=1, fleet_warmup=2, fleet_processes=(1, 2),
    parallel_rounds=2,
)


@dataclass
class Target:
    """One target of issue 4 and what this run measured for it."""

    title: str
    limit: str
    measured: str = "-"
    status: str = "not run"  # "met", "NOT met", "skipped", "error", "not run"
    note: str = ""


@dataclass
class Harness:
    database_url: str
    broker_url: str
    sizes: Sizes
    prefix: str
    results: dict[str, Any] = field(default_factory=dict)
    rabbitmq_url: str = ""
    profile: bool = False
    targets: dict[str, Target] = field(default_factory=lambda: {
        "empty": Target("empty durable task: fixed cost of an attempt (durable - plain) / "
                        "raw durable commit", f"<= {EMPTY_LIMIT}x"),
        "empty_cpu": Target("empty durable task: client CPU per attempt beyond a plain task",
                            "< 0.5 ms"),
        "statements": Target("each statement of start and finish <= 4096 chars "
                             "(psycopg's conversion cache)", "<= 4096"),
        "fresh": Target("fresh step overhead / raw durable commit (worst N)",
                        f"<= {FRESH_LIMIT}x"),
        "replay": Target("round trips to replay a run of 100 completed steps", "<= 2"),
        "replay_cpu": Target("client CPU per replayed step, 100-step replay", "< 30 us"),
        "sqlite": Target("SQLite fresh step overhead / raw BEGIN IMMEDIATE+INSERT+COMMIT "
                         "(worst N)", "<= 3x"),
        "sqlite_tx": Target("SQLite transactions per fresh step", "1"),
        "wal": Target("WAL bytes per durable 10-step task / hand-written twelve commits",
                      "<= 1.5x"),
        "dbos": Target("DBOS per-step overhead / celery-duraflow's (worst N)", ">= 4x"),
        "e2e_redis": Target("e2e throughput durable / hand-written twelve commits (Redis)",
                            f">= {E2E_LIMIT}x"),
        "e2e_rabbitmq": Target("e2e throughput durable / hand-written twelve commits "
                               "(RabbitMQ)", f">= {E2E_LIMIT}x"),
        "memory": Target("worker RSS growth over 10,000 durable runs", "< 20 MB"),
        "scale": Target("large tables: each operation on 1M runs / on empty tables (worst)",
                        "<= 2x"),
        "flow_redis": Target("flow: throughput with Concurrency(2, key) not binding / no "
                             "limit, 3 trivial steps, 4 processes (Redis)", ">= 0.8x"),
        "flow_rabbitmq": Target("flow: throughput with Concurrency(2, key) not binding / no "
                                "limit, 3 trivial steps, 4 processes (RabbitMQ)", ">= 0.8x"),
        "fleet": Target("fleet: durable / hand-written throughput at 1, 2, 4 and 8 prefork "
                        "processes (worst)", ">= 0.9x"),
        "parallel": Target("parallel: ten concurrent 50 ms I/O steps / one such step "
                           "(worst of aparallel, gather, parallel)", "< 2.0x"),
    })
    errors: list[str] = field(default_factory=list)
    _duraflow: DuraflowBench | None = None

    @property
    def conninfo(self) -> str:
        return libpq_url(self.database_url)

    @property
    def duraflow(self) -> DuraflowBench:
        if self._duraflow is None:
            self._duraflow = DuraflowBench.create(self.database_url, self.prefix)
        return self._duraflow

    # -- output -----------------------------------------------------------------------------

    @staticmethod
    def out(text: str = "") -> None:
        print(text, flush=True)

    def section(self, title: str, lines: Sequence[str] = ()) -> None:
        self.out()
        self.out(f"## {title}")
        self.out()
        for line in lines:
            self.out(line)

    # -- fresh ------------------------------------------------------------------------------

    def bench_fresh(self) -> None:
        s = self.sizes
        df = self.duraflow
        floor = Floor(self.conninfo, f"{self.prefix}floor")
        try:
            variants: dict[str, Callable[[], object]] = {"floor": floor.insert}
            per_round = {"floor": s.floor_per_round}
            for n in (0, *s.steps):
                variants[f"n={n}"] = _bind(df.run, n)
                per_round[f"n={n}"] = s.fresh_runs[n]
            # Celery's Task.apply() by itself: the same app, the same (empty) work.
            variants["plain"] = _bind(df.run_plain, 0)
            per_round["plain"] = s.fresh_runs[0]
            log(f"fresh: {s.fresh_rounds} rounds of {per_round}")
            cpu: dict[str, Samples] = {}
            samples = interleaved(variants, per_round, s.fresh_rounds, s.warmup,
                                  bursts={"floor": FLOOR_BURST}, cpu=cpu)
            counts = {n: count_round_trips(df.engine, _bind(df.run, n)) for n in (0, *s.steps)}
            executed, sent = _statements_of(df, 0)
            sync = floor.synchronous_commit
        finally:
            floor.close()

        floor_s = samples["floor"]
        empty = samples["n=0"]
        rows: list[list[object]] = []
        data: list[dict[str, Any]] = []
        worst: float | None = None
        worst_n = 0
        for n in (0, *s.steps):
            run = samples[f"n={n}"]
            statements, wire = counts[n]
            if n == 0:
                per_step = per_step_min = factor = None
            else:
                per_step = (run.median - empty.median) / n
                per_step_min = (run.minimum - empty.minimum) / n
                factor = per_step / floor_s.median
                if worst is None or factor > worst:
                    worst, worst_n = factor, n
            rows.append([n if n else "0 (empty task)", len(run), ms(run.median), ms(run.minimum),
                         ms(per_step), ms(per_step_min), ratio(factor), statements,
                         _opt(wire)])
            data.append({"steps": n, "runs": len(run), "run_median_s": run.median,
                         "run_min_s": run.minimum, "per_step_s": per_step,
                         "per_step_min_s": per_step_min, "floor_ratio": factor,
                         "statements": statements, "round_trips": wire,
                         "cpu_median_s": cpu[f"n={n}"].median})
        self.section("Fresh step overhead", [
            f"Floor: one raw psycopg 3 autocommit INSERT of one row (synchronous_commit="
            f"{sync}): median {ms(floor_s.median)} ms, mean {ms(floor_s.mean)} ms, "
            f"min {ms(floor_s.minimum)} ms over {len(floor_s)} INSERTs, taking turns with "
            "the runs below.",
            "Runs: Task.apply() in this process, a new task id each time. Per-step overhead "
            "= (run - empty run) / N, from the medians (and from the minimums). Round trips: "
            "ReadyForQuery messages in libpq's trace of one run (SQLAlchemy statements: its "
            "before_cursor_execute events, which miss whatever goes to the driver directly).",
            "",
            table(["steps", "runs", "run median ms", "run min ms", "per step ms",
                   "per step (min) ms", "x floor", "SQLAlchemy statements/run",
                   "round trips/run"],
                  rows),
        ])
        self.results["fresh"] = {"floor_median_s": floor_s.median, "floor_mean_s": floor_s.mean,
                                 "floor_min_s": floor_s.minimum, "floor_count": len(floor_s),
                                 "synchronous_commit": sync, "rows": data}
        target = self.targets["fresh"]
        if worst is not None:
            target.measured = f"{worst:.2f}x"
            target.status = "met" if worst <= FRESH_LIMIT else "NOT met"
            target.note = f"N={worst_n}; floor {ms(floor_s.median)} ms per commit"
        self._report_empty(samples, cpu, executed, sent)

    def _report_empty(self, samples: dict[str, Samples], cpu: dict[str, Samples],
                      executed: list[ExecutedStatement], sent: list[SentStatement]) -> None:
        """The empty durable task against the plain task and the floor (same rounds)."""
        floor, durable, plain = samples["floor"], samples["n=0"], samples["plain"]
        d_cpu, p_cpu = cpu["n=0"], cpu["plain"]
        fixed = durable.median - plain.median
        fixed_cpu = d_cpu.median - p_cpu.median
        rows: list[list[object]] = [
            ["empty durable task (start + finish of an attempt)", len(durable),
             ms(durable.median), ms(durable.minimum), ratio(durable.median / floor.median),
             ms(d_cpu.median)],
            ["plain task, same app and body (Celery's Task.apply())", len(plain),
             ms(plain.median), ms(plain.minimum), ratio(plain.median / floor.median),
             ms(p_cpu.median)],
            ["difference: the attempt's fixed cost", "-", ms(fixed),
             ms(durable.minimum - plain.minimum), ratio(fixed / floor.median), ms(fixed_cpu)],
            ["floor: one raw autocommit INSERT", len(floor), ms(floor.median),
             ms(floor.minimum), "1.00x", "-"],
        ]
        longest = max(executed, key=lambda e: e.chars, default=None)
        longest_sent = max(sent, key=lambda e: e.chars, default=None)
        statement_rows = [[i + 1, e.path, e.chars, e.params, _clip(e.text, 80)]
                          for i, e in enumerate(executed)]
        lines = [
            "The empty durable task (durable_steps(0): no step) and a plain task with the "
            "same (empty) work registered on the same app without base=DurableTask, applied "
            "in this process, taking turns with the floor and the runs above in the same "
            "rounds. Medians; CPU = time.thread_time() of this thread around each apply "
            "(the eager task runs in it). The difference is what starting and finishing an "
            "attempt costs beyond Celery's own apply machinery.",
            "",
            table(["task", "runs", "median ms", "min ms", "x floor", "CPU median ms"], rows),
            "",
            "Statements of one empty durable run, as psycopg's Cursor.execute received them "
            "(path psycopg: chars = the encoded query with its %(name)s placeholders, which "
            "psycopg compares with MAX_CACHED_STATEMENT_LENGTH = 4096; params = the "
            "parameters passed, compared with MAX_CACHED_STATEMENT_PARAMS = 50) or as the "
            "store ran them on libpq directly (path libpq: prepared on the connection once, "
            "then PQexecPrepared, which psycopg does not convert at all):",
            "",
            table(["#", "path", "chars", "params", "statement"], statement_rows)
            if statement_rows else "(none seen: the library did not go through "
                                   "psycopg.Cursor.execute)",
            "",
            "Longest as psycopg received it: "
            + (f"{longest.chars} chars with {longest.params} parameters."
               if longest else "-"),
            f"On the wire (Parse/Query messages of libpq's trace of the same run, $n "
            f"placeholders): {len(sent)} statement texts; the longest "
            + (f"{longest_sent.chars} chars with {longest_sent.params} parameters."
               if longest_sent else "none (prepared statements are sent without their text)."),
        ]
        self.section("Empty durable task", lines)
        self.results["empty"] = {
            "durable_median_s": durable.median, "plain_median_s": plain.median,
            "fixed_cost_s": fixed, "fixed_cost_floor_ratio": fixed / floor.median,
            "durable_floor_ratio": durable.median / floor.median,
            "durable_cpu_s": d_cpu.median, "plain_cpu_s": p_cpu.median,
            "fixed_cpu_s": fixed_cpu,
            "statements": [asdict(e) for e in executed],
            "wire_statements": [{"chars": e.chars, "params": e.params} for e in sent],
        }
        target = self.targets["empty"]
        factor = fixed / floor.median
        target.measured = f"{factor:.2f}x"
        target.status = "met" if factor <= EMPTY_LIMIT else "NOT met"
        target.note = (f"raw durable/floor {durable.median / floor.median:.2f}x; "
                       f"{ms(fixed)} ms fixed cost")
        target = self.targets["empty_cpu"]
        target.measured = f"{ms(fixed_cpu)} ms"
        target.status = "met" if fixed_cpu < 0.5e-3 else "NOT met"
        target.note = f"durable {ms(d_cpu.median)} ms - plain {ms(p_cpu.median)} ms"
        target = self.targets["statements"]
        source = ([(e.chars, e.params) for e in executed]
                  or [(e.chars, e.params) for e in sent])
        if source:
            chars, params = max(source)
            target.measured = f"{chars} chars"
            target.status = "met" if chars <= 4096 else "NOT met"
            target.note = (f"{params} params; "
                           + ("as the library sends it" if executed else "wire text")
                           + (f"; wire {longest_sent.chars} chars" if longest_sent and executed
                              else ""))
        else:
            target.status = "error"
            target.note = "no statement seen"

    # -- replay -----------------------------------------------------------------------------

    def bench_replay(self) -> None:
        s = self.sizes
        df = self.duraflow
        sizes = (0, *s.steps)
        ids = {n: df.run(n) for n in sizes}
        largest = max(s.steps)

        body = {n: Samples() for n in sizes}
        cpu = {n: Samples() for n in sizes}

        def resume(n: int) -> float:
            df.reset_to_running(ids[n])
            seconds, used = cpu_timed(_bind(df.run, n, ids[n], 1))
            body[n].add(workload.LAST_BODY[0])
            cpu[n].add(used)
            return seconds

        bodies = workload.BODIES_RUN[0]
        for n in sizes:
            for _ in range(s.warmup):
                resume(n)
        samples = {n: Samples() for n in sizes}
        # Drop the warm-up's (resume() sees these).
        body.update({n: Samples() for n in sizes})
        cpu.update({n: Samples() for n in sizes})
        short = Samples()
        log(f"replay: {s.replay_rounds} rounds of {s.replay_runs}")
        for _ in range(s.replay_rounds):
            for n in sizes:
                for _ in range(s.replay_runs[n]):
                    samples[n].add(resume(n))
            # A run that already succeeded, delivered again: the recorded result at once.
            for _ in range(s.replay_runs[0]):
                short.add(timed(_bind(df.run, largest, ids[largest], 1)))
        counts = {}
        for n in sizes:
            df.reset_to_running(ids[n])
            counts[n] = count_round_trips(df.engine, _bind(df.run, n, ids[n], 1))
        short_counts = count_round_trips(df.engine, _bind(df.run, largest, ids[largest], 1))
        # The same message sent twice (the first-delivery shape): the start's insert
        # first, then the general statement.
        duplicate_counts = count_round_trips(df.engine, _bind(df.run, largest, ids[largest]))
        if workload.BODIES_RUN[0] != bodies:
            raise RuntimeError(f"replays ran {workload.BODIES_RUN[0] - bodies} step bodies "
                               "again: the steps were not answered from the store")

        rows: list[list[object]] = []
        data: list[dict[str, Any]] = []
        for n in sizes:
            run = samples[n]
            statements, wire = counts[n]
            per_step = None if n == 0 else (run.median - samples[0].median) / n
            in_body = None if n == 0 else body[n].median / n
            cpu_step = None if n == 0 else (cpu[n].median - cpu[0].median) / n
            rows.append([f"resume, {n} completed steps", len(run), ms(run.median),
                         ms(run.minimum), _us(per_step), _us(in_body), ms(cpu[n].median),
                         _us(cpu_step), statements, _opt(wire)])
            data.append({"kind": "resume", "steps": n, "runs": len(run),
                         "median_s": run.median, "min_s": run.minimum, "per_step_s": per_step,
                         "body_per_step_s": in_body, "cpu_median_s": cpu[n].median,
                         "cpu_per_step_s": cpu_step, "statements": statements,
                         "round_trips": wire})
        rows.append([f"succeeded run delivered again ({largest} steps)", len(short),
                     ms(short.median), ms(short.minimum), "-", "-", "-", "-", short_counts[0],
                     _opt(short_counts[1])])
        data.append({"kind": "succeeded", "steps": largest, "runs": len(short),
                     "median_s": short.median, "min_s": short.minimum,
                     "statements": short_counts[0], "round_trips": short_counts[1]})
        rows.append([f"succeeded run, the same message sent twice ({largest} steps)", "-",
                     "-", "-", "-", "-", "-", "-", duplicate_counts[0],
                     _opt(duplicate_counts[1])])
        data.append({"kind": "duplicate", "steps": largest, "statements": duplicate_counts[0],
                     "round_trips": duplicate_counts[1]})
        statements, wire = counts[largest]
        self.section("Replay", [
            "Resume: the run row set back to 'running' (the worker died after the last step), "
            "then the same task id applied again as a retry (retries=1; a redelivery that the "
            "broker flags, as RabbitMQ and kombu's Redis transport do, takes the same path); "
            "every step is answered from the store and "
            "no step body runs (checked). Per step = (replay - empty replay) / N, medians; "
            "in body = the task body's own time (first line to last) / N, median; CPU = "
            "time.thread_time() of this thread around the apply, median, and per step "
            "(CPU of the replay - CPU of the empty replay) / N.",
            "Round trips: statements = SQLAlchemy before_cursor_execute events; round trips = "
            "ReadyForQuery messages in libpq's trace of the same connections (one per wait "
            "on the server).",
            "",
            table(["replay", "runs", "median ms", "min ms", "per step us",
                   "per step in body us", "CPU median ms", "CPU per step us",
                   "SQLAlchemy statements", "round trips"], rows),
        ])
        self.results["replay"] = {"rows": data}
        target = self.targets["replay"]
        measured = wire if wire is not None else statements
        target.measured = f"{measured} ({statements} via SQLAlchemy)"
        target.status = "met" if measured <= 2 else "NOT met"
        if largest != 100:
            target.note = f"measured with {largest} steps"
        target = self.targets["replay_cpu"]
        cpu_step = (cpu[largest].median - cpu[0].median) / largest
        target.measured = f"{cpu_step * 1e6:.1f} us"
        target.status = "met" if cpu_step < 30e-6 else "NOT met"
        target.note = (f"({ms(cpu[largest].median)} - {ms(cpu[0].median)} ms) / {largest}, "
                       "thread CPU, medians")

    # -- sqlite -----------------------------------------------------------------------------

    def bench_sqlite(self) -> None:
        s = self.sizes
        target = self.targets["sqlite"]
        directory = tempfile.mkdtemp(prefix="duraflow-bench-sqlite-")
        store_path = os.path.join(directory, "store.db")
        sq = DuraflowBench.create(f"sqlite:///{store_path}", self.prefix)
        floor = SqliteFloor(os.path.join(directory, "floor.db"))
        sizes = tuple(sorted(s.sqlite_runs))
        steps = tuple(n for n in sizes if n)
        try:
            with sq.engine.connect() as conn:
                library_settings = sqlite_settings(conn.connection.driver_connection)
            variants: dict[str, Callable[[], object]] = {"floor": floor.insert}
            per_round = {"floor": s.sqlite_floor_per_round}
            for n in sizes:
                variants[f"n={n}"] = _bind(sq.run, n)
                per_round[f"n={n}"] = s.sqlite_runs[n]
            log(f"sqlite: {s.sqlite_rounds} rounds of {per_round}")
            samples = interleaved(variants, per_round, s.sqlite_rounds, s.warmup,
                                  bursts={"floor": FLOOR_BURST})
            traced: dict[int, SqliteStatements] = {}
            for n in (0, 10):
                traced[n] = SqliteStatements(sq.engine)
                with traced[n].counting():
                    sq.run(n)
        finally:
            floor.close()
            sq.close()
            sq.engine.dispose()
            shutil.rmtree(directory, ignore_errors=True)

        floor_s = samples["floor"]
        empty = samples["n=0"]
        rows: list[list[object]] = []
        data: list[dict[str, Any]] = []
        worst: float | None = None
        worst_n = 0
        for n in sizes:
            run = samples[f"n={n}"]
            per_step = factor = None
            if n:
                per_step = (run.median - empty.median) / n
                factor = per_step / floor_s.median
                if worst is None or factor > worst:
                    worst, worst_n = factor, n
            rows.append([n if n else "0 (empty task)", len(run), ms(run.median),
                         ms(run.minimum), ms(per_step), ratio(factor)])
            data.append({"steps": n, "runs": len(run), "run_median_s": run.median,
                         "per_step_s": per_step, "floor_ratio": factor})
        begins = {n: t.count("BEGIN") for n, t in traced.items()}
        commits = {n: t.count("COMMIT") for n, t in traced.items()}
        per_step_tx = (begins[10] - begins[0]) / 10
        empty_rows = [[i + 1, _clip(" ".join(text.split()), 100)]
                      for i, text in enumerate(traced[0].statements)]
        self.section("SQLite", [
            "The same durable task on an SQLite store (duraflow_database_url=sqlite:///"
            "<temporary file>), applied in this process, a new task id each time; per step = "
            "(run - empty run) / N, medians. Floor: a raw sqlite3 connection "
            "(isolation_level=None) on a second file in the same directory, "
            "`BEGIN IMMEDIATE; INSERT one row; COMMIT` (the way the library opens its "
            "transactions), timed in the same rounds in bursts of "
            f"{FLOOR_BURST}: median {ms(floor_s.median)} ms over {len(floor_s)} commits.",
            f"Settings: the library's connection {library_settings}; the floor's "
            f"{floor.settings}.",
            "",
            table(["steps", "runs", "run median ms", "run min ms", "per step ms", "x floor"],
                  rows),
            "",
            "Statements SQLite ran (sqlite3 set_trace_callback on the store's connections "
            f"while checked out): an empty run {len(traced[0].statements)} ({begins[0]} BEGIN, "
            f"{commits[0]} COMMIT), a 10-step run {len(traced[10].statements)} ({begins[10]} "
            f"BEGIN, {commits[10]} COMMIT): {per_step_tx:g} transactions per fresh step "
            "(BEGINs of the 10-step run - BEGINs of the empty run) / 10. The empty run's:",
            "",
            table(["#", "statement"], empty_rows),
        ])
        self.results["sqlite"] = {
            "floor_median_s": floor_s.median, "rows": data,
            "library_settings": library_settings, "floor_settings": floor.settings,
            "statements_empty": traced[0].statements,
            "statements_10": len(traced[10].statements),
            "begins": begins, "commits": commits, "transactions_per_step": per_step_tx,
        }
        if worst is not None:
            target.measured = f"{worst:.2f}x"
            target.status = "met" if worst <= 3 else "NOT met"
            target.note = f"N={worst_n}; floor {ms(floor_s.median)} ms per commit"
        elif not steps:
            target.note = "no N > 0 measured"
        target = self.targets["sqlite_tx"]
        target.measured = f"{per_step_tx:g}"
        target.status = "met" if per_step_tx <= 1 else "NOT met"
        target.note = (f"BEGINs: {begins[10]} (10 steps) - {begins[0]} (empty); "
                       f"{len(traced[0].statements)} statements in an empty run")

    # -- wal --------------------------------------------------------------------------------

    def bench_wal(self) -> None:
        s = self.sizes
        # Tables of this benchmark's own for both kinds, empty at the start: they then hold
        # as many rows as each other at every batch, so that neither touches more index
        # pages (and writes more full-page images) because other benchmarks filled its
        # tables first. The run's prefix starts their names: cleanup() drops them.
        prefix = f"{self.prefix}wal_"
        df = DuraflowBench.create(self.database_url, prefix)
        admin = self.duraflow.admin
        HandWritten.create_tables(admin, prefix)
        conn = psycopg.connect(self.conninfo, autocommit=True)
        hand = HandWritten(conn, prefix)
        n = s.wal_steps

        def durable() -> None:
            df.run(n)

        def by_hand() -> None:
            task_id = f"bench-{uuid.uuid4()}"
            if hand.run(task_id, n) != workload.expected_result(n):
                raise RuntimeError("the hand-written run returned a wrong result")

        variants = {"durable": durable, "by hand": by_hand}
        waldump = _waldump(admin)
        per_task: dict[str, list[float]] = {k: [] for k in variants}
        dumps: dict[str, str] = {}
        try:
            for fn in variants.values():
                for _ in range(max(s.warmup, 2)):
                    fn()
            log(f"wal: {s.wal_batches} batches of {s.wal_tasks} tasks of each kind")
            for batch in range(s.wal_batches):
                order = list(variants) if batch % 2 == 0 else list(reversed(variants))
                for kind in order:
                    admin.execute("CHECKPOINT")
                    start = _lsn(admin)
                    for _ in range(s.wal_tasks):
                        variants[kind]()
                    end = _lsn(admin)
                    row = admin.execute("SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)",
                                        (end, start)).fetchone()
                    per_task[kind].append(float(row[0] if row else 0) / s.wal_tasks)
                    if batch == s.wal_batches - 1:
                        # Now, before the next CHECKPOINT may recycle the segments.
                        dumps[kind] = _waldump_stats(waldump, start, end)
        finally:
            conn.close()
            df.engine.dispose()
        medians = {k: statistics.median(v) for k, v in per_task.items()}
        factor = medians["durable"] / medians["by hand"] if medians["by hand"] else None
        pairs = [d / h for d, h in zip(per_task["durable"], per_task["by hand"], strict=True)
                 if h]
        paired = statistics.median(pairs) if pairs else None
        rows = [[kind, len(values), f"{medians[kind]:.0f}", f"{min(values):.0f}",
                 f"{max(values):.0f}", ", ".join(f"{v:.0f}" for v in values)]
                for kind, values in per_task.items()]
        lines = [
            f"WAL written per task of {n} steps, in this process: the durable task applied "
            f"eagerly, and the same run written by hand ({n + 2} autocommit statements on a "
            "raw psycopg connection into two tables with only their primary keys: INSERT "
            "the run row, INSERT one row per step, UPDATE the run row); both on tables of "
            "their own, empty at the start. "
            f"{s.wal_batches} batches of {s.wal_tasks} tasks of each kind, alternating, each "
            "after a CHECKPOINT (both pay for full-page images alike); bytes = "
            "pg_wal_lsn_diff(pg_current_wal_lsn() after, before) / tasks.",
            "The database is shared with whatever else runs on the server (other tests "
            "write WAL too), so each batch can include others' records: the median of the "
            "batches is what is compared.",
            "",
            table(["task", "batches", "median bytes/task", "min", "max", "each batch"], rows),
            "",
            f"durable / by hand: {ratio(factor)} (medians of the batches); batch by batch "
            f"(each pair measured at the same table sizes): "
            f"{', '.join(ratio(d / h) for d, h in zip(*per_task.values(), strict=True) if h)}, "
            f"median {ratio(paired)}.",
        ]
        for kind in variants:
            lines += ["", f"pg_waldump --stats=record of the last {kind} batch "
                          "(all records between its two LSNs, other sessions' included):",
                      "", "```", dumps.get(kind, "(not run)"), "```"]
        self.section("WAL per task", lines)
        self.results["wal"] = {"steps": n, "tasks_per_batch": s.wal_tasks,
                               "bytes_per_task": per_task, "median_bytes_per_task": medians,
                               "durable_over_hand": factor, "paired_ratios": pairs,
                               "waldump": dumps}
        target = self.targets["wal"]
        if factor is not None:
            target.measured = f"{factor:.2f}x"
            target.status = "met" if factor <= 1.5 else "NOT met"
            target.note = (f"{medians['durable']:.0f} B vs {medians['by hand']:.0f} B per "
                           f"task, medians of batches (shared server); paired batches "
                           f"{ratio(paired)}")

    # -- dbos -------------------------------------------------------------------------------

    def bench_dbos(self) -> None:
        from .dbos_side import DbosBench, unavailable_reason

        target = self.targets["dbos"]
        reason = unavailable_reason()
        if reason is not None:
            self.section("DBOS side by side", [f"Skipped: {reason}."])
            target.status, target.note = "skipped", "DBOS not importable (see its section)"
            self.results["dbos"] = {"skipped": reason}
            return
        s = self.sizes
        df = self.duraflow
        sizes = (0, *s.steps)
        log("dbos: launching DBOS")
        dbos = DbosBench(self.conninfo, f"{self.prefix}dbos")
        floor = Floor(self.conninfo, f"{self.prefix}floor")
        try:
            variants: dict[str, Callable[[], object]] = {"floor": floor.insert}
            per_round = {"floor": s.floor_per_round // 2}
            for n in sizes:
                variants[f"duraflow n={n}"] = _bind(df.run, n)
                variants[f"dbos n={n}"] = _bind(dbos.run, n)
                per_round[f"duraflow n={n}"] = per_round[f"dbos n={n}"] = s.dbos_runs[n]
            log(f"dbos: {s.dbos_rounds} rounds of {per_round}")
            samples = interleaved(variants, per_round, s.dbos_rounds, s.warmup,
                                  bursts={"floor": FLOOR_BURST})
            counts = {n: (count_round_trips(df.engine, _bind(df.run, n)), dbos.round_trips(n))
                      for n in sizes}

            # Replays. DBOS: the finished workflow called again, and fork_workflow.
            largest = max(s.steps)
            wf_ids = {n: dbos.run(n) for n in sizes}
            df_ids = {n: df.run(n) for n in sizes}
            again = {"duraflow": Samples(), "dbos": Samples()}
            for _ in range(max(s.replay_runs[0], 3)):
                again["duraflow"].add(timed(_bind(df.run, largest, df_ids[largest])))
                again["dbos"].add(timed(_bind(dbos.run, largest, wf_ids[largest])))
            again_counts = {
                "duraflow": count_round_trips(df.engine, _bind(df.run, largest, df_ids[largest])),
                "dbos": dbos.round_trips(largest, wf_ids[largest]),
            }
            log(f"dbos: {s.dbos_forks} fork replays for N in {s.dbos_fork_steps}")
            forks = {n: [dbos.fork_replay(wf_ids[n], n) for _ in range(s.dbos_forks)]
                     for n in s.dbos_fork_steps}
            resumes = {n: Samples() for n in s.dbos_fork_steps}
            for n in s.dbos_fork_steps:
                for _ in range(s.replay_runs[n]):
                    df.reset_to_running(df_ids[n])
                    df.run(n, df_ids[n])
                    resumes[n].add(workload.LAST_BODY[0])
            sync = floor.synchronous_commit
        finally:
            floor.close()
            dbos.close()

        floor_s = samples["floor"]
        rows: list[list[object]] = []
        data: list[dict[str, Any]] = []
        worst: float | None = None
        worst_n = 0
        for n in sizes:
            d, b = samples[f"duraflow n={n}"], samples[f"dbos n={n}"]
            (d_stmt, d_wire), (b_stmt, b_wire) = counts[n]
            if n == 0:
                d_step = b_step = factor = None
            else:
                d_step = (d.median - samples["duraflow n=0"].median) / n
                b_step = (b.median - samples["dbos n=0"].median) / n
                factor = b_step / d_step if d_step > 0 else None
                if factor is not None and (worst is None or factor < worst):
                    worst, worst_n = factor, n
            rows.append([n if n else "0 (empty)", len(d), ms(d.median), ms(b.median),
                         ms(d_step), ms(b_step), ratio(factor),
                         ratio(d_step / floor_s.median if d_step else None),
                         ratio(b_step / floor_s.median if b_step else None),
                         f"{d_stmt} / {_opt(d_wire)}", f"{b_stmt} / {_opt(b_wire)}"])
            data.append({"steps": n, "runs": len(d), "duraflow_median_s": d.median,
                         "dbos_median_s": b.median, "duraflow_per_step_s": d_step,
                         "dbos_per_step_s": b_step, "dbos_over_duraflow": factor,
                         "duraflow_statements": d_stmt, "duraflow_round_trips": d_wire,
                         "dbos_statements": b_stmt, "dbos_round_trips": b_wire})
        replay_rows: list[list[object]] = []
        replay_data: list[dict[str, Any]] = []
        for n in s.dbos_fork_steps:
            fork_body = Samples([f.body for f in forks[n]])
            fork_wall = Samples([f.wall for f in forks[n]])
            last = forks[n][-1]
            d_step = resumes[n].median / n
            b_step = fork_body.median / n
            replay_rows.append([n, f"{len(resumes[n])} / {len(fork_body)}", _us(d_step),
                                _us(b_step), ratio(b_step / d_step if d_step else None, 0),
                                ms(fork_wall.median, 1),
                                f"{last.statements} / {_opt(last.wire)}"])
            replay_data.append({"steps": n, "forks": len(fork_body),
                                "duraflow_resume_body_per_step_s": d_step,
                                "dbos_fork_body_per_step_s": fork_body.median / n,
                                "dbos_fork_wall_s": fork_wall.median,
                                "dbos_fork_statements": last.statements,
                                "dbos_fork_round_trips": last.wire})
        self.section(f"DBOS side by side (dbos {dbos.version})", [
            f"Same PostgreSQL server and database (DBOS system schema {self.prefix}dbos); "
            "celery-duraflow runs, DBOS workflows and the floor take turns in every round. "
            "DBOS: @DBOS.workflow() calling an @DBOS.step() N times, called in this thread "
            "under a new workflow id (SetWorkflowID). Per step = (run - empty run) / N, "
            f"medians. Floor this section: {ms(floor_s.median)} ms (synchronous_commit="
            f"{sync}).",
            "",
            table(["steps", "runs each", "duraflow run ms", "DBOS run ms", "duraflow per step ms",
                   "DBOS per step ms", "DBOS / duraflow", "duraflow x floor", "DBOS x floor",
                   "duraflow SQLAlchemy stmts / round trips",
                   "DBOS SQLAlchemy stmts / round trips"], rows),
            "",
            "Replays. A finished run delivered again, "
            f"{largest} steps: celery-duraflow {ms(again['duraflow'].median)} ms "
            f"({again_counts['duraflow'][0]} statements / {_opt(again_counts['duraflow'][1])} "
            f"round trips), DBOS {ms(again['dbos'].median)} ms "
            f"({again_counts['dbos'][0]} / {_opt(again_counts['dbos'][1])}); neither runs a "
            "step.",
            "Resume from checkpoints, per step, measured inside the body (first line to last) "
            "/ N: celery-duraflow resumed as in the replay section; DBOS through "
            "DBOS.fork_workflow(id, start_step=N+1), whose body runs in DBOS's executor thread "
            "and answers every step from the copied checkpoints. The fork's wall time "
            "includes DBOS's queue dispatch and is not comparable.",
            "",
            table(["steps", "replays duraflow / DBOS", "duraflow per step us",
                   "DBOS per step us", "DBOS / duraflow", "DBOS fork wall ms",
                   "DBOS stmts / round trips (executor thread)"], replay_rows),
        ])
        self.results["dbos"] = {
            "version": dbos.version, "floor_median_s": floor_s.median, "rows": data,
            "again": {k: {"median_s": v.median, "statements": again_counts[k][0],
                          "round_trips": again_counts[k][1]} for k, v in again.items()},
            "replay_rows": replay_data,
        }
        if worst is not None:
            target.measured = f"{worst:.2f}x"
            target.status = "met" if worst >= 4 else "NOT met"
            target.note = f"N={worst_n}"

    # -- e2e --------------------------------------------------------------------------------

    def _brokers(self) -> list[tuple[str, str, str | None]]:
        """Redis and RabbitMQ: (label, URL, why it cannot be used or None)."""
        brokers: list[tuple[str, str, str | None]] = [("Redis", self.broker_url, None)]
        if self.rabbitmq_url:
            brokers.append(("RabbitMQ", self.rabbitmq_url, _rabbitmq_problem(self.rabbitmq_url)))
        else:
            brokers.append(("RabbitMQ", "", "no RabbitMQ URL given"))
        return brokers

    def _per_broker(self, name: str, on_broker: Callable[[str, str, Target], list[str]]
                    ) -> tuple[list[str], Exception | None]:
        """``on_broker(label, url, target)`` on Redis, then RabbitMQ; each section's lines.

        A broker that cannot be used is skipped with the reason; one that fails is reported
        as an ERROR in its section, and the other broker's numbers are still taken. The
        first failure is returned for the caller to raise once its section is printed.
        """
        self.results[name] = {}
        lines: list[str] = []
        failure: Exception | None = None
        for label, url, problem in self._brokers():
            target = self.targets[f"{name}_{label.lower()}"]
            if problem:
                lines += [f"### {label}", "", f"Skipped: {problem}.", ""]
                target.status, target.note = "skipped", problem
                self.results[name][label] = {"skipped": problem}
                continue
            try:
                lines += on_broker(label, url, target)
            except Exception as exc:
                traceback.print_exc()
                failure = failure or exc
                lines += [f"### {label}", "", f"ERROR: {type(exc).__name__}: {exc}", ""]
                target.status, target.note = "error", type(exc).__name__
                self.results[name][label] = {"error": f"{type(exc).__name__}: {exc}"}
        return lines, failure

    def bench_e2e(self) -> None:
        df = self.duraflow  # the schema exists before the workers start
        HandWritten.create_tables(df.admin, self.prefix)
        lines, failure = self._per_broker("e2e", self._e2e_on)
        s = self.sizes
        self.section("End to end through Celery", [
            f"{s.e2e_tasks} tasks per round, sent to one `celery worker --pool prefork "
            "--concurrency 2` (2 pool processes) per broker, Redis as the result backend "
            "for both brokers; wall time from the first send to the last result. Three kinds "
            f"of task of {s.e2e_steps} trivial steps, taking turns (the order rotates each "
            "round): a plain Celery task; a plain task that records the run by hand (the "
            f"same {s.e2e_steps + 2} commits: a raw psycopg connection per pool process in "
            "autocommit, INSERT the run row, INSERT one row per step, UPDATE the run row, "
            "into two tables with only their primary keys); and the DurableTask. Every "
            "result is checked, and so are the rows: every durable run succeeded, every "
            "hand-written run row is finished. Celery defaults otherwise (early ack, "
            "prefetch 4).",
            "",
            *lines,
        ])
        if failure is not None:
            raise failure

    def _e2e_on(self, label: str, broker_url: str, target: Target) -> list[str]:
        from .workers import celery_worker

        s = self.sizes
        df = self.duraflow
        expected = workload.expected_result(s.e2e_steps)
        kinds = ("plain", "by hand", "durable")
        names = {"plain": PLAIN_TASK_NAME, "by hand": HANDWRITTEN_TASK_NAME,
                 "durable": DURABLE_TASK_NAME}
        walls: dict[str, Samples] = {k: Samples() for k in kinds}
        sent = dict.fromkeys(kinds, 0)
        durable_before = self._count_succeeded(df)
        hand_before = self._count_hand_finished(df)
        log(f"e2e: starting celery worker on {label} (prefork, concurrency 2)")
        with celery_worker(broker_url=broker_url, backend_url=self.broker_url,
                           database_url=self.database_url, prefix=self.prefix, concurrency=2,
                           label=f"e2e-{label.lower()}") as worker:
            for kind in kinds:
                warm = [worker.send(names[kind], s.e2e_steps) for _ in range(s.e2e_warmup)]
                self._check_values(kind, worker.wait_all(warm, timeout=300), expected)
                sent[kind] += len(warm)
                for result in warm:
                    result.forget()
            for r in range(s.e2e_rounds):
                for kind in kinds[r % 3:] + kinds[:r % 3]:
                    log(f"e2e {label}: round {r + 1}/{s.e2e_rounds}, {s.e2e_tasks} {kind} tasks")
                    start = time.perf_counter()
                    results = [worker.send(names[kind], s.e2e_steps) for _ in range(s.e2e_tasks)]
                    values = worker.wait_all(results, timeout=900)
                    walls[kind].add(time.perf_counter() - start)
                    self._check_values(kind, values, expected)
                    sent[kind] += len(results)
                    for result in results:
                        result.forget()
        durable_ok = self._count_succeeded(df) - durable_before
        hand_ok = self._count_hand_finished(df) - hand_before
        if durable_ok != sent["durable"] or hand_ok != sent["by hand"]:
            raise RuntimeError(f"{label}: {durable_ok} of {sent['durable']} durable runs "
                               f"succeeded, {hand_ok} of {sent['by hand']} hand-written runs "
                               "finished")
        tput = {k: s.e2e_tasks / v.median for k, v in walls.items()}
        best = {k: s.e2e_tasks / v.minimum for k, v in walls.items()}
        vs_hand = tput["durable"] / tput["by hand"]
        vs_plain = tput["durable"] / tput["plain"]
        rows = [[title, len(walls[k]), f"{walls[k].median:.2f}", f"{tput[k]:.0f}",
                 f"{best[k]:.0f}", ratio(tput["durable"] / tput[k])]
                for k, title in (("plain", "plain Celery task"),
                                 ("by hand", "plain task, twelve commits by hand"),
                                 ("durable", "DurableTask"))]
        extra = (walls["durable"].median - walls["by hand"].median) / s.e2e_tasks
        self.results["e2e"][label] = {
            "tasks": s.e2e_tasks, "steps": s.e2e_steps, "rounds": s.e2e_rounds,
            "wall_s": {k: v.values for k, v in walls.items()},
            "tasks_per_s": tput, "durable_over_hand": vs_hand, "durable_over_plain": vs_plain,
            "checked": {"durable_succeeded": durable_ok, "hand_finished": hand_ok},
        }
        target.measured = f"{vs_hand:.2f}x"
        target.status = "met" if vs_hand >= E2E_LIMIT else "NOT met"
        target.note = (f"{tput['durable']:.0f} vs {tput['by hand']:.0f} tasks/s; durable/plain "
                       f"{vs_plain:.2f}x")
        return [
            f"### {label} ({_redact(broker_url)})",
            "",
            table(["task", "rounds", "median wall s", "tasks/s (median)", "tasks/s (best)",
                   "durable throughput / this"], rows),
            "",
            f"Durable / hand-written throughput {vs_hand:.2f}x, durable / plain "
            f"{vs_plain:.2f}x; the DurableTask takes {ms(extra, 2)} ms more wall time per "
            f"task than writing the same commits by hand, with 2 pool processes. Checked: "
            f"{durable_ok} durable runs succeeded, {hand_ok} hand-written runs finished.",
            "",
        ]

    @staticmethod
    def _check_values(kind: str, values: list[Any], expected: int) -> None:
        wrong = [v for v in values if v != expected]
        if wrong:
            raise RuntimeError(f"{len(wrong)} {kind} tasks returned {wrong[:3]}")

    def _count_hand_finished(self, df: DuraflowBench) -> int:
        row = df.admin.execute(
            f"SELECT count(*) FROM \"{self.prefix}hand_runs\" WHERE status = 'succeeded'"
        ).fetchone()
        return int(row[0]) if row else 0

    # -- memory -----------------------------------------------------------------------------

    def bench_memory(self) -> None:
        from .workers import celery_worker

        s = self.sizes
        df = self.duraflow
        target = self.targets["memory"]
        log("memory: starting celery worker (prefork, concurrency 1)")
        series: dict[str, list[tuple[int, int]]] = {}
        pid = None
        with celery_worker(broker_url=self.broker_url, database_url=self.database_url,
                           prefix=self.prefix, concurrency=1, label="memory") as worker:
            succeeded_before = self._count_succeeded(df)
            for kind, name in (("plain", PLAIN_TASK_NAME), ("durable", DURABLE_TASK_NAME)):
                for _ in range(s.memory_warmup):
                    worker.send(name, s.memory_steps, ignore_result=True)
                # bench.rss runs after every task sent before it: one process, in order.
                first = worker.call(RSS_TASK_NAME, timeout=600)
                pid = pid or first["pid"]
                points = [(0, int(first["rss"]))]
                bodies = int(first["bodies_run"])
                chunk = max(1, s.memory_runs // s.memory_samples)
                done = 0
                log(f"memory: {s.memory_runs} {kind} runs of {s.memory_steps} steps")
                while done < s.memory_runs:
                    size = min(chunk, s.memory_runs - done)
                    for _ in range(size):
                        worker.send(name, s.memory_steps, ignore_result=True)
                    done += size
                    answer = worker.call(RSS_TASK_NAME, timeout=1200)
                    if answer["pid"] != pid:
                        raise RuntimeError("the worker's pool process was replaced during the "
                                           "memory benchmark")
                    points.append((done, int(answer["rss"])))
                ran = int(answer["bodies_run"]) - bodies
                if ran != s.memory_runs * s.memory_steps:
                    raise RuntimeError(f"{kind}: {ran} step bodies ran, expected "
                                       f"{s.memory_runs * s.memory_steps}")
                series[kind] = points
            succeeded = self._count_succeeded(df) - succeeded_before
            if succeeded != s.memory_runs + s.memory_warmup:
                raise RuntimeError(f"{succeeded} durable runs succeeded, expected "
                                   f"{s.memory_runs + s.memory_warmup}")
        mb = 1024 * 1024
        rows = []
        growth = {}
        for kind, points in series.items():
            growth[kind] = points[-1][1] - points[0][1]
            trend = ", ".join(f"{n}: {rss / mb:.1f}" for n, rss in points)
            rows.append([kind, f"{points[0][1] / mb:.1f}", f"{points[-1][1] / mb:.1f}",
                         f"{growth[kind] / mb:+.1f}", trend])
        self.section("Memory", [
            f"One `celery worker --pool prefork --concurrency 1`; its pool process runs "
            f"{s.memory_warmup} warm-up tasks, then {s.memory_runs} runs of {s.memory_steps} "
            "trivial steps, plain tasks first, then DurableTask runs. RSS (VmRSS, after "
            "gc.collect()) is read by a task in that same process.",
            "",
            table(["task", "RSS before MB", "RSS after MB", "growth MB",
                   "RSS MB after n runs"], rows),
        ])
        self.results["memory"] = {"runs": s.memory_runs, "steps": s.memory_steps,
                                  "series": series, "growth_bytes": growth}
        durable_growth = growth["durable"] / mb
        target.measured = f"{durable_growth:+.1f} MB"
        target.status = "met" if durable_growth < 20 else "NOT met"
        if s.memory_runs != 10_000:
            target.note = f"measured over {s.memory_runs} runs"

    def _count_succeeded(self, df: DuraflowBench) -> int:
        row = df.admin.execute(
            f"SELECT count(*) FROM \"{self.prefix}runs\" WHERE status = 'succeeded'"
        ).fetchone()
        return int(row[0]) if row else 0

    # -- the whole run ----------------------------------------------------------------------

    def run(self, selected: Sequence[str]) -> int:
        self.section("Machine and versions", [table(["what", "value"], machine_info(self))])
        redis_problem = None
        if {"e2e", "memory", "flow", "fleet"} & set(selected):
            redis_problem = _redis_problem(self.broker_url)
        try:
            for name in selected:
                if name in ("e2e", "memory", "flow", "fleet") and redis_problem:
                    self.section(name, [f"Skipped: {redis_problem}."])
                    for key in self._targets_of(name):
                        self.targets[key].status = "skipped"
                        self.targets[key].note = redis_problem
                    continue
                started = time.perf_counter()
                try:
                    getattr(self, f"bench_{name}")()
                except Exception as exc:
                    traceback.print_exc()
                    self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                    self.section(name, [f"ERROR: {type(exc).__name__}: {exc}"])
                    for key in self._targets_of(name):
                        if self.targets[key].status == "not run":
                            self.targets[key].status = "error"
                            self.targets[key].note = f"{type(exc).__name__}"
                log(f"{name}: {time.perf_counter() - started:.1f}s")
            if self.profile:
                started = time.perf_counter()
                try:
                    self.bench_profile()
                except Exception as exc:
                    traceback.print_exc()
                    self.errors.append(f"profile: {type(exc).__name__}: {exc}")
                    self.section("Per-attempt profile", [f"ERROR: {type(exc).__name__}: {exc}"])
                log(f"profile: {time.perf_counter() - started:.1f}s")
        finally:
            self.cleanup()
        rows = [[t.title, t.measured, t.limit, t.status, t.note] for t in self.targets.values()]
        self.section("Targets", [table(["target", "measured", "target", "verdict", "note"],
                                       rows)])
        self.results["targets"] = {k: asdict(v) for k, v in self.targets.items()}
        return 1 if self.errors else 0

    def _targets_of(self, name: str) -> list[str]:
        """The targets a benchmark sets (``fresh`` also measures the empty task)."""
        extra = {"fresh": ["empty", "empty_cpu", "statements"], "replay": ["replay_cpu"],
                 "sqlite": ["sqlite_tx"], "e2e": ["e2e_redis", "e2e_rabbitmq"],
                 "flow": ["flow_redis", "flow_rabbitmq"]}
        return [k for k in [name, *extra.get(name, [])] if k in self.targets]

    def bench_atomic(self) -> None:
        from .atomic import bench_atomic

        s = self.sizes
        lines, data = bench_atomic(self.database_url, self.prefix, steps=s.atomic_steps,
                                   rounds=s.atomic_rounds, runs=s.atomic_runs,
                                   warmup=s.warmup)
        self.section("Atomic steps against plain ones", lines)
        self.results["atomic"] = data

    def bench_telemetry(self) -> None:
        from .telemetry import bench_telemetry

        s = self.sizes
        lines, data = bench_telemetry(self.database_url, self.prefix, steps=s.telemetry_steps,
                                      rounds=s.telemetry_rounds, runs=s.telemetry_runs,
                                      warmup=s.warmup)
        self.section("OpenTelemetry cost", lines)
        self.results["telemetry"] = data

    def bench_scale(self) -> None:
        from .scale import LIMIT, bench_scale, default_sizes

        sizes = default_sizes(self.sizes is QUICK)
        lines, data = bench_scale(self.database_url, self.prefix, **sizes)
        self.section("Large tables", lines)
        self.results["scale"] = data
        target = self.targets["scale"]
        worst = data["worst"]
        if worst is not None:
            target.measured = f"{worst['ratio']:.2f}x"
            target.status = "met" if worst["ratio"] <= LIMIT else "NOT met"
            target.note = f"{worst['operation']}; {data['runs']:,} runs"

    def bench_flow(self) -> None:
        from . import flow

        s = self.sizes
        df = self.duraflow  # the schema exists before the workers start
        lines: list[str] = [
            f"{s.flow_tasks} tasks per round of each kind, sent to one `celery worker --pool "
            f"prefork --concurrency {flow.PROCESSES}` per broker, Redis as the result backend "
            "for both brokers; wall time from the first send to the last result, "
            f"{s.flow_rounds} rounds, the kinds taking turns (the order rotates each round) "
            f"after {s.flow_warmup} warm-up tasks of each. The same work, DurableTask runs "
            "of (tenant, steps, sleep_ms), declared four ways: no limit; "
            f"Concurrency({flow.LIMIT}, key='tenant') with the runs spread round robin over "
            f"{flow.KEYS} tenants, and Concurrency({flow.WIDE_LIMIT}) with no key (one key, "
            f"above the {flow.PROCESSES} processes): neither can bind; and "
            f"Concurrency({flow.LIMIT}, key='tenant') with every run on one tenant, which "
            f"binds ({flow.LIMIT} of {flow.PROCESSES} processes; the other runs queue, are "
            "suspended and sent again when a slot frees). Every result and run row is "
            "checked; where a limit does not bind no run may queue. Celery defaults "
            "otherwise (early ack, prefetch 4).",
            "",
        ]

        def on_broker(label: str, url: str, target: Target) -> list[str]:
            broker_lines, data = flow.through_worker(
                label, url, backend_url=self.broker_url, database_url=self.database_url,
                prefix=self.prefix, admin=df.admin, tasks=s.flow_tasks,
                rounds=s.flow_rounds, warmup=s.flow_warmup)
            self.results["flow"][label] = data
            figures = data["works"][flow.TARGET_WORK]
            keyed = figures["keyed"]["over_none"]
            target.measured = f"{keyed:.2f}x"
            target.status = "met" if keyed >= flow.TARGET else "NOT met"
            target.note = (f"{figures['keyed']['tasks_per_s']:.0f} vs "
                           f"{figures['none']['tasks_per_s']:.0f} tasks/s; one key "
                           f"{figures['one key']['over_none']:.2f}x; 10 ms sleep "
                           f"{data['works']['sleep']['keyed']['over_none']:.2f}x")
            return broker_lines

        broker_lines, failure = self._per_broker("flow", on_broker)
        lines += broker_lines
        local_lines, local = flow.in_process(
            self.database_url, self.prefix, steps=flow.WORKS[0].steps,
            rounds=s.flow_local_rounds, runs=s.flow_runs, warmup=s.warmup,
            traced=s.flow_traced)
        self.results["flow"]["in_process"] = local
        lines += ["### What the limit adds to an attempt (PostgreSQL, in this process)", "",
                  *local_lines]
        self.section("Flow control", lines)
        if failure is not None:
            raise failure

    def bench_fleet(self) -> None:
        from . import fleet

        s = self.sizes
        df = self.duraflow  # the schema exists before the workers start
        HandWritten.create_tables(df.admin, self.prefix)
        lines, data = fleet.through_fleet(
            self.broker_url, database_url=self.database_url, conninfo=self.conninfo,
            prefix=self.prefix, admin=df.admin, tasks=s.fleet_tasks, rounds=s.fleet_rounds,
            warmup=s.fleet_warmup, steps=s.fleet_steps, processes=s.fleet_processes)
        self.results["fleet"] = data
        self.section("Scaling the fleet", [
            f"One `celery worker --pool prefork` on Redis ({_redact(self.broker_url)}) at "
            f"each of {', '.join(map(str, s.fleet_processes))} pool processes, one "
            "PostgreSQL; the task that writes the same commits by hand and the DurableTask "
            "take turns (the order rotates each round). See `benchmarks/fleet.py`.",
            "",
            *lines,
        ])
        target = self.targets["fleet"]
        worst = data["worst"]
        target.measured = f"{worst['ratio']:.2f}x"
        target.status = "met" if worst["ratio"] >= fleet.TARGET else "NOT met"
        target.note = f"worst at {worst['processes']} processes"

    def bench_parallel(self) -> None:
        from . import parallel

        lines, data = parallel.concurrent_steps(self.duraflow, self.sizes.parallel_rounds)
        self.results["parallel"] = data
        self.section("Concurrent steps", [
            f"A DurableTask applied in this process, fresh runs, {self.sizes.parallel_rounds} "
            "rounds after one to warm up, the kinds taking turns: one step whose body waits "
            f"{parallel.IO_SECONDS * 1000:.0f} ms, and ten such steps at once with "
            "aparallel(), with asyncio.gather of steps created first, and with parallel() "
            "in threads. See `benchmarks/parallel.py`.",
            "",
            *lines,
        ])
        target = self.targets["parallel"]
        target.measured = f"{data['worst']:.2f}x"
        target.status = "met" if data["worst"] < parallel.TARGET else "NOT met"

    def bench_profile(self) -> None:
        from .profile import attempt_profile

        lines, data = attempt_profile(self.duraflow, self.sizes.profile_runs,
                                      self.sizes.profile_traced)
        self.section("Per-attempt profile", lines)
        self.results["profile"] = data

    def cleanup(self) -> None:
        if self._duraflow is not None:
            self._duraflow.close()
            self._duraflow.engine.dispose()
        with contextlib.suppress(Exception):
            drop_prefixed_tables(self.conninfo, self.prefix)


def _bind(fn: Callable[..., object], *args: Any) -> Callable[[], object]:
    return lambda: fn(*args)


def _opt(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def _rabbitmq_problem(url: str) -> str | None:
    from kombu.connection import Connection

    try:
        with Connection(url, connect_timeout=3) as conn:  # type: ignore[no-untyped-call]
            conn.ensure_connection(max_retries=1)
    except Exception as exc:
        return f"RabbitMQ at {_redact(url)} is unreachable ({type(exc).__name__}: {exc})"
    return None


def _redact(url: str) -> str:
    """A broker URL without its password."""
    from kombu.utils.url import maybe_sanitize_url

    return str(maybe_sanitize_url(url))


def _redis_problem(url: str) -> str | None:
    try:
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=3)
        client.ping()
        client.close()
    except Exception as exc:
        return f"Redis at {url} is unreachable ({type(exc).__name__}: {exc})"
    return None


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def library_digest() -> str:
    """A digest of celery_duraflow/*.py as measured (the tree may differ from the commit)."""
    digest = hashlib.sha256()
    for path in sorted((REPO_ROOT / "celery_duraflow").glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def machine_info(harness: Harness) -> list[list[str]]:
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = "?"
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
        memory = f"{kb / 1024 / 1024:.1f} GiB"
    with psycopg.connect(harness.conninfo, autocommit=True) as conn:
        settings = {}
        for name in ("server_version", "synchronous_commit", "fsync", "wal_sync_method"):
            row = conn.execute(f"SHOW {name}").fetchone()
            settings[name] = str(row[0]) if row else "?"
    commit = _git("rev-parse", "--short", "HEAD") or "?"
    dirty = _git("status", "--porcelain", "--", "celery_duraflow")
    info = [
        ["celery-duraflow commit", commit + (" + uncommitted changes in celery_duraflow/"
                                            if dirty else "")],
        ["celery_duraflow/*.py digest", library_digest()],
        ["CPU", f"{cpu}, {os.cpu_count()} cores"],
        ["memory", memory],
        ["OS", f"{platform.system()} {platform.release()}"],
        ["Python", platform.python_version()],
        ["PostgreSQL", f"{settings['server_version']} (synchronous_commit="
                       f"{settings['synchronous_commit']}, fsync={settings['fsync']}, "
                       f"wal_sync_method={settings['wal_sync_method']}), "
                       f"{harness.conninfo.split('@')[-1]}"],
        ["broker", harness.broker_url],
        ["packages", ", ".join(f"{p} {_version(p)}" for p in
                               ("celery", "sqlalchemy", "psycopg", "redis", "dbos"))],
        ["telemetry", "off, as without the otel extra (the telemetry section measures it)"],
        ["mode", "quick" if harness.sizes is QUICK else "full"],
        ["started", time.strftime("%Y-%m-%d %H:%M:%S %Z")],
    ]
    harness.results["machine"] = dict(info)
    return info


def _parse_only(raw: Sequence[str] | None) -> list[str]:
    if not raw:
        return list(BENCHMARKS)
    names = [n.strip() for chunk in raw for n in chunk.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(BENCHMARKS)}")
    return [n for n in BENCHMARKS if n in names]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmarks of celery-duraflow against baselines measured in the same run.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes: checks that everything runs, measures nothing")
    parser.add_argument("--only", action="append", metavar="NAMES",
                        help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    parser.add_argument("--database-url", default=default_database_url(),
                        help="PostgreSQL URL (default: $DURAFLOW_BENCH_DATABASE_URL, "
                             "$DURAFLOW_TEST_DATABASE_URL, or the local test database)")
    parser.add_argument("--broker-url", default=default_broker_url(),
                        help="Redis URL for the worker benchmarks (default: "
                             "$DURAFLOW_BENCH_BROKER_URL, $DURAFLOW_TEST_BROKER_URL, or "
                             "redis://127.0.0.1:6379/9)")
    parser.add_argument("--rabbitmq-url", default=default_rabbitmq_url(),
                        help="RabbitMQ URL for the second e2e broker (default: "
                             "$DURAFLOW_BENCH_RABBITMQ_URL or amqp://guest:guest@127.0.0.1:"
                             "5672//; '' skips it; skipped with a note when unreachable)")
    parser.add_argument("--profile", action="store_true",
                        help="also print the per-attempt profile (python -m benchmarks.profile "
                             "--attempt): where an empty and a 10-step attempt spend their "
                             "time")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    selected = _parse_only(args.only)
    telemetry_off()

    conninfo = libpq_url(args.database_url)
    try:
        psycopg.connect(conninfo, connect_timeout=5).close()
    except psycopg.Error as exc:
        print(f"PostgreSQL at {args.database_url} is unreachable: {exc}", file=sys.stderr)
        return 2

    harness = Harness(database_url=args.database_url, broker_url=args.broker_url,
                      sizes=QUICK if args.quick else FULL, prefix=new_prefix(),
                      rabbitmq_url=args.rabbitmq_url, profile=args.profile)
    print("# celery-duraflow benchmarks" + (" (quick: sizes too small to mean anything)"
                                            if args.quick else ""))
    started = time.perf_counter()
    status = harness.run(selected)
    elapsed = time.perf_counter() - started
    print(f"\nTotal time {elapsed:.0f} s.")
    if args.json:
        harness.results["elapsed_s"] = elapsed
        Path(args.json).write_text(json.dumps(harness.results, indent=2, default=str) + "\n")
    for error in harness.errors:
        print(f"error in {error}", file=sys.stderr)
    return status


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 3] + "..."


def _statements_of(df: DuraflowBench,
                   n: int) -> tuple[list[ExecutedStatement], list[SentStatement]]:
    """The statements of one run: as psycopg's Cursor.execute got them, and on the wire.

    The pool's connections are closed first: psycopg prepares a statement it has run
    five times on a connection and sends it without its text from then on, whereas the
    first executions on a new connection carry it (``Parse`` messages).
    """
    df.engine.dispose()
    df.run(n)  # the schema check and whatever a new connection does first, untraced
    df.engine.dispose()
    counter = RoundTrips(df.engine, keep=True)
    with psycopg_statements() as executed, counter.counting():
        df.run(n)
    texts = counter.traces[threading.get_ident()]
    return list(executed), [sent for text in texts for sent in trace_statements(text)]


def _lsn(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    if row is None:
        raise RuntimeError("pg_current_wal_lsn() returned nothing")
    return str(row[0])


@dataclass(frozen=True)
class WalDump:
    """Where pg_waldump and the server's WAL are, or why they cannot be used."""

    binary: str | None
    directory: str | None
    problem: str | None


def _waldump(conn: psycopg.Connection[Any]) -> WalDump:
    try:
        row = conn.execute("SHOW server_version_num").fetchone()
        major = int(row[0]) // 10000 if row else 0
        row = conn.execute("SHOW data_directory").fetchone()
        directory = os.path.join(str(row[0]), "pg_wal") if row else None
    except psycopg.Error as exc:
        return WalDump(None, None, f"cannot ask the server where its WAL is ({exc})")
    candidates = [os.environ.get("DURAFLOW_BENCH_PG_WALDUMP"),
                  f"/usr/lib/postgresql/{major}/bin/pg_waldump", shutil.which("pg_waldump")]
    binary = next((c for c in candidates if c and os.access(c, os.X_OK)), None)
    if binary is None:
        return WalDump(None, directory, "pg_waldump not found (DURAFLOW_BENCH_PG_WALDUMP "
                                        "names it)")
    if directory is None or not os.access(directory, os.R_OK | os.X_OK):
        return WalDump(binary, directory, f"the WAL directory {directory} is not readable "
                                          "here (another machine, or another user)")
    return WalDump(binary, directory, None)


def _waldump_stats(waldump: WalDump, start: str, end: str) -> str:
    """pg_waldump --stats=record between two LSNs, or why not."""
    if waldump.problem or not waldump.binary or not waldump.directory:
        return f"skipped: {waldump.problem}"
    try:
        done = subprocess.run([waldump.binary, "--path", waldump.directory, "--start", start,
                               "--end", end, "--stats=record"], capture_output=True, text=True,
                              timeout=120, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"skipped: pg_waldump did not run ({type(exc).__name__}: {exc})"
    if done.returncode != 0 or not done.stdout.strip():
        problem = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"skipped: pg_waldump exited with {done.returncode}: {problem}"
    return done.stdout.rstrip()
