"""Fan-out to child runs and their durable join: ``children()``.

On a real (in-process) worker, on SQLite and on PostgreSQL: every child runs once,
results come back in the order given, the parent holds no worker while it waits
(one worker slot is enough for a parent and all its children), a replay starts no
child again, failures and a timeout follow the documented rule. The races between
children ending at once, and between an end and the parent's suspension, are
forced on PostgreSQL with row locks.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_duraflow import (
    ChildFailed,
    ChildTimeout,
    DurableTask,
    NonDeterministicReplay,
    children,
    get_run,
    step,
)
from celery_duraflow._config import config_for_app
from celery_duraflow._fanout import join_child_id
from celery_duraflow._joins_store import NewChild
from celery_duraflow._store import Delivery, Store, store_for
from tests.conftest import run_worker, wait_for_status
from tests.test_sweep_arrivals import race_the_suspension

RESULT_TIMEOUT = 60.0
OWNER = "fanout-test-host|x|1|abc"
LEASE = 1.0


def _worker_app(make_app: Callable[..., Celery], **conf: Any) -> Celery:
    return make_app(eager=False, **conf)


def test_children_run_once_and_join_in_order_on_one_worker_slot(
        make_app: Callable[..., Celery]) -> None:
    """Ten children on a worker with one slot: the parent waits without holding it, every
    child runs once, the results come back in the order given, the join is recorded."""
    app = _worker_app(make_app)
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask)
    def square(n: int) -> int:
        calls[f"child-{n}"] += 1
        with step("work") as s:
            s.result = n * n
        return int(s.result)

    @app.task(base=DurableTask)
    def parent(count: int) -> list[int]:
        with step("prepare"):
            calls["prepare"] += 1
        return children("squares", [square.s(n) for n in range(count)])

    with run_worker(app, pool="solo", concurrency=1):
        result = parent.delay(10)
        assert result.get(timeout=RESULT_TIMEOUT) == [n * n for n in range(10)]
    assert calls == {"prepare": 1, **{f"child-{n}": 1 for n in range(10)}}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded"
    assert run.step("squares").result == {"children": 10,
                                          "results": [n * n for n in range(10)],
                                          "failed": []}
    for n in range(10):
        kid = get_run(join_child_id(result.id, "squares", n), app=app)
        assert kid is not None and kid.status == "succeeded" and kid.parent_id == result.id


def test_a_replay_starts_no_child_again_and_reads_the_join_from_its_record(
        make_app: Callable[..., Celery]) -> None:
    """A parent that fails after its join and is retried gets the same results back without
    any child running again."""
    app = _worker_app(make_app)
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask)
    def shout(word: str) -> str:
        calls[word] += 1
        return word.upper()

    @app.task(base=DurableTask, bind=True, max_retries=2)
    def parent(self: Any) -> list[str]:
        words = children("shout", [shout.s(w) for w in ("a", "b", "c")])
        with step("after") as s:
            calls["after"] += 1
            if calls["after"] == 1:
                raise self.retry(countdown=0)
            s.result = words
        return list(s.result)

    with run_worker(app, pool="threads", concurrency=2):
        result = parent.delay()
        assert result.get(timeout=RESULT_TIMEOUT) == ["A", "B", "C"]
    assert calls == {"a": 1, "b": 1, "c": 1, "after": 2}


def test_a_failed_child_raises_after_every_child_ended_and_siblings_run_once(
        make_app: Callable[..., Celery]) -> None:
    """One child fails for good: its siblings still run (once each), the join waits for all,
    then raises ChildFailed for the first failure; return_exceptions puts it in place."""
    app = _worker_app(make_app)
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask)
    def charge(n: int) -> int:
        calls[f"charge-{n}"] += 1
        if n in (1, 3):
            raise ValueError(f"card {n} declined")
        return n

    @app.task(base=DurableTask)
    def strict() -> str:
        try:
            children("charge", [charge.s(n) for n in range(5)])
        except ChildFailed as exc:
            return f"{exc.child_id} {exc.error}"
        return "unexpected"

    @app.task(base=DurableTask)
    def lenient() -> list[str]:
        got = children("charge", [charge.s(n) for n in range(5)], return_exceptions=True)
        return [type(x).__name__ if isinstance(x, ChildFailed) else str(x) for x in got]

    with run_worker(app, pool="threads", concurrency=2):
        first = strict.delay()
        assert first.get(timeout=RESULT_TIMEOUT) == (
            f"{join_child_id(first.id, 'charge', 1)} ValueError: card 1 declined")
        assert calls == {f"charge-{n}": 1 for n in range(5)}
        second = lenient.delay()
        assert second.get(timeout=RESULT_TIMEOUT) == [
            "0", "ChildFailed", "2", "ChildFailed", "4"]
    assert calls == {f"charge-{n}": 2 for n in range(5)}
    run = get_run(first.id, app=app)
    assert run is not None
    outcome = run.step("charge").result
    assert [entry["index"] for entry in outcome["failed"]] == [1, 3]


def test_a_join_times_out_and_its_children_go_on(make_app: Callable[..., Celery]) -> None:
    """Past its timeout the join raises ChildTimeout with how many had ended; the children
    that were still running finish anyway."""
    app = _worker_app(make_app)
    release = threading.Event()

    @app.task(base=DurableTask)
    def slow(n: int) -> int:
        if n:
            release.wait(10)
        return n

    @app.task(base=DurableTask)
    def parent() -> str:
        try:
            children("slow", [slow.s(n) for n in range(3)], timeout=0.5)
        except ChildTimeout as exc:
            return str(exc).split(" children")[0]
        return "unexpected"

    with run_worker(app, pool="threads", concurrency=4):
        result = parent.delay()
        assert result.get(timeout=RESULT_TIMEOUT) == "1 of the 3"
        release.set()
        for n in (1, 2):
            wait_for_status(app, join_child_id(result.id, "slow", n), "succeeded")


def test_a_replay_that_reaches_the_join_with_other_signatures_is_refused(
        make_app: Callable[..., Celery]) -> None:
    """The parent waits on three children; its code then builds four: the replay refuses
    with NonDeterministicReplay and starts no fourth child."""
    app = _worker_app(make_app)
    release = threading.Event()
    count = [3]

    @app.task(base=DurableTask)
    def held(n: int) -> int:
        release.wait(10)
        return n

    @app.task(base=DurableTask)
    def parent() -> list[int]:
        return children("held", [held.s(n) for n in range(count[0])])

    with run_worker(app, pool="threads", concurrency=4):
        result = parent.delay()
        wait_for_status(app, result.id, "waiting")
        count[0] = 4
        release.set()
        with pytest.raises(NonDeterministicReplay, match="started 3 children"):
            result.get(timeout=RESULT_TIMEOUT)
    assert get_run(join_child_id(result.id, "held", 3), app=app) is None


def test_no_children_is_an_empty_join(make_app: Callable[..., Celery]) -> None:
    """An empty list of signatures joins at once, with nothing started."""
    app = make_app()

    @app.task(base=DurableTask)
    def parent() -> list[Any]:
        return children("none", [])

    assert parent.apply().get() == []


def test_children_must_be_durable_tasks(make_app: Callable[..., Celery]) -> None:
    """A plain Celery task among the signatures is refused before any child is recorded."""
    app = make_app()

    @app.task
    def plain() -> int:
        return 1

    @app.task(base=DurableTask)
    def durable_one() -> int:
        return 2

    @app.task(base=DurableTask)
    def parent() -> list[Any]:
        return children("mixed", [durable_one.s(), plain.s()])

    result = parent.apply()
    with pytest.raises(TypeError, match="not a DurableTask"):
        result.get()
    assert get_run(join_child_id(result.id, "mixed", 0), app=app) is None


# -- the races, at the store ------------------------------------------------------------------


def _store(make_app: Callable[..., Celery]) -> Store:
    return store_for(config_for_app(make_app(duraflow_lease_seconds=LEASE)))


def _join(store: Store, count: int) -> tuple[str, list[str]]:
    """A parent that took its first attempt and recorded ``count`` children at step
    ``fan``, each of which took its first attempt."""
    parent = str(uuid.uuid4())
    store.begin_attempt(parent, Delivery(task_name="shop.trip", owner=OWNER))
    ids = [join_child_id(parent, "fan", n) for n in range(count)]
    inserted = store.create_join_children(
        parent, "fan", [NewChild(task_id=i, task_name="shop.leg", args="[]") for i in ids])
    assert sorted(inserted) == sorted(ids)
    assert store.create_join_children(
        parent, "fan", [NewChild(task_id=i, task_name="shop.leg", args="[]") for i in ids]) == []
    for child_id in ids:
        store.begin_attempt(child_id, Delivery(task_name="shop.leg", owner=f"{OWNER}-{child_id}"))
    return parent, ids


def _end(store: Store, child_id: str) -> Any:
    """What a join child's attempt does at its end: record it, then wake the parent."""
    assert store.finish_run(child_id, f"{OWNER}-{child_id}", "succeeded", result="1",
                            serializer="json")
    return store.wake_join(store.get_run(child_id).parent_id, "fan", grace=LEASE)  # type: ignore[union-attr]


