"""What an atomic step costs against a plain one that makes the same write.

Both tasks run N steps, and each step's body inserts one row into a table of the
user's own in the store's database:

* plain: the body writes on a connection of the user's own, in autocommit (the way a
  step writes to its database today), then the library records the step: two commits;
* atomic: ``step(..., atomic=True)``, the body writes on ``s.connection``, and the
  record commits with it: one commit, around ``BEGIN``, the fence and the record.

Taken in the same rounds, on PostgreSQL and on SQLite, each against the empty durable
task; reported per step and as the ratio atomic / plain.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine

from celery_duraflow import DurableTask, step
from celery_duraflow._config import config_for_app
from celery_duraflow._store import close_all_stores, store_for

from .common import Samples, interleaved, log, ms, ratio, table

# Set by AtomicBench before the tasks run: the user's table and connection.
_TARGET: dict[str, Any] = {}


def plain_writes(n: int) -> int:
    """N steps, each writing one row on the user's own autocommit connection."""
    rows, conn = _TARGET["table"], _TARGET["conn"]
    for i in range(n):
        with step("write") as s:
            conn.execute(rows.insert().values(task=_TARGET["task_id"](), step=i))
            s.result = i
    return n


def atomic_writes(n: int) -> int:
    """N atomic steps, each writing one row on the step's own transaction."""
    rows = _TARGET["table"]
    for i in range(n):
        with step("write", atomic=True) as s:
            s.connection.execute(rows.insert().values(task=_TARGET["task_id"](), step=i))
            s.result = i
    return n


class AtomicBench:
    """The two tasks on one store, and the user's table beside the store's."""

    def __init__(self, database_url: str, prefix: str) -> None:
        self.database_url = database_url
        self.app = Celery(f"atomic-bench-{uuid.uuid4().hex[:6]}", broker="memory://",
                          backend="cache+memory://", set_as_current=False)
        self.app.conf.update(duraflow_database_url=database_url, duraflow_table_prefix=prefix,
                             task_eager_propagates=True)
        self.plain = self.app.task(base=DurableTask, name="bench.plain_writes",
                                   shared=False)(plain_writes)
        self.atomic = self.app.task(base=DurableTask, name="bench.atomic_writes",
                                    shared=False)(atomic_writes)
        self.table = Table(f"{prefix}user_rows", MetaData(),
                           Column("id", Integer, primary_key=True, autoincrement=True),
                           Column("task", String(64), nullable=False),
                           Column("step", Integer, nullable=False))
        store_for(config_for_app(self.app)).migrate()
        self.engine = create_engine(database_url, isolation_level="AUTOCOMMIT")
        self.table.create(self.engine)
        self.conn = self.engine.connect()
        _TARGET.update(table=self.table, conn=self.conn,
                       task_id=lambda: self._current or "")
        self._current: str | None = None

    def run(self, task: Any, n: int) -> None:
        self._current = f"bench-{uuid.uuid4()}"
        result = task.apply(args=(n,), task_id=self._current)
        if result.result != n:
            raise RuntimeError(f"{task.name} of {n} steps failed: {result.traceback}")

    def close(self) -> None:
        self.conn.close()
        self.table.drop(self.engine, checkfirst=True)
        self.engine.dispose()
        close_all_stores()


def measure(database_url: str, prefix: str, *, steps: int, rounds: int, runs: int,
            warmup: int) -> tuple[list[str], dict[str, Any]]:
    """Per-step cost of the plain and the atomic step on one store; lines and data."""
    bench = AtomicBench(database_url, prefix)
    try:
        variants: dict[str, Callable[[], object]] = {
            "empty": lambda: bench.run(bench.plain, 0),
            "plain": lambda: bench.run(bench.plain, steps),
            "atomic": lambda: bench.run(bench.atomic, steps),
        }
        samples: dict[str, Samples] = interleaved(
            variants, dict.fromkeys(variants, runs), rounds, warmup)
    finally:
        bench.close()
    empty = samples["empty"].median
    plain = (samples["plain"].median - empty) / steps
    atomic = (samples["atomic"].median - empty) / steps
    factor = atomic / plain if plain > 0 else None
    rows = [["plain step + its own autocommit write", ms(plain)],
            ["atomic step, the write in its transaction", ms(atomic)]]
    data = {"plain_per_step_s": plain, "atomic_per_step_s": atomic, "ratio": factor,
            "runs": {k: len(v) for k, v in samples.items()}}
    return [table(["per step (median, minus the empty task)", "ms"], rows), "",
            f"atomic / plain: {ratio(factor)}"], data


def bench_atomic(database_url: str, prefix: str, *, steps: int, rounds: int, runs: int,
                 warmup: int) -> tuple[list[str], dict[str, Any]]:
    """The comparison on PostgreSQL (``database_url``) and on a temporary SQLite file."""
    lines: list[str] = [
        f"Tasks of {steps} steps, each step's body inserting one row into a table of the "
        "user's own in the store's database; `plain`: the body writes on its own autocommit "
        "connection, then the step is recorded (two commits); `atomic`: step(..., "
        "atomic=True), the write on s.connection, committed with the record (one commit). "
        f"{rounds} rounds of {runs} runs of each, taking turns; per step = (run - empty "
        "task) / steps, from the medians.", ""]
    data: dict[str, Any] = {}
    log("atomic: PostgreSQL")
    pg_lines, data["postgresql"] = measure(database_url, f"{prefix}a_", steps=steps,
                                           rounds=rounds, runs=runs, warmup=warmup)
    lines += ["PostgreSQL:", "", *pg_lines, ""]
    with tempfile.TemporaryDirectory(prefix="duraflow-atomic-") as folder:
        log("atomic: SQLite")
        url = f"sqlite:///{Path(folder) / 'atomic.sqlite3'}"
        lite_lines, data["sqlite"] = measure(url, f"{prefix}a_", steps=steps, rounds=rounds,
                                             runs=runs, warmup=warmup)
    lines += ["SQLite (WAL, synchronous=FULL):", "", *lite_lines]
    return lines, data
