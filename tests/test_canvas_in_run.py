"""Celery's canvas (group, chord, chain) sent from inside a durable run.

The send is a step of the run: a retry hands back the same result handle and sends
nothing again; a send that died before its record is sent again under the same task ids,
so each durable task in it runs once and a chord's join sees every result once. A chord
whose join could run twice (a plain body, a backend that counts parts by increment) is
refused before anything is sent. Real in-process workers on Redis (broker and result
backend), on SQLite and PostgreSQL; ledgers in this process say how often bodies ran.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery, chain, chord, group
from celery.signals import before_task_publish, task_postrun
from sqlalchemy import create_engine, text

from celery_duraflow import DurableTask, StepInputChanged, UnsupportedCode, get_run, step
from celery_duraflow._context import current_run
from celery_duraflow._store import close_all_stores
from tests.conftest import app_factory, drop_tables, run_worker

RESULT_TIMEOUT = 60.0


class Flaky(Exception):
    """A failure of the user's own, listed in autoretry_for."""


@pytest.fixture
def redis_app(make_app: Callable[..., Celery], redis_url: str) -> Iterator[Celery]:
    """An app on Redis (broker and result backend) with a queue of its own."""
    queue = f"canvas-{uuid.uuid4().hex[:8]}"
    app = make_app(eager=False, broker=redis_url, task_default_queue=queue)
    yield app
    with app.connection_for_write() as conn:
        conn.default_channel.client.delete(queue)


