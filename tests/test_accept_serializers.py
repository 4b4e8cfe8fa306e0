"""A stored row's serializer name never chooses code (issue 13, finding 3).

A row's ``serializer`` column is only compared with ``duraflow_serializer``
and ``duraflow_accept_serializers``; a row naming anything else is unreadable:
a worker refuses it with ConfigurationError, and the read-only views (get_run,
``celery duraflow show``, the web page) show a placeholder. The hostile rows
here are written with plain SQL after a real run recorded them, and name
:class:`Hostile`, whose ``loads`` leaves a mark the way a pickle payload that
ran ``os.system`` would.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from celery.bin.celery import celery as celery_command
from click.testing import CliRunner
from sqlalchemy import text
from starlette.testclient import TestClient

from celery_duraflow import (
    ConfigurationError,
    DurableTask,
    child,
    get_run,
    send_signal,
    step,
    wait_for_signal,
)
from celery_duraflow._config import config_for_app
from celery_duraflow._serialization import decode, get_serializer
from celery_duraflow._store import store_for
from celery_duraflow._waits import child_task_id
from celery_duraflow.web import create_app

#: What Hostile did: "built" when constructed, the data when asked to load it.
MARKS: list[str] = []

HOSTILE = "tests.test_accept_serializers.Hostile"
TRUSTED = "tests.test_accept_serializers.Trusted"
PLACEHOLDER = f"<unreadable: stored with serializer {HOSTILE!r}, which is not accepted>"


class Hostile:
    """A serializer nobody configured: building or loading it leaves a mark in MARKS."""

    def __init__(self) -> None:
        MARKS.append("built")

    def dumps(self, obj: Any) -> str:
        return json.dumps(obj)

    def loads(self, data: str) -> Any:
        MARKS.append(data)
        return "hostile"


class Trusted:
    """A custom serializer a deployment configures by dotted path."""

    def dumps(self, obj: Any) -> str:
        return "T" + json.dumps(obj)

    def loads(self, data: str) -> Any:
        assert data.startswith("T"), data
        return json.loads(data[1:])


class Point:
    """A user type only pickle can store."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and other.x == self.x


class Stop(Exception):
    """Ends an attempt after its steps were recorded, so that the run can be replayed."""


@pytest.fixture(autouse=True)
def marks() -> Iterator[list[str]]:
    MARKS.clear()
    yield MARKS
    MARKS.clear()


def set_serializer(app: Celery, table: str, value: str | None, /, **where: str) -> None:
    """Write ``value`` into the serializer column of the matching row, with plain SQL."""
    config = config_for_app(app)
    store = store_for(config)
    clauses = " AND ".join(f"{column} = :{column}" for column in where)
    with store.engine.begin() as conn:
        changed = conn.execute(
            text(f"UPDATE {config.table_prefix}{table} SET serializer = :value WHERE {clauses}"),
            {"value": value, **where}).rowcount
    assert changed == 1, (table, where)


def define_trip(app: Celery, calls: list[str], *, stop: bool = True) -> Any:
    """A task with one step; with ``stop``, its first attempt fails after the step."""
    attempts: list[int] = []

    @app.task(base=DurableTask, name="accept.trip")
    def trip() -> Any:
        attempts.append(1)
        with step("quote") as s:
            calls.append("quote")
            s.result = {"price": 3}
        if stop and len(attempts) == 1:
            raise Stop("after the quote")
        return {"quoted": s.result}

    return trip


def duraflow_show(app: Celery, *args: str) -> Any:
    return CliRunner().invoke(celery_command, ["-A", app, "duraflow", "show", *args],
                              env={"COLUMNS": "400"})


def web_page(app: Celery, task_id: str) -> str:
    """The run page, fetched without logging in (the read-only view)."""
    client = TestClient(create_app(app), base_url="http://localhost", follow_redirects=False)
    response = client.get(f"/runs/{task_id}")
    assert response.status_code == 200, response.text
    return response.text


# -- workers ------------------------------------------------------------------------------


def test_a_replay_refuses_a_step_row_naming_an_unaccepted_serializer(
        make_app: Callable[..., Celery], marks: list[str]) -> None:
    """A worker replaying a step row that names an unaccepted serializer raises, loads nothing."""
    app = make_app()
    calls: list[str] = []
    trip = define_trip(app, calls)
    task_id = str(uuid.uuid4())
    assert isinstance(trip.apply(task_id=task_id).result, Stop)
    set_serializer(app, "steps", HOSTILE, task_id=task_id, step_key="quote")

    again = trip.apply(task_id=task_id)
    error = again.result
    assert marks == []  # Hostile was neither built nor asked to load
    assert isinstance(error, ConfigurationError), error
    assert error.task_id == task_id and error.step_key == "quote"
    message = str(error)
    assert task_id in message and "'quote'" in message and repr(HOSTILE) in message
    assert "duraflow_accept_serializers" in message and "retry" in message
    assert calls == ["quote"]  # the completed step did not run again either


