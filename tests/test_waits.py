"""Waits on a real (in-process) Celery worker: sleep, signals, child runs.

Every test runs on SQLite and on PostgreSQL. The worker consumes from the
in-memory broker in this process, so what wakes a run is what wakes it in
production: a broker countdown, the sweep, send_signal, or a child's end.
"""

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
from celery.result import AsyncResult

from celery_duraflow import (
    ChildFailed,
    ChildTimeout,
    DurableTask,
    NotInDurableTask,
    RunNotFound,
    SignalTimeout,
    child,
    get_run,
    recover,
    send_signal,
    sleep,
    step,
    wait_for_signal,
)
from celery_duraflow._waits import child_task_id
from tests.conftest import run_worker, wait_for_status

RESULT_TIMEOUT = 30.0


def _worker_app(make_app: Callable[..., Celery], **conf: Any) -> Celery:
    return make_app(eager=False, **conf)


def test_short_sleep_wakes_on_time_through_the_broker(make_app: Callable[..., Celery]) -> None:
    """Under the eta threshold a sleep needs nothing but a worker; the steps before it run once."""
    app = _worker_app(make_app)
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask)
    def nap() -> float:
        with step("before") as s:
            calls["before"] += 1
            s.result = time.time()
        sleep("nap", 0.6)
        with step("after") as s:
            calls["after"] += 1
            s.result = time.time()
        return float(s.result)

    with run_worker(app):
        result = nap.delay()
        sleeping = wait_for_status(app, result.id, "sleeping")
        assert sleeping.wait_kind == "sleep" and sleeping.waiting_for == "nap"
        assert sleeping.wake_at is not None
        assert sleeping.step("nap").status == "waiting"
        finished = result.get(timeout=RESULT_TIMEOUT)
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded"
    assert calls == {"before": 1, "after": 1}
    assert finished >= sleeping.wake_at.timestamp()
    assert [(s.key, s.status) for s in run.steps] == [
        ("before", "completed"), ("nap", "completed"), ("after", "completed")]
    assert run.wait_kind is None and run.wake_at is None


def test_long_sleep_is_woken_by_the_sweep_not_the_broker(make_app: Callable[..., Celery]) -> None:
    """Over the threshold no countdown is sent: the run sleeps until a sweep finds it due."""
    app = _worker_app(make_app, duraflow_eta_threshold=0.0)
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask)
    def nap() -> str:
        with step("before"):
            calls["before"] += 1
        # Long enough that the sweep below surely runs before it is due, even on a slow,
        # busy machine (each SQLite commit waits for the disk).
        sleep("nap", 2.0)
        return "awake"

    with run_worker(app):
        result = nap.delay()
        sleeping = wait_for_status(app, result.id, "sleeping")
        assert recover(app) == []  # not due yet: nothing is sent
        assert sleeping.wake_at is not None
        time.sleep(max(0.0, sleeping.wake_at.timestamp() - time.time()) + 0.05)
        time.sleep(0.5)  # no message was scheduled: without a sweep it keeps sleeping
        assert wait_for_status(app, result.id, "sleeping").status == "sleeping"
        assert recover(app) == [result.id]
        assert result.get(timeout=RESULT_TIMEOUT) == "awake"
    assert calls == {"before": 1}


def test_sleep_until_a_moment_already_past_returns_at_once(
        make_app: Callable[..., Celery]) -> None:
    """Sleeping until a moment already past returns at once, and the sleep is recorded completed."""
    app = make_app()

    @app.task(base=DurableTask)
    def task() -> str:
        sleep("past", until=datetime.now(UTC) - timedelta(seconds=5))
        return "went on"

    result = task.apply()
    assert result.get() == "went on"
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded"
    assert run.step("past").status == "completed"


def test_sleep_arguments_are_checked(make_app: Callable[..., Celery]) -> None:
    """sleep() refuses a duration and until= together, and refuses to run outside a durable task."""
    app = make_app()

    @app.task(base=DurableTask)
    def both() -> None:
        sleep("x", 1, until=datetime.now(UTC))

    assert isinstance(both.apply().result, TypeError)
    with pytest.raises(NotInDurableTask, match="'x'"):
        sleep("x", 1)


