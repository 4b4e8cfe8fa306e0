"""Compensation (undoing completed steps) and cancellation, in every state of a run."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import update

from celery_duraflow import (
    DurableTask,
    RunCancelled,
    RunNotFound,
    cancel,
    get_run,
    sleep,
    step,
    wait_for_signal,
)
from celery_duraflow._config import config_for_app
from celery_duraflow._lease import keeper
from celery_duraflow._store import store_for
from tests.conftest import run_worker, wait_for_status

RESULT_TIMEOUT = 30.0


class NoSeats(Exception):
    """A failure Celery does not retry."""


class Crash(BaseException):
    """Stands in for the worker process dying in the middle of an undo."""


def _booking_task(app: Celery, undone: list[str], *, fail: BaseException | None = None,
                  undo_fails: int = 0, crash_once: list[bool] | None = None,
                  **options: Any) -> Any:
    """reserve-seat, charge-card (both undoable), send-ticket (not), then issue (fails)."""
    failures: Counter[str] = Counter()

    def release_seat(seat: str) -> str:
        if crash_once:
            crash_once.pop()
            raise Crash()
        undone.append(f"release {seat}")
        return "released"

    def refund(charge: dict[str, Any]) -> None:
        failures["refund"] += 1
        if failures["refund"] <= undo_fails:
            raise ConnectionError(f"refund service down (try {failures['refund']})")
        undone.append(f"refund {charge['amount']}")

    @app.task(base=DurableTask, name="proj.booking", **options)
    def booking() -> str:
        with step("reserve-seat", compensate=release_seat) as s:
            s.result = "12A"
        with step("charge-card", compensate=refund) as s:
            s.result = {"amount": 250}
        with step("send-ticket") as s:
            s.result = "sent"
        with step("issue"):
            if fail is not None:
                raise fail
        return "issued"

    return booking


def test_failed_run_undoes_completed_steps_in_reverse_order(
        make_app: Callable[..., Celery]) -> None:
    """A run that fails for good undoes its steps newest first; the caller sees the real error."""
    app = make_app()
    undone: list[str] = []
    task = _booking_task(app, undone, fail=NoSeats("the flight is full"))
    result = task.apply()
    assert isinstance(result.result, NoSeats)  # the caller still sees the real failure
    assert undone == ["refund 250", "release 12A"]
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "compensated"
    assert "NoSeats: the flight is full" in str(run.error)
    steps = {s.key: s.status for s in run.steps}
    assert steps["compensate:charge-card"] == "completed"
    assert steps["compensate:reserve-seat"] == "completed"
    assert "compensate:send-ticket" not in steps


def test_compensation_waits_until_the_retries_are_used_up(
        make_app: Callable[..., Celery]) -> None:
    """Nothing is undone while retries remain; each undo runs once, after the last retry failed."""
    app = make_app()
    undone: list[str] = []
    task = _booking_task(app, undone, fail=ConnectionError("issuer down"),
                         autoretry_for=(ConnectionError,), max_retries=2,
                         default_retry_delay=0)
    result = task.apply()
    assert isinstance(result.result, ConnectionError)
    assert undone == ["refund 250", "release 12A"]  # once, after the last retry
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "compensated" and run.attempts == 3


def test_an_undo_that_keeps_failing_fails_the_run_after_the_others(
        make_app: Callable[..., Celery]) -> None:
    """An undo that keeps failing fails the run, but only after every other undo has run."""
    app = make_app()
    undone: list[str] = []
    task = _booking_task(app, undone, fail=NoSeats("full"), undo_fails=99)
    result = task.apply()
    assert isinstance(result.result, NoSeats)
    assert undone == ["release 12A"]  # the other undo still ran
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed"
    assert "undoing step 'charge-card' failed: ConnectionError" in str(run.error)
    charge_undo = run.step("compensate:charge-card")
    assert charge_undo.status == "failed" and charge_undo.attempts == 3


def test_an_undo_that_fails_once_is_tried_again(make_app: Callable[..., Celery]) -> None:
    """An undo that fails once is tried again, and the run still ends compensated."""
    app = make_app()
    undone: list[str] = []
    result = _booking_task(app, undone, fail=NoSeats("full"), undo_fails=1).apply()
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "compensated"
    assert undone == ["refund 250", "release 12A"]
    assert run.step("compensate:charge-card").attempts == 2


def test_a_crash_while_compensating_resumes_and_never_undoes_twice(
        make_app: Callable[..., Celery]) -> None:
    """A crash while undoing resumes on the next delivery, and no undo already done is repeated."""
    app = make_app()
    undone: list[str] = []
    crash_once = [True]
    task = _booking_task(app, undone, fail=NoSeats("full"), crash_once=crash_once)
    task_id = str(uuid.uuid4())
    with pytest.raises(Crash):
        task.apply(task_id=task_id, throw=True)
    assert undone == ["refund 250"]  # the refund was done and recorded, then the crash
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "running"

    # The worker is gone; its lease expires and the run is delivered again.
    store = store_for(config_for_app(app))
    runs = store.tables.runs
    with store.engine.begin() as conn:
        conn.execute(update(runs).where(runs.c.task_id == task_id).values(
            lease_owner="gone-host|x|1|dead",
            lease_expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    again = task.apply(task_id=task_id)
    assert again.state == "IGNORED"
    assert undone == ["refund 250", "release 12A"]  # the refund was not repeated
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "compensated"
    assert "NoSeats" in str(run.error)


def test_cancel_a_waiting_run(make_app: Callable[..., Celery]) -> None:
    """Cancelling a waiting run undoes its steps, runs none of the rest, and closes the wait."""
    app = make_app(eager=False)
    undone: list[str] = []

    @app.task(base=DurableTask)
    def trip() -> str:
        with step("hold-seat", compensate=lambda seat: undone.append(f"release {seat}")) as s:
            s.result = "3C"
        wait_for_signal("approval")
        with step("book"):
            undone.append("booked?!")
        return "booked"

    with run_worker(app):
        result = trip.delay()
        wait_for_status(app, result.id, "waiting")
        assert cancel(result.id, app=app) is True
        with pytest.raises(RunCancelled, match="approval"):
            result.get(timeout=RESULT_TIMEOUT)
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "cancelled"
    assert undone == ["release 3C"]
    approval = run.step("approval")  # the wait it was stopped at is closed, not left waiting
    assert (approval.status, approval.error) == ("failed", "cancelled while waiting")
    assert cancel(result.id, app=app) is False  # it has ended


def test_cancel_a_sleeping_run_at_once(make_app: Callable[..., Celery]) -> None:
    """A sleeping run is cancelled at once, not when its sleep ends, and its steps are undone."""
    app = make_app(eager=False)
    undone: list[str] = []

    @app.task(base=DurableTask)
    def trip() -> str:
        with step("hold-seat", compensate=lambda seat: undone.append(f"release {seat}")) as s:
            s.result = "9F"
        sleep("cool-off", 3600)
        return "done"

    with run_worker(app):
        result = trip.delay()
        wait_for_status(app, result.id, "sleeping")
        assert cancel(result.id, app=app) is True
        wait_for_status(app, result.id, "cancelled")
    assert undone == ["release 9F"]


def test_cancel_a_running_run_stops_it_at_the_next_step(make_app: Callable[..., Celery]) -> None:
    """A cancelled running run finishes the step in progress, starts no other, and is undone."""
    app = make_app(eager=False, duraflow_lease_seconds=1)
    undone: list[str] = []
    ran: list[str] = []
    inside = threading.Event()
    release = threading.Event()

    @app.task(base=DurableTask)
    def trip() -> str:
        with step("hold-seat", compensate=lambda seat: undone.append(f"release {seat}")) as s:
            s.result = "1A"
        with step("slow-quote") as s:
            inside.set()
            release.wait(10)
            ran.append("slow-quote")
            s.result = 99
        with step("book"):
            ran.append("book")
        return "booked"

    with run_worker(app):
        result = trip.delay()
        assert inside.wait(10)
        assert cancel(result.id, app=app) is True
        # The worker hears of it when it next renews the lease (every third of a second).
        owner = get_run(result.id, app=app).lease_owner  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while not keeper().cancelled(result.id, owner) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert keeper().cancelled(result.id, owner)
        release.set()
        wait_for_status(app, result.id, "cancelled")
    assert ran == ["slow-quote"]  # the step in progress finished; the next one never ran
    assert undone == ["release 1A"]


def test_cancel_an_unknown_run(make_app: Callable[..., Celery]) -> None:
    """Cancelling a task id that has no run raises RunNotFound naming that id."""
    app = make_app()
    missing = str(uuid.uuid4())
    with pytest.raises(RunNotFound, match=missing):
        cancel(missing, app=app)


def test_cancelled_run_without_compensations(make_app: Callable[..., Celery]) -> None:
    """A cancelled run with nothing to undo ends `cancelled`, with the error 'cancelled'."""
    app = make_app(eager=False)

    @app.task(base=DurableTask)
    def trip() -> None:
        wait_for_signal("go")

    with run_worker(app):
        result = trip.delay()
        wait_for_status(app, result.id, "waiting")
        cancel(result.id, app=app)
        run = wait_for_status(app, result.id, "cancelled")
    assert run.error == "cancelled"


def test_retry_of_a_compensated_run_must_start_at_an_undone_step(
        make_app: Callable[..., Celery]) -> None:
    """A compensated run is retried only from its first undone step, with its retry count reset."""
    from celery_duraflow import RunStateError, retry_run

    app = make_app(eager=False)  # the retry is sent to the broker; no worker takes it here
    undone: list[str] = []
    result = _booking_task(app, undone, fail=NoSeats("full")).apply()
    assert get_run(result.id, app=app).status == "compensated"  # type: ignore[union-attr]
    with pytest.raises(RunStateError, match="were undone"):
        retry_run(result.id, app=app)
    with pytest.raises(RunStateError, match="'reserve-seat' was undone"):
        retry_run(result.id, from_step="send-ticket", app=app)
    # From the first undone step: accepted, and sent with its retry count started over.
    rerun = retry_run(result.id, from_step="reserve-seat", app=app)
    assert rerun.status == "running" and rerun.retries == 0