def test_a_replay_refuses_a_returned_value_naming_an_unaccepted_serializer(
        make_app: Callable[..., Celery], marks: list[str]) -> None:
    """A step that returned from its body: its returned value is not loaded with a row's choice."""
    app = make_app()
    calls: list[str] = []

    @app.task(base=DurableTask, name="accept.returning")
    def returning() -> Any:
        with step("decide"):
            calls.append("decide")
            return "returned early"

    task_id = str(uuid.uuid4())
    assert returning.apply(task_id=task_id).get() == "returned early"
    set_serializer(app, "steps", HOSTILE, task_id=task_id, step_key="decide")
    # Only the returned value is left to read, and the run replays from the top.
    store = store_for(config_for_app(app))
    with store.engine.begin() as conn:
        conn.execute(text(f"UPDATE {store.tables.steps.name} SET output = NULL "
                          "WHERE task_id = :id"), {"id": task_id})
        conn.execute(text(f"UPDATE {store.tables.runs.name} SET status = 'failed', "
                          "result = NULL, serializer = NULL WHERE task_id = :id"),
                     {"id": task_id})

    error = returning.apply(task_id=task_id).result
    assert marks == []  # Hostile was neither built nor asked to load
    assert isinstance(error, ConfigurationError), error
    assert error.step_key == "decide" and repr(HOSTILE) in str(error)
    assert calls == ["decide"]


def test_a_redelivery_of_a_succeeded_run_refuses_its_result_row(
        make_app: Callable[..., Celery], marks: list[str]) -> None:
    """A succeeded run's result row naming an unaccepted serializer is refused, not loaded."""
    app = make_app()
    calls: list[str] = []
    trip = define_trip(app, calls, stop=False)
    task_id = str(uuid.uuid4())
    assert trip.apply(task_id=task_id).get() == {"quoted": {"price": 3}}
    set_serializer(app, "runs", HOSTILE, task_id=task_id)

    error = trip.apply(task_id=task_id).result
    assert marks == []  # Hostile was neither built nor asked to load
    assert isinstance(error, ConfigurationError), error
    assert error.task_id == task_id and repr(HOSTILE) in str(error)


def test_a_signal_row_naming_an_unaccepted_serializer_is_refused(
        make_app: Callable[..., Celery], marks: list[str]) -> None:
    """A stored signal payload naming an unaccepted serializer is refused by the waiting run."""
    app = make_app()
    attempts: list[int] = []

    @app.task(base=DurableTask, name="accept.approve")
    def approve() -> Any:
        attempts.append(1)
        with step("ask"):
            pass
        if len(attempts) == 1:
            raise Stop("before the wait")
        return wait_for_signal("approval")

    task_id = str(uuid.uuid4())
    assert isinstance(approve.apply(task_id=task_id).result, Stop)
    assert send_signal(task_id, "approval", {"ok": True}, app=app)
    set_serializer(app, "signals", HOSTILE, task_id=task_id, name="approval")

    error = approve.apply(task_id=task_id).result
    assert marks == []  # Hostile was neither built nor asked to load
    assert isinstance(error, ConfigurationError), error
    assert error.task_id == task_id and repr(HOSTILE) in str(error)


def test_a_child_result_row_naming_an_unaccepted_serializer_is_refused(
        make_app: Callable[..., Celery], marks: list[str]) -> None:
    """A finished child's result row naming an unaccepted serializer is refused by the parent."""
    app = make_app()

    @app.task(base=DurableTask, name="accept.kid")
    def kid() -> Any:
        return {"kid": 1}

    @app.task(base=DurableTask, name="accept.parent")
    def parent() -> Any:
        return child("kid", kid.s())

    parent_id = str(uuid.uuid4())
    kid_id = child_task_id(parent_id, "kid")
    assert kid.apply(task_id=kid_id).get() == {"kid": 1}
    set_serializer(app, "runs", HOSTILE, task_id=kid_id)

    error = parent.apply(task_id=parent_id).result
    assert marks == []  # Hostile was neither built nor asked to load
    assert isinstance(error, ConfigurationError), error
    assert repr(HOSTILE) in str(error)