@pytest.fixture
def published() -> Iterator[list[tuple[str, str]]]:
    """(task name, task id) of every message published while the test runs."""
    seen: list[tuple[str, str]] = []

    def receiver(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if headers:
            seen.append((str(headers.get("task")), str(headers.get("id"))))

    before_task_publish.connect(receiver, weak=False)
    yield seen
    before_task_publish.disconnect(receiver)


def _parts_and_join(app: Celery, calls: Counter[str], joined: list[list[int]]) -> Any:
    @app.task(base=DurableTask, name="canvas.part")
    def part(n: int) -> int:
        with step("square") as s:
            calls[f"part-{n}"] += 1
            s.result = n * n
        return int(s.result)

    @app.task(base=DurableTask, name="canvas.join")
    def join(results: list[int]) -> int:
        with step("sum") as s:
            calls["join"] += 1
            joined.append(sorted(results))
            s.result = sum(results)
        return int(s.result)

    return part, join


def test_a_chord_sent_by_a_retried_run_is_sent_once_and_joins_each_result_once(
        redis_app: Celery) -> None:
    """A run that sends a chord and then fails once: the retry re-uses the recorded send,
    every header task runs once, the join once with every result once."""
    app = redis_app
    calls: Counter[str] = Counter()
    joined: list[list[int]] = []
    chord_ids: list[str] = []
    part, join = _parts_and_join(app, calls, joined)

    @app.task(base=DurableTask, bind=True, autoretry_for=(Flaky,), max_retries=2,
              default_retry_delay=0)
    def parent(self: Any, count: int) -> str:
        result = chord([part.s(n) for n in range(count)], join.s()).apply_async()
        chord_ids.append(result.id)
        with step("after") as s:
            calls["after"] += 1
            if calls["after"] == 1:
                raise Flaky("the step after the chord fails once")
            s.result = "done"
        return str(result.id)

    with run_worker(app, pool="threads", concurrency=4):
        sent = parent.delay(5)
        chord_id = sent.get(timeout=RESULT_TIMEOUT)
        assert app.AsyncResult(chord_id).get(timeout=RESULT_TIMEOUT) == 30
    assert chord_ids == [chord_id, chord_id]
    assert calls == {"after": 2, "join": 1, **{f"part-{n}": 1 for n in range(5)}}
    assert joined == [[0, 1, 4, 9, 16]]
    run = get_run(sent.id, app=app)
    assert run is not None and run.status == "succeeded"
    assert [v.key for v in run.steps] == ["celery.chord", "after"]


def test_a_group_sent_by_a_retried_run_is_not_sent_again(
        redis_app: Celery, published: list[tuple[str, str]]) -> None:
    """A retried run that sent a group gets the same group result back; each member is
    published once and runs once."""
    app = redis_app
    calls: Counter[str] = Counter()
    seen_ids: list[list[str]] = []
    part, _ = _parts_and_join(app, calls, [])

    @app.task(base=DurableTask, bind=True, autoretry_for=(Flaky,), max_retries=2,
              default_retry_delay=0)
    def parent(self: Any) -> list[str]:
        result = group(part.s(n) for n in range(3)).apply_async()
        seen_ids.append([r.id for r in result.results])
        with step("after"):
            calls["after"] += 1
            if calls["after"] == 1:
                raise Flaky("the step after the group fails once")
        return [r.id for r in result.results]

    with run_worker(app, pool="threads", concurrency=4):
        ids = parent.delay().get(timeout=RESULT_TIMEOUT)
        assert [app.AsyncResult(i).get(timeout=RESULT_TIMEOUT) for i in ids] == [0, 1, 4]
    assert seen_ids == [ids, ids]
    assert sorted(i for name, i in published if name == "canvas.part") == sorted(ids)
    assert calls == {"after": 2, **{f"part-{n}": 1 for n in range(3)}}


def test_a_chain_sent_by_a_retried_run_is_not_sent_again(
        redis_app: Celery, published: list[tuple[str, str]]) -> None:
    """A retried run that sent a chain: its first link is published once, each link runs
    once."""
    app = redis_app
    calls: Counter[str] = Counter()
    part, join = _parts_and_join(app, calls, [])

    @app.task(base=DurableTask, bind=True, autoretry_for=(Flaky,), max_retries=2,
              default_retry_delay=0)
    def parent(self: Any) -> str:
        result = chain(group(part.s(1), part.s(2)), join.s()).apply_async()
        with step("after"):
            calls["after"] += 1
            if calls["after"] == 1:
                raise Flaky("the step after the chain fails once")
        return str(result.id)

    with run_worker(app, pool="threads", concurrency=4):
        last = parent.delay().get(timeout=RESULT_TIMEOUT)
        assert app.AsyncResult(last).get(timeout=RESULT_TIMEOUT) == 5
    assert calls == {"after": 2, "join": 1, "part-1": 1, "part-2": 1}
    assert Counter(name for name, _ in published)["canvas.part"] == 2


def test_a_chord_with_a_plain_body_is_refused_before_anything_is_sent(
        redis_app: Celery, published: list[tuple[str, str]]) -> None:
    """A chord whose join is a plain task fails the run for good, naming the task id and
    the step's key; nothing is published or recorded for it."""
    app = redis_app
    calls: Counter[str] = Counter()
    part, _ = _parts_and_join(app, calls, [])

    @app.task(name="canvas.plain-join")
    def plain_join(results: list[int]) -> int:
        return sum(results)

    @app.task(base=DurableTask, autoretry_for=(Exception,), max_retries=3)
    def parent() -> None:
        chord([part.s(1), part.s(2)], plain_join.s()).apply_async()

    task_id = str(uuid.uuid4())
    result = parent.apply(task_id=task_id)
    error = result.result
    assert isinstance(error, UnsupportedCode)
    assert error.task_id == task_id and error.step_key == "celery.chord"
    assert "canvas.plain-join" in str(error) and "base=DurableTask" in str(error)
    assert published == []
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "failed" and run.steps == ()


def test_a_plain_body_given_when_the_chord_is_called_is_refused(
        redis_app: Celery, published: list[tuple[str, str]]) -> None:
    """chord(header)(body) with a plain task as the body is refused like chord(header, body):
    nothing is published."""
    app = redis_app
    part, _ = _parts_and_join(app, Counter(), [])

    @app.task(name="canvas.plain-join")
    def plain_join(results: list[int]) -> int:
        return sum(results)

    @app.task(base=DurableTask)
    def parent() -> None:
        chord([part.s(1), part.s(2)])(plain_join.s())

    task_id = str(uuid.uuid4())
    error = parent.apply(task_id=task_id).result
    assert isinstance(error, UnsupportedCode)
    assert error.task_id == task_id and error.step_key == "celery.chord"
    assert "canvas.plain-join" in str(error)
    assert published == []


def test_a_chord_on_a_backend_that_counts_by_increment_is_refused(
        make_app: Callable[..., Celery], published: list[tuple[str, str]]) -> None:
    """On a result backend that counts a chord's parts with a counter (a duplicate part
    would be counted twice), a chord in a durable run is refused before it is sent."""
    app = make_app(eager=False)  # memory broker, cache+memory result backend
    part, join = _parts_and_join(app, Counter(), [])

    @app.task(base=DurableTask)
    def parent() -> None:
        chord([part.s(1)], join.s()).apply_async()

    task_id = str(uuid.uuid4())
    error = parent.apply(task_id=task_id).result
    assert isinstance(error, UnsupportedCode)
    assert error.task_id == task_id and error.step_key == "celery.chord"
    assert "CacheBackend" in str(error)
    assert published == []


def test_canvas_ids_are_derived_in_a_run_and_random_outside(
        make_app: Callable[..., Celery], published: list[tuple[str, str]]) -> None:
    """Inside a run, the ids of a canvas's tasks are derived (UUID version 5) and differ
    between two sends; outside a run they are random (version 4), as in plain Celery."""
    app = make_app(eager=False, task_default_queue=f"nobody-{uuid.uuid4().hex[:8]}")
    part, _ = _parts_and_join(app, Counter(), [])

    @app.task(base=DurableTask)
    def parent() -> list[list[str]]:
        first = group(part.s(1), part.s(2)).apply_async()
        second = group(part.s(1), part.s(2)).apply_async()
        return [[r.id for r in first.results], [r.id for r in second.results]]

    result = parent.apply()
    assert result.successful(), result.traceback
    first, second = result.result
    assert {uuid.UUID(i).version for i in first + second} == {5}
    assert len(set(first + second)) == 4
    run = get_run(result.id, app=app)
    assert run is not None and [v.key for v in run.steps] == ["celery.group",
                                                               "celery.group#2"]
    outside = group(part.s(1), part.s(2)).apply_async()
    assert {uuid.UUID(r.id).version for r in outside.results} == {4}
    assert len(published) == 6


def test_a_retry_that_would_send_another_canvas_is_refused(
        make_app: Callable[..., Celery], published: list[tuple[str, str]]) -> None:
    """A retry reaching a recorded canvas send with other tasks in it fails with
    StepInputChanged instead of handing back the old send's ids; nothing more is sent."""
    app = make_app(eager=False, task_default_queue=f"nobody-{uuid.uuid4().hex[:8]}")
    part, join = _parts_and_join(app, Counter(), [])
    members = [part.s(1), part.s(2)]
    attempts: Counter[str] = Counter()

    @app.task(base=DurableTask)
    def parent() -> None:
        attempts["parent"] += 1
        group(members).apply_async()
        if attempts["parent"] == 1:
            raise Flaky("the first attempt fails after the send")

    task_id = str(uuid.uuid4())
    assert isinstance(parent.apply(task_id=task_id).result, Flaky)
    assert len(published) == 2
    members.append(join.s())
    error = parent.apply(task_id=task_id).result
    assert isinstance(error, StepInputChanged)
    assert error.task_id == task_id and error.step_key == "celery.group"
    assert len(published) == 2


@pytest.mark.postgres
def test_a_chord_sent_again_after_its_record_was_lost_runs_each_task_once(
        pg_url: str, redis_url: str, table_prefix: str) -> None:
    """The chord's send ran but its record failed (in doubt): the next attempt sends it
    again under the same task ids, every header task runs once, the join once."""
    queue = f"canvas-{uuid.uuid4().hex[:8]}"
    app = app_factory(pg_url, table_prefix)(
        eager=False, broker=redis_url, task_default_queue=queue,
        duraflow_engine_options={"connect_args": {"options": "-c statement_timeout=1000"}})
    calls: Counter[str] = Counter()
    joined: list[list[int]] = []
    part, join = _parts_and_join(app, calls, joined)
    locked, done = threading.Event(), threading.Event()
    from_parent: list[str] = []

    def hold_steps_table() -> None:
        engine = create_engine(pg_url)
        try:
            with engine.begin() as conn:
                conn.execute(text(f'LOCK TABLE "{table_prefix}steps" IN ACCESS EXCLUSIVE MODE'))
                locked.set()
                done.wait(10)
        finally:
            engine.dispose()

    def release_after_the_attempt(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "name", None) == "canvas.parent":
            done.set()

    def lock_after_send(sender: Any = None, headers: Any = None, **_: Any) -> None:
        ctx = current_run.get()
        if sender != "canvas.part" or ctx is None or ctx.task_name != "canvas.parent":
            return
        from_parent.append(str(headers["id"]))
        if not locked.is_set():  # the send cannot be recorded once the header is on its way
            threading.Thread(target=hold_steps_table, daemon=True).start()
            assert locked.wait(10)

    @app.task(base=DurableTask, name="canvas.parent")
    def parent() -> str:
        return str(chord([part.s(n) for n in range(4)], join.s()).apply_async().id)

    before_task_publish.connect(lock_after_send, weak=False)
    task_postrun.connect(release_after_the_attempt, weak=False)
    try:
        # One slot: no header task runs while the parent's attempt holds it.
        with run_worker(app, pool="solo"):
            sent = parent.delay()
            chord_id = sent.get(timeout=RESULT_TIMEOUT)
            assert app.AsyncResult(chord_id).get(timeout=RESULT_TIMEOUT) == 14
            run = get_run(sent.id, app=app)
            assert run is not None and run.status == "succeeded"
        # The parent published the header twice, under the same four ids.
        assert len(from_parent) == 8 and len(set(from_parent)) == 4
        assert calls == {"join": 1, **{f"part-{n}": 1 for n in range(4)}}
        assert joined == [[0, 1, 4, 9]]
    finally:
        before_task_publish.disconnect(lock_after_send)
        task_postrun.disconnect(release_after_the_attempt)
        done.set()
        close_all_stores()
        drop_tables(pg_url, table_prefix)
        with app.connection_for_write() as conn:
            conn.default_channel.client.delete(queue)
