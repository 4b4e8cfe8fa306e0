"""What the store cannot hold is refused before any step body runs, the same on every database.

Issue 12, findings 3 and 4: keys, task ids and signal names over their
columns, and durations that are NaN, infinite or too long, used to be found by
PostgreSQL only after the body ran (and not at all by SQLite). Every test that
takes ``make_app`` runs on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import func, select

from celery_duraflow import (
    DurableTask,
    InvalidDuration,
    InvalidStepName,
    InvalidTaskId,
    child,
    get_run,
    send_signal,
    sleep,
    step,
    wait_for_signal,
)
from celery_duraflow._config import config_for_app
from celery_duraflow._lease import new_owner
from celery_duraflow._limits import (
    MAX_WAIT_SECONDS,
    STEP_KEY_LENGTH,
    TASK_ID_LENGTH,
    check_key,
    check_signal_name,
    check_task_id,
    seconds,
)
from celery_duraflow._schema import STEP_KEY_LENGTH as SCHEMA_STEP_KEY_LENGTH
from celery_duraflow._schema import TASK_ID_LENGTH as SCHEMA_TASK_ID_LENGTH
from celery_duraflow._store import STEP_COMPLETED, Delivery, Store, store_for
from celery_duraflow._waits import SEND_SIGNAL_TASK_NAME, child_task_id
from tests.conftest import app_factory, drop_tables

# Six levels of 200-character names: 6 * 200 + 5 slashes = 1205 characters.
LEVELS = [f"level{n}-" + "x" * 193 for n in range(1, 7)]


def _store(app: Celery) -> Store:
    store = store_for(config_for_app(app))
    store.ensure_schema()
    return store


def _rows(app: Celery) -> dict[str, int]:
    """How many rows each table holds: what anything recorded, whatever its ids."""
    store = _store(app)
    tables = store.tables
    with store.engine.connect() as conn:
        return {table.name.rpartition("_")[2]: int(conn.execute(
            select(func.count()).select_from(table)).scalar_one())
            for table in (tables.runs, tables.steps, tables.signals)}


def _message(result: Any) -> str:
    assert result.failed(), result.state
    return str(result.result)


# -- the limits are the columns' ----------------------------------------------------------


def test_limits_are_the_columns_lengths() -> None:
    """The Python checks use exactly the lengths the tables declare."""
    assert (TASK_ID_LENGTH, STEP_KEY_LENGTH) == (SCHEMA_TASK_ID_LENGTH, SCHEMA_STEP_KEY_LENGTH)
    assert MAX_WAIT_SECONDS == 100 * 365 * 24 * 3600


def test_limit_itself_is_allowed() -> None:
    """A task id and a key of exactly the column's length are accepted, one more is not."""
    check_task_id("t" * TASK_ID_LENGTH)
    check_key("t", "k" * STEP_KEY_LENGTH)
    check_signal_name("t", "s" * STEP_KEY_LENGTH)
    with pytest.raises(InvalidTaskId):
        check_task_id("t" * (TASK_ID_LENGTH + 1))
    with pytest.raises(InvalidStepName):
        check_key("t", "k" * (STEP_KEY_LENGTH + 1))
    with pytest.raises(InvalidStepName):
        check_signal_name("t", "s" * (STEP_KEY_LENGTH + 1))


@pytest.mark.parametrize("task_id", [None, 42, b"bytes-id", "nul\x00inside"])
def test_task_id_of_another_kind_is_refused(task_id: object) -> None:
    """A task id that is not a string, or holds NUL, is InvalidTaskId (a ValueError)."""
    with pytest.raises(InvalidTaskId) as caught:
        check_task_id(task_id)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("name", [None, 7, "", "nul\x00inside"])
def test_signal_name_of_another_kind_is_refused(name: object) -> None:
    """A signal name that is not a string, is empty or holds NUL is InvalidStepName."""
    with pytest.raises(InvalidStepName, match="task-1"):
        check_signal_name("task-1", name)


