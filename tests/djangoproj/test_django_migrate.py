"""``manage.py migrate`` creates and upgrades the store's tables, through the library's
own numbered migrations, on the store's alias only.

Each test gives the store a table prefix of its own (``DURAFLOW_TABLE_PREFIX``), marks
the app's Django migrations unapplied on the alias, and runs ``migrate`` as a
deployment would (``call_command``), on PostgreSQL (``default``) and SQLite (``lite``).
"""

from __future__ import annotations

import itertools
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from celery import Celery
from django.core.management import call_command
from django.db import connections
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder
from django.test import override_settings
from sqlalchemy import create_engine, inspect, select, text
from sqlalchemy.engine import URL

from celery_duraflow import DurableTask, get_run, step
from celery_duraflow._db import Database
from celery_duraflow._schema import LATEST_VERSION, MIGRATIONS, build_tables
from celery_duraflow._store import close_all_stores
from celery_duraflow.contrib.django import conf
from celery_duraflow.contrib.django._migrate import schema_version_of

APP_LABEL = "duraflow"
ALIASES = ["default", "lite"]
SCHEMA_MIGRATION = re.compile(r"^\d{4}_schema_v(\d+)$")

pytestmark = pytest.mark.django_db(databases=ALIASES, transaction=True)


def _app_migrations() -> list[str]:
    loader = MigrationLoader(None, ignore_no_migrations=True)
    return sorted(name for app, name in loader.disk_migrations if app == APP_LABEL)


