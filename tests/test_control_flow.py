"""`return`, `break` and `continue` leaving a step body are re-enacted on a replay."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine, text, update

from celery_duraflow import (
    DurableTask,
    NonDeterministicReplay,
    StepOutputNotSerializable,
    UnsupportedCode,
    durable,
    get_run,
    retry_run,
    step,
)
from celery_duraflow._config import config_for_app
from celery_duraflow._store import store_for
from tests.conftest import run_worker, wait_for_status


def rerun(app: Celery, task_id: str) -> Any:
    """Retry an ended run the operator's way (every step replays); wait for its end.

    The succeeded run is first recorded as failed after its last step, as if its
    end had gone wrong: an operator retries a succeeded run only from a named step
    (which would run that step again), while a failed run's retry replays every
    completed step, which is what these tests look at.
    """
    store = store_for(config_for_app(app))
    runs = store.tables.runs
    with store.engine.begin() as conn:
        failed = conn.execute(
            update(runs).where(runs.c.task_id == task_id, runs.c.status == "succeeded")
            .values(status="failed", result=None, serializer=None,
                    error="RuntimeError: the run's end went wrong")).rowcount
    assert failed == 1
    retry_run(task_id, app=app)
    return wait_for_status(app, task_id, "succeeded")


class Flaky(Exception):
    """Raised by test bodies to make Celery retry the task."""


def fail_first(counter: Counter[str], key: str, times: int = 1) -> None:
    counter[key] += 1
    if counter[key] <= times:
        raise Flaky(f"{key} fails on call {counter[key]}")


def test_early_return_from_a_helper_is_not_followed_by_the_charge_on_retry(
        make_app: Callable[..., Celery]) -> None:
    """A helper that returned early from a step returns the same way on the retry."""
    app = make_app()
    calls: Counter[str] = Counter()

    @durable
    def settle(order: dict[str, Any]) -> str:
        with step("check") as s:
            calls["check"] += 1
            if order["paid"]:
                return "no charge needed"
            s.result = "unpaid"
        with step("charge") as s:
            calls["charge"] += 1
            s.result = "charged"
        return str(s.result)

    @app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3)
    def task() -> Any:
        outcome = settle({"paid": True})
        with step("notify"):
            fail_first(calls, "notify")
        return outcome

    result = task.apply()
    assert result.get() == "no charge needed"
    assert calls == {"check": 1, "notify": 2}
    assert calls["charge"] == 0
    run = get_run(result.id, app=app)
    assert run is not None
    assert [s.key for s in run.steps] == ["check", "notify"]


def test_break_found_in_a_loop_stops_the_loop_again_on_retry(
        make_app: Callable[..., Celery]) -> None:
    """A step that broke out of its loop breaks out on the replay: no divergence."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3)
    def task() -> Any:
        found = None
        for page in range(5):
            with step("look") as s:
                calls["look"] += 1
                if page == 2:
                    s.result = f"found on page {page}"
                    break
        found = s.result
        with step("notify"):
            fail_first(calls, "notify")
        return found

    result = task.apply()
    assert result.get() == "found on page 2"
    assert calls == {"look": 3, "notify": 2}
    run = get_run(result.id, app=app)
    assert run is not None
    assert run.status == "succeeded"
    assert [s.key for s in run.steps] == ["look", "look#2", "look#3", "notify"]


