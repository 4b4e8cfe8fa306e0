"""Schema version 15: the children of a fan-out join, and the indexes that answer a join.

A child run started by ``children()`` records its parent's step key (``join_key``).
The index of open joins holds only the children of joins that have not ended, so a
child's end asks "is any sibling still open?" with one probe; the index of parents
waiting on a join serves the sweep's periodic look. Version 15 applies to a
version-14 database and keeps every row.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from celery import Celery
from sqlalchemy import select

from celery_duraflow._config import config_for_app
from celery_duraflow._schema import LATEST_VERSION, migrate
from celery_duraflow._store import Store, store_for
from tests.conftest import index_definitions, schema_at


def _store(app: Celery) -> Store:
    return store_for(config_for_app(app))


def test_a_new_database_has_the_indexes_of_joins(make_app: Callable[..., Celery]) -> None:
    """The index of open joins is partial on join children not ended; the index of parents
    waiting on a join is partial on those parents."""
    store = _store(make_app())
    store.ensure_schema()
    prefix = store.config.table_prefix
    runs = {name.removeprefix(prefix): sql.lower() for name, sql in
            index_definitions(store.engine, store.tables.runs.name).items()}
    open_joins = runs["runs_open_joins"]
    assert "parent_id, join_key" in open_joins and "join_key is not null" in open_joins
    for status in ("'running'", "'sleeping'", "'waiting'"):
        assert status in open_joins
    assert "'succeeded'" not in open_joins
    waiting = runs["runs_waiting_join"]
    assert "waiting_for" in waiting and "'children'" in waiting and "'waiting'" in waiting


def test_a_version_14_database_upgrades_keeping_its_rows(
        make_app: Callable[..., Celery]) -> None:
    """Version 15 applies to a version-14 database: the runs keep every value, with no
    join, and a join's children can be recorded afterwards."""
    store = _store(make_app())
    engine = schema_at(store, 14)
    tables = store.tables
    now = datetime.now(UTC)
    columns = [c for c in tables.runs.c if c.name != "join_key"]
    with engine.begin() as conn:
        for i, status in enumerate(("succeeded", "waiting")):
            conn.execute(tables.runs.insert().values(
                task_id=f"r{i}", task_name="v14.task", status=status, attempts=1,
                created_at=now, updated_at=now, retries=0, recoveries=0,
                interrupted=False, parent_id="p" if i else None))
        before = sorted(map(tuple, conn.execute(select(*columns)).all()))

    assert migrate(engine, tables, store.config.table_prefix) == list(
        range(15, LATEST_VERSION + 1))

    with engine.connect() as conn:
        assert sorted(map(tuple, conn.execute(select(*columns)).all())) == before
        assert conn.execute(select(tables.runs.c.join_key)).scalars().all() == [None, None]
