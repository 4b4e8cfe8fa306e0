"""On PostgreSQL the database's clock decides leases and wake-ups, not the worker's.

Two hosts whose clocks differ by minutes must never take each other's runs
early. The worker tests shift ``time.time()`` in a real ``celery worker``
(``PROJ_CLOCK_SHIFT`` in tests.proj) by ten minutes one way, and in another by
ten minutes the other way.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from celery import Celery

from celery_duraflow import DurableTask, get_run, step
from celery_duraflow._store import close_all_stores
from tests.conftest import app_factory, drop_tables
from tests.workers import (
    client_app,
    end_project,
    fetch_all,
    log_tail,
    proj_env,
    start_worker_process,
    wait_for_run,
)

pytestmark = pytest.mark.postgres

SHIFT = 600.0  # ten minutes


def _database_now(pg_url: str) -> datetime:
    value: datetime = fetch_all(pg_url, "SELECT clock_timestamp()", {})[0][0]
    return value


@pytest.fixture
def shifted_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's ``time.time()`` ten minutes ahead, as on a host whose clock drifted;
    the clock's offset is measured afresh under it and forgotten afterwards."""
    from celery_duraflow import _clock

    host_time = time.time
    monkeypatch.setattr(time, "time", lambda: host_time() + SHIFT)
    monkeypatch.setattr(_clock, "_measured_at", None)
    monkeypatch.setattr(_clock, "_offset", 0.0)
    close_all_stores()  # new connections, which measure the clock
    yield
    close_all_stores()


def test_stored_timestamps_follow_the_database_clock_on_a_drifted_host(
        pg_url: str, table_prefix: str, shifted_host: None) -> None:
    """On a host ten minutes ahead, a run's stored start and end times are the database's
    time, not the host's."""
    app: Celery = app_factory(pg_url, table_prefix)()

    @app.task(base=DurableTask)
    def charge() -> str:
        with step("charge"):
            pass
        return "ok"

    try:
        task_id = f"clock-{uuid.uuid4().hex[:8]}"
        assert charge.apply(task_id=task_id).get() == "ok"
        run = get_run(task_id, app=app)
        assert run is not None
        database_now = _database_now(pg_url)
        for moment in (run.created_at, run.updated_at):
            assert abs((moment - database_now).total_seconds()) < 60, (moment, database_now)
    finally:
        close_all_stores()
        drop_tables(pg_url, table_prefix)


def test_offset_is_measured_again_once_a_minute_on_an_attempts_connection(
        pg_url: str, table_prefix: str, shifted_host: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A host clock that jumps after the connection was opened is caught up with at the next
    attempt once the last measure is a minute old."""
    from celery_duraflow import _clock

    app: Celery = app_factory(pg_url, table_prefix)()

    @app.task(base=DurableTask)
    def charge() -> str:
        with step("charge"):
            pass
        return "ok"

    try:
        assert charge.apply(task_id=f"clock-{uuid.uuid4().hex[:8]}").get() == "ok"
        assert abs(_clock.offset() + SHIFT) < 5
        jumped = time.time
        monkeypatch.setattr(time, "time", lambda: jumped() - 2 * SHIFT)  # now 10 min behind
        monkeypatch.setattr(_clock, "_measured_at", time.monotonic() - _clock.MEASURE_EVERY - 1)
        assert charge.apply(task_id=f"clock-{uuid.uuid4().hex[:8]}").get() == "ok"
        assert abs(_clock.offset() - SHIFT) < 5
        assert abs((_clock.now() - _database_now(pg_url)).total_seconds()) < 5
    finally:
        close_all_stores()
        drop_tables(pg_url, table_prefix)


@pytest.mark.subprocess
@pytest.mark.redis
def test_workers_with_clocks_twenty_minutes_apart_never_take_a_live_run(
        pg_url: str, redis_url: str, table_prefix: str, tmp_path: Path) -> None:
    """A run leased by a worker ten minutes behind, delivered again to a worker ten minutes
    ahead while its step still runs, is not taken over: the step body runs once."""
    queues = [f"duraflow-clock-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    logs = [tmp_path / "behind.log", tmp_path / "ahead.log"]
    client = client_app(pg_url, redis_url, table_prefix)
    workers = []
    try:
        for queue, log, shift in zip(queues, logs, (-SHIFT, SHIFT), strict=True):
            workers.append(start_worker_process(queue, log, proj_env(
                pg_url, redis_url, table_prefix, PROJ_CLOCK_SHIFT=str(shift),
                PROJ_LEASE_SECONDS="3"), concurrency=1))
        task_id = f"clock-{uuid.uuid4().hex[:8]}"
        client.send_task("proj.slow_charge", args=(9.0,), task_id=task_id, queue=queues[0])
        wait_for_run(client, task_id, "running", logs[0])
        time.sleep(1.0)  # the body has started and the heartbeat renews every second
        client.send_task("proj.slow_charge", args=(9.0,), task_id=task_id, queue=queues[1])
        run = wait_for_run(client, task_id, "succeeded", logs[0], timeout=60)
        time.sleep(2.0)  # the second delivery, if it ran the body, has recorded it by now
        charges = fetch_all(pg_url, f'SELECT count(*) FROM "{table_prefix}wait_events" '
                            "WHERE task_id = :t AND event = 'charge'", {"t": task_id})[0][0]
        assert charges == 1, (log_tail(logs[0]), log_tail(logs[1]))
        assert abs((run.updated_at - _database_now(pg_url)).total_seconds()) < 60
        assert run.updated_at - run.created_at < timedelta(minutes=1)
        assert datetime.now(UTC) - run.created_at < timedelta(minutes=5)
    finally:
        end_project(client, pg_url, table_prefix, workers, queues)
