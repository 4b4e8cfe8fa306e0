"""Prune works in bounded batches, reports each one, and resumes after an interruption.

On a store of millions of runs a prune must never be one long statement holding
locks on everything it deletes: each batch of at most ``batch_size`` runs is one
short transaction (its steps, its signals, then the runs' rows become tombstones),
committed before the next begins. The command reports every batch; an interrupted
prune keeps what it committed and the next one goes on from there. Its dry run and
the listings' footers count up to a cap, and say so. On SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from celery import Celery
from celery.bin.celery import celery as celery_command
from click.testing import CliRunner, Result
from sqlalchemy import func, select

from celery_duraflow import _admin
from celery_duraflow._config import config_for_app
from celery_duraflow._store import Store, store_for


def _store(app: Celery) -> Store:
    store = store_for(config_for_app(app))
    store.ensure_schema()
    return store


def _fill(store: Store, count: int, *, days_ago: float, status: str = "succeeded",
          prefix: str = "old", steps: int = 2) -> list[str]:
    """``count`` runs last updated ``days_ago`` days ago, each with ``steps`` steps."""
    tables = store.tables
    when = datetime.now(UTC) - timedelta(days=days_ago)
    ids = [f"{prefix}-{i:03d}" for i in range(count)]
    with store.engine.begin() as conn:
        conn.execute(tables.runs.insert(), [
            {"task_id": task_id, "task_name": "shop.trip", "status": status, "attempts": 1,
             "created_at": when, "updated_at": when, "retries": 0, "recoveries": 0,
             "interrupted": False} for task_id in ids])
        conn.execute(tables.steps.insert(), [
            {"task_id": task_id, "step_key": f"s{n}", "status": "completed", "attempts": 1,
             "started_at": when} for task_id in ids for n in range(steps)])
    return ids


def _count(store: Store, table: str, *, live: bool = False) -> int:
    t = getattr(store.tables, table)
    query = select(func.count()).select_from(t)
    if live:
        query = query.where(t.c.pruned_at.is_(None))
    with store.engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def _duraflow(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(celery_command, ["-A", app, "duraflow", *args],  # type: ignore[list-item]
                              env={"COLUMNS": "400"})


def test_prune_deletes_in_batches_and_leaves_younger_runs(
        make_app: Callable[..., Celery]) -> None:
    """35 old runs with a batch size of 10 go in 4 batches, reported one by one; young ones stay."""
    store = _store(make_app())
    _fill(store, 35, days_ago=40)
    young = _fill(store, 5, days_ago=1, prefix="young")
    batches: list[_admin.PruneBatch] = []

    pruned = _admin.prune(store, older_than=timedelta(days=30), batch_size=10,
                          tombstones_older_than=None, progress=batches.append)

    assert pruned == (35, 70)
    assert [(b.runs, b.steps) for b in batches] == [(10, 20), (10, 20), (10, 20), (5, 10)]
    assert [b.runs_total for b in batches] == [10, 20, 30, 35]
    assert batches[-1].steps_total == 70
    assert all(b.status == "succeeded" and b.seconds >= 0 for b in batches)
    assert _count(store, "runs", live=True) == 5
    assert _count(store, "steps") == 10
    assert all(store.get_run(task_id) is not None for task_id in young)


def test_an_interrupted_prune_keeps_its_batches_and_resumes(
        make_app: Callable[..., Celery]) -> None:
    """A prune stopped after its first batch kept that batch; running it again prunes the rest."""
    store = _store(make_app())
    _fill(store, 25, days_ago=40)

    def stop(batch: _admin.PruneBatch) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _admin.prune(store, older_than=timedelta(days=30), batch_size=10,
                     tombstones_older_than=None, progress=stop)
    assert _count(store, "runs", live=True) == 15
    assert _count(store, "steps") == 30

    assert _admin.prune(store, older_than=timedelta(days=30), batch_size=10,
                        tombstones_older_than=None) == (15, 30)
    assert _count(store, "runs", live=True) == 0
    assert _count(store, "steps") == 0


def test_the_prune_command_reports_each_batch(make_app: Callable[..., Celery]) -> None:
    """`prune --batch-size 10` prints a progress line per batch on stderr, the summary on stdout."""
    app = make_app()
    store = _store(app)
    _fill(store, 23, days_ago=40)

    result = _duraflow(app, "prune", "--older-than", "30d", "--batch-size", "10")

    assert result.exit_code == 0, (result.output, result.exception)
    progress = result.stderr.splitlines()
    assert [line.split(" in ")[0] for line in progress] == [
        "pruned 10 succeeded run(s) (20 steps)", "pruned 10 succeeded run(s) (20 steps)",
        "pruned 3 succeeded run(s) (6 steps)"]
    assert progress[-1].endswith("; 23 run(s) (46 steps) so far")
    assert result.stdout.startswith("pruned 23 run(s) (46 steps)")


def test_dry_run_and_listing_counts_stop_at_the_cap_and_say_so(
        make_app: Callable[..., Celery], monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the cap, the dry run and the listing footer print 'N+' and say they are bounded;
    the dry run counts steps only below it."""
    app = make_app()
    store = _store(app)
    _fill(store, 7, days_ago=40)
    _fill(store, 2, days_ago=40, status="failed", prefix="bad")
    monkeypatch.setattr(_admin, "COUNT_CAP", 5)

    counts = _admin.count_by_status_bounded(store, cap=5)
    assert counts.counts == {"succeeded": 5, "failed": 2}
    assert counts.bounded and counts.at_least("succeeded") and not counts.at_least("failed")
    assert counts.text(5) == "5+" and counts.text(2) == "2"
    exact = _admin.count_by_status_bounded(store, cap=1000)
    assert exact.counts == {"succeeded": 7, "failed": 2} and not exact.bounded

    dry = _duraflow(app, "prune", "--older-than", "30d", "--dry-run")
    assert dry.exit_code == 0, (dry.output, dry.exception)
    # At the cap the steps are not counted: that count would grow with the store.
    assert dry.stdout.startswith("would prune 5+ run(s) (their steps not counted)")
    assert _admin.count_prunable(store, older_than=timedelta(days=30), cap=5) == (5, None)
    assert _admin.count_prunable(store, older_than=timedelta(days=30), cap=10) == (9, 18)
    assert "counted up to 5, so '+' means at least" in dry.stdout
    assert _count(store, "runs", live=True) == 9

    listing = _duraflow(app, "runs")
    assert listing.exit_code == 0, (listing.output, listing.exception)
    footer = listing.stdout.splitlines()[-1]
    assert footer.startswith("7+ run(s) match: succeeded 5+, failed 2 (newest 9 shown")
    assert "counted up to 5 per status, so '+' means at least" in footer
