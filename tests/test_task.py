"""DurableTask runs on SQLite and PostgreSQL: retries, results, statuses, errors."""

from __future__ import annotations

import datetime as dt
import decimal
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Retry
from sqlalchemy import select, update

from celery_duraflow import (
    DurableTask,
    NotInDurableTask,
    StepConflict,
    StepOutputNotSerializable,
    get_run,
    step,
)
from celery_duraflow._config import config_for_app
from celery_duraflow._store import store_for
from tests.conftest import run_worker


class Flaky(Exception):
    """Raised by test bodies to make Celery retry the task."""


def test_autoretry_charges_once(make_app: Callable[..., Celery]) -> None:
    """The booking flow from the essay: notify fails, the retry does not book again."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=5)
    def book_trip(user: str) -> Any:
        with step("search-flights") as s:
            calls["search"] += 1
            s.result = [{"flight": "LH123", "price": 420}, {"flight": "BA9", "price": 380}]
        flights = s.result
        with step("pick-flight") as s:
            calls["pick"] += 1
            s.result = min(flights, key=lambda f: f["price"])
        flight = s.result
        with step("book-flight") as s:
            calls["book"] += 1
            s.result = {"booking": f"{user}-{flight['flight']}", "key": s.idempotency_key}
        booking = s.result
        with step("notify-user") as s:
            calls["notify"] += 1
            if calls["notify"] < 3:
                raise Flaky("mail server down")
            s.result = "sent"
        return booking

    result = book_trip.apply(args=("ann",))
    assert result.successful(), result.traceback
    assert calls == {"search": 1, "pick": 1, "book": 1, "notify": 3}
    run = get_run(result.id, app=app)
    assert run is not None
    assert run.status == "succeeded"
    assert run.attempts == 3
    assert run.result == result.get()
    assert [(s.key, s.status, s.attempts) for s in run.steps] == [
        ("search-flights", "completed", 1),
        ("pick-flight", "completed", 1),
        ("book-flight", "completed", 1),
        ("notify-user", "completed", 3),
    ]
    assert run.step("book-flight").result == {"booking": "ann-BA9",
                                              "key": result.get()["key"]}
    assert run.step("notify-user").completed_at is not None


def test_step_attributes_across_attempts(make_app: Callable[..., Celery]) -> None:
    """cached, attempt and idempotency_key tell the body what happened before."""
    app = make_app()
    seen: list[tuple[str, bool, int, str]] = []

    @app.task(base=DurableTask, bind=True, max_retries=3)
    def task(self: DurableTask) -> Any:
        with step("pay") as pay:
            pass
        seen.append(("pay", pay.cached, pay.attempt, pay.idempotency_key))
        with step("ship") as ship:
            if self.request.retries == 0:
                raise self.retry(countdown=0)
        seen.append(("ship", ship.cached, ship.attempt, ship.idempotency_key))
        return None

    result = task.apply()
    assert result.successful(), result.traceback
    (first_pay, second_pay, ship) = seen
    assert first_pay[1:3] == (False, 1)
    assert second_pay[1:3] == (True, 1)
    assert first_pay[3] == second_pay[3]
    assert ship[1:3] == (False, 2)
    assert ship[3] != first_pay[3]
    uuid.UUID(ship[3])  # a real UUID, usable by APIs that want one


def test_retries_exhausted_marks_run_failed(make_app: Callable[..., Celery]) -> None:
    """When Celery gives up, the run and the step say failed, with the error text."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=2)
    def task() -> None:
        with step("ok"):
            calls["ok"] += 1
        with step("never"):
            calls["never"] += 1
            raise Flaky("still down")

    result = task.apply()
    assert isinstance(result.result, Flaky)
    assert calls == {"ok": 1, "never": 3}
    run = get_run(result.id, app=app)
    assert run is not None
    assert run.status == "failed"
    assert run.error is not None and "still down" in run.error
    never = run.step("never")
    assert (never.status, never.attempts) == ("failed", 3)
    assert never.error is not None and "Flaky: still down" in never.error


def test_exception_not_in_autoretry_fails_without_retry(make_app: Callable[..., Celery]) -> None:
    """An exception Celery does not retry propagates unchanged and fails the run."""
    app = make_app()

    @app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=2)
    def task() -> None:
        with step("bad"):
            raise KeyError("missing")

    result = task.apply()
    assert isinstance(result.result, KeyError)
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed"
    assert run.step("bad").attempts == 1


