"""Schema version 12: the run indexes that a run's own writes do not touch.

Every update that ends a run changes its status, so it is never HOT: the new row
version gets an entry in every index whose predicate it satisfies. Version 12
makes three indexes partial so that the writes of an ordinary run skip them:
the sweep's ``(status, lease_expires_at)`` holds only runs with a lease expiry
(ending a run clears it), ``(parent_id)`` only child runs, and prune's
``(status, updated_at)`` only ended runs not pruned yet (a new run is running).
On PostgreSQL the runs table also gets a fill factor, so that updated row
versions find room on their own page.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Engine, MetaData, Table, create_engine, select, text

from celery_duraflow import DurableTask, step
from celery_duraflow._config import config_for_app
from celery_duraflow._records import FINISHED, Delivery
from celery_duraflow._schema import (
    LATEST_VERSION,
    RUNS_FILLFACTOR,
    V12_FINISHED,
    Tables,
    migrate,
)
from celery_duraflow._store import Store, close_all_stores, store_for
from tests.conftest import drop_tables, index_definitions, schema_at

#: The indexes of the runs table from version 12 on (without the prefix).
RUN_INDEXES = {
    "runs_status_lease", "runs_parent", "runs_created", "runs_status_created",
    "runs_task_created", "runs_live_status_updated", "runs_pruned",
}


def _store(app: Celery) -> Store:
    return store_for(config_for_app(app))


def _rows(engine: Engine, tables: Tables) -> dict[str, list[dict[str, Any]]]:
    """Every row of the runs, steps and signals tables, in a stable order."""
    out: dict[str, list[dict[str, Any]]] = {}
    metadata = MetaData()
    for table in (tables.runs, tables.steps, tables.signals):
        reflected = Table(table.name, metadata, autoload_with=engine)
        order = [reflected.c[c.name] for c in table.primary_key.columns]
        with engine.connect() as conn:
            out[table.name] = [dict(row._mapping) for row in
                               conn.execute(select(reflected).order_by(*order))]
    return out


def test_the_status_lists_of_the_predicates_are_the_run_statuses() -> None:
    """The ended statuses written into version 12's predicates are those the code ends runs with."""
    assert set(V12_FINISHED) == set(FINISHED)


def test_a_version_11_database_upgrades_keeping_every_row(
        make_app: Callable[..., Celery]) -> None:
    """Version 12 applies to a version-11 database holding runs, and every row is kept as it was."""
    store = _store(make_app())
    tables = store.tables
    engine = schema_at(store, 11)
    now = datetime.now(UTC)
    base = {"task_name": "v11.task", "attempts": 1, "created_at": now, "updated_at": now,
            "retries": 0, "recoveries": 0, "interrupted": False}
    runs: list[dict[str, Any]] = [
        {"task_id": "ok", "status": "succeeded", "result": "1", "finished_at": now},
        {"task_id": "failed", "status": "failed", "error": "E", "finished_at": now},
        {"task_id": "running", "status": "running", "lease_owner": "o|m|1|x",
         "lease_expires_at": now + timedelta(minutes=5)},
        {"task_id": "sleeping", "status": "sleeping", "wait_kind": "sleep",
         "waiting_for": "nap", "wake_at": now, "lease_expires_at": now},
        {"task_id": "waiting", "status": "waiting", "wait_kind": "signal",
         "waiting_for": "go"},
        {"task_id": "child", "status": "running", "parent_id": "waiting",
         "attempts": 0, "lease_expires_at": now},
        {"task_id": "tomb", "status": "succeeded", "finished_at": now, "pruned_at": now},
    ]
    with engine.begin() as conn:
        for run in runs:
            conn.execute(tables.runs.insert().values(**{**base, **run}))
        for run in runs[:3]:
            conn.execute(tables.steps.insert().values(
                task_id=run["task_id"], step_key="a", status="completed", attempts=1,
                output="1", serializer="json", started_at=now, completed_at=now, position=1))
        conn.execute(tables.signals.insert().values(task_id="waiting", name="other",
                                                    payload="1", sent_at=now))
    before = _rows(engine, tables)

    assert migrate(engine, tables, store.config.table_prefix) == list(
        range(12, LATEST_VERSION + 1))

    after = _rows(engine, tables)
    # Later versions add columns: every row keeps each value it had, and is empty in them.
    pairs = [(row, old) for name, rows in after.items()
             for row, old in zip(rows, before[name], strict=True)]
    assert [{k: row[k] for k in old} for row, old in pairs] == [old for _, old in pairs]
    assert {k: v for row, old in pairs for k, v in row.items() if k not in old} == {
        "priority": None, "join_key": None}
    assert sum(len(rows) for rows in before.values()) == len(runs) + 3 + 1
    with engine.connect() as conn:
        version = conn.execute(select(tables.schema_version.c.version)
                               .order_by(tables.schema_version.c.version.desc())).first()
    assert version is not None and version[0] == LATEST_VERSION