# -- read-only views ----------------------------------------------------------------------


@pytest.fixture
def hostile_run(make_app: Callable[..., Celery]) -> tuple[Celery, str]:
    """A succeeded run whose step row and result row both name Hostile."""
    app = make_app()
    trip = define_trip(app, [], stop=False)
    task_id = str(uuid.uuid4())
    assert trip.apply(task_id=task_id).get() == {"quoted": {"price": 3}}
    set_serializer(app, "steps", HOSTILE, task_id=task_id, step_key="quote")
    set_serializer(app, "runs", HOSTILE, task_id=task_id)
    return app, task_id


def test_get_run_shows_an_unaccepted_row_as_unreadable(
        hostile_run: tuple[Celery, str], marks: list[str]) -> None:
    """get_run shows rows naming an unaccepted serializer as unreadable, without loading them."""
    app, task_id = hostile_run
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "succeeded"
    assert str(run.step("quote").result) == PLACEHOLDER
    assert str(run.result) == PLACEHOLDER
    assert marks == []


def test_cli_show_shows_an_unaccepted_row_as_unreadable(
        hostile_run: tuple[Celery, str], marks: list[str]) -> None:
    """`duraflow show` (text and --json) prints the placeholder and exits 0, loading nothing."""
    app, task_id = hostile_run
    shown = duraflow_show(app, task_id)
    assert shown.exit_code == 0, (shown.output, shown.exception)
    assert PLACEHOLDER in shown.stdout
    rows = [line for line in shown.stdout.splitlines() if line.startswith("quote ")]
    assert len(rows) == 1 and "<unreadable: " in rows[0]

    as_json = duraflow_show(app, task_id, "--json")
    assert as_json.exit_code == 0, (as_json.output, as_json.exception)
    data = json.loads(as_json.stdout)
    assert data["result"] == PLACEHOLDER
    assert data["steps"][0]["result"] == PLACEHOLDER
    assert marks == []


def test_the_web_page_shows_an_unaccepted_row_as_unreadable(
        hostile_run: tuple[Celery, str], marks: list[str]) -> None:
    """An unauthenticated GET of the run page shows the placeholder and loads nothing."""
    app, task_id = hostile_run
    page = web_page(app, task_id)
    assert "&lt;unreadable: stored with serializer" in page and "not accepted" in page
    assert "duraflow_accept_serializers" in page
    assert marks == []


def test_a_null_serializer_means_the_configured_one(make_app: Callable[..., Celery]) -> None:
    """A row with a NULL serializer is read with the configured serializer."""
    app = make_app()
    calls: list[str] = []
    trip = define_trip(app, calls)
    task_id = str(uuid.uuid4())
    assert isinstance(trip.apply(task_id=task_id).result, Stop)
    set_serializer(app, "steps", None, task_id=task_id, step_key="quote")
    assert get_run(task_id, app=app).step("quote").result == {"price": 3}  # type: ignore[union-attr]
    assert trip.apply(task_id=task_id).get() == {"quoted": {"price": 3}}
    assert calls == ["quote"]


# -- pickle stays opt-in -------------------------------------------------------------------


def pickled_run(make_app: Callable[..., Celery]) -> str:
    """A failed run whose step was stored by a deployment configured for pickle."""
    writer = make_app(duraflow_serializer="pickle")
    calls: list[str] = []

    @writer.task(base=DurableTask, name="accept.pickled")
    def pickled() -> Any:
        with step("point") as s:
            calls.append("point")
            s.result = Point(7)
        raise Stop("after the point")

    task_id = str(uuid.uuid4())
    assert isinstance(pickled.apply(task_id=task_id).result, Stop)
    return task_id


def replay_pickled(app: Celery, task_id: str, calls: list[str]) -> Any:
    @app.task(base=DurableTask, name="accept.pickled")
    def pickled() -> Any:
        with step("point") as s:
            calls.append("point")
            s.result = Point(0)
        return s.result.x

    return pickled.apply(task_id=task_id).result


def test_a_pickle_row_is_unreadable_unless_pickle_is_configured_or_accepted(
        make_app: Callable[..., Celery]) -> None:
    """Under JSON a pickle row is unreadable; it is read once pickle is configured or accepted."""
    task_id = pickled_run(make_app)
    reader = make_app()
    run = get_run(task_id, app=reader)
    assert run is not None
    assert str(run.step("point").result) == (
        "<unreadable: stored with serializer 'pickle', which is not accepted>")
    calls: list[str] = []
    error = replay_pickled(reader, task_id, calls)
    assert isinstance(error, ConfigurationError) and "stored with pickle" in str(error)
    assert calls == []

    accepting = make_app(duraflow_accept_serializers=["pickle"])
    assert get_run(task_id, app=accepting).step("point").result == Point(7)  # type: ignore[union-attr]
    configured = make_app(duraflow_serializer="pickle")
    assert get_run(task_id, app=configured).step("point").result == Point(7)  # type: ignore[union-attr]
    assert replay_pickled(accepting, task_id, calls) == 7
    assert calls == []