def test_redelivery_of_succeeded_run_runs_nothing(make_app: Callable[..., Celery]) -> None:
    """The same task id delivered again returns the recorded result; no step runs."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask)
    def task(x: int) -> dict[str, Any]:
        with step("charge") as s:
            calls["charge"] += 1
            s.result = x * 2
        calls["after"] += 1
        return {"charged": s.result, "at": dt.datetime(2026, 1, 2, tzinfo=dt.UTC)}

    task_id = str(uuid.uuid4())
    first = task.apply(args=(21,), task_id=task_id)
    again = task.apply(args=(21,), task_id=task_id)
    assert first.get() == again.get() == {"charged": 42,
                                          "at": dt.datetime(2026, 1, 2, tzinfo=dt.UTC)}
    assert calls == {"charge": 1, "after": 1}
    run = get_run(task_id, app=app)
    assert run is not None and run.attempts == 1


def test_outputs_round_trip_rich_types(make_app: Callable[..., Celery]) -> None:
    """datetime, Decimal, UUID and bytes come back as themselves on replay."""
    app = make_app()
    value = {
        "when": dt.datetime(2026, 12, 2, 10, 30, tzinfo=dt.UTC),
        "day": dt.date(2026, 12, 24),
        "price": decimal.Decimal("420.10"),
        "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "blob": b"\x00\xffbinary",
    }
    seen: list[Any] = []

    @app.task(base=DurableTask, bind=True, max_retries=1)
    def task(self: DurableTask) -> None:
        with step("rich") as s:
            s.result = value
        seen.append(s.result)
        if self.request.retries == 0:
            raise self.retry(countdown=0)

    assert task.apply().successful()
    assert seen == [value, value]
    assert isinstance(seen[1]["price"], decimal.Decimal)


def test_unserializable_output_is_refused(make_app: Callable[..., Celery]) -> None:
    """A set cannot be stored: clear error, step failed for good, no retry runs it again."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, autoretry_for=(StepOutputNotSerializable,), max_retries=1)
    def task() -> Any:
        with step("make-set") as s:
            calls["make-set"] += 1
            s.result = {1, 2} if calls["make-set"] == 1 else [1, 2]
        return s.result

    result = task.apply()
    assert isinstance(result.result, StepOutputNotSerializable)
    assert calls["make-set"] == 1
    run = get_run(result.id, app=app)
    assert run is not None
    assert run.status == "failed"
    assert run.step("make-set").attempts == 1

    @app.task(base=DurableTask, name="always-set")
    def always() -> None:
        with step("make-set") as s:
            s.result = {1, 2}

    failed = always.apply()
    err = failed.result
    assert isinstance(err, StepOutputNotSerializable)
    assert err.task_id == failed.id and err.step_key == "make-set"
    assert failed.id in str(err) and "'make-set'" in str(err) and "set" in str(err)
    run = get_run(failed.id, app=app)
    assert run is not None
    assert run.step("make-set").status == "failed"
    assert run.step("make-set").result is None


def test_unserializable_return_value_fails_the_run(make_app: Callable[..., Celery]) -> None:
    """A task result the serializer refuses is an error naming the task."""
    app = make_app()

    @app.task(base=DurableTask)
    def task() -> object:
        return object()

    result = task.apply()
    assert isinstance(result.result, StepOutputNotSerializable)
    assert result.id in str(result.result)
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed"


def test_in_doubt_step_runs_again_with_same_key(make_app: Callable[..., Celery]) -> None:
    """A step left 'running' by a dead process re-runs with in_doubt and the same key."""
    app = make_app()
    seen: list[tuple[bool, int, str]] = []

    @app.task(base=DurableTask)
    def task() -> None:
        with step("charge") as s:
            seen.append((s.in_doubt, s.attempt, s.idempotency_key))

    task_id = str(uuid.uuid4())
    assert task.apply(task_id=task_id).successful()
    # Make the store look like a process died inside the body.
    store = store_for(config_for_app(app))
    steps = store.tables.steps
    runs = store.tables.runs
    with store.engine.begin() as conn:
        conn.execute(update(steps).values(status="running", output=None, completed_at=None))
        conn.execute(update(runs).values(status="running"))
    assert task.apply(task_id=task_id).successful()
    assert seen[0][:2] == (False, 1)
    assert seen[1][:2] == (True, 2)
    assert seen[0][2] == seen[1][2]


