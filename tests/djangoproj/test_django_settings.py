"""The store of a Django project is one of its DATABASES aliases.

``DURAFLOW_DATABASE`` (or ``CELERY_DURAFLOW_DATABASE``, Celery's ``duraflow_database``)
names the alias; the project's Celery app, which reads Django's settings as Celery's
guide shows, uses the ``default`` alias when none is named. These tests run in the
real test project (tests/djangoproj) on the test databases pytest-django created.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from django.conf import settings
from django.db import connections
from django.test import override_settings
from sqlalchemy import create_engine, text

from celery_duraflow import ConfigurationError, DurableTask, get_run, step
from celery_duraflow._config import config_for_app, load_config
from celery_duraflow._store import close_all_stores
from celery_duraflow.contrib.django import conf
from tests.djangoproj.celery_app import app as project_app
from tests.djangoproj.shop.tasks import ping

BOTH = ["default", "lite"]


@pytest.fixture(autouse=True)
def _close_stores() -> Iterator[None]:
    """Leave no store connection open: pytest-django drops the test databases at the end."""
    yield
    close_all_stores()


@pytest.fixture
def add_alias() -> Iterator[Any]:
    """Add aliases to DATABASES for one test; they are removed afterwards."""
    added: list[str] = []

    def add(spec: dict[str, Any]) -> str:
        alias = f"extra_{uuid.uuid4().hex[:8]}"
        settings.DATABASES[alias] = {"OPTIONS": {}, "USER": "", "PASSWORD": "", "HOST": "",
                                     "PORT": "", **spec}
        added.append(alias)
        return alias

    yield add
    for alias in added:
        settings.DATABASES.pop(alias, None)
        with contextlib.suppress(AttributeError):
            del connections[alias]


def django_app(name: str) -> Celery:
    """A Celery app laid out as Celery's Django guide shows: configured from Django's
    settings, with the CELERY namespace."""
    app = Celery(name, set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    return app


def test_a_django_project_app_stores_in_the_default_alias() -> None:
    """With the app installed and no database named, the project's Celery app uses 'default'."""
    config = config_for_app(django_app("plain"))
    default = settings.DATABASES["default"]
    assert config.django_alias == "default"
    assert config.database_url.drivername == "postgresql+psycopg"
    assert config.database_url.database == default["NAME"]
    assert config.database_url.host == default["HOST"]
    assert config.database_url.port == int(default["PORT"])
    assert config.database_url.username == default["USER"]
    # manage.py migrate owns the schema of a Django alias
    assert config.auto_migrate is False
    assert conf.store_alias() == "default"
    assert conf.store_config().django_alias == "default"


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_runs_are_stored_in_the_test_database_django_uses() -> None:
    """A run of the project's app lands in the very database Django's connection reads."""
    task_id = f"settings-{uuid.uuid4().hex}"
    assert ping.apply(args=("hello",), task_id=task_id).get() == "hello"
    config = config_for_app(project_app)
    assert config.database_url.database == connections["default"].settings_dict["NAME"]
    assert config.database_url.database.startswith("test_")
    with connections["default"].cursor() as cursor:
        cursor.execute(f"SELECT status FROM {config.table_prefix}runs WHERE task_id = %s",
                       [task_id])
        assert cursor.fetchall() == [("succeeded",)]
        cursor.execute(f"SELECT step_key, status FROM {config.table_prefix}steps "
                       "WHERE task_id = %s", [task_id])
        assert cursor.fetchall() == [("pong", "completed")]


@pytest.mark.parametrize("setting", ["DURAFLOW_DATABASE", "CELERY_DURAFLOW_DATABASE"])
def test_a_setting_names_the_alias(setting: str) -> None:
    """DURAFLOW_DATABASE or CELERY_DURAFLOW_DATABASE moves the store to the named alias."""
    with override_settings(**{setting: "lite"}):
        config = config_for_app(django_app(setting))
        assert conf.store_alias() == "lite"
        assert conf.store_config().django_alias == "lite"
    assert config.django_alias == "lite"
    assert config.database_url.drivername == "sqlite"
    assert config.database_url.database == str(settings.DATABASES["lite"]["NAME"])
    assert config.auto_migrate is False


