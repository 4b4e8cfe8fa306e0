"""Durable steps under a real ``celery worker`` process with a prefork pool.

These tests start ``python -m celery -A tests.proj worker`` as a subprocess,
send it runs of ``proj.book_trip`` through the broker (each test runs once on
Redis and once on RabbitMQ), and check the result in PostgreSQL: the duraflow
step rows and the project's own charge ledger. Each test has its own queue
(deleted afterwards), worker node name and table prefix.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from celery import Celery
from celery.result import AsyncResult

from celery_duraflow import get_run
from tests.conftest import Broker
from tests.workers import (
    client_app,
    end_project,
    fetch_all,
    log_tail,
    proj_env,
    start_worker_process,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.subprocess]

TASK_NAME = "proj.book_trip"
RESULT_TIMEOUT = 60.0


@dataclass
class Worker:
    """A running worker subprocess and what the test needs to talk to it."""

    process: subprocess.Popen[bytes]
    log_path: Path
    queue: str
    client: Celery
    database_url: str
    prefix: str

    def log_tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)

    def submit(self, user_id: str, query: str, *, task_id: str | None = None) -> AsyncResult:
        return self.client.signature(TASK_NAME, args=(user_id, query)).apply_async(
            queue=self.queue, task_id=task_id
        )

    def charges_per_run(self) -> dict[str, int]:
        rows = fetch_all(self.database_url,
                         f'SELECT task_id, count(*) FROM "{self.prefix}charges" GROUP BY task_id',
                         {})
        return {task_id: count for task_id, count in rows}


@pytest.fixture
def worker(pg_url: str, broker: Broker, table_prefix: str, tmp_path: Path) -> Iterator[Worker]:
    """A prefork ``celery worker`` on tests.proj, with its own queue and tables."""
    queue = f"duraflow-test-{uuid.uuid4().hex[:12]}"
    log_path = tmp_path / "worker.log"
    client = client_app(pg_url, broker.url, table_prefix, result_backend=broker.result_backend)
    process = None
    try:
        process = start_worker_process(queue, log_path, proj_env(
            pg_url, broker.url, table_prefix, result_backend=broker.result_backend))
        yield Worker(process=process, log_path=log_path, queue=queue, client=client,
                     database_url=pg_url, prefix=table_prefix)
    finally:
        end_project(client, pg_url, table_prefix, [process] if process is not None else [],
                    [queue])


def _wait_all(worker: Worker, results: list[AsyncResult]) -> list[object]:
    values = []
    for result in results:
        try:
            values.append(result.get(timeout=RESULT_TIMEOUT, propagate=True))
        except Exception as exc:
            pytest.fail(
                f"run {result.id} did not succeed ({type(exc).__name__}: {exc}).\n"
                f"worker log tail:\n{worker.log_tail()}",
                pytrace=False,
            )
    return values


def test_prefork_retries_charge_each_run_exactly_once(worker: Worker) -> None:
    """Under a prefork worker, a retry after a failed notify never charges the card again."""
    runs = 10
    results = [worker.submit(f"user-{n}", f"LIS-JFK-{n}") for n in range(runs)]
    values = _wait_all(worker, results)

    charges = worker.charges_per_run()
    problems = []
    for result, value in zip(results, values, strict=True):
        run = get_run(result.id, app=worker.client)
        if run is None:
            problems.append(f"{result.id}: no run recorded")
            continue
        steps = {s.key: s for s in run.steps}
        attempts = {key: s.attempts for key, s in steps.items()}
        if run.status != "succeeded":
            problems.append(f"{result.id}: run status {run.status!r} ({run.error})")
        if list(steps) != ["search", "pick", "book", "notify"]:
            problems.append(f"{result.id}: steps recorded {list(steps)}")
        if attempts.get("book") != 1 or attempts.get("notify") != 2:
            problems.append(f"{result.id}: step attempts {attempts}")
        statuses = {key: s.status for key, s in steps.items()}
        if any(status != "completed" for status in statuses.values()):
            problems.append(f"{result.id}: step statuses {statuses}")
        if charges.get(result.id) != 1:
            problems.append(f"{result.id}: {charges.get(result.id, 0)} charges in the ledger")
        if not isinstance(value, dict) or value["booking"] != steps["book"].result:
            problems.append(f"{result.id}: task returned {value!r}")
        result.forget()
    assert len(charges) == runs, f"ledger has charges for {len(charges)} runs, expected {runs}"
    assert not problems, "\n".join(problems) + f"\nworker log tail:\n{worker.log_tail()}"


def test_redelivered_succeeded_run_returns_recorded_result(worker: Worker) -> None:
    """A task id sent again after it succeeded gets the stored result and charges nothing."""
    task_id = f"trip-{uuid.uuid4()}"
    first = worker.submit("user-again", "OPO-GRU", task_id=task_id)
    [first_value] = _wait_all(worker, [first])
    before = get_run(task_id, app=worker.client)
    assert before is not None and before.status == "succeeded", worker.log_tail()

    # Drop the stored Celery result so that waiting below sees the second delivery's own.
    first.forget()
    again = worker.submit("user-again", "OPO-GRU", task_id=task_id)
    [second_value] = _wait_all(worker, [again])
    again.forget()

    after = get_run(task_id, app=worker.client)
    assert after is not None
    log = worker.log_tail()
    assert second_value == first_value, log
    assert worker.charges_per_run() == {task_id: 1}, log
    assert after.status == "succeeded", log
    assert after.attempts == before.attempts, log
    assert [(s.key, s.attempts) for s in after.steps] == [
        ("search", 1), ("pick", 1), ("book", 1), ("notify", 2)
    ], log


def _failure(worker: Worker, result: AsyncResult) -> BaseException:
    try:
        value = result.get(timeout=RESULT_TIMEOUT, propagate=True)
    except Exception as exc:
        return exc
    pytest.fail(f"run {result.id} succeeded with {value!r}; it should have failed.\n"
                f"worker log tail:\n{worker.log_tail()}", pytrace=False)


def test_unstorable_output_under_autoretry_books_once(worker: Worker) -> None:
    """autoretry_for=(Exception,) never re-runs a body whose output could not be stored."""
    result = worker.client.signature(
        "proj.book_unstorable", args=("user-x", "LIS-OPO")).apply_async(queue=worker.queue)
    error = _failure(worker, result)
    log = worker.log_tail()
    assert type(error).__name__ == "StepOutputNotSerializable", log
    assert result.id in str(error) and "'book'" in str(error), log
    assert 'result["booking"] is Booking' in str(error), log
    assert worker.charges_per_run() == {result.id: 1}, log
    run = get_run(result.id, app=worker.client)
    assert run is not None and run.status == "failed", log
    assert [(s.key, s.status, s.attempts) for s in run.steps] == [("book", "failed", 1)], log
    assert f"[{result.id}] retry:" not in log, log


def test_nested_key_too_long_is_refused_before_the_charge(worker: Worker) -> None:
    """A nested key PostgreSQL cannot hold is refused before the leaf body, with no retry."""
    result = worker.client.signature(
        "proj.book_deep", args=("user-y", "LIS-MAD", 6)).apply_async(queue=worker.queue)
    error = _failure(worker, result)
    log = worker.log_tail()
    assert type(error).__name__ == "InvalidStepName", log
    assert result.id in str(error), log
    assert "DataError" not in log and "StringDataRightTruncation" not in log, log
    assert worker.charges_per_run() == {}, log
    run = get_run(result.id, app=worker.client)
    assert run is not None and run.status == "failed", log
    assert f"[{result.id}] retry:" not in log, log


def test_worker_logs_its_store_once_at_start(worker: Worker) -> None:
    """A real worker names the store its runs go to, once, with no password."""
    lines = [line for line in worker.log_path.read_text(errors="replace").splitlines()
             if "celery-duraflow: runs are stored in" in line]
    assert len(lines) == 1, worker.log_tail()
    assert f"(tables {worker.prefix}*)" in lines[0]
    assert "127.0.0.1:5432/test" in lines[0]