# -- custom serializers by dotted path -----------------------------------------------------


def test_a_row_of_the_configured_dotted_path_serializer_is_read(
        make_app: Callable[..., Celery]) -> None:
    """Rows written with the configured dotted-path serializer are read normally."""
    app = make_app(duraflow_serializer=TRUSTED)
    calls: list[str] = []
    trip = define_trip(app, calls)
    task_id = str(uuid.uuid4())
    assert isinstance(trip.apply(task_id=task_id).result, Stop)
    assert get_run(task_id, app=app).step("quote").result == {"price": 3}  # type: ignore[union-attr]
    assert trip.apply(task_id=task_id).get() == {"quoted": {"price": 3}}
    assert calls == ["quote"]
    shown = duraflow_show(app, task_id)
    assert shown.exit_code == 0 and '{"price": 3}' in shown.stdout


def test_an_accepted_dotted_path_row_is_read_and_others_are_not(
        make_app: Callable[..., Celery], marks: list[str]) -> None:
    """A dotted path in duraflow_accept_serializers is read; other names still are not."""
    writer = make_app(duraflow_serializer=TRUSTED)
    calls: list[str] = []
    trip = define_trip(writer, calls)
    task_id = str(uuid.uuid4())
    assert isinstance(trip.apply(task_id=task_id).result, Stop)

    reader = make_app(duraflow_accept_serializers=[TRUSTED])
    assert get_run(task_id, app=reader).step("quote").result == {"price": 3}  # type: ignore[union-attr]
    set_serializer(reader, "steps", HOSTILE, task_id=task_id, step_key="quote")
    assert str(get_run(task_id, app=reader).step("quote").result) == PLACEHOLDER  # type: ignore[union-attr]
    assert marks == []


# -- decode itself -------------------------------------------------------------------------


def test_decode_never_imports_an_unaccepted_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode compares a row's name with the settings; it imports nothing a row names."""
    import importlib

    imported: list[str] = []
    real = importlib.import_module

    def spy(name: str, package: str | None = None) -> Any:
        imported.append(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", spy)
    with pytest.raises(ConfigurationError, match="not accepted") as info:
        decode('"x"', "os.system", "json", accept=("pickle",), task_id="t-1", step_key="k")
    assert info.value.task_id == "t-1" and info.value.step_key == "k"
    with pytest.raises(ConfigurationError, match="not accepted"):
        decode('"x"', HOSTILE, "json", task_id="t-1", step_key="k")
    assert imported == [] and MARKS == []


def test_decode_shows_a_long_or_strange_name_safely() -> None:
    """The refused name is quoted, kept on one line and cut short in the message."""
    name = "evil.\n<script>" + "x" * 500
    with pytest.raises(ConfigurationError) as info:
        decode('"x"', name, "json", task_id="t-1", step_key="k")
    message = str(info.value)
    assert "\n" not in message and "x" * 100 not in message
    assert "'evil.\\n<script>xxx" in message
    unreadable = decode('"x"', name, "json", task_id="t-1", step_key="k", placeholder=True)
    assert str(unreadable).startswith("<unreadable: stored with serializer 'evil.\\n<script>")
    assert len(str(unreadable)) < 200


def test_decode_reads_configured_and_accepted_names_only() -> None:
    """The configured name and the accepted names are read; everything else is not."""
    data = get_serializer("pickle").dumps(Point(2))
    assert decode(data, "pickle", "pickle", task_id="t", step_key=None) == Point(2)
    assert decode(data, "pickle", "json", accept=("pickle",), task_id="t",
                  step_key=None) == Point(2)
    assert decode('"x"', None, "json", task_id="t", step_key=None) == "x"
    assert decode('T"x"', TRUSTED, "json", accept=(TRUSTED,), task_id="t", step_key=None) == "x"
    with pytest.raises(ConfigurationError, match="stored with pickle"):
        decode(data, "pickle", "json", accept=(TRUSTED,), task_id="t", step_key=None)
    with pytest.raises(ConfigurationError, match="not accepted"):
        decode('"x"', "json", TRUSTED, task_id="t", step_key=None)
