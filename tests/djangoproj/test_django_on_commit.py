"""``DurableTask`` keeps ``delay_on_commit()`` and ``apply_async_on_commit()``.

Celery's Django fix-up makes the app's task class ``DjangoTask``; a task declared
with ``base=DurableTask`` gets it mixed in. The sends are checked end to end: a
real ``celery worker`` subprocess of the test project (tests/djangoproj) consumes
this session's queue on Redis and records its runs in the test database that
pytest-django created, which the worker reaches through ``DURAFLOW_TEST_DJANGO_DB``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, Task
from celery.contrib.django.task import DjangoTask
from django.conf import settings
from django.db import connections, transaction

from celery_duraflow import DurableTask, get_run, step
from celery_duraflow._config import config_for_app
from celery_duraflow._store import close_all_stores
from tests.djangoproj.celery_app import app as project_app
from tests.djangoproj.shop.models import Order
from tests.djangoproj.shop.tasks import confirm_order, ping
from tests.workers import _wait_until_ready, discard_process, log_tail, purge_queue

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULT_TIMEOUT = 60.0


class Rollback(Exception):
    """Raised to roll a transaction back."""


@pytest.fixture(autouse=True)
def _close_stores() -> Iterator[None]:
    """Leave no store connection open: pytest-django drops the test databases at the end."""
    yield
    close_all_stores()


@pytest.fixture(scope="module")
def worker(django_db_setup: Any, django_db_blocker: Any, redis_url: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A prefork ``celery -A tests.djangoproj.celery_app worker`` on this session's queue,
    on the test databases; yields its log file."""
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    log_path = tmp_path_factory.mktemp("django-worker") / "worker.log"
    purge_queue(project_app, queue)
    env = dict(os.environ, DURAFLOW_TEST_DJANGO_WORKER="1", PYTHONUNBUFFERED="1",
               DJANGO_SETTINGS_MODULE="tests.djangoproj.settings",
               DURAFLOW_TEST_BROKER_URL=redis_url)
    command = [sys.executable, "-m", "celery", "-A", "tests.djangoproj.celery_app", "worker",
               "--pool", "prefork", "--concurrency", "1", "--loglevel", "INFO", "-Q", queue,
               "-n", f"django-{uuid.uuid4().hex[:8]}@%h", "--without-heartbeat",
               "--without-gossip", "--without-mingle"]
    with log_path.open("ab") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_until_ready(process, log_path, 0)
        yield log_path
    finally:
        discard_process(process)
        purge_queue(project_app, queue)


def runs_of(task_name: str) -> dict[str, str]:
    """Every recorded run of ``task_name``: task id -> status, read with Django's connection
    from the store's tables in the test database."""
    prefix = config_for_app(project_app).table_prefix
    with connections["default"].cursor() as cursor:
        cursor.execute(f"SELECT task_id, status FROM {prefix}runs WHERE task_name = %s",
                       [task_name])
        return dict(cursor.fetchall())


def wait_for(condition: Callable[[], Any], what: str, log_path: Path) -> Any:
    deadline = time.monotonic() + RESULT_TIMEOUT
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} within {RESULT_TIMEOUT:.0f}s; worker log:\n"
                         + log_tail(log_path))


def finished(task_id: str) -> Callable[[], str | None]:
    def status() -> str | None:
        run = runs_of_id(task_id)
        return run if run in ("succeeded", "failed") else None

    return status


def runs_of_id(task_id: str) -> str | None:
    prefix = config_for_app(project_app).table_prefix
    with connections["default"].cursor() as cursor:
        cursor.execute(f"SELECT status FROM {prefix}runs WHERE task_id = %s", [task_id])
        row = cursor.fetchone()
    return None if row is None else str(row[0])