def test_signal_wakes_a_waiting_run_and_the_first_payload_wins(
        make_app: Callable[..., Celery]) -> None:
    """A signal wakes a waiting run, which reruns no step; the first payload sent is kept."""
    app = _worker_app(make_app)
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask)
    def approve(amount: int) -> dict[str, Any]:
        with step("quote") as s:
            calls["quote"] += 1
            s.result = amount * 2
        decision = wait_for_signal("approval")
        with step("book") as s:
            calls["book"] += 1
            s.result = {"approved": decision["approved"], "total": amount * 2}
        return dict(s.result)

    with run_worker(app):
        result = approve.delay(21)
        waiting = wait_for_status(app, result.id, "waiting")
        assert (waiting.wait_kind, waiting.waiting_for, waiting.wake_at) == (
            "signal", "approval", None)
        assert send_signal(result.id, "approval", {"approved": True}, app=app) is True
        assert send_signal(result.id, "approval", {"approved": False}, app=app) is False
        assert result.get(timeout=RESULT_TIMEOUT) == {"approved": True, "total": 42}
    assert calls == {"quote": 1, "book": 1}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded"
    assert run.step("approval").result == {"signal": "approval", "payload": {"approved": True}}


def test_signal_sent_before_the_wait_is_kept_for_it(make_app: Callable[..., Celery]) -> None:
    """A signal sent before the run reaches its wait is kept, and answers that wait."""
    app = _worker_app(make_app)

    @app.task(base=DurableTask)
    def later() -> Any:
        sleep("first", 0.4)
        return wait_for_signal("approval")

    with run_worker(app):
        result = later.delay()
        wait_for_status(app, result.id, "sleeping")
        assert send_signal(result.id, "approval", "yes", app=app) is True
        assert result.get(timeout=RESULT_TIMEOUT) == "yes"
    run = get_run(result.id, app=app)
    assert run is not None and [s.key for s in run.steps] == ["first", "approval"]


def test_signal_timeout_is_raised_and_replayed(make_app: Callable[..., Celery]) -> None:
    """After its timeout the wait raises SignalTimeout, also on every later attempt."""
    app = _worker_app(make_app)
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, bind=True, max_retries=1)
    def impatient(self: DurableTask) -> str:
        try:
            wait_for_signal("approval", timeout=0.4)
            outcome = "approved"
        except SignalTimeout:
            outcome = "timed out"
        with step("decide") as s:
            calls[outcome] += 1
            if calls[outcome] == 1:
                raise self.retry(countdown=0)
            s.result = outcome
        return str(s.result)

    with run_worker(app):
        result = impatient.delay()
        wait_for_status(app, result.id, "waiting")
        assert result.get(timeout=RESULT_TIMEOUT) == "timed out"
        # Too late: stored, but the run already recorded its timeout.
        assert send_signal(result.id, "approval", "late", app=app) is True
    assert calls == {"timed out": 2}
    run = get_run(result.id, app=app)
    assert run is not None and run.step("approval").result["timed_out"] is True


def test_signal_to_an_unknown_run_is_a_clear_error(make_app: Callable[..., Celery]) -> None:
    """A signal to an unknown task id raises RunNotFound naming the run and the signal."""
    app = make_app()
    missing = str(uuid.uuid4())
    with pytest.raises(RunNotFound, match=missing) as info:
        send_signal(missing, "approval", True, app=app)
    assert info.value.task_id == missing and info.value.step_key == "approval"


