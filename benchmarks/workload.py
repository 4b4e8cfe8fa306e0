"""The measured work: a run of N trivial steps, the same shape for every system compared.

``durable_steps(0)`` is the *empty durable task*: the same task, the same code path, no step.
Subtracting its time from ``durable_steps(n)`` leaves what the n steps cost.

:data:`BODIES_RUN` counts the step bodies that really ran in this process, so that a
benchmark can check that a replay ran none of them.

:class:`HandWritten` is the same run written to PostgreSQL by hand: the twelve commits of a
10-step run (run row, one row per step, run row finished) and nothing else, the yardstick
the end-to-end and WAL benchmarks hold the durable task against.
"""

from __future__ import annotations

import json
import time
from typing import Any

from celery_duraflow import step

# One counter in a list, so that step bodies can bump it without a `global` statement.
BODIES_RUN = [0]
# Seconds from the first line of the last durable_steps() body to its last line: the
# steps alone, without what happens before and after the task body (for replays).
LAST_BODY = [0.0]


def trivial(i: int) -> int:
    """The body of every step: no I/O, just enough to be counted."""
    BODIES_RUN[0] += 1
    return i


def durable_steps(n: int) -> int:
    """A durable run of ``n`` trivial steps (register it with ``base=DurableTask``)."""
    start = time.perf_counter()
    total = 0
    for i in range(n):
        with step("step") as s:
            s.result = trivial(i)
        total += s.result
    LAST_BODY[0] = time.perf_counter() - start
    return total


def plain_steps(n: int) -> int:
    """The same work as :func:`durable_steps` with no durability at all."""
    total = 0
    for i in range(n):
        total += trivial(i)
    return total


def expected_result(n: int) -> int:
    """What both tasks return for ``n`` steps."""
    return n * (n - 1) // 2


class HandWritten:
    """A run of ``n`` trivial steps recorded by hand, one autocommit statement per write.

    ``INSERT`` the run row, ``INSERT`` one row per step (its output as JSON), ``UPDATE`` the
    run row to finished: ``n + 2`` single-statement transactions on a raw psycopg
    connection in autocommit, into two tables of the benchmark's own that have nothing but
    their primary keys. No lease, no fencing, no arguments, no retries: what a durable run
    cannot do with less.
    """

    def __init__(self, conn: Any, prefix: str) -> None:
        self.conn = conn
        runs, steps = f'"{prefix}hand_runs"', f'"{prefix}hand_steps"'
        self.runs_table, self.steps_table = f"{prefix}hand_runs", f"{prefix}hand_steps"
        self._start = f"INSERT INTO {runs} (task_id, status) VALUES (%s, %s)"
        self._step = f"INSERT INTO {steps} (task_id, step_key, output) VALUES (%s, %s, %s)"
        self._finish = f"UPDATE {runs} SET status = %s WHERE task_id = %s"

    @staticmethod
    def create_tables(conn: Any, prefix: str) -> None:
        conn.execute(f'CREATE TABLE IF NOT EXISTS "{prefix}hand_runs" '
                     "(task_id varchar(255) PRIMARY KEY, status varchar(16) NOT NULL)")
        conn.execute(f'CREATE TABLE IF NOT EXISTS "{prefix}hand_steps" '
                     "(task_id varchar(255) NOT NULL, step_key varchar(1024) NOT NULL, "
                     "output text, PRIMARY KEY (task_id, step_key))")

    def run(self, task_id: str, n: int) -> int:
        execute = self.conn.execute
        execute(self._start, (task_id, "running"))
        total = 0
        for i in range(n):
            result = trivial(i)
            execute(self._step, (task_id, f"step#{i}", json.dumps(result)))
            total += result
        execute(self._finish, ("succeeded", task_id))
        return total