def test_message_of_a_huge_key_stays_short() -> None:
    """A 10 KB key is shown by its start and its length, never whole."""
    key = "k" * 10_000
    with pytest.raises(InvalidStepName) as caught:
        check_key("task-1", key)
    message = str(caught.value)
    assert len(message) < 1000
    assert "k" * 80 in message and "10000 characters" in message and "task-1" in message
    assert caught.value.step_key == key and caught.value.task_id == "task-1"


@pytest.mark.parametrize("value", [0, 0.0, 1, 2.5, timedelta(hours=1), MAX_WAIT_SECONDS,
                                   timedelta(seconds=MAX_WAIT_SECONDS)])
def test_usable_durations_pass(value: Any) -> None:
    """Finite durations from 0 to 100 years, numbers or timedeltas, come back in seconds."""
    expected = value.total_seconds() if isinstance(value, timedelta) else float(value)
    assert seconds(value, task_id="t", key="k", what="the sleep") == expected


# -- nested keys --------------------------------------------------------------------------


def test_nested_key_over_the_column_fails_the_run_before_the_leaf_body(
        make_app: Callable[..., Celery]) -> None:
    """Six nested 200-character names: the leaf never runs and autoretry does not retry."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, bind=True, autoretry_for=(Exception,), max_retries=3,
              retry_backoff=False, default_retry_delay=0)
    def deep(self: DurableTask) -> str:
        calls["attempts"] += 1
        with step(LEVELS[0]):  # noqa: SIM117 - one block per level, as users nest steps
            with step(LEVELS[1]):
                with step(LEVELS[2]):
                    with step(LEVELS[3]):
                        with step(LEVELS[4]):
                            with step(LEVELS[5]):
                                calls["leaf"] += 1
        return "done"

    task_id = f"deep-{uuid.uuid4()}"
    result = deep.apply(task_id=task_id)
    assert isinstance(result.result, InvalidStepName)
    message = _message(result)
    leaf_key = "/".join(LEVELS)
    assert len(leaf_key) > STEP_KEY_LENGTH
    assert task_id in message and leaf_key[:80] in message
    assert f"{len(leaf_key)} characters" in message and leaf_key not in message
    assert result.result.step_key == leaf_key
    assert calls == {"attempts": 1}  # no retry, and the leaf body never ran
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "failed" and run.attempts == 1
    # Only the parents, which did start, are recorded (as failed): no row for the leaf.
    assert [(s.key, s.status) for s in run.steps] == [
        ("/".join(LEVELS[:n]), "failed") for n in range(1, 6)]


def test_repeat_suffix_that_crosses_the_limit_is_refused(
        make_app: Callable[..., Celery]) -> None:
    """A key that only the '#2' of a repeated name pushes over the limit is refused too."""
    app = make_app()
    calls: Counter[str] = Counter()
    parents = LEVELS[:5]  # 1004 characters
    leaf = "y" * (STEP_KEY_LENGTH - len("/".join(parents)) - 1)  # exactly at the limit

    @app.task(base=DurableTask, autoretry_for=(Exception,), max_retries=3,
              retry_backoff=False, default_retry_delay=0)
    def repeated() -> None:
        calls["attempts"] += 1
        with step(parents[0]):  # noqa: SIM117 - one block per level, as users nest steps
            with step(parents[1]):
                with step(parents[2]):
                    with step(parents[3]):
                        with step(parents[4]):
                            for _ in range(2):
                                with step(leaf):
                                    calls["leaf"] += 1

    task_id = f"repeat-{uuid.uuid4()}"
    result = repeated.apply(task_id=task_id)
    assert isinstance(result.result, InvalidStepName)
    assert task_id in _message(result)
    assert calls == {"attempts": 1, "leaf": 1}
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "failed"
    first = "/".join([*parents, leaf])
    assert len(first) == STEP_KEY_LENGTH
    assert run.step(first).status == "completed"
    assert f"{first}#2" not in [s.key for s in run.steps]


def test_wait_with_a_key_over_the_column_records_nothing(
        make_app: Callable[..., Celery]) -> None:
    """A wait nested too deep is refused like a step: no wait row, no sleeping run."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, autoretry_for=(Exception,), max_retries=3,
              retry_backoff=False, default_retry_delay=0)
    def nap() -> None:
        calls["attempts"] += 1
        with step(LEVELS[0]):  # noqa: SIM117 - one block per level, as users nest steps
            with step(LEVELS[1]):
                with step(LEVELS[2]):
                    with step(LEVELS[3]):
                        with step(LEVELS[4]):
                            sleep(LEVELS[5], 3600)
                            calls["after"] += 1

    task_id = f"nap-{uuid.uuid4()}"
    result = nap.apply(task_id=task_id)
    assert isinstance(result.result, InvalidStepName)
    assert task_id in _message(result)
    assert calls == {"attempts": 1}
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "failed" and run.wake_at is None
    assert all(s.status == "failed" for s in run.steps) and len(run.steps) == 5