def test_child_result_comes_back_and_a_replay_starts_no_second_child(
        make_app: Callable[..., Celery]) -> None:
    """A child's result comes back to its parent; a redelivered parent starts no second child."""
    app = _worker_app(make_app)
    calls: Counter[str] = Counter()
    release = threading.Event()

    @app.task(base=DurableTask)
    def search(query: str) -> list[str]:
        calls["child"] += 1
        release.wait(10)
        with step("fetch") as s:
            s.result = [f"{query}-1", f"{query}-2"]
        return list(s.result)

    @app.task(base=DurableTask)
    def parent(query: str) -> dict[str, Any]:
        with step("prepare"):
            calls["prepare"] += 1
        offers = child("search", search.s(query))
        return {"offers": offers}

    with run_worker(app, pool="threads", concurrency=3):
        result = parent.delay("LIS")
        waiting = wait_for_status(app, result.id, "waiting")
        child_id = child_task_id(result.id, "search")
        assert (waiting.wait_kind, waiting.waiting_for) == ("child", child_id)
        # The parent is delivered again while its child runs: it waits again, and the
        # child is not started a second time.
        parent.apply_async(args=("LIS",), task_id=result.id)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # until that delivery ran and waits again
            again = get_run(result.id, app=app)
            if again is not None and again.attempts == 2 and again.status == "waiting":
                break
            time.sleep(0.02)
        else:
            raise AssertionError("the second delivery of the parent did not wait again")
        release.set()
        assert result.get(timeout=RESULT_TIMEOUT) == {"offers": ["LIS-1", "LIS-2"]}
    assert calls == {"prepare": 1, "child": 1}
    child_run = get_run(child_id, app=app)
    assert child_run is not None and child_run.status == "succeeded"
    assert child_run.parent_id == result.id
    run = get_run(result.id, app=app)
    assert run is not None
    assert run.step("search").result == {"child": child_id, "result": ["LIS-1", "LIS-2"]}


def test_failed_child_raises_child_failed_in_the_parent(make_app: Callable[..., Celery]) -> None:
    """A child that fails raises ChildFailed in its parent, with the child's id and error."""
    app = _worker_app(make_app)

    @app.task(base=DurableTask)
    def broken() -> None:
        raise ValueError("no seats left")

    @app.task(base=DurableTask)
    def parent() -> str:
        try:
            child("book", broken.s())
        except ChildFailed as exc:
            return f"child {exc.child_id} failed: {exc.error}"
        return "unexpected"

    with run_worker(app):
        result = parent.delay()
        message = result.get(timeout=RESULT_TIMEOUT)
    child_id = child_task_id(result.id, "book")
    assert message == f"child {child_id} failed: ValueError: no seats left"


def test_child_timeout(make_app: Callable[..., Celery]) -> None:
    """A parent stops waiting for a child at its timeout; the child goes on and finishes."""
    app = _worker_app(make_app)
    release = threading.Event()

    @app.task(base=DurableTask)
    def slow() -> str:
        release.wait(10)
        return "late"

    @app.task(base=DurableTask)
    def parent() -> str:
        try:
            return str(child("slow", slow.s(), timeout=0.3))
        except ChildTimeout:
            return "gave up"

    with run_worker(app, pool="threads", concurrency=2):
        result = parent.delay()
        assert result.get(timeout=RESULT_TIMEOUT) == "gave up"
        release.set()
        child_id = child_task_id(result.id, "slow")
        AsyncResult(child_id, app=app)  # the child goes on and finishes on its own
        assert wait_for_status(app, child_id, "succeeded").status == "succeeded"


def test_child_must_be_durable(make_app: Callable[..., Celery]) -> None:
    """child() refuses a task that is not a DurableTask, with a TypeError saying so."""
    app = make_app()

    @app.task
    def plain() -> int:
        return 1

    @app.task(base=DurableTask)
    def parent() -> Any:
        return child("plain", plain.s())

    outcome = parent.apply().result
    assert isinstance(outcome, TypeError) and "not a DurableTask" in str(outcome)


def test_signal_sent_as_a_celery_task(make_app: Callable[..., Celery]) -> None:
    """A web handler with only a broker at hand sends celery_duraflow.send_signal."""
    app = _worker_app(make_app)

    @app.task(base=DurableTask)
    def approve() -> Any:
        return wait_for_signal("approval")

    with run_worker(app):
        result = approve.delay()
        wait_for_status(app, result.id, "waiting")
        sent = app.send_task("celery_duraflow.send_signal",
                             args=(result.id, "approval", {"approved": True}))
        assert sent.get(timeout=RESULT_TIMEOUT) is True
        assert result.get(timeout=RESULT_TIMEOUT) == {"approved": True}