def test_only_the_end_that_leaves_no_child_open_wakes_the_parent(
        make_app: Callable[..., Celery]) -> None:
    """Of three children, the first two ends wake nothing; the third wakes the parent; the
    suspension is refused once every child ended."""
    store = _store(make_app)
    parent, ids = _join(store, 3)
    assert store.suspend(parent, OWNER, status="waiting", kind="children", waiting_for="fan",
                         wake_at=None, sweep_at=None)
    assert _end(store, ids[0]) is None
    assert _end(store, ids[2]) is None
    woken = _end(store, ids[1])
    assert woken is not None and woken.task_id == parent and woken.status == "running"

    again, more = _join(store, 1)
    _end(store, more[0])
    assert not store.suspend(again, OWNER, status="waiting", kind="children",
                             waiting_for="fan", wake_at=None, sweep_at=None)


def test_a_join_whose_last_waker_died_is_found_by_the_look_at_parents(
        make_app: Callable[..., Celery]) -> None:
    """Every child ended but nobody woke the parent: a plain sweep pass does not find it,
    the look at waiting parents does."""
    store = _store(make_app)
    parent, ids = _join(store, 2)
    assert store.suspend(parent, OWNER, status="waiting", kind="children", waiting_for="fan",
                         wake_at=None, sweep_at=None)
    for child_id in ids:
        assert store.finish_run(child_id, f"{OWNER}-{child_id}", "succeeded", result="1",
                                serializer="json")
    plain = store.recoverable_runs(10, arrivals=False, parents=False)
    assert parent not in [run.task_id for run in plain]
    looked = store.recoverable_runs(10, arrivals=False, parents=True)
    assert [run.task_id for run in looked] == [parent]