def test_continue_skips_the_rest_of_the_iteration_again_on_retry(
        make_app: Callable[..., Celery]) -> None:
    """A step that continued its loop continues it on the replay."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3)
    def task() -> Any:
        kept = []
        for item in range(4):
            with step("item") as s:
                calls["item"] += 1
                if item % 2:
                    continue
                s.result = item * 10
            kept.append(s.result)
        with step("notify"):
            fail_first(calls, "notify")
        return kept

    result = task.apply()
    assert result.get() == [0, 20]
    assert calls == {"item": 4, "notify": 2}


def test_return_from_the_task_function_itself_is_replayed(
        make_app: Callable[..., Celery]) -> None:
    """A task that returned from a step returns the same value when the run is replayed."""
    app = make_app(eager=False)
    calls: Counter[str] = Counter()
    mode = {"early": True}

    @app.task(base=DurableTask)
    def task() -> Any:
        with step("gate") as s:
            calls["gate"] += 1
            if mode["early"]:
                return {"decision": "early", "at": 1}
            s.result = "open"
        with step("charge"):
            calls["charge"] += 1
        return "charged"

    with run_worker(app):
        result = task.delay()
        assert result.get(timeout=10) == {"decision": "early", "at": 1}
        mode["early"] = False  # a replay must not look: the recorded run returned
        run = rerun(app, result.id)
    assert run.result == {"decision": "early", "at": 1}
    assert calls == {"gate": 1}
    assert calls["charge"] == 0


def test_return_inside_nested_steps_is_replayed_by_the_parent_and_the_child(
        make_app: Callable[..., Celery]) -> None:
    """A return from a nested step leaves both steps, fresh or replayed."""
    app = make_app(eager=False)
    calls: Counter[str] = Counter()

    @durable
    def pick() -> str:
        with step("inner"):
            calls["inner"] += 1
            return "chosen"
        return "not reached"  # pragma: no cover

    @app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3, default_retry_delay=0)
    def task() -> Any:
        with step("outer") as o:
            choice = pick()
            fail_first(calls, "outer")
            o.result = choice
        with step("same-function"), step("deep") as b:
            calls["deep"] += 1
            b.result = "b"
            return [o.result, "from deep"]
        return "not reached either"

    with run_worker(app):
        result = task.delay()
        assert result.get(timeout=10) == ["chosen", "from deep"]
        # outer failed once with inner done: the retry replays inner's return.
        assert calls == {"inner": 1, "outer": 2, "deep": 1}
        run = get_run(result.id, app=app)
        assert run is not None
        assert [s.key for s in run.steps] == [
            "outer", "outer/inner", "same-function", "same-function/deep"]
        run = rerun(app, result.id)  # everything replays: both levels return again
    assert run.result == ["chosen", "from deep"]
    assert calls == {"inner": 1, "outer": 2, "deep": 1}


def test_control_flow_deep_inside_the_body_is_recorded(
        make_app: Callable[..., Celery]) -> None:
    """break/return inside if, try/except/finally and other with blocks are re-enacted."""
    app = make_app(eager=False)
    calls: Counter[str] = Counter()

    class Resource:
        def __enter__(self) -> Resource:
            calls["resource"] += 1
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    @app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3)
    def task() -> Any:
        for n in range(3):
            with step("try-break"):
                calls["try-break"] += 1
                try:
                    if n == 1:
                        raise KeyError(n)
                except KeyError:
                    with Resource():
                        break
                finally:
                    calls["finally"] += 1
        with step("outer"):
            for _ in range(3):  # a loop inside the body: its break is ordinary code
                calls["inner-loop"] += 1
                break
            with step("leaf"):
                calls["leaf"] += 1
                if calls["leaf"] == 1:
                    with Resource():
                        try:
                            return "returned from deep"
                        finally:
                            calls["leaf-finally"] += 1
        return "fell through"

    with run_worker(app):
        first = task.delay()
        assert first.get(timeout=10) == "returned from deep"
        assert calls["try-break"] == 2 and calls["leaf"] == 1
        run = rerun(app, first.id)
    assert run.result == "returned from deep"
    assert calls["try-break"] == 2 and calls["leaf"] == 1 and calls["inner-loop"] == 1


def test_return_in_a_nested_function_or_lambda_is_ordinary_code(
        make_app: Callable[..., Celery]) -> None:
    """A return inside a def, lambda or class within a body does not leave the step."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3)
    def task() -> Any:
        with step("compute") as s:
            def double(x: int) -> int:
                return x * 2

            class Box:
                def value(self) -> int:
                    return 5

            triple = lambda x: x * 3  # noqa: E731
            calls["compute"] += 1
            s.result = [double(2), triple(2), Box().value()]
        with step("notify"):
            fail_first(calls, "notify")
        return s.result

    result = task.apply()
    assert result.get() == [4, 6, 5]
    assert calls == {"compute": 1, "notify": 2}


def test_returned_value_goes_through_the_serializer(make_app: Callable[..., Celery]) -> None:
    """The first attempt returns the stored form of the value, as a replay will."""
    app = make_app()

    @app.task(base=DurableTask)
    def task() -> Any:
        with step("tuple"):
            return (1, 2)
        return None  # pragma: no cover

    assert task.apply().get() == [1, 2]


