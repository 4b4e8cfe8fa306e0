"""Durable throughput against the same commits written by hand, as the fleet grows.

One ``celery worker --pool prefork`` on Redis (broker and result backend) with 1, 2, 4 and
8 pool processes (:data:`PROCESSES`), each on the same PostgreSQL. At each size two kinds of
task of the same 10 trivial steps take turns (the order rotates each round): the plain task
that records the run by hand (a raw psycopg connection per pool process in autocommit:
INSERT the run row, INSERT one row per step, UPDATE the run row, into two tables with only
their primary keys) and the DurableTask. Throughput is tasks / wall time from the first
send to the last result; the figure is durable over hand-written at each size.

Beside it, for each kind at each size, measured on the server during the rounds:

* **write transactions per run**: how far the server's next transaction id moved over the
  round (``pg_snapshot_xmax(pg_current_snapshot())``: every transaction that wrote takes
  one id), over the tasks of the round. It includes whatever else wrote meanwhile (on a
  quiet machine, nothing);
* **lock waits**: ``pg_stat_activity`` sampled every :data:`SAMPLE_EVERY` seconds during
  the round, the share of the samples of the worker's active backends that waited on a
  heavyweight lock (``wait_event_type = 'Lock'``: a row, a transaction, an advisory lock),
  and on a lightweight one (``LWLock``: the WAL insertion and flush locks among them).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

from . import workload
from .common import DURABLE_TASK_NAME, HANDWRITTEN_TASK_NAME, Samples, log, ratio, table

#: Pool processes of the worker, one size after the other.
PROCESSES = (1, 2, 4, 8)
#: The target: durable throughput / hand-written throughput at each size.
TARGET = 0.9
#: How often the server's activity is sampled during a round, in seconds.
SAMPLE_EVERY = 0.01

KINDS = ("by hand", "durable")
NAMES = {"by hand": HANDWRITTEN_TASK_NAME, "durable": DURABLE_TASK_NAME}


class ActivitySampler:
    """Samples the wait events of the backends that serve ``application`` meanwhile."""

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.samples = self.lock = self.lwlock = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ActivitySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            own = conn.info.backend_pid
            while not self._stop.wait(SAMPLE_EVERY):
                rows = conn.execute(
                    "SELECT wait_event_type FROM pg_stat_activity "
                    "WHERE datname = current_database() AND state = 'active' "
                    "AND backend_type = 'client backend' AND pid <> %s", (own,)).fetchall()
                self.samples += len(rows)
                self.lock += sum(1 for (kind,) in rows if kind == "Lock")
                self.lwlock += sum(1 for (kind,) in rows if kind == "LWLock")


def _next_xid(admin: psycopg.Connection[Any]) -> int:
    row = admin.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint"
                        ).fetchone()
    assert row is not None
    return int(row[0])


def through_fleet(broker_url: str, *, database_url: str, conninfo: str, prefix: str,
                  admin: psycopg.Connection[Any], tasks: int, rounds: int, warmup: int,
                  steps: int, processes: tuple[int, ...] = PROCESSES
                  ) -> tuple[list[str], dict[str, Any]]:
    """Both kinds at each size; the section's lines and data."""
    from .workers import celery_worker

    expected = workload.expected_result(steps)
    data: dict[str, Any] = {"tasks": tasks, "rounds": rounds, "steps": steps, "sizes": {}}
    rows: list[list[str]] = []
    for size in processes:
        walls = {kind: Samples() for kind in KINDS}
        xids = {kind: Samples() for kind in KINDS}
        waits: dict[str, list[int]] = {kind: [0, 0, 0] for kind in KINDS}
        log(f"fleet: starting celery worker (prefork, concurrency {size})")
        with celery_worker(broker_url=broker_url, database_url=database_url, prefix=prefix,
                           concurrency=size, label=f"fleet-{size}") as worker:
            for kind in KINDS:
                warm = [worker.send(NAMES[kind], steps) for _ in range(warmup)]
                _check(kind, worker.wait_all(warm, timeout=300), expected)
                for result in warm:
                    result.forget()
            for r in range(rounds):
                for kind in KINDS[r % 2:] + KINDS[:r % 2]:
                    log(f"fleet {size} processes: round {r + 1}/{rounds}, {tasks} {kind}")
                    before = _next_xid(admin)
                    with ActivitySampler(conninfo) as sampler:
                        start = time.perf_counter()
                        results = [worker.send(NAMES[kind], steps) for _ in range(tasks)]
                        values = worker.wait_all(results, timeout=900)
                        walls[kind].add(time.perf_counter() - start)
                    xids[kind].add((_next_xid(admin) - before) / tasks)
                    _check(kind, values, expected)
                    for result in results:
                        result.forget()
                    waits[kind][0] += sampler.samples
                    waits[kind][1] += sampler.lock
                    waits[kind][2] += sampler.lwlock
        tput = {kind: tasks / walls[kind].median for kind in KINDS}
        over = tput["durable"] / tput["by hand"]
        shares = {kind: (waits[kind][1] / waits[kind][0] if waits[kind][0] else 0.0,
                         waits[kind][2] / waits[kind][0] if waits[kind][0] else 0.0)
                  for kind in KINDS}
        data["sizes"][size] = {
            "wall_s": {kind: walls[kind].values for kind in KINDS},
            "tasks_per_s": tput, "durable_over_hand": over,
            "write_transactions_per_run": {kind: xids[kind].median for kind in KINDS},
            "lock_wait_share": {kind: shares[kind][0] for kind in KINDS},
            "lwlock_wait_share": {kind: shares[kind][1] for kind in KINDS},
        }
        rows.append([str(size), f"{tput['by hand']:.0f}", f"{tput['durable']:.0f}",
                     ratio(over),
                     f"{xids['by hand'].median:.1f} / {xids['durable'].median:.1f}",
                     f"{shares['by hand'][0]:.1%} / {shares['durable'][0]:.1%}",
                     f"{shares['by hand'][1]:.1%} / {shares['durable'][1]:.1%}"])
    worst = min(data["sizes"].items(), key=lambda item: item[1]["durable_over_hand"])
    data["worst"] = {"processes": worst[0], "ratio": worst[1]["durable_over_hand"]}
    lines = [
        table(["pool processes", "by hand tasks/s", "durable tasks/s", "durable / by hand",
               "write transactions per run (hand / durable)",
               "lock waits (hand / durable)", "LWLock waits (hand / durable)"], rows),
        "",
        f"Medians of {rounds} rounds of {tasks} tasks of {steps} trivial steps at each size. "
        "Write transactions per run: the server's transaction ids used per task; lock "
        "waits: the share of the sampled active backends waiting on a heavyweight lock, "
        "and on a lightweight one.",
        "",
    ]
    return lines, data


def _check(kind: str, values: list[Any], expected: int) -> None:
    wrong = [v for v in values if v != expected]
    if wrong:
        raise RuntimeError(f"{len(wrong)} {kind} tasks returned {wrong[:3]}")