# -- task ids -----------------------------------------------------------------------------


@pytest.mark.parametrize("task_id", ["t" * 300, "nul\x00in-the-id"])
def test_task_id_the_store_cannot_hold_is_refused_before_anything(
        make_app: Callable[..., Celery], task_id: str) -> None:
    """A 300-character (or NUL-holding) task id: no body runs, no retry, nothing recorded."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, autoretry_for=(Exception,), max_retries=3,
              retry_backoff=False, default_retry_delay=0)
    def booked() -> str:
        calls["body"] += 1
        with step("book") as s:
            calls["book"] += 1
            s.result = "booked"
        return str(s.result)

    result = booked.apply(task_id=task_id)
    assert isinstance(result.result, InvalidTaskId)
    message = _message(result)
    assert repr(task_id[:80]) in message
    assert (f"{TASK_ID_LENGTH} characters" if len(task_id) > TASK_ID_LENGTH else "NUL") in message
    assert task_id not in message
    assert calls == {}
    assert _rows(app) == {"runs": 0, "steps": 0, "signals": 0}


# -- signals ------------------------------------------------------------------------------


def _waiting_run(app: Celery) -> str:
    """A run waiting for the signal 'approval'."""

    @app.task(base=DurableTask)
    def approve() -> Any:
        return wait_for_signal("approval")

    task_id = f"approve-{uuid.uuid4()}"
    approve.apply(task_id=task_id)
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "waiting"
    return task_id


def test_signal_with_a_10kb_name_is_refused_before_the_store(
        make_app: Callable[..., Celery]) -> None:
    """send_signal with a 10 KB name: InvalidStepName naming the run, no signal stored."""
    app = make_app()
    task_id = _waiting_run(app)
    name = "n" * 10_000
    with pytest.raises(InvalidStepName) as caught:
        send_signal(task_id, name, {"ok": True}, app=app)
    message = str(caught.value)
    assert task_id in message and "n" * 80 in message and "10000 characters" in message
    assert len(message) < 1000
    # The Celery task that sends signals goes through the same checks.
    sent = app.tasks[SEND_SIGNAL_TASK_NAME].apply(args=(task_id, name, {"ok": True}))
    assert isinstance(sent.result, InvalidStepName)
    assert _rows(app)["signals"] == 0
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "waiting"


def test_signal_with_a_non_string_name_is_refused(make_app: Callable[..., Celery]) -> None:
    """send_signal with a name that is not a string: InvalidStepName, nothing stored."""
    app = make_app()
    task_id = _waiting_run(app)
    with pytest.raises(InvalidStepName, match=task_id):
        send_signal(task_id, 42, app=app)  # type: ignore[arg-type]
    assert _rows(app)["signals"] == 0


def test_signal_to_a_300_character_task_id_is_refused(
        make_app: Callable[..., Celery]) -> None:
    """send_signal to a task id over the column: InvalidTaskId, not RunNotFound."""
    app = make_app()
    task_id = "t" * 300
    with pytest.raises(InvalidTaskId) as caught:
        send_signal(task_id, "approval", app=app)
    assert "t" * 80 in str(caught.value) and task_id not in str(caught.value)
    sent = app.tasks[SEND_SIGNAL_TASK_NAME].apply(args=(task_id, "approval"))
    assert isinstance(sent.result, InvalidTaskId)
    assert _rows(app)["signals"] == 0


# -- durations ----------------------------------------------------------------------------

BAD_SLEEPS = [
    pytest.param(float("nan"), "NaN", id="nan"),
    pytest.param(math.inf, "infinite", id="inf"),
    pytest.param(-math.inf, "infinite", id="minus-inf"),
    pytest.param(1e12, "longer than", id="1e12"),
    pytest.param(timedelta(days=365 * 200), "longer than", id="timedelta-200-years"),
    pytest.param(timedelta.max, "longer than", id="timedelta-max"),
    pytest.param(-1, "negative", id="negative"),
    pytest.param(timedelta(seconds=-5), "negative", id="negative-timedelta"),
    pytest.param(10**400, "not a usable number", id="int-too-big-for-a-float"),
    pytest.param("60", "not a number", id="string"),
]


@pytest.mark.parametrize(("length", "problem"), BAD_SLEEPS)
def test_sleep_of_an_unusable_length_is_refused_before_it_is_recorded(
        make_app: Callable[..., Celery], length: Any, problem: str) -> None:
    """sleep() with NaN, inf, 1e12 s, a huge timedelta or a negative length: InvalidDuration."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask)
    def nap() -> None:
        with step("before"):
            calls["before"] += 1
        sleep("nap", length)
        with step("after"):
            calls["after"] += 1

    task_id = f"nap-{uuid.uuid4()}"
    result = nap.apply(task_id=task_id)
    assert isinstance(result.result, InvalidDuration)
    assert isinstance(result.result, ValueError)
    message = _message(result)
    assert task_id in message and "'nap'" in message and problem in message
    assert result.result.task_id == task_id and result.result.step_key == "nap"
    assert calls == {"before": 1}
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "failed" and run.wake_at is None
    assert [(s.key, s.status) for s in run.steps] == [("before", "completed")]


