"""Atomic steps in a Django project: ORM writes on the store's alias commit with the record."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from django.db import transaction
from sqlalchemy import text

from celery_duraflow import AtomicStepError, DurableTask, get_run, step
from celery_duraflow._store import close_all_stores
from tests.djangoproj.shop.models import Order

BOTH = ["default", "lite"]
pytestmark = pytest.mark.django_db(databases=BOTH, transaction=True)


class Flaky(Exception):
    """Raised by test bodies to make Celery retry the task."""


@pytest.fixture(autouse=True)
def _close_stores() -> Iterator[None]:
    """Leave no store connection open: pytest-django drops the test databases at the end."""
    yield
    close_all_stores()


@pytest.fixture
def make_app() -> Callable[[str], Celery]:
    """An eager Celery app configured from Django's settings, its store on ``alias``."""

    def make(alias: str) -> Celery:
        app = Celery(f"dj-{uuid.uuid4().hex[:6]}", set_as_current=False)
        app.config_from_object("django.conf:settings", namespace="CELERY")
        app.conf.update(task_always_eager=True, task_eager_propagates=False,
                        broker_url="memory://", result_backend="cache+memory://",
                        duraflow_database=alias, duraflow_auto_migrate=True,
                        duraflow_table_prefix=f"dj{uuid.uuid4().hex[:8]}_")
        return app

    return make


def statuses(app: Celery, task_id: str) -> dict[str, str]:
    run = get_run(task_id, app=app)
    return {} if run is None else {s.key: s.status for s in run.steps}


@pytest.mark.parametrize("alias", BOTH)
def test_orm_write_commits_with_record(make_app: Callable[[str], Celery], alias: str) -> None:
    """A retry after a later failure skips the atomic body: the ORM row exists once."""
    app = make_app(alias)
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, shared=False, autoretry_for=(Flaky,), retry_backoff=False,
              max_retries=3)
    def place(number: str) -> Any:
        with step("save-order", atomic=True) as s:
            calls["save"] += 1
            s.result = Order.objects.using(alias).create(number=number, amount=10).pk
        with step("charge") as s:
            calls["charge"] += 1
            if calls["charge"] == 1:
                raise Flaky("payment API timed out")
            s.result = "charged"
        return s.result

    result = place.apply(args=("K-1",))
    assert result.get() == "charged"
    assert calls == {"save": 1, "charge": 2}
    assert list(Order.objects.using(alias).values_list("number", flat=True)) == ["K-1"]
    assert statuses(app, result.id) == {"save-order": "completed", "charge": "completed"}


@pytest.mark.parametrize("alias", BOTH)
def test_exception_rolls_back_orm_write(make_app: Callable[[str], Celery], alias: str) -> None:
    """A body that raises after an ORM write leaves no row; the retry writes it once."""
    app = make_app(alias)
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, shared=False, autoretry_for=(Flaky,), retry_backoff=False,
              max_retries=3)
    def place(number: str) -> Any:
        with step("save-order", atomic=True) as s:
            calls["save"] += 1
            Order.objects.using(alias).create(number=number, amount=11)
            if calls["save"] == 1:
                raise Flaky("fails after the write")
            s.result = "saved"
        return s.result

    assert place.apply(args=("L-1",)).get() == "saved"
    assert calls["save"] == 2
    assert Order.objects.using(alias).filter(number="L-1").count() == 1


@pytest.mark.parametrize("alias", BOTH)
def test_sqlalchemy_and_orm_share_the_transaction(make_app: Callable[[str], Celery],
                                                  alias: str) -> None:
    """s.connection is Django's connection: it sees the ORM's uncommitted row, and both land."""
    app = make_app(alias)

    @app.task(base=DurableTask, shared=False)
    def place() -> Any:
        with step("save", atomic=True) as s:
            Order.objects.using(alias).create(number="M-orm", amount=1)
            seen = s.connection.execute(
                text("SELECT count(*) FROM shop_order WHERE number = 'M-orm'")).scalar()
            s.connection.execute(
                text("INSERT INTO shop_order (number, amount) VALUES ('M-sql', 2)"))
            s.result = seen
        return s.result

    assert place.apply().get() == 1
    assert sorted(Order.objects.using(alias).values_list("number", flat=True)) == [
        "M-orm", "M-sql"]


def test_write_to_other_alias_refused(make_app: Callable[[str], Celery]) -> None:
    """An ORM write to another alias inside an atomic body is refused; nothing lands."""
    app = make_app("default")

    @app.task(base=DurableTask, shared=False)
    def place() -> Any:
        with step("save-order", atomic=True) as s:
            Order.objects.using("default").create(number="N-1", amount=1)
            Order.objects.using("lite").create(number="N-1", amount=1)
            s.result = "saved"
        return s.result

    result = place.apply()
    assert isinstance(result.result, AtomicStepError)
    assert "'lite'" in str(result.result) and "save-order" in str(result.result)
    assert not Order.objects.using("default").filter(number="N-1").exists()
    assert not Order.objects.using("lite").filter(number="N-1").exists()
    assert "completed" not in statuses(app, result.id).values()


@pytest.mark.parametrize("alias", BOTH)
def test_set_rollback_refused(make_app: Callable[[str], Celery], alias: str) -> None:
    """A body that marks the transaction for rollback gets AtomicStepError and no record."""
    app = make_app(alias)

    @app.task(base=DurableTask, shared=False)
    def place() -> Any:
        with step("save-order", atomic=True) as s:
            Order.objects.using(alias).create(number="O-1", amount=1)
            transaction.set_rollback(True, using=alias)
            s.result = "saved"
        return s.result

    result = place.apply()
    assert isinstance(result.result, AtomicStepError)
    assert "set_rollback" in str(result.result)
    assert not Order.objects.using(alias).filter(number="O-1").exists()
    assert "completed" not in statuses(app, result.id).values()


@pytest.mark.parametrize("alias", BOTH)
def test_nested_atomic_is_a_savepoint(make_app: Callable[[str], Celery], alias: str) -> None:
    """An inner atomic step that fails rolls back only its own ORM writes."""
    app = make_app(alias)

    @app.task(base=DurableTask, shared=False)
    def place() -> Any:
        with step("outer", atomic=True) as outer:
            Order.objects.using(alias).create(number="P-outer", amount=1)
            try:
                with step("inner", atomic=True) as inner:
                    Order.objects.using(alias).create(number="P-inner", amount=2)
                    inner.result = "never"
                    raise ValueError("inner gives up")
            except ValueError:
                pass
            outer.result = "kept"
        return outer.result

    result = place.apply()
    assert result.get() == "kept"
    assert list(Order.objects.using(alias).values_list("number", flat=True)) == ["P-outer"]
    assert statuses(app, result.id) == {"outer": "completed", "outer/inner": "failed"}