def handled_everything_sent_before(log_path: Path) -> None:
    """Send a ping and wait for it: the worker runs one task at a time, in order, so every
    message sent before it has been handled once it has."""
    result = ping.delay("sentinel")
    assert wait_for(finished(result.id), "the sentinel ping did not finish",
                    log_path) == "succeeded"


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.subprocess
@pytest.mark.django_db(databases=["default"], transaction=True)
def test_delay_on_commit_sends_once_the_transaction_commits(worker: Path) -> None:
    """delay_on_commit sends nothing while the transaction is open, and the run after it."""
    number = f"order-{uuid.uuid4().hex[:12]}"
    before = runs_of(confirm_order.name)
    with transaction.atomic():
        Order.objects.create(number=number, amount=10)
        confirm_order.delay_on_commit(number)
        # Had it been sent now, the worker would have run it, not found the uncommitted
        # order and recorded a failed run by the time the sentinel is done.
        time.sleep(1.0)
        assert runs_of(confirm_order.name) == before
    new = wait_for(lambda: set(runs_of(confirm_order.name)) - set(before),
                   "the order's run was not recorded", worker)
    assert len(new) == 1
    (task_id,) = new
    assert wait_for(finished(task_id), "the order's run did not finish", worker) == "succeeded"
    assert Order.objects.get(number=number).amount == 11  # confirmed exactly once
    run = get_run(task_id, app=project_app)
    assert [(s.key, s.status) for s in run.steps] == [("load-order", "completed"),
                                                     ("confirm", "completed")]


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.subprocess
@pytest.mark.django_db(databases=["default"], transaction=True)
def test_delay_on_commit_sends_nothing_when_the_transaction_rolls_back(worker: Path) -> None:
    """A rolled-back transaction's delay_on_commit never reaches the worker."""
    number = f"order-{uuid.uuid4().hex[:12]}"
    before = runs_of(confirm_order.name)
    with pytest.raises(Rollback), transaction.atomic():
        Order.objects.create(number=number, amount=10)
        confirm_order.delay_on_commit(number)
        confirm_order.apply_async_on_commit((number,), task_id=f"rolled-back-{number}")
        raise Rollback
    handled_everything_sent_before(worker)
    assert runs_of(confirm_order.name) == before
    assert runs_of_id(f"rolled-back-{number}") is None
    assert not Order.objects.filter(number=number).exists()


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.subprocess
@pytest.mark.django_db(databases=["default"], transaction=True)
def test_apply_async_on_commit_keeps_the_sending_options(worker: Path) -> None:
    """apply_async_on_commit sends after the commit with the task id it was given."""
    number = f"order-{uuid.uuid4().hex[:12]}"
    task_id = f"confirm-{number}"
    with transaction.atomic():
        Order.objects.create(number=number, amount=41)
        confirm_order.apply_async_on_commit((number,), task_id=task_id)
        time.sleep(0.5)
        assert runs_of_id(task_id) is None
    assert wait_for(finished(task_id), "the order's run did not finish", worker) == "succeeded"
    assert Order.objects.get(number=number).amount == 42
    assert get_run(task_id, app=project_app).status == "succeeded"


def test_durable_tasks_of_a_django_app_are_django_tasks() -> None:
    """base=DurableTask in a Django project's app keeps DjangoTask, after DurableTask."""
    task = project_app.tasks[confirm_order.name]
    mro = type(task).__mro__
    assert isinstance(task, DjangoTask) and isinstance(task, DurableTask)
    assert mro.index(DurableTask) < mro.index(DjangoTask)
    assert type(task).delay_on_commit is DurableTask.delay_on_commit


def test_durable_tasks_keep_what_the_app_task_class_adds() -> None:
    """Any app task_cls other than Task itself is mixed into base=DurableTask tasks."""

    class Audited(Task):  # type: ignore[misc]
        def audit(self) -> str:
            return f"audited {self.name}"

    app = Celery("audited", set_as_current=False, task_cls=Audited)

    @app.task(base=DurableTask, name="audited.work", shared=False)
    def work() -> None:
        return None

    # Without Django's fix-up the app's task class is Task itself: nothing to add.
    plain = Celery("plain", set_as_current=False, fixups=[])

    @plain.task(base=DurableTask, name="plain.work", shared=False)
    def plain_work() -> None:
        return None

    assert isinstance(work, Audited) and work.audit() == "audited audited.work"
    assert type(work._get_current_object()).__bases__ == (DurableTask, Audited)
    assert type(plain_work._get_current_object()).__bases__ == (DurableTask,)


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_without_djangotask_on_commit_still_waits_for_the_commit() -> None:
    """An app whose task class is DurableTask itself gets the on-commit sends from Django."""
    prefix = f"c{uuid.uuid4().hex[:8]}_"
    app = Celery("eager", set_as_current=False, task_cls=DurableTask)
    app.conf.update(task_always_eager=True, duraflow_database="default",
                    duraflow_table_prefix=prefix, duraflow_auto_migrate=True)
    sent: list[str] = []

    @app.task(name="eager.note", shared=False)
    def note(text: str) -> str:
        with step("note") as s:
            sent.append(text)
            s.result = text
        result: str = s.result
        return result

    assert not isinstance(note, DjangoTask)
    try:
        with pytest.raises(Rollback), transaction.atomic():
            note.delay_on_commit("rolled back")
            raise Rollback
        with transaction.atomic():
            note.apply_async_on_commit(("committed",), task_id=f"note-{prefix}")
            assert sent == []
        assert sent == ["committed"]
        assert get_run(f"note-{prefix}", app=app).status == "succeeded"
    finally:
        close_all_stores()
        with connections["default"].cursor() as cursor:
            for table in ("steps", "signals", "runs", "schema"):
                cursor.execute(f"DROP TABLE IF EXISTS {prefix}{table}")


def test_on_commit_outside_django_is_a_clear_error() -> None:
    """Without a Django project, delay_on_commit raises ConfigurationError, sending nothing."""
    code = (
        "from celery import Celery\n"
        "from celery_duraflow import ConfigurationError, DurableTask\n"
        "app = Celery('nodjango', broker='memory://', set_as_current=False)\n"
        "@app.task(base=DurableTask, name='nodjango.work', shared=False)\n"
        "def work():\n"
        "    return 1\n"
        "for method in (work.delay_on_commit, work.apply_async_on_commit):\n"
        "    try:\n"
        "        method()\n"
        "    except ConfigurationError as exc:\n"
        "        print(exc)\n"
        "    else:\n"
        "        raise SystemExit('no error')\n"
    )
    env = {name: value for name, value in os.environ.items()
           if name != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "nodjango.work.delay_on_commit() sends the task once the Django" in lines[0]
    assert "Call delay() instead." in lines[0]
    assert "Call apply_async() instead." in lines[1]