@pytest.fixture
def store(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The store on one alias under a fresh prefix, with the app's migrations unapplied
    there; afterwards its tables are dropped and the migrations recorded as applied."""
    alias: str = request.param
    prefix = f"m{uuid.uuid4().hex[:8]}_"
    with override_settings(DURAFLOW_DATABASE=alias, DURAFLOW_TABLE_PREFIX=prefix):
        config = conf.store_config()
        assert (config.django_alias, config.table_prefix) == (alias, prefix)
        unapply(alias)
        try:
            yield config
        finally:
            close_all_stores()
            engine = create_engine(config.database_url)
            try:
                with engine.begin() as conn:
                    build_tables(prefix).metadata.drop_all(conn)
            finally:
                engine.dispose()
            recorder = MigrationRecorder(connections[alias])
            for name in _app_migrations():
                recorder.record_applied(APP_LABEL, name)


def unapply(alias: str) -> None:
    """Forget, on ``alias``, that the app's Django migrations ran."""
    recorder = MigrationRecorder(connections[alias])
    for name in _app_migrations():
        recorder.record_unapplied(APP_LABEL, name)


def migrate(alias: str) -> None:
    call_command("migrate", APP_LABEL, database=alias, verbosity=0, interactive=False)


def recorded_by_django(alias: str) -> set[str]:
    return {name for app, name in MigrationRecorder(connections[alias]).applied_migrations()
            if app == APP_LABEL}


def schema_rows(url: URL, prefix: str) -> list[tuple[int, str, Any]]:
    """The library's record of applied schema versions, [] when there is none."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            if not inspect(conn).has_table(f"{prefix}schema"):
                return []
            table = build_tables(prefix).schema_version
            return [tuple(row) for row in conn.execute(
                select(table.c.version, table.c.description, table.c.applied_at)
                .order_by(table.c.version))]
    finally:
        engine.dispose()


def our_tables(url: URL, prefix: str) -> set[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return {name for name in inspect(conn).get_table_names() if name.startswith(prefix)}
    finally:
        engine.dispose()


def run_a_task(alias: str) -> str:
    """Run a durable task on the store as a worker of the project would (auto_migrate off);
    return the run's status."""
    app = Celery(f"migrate-{alias}", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")

    @app.task(base=DurableTask, name="migrate.add", shared=False)
    def add(x: int, y: int) -> int:
        with step("add") as s:
            s.result = x + y
        result: int = s.result
        return result

    task_id = f"migrate-{uuid.uuid4().hex}"
    assert add.apply(args=(2, 3), task_id=task_id).get() == 5
    run = get_run(task_id, app=app)
    assert [(s.key, s.status) for s in run.steps] == [("add", "completed")]
    return run.status


@pytest.mark.parametrize("store", ALIASES, indirect=True)
def test_migrate_creates_the_schema_in_an_empty_database(store: Any) -> None:
    """On a database without the store's tables, migrate creates them at the latest version."""
    alias, url, prefix = store.django_alias, store.database_url, store.table_prefix
    assert our_tables(url, prefix) == set()
    migrate(alias)
    tables = build_tables(prefix)
    assert our_tables(url, prefix) == {t.name for t in tables.metadata.sorted_tables}
    assert [row[0] for row in schema_rows(url, prefix)] == list(range(1, LATEST_VERSION + 1))
    assert recorded_by_django(alias) == set(_app_migrations())
    assert store.auto_migrate is False
    assert run_a_task(alias) == "succeeded"


@pytest.mark.parametrize("store", ALIASES, indirect=True)
def test_migrate_keeps_a_schema_the_library_created_itself(store: Any) -> None:
    """A database the library migrated on its own is left as it is, with its runs."""
    alias, url, prefix = store.django_alias, store.database_url, store.table_prefix
    database = Database(store)
    try:
        assert database.migrate() == list(range(1, LATEST_VERSION + 1))
    finally:
        database.close()
    before = schema_rows(url, prefix)
    with override_settings(DURAFLOW_AUTO_MIGRATE=False):
        assert run_a_task(alias) == "succeeded"
    migrate(alias)
    assert schema_rows(url, prefix) == before  # no version applied twice, none rewritten
    assert recorded_by_django(alias) == set(_app_migrations())
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            statuses = conn.execute(text(f"SELECT status FROM {prefix}runs")).scalars().all()
    finally:
        engine.dispose()
    assert statuses == ["succeeded"]


@pytest.mark.parametrize("store", ALIASES, indirect=True)
def test_migrate_upgrades_a_schema_an_older_release_left(store: Any) -> None:
    """A schema the library left at the previous version is upgraded by migrate, in place."""
    alias, url, prefix = store.django_alias, store.database_url, store.table_prefix
    tables = build_tables(prefix)
    engine = create_engine(url)
    try:
        for version, description, apply in MIGRATIONS[:-1]:
            with engine.begin() as conn:
                tables.schema_version.create(conn, checkfirst=True)
                apply(conn, tables)
                conn.execute(tables.schema_version.insert().values(
                    version=version, description=description, applied_at=datetime.now(UTC)))
    finally:
        engine.dispose()
    older = schema_rows(url, prefix)
    assert [row[0] for row in older] == list(range(1, LATEST_VERSION))
    migrate(alias)
    upgraded = schema_rows(url, prefix)
    assert upgraded[:-1] == older
    assert [row[0] for row in upgraded] == list(range(1, LATEST_VERSION + 1))
    assert run_a_task(alias) == "succeeded"


@pytest.mark.parametrize(("store", "other"), [("default", "lite"), ("lite", "default")],
                         indirect=["store"])
def test_migrate_on_another_alias_leaves_it_alone(store: Any, other: str) -> None:
    """Migrating an alias that is not the store's creates no table there, and records it."""
    prefix = store.table_prefix
    with override_settings(DURAFLOW_DATABASE=other):
        other_url = conf.store_config().database_url
    unapply(other)
    migrate(other)
    assert our_tables(other_url, prefix) == set()
    assert our_tables(store.database_url, prefix) == set()  # the store's alias: not yet
    assert recorded_by_django(other) == set(_app_migrations())
    migrate(store.django_alias)
    assert [row[0] for row in schema_rows(store.database_url, prefix)][-1] == LATEST_VERSION
    assert our_tables(other_url, prefix) == set()


@pytest.mark.parametrize("store", ["default"], indirect=True)
def test_migrate_leaves_a_store_given_by_url_to_the_library(store: Any, tmp_path: Any) -> None:
    """With DURAFLOW_DATABASE_URL set the store is on no alias, and migrate touches no alias."""
    url = f"sqlite:///{tmp_path / 'elsewhere.sqlite3'}"
    with override_settings(DURAFLOW_DATABASE_URL=url):
        assert conf.store_config().django_alias is None
        migrate("default")
    assert our_tables(store.database_url, store.table_prefix) == set()
    assert not (tmp_path / "elsewhere.sqlite3").exists()
    assert recorded_by_django("default") == set(_app_migrations())


def test_every_schema_version_has_a_django_migration() -> None:
    """The library's LATEST_VERSION has its Django migration, and each names its version."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    versions: dict[int, str] = {}
    for (app, name), migration in loader.disk_migrations.items():
        if app != APP_LABEL:
            continue
        applied = [v for v in map(schema_version_of, migration.operations) if v is not None]
        match = SCHEMA_MIGRATION.match(name)
        if match is None:
            assert applied == [], f"{name} applies schema versions without saying so"
            continue
        assert applied == [int(match.group(1))], f"{name} must apply version {match.group(1)}"
        assert migration.atomic is False, f"{name}: the library's migrations take their own lock"
        versions[int(match.group(1))] = name
    assert LATEST_VERSION in versions, (
        f"celery_duraflow._schema.LATEST_VERSION is {LATEST_VERSION}, and no Django migration "
        f"applies it: add celery_duraflow/contrib/django/migrations/NNNN_schema_v"
        f"{LATEST_VERSION}.py with schema_operation({LATEST_VERSION}), depending on the "
        "app's latest migration.")
    assert max(versions) == LATEST_VERSION
    # Each schema migration comes after the previous one in Django's graph.
    ordered = [versions[v] for v in sorted(versions)]
    graph = loader.graph
    for earlier, later in itertools.pairwise(ordered):
        assert (APP_LABEL, earlier) in graph.forwards_plan((APP_LABEL, later))


@pytest.mark.parametrize("store", ALIASES, indirect=True)
def test_unmigrated_alias_says_manage_py_migrate(store: Any) -> None:
    """Before `manage.py migrate`, a durable task refuses to run and names that command."""
    app = Celery(f"unmigrated-{store.django_alias}", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    ran: list[int] = []

    @app.task(base=DurableTask, name="migrate.unmigrated", shared=False)
    def add(x: int, y: int) -> int:
        with step("add") as s:
            ran.append(1)
            s.result = x + y
        result: int = s.result
        return result

    result = add.apply(args=(2, 3))
    assert ran == []
    assert type(result.result).__name__ == "StoreMisconfigured"
    assert f"python manage.py migrate --database {store.django_alias}" in str(result.result)


@pytest.mark.parametrize("store", ["default"], indirect=True)
@pytest.mark.parametrize("setting", ["DURAFLOW_CELERY_APP", "CELERY_DURAFLOW_CELERY_APP"])
def test_migrate_accepts_the_admins_celery_app_setting(store: Any, setting: str) -> None:
    """The documented DURAFLOW_CELERY_APP setting (either spelling) does not stop migrate."""
    alias, url, prefix = store.django_alias, store.database_url, store.table_prefix
    with override_settings(**{setting: "tests.djangoproj.celery_app.app"}):
        migrate(alias)
        # The project's Celery app reads the CELERY_ spelling too, and accepts it.
        assert run_a_task(alias) == "succeeded"
    assert [row[0] for row in schema_rows(url, prefix)] == list(range(1, LATEST_VERSION + 1))
