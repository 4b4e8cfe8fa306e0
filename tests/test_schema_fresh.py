"""An empty database gets the current schema at once, and it is the migrated one.

``migrate()`` creates an empty database's tables straight from the current model
(``build_tables``) in one transaction and records every version as applied,
instead of running the twelve numbered migrations one after the other. That is
only right while the model describes exactly what the migrations build, so the
tests here build both, side by side under two prefixes of one database, and
compare what SQLAlchemy's reflection and the database's own catalogue say:
columns with their types, nullability and defaults, primary keys, unique
constraints, foreign keys, checks and every index (on PostgreSQL its full
definition and the tables' storage options, on SQLite the SQL it keeps, partial
predicates included).

Column order is left out of the comparison: migrations append the columns they
add at the end of a table, while the model declares them where they belong. The
library names its columns in every statement it issues (never ``SELECT *`` or an
INSERT without a column list), so the order cannot change what it reads or writes.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Engine, create_engine, inspect, select, text

from celery_duraflow import DurableTask, _schema, get_run, step
from celery_duraflow._config import config_for_app, load_config
from celery_duraflow._schema import (
    LATEST_VERSION,
    MIGRATIONS,
    RUNS_FILLFACTOR,
    Tables,
    _apply_migrations,
    build_tables,
    current_version,
    migrate,
)
from celery_duraflow._store import Store, store_for
from tests.conftest import drop_tables


def _store(app: Celery) -> Store:
    return store_for(config_for_app(app))


def _store_with_prefix(app: Celery, prefix: str) -> Store:
    """A store on ``app``'s database under another table prefix."""
    other = Celery(f"fresh-{uuid.uuid4().hex[:6]}", set_as_current=False)
    other.conf.update(duraflow_database_url=app.conf.duraflow_database_url,
                      duraflow_table_prefix=prefix)
    return Store(config_for_app(other))


def _migrate_one_by_one(engine: Engine, tables: Tables) -> list[int]:
    """Build the schema as releases before the fast path did: each migration in turn."""
    with engine.connect() as conn:
        return _apply_migrations(conn, tables)