def test_duraflow_database_in_app_conf_names_the_alias() -> None:
    """app.conf.duraflow_database is the same setting, for apps configured in code."""
    app = Celery("in-code", set_as_current=False)
    app.conf.duraflow_database = "lite"
    config = config_for_app(app)
    assert (config.django_alias, config.database_url.drivername) == ("lite", "sqlite")


def test_an_explicit_url_wins_over_the_alias(tmp_path: Any) -> None:
    """duraflow_database_url still decides the store where an alias is named too."""
    url = f"sqlite:///{tmp_path / 'explicit.sqlite3'}"
    config = load_config({"duraflow_database_url": url, "duraflow_database": "default"},
                         environ={})
    assert config.database_url.database == str(tmp_path / "explicit.sqlite3")
    assert config.django_alias is None
    assert config.auto_migrate is True
    with override_settings(CELERY_DURAFLOW_DATABASE_URL=url):
        assert config_for_app(django_app("explicit")).django_alias is None
        assert conf.store_config().django_alias is None
    env = {"DURAFLOW_DATABASE_URL": url}
    assert load_config({}, environ=env, django_project=True).django_alias is None
    # The app's own configuration wins over the environment, as for every setting.
    assert load_config({"duraflow_database": "lite"}, environ=env).django_alias == "lite"


def test_an_app_not_configured_from_django_keeps_the_embedded_default() -> None:
    """In a Django process, an app that does not read Django's settings is not moved."""
    config = config_for_app(Celery("elsewhere", set_as_current=False))
    assert config.django_alias is None
    assert config.database_url.render_as_string() == "sqlite:///duraflow.sqlite3"
    assert load_config({}, environ={}).django_alias is None


def test_postgres_alias_carries_its_connection_settings(add_alias: Any) -> None:
    """HOST, PORT, USER, PASSWORD, NAME and libpq OPTIONS such as sslmode reach the URL."""
    alias = add_alias({
        "ENGINE": "django.db.backends.postgresql", "NAME": "shop", "USER": "shopper",
        "PASSWORD": "p@ss:word", "HOST": "db.example.org", "PORT": "6543",
        "OPTIONS": {"sslmode": "require", "connect_timeout": 7, "isolation_level": 2,
                    "pool": True, "server_side_binding": True},
    })
    config = load_config({"duraflow_database": alias}, environ={})
    url = config.database_url
    assert (url.drivername, url.username, url.password, url.host, url.port, url.database) == (
        "postgresql+psycopg", "shopper", "p@ss:word", "db.example.org", 6543, "shop")
    # Django's own connection options are not libpq's and stay behind.
    assert dict(url.query) == {"sslmode": "require", "connect_timeout": "7"}
    assert config.django_alias == alias

    socket = add_alias({"ENGINE": "django.db.backends.postgresql", "NAME": "shop",
                        "HOST": "/var/run/postgresql"})
    url = load_config({"duraflow_database": socket}, environ={}).database_url
    assert url.host is None and dict(url.query) == {"host": "/var/run/postgresql"}


