"""Configuration: where settings come from, and what bad values are told."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy import create_engine, inspect

from celery_duraflow import ConfigurationError, DurableTask, step
from celery_duraflow._config import Config, config_for_app, load_config
from celery_duraflow._schema import LATEST_VERSION


def test_defaults() -> None:
    """With nothing configured, the embedded SQLite default and json are used."""
    config = load_config({}, environ={})
    assert config.database_url.render_as_string() == "sqlite:///duraflow.sqlite3"
    assert config.table_prefix == "duraflow_"
    assert config.serializer == "json"
    assert config.auto_migrate is True
    assert 10 <= config.lease_seconds < 100
    assert config.eta_threshold == 60


def test_app_conf_wins_over_environment() -> None:
    """app.conf is read first, then DURAFLOW_DATABASE_URL."""
    env = {"DURAFLOW_DATABASE_URL": "sqlite:///from-env.sqlite3"}
    assert load_config({}, environ=env).database_url.database == "from-env.sqlite3"
    conf = {"duraflow_database_url": "sqlite:///from-conf.sqlite3"}
    assert load_config(conf, environ=env).database_url.database == "from-conf.sqlite3"


def test_celery_namespace_settings() -> None:
    """CELERY_DURAFLOW_* keys work with config_from_object(namespace='CELERY')."""

    class Settings:
        CELERY_DURAFLOW_DATABASE_URL = "sqlite:///ns.sqlite3"
        CELERY_DURAFLOW_TABLE_PREFIX = "myapp_"

    app = Celery("ns", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    config = config_for_app(app)
    assert config.database_url.database == "ns.sqlite3"
    assert config.table_prefix == "myapp_"
    assert config_for_app(app) is config  # parsed once


@pytest.mark.parametrize("url", ["postgresql://u@h/db", "postgres://u@h/db"])
def test_postgres_urls_mean_psycopg3(url: str) -> None:
    """Bare postgresql:// URLs use psycopg 3, the driver we depend on."""
    config = load_config({"duraflow_database_url": url}, environ={})
    assert config.database_url.drivername == "postgresql+psycopg"


def test_explicit_driver_is_kept() -> None:
    """A driver the user named is not replaced behind their back."""
    config = load_config({"duraflow_database_url": "postgresql+psycopg2://u@h/db"}, environ={})
    assert config.database_url.drivername == "postgresql+psycopg2"


@pytest.mark.parametrize("prefix", ["duraflow; DROP TABLE users; --", "a b", "1abc", "",
                                    "x" * 41, "naïve", 5])
def test_bad_table_prefix(prefix: object) -> None:
    """A prefix that is not a plain identifier is refused before any SQL runs."""
    with pytest.raises(ConfigurationError, match="duraflow_table_prefix") as info:
        load_config({"duraflow_table_prefix": prefix}, environ={})
    assert "letters, digits and underscores" in str(info.value)


@pytest.mark.parametrize("url", ["not a url", "://nothing", "mysql://u@h/db", "", 42])
def test_bad_database_url(url: object) -> None:
    """Malformed or unsupported URLs say which key is wrong and what would work."""
    with pytest.raises(ConfigurationError, match="duraflow_database_url") as info:
        load_config({"duraflow_database_url": url}, environ={})
    assert "postgresql+psycopg://" in str(info.value)


@pytest.mark.parametrize(("key", "value"), [("duraflow_lease_seconds", "soon"),
                                            ("duraflow_lease_seconds", 0),
                                            ("duraflow_auto_migrate", "maybe"),
                                            ("duraflow_engine_options", "pool_size=5"),
                                            ("duraflow_serializer", 3)])
def test_bad_values_name_their_key(key: str, value: object) -> None:
    """Every refused value names its setting."""
    with pytest.raises(ConfigurationError, match=key):
        load_config({key: value}, environ={})


def test_bad_config_fails_the_task_and_writes_nothing(tmp_path: Path) -> None:
    """A task on a misconfigured app fails with the config error and creates no tables."""
    db = tmp_path / "never.sqlite3"
    app = Celery("bad", set_as_current=False)
    app.conf.update(task_always_eager=True, duraflow_database_url=f"sqlite:///{db}",
                    duraflow_table_prefix="x; DROP TABLE y")

    @app.task(base=DurableTask, shared=False)
    def task() -> None:
        with step("s"):
            pass

    result = task.apply()
    assert isinstance(result.result, ConfigurationError)
    assert not db.exists()


def test_unknown_driver_is_a_configuration_error(tmp_path: Path) -> None:
    """A URL naming a driver that is not installed fails at first use, clearly."""
    from celery_duraflow._store import Store

    config = load_config({"duraflow_database_url": "postgresql+nosuchdriver://u@h/db"},
                         environ={})
    with pytest.raises(ConfigurationError, match="cannot create a database engine"):
        Store(config).engine  # noqa: B018


def test_auto_migrate_off_requires_schema(tmp_path: Path) -> None:
    """With auto-migrate off and no schema, the error says to migrate; nothing is created."""
    from celery_duraflow._store import Store

    url = f"sqlite:///{tmp_path / 'db.sqlite3'}"
    config = load_config({"duraflow_database_url": url, "duraflow_auto_migrate": False},
                         environ={})
    store = Store(config)
    with pytest.raises(ConfigurationError, match="auto_migrate is off"):
        store.ensure_schema()
    engine = create_engine(url)
    assert inspect(engine).get_table_names() == []
    engine.dispose()
    assert store.migrate() == list(range(1, LATEST_VERSION + 1))
    store.ensure_schema()
    store.close()