def test_concurrent_claim_is_refused(make_app: Callable[..., Celery]) -> None:
    """A claimed step (on_in_doubt='raise') claimed again meanwhile does not run its body."""
    from celery_duraflow._context import get_current_run

    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask)
    def task() -> None:
        ctx = get_current_run()
        assert ctx is not None
        # Something claims the step between the attempt's load and its claim.
        ctx.store.claim_step(ctx.task_id, "charge", ctx.owner, None)
        with step("charge", on_in_doubt="raise"):
            calls["charge"] += 1

    result = task.apply()
    assert isinstance(result.result, StepConflict)
    assert result.result.step_key == "charge"
    assert calls["charge"] == 0


def test_completed_elsewhere_keeps_the_recorded_output(make_app: Callable[..., Celery]) -> None:
    """If the step was completed meanwhile, this attempt's output does not replace it."""
    from celery_duraflow._context import get_current_run

    app = make_app()

    @app.task(base=DurableTask)
    def task() -> None:
        with step("charge") as s:
            ctx = get_current_run()
            assert ctx is not None
            ctx.store.record_step(ctx.task_id, "charge", ctx.owner, status="completed",
                                  started_at=datetime.now(UTC), output='"first"',
                                  serializer="json")
            s.result = "second"

    result = task.apply()
    assert isinstance(result.result, StepConflict)
    run = get_run(result.id, app=app)
    assert run is not None
    assert run.step("charge").result == "first"