@pytest.mark.parametrize("until", [
    pytest.param(datetime(2000, 1, 1), id="naive"),
    pytest.param(datetime(2000, 1, 1, tzinfo=UTC), id="aware"),
])
def test_sleep_until_a_datetime_is_fine(make_app: Callable[..., Celery],
                                        until: datetime) -> None:
    """until= takes naive (UTC) and aware datetimes; one in the past is already over."""
    app = make_app()

    @app.task(base=DurableTask)
    def nap() -> str:
        sleep("nap", until=until)
        return "awake"

    result = nap.apply()
    assert result.get() == "awake"
    run = get_run(result.id, app=app)
    assert run is not None and run.step("nap").status == "completed"


def test_sleep_until_something_else_is_refused(make_app: Callable[..., Celery]) -> None:
    """until= that is not a datetime: InvalidDuration naming the task and the sleep."""
    app = make_app()

    @app.task(base=DurableTask)
    def nap() -> None:
        sleep("nap", until="tomorrow")  # type: ignore[arg-type]

    result = nap.apply()
    assert isinstance(result.result, InvalidDuration)
    assert result.id in _message(result) and "'nap'" in _message(result)
    run = get_run(result.id, app=app)
    assert run is not None and not run.steps


@pytest.mark.parametrize(("timeout", "problem"), [
    pytest.param(float("nan"), "NaN", id="nan"),
    pytest.param(math.inf, "infinite", id="inf"),
    pytest.param(1e12, "longer than", id="1e12"),
    pytest.param(-1.0, "negative", id="negative"),
    pytest.param(timedelta(seconds=-1), "negative", id="negative-timedelta"),
])
def test_signal_timeout_of_an_unusable_length_is_refused(
        make_app: Callable[..., Celery], timeout: Any, problem: str) -> None:
    """wait_for_signal(timeout=NaN, inf, 1e12, negative): InvalidDuration, no wait recorded."""
    app = make_app()

    @app.task(base=DurableTask, autoretry_for=(Exception,), max_retries=2,
              retry_backoff=False, default_retry_delay=0)
    def approve() -> Any:
        return wait_for_signal("approval", timeout=timeout)

    task_id = f"approve-{uuid.uuid4()}"
    result = approve.apply(task_id=task_id)
    assert isinstance(result.result, InvalidDuration)
    message = _message(result)
    assert task_id in message and "'approval'" in message and problem in message
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "failed" and not run.steps
    assert run.wait_kind is None