@pytest.mark.postgres
@pytest.mark.pooled
@pytest.mark.parametrize("database_url", ["postgres", "pgbouncer"], indirect=True)
@pytest.mark.parametrize("first", ["suspension", "child"])
def test_the_last_end_racing_the_suspension_always_wakes_the_parent(
        make_app: Callable[..., Celery], database_url: str, pg_url: str, first: str) -> None:
    """The worst orders, forced with a lock: the suspension checks the join before the last
    child's end commits and writes after its waker looked (``suspension``), or the last end
    is written while the parent suspends (``child``): the parent is never left waiting on
    a join with no child open."""
    store = _store(make_app)
    parent, ids = _join(store, 2)
    assert store.finish_run(ids[0], f"{OWNER}-{ids[0]}", "succeeded", result="1",
                            serializer="json")
    race_the_suspension(
        store, pg_url, first, parent=parent, last_child=ids[1],
        suspend=lambda: store.suspend(parent, OWNER, status="waiting", kind="children",
                                      waiting_for="fan", wake_at=None, sweep_at=None),
        end=lambda: _end(store, ids[1]),
        wake=lambda: store.wake_join(parent, "fan", grace=LEASE), owner=OWNER)


# -- what the operator sees -------------------------------------------------------------------


def test_the_cli_and_the_web_view_show_each_joins_progress(
        make_app: Callable[..., Celery]) -> None:
    """`show` (text and JSON) and the web view's run page give, per join, how many of its
    children ended, by status: while they run and once they ended."""
    from celery.bin.celery import celery as celery_command
    from click.testing import CliRunner

    from tests.test_web import logged_in

    store = _store(make_app)
    parent, ids = _join(store, 3)
    assert store.finish_run(ids[0], f"{OWNER}-{ids[0]}", "failed", error="E")
    assert store.join_progress(parent) == {"fan": {"failed": 1, "running": 2}}

    app = make_app()

    @app.task(base=DurableTask)
    def leg(n: int) -> int:
        if n == 1:
            raise ValueError("no seat")
        return n

    @app.task(base=DurableTask)
    def trip() -> list[str]:
        got = children("legs", [leg.s(n) for n in range(3)], return_exceptions=True)
        return [type(x).__name__ for x in got]

    result = trip.apply()
    assert result.get() == ["int", "ChildFailed", "int"]

    def show(*args: str) -> str:
        out = CliRunner().invoke(celery_command, ["-A", app, "duraflow", "show", *args],  # type: ignore[list-item]
                                 env={"COLUMNS": "200"})
        assert out.exit_code == 0, (out.output, out.exception)
        return out.stdout

    assert "children  step 'legs': 3 of 3 ended (1 failed, 2 succeeded)" in show(result.id)
    assert json.loads(show(result.id, "--json"))["joins"] == {
        "legs": {"failed": 1, "succeeded": 2}}
    page = logged_in(app).get(f"/runs/{result.id}").text
    assert "step &#39;legs&#39;: 3 of 3 ended (1 failed, 2 succeeded)" in page