@pytest.mark.postgres
def test_alias_options_reach_the_server(add_alias: Any) -> None:
    """A store built from an alias really connects with the alias's OPTIONS."""
    default = settings.DATABASES["default"]
    alias = add_alias({**{key: default[key] for key in ("ENGINE", "NAME", "USER", "PASSWORD",
                                                        "HOST", "PORT")},
                       "OPTIONS": {"application_name": "duraflow-alias-test",
                                   "sslmode": "disable"}})
    config = load_config({"duraflow_database": alias}, environ={})
    engine = create_engine(config.database_url, **dict(config.engine_options))
    try:
        with engine.connect() as conn:
            name = conn.execute(text("SELECT current_setting('application_name')")).scalar()
            ssl = conn.execute(text("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
                               ).scalar()
    finally:
        engine.dispose()
    assert name == "duraflow-alias-test"
    assert ssl is False


def test_a_missing_alias_is_a_configuration_error() -> None:
    """An alias DATABASES does not have is refused, naming it and the aliases there are."""
    with pytest.raises(ConfigurationError, match="'nowhere'") as raised:
        load_config({"duraflow_database": "nowhere"}, environ={})
    assert "'default'" in str(raised.value) and "'lite'" in str(raised.value)
    with override_settings(DURAFLOW_DATABASE="nowhere"), pytest.raises(
            ConfigurationError, match="'nowhere'"):
        config_for_app(django_app("missing"))


@pytest.mark.parametrize("engine", ["django.db.backends.mysql", "django.db.backends.dummy",
                                    "django.db.backends.oracle"])
def test_an_alias_on_another_database_is_a_configuration_error(add_alias: Any,
                                                                engine: str) -> None:
    """An alias that is not on PostgreSQL or SQLite is refused, naming the alias."""
    alias = add_alias({"ENGINE": engine, "NAME": "shop"})
    with pytest.raises(ConfigurationError, match=f"'{alias}'.*PostgreSQL or SQLite"):
        load_config({"duraflow_database": alias}, environ={})


def test_unusable_aliases_are_refused(add_alias: Any) -> None:
    """An in-memory SQLite alias and a role-switching one are refused, naming the alias."""
    memory = add_alias({"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"})
    with pytest.raises(ConfigurationError, match=f"'{memory}'.*in-memory"):
        load_config({"duraflow_database": memory}, environ={})
    role = add_alias({"ENGINE": "django.db.backends.postgresql", "NAME": "shop",
                      "OPTIONS": {"assume_role": "shop_owner"}})
    with pytest.raises(ConfigurationError, match=f"'{role}'.*assume_role"):
        load_config({"duraflow_database": role}, environ={})
    with pytest.raises(ConfigurationError, match=r"Did you mean DURAFLOW_DATABASE\?"):
        load_config({"DURAFLOW_DATABAS": "default"}, environ={})


def test_the_alias_is_resolved_again_when_django_renames_its_database() -> None:
    """A config cached before the test database existed follows the alias's new NAME."""
    app = django_app("renamed")
    lite = settings.DATABASES["lite"]
    original = lite["NAME"]
    with override_settings(DURAFLOW_DATABASE="lite"):
        first = config_for_app(app)
        assert config_for_app(app) is first  # cached while nothing changes
        lite["NAME"] = f"{original}.renamed"
        try:
            moved = config_for_app(app)
        finally:
            lite["NAME"] = original
    assert first.database_url.database == str(original)
    assert moved.database_url.database == f"{original}.renamed"
    assert moved.django_alias == "lite"


@pytest.mark.django_db(databases=["lite"], transaction=True)
def test_a_run_on_the_sqlite_alias_is_stored_in_its_test_database() -> None:
    """With DURAFLOW_DATABASE='lite' a run's steps land in the SQLite test database."""
    with override_settings(DURAFLOW_DATABASE="lite", DURAFLOW_AUTO_MIGRATE=True,
                           DURAFLOW_TABLE_PREFIX=f"s{uuid.uuid4().hex[:8]}_"):
        app = django_app("lite-run")

        @app.task(base=DurableTask, name="settings.double", shared=False)
        def double(x: int) -> int:
            with step("double") as s:
                s.result = x * 2
            result: int = s.result
            return result

        task_id = f"lite-{uuid.uuid4().hex}"
        assert double.apply(args=(21,), task_id=task_id).get() == 42
        run = get_run(task_id, app=app)
        prefix = config_for_app(app).table_prefix
    assert run.status == "succeeded"
    assert [(s.key, s.status) for s in run.steps] == [("double", "completed")]
    assert Path(settings.DATABASES["lite"]["NAME"]).name.startswith("test_")
    with connections["lite"].cursor() as cursor:
        cursor.execute(f"SELECT status FROM {prefix}runs WHERE task_id = %s", [task_id])
        assert cursor.fetchall() == [("succeeded",)]


def test_the_core_imports_and_refuses_aliases_without_django() -> None:
    """Without Django installed the package imports, and an alias is a clear error."""
    code = (
        "import sys\n"
        "sys.modules['django'] = None\n"
        "import celery_duraflow\n"
        "from celery_duraflow._config import load_config\n"
        "assert load_config({}, environ={}).django_alias is None\n"
        "try:\n"
        "    load_config({'duraflow_database': 'default'}, environ={})\n"
        "except celery_duraflow.ConfigurationError as exc:\n"
        "    print(exc)\n"
        "assert not any(name.startswith('django.') for name in sys.modules)\n"
    )
    env = {name: value for name, value in os.environ.items()
           if name != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert "'default' names a Django database alias, but Django is not installed" in done.stdout