@pytest.mark.parametrize("timeout", [
    pytest.param(float("nan"), id="nan"),
    pytest.param(-5, id="negative"),
    pytest.param(timedelta(days=365 * 1000), id="timedelta-1000-years"),
])
def test_child_timeout_of_an_unusable_length_is_refused_before_the_child_starts(
        make_app: Callable[..., Celery], timeout: Any) -> None:
    """child(timeout=NaN or negative): InvalidDuration; the child is neither recorded nor run."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask)
    def kid() -> str:
        calls["kid"] += 1
        return "kid"

    @app.task(base=DurableTask)
    def parent() -> Any:
        return child("kid", kid.s(), timeout=timeout)

    task_id = f"parent-{uuid.uuid4()}"
    result = parent.apply(task_id=task_id)
    assert isinstance(result.result, InvalidDuration)
    assert task_id in _message(result) and "'kid'" in _message(result)
    assert calls == {}
    assert get_run(child_task_id(task_id, "kid"), app=app) is None
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "failed" and not run.steps


# -- database errors carry no parameters --------------------------------------------------

MARKER = "SECRET-MARKER-7f3a"


@pytest.fixture
def pg_app(pg_url: str, table_prefix: str) -> Iterator[Celery]:
    """An eager app on PostgreSQL only: the database that enforces the column lengths."""
    from celery_duraflow._store import close_all_stores

    yield app_factory(pg_url, table_prefix)()
    close_all_stores()
    drop_tables(pg_url, table_prefix)


@pytest.mark.postgres
def test_postgres_data_error_shows_no_parameters(pg_app: Celery,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A real DataError from the store (checks bypassed) keeps its parameters out of text."""
    store = _store(pg_app)
    owner = new_owner()
    task_id = f"raw-{uuid.uuid4()}"
    run, _ = store.begin_attempt(task_id, Delivery(task_name="raw", owner=owner,
                                                   args=f'["{MARKER}-args"]'))
    assert run.lease_owner == owner
    too_long = (MARKER + "-") * (STEP_KEY_LENGTH // len(MARKER) + 1)
    errors: list[BaseException] = []
    with caplog.at_level(logging.DEBUG):
        # Through SQLAlchemy: its errors would list the statement's parameters.
        with pytest.raises(Exception) as caught:
            store.put_signal(task_id, too_long, f'"{MARKER}-payload"', "json", grace=5.0)
        errors.append(caught.value)
        with pytest.raises(Exception) as caught:
            store.begin_attempt("t" * 300 + MARKER, Delivery(task_name="raw", owner=owner))
        errors.append(caught.value)
        # Straight on the psycopg connection (the per-step hot path).
        with pytest.raises(Exception) as caught:
            store.record_step(task_id, too_long, owner, status=STEP_COMPLETED,
                              started_at=datetime.now(UTC), output=f'"{MARKER}-output"',
                              serializer="json", new=True)
        errors.append(caught.value)
    for error in errors:
        assert "too long" in str(error), error  # it is the DataError we provoked
        texts = [str(error), repr(error), *(str(e) for e in (error.__cause__,
                                                             error.__context__) if e)]
        assert not any(MARKER in text for text in texts), texts
    assert MARKER not in caplog.text
    assert _rows(pg_app)["signals"] == 0


@pytest.mark.postgres
def test_engine_options_can_show_parameters_again(pg_url: str, table_prefix: str) -> None:
    """hide_parameters is only a default: duraflow_engine_options may turn it off."""
    from celery_duraflow._store import close_all_stores

    app = app_factory(pg_url, table_prefix)(
        duraflow_engine_options={"hide_parameters": False})
    try:
        assert store_for(config_for_app(app)).engine.hide_parameters is False
        default = app_factory(pg_url, table_prefix)()
        assert store_for(config_for_app(default)).engine.hide_parameters is True
    finally:
        close_all_stores()
        drop_tables(pg_url, table_prefix)
