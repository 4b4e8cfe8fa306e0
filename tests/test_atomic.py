"""Atomic steps: the body's writes and the step's record commit together, or neither does."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, select, update
from sqlalchemy.exc import IntegrityError

from celery_duraflow import (
    AtomicStepError,
    DurableTask,
    StepOutputNotSerializable,
    get_run,
    step,
    wait_for_signal,
)
from celery_duraflow._config import config_for_app
from celery_duraflow._store import close_all_stores, store_for
from tests.conftest import app_factory

# The store's own tests: on PostgreSQL also through PgBouncer (transaction pooling).
pytestmark = pytest.mark.pooled


class Flaky(Exception):
    """Raised by test bodies to make Celery retry the task."""


@pytest.fixture
def orders(database_url: str, table_prefix: str) -> Iterator[Table]:
    """A table of the user's own, in the store's database: what atomic bodies write."""
    table = Table(f"{table_prefix}orders", MetaData(),
                  Column("number", String(50), primary_key=True),
                  Column("amount", Integer, nullable=False))
    engine = create_engine(database_url)
    table.create(engine)
    engine.dispose()
    yield table
    close_all_stores()
    engine = create_engine(database_url)
    table.drop(engine, checkfirst=True)
    engine.dispose()


def order_numbers(database_url: str, table: Table) -> list[str]:
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return sorted(conn.execute(select(table.c.number)).scalars())
    finally:
        engine.dispose()


def step_rows(app: Celery, task_id: str) -> dict[str, str]:
    """{step key: status} of the run's recorded steps."""
    run = get_run(task_id, app=app)
    return {} if run is None else {s.key: s.status for s in run.steps}


def test_atomic_write_commits_with_record(make_app: Callable[..., Celery], orders: Table,
                                          database_url: str) -> None:
    """A retry after a later failure skips the atomic body: the order row exists once."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def place(number: str) -> Any:
        with step("save-order", atomic=True) as s:
            calls["save"] += 1
            s.connection.execute(orders.insert().values(number=number, amount=42))
            s.result = {"order": number}
        with step("charge") as s:
            calls["charge"] += 1
            if calls["charge"] == 1:
                raise Flaky("payment API timed out")
            s.result = "charged"
        return s.result

    result = place.apply(args=("A-1",))
    assert result.get() == "charged"
    assert calls == {"save": 1, "charge": 2}
    assert order_numbers(database_url, orders) == ["A-1"]
    assert step_rows(app, result.id) == {"save-order": "completed", "charge": "completed"}


def test_exception_rolls_back_writes_and_record(make_app: Callable[..., Celery], orders: Table,
                                                database_url: str) -> None:
    """A body that raises after its write leaves no row; the retry writes it once."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def place(number: str) -> Any:
        with step("save-order", atomic=True) as s:
            calls["save"] += 1
            s.connection.execute(orders.insert().values(number=number, amount=1))
            if calls["save"] == 1:
                # Had the first write committed, the retry would hit the primary key.
                assert order_numbers(database_url, orders) == []
                raise Flaky("fails after the write")
            s.result = "saved"
        return s.result

    result = place.apply(args=("B-1",))
    assert result.get() == "saved"
    assert calls["save"] == 2
    assert order_numbers(database_url, orders) == ["B-1"]
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded"
    assert [(s.key, s.attempts) for s in run.steps] == [("save-order", 2)]


