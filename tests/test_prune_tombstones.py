"""Pruning leaves a tombstone, so a late redelivery never runs a pruned run again.

Issue 13, finding 6: with Redis a message can come back after the broker's
visibility timeout (an hour by default), long after its run ended, and a
prune that deleted the run's row let that delivery start the run again from
nothing, repeating every side effect. A pruned run now leaves its task id,
task name and final status behind (its steps, signals, arguments, result and
error go); a delivery that finds the tombstone runs no step and records
nothing. Tombstones are not listed or shown, and a later prune deletes those
older than the retention (seven days by default). On SQLite and PostgreSQL.
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
from click.testing import CliRunner, Result
from sqlalchemy import MetaData, Table, func, inspect, select, update

from celery_duraflow import (
    DurableTask,
    RunNotFound,
    get_run,
    recover,
    send_signal,
    step,
    wait_for_signal,
)
from celery_duraflow._admin import (
    TOMBSTONE_RETENTION,
    count_by_status,
    count_tombstones,
    delete_tombstones,
    list_runs,
    prune,
)
from celery_duraflow._config import config_for_app
from celery_duraflow._operations import retry_run
from celery_duraflow._schema import LATEST_VERSION, MIGRATIONS, migrate
from celery_duraflow._store import Store, store_for
from tests.conftest import run_worker


def _store(app: Celery) -> Store:
    return store_for(config_for_app(app))


def _row(app: Celery, task_id: str) -> dict[str, Any] | None:
    """The run's row as it is in the table, tombstone or not."""
    store = _store(app)
    runs = store.tables.runs
    with store.engine.connect() as conn:
        row = conn.execute(select(runs).where(runs.c.task_id == task_id)).first()
    return dict(row._mapping) if row is not None else None


def _count(app: Celery, table: str, task_id: str) -> int:
    store = _store(app)
    t = getattr(store.tables, table)
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(t)
                                .where(t.c.task_id == task_id)).scalar_one())


def _age(app: Celery, task_id: str, **columns: datetime) -> None:
    store = _store(app)
    runs = store.tables.runs
    with store.engine.begin() as conn:
        conn.execute(update(runs).where(runs.c.task_id == task_id).values(**columns))


def _prune_old(app: Celery, task_id: str) -> None:
    """Make the run two hours old and prune runs older than an hour, as an operator would."""
    _age(app, task_id, updated_at=datetime.now(UTC) - timedelta(hours=2))
    steps = _count(app, "steps", task_id)
    assert prune(_store(app), older_than=timedelta(hours=1)) == (1, steps)
    tombstone = _row(app, task_id)
    assert tombstone is not None and tombstone["pruned_at"] is not None