@pytest.fixture
def no_step_by_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any use of the numbered migrations fail, to prove the fast path did the work.

    Only ``migrate()``'s own lookup is replaced: this module imported the original
    function by name, so :func:`_migrate_one_by_one` still builds the reference schema.
    """

    def refuse(conn: Any, tables: Tables) -> list[int]:
        raise AssertionError("an empty database took the numbered migrations")

    monkeypatch.setattr(_schema, "_apply_migrations", refuse)


def _strip(value: Any, prefix: str) -> Any:
    """``value`` with the table prefix taken out of every string in it."""
    if isinstance(value, str):
        return value.replace(prefix, "<p>")
    if isinstance(value, dict):
        return {_strip(k, prefix): _strip(v, prefix) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return tuple(_strip(v, prefix) for v in value)
    return value


def _reflected(engine: Engine, prefix: str) -> dict[str, Any]:
    """What reflection reports of every table under ``prefix``, prefix removed."""
    out: dict[str, Any] = {}
    with engine.connect() as conn:
        inspector = inspect(conn)
        for table in sorted(t for t in inspector.get_table_names() if t.startswith(prefix)):
            columns = {
                c["name"]: (c["type"].compile(dialect=engine.dialect), c["nullable"],
                            c.get("default"))
                for c in inspector.get_columns(table)
            }
            indexes = sorted(
                (str(i["name"]), tuple(i["column_names"]), bool(i["unique"]),
                 # Partial predicates come back as text clauses: compare their SQL.
                 tuple(sorted((k, str(v)) for k, v in i.get("dialect_options", {}).items())))
                for i in inspector.get_indexes(table)
            )
            out[table.removeprefix(prefix)] = _strip({
                "columns": columns,
                "primary_key": inspector.get_pk_constraint(table),
                "unique": sorted((str(u["name"]), tuple(u["column_names"]))
                                 for u in inspector.get_unique_constraints(table)),
                "foreign_keys": sorted(repr(sorted(fk.items()))
                                       for fk in inspector.get_foreign_keys(table)),
                "checks": sorted(repr(sorted(c.items()))
                                 for c in inspector.get_check_constraints(table)),
                "indexes": indexes,
            }, prefix)
    return out


def _catalogue(engine: Engine, prefix: str) -> dict[str, Any]:
    """What the database keeps about every object under ``prefix``, prefix removed.

    PostgreSQL: each relation (tables, indexes, sequences) with its kind and
    storage options (the runs fill factor), and each index's full definition.
    SQLite: each object with its kind, and each index's SQL (table SQL is left
    out: it lists the columns in their order of arrival).
    """
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            relations = conn.execute(text(
                "SELECT relname, relkind, reloptions FROM pg_class "
                "WHERE starts_with(relname, :p) AND pg_table_is_visible(oid)"), {"p": prefix})
            indexes = conn.execute(text(
                "SELECT indexname, indexdef FROM pg_indexes "
                "WHERE starts_with(tablename, :p) AND schemaname = current_schema()"),
                {"p": prefix})
            return _strip({
                "relations": {name: (kind, sorted(options or ()))
                              for name, kind, options in relations},
                "indexes": {name: definition for name, definition in indexes},
            }, prefix)
        objects = conn.execute(text(
            "SELECT type, name, CASE WHEN type = 'index' THEN sql END FROM sqlite_master "
            "WHERE substr(tbl_name, 1, length(:p)) = :p"), {"p": prefix})
        return _strip({"objects": {(kind, name): sql for kind, name, sql in objects}}, prefix)


def _versions(engine: Engine, tables: Tables) -> list[tuple[int, str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(select(tables.schema_version).order_by(
            tables.schema_version.c.version)).all()
    return [(row.version, row.description, row.applied_at) for row in rows]


@pytest.fixture
def migrated(make_app: Callable[..., Celery]) -> Iterator[Store]:
    """A store on this test's database, under a prefix of its own, with no tables yet."""
    app = make_app()
    prefix = f"t{uuid.uuid4().hex[:10]}_"
    store = _store_with_prefix(app, prefix)
    yield store
    store.close()
    drop_tables(app.conf.duraflow_database_url, prefix)


def test_a_new_database_gets_the_schema_the_migrations_build(
        make_app: Callable[..., Celery], migrated: Store, no_step_by_step: None) -> None:
    """Creating the current model at once gives the tables, keys and indexes of migrations 1..N."""
    assert _migrate_one_by_one(migrated._transactional(), migrated.tables) == list(
        range(1, LATEST_VERSION + 1))
    fresh = _store(make_app())
    assert fresh.migrate() == list(range(1, LATEST_VERSION + 1))

    old_prefix, new_prefix = migrated.config.table_prefix, fresh.config.table_prefix
    by_migrations = _reflected(migrated.engine, old_prefix)
    at_once = _reflected(fresh.engine, new_prefix)
    assert set(at_once) == {"schema", "runs", "steps", "signals", "flow_slots", "flow_waits",
                            "flow_rates", "flow_dedupe", "schedules"}
    assert at_once == by_migrations
    catalogue = _catalogue(fresh.engine, new_prefix)
    assert catalogue == _catalogue(migrated.engine, old_prefix)
    # The comparison saw the objects it is about (a query that matched nothing would
    # compare two empty catalogues).
    if fresh.engine.dialect.name == "postgresql":
        assert catalogue["relations"]["<p>runs"] == ("r", (f"fillfactor={RUNS_FILLFACTOR}",))
        assert "WHERE" in catalogue["indexes"]["<p>runs_live_status_updated"]
    else:
        assert "WHERE" in catalogue["objects"][("index", "<p>runs_live_status_updated")]