def test_unstorable_return_value_fails_the_run_for_good(make_app: Callable[..., Celery]) -> None:
    """A return value the serializer refuses fails the run at once; no retry runs the body."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, autoretry_for=(Exception,), max_retries=3)
    def task() -> Any:
        with step("outer"), step("book") as s:
            calls["book"] += 1
            s.result = "booked"
            return {"booking": {1, 2}}
        return None  # pragma: no cover

    result = task.apply()
    error = result.result
    assert isinstance(error, StepOutputNotSerializable)
    assert error.task_id == result.id and error.step_key == "outer/book"
    assert 'returned value["booking"]' in str(error) and "set" in str(error)
    assert calls == {"book": 1}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed"
    assert {s.key: s.status for s in run.steps} == {"outer": "failed", "outer/book": "failed"}


def test_recorded_break_where_the_code_has_no_loop_is_a_divergence(
        make_app: Callable[..., Celery]) -> None:
    """A replay that cannot re-enact a recorded break fails as a divergence."""
    app = make_app()
    versions: dict[str, Callable[[], Any]] = {}

    def v1() -> Any:
        for _ in range(2):
            with step("scan"):
                break
        raise Flaky("fail after the loop")

    def v2() -> Any:
        with step("scan"):
            pass
        return "v2"

    versions["code"] = durable(v1)

    @app.task(base=DurableTask)
    def task() -> Any:
        return versions["code"]()

    first = task.apply()
    assert isinstance(first.result, Flaky)
    versions["code"] = durable(v2)
    again = task.apply(task_id=first.id)
    assert isinstance(again.result, NonDeterministicReplay)
    assert again.result.step_key == "scan" and "break" in str(again.result)


def test_rows_from_before_body_exits_replay_as_fell_through(
        make_app: Callable[..., Celery], database_url: str, table_prefix: str) -> None:
    """A completed step row with no recorded exit (older schema) replays as fell through."""
    app = make_app(eager=False)
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3)
    def task() -> Any:
        with step("old"):
            calls["old"] += 1
            if calls["old"] == 1:
                return "first attempt returned"
        with step("after"):
            calls["after"] += 1
        return "fell through"

    with run_worker(app):
        first = task.delay()
        assert first.get(timeout=10) == "first attempt returned"
    engine = create_engine(database_url)
    try:
        with engine.begin() as conn:
            # What every row written before schema version 9 looks like.
            updated = conn.execute(text(
                f'UPDATE "{table_prefix}steps" SET body_exit = NULL, returned = NULL '
                "WHERE task_id = :t AND step_key = 'old'"), {"t": first.id}).rowcount
    finally:
        engine.dispose()
    assert updated == 1
    with run_worker(app):
        run = rerun(app, first.id)
    assert run.result == "fell through"
    assert calls == {"old": 1, "after": 1}


def test_yield_or_await_in_a_step_body_is_refused_when_prepared() -> None:
    """yield, yield from and await inside a step body fail where the function is prepared."""
    def gen() -> Iterator[int]:
        with step("stream"):
            yield 1

    def gen_from() -> Iterator[int]:
        with step("stream"):
            yield from [1]

    async def coro() -> None:
        with step("call"):
            await some_coroutine()

    async def some_coroutine() -> None:  # pragma: no cover
        return None

    for fn, word in ((gen, "yield"), (gen_from, "yield from")):
        with pytest.raises(UnsupportedCode) as info:
            durable(fn)
        line = inspect.getsourcelines(fn)[1] + 2
        assert f"`{word}`" in str(info.value) and f"test_control_flow.py:{line}" in str(info.value)

    def outer() -> Any:
        async def inner() -> None:
            with step("call"):
                await some_coroutine()
        return inner

    with pytest.raises(UnsupportedCode, match="`await`"):
        durable(outer)
    with pytest.raises(UnsupportedCode, match="async def"):
        durable(coro)


def test_generator_outside_step_bodies_stays_allowed() -> None:
    """A @durable generator may yield between steps, just not inside one."""
    def gen() -> Iterator[int]:
        with step("one") as s:
            s.result = 1
        yield s.result

    assert durable(gen) is not gen


def test_async_tasks_are_refused_where_they_are_defined(sqlite_app: Celery) -> None:
    """An async def task, or an async run() method, is refused with what to do instead."""
    async def fetch() -> int:  # pragma: no cover
        return 1

    with pytest.raises(UnsupportedCode, match="synchronously"):
        sqlite_app.task(base=DurableTask, lazy=False)(fetch)

    with pytest.raises(UnsupportedCode, match=r"asyncio\.run"):
        class AsyncTask(DurableTask):
            async def run(self) -> int:  # pragma: no cover
                return 1

    with pytest.raises(UnsupportedCode, match="durable"):
        durable(fetch)