def test_functional_form(make_app: Callable[..., Celery], orders: Table,
                         database_url: str) -> None:
    """step(..., atomic=True).run(fn) writes through the step's connection once."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def place(number: str) -> Any:
        saving = step("save-order", atomic=True)

        def save() -> str:
            calls["save"] += 1
            saving.connection.execute(orders.insert().values(number=number, amount=3))
            return number

        saved = saving.run(save)
        with step("after") as s:
            calls["after"] += 1
            if calls["after"] == 1:
                raise Flaky("later failure")
            s.result = saved
        return s.result

    assert place.apply(args=("C-1",)).get() == "C-1"
    assert calls == {"save": 1, "after": 2}
    assert order_numbers(database_url, orders) == ["C-1"]


def test_lost_lease_commits_nothing(make_app: Callable[..., Celery], orders: Table,
                                   database_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """An attempt whose run is taken over during the body commits neither writes nor record."""
    app = make_app()

    runs = store_for(config_for_app(app)).tables.runs

    @app.task(base=DurableTask)
    def place(number: str) -> Any:
        with step("save-order", atomic=True) as s:
            s.connection.execute(orders.insert().values(number=number, amount=5))
            take_over = (update(runs).where(runs.c.task_id == place.request.id)
                         .values(lease_owner="someone-else"))
            if database_url.startswith("sqlite"):
                # SQLite has one writer at a time, and this transaction is it: the
                # take-over can only be seen here from inside.
                s.connection.execute(take_over)
            else:
                # Another worker takes the run over meanwhile, on a connection of its own.
                engine = create_engine(database_url)
                with engine.begin() as conn:
                    conn.execute(take_over)
                engine.dispose()
            s.result = "saved"
        return s.result

    with caplog.at_level(logging.WARNING, logger="celery_duraflow.task"):
        result = place.apply(args=("D-1",))
    # The attempt stops (Celery's Ignore): the run is the new owner's.
    assert isinstance(result.result, Ignore)
    assert "save-order" in caplog.text and "nothing of the body" in caplog.text
    assert order_numbers(database_url, orders) == []
    assert step_rows(app, result.id) == {}


def test_body_commit_refused(make_app: Callable[..., Celery], orders: Table,
                             database_url: str) -> None:
    """A body that commits the step's connection itself gets AtomicStepError; nothing lands."""
    app = make_app()

    @app.task(base=DurableTask)
    def place(number: str) -> Any:
        with step("save-order", atomic=True) as s:
            s.connection.execute(orders.insert().values(number=number, amount=6))
            s.connection.commit()
            s.result = "saved"
        return s.result

    result = place.apply(args=("E-1",))
    assert isinstance(result.result, AtomicStepError)
    assert "save-order" in str(result.result) and result.id in str(result.result)
    assert order_numbers(database_url, orders) == []
    assert "completed" not in step_rows(app, result.id).values()


@pytest.mark.postgres
def test_raw_rollback_in_body_refused(pg_url: str, table_prefix: str) -> None:
    """A body that ends the transaction with raw SQL gets AtomicStepError and no record."""
    app = app_factory(pg_url, table_prefix)()
    try:
        @app.task(base=DurableTask)
        def place() -> Any:
            with step("save-order", atomic=True) as s:
                s.connection.exec_driver_sql("ROLLBACK")
                s.result = "saved"
            return s.result

        result = place.apply()
        assert isinstance(result.result, AtomicStepError)
        assert "committed or rolled back the transaction itself" in str(result.result)
        assert "completed" not in step_rows(app, result.id).values()
    finally:
        close_all_stores()
        from tests.conftest import drop_tables
        drop_tables(pg_url, table_prefix)


def test_swallowed_statement_error(make_app: Callable[..., Celery], orders: Table,
                                   database_url: str) -> None:
    """On PostgreSQL a failed statement whose error the body swallows aborts the step."""
    app = make_app()
    postgres = database_url.startswith("postgresql")

    @app.task(base=DurableTask)
    def place(number: str) -> Any:
        with step("save-order", atomic=True) as s:
            s.connection.execute(orders.insert().values(number=number, amount=7))
            # Swallowed: on PostgreSQL the transaction can only roll back now.
            with contextlib.suppress(IntegrityError):
                s.connection.execute(orders.insert().values(number=number, amount=8))
            s.result = "saved"
        return s.result

    result = place.apply(args=("F-1",))
    if postgres:
        assert isinstance(result.result, AtomicStepError)
        assert "failed" in str(result.result)
        assert order_numbers(database_url, orders) == []
    else:
        # SQLite keeps the transaction usable after a failed statement: the first write
        # and the record commit together.
        assert result.get() == "saved"
        assert order_numbers(database_url, orders) == ["F-1"]