def test_config_is_frozen() -> None:
    """Config objects cannot be changed after they are read."""
    config = load_config({}, environ={})
    assert isinstance(config, Config)
    with pytest.raises(AttributeError):
        config.table_prefix = "other_"  # type: ignore[misc]


def test_misspelled_setting_is_refused_before_any_store_is_created(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """duraflow_databse_url is refused with the key it resembles; no SQLite file appears."""
    monkeypatch.chdir(tmp_path)
    app = Celery("typo", set_as_current=False)
    app.conf.update(task_always_eager=True, duraflow_databse_url="sqlite:///elsewhere.sqlite3")

    @app.task(base=DurableTask, shared=False)
    def task() -> str:
        with step("one"):
            pass
        return "done"

    result = task.apply()
    assert isinstance(result.result, ConfigurationError)
    assert "duraflow_databse_url" in str(result.result)
    assert "Did you mean duraflow_database_url?" in str(result.result)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("conf", "env", "named", "suggested"), [
    ({"CELERY_DURAFLOW_LEASE_SECOND": 5}, {}, "CELERY_DURAFLOW_LEASE_SECOND",
     "CELERY_DURAFLOW_LEASE_SECONDS"),
    ({}, {"DURAFLOW_DATABASEURL": "sqlite://"}, "DURAFLOW_DATABASEURL", "DURAFLOW_DATABASE_URL"),
    ({}, {"DURAFLOW_ENGINE_OPTIONS": "{}"}, "DURAFLOW_ENGINE_OPTIONS", "app.conf"),
])
def test_unknown_keys_in_every_place_are_refused(
        conf: dict[str, object], env: dict[str, str], named: str, suggested: str) -> None:
    """Unknown CELERY_DURAFLOW_* keys and DURAFLOW_* variables name the closest setting."""
    with pytest.raises(ConfigurationError) as info:
        load_config(conf, environ=env)
    assert named in str(info.value) and suggested in str(info.value)


def test_environment_sets_any_setting_and_test_variables_are_left_alone() -> None:
    """DURAFLOW_<KEY> sets a setting; DURAFLOW_TEST_/BENCH_/REQUIRE_ belong to test suites."""
    env = {"DURAFLOW_TABLE_PREFIX": "envprefix_", "DURAFLOW_STORE_OUTAGE_TIMEOUT": "12",
           "DURAFLOW_ACCEPT_SERIALIZERS": "json, pickle", "DURAFLOW_WEB_TOKEN": "x" * 20,
           "DURAFLOW_TEST_DATABASE_URL": "postgresql://h/db", "DURAFLOW_REQUIRE_SERVICES": "1",
           "DURAFLOW_BENCH_BROKER_URL": "redis://h"}
    config = load_config({}, environ=env)
    assert config.table_prefix == "envprefix_"
    assert config.store_outage_timeout == 12
    assert config.accept_serializers == ("json", "pickle")
    assert load_config({"duraflow_table_prefix": "conf_"}, environ=env).table_prefix == "conf_"


def test_worker_says_which_store_it_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    """A starting worker logs its store (SQLite: absolute path) and warns on a shared broker."""
    from celery_duraflow._signals import _announce_store

    monkeypatch.chdir(tmp_path)

    class Worker:
        def __init__(self, app: Celery) -> None:
            self.app = app

    caplog.set_level("INFO", logger="celery_duraflow")
    local = Celery("local", broker="memory://", set_as_current=False)
    _announce_store(sender=Worker(local))
    shared = Celery("shared", broker="redis://127.0.0.1:6379/0", set_as_current=False)
    _announce_store(sender=Worker(shared))
    secret = Celery("pg", broker="redis://127.0.0.1:6379/0", set_as_current=False)
    secret.conf.duraflow_database_url = "postgresql://u:hunter2-pw@db.example:5432/runs"
    _announce_store(sender=Worker(secret))
    messages = [r.getMessage() for r in caplog.records]
    path = str(tmp_path / "duraflow.sqlite3")
    assert sum(path in m and "runs are stored in" in m for m in messages) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "durable on this host only" in warnings[0]
    assert any("db.example:5432/runs" in m and "***" in m for m in messages)
    assert not any("hunter2-pw" in m for m in messages)


@pytest.mark.parametrize("conf", [{"duraflow_celery_app": "proj.celery.app"},
                                  {"CELERY_DURAFLOW_CELERY_APP": "proj.celery.app"}])
def test_the_django_apps_own_setting_is_refused_outside_a_django_project(
        conf: dict[str, object]) -> None:
    """DURAFLOW_CELERY_APP in a plain Celery app's conf is refused, naming settings.py."""
    with pytest.raises(ConfigurationError, match=r"setting of the Django app .*settings\.py"):
        load_config(conf, environ={})
    assert load_config(conf, environ={}, django_project=True).django_alias == "default"


def test_the_django_apps_own_setting_is_refused_in_the_environment() -> None:
    """A DURAFLOW_CELERY_APP environment variable is refused: only Django's settings hold it."""
    with pytest.raises(ConfigurationError, match="read from Django's settings only"):
        load_config({}, environ={"DURAFLOW_CELERY_APP": "proj.celery.app"})


def test_the_demos_model_variable_is_not_a_setting_typo() -> None:
    """DURAFLOW_DEMO_MODEL, which the agent demo documents, does not stop a worker's config."""
    config = load_config({}, environ={"DURAFLOW_DEMO_MODEL": "openai:gpt-4o-mini"})
    assert config.table_prefix == "duraflow_"
