"""The sweep makes progress past runs it cannot send (issue 13, finding 4).

A lost run that the sweep cannot send (its arguments were not recorded or
cannot be decoded, its task is not registered) used to be logged and skipped
by every sweep, and stayed first in line: a page of them (the default limit
is 100) kept every other lost run, due sleep and due wait from ever being
sent. Now such a run is marked failed, with the reason, the first time it is
met, and the same sweep goes on to the runs behind it. On SQLite and
PostgreSQL.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from celery.bin.celery import celery as celery_command
from click.testing import CliRunner
from sqlalchemy import func, select, update

from celery_duraflow import DurableTask, recover, step
from celery_duraflow._config import config_for_app
from celery_duraflow._lease import new_owner
from celery_duraflow._serialization import encode_arguments, get_serializer
from celery_duraflow._store import Delivery, RunRecord, Store, store_for
from tests.conftest import run_worker

BAD_RUNS = 300


def _store(app: Celery) -> Store:
    return store_for(config_for_app(app))


def _trip_task(app: Celery, calls: Counter[str]) -> Any:
    """A two-step task whose first attempt asks Celery for a retry ten minutes away."""
    first = [True]

    @app.task(base=DurableTask, bind=True, name="sweep.trip", max_retries=3)
    def trip(self: DurableTask, n: int) -> str:
        with step("search") as s:
            calls["search"] += 1
            s.result = f"flight-{n}"
        flight = s.result
        if first[0]:
            first[0] = False
            raise self.retry(countdown=600)
        with step("book") as s:
            calls["book"] += 1
            s.result = f"booked {flight}"
        return str(s.result)

    return trip


def _lost_good_run(app: Celery, trip: Any) -> str:
    """A real attempt records the run and its arguments; its retry message is then lost."""
    task_id = f"good-{uuid.uuid4()}"
    with pytest.raises(Exception, match="Retry"):
        trip.apply(args=(7,), task_id=task_id)
    store = _store(app)
    run = store.get_run(task_id)
    assert run is not None and run.status == "running" and run.args is not None
    runs = store.tables.runs
    with store.engine.begin() as conn:
        # The retry never arrived: its recovery time has passed.
        conn.execute(update(runs).where(runs.c.task_id == task_id)
                     .values(lease_expires_at=datetime.now(UTC) - timedelta(minutes=1)))
    return task_id


def _insert_bad_runs(app: Celery, count: int) -> dict[str, list[str]]:
    """``count`` lost runs the sweep cannot send, all due before the good one, in one insert.

    A third have no recorded arguments, a third belong to a task no app
    registers, a third have arguments no serializer can read.
    """
    store = _store(app)
    store.ensure_schema()
    now = datetime.now(UTC)
    good_args, fingerprint = encode_arguments([1], {}, get_serializer("json"))
    kinds: dict[str, list[str]] = {"no-args": [], "unknown-task": [], "undecodable": []}
    rows = []
    for n in range(count):
        kind = list(kinds)[n % 3]
        task_id = f"bad-{kind}-{n}"
        kinds[kind].append(task_id)
        rows.append({
            "task_id": task_id,
            "task_name": "gone.renamed_task" if kind == "unknown-task" else "sweep.trip",
            "status": "running", "attempts": 1, "created_at": now - timedelta(days=2),
            "updated_at": now - timedelta(days=1),
            "lease_owner": "dead-host|dead-machine|4242|abc",
            # Older than the good run's: they come first in the sweep's order.
            "lease_expires_at": now - timedelta(days=1, seconds=n),
            "args": {"no-args": None, "unknown-task": good_args,
                     "undecodable": "{not json at all"}[kind],
            "args_fingerprint": None if kind == "no-args" else fingerprint,
            "retries": 0, "recoveries": 0, "interrupted": False,
        })
    with store.engine.begin() as conn:
        conn.execute(store.tables.runs.insert(), rows)
    return kinds


def _statuses(app: Celery, task_ids: list[str]) -> Counter[str]:
    store = _store(app)
    runs = store.tables.runs
    with store.engine.connect() as conn:
        return Counter(conn.execute(select(runs.c.status)
                                    .where(runs.c.task_id.in_(task_ids))).scalars())


def _errors(app: Celery, task_ids: list[str]) -> list[str]:
    store = _store(app)
    runs = store.tables.runs
    with store.engine.connect() as conn:
        return list(conn.execute(select(runs.c.error)
                                 .where(runs.c.task_id.in_(task_ids))).scalars())


def test_the_first_sweep_sends_a_good_run_behind_hundreds_it_cannot_send(
        make_app: Callable[..., Celery]) -> None:
    """One sweep sends a lost run queued behind hundreds it cannot send, and marks those failed."""
    app = make_app(eager=False, task_eager_propagates=True)
    calls: Counter[str] = Counter()
    trip = _trip_task(app, calls)
    good = _lost_good_run(app, trip)
    assert calls == {"search": 1}
    bad = _insert_bad_runs(app, BAD_RUNS)
    every_bad = [task_id for ids in bad.values() for task_id in ids]

    # One sweep with the default limit (100): the good run is sent, every bad one failed.
    assert recover(app) == [good]
    assert _statuses(app, every_bad) == {"failed": BAD_RUNS}
    for error in _errors(app, bad["no-args"]):
        assert "its arguments were not recorded" in error
        assert "marked failed" in error
    for error in _errors(app, bad["unknown-task"]):
        assert "'gone.renamed_task' is not registered" in error
    for error in _errors(app, bad["undecodable"]):
        assert "recorded arguments cannot be decoded" in error
    failed_run = _store(app).get_run(bad["no-args"][0])
    assert failed_run is not None
    assert failed_run.lease_owner is None and failed_run.lease_expires_at is None
    assert failed_run.finished_at is not None

    # Nothing is left to do, and the good run finishes in a worker, skipping its search.
    assert recover(app) == []
    with run_worker(app, pool="solo"):
        assert app.AsyncResult(good).get(timeout=30) == "booked flight-7"
    assert calls == {"search": 1, "book": 1}


def test_a_failed_run_is_no_longer_in_the_way_of_a_small_limit(
        make_app: Callable[..., Celery]) -> None:
    """With limit 1 the sweep still reads on past the runs it fails, to send one run."""
    app = make_app(eager=False, task_eager_propagates=True)
    trip = _trip_task(app, Counter())
    good = _lost_good_run(app, trip)
    bad = _insert_bad_runs(app, 9)
    assert recover(app, limit=1) == [good]
    assert _statuses(app, [t for ids in bad.values() for t in ids]) == {"failed": 9}


def test_failing_an_unsendable_run_is_fenced(make_app: Callable[..., Celery]) -> None:
    """A run taken by a delivery after the sweep read it is not failed by that sweep."""
    app = make_app(eager=False)
    store = _store(app)
    _insert_bad_runs(app, 1)
    [seen] = [run for run in store.recoverable_runs(10) if run.task_id == "bad-no-args-0"]
    # Meanwhile a (late) delivery of the message takes the run.
    owner = new_owner()
    blob, fingerprint = encode_arguments([1], {}, get_serializer("json"))
    taken, _ = store.begin_attempt(seen.task_id, Delivery(
        task_name="sweep.trip", owner=owner, args=blob, args_fingerprint=fingerprint))
    assert taken.lease_owner == owner
    assert not store.fail_unsendable(seen, "too late")
    now = store.get_run(seen.task_id)
    assert now is not None and now.status == "running" and now.lease_owner == owner
    assert now.error is None
    # The run as it is now can be failed (nothing changed since it was read).
    assert store.fail_unsendable(now, "the reason")
    failed: RunRecord | None = store.get_run(seen.task_id)
    assert failed is not None and (failed.status, failed.error) == ("failed", "the reason")


def test_recover_once_says_which_runs_it_marked_failed(
        make_app: Callable[..., Celery]) -> None:
    """`recover --once` names the runs it sent and the ones it marked failed as unsendable."""
    app = make_app(eager=False, task_eager_propagates=True)
    trip = _trip_task(app, Counter())
    good = _lost_good_run(app, trip)
    bad = _insert_bad_runs(app, 3)
    result = CliRunner().invoke(celery_command, ["-A", app, "duraflow", "recover",  # type: ignore[list-item]
                                                 "--once"])
    assert result.exit_code == 0, (result.output, result.exception)
    lines = result.stdout.splitlines()
    assert lines[0] == f"sent 1 run(s): {good}"
    assert lines[1].startswith("marked 3 run(s) failed that cannot be sent")
    assert set(lines[1].split(": ", 1)[1].split()) == {t for ids in bad.values() for t in ids}
    store = _store(app)
    runs = store.tables.runs
    with store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(runs)
                            .where(runs.c.status == "failed")).scalar_one() == 3
