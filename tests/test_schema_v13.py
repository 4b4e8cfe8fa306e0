"""Schema version 13: the operator side's indexes, for stores of millions of runs.

The listing by status reads ``(status, created_at)`` and the listing by task name
``(task_name, status, created_at)``, both of the live runs only (a tombstone has no
entry), so that a count per status can stop after a capped number of entries. On
PostgreSQL an index of the patch markers by name lets ``patch NAME`` look its marker
up instead of matching every step key against ``%/NAME``. Version 13 applies to a
version-12 database, keeps every row, and leaves the indexes a new database gets.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery
from sqlalchemy import Engine, select

from celery_duraflow import _admin
from celery_duraflow._config import config_for_app
from celery_duraflow._schema import LATEST_VERSION, migrate
from celery_duraflow._store import Store, store_for
from tests.conftest import drop_tables, index_definitions, schema_at

#: The indexes of the runs table from version 13 on (without the prefix).
RUN_INDEXES = {
    "runs_status_lease", "runs_parent", "runs_created", "runs_status_created",
    "runs_task_status_created", "runs_live_status_updated", "runs_pruned",
}


def _store(app: Celery) -> Store:
    return store_for(config_for_app(app))


def _index_definitions(engine: Engine, table: str) -> dict[str, str]:
    return {name: sql.lower() for name, sql in index_definitions(engine, table).items()}


# Columns that versions after 13 added to runs and steps.
_LATER_COLUMNS = frozenset({"priority", "join_key"})


def _rows(engine: Engine, store: Store) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of runs and steps, in the columns the tables had at version 13 (later
    versions add columns, which a version-12 database gets only when it migrates)."""
    with engine.connect() as conn:
        return {t.name: sorted(map(tuple, conn.execute(
                    select(*[c for c in t.c if c.name not in _LATER_COLUMNS])).all()))
                for t in (store.tables.runs, store.tables.steps)}


def test_the_indexes_of_a_new_database(make_app: Callable[..., Celery]) -> None:
    """A new database has version 13's run indexes, the listing ones partial on live runs,
    version 14's index of the runs waiting for a child, and version 15's of joins."""
    store = _store(make_app())
    store.ensure_schema()
    prefix = store.config.table_prefix
    runs = {name.removeprefix(prefix): sql for name, sql in
            _index_definitions(store.engine, store.tables.runs.name).items()
            if name.startswith(prefix)}
    assert set(runs) - {"runs_pkey"} == RUN_INDEXES | {"runs_waiting_child", "runs_open_joins",
                                                       "runs_waiting_join"}
    assert "'waiting'" in runs["runs_waiting_child"] and "'child'" in runs["runs_waiting_child"]
    for listing in ("runs_status_created", "runs_task_status_created"):
        assert "pruned_at is null" in runs[listing]
    assert "task_name, status, created_at" in runs["runs_task_status_created"]
    steps = {name.removeprefix(prefix) for name in
             _index_definitions(store.engine, store.tables.steps.name)
             if name.startswith(prefix)}
    if store.engine.dialect.name == "postgresql":
        assert steps == {"steps_task_step_key", "steps_patch_markers"}
    else:
        assert steps <= {"steps_task_step_key"}  # SQLite's key index is implicit


def test_a_version_12_database_upgrades_keeping_its_rows_and_markers(
        make_app: Callable[..., Celery]) -> None:
    """Version 13 applies to a version-12 database, keeps its rows, and patch finds its markers."""
    app = make_app()
    store = _store(app)
    engine = schema_at(store, 12)
    tables = store.tables
    now = datetime.now(UTC)
    with engine.begin() as conn:
        for i, status in enumerate(("succeeded", "running", "waiting")):
            conn.execute(tables.runs.insert().values(
                task_id=f"r{i}", task_name="v12.task", status=status, attempts=1,
                created_at=now - timedelta(hours=3 - i), updated_at=now, retries=0,
                recoveries=0, interrupted=False))
        conn.execute(tables.steps.insert().values(
            task_id="r0", step_key="patched:fast-path", status="completed", attempts=1,
            output="true", serializer="json", started_at=now - timedelta(minutes=90)))
    before = _rows(engine, store)

    assert migrate(engine, tables, store.config.table_prefix) == list(range(13, LATEST_VERSION + 1))

    assert _rows(engine, store) == before
    first, count, old = _admin.patch_status(store, "patched:fast-path")
    assert first is not None and count == 1
    # r1 was created before the marker's first record, without it: it may take the old branch.
    assert [run.task_id for run in old] == ["r1"]


def test_an_upgraded_database_has_the_indexes_of_a_new_one(
        make_app: Callable[..., Celery]) -> None:
    """Migrating 12 to 13 and creating a database from nothing give the same indexes."""
    app = make_app()
    store = _store(app)
    engine = schema_at(store, 12)
    migrate(engine, store.tables, store.config.table_prefix)
    prefix = store.config.table_prefix
    fresh_prefix = f"t{uuid.uuid4().hex[:10]}_"
    fresh_app = Celery("fresh", set_as_current=False)
    fresh_app.conf.update(duraflow_database_url=app.conf.duraflow_database_url,
                          duraflow_table_prefix=fresh_prefix)
    fresh = _store(fresh_app)
    try:
        fresh.ensure_schema()
        for table in ("runs", "steps"):
            upgraded = _index_definitions(engine, prefix + table)
            created = _index_definitions(fresh.engine, fresh_prefix + table)
            assert ({n.replace(prefix, ""): s.replace(prefix, "") for n, s in upgraded.items()}
                    == {n.replace(fresh_prefix, ""): s.replace(fresh_prefix, "")
                        for n, s in created.items()})
    finally:
        fresh.close()
        drop_tables(app.conf.duraflow_database_url, fresh_prefix)


def test_patch_matches_the_same_keys_with_and_without_the_index(
        make_app: Callable[..., Celery]) -> None:
    """A marker is found at the top level, nested, repeated; a longer name never matches."""
    store = _store(make_app())
    store.ensure_schema()
    tables = store.tables
    now = datetime.now(UTC)
    keys: dict[str, str] = {"top": "patched:price", "nested": "book/patched:price",
                            "again": "book/patched:price#2", "deep": "a/b/patched:price#3",
                            "longer": "patched:price-check", "prefix": "patched:pric",
                            "inside": "patched:price/child"}
    rows: list[dict[str, Any]] = []
    for i, (task_id, key) in enumerate(keys.items()):
        rows.append({"task_id": task_id, "step_key": key, "status": "completed",
                     "attempts": 1, "started_at": now + timedelta(seconds=i)})
    with store.engine.begin() as conn:
        conn.execute(tables.steps.insert(), rows)
    first, count, _old = _admin.patch_status(store, "patched:price")
    assert count == 4
    assert first is not None and abs((first - now).total_seconds()) < 1
    _first, bounded, _old = _admin.patch_progress(store, "patched:price", cap=2)
    assert bounded == 2