def test_attempt_that_lost_its_lease_records_nothing(make_app: Callable[..., Celery]) -> None:
    """Fencing: once another owner holds the run, this attempt neither runs nor records."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask)
    def task() -> None:
        with step("first") as s:
            calls["first"] += 1
            store = store_for(config_for_app(app))
            runs = store.tables.runs
            with store.engine.begin() as conn:
                conn.execute(update(runs).values(lease_owner="another-host|x|1|abc"))
            s.result = "done"
        with step("second"):
            calls["second"] += 1

    result = task.apply()
    assert result.state == "IGNORED"
    assert calls == {"first": 1}
    run = get_run(result.id, app=app)
    assert run is not None
    assert run.status == "running"  # the new owner decides how it ends
    assert run.steps == ()  # the body ran, but its end was not recorded: fenced out


def test_step_outside_a_run_raises(make_app: Callable[..., Celery]) -> None:
    """step() with no durable run is refused instead of pretending to be durable."""
    app = make_app()
    with pytest.raises(NotInDurableTask, match="outside a durable task"):
        step("x")

    @app.task(base=DurableTask)
    def task() -> None:
        with step("x"):
            pass

    with pytest.raises(NotInDurableTask):
        task()  # a plain function call has no task id, so no run


def test_invalid_step_names(make_app: Callable[..., Celery]) -> None:
    """Empty, non-string and malformed names are refused with the task id named."""
    from celery_duraflow import InvalidStepName

    app = make_app()

    @app.task(base=DurableTask)
    def task(name: Any) -> None:
        step(name).run(lambda: None)

    for bad in ("", "   ", 42, None, "a/b", "a#2", "x" * 201, "tab\there"):
        result = task.apply(args=(bad,))
        assert isinstance(result.result, InvalidStepName), bad
        assert result.id in str(result.result)
        run = get_run(result.id, app=app)
        assert run is not None and run.steps == ()


def test_nested_eager_apply_of_another_task(make_app: Callable[..., Celery]) -> None:
    """A durable task applied inside another keeps its own run; the outer one continues."""
    app = make_app()

    @app.task(base=DurableTask)
    def inner(x: int) -> int:
        with step("inner-step") as s:
            s.result = x + 1
        return int(s.result)

    @app.task(base=DurableTask)
    def outer() -> int:
        with step("before") as s:
            s.result = 1
        value = inner.apply(args=(s.result,)).get()
        with step("after") as s:
            s.result = value * 10
        return int(s.result)

    result = outer.apply()
    assert result.get() == 20
    run = get_run(result.id, app=app)
    assert run is not None
    assert [s.key for s in run.steps] == ["before", "after"]


def test_retry_raised_inside_step_leaves_run_running(make_app: Callable[..., Celery]) -> None:
    """Between attempts the run is 'running' and the failed step is recorded as failed."""
    app = make_app(task_eager_propagates=True)

    @app.task(base=DurableTask, bind=True, max_retries=3)
    def task(self: DurableTask) -> None:
        with step("first"):
            pass
        with step("second"):
            raise self.retry(countdown=60)

    task_id = str(uuid.uuid4())
    with pytest.raises(Retry):
        task.apply(task_id=task_id)
    run = get_run(task_id, app=app)
    assert run is not None
    assert run.status == "running"
    assert [(s.key, s.status) for s in run.steps] == [("first", "completed"),
                                                      ("second", "failed")]


def test_get_run_of_unknown_task_is_none(make_app: Callable[..., Celery]) -> None:
    """get_run() answers None for an id it never saw."""
    app = make_app()
    assert get_run("no-such-task", app=app) is None


def book_then_notify_task(app: Celery, calls: Counter[str]) -> Any:
    """A task whose notify step fails once per run, retried through the broker."""

    @app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3,
              retry_kwargs={"countdown": 0})
    def task(n: int) -> int:
        with step("book") as s:
            calls[f"book-{n}"] += 1
            s.result = n
        with step("notify"):
            calls[f"notify-{n}"] += 1
            if calls[f"notify-{n}"] == 1:
                raise Flaky("first notify fails")
        return int(s.result)

    return task


def test_real_worker_memory_broker(make_app: Callable[..., Celery]) -> None:
    """An in-process worker retries through the broker and books once."""
    app = make_app(eager=False)
    calls: Counter[str] = Counter()

    task = book_then_notify_task(app, calls)

    with run_worker(app, pool="threads", concurrency=2):
        results = [task.delay(n) for n in range(4)]
        assert [r.get(timeout=30) for r in results] == [0, 1, 2, 3]
    assert all(calls[f"book-{n}"] == 1 and calls[f"notify-{n}"] == 2 for n in range(4))


@pytest.mark.redis
def test_real_worker_redis_broker(make_app: Callable[..., Celery], redis_url: str) -> None:
    """Over Redis, with an in-process worker, autoretry skips completed steps."""
    app = make_app(eager=False, broker=redis_url,
                   task_default_queue=f"q-{uuid.uuid4().hex[:8]}")
    calls: Counter[str] = Counter()

    task = book_then_notify_task(app, calls)

    with run_worker(app, pool="solo"):
        results = [task.delay(n) for n in range(3)]
        assert [r.get(timeout=30) for r in results] == [0, 1, 2]
    assert all(calls[f"book-{n}"] == 1 and calls[f"notify-{n}"] == 2 for n in range(3))
    store = store_for(config_for_app(app))
    with store.engine.connect() as conn:
        rows = conn.execute(select(store.tables.runs.c.status)).scalars().all()
    assert rows == ["succeeded"] * 3


def test_nested_attempt_of_same_run_continues_it(make_app: Callable[..., Celery]) -> None:
    """A retry run inside the failing attempt's call stack (old eager mode) continues the run."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, bind=True, max_retries=3)
    def task(self: DurableTask) -> str:
        with step("a") as s:
            calls["a"] += 1
            s.result = "A"
        try:
            with step("b") as s:
                calls["b"] += 1
                if calls["b"] == 1:
                    raise Flaky("b fails once")
                s.result = "B"
        except Flaky as exc:
            # What Celery's eager retry once did: run the next attempt right here,
            # with the same task id, then unwind with Retry.
            nested = self.apply(task_id=self.request.id, retries=self.request.retries + 1)
            calls["nested-result"] += nested.get() == "AB"
            raise Retry(exc=exc, when=0) from exc
        return "A" + str(s.result)

    task_id = str(uuid.uuid4())
    outer = task.apply(task_id=task_id)
    assert outer.state == "RETRY"
    assert calls == {"a": 1, "b": 2, "nested-result": 1}
    run = get_run(task_id, app=app)
    assert run is not None
    assert run.status == "succeeded"  # the outer attempt's unwinding did not undo it
    assert run.attempts == 2
    assert run.result == "AB"
    assert [(s.key, s.status, s.attempts) for s in run.steps] == [("a", "completed", 1),
                                                                  ("b", "completed", 2)]