def _duraflow(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(celery_command, ["-A", app, "duraflow", *args],  # type: ignore[list-item]
                              env={"COLUMNS": "400"})


def _tasks(app: Celery, calls: Counter[str]) -> tuple[Any, Any]:
    @app.task(base=DurableTask, name="tomb.book")
    def book(n: int) -> str:
        with step("charge") as s:
            calls["charge"] += 1
            s.result = f"charged-{n}"
        with step("mail") as s:
            calls["mail"] += 1
        return f"booked-{n}"

    @app.task(base=DurableTask, name="tomb.declined")
    def declined(n: int) -> None:
        with step("charge"):
            calls["declined-charge"] += 1
        raise ValueError("card declined after the charge")

    return book, declined


def test_a_pruned_succeeded_run_delivered_again_runs_no_step(
        make_app: Callable[..., Celery]) -> None:
    """A late delivery of a pruned run finds its tombstone and runs no step: no charge twice."""
    app = make_app()
    calls: Counter[str] = Counter()
    book, _ = _tasks(app, calls)
    task_id = str(uuid.uuid4())
    assert book.apply(args=(1,), task_id=task_id).get() == "booked-1"
    assert calls == {"charge": 1, "mail": 1}
    assert _count(app, "steps", task_id) == 2
    _prune_old(app, task_id)

    tombstone = _row(app, task_id)
    assert tombstone is not None
    assert (tombstone["task_name"], tombstone["status"]) == ("tomb.book", "succeeded")
    for gone in ("args", "args_fingerprint", "result", "error", "serializer"):
        assert tombstone[gone] is None, gone
    assert _count(app, "steps", task_id) == 0
    # Not a run to show or list any more, as before tombstones.
    assert get_run(task_id, app=app) is None
    assert task_id not in [r.task_id for r in list_runs(_store(app))]
    assert count_by_status(_store(app)) == {}

    # The broker delivers the old message again (same id, same arguments).
    again = book.apply(args=(1,), task_id=task_id)
    assert again.state == "IGNORED"
    assert calls == {"charge": 1, "mail": 1}
    assert _row(app, task_id) == tombstone  # nothing new recorded
    assert _count(app, "steps", task_id) == 0
    # Nor is it sent by a sweep.
    assert recover(app) == []


def test_a_pruned_failed_run_delivered_again_runs_no_step(
        make_app: Callable[..., Celery]) -> None:
    """Before pruning, a redelivery of a failed run continues it; after, it must not restart it."""
    app = make_app()
    calls: Counter[str] = Counter()
    _, declined = _tasks(app, calls)
    task_id = str(uuid.uuid4())
    assert declined.apply(args=(2,), task_id=task_id).state == "FAILURE"
    assert calls == {"declined-charge": 1}
    row = _row(app, task_id)
    assert row is not None and row["status"] == "failed"
    assert "card declined" in row["error"]
    _prune_old(app, task_id)
    tombstone = _row(app, task_id)
    assert tombstone is not None and tombstone["status"] == "failed"
    assert tombstone["error"] is None

    for _ in range(2):
        assert declined.apply(args=(2,), task_id=task_id).state == "IGNORED"
    assert calls == {"declined-charge": 1}
    assert _row(app, task_id) == tombstone
    assert _count(app, "steps", task_id) == 0


def test_a_worker_ignores_a_late_redelivery_of_a_pruned_run(
        make_app: Callable[..., Celery]) -> None:
    """Through a real worker: no step runs, and the result backend keeps the run's result."""
    app = make_app(eager=False)
    calls: Counter[str] = Counter()
    book, declined = _tasks(app, calls)

    @app.task(name="tomb.marker")
    def marker() -> str:
        return "after"

    ok_id, failed_id = str(uuid.uuid4()), str(uuid.uuid4())
    with run_worker(app, pool="solo"):
        assert book.apply_async(args=(3,), task_id=ok_id).get(timeout=30) == "booked-3"
        with pytest.raises(ValueError, match="card declined"):
            declined.apply_async(args=(4,), task_id=failed_id).get(timeout=30)
        assert calls == {"charge": 1, "mail": 1, "declined-charge": 1}
        for task_id in (ok_id, failed_id):
            _prune_old(app, task_id)
        tombstones = {task_id: _row(app, task_id) for task_id in (ok_id, failed_id)}

        # The late deliveries of both messages, then a marker behind them in the same queue:
        # the solo worker runs them in order, so once the marker is done so are they.
        book.apply_async(args=(3,), task_id=ok_id)
        declined.apply_async(args=(4,), task_id=failed_id)
        assert marker.delay().get(timeout=30) == "after"

    assert calls == {"charge": 1, "mail": 1, "declined-charge": 1}
    for task_id, tombstone in tombstones.items():
        assert _row(app, task_id) == tombstone
        assert _count(app, "steps", task_id) == 0
    # Ignore stores nothing: the backend still holds what the runs ended with.
    assert app.AsyncResult(ok_id).get(timeout=5) == "booked-3"
    assert app.AsyncResult(failed_id).state == "FAILURE"


def test_a_pruned_run_cannot_be_retried_or_signalled(make_app: Callable[..., Celery]) -> None:
    """Operations on a pruned run find no run, as they did when prune deleted its row."""
    app = make_app()
    calls: Counter[str] = Counter()
    book, _ = _tasks(app, calls)
    task_id = str(uuid.uuid4())
    book.apply(args=(5,), task_id=task_id)
    _prune_old(app, task_id)
    with pytest.raises(RunNotFound):
        retry_run(task_id, app=app)
    with pytest.raises(RunNotFound):
        send_signal(task_id, "approval", True, app=app)
    assert "no run with task id" in _duraflow(app, "show", task_id).stderr
    assert calls == {"charge": 1, "mail": 1}
    assert _count(app, "signals", task_id) == 0


def test_prune_keeps_unended_runs_and_a_second_prune_leaves_tombstones_alone(
        make_app: Callable[..., Celery]) -> None:
    """Prune keeps an old waiting run, and a second prune does not prune tombstones again."""
    app = make_app()

    @app.task(base=DurableTask, name="tomb.approve")
    def approve() -> Any:
        with step("quote") as s:
            s.result = 10
        return wait_for_signal("approval")

    waiting = approve.apply().id
    _age(app, waiting, updated_at=datetime.now(UTC) - timedelta(days=40))
    calls: Counter[str] = Counter()
    book, _ = _tasks(app, calls)
    done = book.apply(args=(6,)).id
    _age(app, done, updated_at=datetime.now(UTC) - timedelta(days=40))
    store = _store(app)
    assert prune(store, older_than=timedelta(days=30)) == (1, 2)
    assert prune(store, older_than=timedelta(days=30)) == (0, 0)
    waiting_row = _row(app, waiting)
    assert waiting_row is not None and waiting_row["pruned_at"] is None
    assert _count(app, "steps", waiting) == 2  # the quote and the wait


def test_tombstones_are_deleted_by_a_later_prune_after_their_retention(
        make_app: Callable[..., Celery]) -> None:
    """A later prune deletes tombstones older than their retention, with any signals they kept."""
    app = make_app()
    calls: Counter[str] = Counter()
    book, _ = _tasks(app, calls)
    store = _store(app)
    assert timedelta(days=1) <= TOMBSTONE_RETENTION  # far beyond Redis' visibility timeout
    recent, old = str(uuid.uuid4()), str(uuid.uuid4())
    for task_id in (recent, old):
        book.apply(args=(7,), task_id=task_id)
        _prune_old(app, task_id)
    _age(app, old, pruned_at=datetime.now(UTC) - TOMBSTONE_RETENTION - timedelta(hours=1))
    # A signal sent to a pruned run is refused, but one stored before
    # tombstones existed, say, goes with its tombstone.
    with store.engine.begin() as conn:
        conn.execute(store.tables.signals.insert().values(
            task_id=old, name="late", payload="1", serializer="json",
            sent_at=datetime.now(UTC)))

    assert count_tombstones(store) == 1
    lines = _duraflow(app, "prune", "--older-than", "30d", "--dry-run").stdout.splitlines()
    assert lines == ["would prune 0 run(s) (0 steps): succeeded, failed, compensated, "
                     "cancelled, ignored, rejected, replaced runs last updated more than 30d "
                     "ago; would delete 1 "
                     "tombstone(s) of runs pruned more than 7d ago; nothing was deleted "
                     "(--dry-run)"]
    assert _row(app, old) is not None
    lines = _duraflow(app, "prune", "--older-than", "30d").stdout.splitlines()
    assert lines[0].endswith("; deleted 1 tombstone(s) of runs pruned more than 7d ago")
    assert _row(app, old) is None and _count(app, "signals", old) == 0
    assert _row(app, recent) is not None

    # With a shorter retention asked for, the recent one goes too; after that its task id
    # is unknown, and a delivery of it would start a new run.
    assert delete_tombstones(store, older_than=timedelta(hours=2)) == 0
    lines = _duraflow(app, "prune", "--older-than", "30d",
                      "--tombstones-older-than", "0s").stdout.splitlines()
    assert lines[0].endswith("; deleted 1 tombstone(s) of runs pruned more than 0s ago")
    assert _row(app, recent) is None
    assert calls == {"charge": 2, "mail": 2}


def test_a_version_9_database_upgrades_with_its_runs(make_app: Callable[..., Celery]) -> None:
    """Version 10 adds pruned_at and prune's partial indexes to a database holding runs."""
    app = make_app()
    store = _store(app)
    engine = store._transactional()
    tables = store.tables
    with engine.begin() as conn:
        tables.schema_version.create(conn)
        for version, description, apply in MIGRATIONS[:9]:
            apply(conn, tables)
            conn.execute(tables.schema_version.insert().values(
                version=version, description=description, applied_at=datetime.now(UTC)))
    # Rows written by a version-9 release: a succeeded run with a step, and a failed one.
    v9 = MetaData()
    runs_v9 = Table(tables.runs.name, v9, autoload_with=store.engine)
    steps_v9 = Table(tables.steps.name, v9, autoload_with=store.engine)
    assert "pruned_at" not in runs_v9.c
    old = datetime.now(UTC) - timedelta(days=40)
    with engine.begin() as conn:
        for task_id, status in (("v9-ok", "succeeded"), ("v9-failed", "failed")):
            conn.execute(runs_v9.insert().values(
                task_id=task_id, task_name="tomb.book", status=status, attempts=1,
                result='"booked-8"' if status == "succeeded" else None, serializer="json",
                error="ValueError: no" if status == "failed" else None,
                args='{"args": [8], "kwargs": {}}', created_at=old, updated_at=old,
                finished_at=old, retries=0, recoveries=0, interrupted=False))
            conn.execute(steps_v9.insert().values(
                task_id=task_id, step_key="charge", status="completed", attempts=1,
                output='"charged-8"', serializer="json", started_at=old, completed_at=old,
                position=1))

    assert migrate(engine, tables, store.config.table_prefix) == list(
        range(10, LATEST_VERSION + 1))
    prefix = store.config.table_prefix
    indexes = {index["name"] for index in inspect(store.engine).get_indexes(tables.runs.name)}
    assert {f"{prefix}runs_live_status_updated", f"{prefix}runs_pruned"} <= indexes
    assert f"{prefix}runs_status_updated" not in indexes
    for task_id in ("v9-ok", "v9-failed"):
        row = _row(app, task_id)
        assert row is not None and row["pruned_at"] is None
        assert _count(app, "steps", task_id) == 1
    view = get_run("v9-ok", app=app)
    assert view is not None and view.result == "booked-8" and view.steps[0].result == "charged-8"

    # The upgraded runs are pruned like any other, and a redelivery then runs nothing.
    calls: Counter[str] = Counter()
    book, _ = _tasks(app, calls)
    assert book.apply(args=(8,), task_id="v9-ok").get() == "booked-8"  # its stored result
    _age(app, "v9-ok", updated_at=old)
    assert prune(store, older_than=timedelta(days=30)) == (2, 2)
    assert book.apply(args=(8,), task_id="v9-ok").state == "IGNORED"
    assert book.apply(args=(8,), task_id="v9-failed").state == "IGNORED"
    assert calls == {}