def test_nested_steps_commit_with_outer(make_app: Callable[..., Celery], orders: Table,
                                        database_url: str) -> None:
    """Records of steps nested in an atomic step roll back with it, and run again."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def place(number: str) -> Any:
        with step("outer", atomic=True) as outer:
            with step("inner") as inner:
                calls["inner"] += 1
                inner.result = "inner-done"
            with step("inner-atomic", atomic=True) as ia:
                calls["inner-atomic"] += 1
                ia.connection.execute(orders.insert().values(number=number, amount=9))
                ia.result = "written"
            calls["outer"] += 1
            if calls["outer"] == 1:
                raise Flaky("outer fails after its children completed")
            outer.result = [inner.result, ia.result]
        return outer.result

    result = place.apply(args=("G-1",))
    assert result.get() == ["inner-done", "written"]
    # The children's records were rolled back with the outer step, so they ran again.
    assert calls == {"inner": 2, "inner-atomic": 2, "outer": 2}
    assert order_numbers(database_url, orders) == ["G-1"]
    assert step_rows(app, result.id) == {"outer": "completed", "outer/inner": "completed",
                                         "outer/inner-atomic": "completed"}


def test_nested_atomic_failure_is_a_savepoint(make_app: Callable[..., Celery], orders: Table,
                                              database_url: str) -> None:
    """An inner atomic step that fails rolls back only its own writes."""
    app = make_app()

    @app.task(base=DurableTask)
    def place() -> Any:
        with step("outer", atomic=True) as outer:
            outer.connection.execute(orders.insert().values(number="H-outer", amount=1))
            try:
                with step("inner", atomic=True) as inner:
                    inner.connection.execute(orders.insert().values(number="H-inner", amount=2))
                    raise ValueError("inner gives up")
            except ValueError:
                pass
            outer.result = "outer kept"
        return outer.result

    result = place.apply()
    assert result.get() == "outer kept"
    assert order_numbers(database_url, orders) == ["H-outer"]
    assert step_rows(app, result.id) == {"outer": "completed", "outer/inner": "failed"}


def test_wait_inside_atomic_step_fails_for_good(make_app: Callable[..., Celery], orders: Table,
                                                database_url: str) -> None:
    """A wait inside an atomic body is refused before anything is committed; the run fails."""
    app = make_app()

    @app.task(base=DurableTask, autoretry_for=(Exception,), retry_backoff=False,
              max_retries=3)
    def place() -> Any:
        with step("save-order", atomic=True) as s:
            s.connection.execute(orders.insert().values(number="I-1", amount=1))
            s.result = wait_for_signal("approval")
        return s.result

    result = place.apply()
    assert isinstance(result.result, AtomicStepError)
    assert "approval" in str(result.result) and "save-order" in str(result.result)
    assert order_numbers(database_url, orders) == []
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed"


def test_unstorable_output_fails_for_good(make_app: Callable[..., Celery], orders: Table,
                                          database_url: str) -> None:
    """An atomic output the serializer refuses: writes rolled back, the run fails for good."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, autoretry_for=(Exception,), retry_backoff=False,
              max_retries=3)
    def place() -> Any:
        with step("save-order", atomic=True) as s:
            calls["save"] += 1
            s.connection.execute(orders.insert().values(number="J-1", amount=1))
            s.result = object()
        return "unreachable"

    result = place.apply()
    assert isinstance(result.result, StepOutputNotSerializable)
    assert calls["save"] == 1
    assert order_numbers(database_url, orders) == []
    assert step_rows(app, result.id) == {"save-order": "failed"}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed"


def test_connection_outside_body(make_app: Callable[..., Celery]) -> None:
    """s.connection of a plain step, or after the body, is a clear AtomicStepError."""
    app = make_app()
    seen: list[str] = []

    @app.task(base=DurableTask)
    def place() -> Any:
        with step("plain") as s:
            try:
                s.connection  # noqa: B018
            except AtomicStepError as error:
                seen.append(str(error))
            s.result = 1
        with step("atomic", atomic=True) as a:
            a.result = 2
        try:
            a.connection  # noqa: B018
        except AtomicStepError as error:
            seen.append(str(error))
        return [s.result, a.result]

    assert place.apply().get() == [1, 2]
    assert "not atomic" in seen[0] and "'plain'" in seen[0]
    assert "not running" in seen[1] and "'atomic'" in seen[1]


def test_atomic_inside_other_stores_atomic_refused(make_app: Callable[..., Celery],
                                                   sqlite_url: str) -> None:
    """An atomic step of a run on another store, inside an atomic body, is refused."""
    app = make_app()
    other_file = sqlite_url.replace("duraflow.sqlite3", "other.sqlite3")
    other = app_factory(other_file, f"o{uuid.uuid4().hex[:8]}_")()

    @other.task(base=DurableTask)
    def inner() -> Any:
        with step("inner-save", atomic=True) as s:
            s.result = "inner"
        return s.result

    errors: list[Any] = []

    @app.task(base=DurableTask)
    def outer() -> Any:
        with step("outer-save", atomic=True) as s:
            errors.append(inner.apply().result)
            s.result = "outer done"
        return s.result

    assert outer.apply().get() == "outer done"
    assert isinstance(errors[0], AtomicStepError)
    assert "inner-save" in str(errors[0]) and "outer-save" in str(errors[0])