def test_the_run_indexes_after_migration(make_app: Callable[..., Celery]) -> None:
    """After migrating, runs has version 12's partial indexes, with their predicates."""
    store = _store(make_app())
    store.ensure_schema()
    prefix = store.config.table_prefix
    engine = store.engine
    definitions = {name.removeprefix(prefix): sql.lower() for name, sql in
                   index_definitions(engine, store.tables.runs.name).items()
                   if name.startswith(prefix)}
    # Version 13 redefined the two listing indexes (tests/test_schema_v13.py); the rest
    # are version 12's.
    assert set(definitions) >= RUN_INDEXES - {"runs_status_created", "runs_task_created"}
    assert "lease_expires_at is not null" in definitions["runs_status_lease"]
    assert "parent_id is not null" in definitions["runs_parent"]
    prune_index = definitions["runs_live_status_updated"]
    assert "pruned_at is null" in prune_index
    assert all(status in prune_index for status in V12_FINISHED)
    assert "running" not in prune_index
    assert "pruned_at is not null" in definitions["runs_pruned"]
    assert " where " not in definitions["runs_created"]
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            options = conn.execute(text("SELECT reloptions FROM pg_class WHERE relname = :t"),
                                   {"t": store.tables.runs.name}).scalar_one()
        assert options == [f"fillfactor={RUNS_FILLFACTOR}"]


def test_an_upgraded_database_has_the_indexes_of_a_new_one(
        make_app: Callable[..., Celery]) -> None:
    """Migrating 11 to 12 and creating a database from nothing give the same run indexes."""
    app = make_app()
    store = _store(app)
    engine = schema_at(store, 11)
    migrate(engine, store.tables, store.config.table_prefix)
    prefix = store.config.table_prefix
    upgraded = index_definitions(engine, store.tables.runs.name)
    fresh_prefix = f"t{uuid.uuid4().hex[:10]}_"
    fresh_app = Celery("fresh", set_as_current=False)
    fresh_app.conf.update(duraflow_database_url=app.conf.duraflow_database_url,
                          duraflow_table_prefix=fresh_prefix)
    fresh = _store(fresh_app)
    try:
        fresh.ensure_schema()
        created = index_definitions(fresh.engine, fresh.tables.runs.name)
        assert ({n.replace(prefix, ""): s.replace(prefix, "") for n, s in upgraded.items()}
                == {n.replace(fresh_prefix, ""): s.replace(fresh_prefix, "")
                    for n, s in created.items()})
    finally:
        fresh.close()
        drop_tables(app.conf.duraflow_database_url, fresh_prefix)


@pytest.fixture
def pg_app(pg_url: str, table_prefix: str) -> Iterator[Celery]:
    app = Celery(f"test-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.update(result_backend="cache+memory://", task_always_eager=True,
                    task_eager_propagates=False, duraflow_database_url=pg_url,
                    duraflow_table_prefix=table_prefix)
    yield app
    close_all_stores()
    drop_tables(pg_url, table_prefix)


def _entries_after_vacuum(url: str, table: str) -> dict[str, float]:
    """The entries each index of ``table`` keeps once the dead row versions are gone.

    ``VACUUM (INDEX_CLEANUP ON)`` scans every index and records its exact entry
    count in ``reltuples``. Another session's old snapshot can keep dead versions
    (and their entries) for a while on a shared server: vacuum again until none is left.
    """
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            deadline = time.monotonic() + 30
            while True:
                conn.execute(text(f'VACUUM (INDEX_CLEANUP ON) "{table}"'))
                dead = conn.execute(text(
                    "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = :t"),
                    {"t": table}).scalar_one()
                if not dead or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
                conn.execute(text("SELECT pg_stat_clear_snapshot()"))
            rows = conn.execute(text(
                "SELECT i.relname, i.reltuples FROM pg_index x "
                "JOIN pg_class i ON i.oid = x.indexrelid "
                "JOIN pg_class t ON t.oid = x.indrelid WHERE t.relname = :t"), {"t": table})
            return {str(name): float(count) for name, count in rows}
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_runs_own_writes_leave_out_the_partial_indexes(pg_app: Celery, pg_url: str,
                                                        table_prefix: str) -> None:
    """Ended runs keep no entry in the sweep's index, running ones none in prune's, top-level
    ones none in the parent index: with version 11's indexes each would have one."""

    @pg_app.task(base=DurableTask, name="v12.two_steps")
    def two_steps(n: int) -> int:
        with step("a") as a:
            a.result = n
        with step("b") as b:
            b.result = n + 1
        return int(a.result) + int(b.result)

    ended, running = 12, 5
    for n in range(ended):
        assert two_steps.apply(args=(n,)).get() == 2 * n + 1
    store = _store(pg_app)
    for n in range(running):
        run, _ = store.begin_attempt(f"running-{n}", Delivery(task_name="v12.two_steps",
                                                              owner=f"owner-{n}"))
        assert run.status == "running" and run.lease_expires_at is not None
    runs = store.tables.runs.name
    store.close()

    with create_engine(pg_url).connect() as conn:
        parent_size = conn.execute(text("SELECT pg_relation_size(:i)"),
                                   {"i": f"{table_prefix}runs_parent"}).scalar_one()
    # Only its metapage: not one of the 2 x 12 + 5 run row versions ever got an entry.
    assert parent_size == 8192

    entries = {name.removeprefix(table_prefix): count
               for name, count in _entries_after_vacuum(pg_url, runs).items()}
    assert entries["runs_pkey"] == ended + running
    assert entries["runs_created"] == ended + running
    # Ending a run clears its lease expiry: only the running runs are in the sweep's index.
    assert entries["runs_status_lease"] == running
    # A run that has not ended is no prune candidate: only the ended ones.
    assert entries["runs_live_status_updated"] == ended
    assert entries["runs_parent"] == 0
    assert entries["runs_pruned"] == 0
