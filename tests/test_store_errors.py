"""Store errors are classified: permanent ones fail at once, outages are waited out, boundedly.

No test here stops a server: a permanent error comes from a URL the server refuses
(a database or a role that does not exist), an outage from a port nothing listens on.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from celery_duraflow import (
    DurableTask,
    StoreMisconfigured,
    StoreUnavailable,
    step,
)
from celery_duraflow._schema import LATEST_VERSION
from celery_duraflow._store import close_all_stores
from tests.conftest import app_factory, run_worker

# The store's own tests: on PostgreSQL also through PgBouncer (transaction pooling).
pytestmark = pytest.mark.pooled

# Nothing listens on port 1 of the loopback interface: every connection is refused.
REFUSED_URL = "postgresql+psycopg://postgres@127.0.0.1:1/test"


@pytest.fixture
def counted() -> Iterator[Counter[str]]:
    """Counts of the step bodies the tasks below ran."""
    yield Counter()
    close_all_stores()


def _task(app: Celery, calls: Counter[str]) -> Any:
    @app.task(base=DurableTask, autoretry_for=(Exception,), max_retries=5)
    def charge() -> str:
        with step("charge"):
            calls["charge"] += 1
        return "charged"

    return charge


def _outcome(result: Any, timeout: float = 30.0) -> BaseException:
    try:
        value = result.get(timeout=timeout, propagate=True)
    except Exception as exc:
        return exc
    raise AssertionError(f"the task succeeded with {value!r}")


def _pg_with(pg_url: str, **parts: str) -> str:
    return make_url(pg_url).set(**parts).render_as_string(hide_password=False)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize("problem", ["database", "role"])
def test_permanent_error_fails_at_once_with_the_url_and_no_password(
        pg_url: str, redis_url: str, table_prefix: str, counted: Counter[str],
        caplog: pytest.LogCaptureFixture, problem: str) -> None:
    """A database or login that does not exist fails the task once, without re-sends."""
    missing = f"missing_{uuid.uuid4().hex[:8]}"
    url = (_pg_with(pg_url, database=missing, password="s3cret-pw") if problem == "database"
           else _pg_with(pg_url, username=missing, password="s3cret-pw"))
    app = app_factory(url, table_prefix)(eager=False, broker=redis_url)
    app.conf.task_default_queue = f"q-{uuid.uuid4().hex[:8]}"
    charge = _task(app, counted)
    caplog.set_level(logging.WARNING, logger="celery_duraflow")
    with run_worker(app):
        started = time.monotonic()
        error = _outcome(charge.delay())
        waited = time.monotonic() - started
    assert isinstance(error, StoreMisconfigured), error
    assert missing in str(error) and "s3cret-pw" not in str(error) and "***" in str(error)
    assert "Waiting will not change that" in str(error)
    assert counted["charge"] == 0
    assert not [r for r in caplog.records if "re-send" in r.getMessage()]
    assert waited < 10


@pytest.mark.redis
def test_outage_is_waited_out_with_backoff_then_fails(
        redis_url: str, table_prefix: str, counted: Counter[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """A refused connection is re-sent with growing waits, then fails after the timeout."""
    app = app_factory(REFUSED_URL, table_prefix)(eager=False, broker=redis_url,
                                                 duraflow_store_outage_timeout=4)
    app.conf.task_default_queue = f"q-{uuid.uuid4().hex[:8]}"
    charge = _task(app, counted)
    caplog.set_level(logging.WARNING, logger="celery_duraflow")
    with run_worker(app):
        started = time.monotonic()
        error = _outcome(charge.delay(), timeout=30)
        waited = time.monotonic() - started
    assert isinstance(error, StoreUnavailable) and not isinstance(error, StoreMisconfigured)
    assert "duraflow_store_outage_timeout" in str(error)
    resends = [r.getMessage() for r in caplog.records if "re-send" in r.getMessage()]
    # 1 s, 2 s, then what is left of the 4 s (each with jitter): a handful, never a flood.
    assert 2 <= len(resends) <= 6, resends
    assert "re-send 1 in" in resends[0] and "left of duraflow_store_outage_timeout" in resends[0]
    assert 3.5 <= waited < 15
    assert counted["charge"] == 0


def test_sqlite_file_in_a_missing_folder_is_permanent(
        tmp_path: Path, table_prefix: str, counted: Counter[str]) -> None:
    """A SQLite store in a folder that does not exist is a configuration error."""
    url = f"sqlite:///{tmp_path / 'no-such-folder' / 'runs.sqlite3'}"
    app = app_factory(url, table_prefix)()
    result = _task(app, counted).apply()
    assert isinstance(result.result, StoreMisconfigured), result.result
    assert "no-such-folder" in str(result.result) and "does not exist" in str(result.result)
    assert counted["charge"] == 0


def test_schema_newer_than_the_code_is_refused(
        make_app: Callable[..., Celery], database_url: str, table_prefix: str,
        counted: Counter[str]) -> None:
    """A store migrated by a newer release is refused rather than written to."""
    app = make_app()
    charge = _task(app, counted)
    assert charge.apply().get() == "charged"
    close_all_stores()
    engine = create_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(
                f'INSERT INTO "{table_prefix}schema" (version, description, applied_at) '
                "VALUES (:v, 'from the future', CURRENT_TIMESTAMP)"), {"v": LATEST_VERSION + 1})
    finally:
        engine.dispose()
    again = _task(make_app(), counted).apply()
    assert isinstance(again.result, StoreMisconfigured), again.result
    assert f"version {LATEST_VERSION + 1}" in str(again.result)
    assert counted["charge"] == 1


@pytest.mark.postgres
def test_a_signal_that_cannot_be_stored_names_the_run_and_the_signal(pg_url: str) -> None:
    """Storing a signal while the server is unreachable raises StoreUnavailable naming the
    task id and the signal, as every step's record names its step."""
    from celery_duraflow._config import config_for_app
    from celery_duraflow._store import store_for

    app = app_factory(_pg_with(pg_url, port="1"), f"t{uuid.uuid4().hex[:8]}_")()
    store = store_for(config_for_app(app))
    try:
        with pytest.raises(StoreUnavailable) as caught:
            store.put_signal("order-7", "approval", "true", "json", grace=5.0)
    finally:
        close_all_stores()
    assert caught.value.task_id == "order-7" and caught.value.step_key == "approval"
    assert "order-7" in str(caught.value) and "approval" in str(caught.value)