def test_the_fast_path_records_every_version(
        make_app: Callable[..., Celery], no_step_by_step: None) -> None:
    """An empty database ends at the latest version, with one row per migration, as migrated."""
    store = _store(make_app())
    assert store.migrate() == [version for version, _d, _a in MIGRATIONS]
    with store.engine.connect() as conn:
        assert current_version(conn, store.tables) == LATEST_VERSION
    rows = _versions(store.engine, store.tables)
    assert [(v, d) for v, d, _at in rows] == [(v, d) for v, d, _a in MIGRATIONS]
    # Recorded in one transaction, at one time.
    assert len({at for _v, _d, at in rows}) == 1
    # Nothing left to apply afterwards.
    assert store.migrate() == []
    assert len(_versions(store.engine, store.tables)) == len(MIGRATIONS)


def test_an_empty_version_table_still_takes_the_fast_path(
        make_app: Callable[..., Celery], no_step_by_step: None) -> None:
    """A version table with no rows is version 0: the schema is created at once beside it."""
    store = _store(make_app())
    with store._transactional().begin() as conn:
        store.tables.schema_version.create(conn)
    assert store.migrate() == list(range(1, LATEST_VERSION + 1))
    assert len(_versions(store.engine, store.tables)) == len(MIGRATIONS)


def test_a_database_with_a_schema_takes_the_numbered_migrations(
        make_app: Callable[..., Celery]) -> None:
    """A database at version 1 or later is upgraded by the migrations it lacks, not recreated."""
    store = _store(make_app())
    tables = store.tables
    engine = store._transactional()
    with engine.begin() as conn:
        tables.schema_version.create(conn)
        for version, description, apply in MIGRATIONS[:1]:
            apply(conn, tables)
            conn.execute(tables.schema_version.insert().values(
                version=version, description=description, applied_at=datetime.now(UTC)))
    assert migrate(engine, tables, store.config.table_prefix) == list(
        range(2, LATEST_VERSION + 1))
    rows = _versions(store.engine, tables)
    assert [v for v, _d, _at in rows] == list(range(1, LATEST_VERSION + 1))
    # Each later version in a transaction of its own, after version 1's.
    assert len({at for _v, _d, at in rows}) > 1


def test_a_database_created_at_once_stores_runs_and_steps(
        make_app: Callable[..., Celery], no_step_by_step: None) -> None:
    """A task with a step runs on a schema created at once and leaves its run and step rows."""
    app = make_app()
    store = _store(app)
    store.migrate()

    @app.task(base=DurableTask)
    def add(a: int, b: int) -> int:
        with step("sum") as s:
            s.result = a + b
        return int(s.result) * 2

    result = add.apply(args=(2, 3))
    assert result.get() == 10
    tables = store.tables
    with store.engine.connect() as conn:
        run = conn.execute(select(tables.runs).where(
            tables.runs.c.task_id == result.id)).one()
        steps = conn.execute(select(tables.steps).where(
            tables.steps.c.task_id == result.id)).all()
    assert (run.status, run.attempts, run.task_name) == ("succeeded", 1, add.name)
    assert run.result is not None and run.lease_owner is None and run.pruned_at is None
    assert [(s.step_key, s.status, s.attempts, s.position) for s in steps] == [
        ("sum", "completed", 1, 1)]
    assert steps[0].output is not None and steps[0].code_fingerprint is not None
    recorded = get_run(result.id, app=app)
    assert recorded is not None and recorded.step("sum").result == 5


def test_six_threads_creating_one_sqlite_file_create_it_once(tmp_path: Path) -> None:
    """Six stores creating the same new SQLite file at once all succeed; one creates it."""
    url = f"sqlite:///{tmp_path / 'race.sqlite3'}"
    prefix = "race_"
    barrier = threading.Barrier(6)
    results: list[list[int]] = []
    errors: list[BaseException] = []

    def work() -> None:
        store = Store(load_config({"duraflow_database_url": url,
                                   "duraflow_table_prefix": prefix}, environ={}))
        try:
            barrier.wait()
            results.append(store.migrate())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            store.close()

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert sorted(results, key=len) == [[]] * 5 + [list(range(1, LATEST_VERSION + 1))]
    engine = create_engine(url)
    try:
        rows = _versions(engine, build_tables(prefix))
    finally:
        engine.dispose()
    assert [(v, d) for v, d, _at in rows] == [(v, d) for v, d, _a in MIGRATIONS]
