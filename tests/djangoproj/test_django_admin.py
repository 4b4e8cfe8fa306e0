"""The Django admin of runs, through Django's test client, on the test project's databases.

Every run shown is a real one, made by running a DurableTask on a Celery app whose store
is the database pytest-django created for the alias under test (PostgreSQL ``default``
or SQLite ``lite``): eagerly with ``apply()`` for runs that end or reach a wait, and on
an in-process worker where an action must make a run go on.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from html import unescape
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery import _state as celery_state
from django.contrib import admin
from django.contrib.admin.models import LogEntry
from django.contrib.admin.utils import quote
from django.contrib.admin.utils import unquote as admin_unquote
from django.contrib.auth.models import Permission, User
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connections
from django.test import Client
from sqlalchemy import delete
from sqlalchemy.engine import URL

from celery_duraflow import (
    DurableTask,
    child,
    children,
    get_run,
    send_signal,
    step,
    wait_for_signal,
)
from celery_duraflow._config import config_for_app
from celery_duraflow._store import Store, close_all_stores, store_for
from celery_duraflow.contrib.django import conf
from celery_duraflow.contrib.django.admin import celery_app
from celery_duraflow.contrib.django.models import Run, Schedule, Signal, Step
from tests.conftest import app_factory, run_worker, wait_for_status

pytestmark = pytest.mark.django_db(databases=["default", "lite"], transaction=True)

RUNS = "/admin/duraflow/run/"


def store_url(alias: str) -> str:
    """The SQLAlchemy URL of the database pytest-django created for ``alias``."""
    settings = connections[alias].settings_dict
    if settings["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{settings['NAME']}"
    return URL.create("postgresql+psycopg", username=settings["USER"] or None,
                      password=settings["PASSWORD"] or None, host=settings["HOST"] or None,
                      port=int(settings["PORT"]) if settings["PORT"] else None,
                      database=settings["NAME"]).render_as_string(hide_password=False)


def clear(store: Store) -> None:
    """Delete every run, step and signal: the tables outlive each test (Django's flush
    leaves unmanaged tables alone)."""
    tables = store.tables
    with store.engine.begin() as conn:
        for table in (tables.signals, tables.steps, tables.runs):
            conn.execute(delete(table))


def define_tasks(app: Celery) -> SimpleNamespace:
    """The tasks the tests run, registered on ``app``."""
    attempts: dict[str, int] = {}

    @app.task(base=DurableTask)
    def book(amount: int) -> dict[str, Any]:
        with step("quote") as s:
            s.result = {"amount": amount}
        with step("charge") as s:
            s.result = f"charge-{amount}"
        return {"booked": True}

    @app.task(base=DurableTask)
    def broken(reason: str) -> None:
        with step("prepare") as s:
            s.result = "ready"
        with step("explode"):
            raise ValueError(reason)

    @app.task(base=DurableTask)
    def flaky() -> str:
        with step("once") as s:
            attempts["flaky"] = attempts.get("flaky", 0) + 1
            if attempts["flaky"] == 1:
                raise RuntimeError("first attempt fails")
            s.result = "ok"
        return "done"

    @app.task(base=DurableTask)
    def approval(amount: int) -> dict[str, Any]:
        with step("quote", compensate=lambda quoted: None) as s:
            s.result = amount
        decision = wait_for_signal("approval")
        with step("book") as s:
            s.result = {"approved": decision["approved"], "amount": amount}
        return dict(s.result)

    return SimpleNamespace(book=book, broken=broken, flaky=flaky, approval=approval)


@pytest.fixture(params=["default", "lite"])
def alias(request: pytest.FixtureRequest) -> str:
    """The store's database alias: PostgreSQL, then SQLite."""
    return str(request.param)


def app_on(alias: str, settings: Any) -> Iterator[Celery]:
    """A Celery app whose store is the test database of ``alias``, named to the admin.

    It publishes to a queue of its own on the in-memory broker (what an action sends
    again goes there, for an in-process worker to run).
    """
    settings.DURAFLOW_DATABASE = alias
    celery_app = app_factory(store_url(alias), conf.table_prefix())(
        eager=False, task_default_queue=f"admin-{uuid.uuid4().hex[:10]}")
    settings.DURAFLOW_CELERY_APP = celery_app
    store = store_for(config_for_app(celery_app))
    store.migrate()
    clear(store)
    yield celery_app
    clear(store)
    # ``worker()`` may have closed every store already: this one then has a new engine.
    store.close()
    close_all_stores()


@pytest.fixture
def app(settings: Any) -> Iterator[Celery]:
    """:func:`app_on` PostgreSQL (``default``)."""
    yield from app_on("default", settings)


@pytest.fixture
def each_app(alias: str, settings: Any) -> Iterator[Celery]:
    """:func:`app_on` each database in turn."""
    yield from app_on(alias, settings)


@contextmanager
def worker(app: Celery) -> Iterator[Any]:
    """An in-process worker of ``app``.

    As it starts, the library drops its pooled connections without closing them (what a
    prefork child must do with its parent's); they are closed first, so that none is
    left open on the test database, which pytest-django drops at the end.
    """
    close_all_stores()
    # Celery's test worker makes its app the current and the default one: put back the
    # project's, which later tests send their shared tasks with.
    default, current = celery_state.default_app, celery_state._tls.current_app
    try:
        with run_worker(app) as started:
            yield started
    finally:
        celery_state.set_default_app(default)
        celery_state._set_current_app(current)


def superuser_client(**options: Any) -> Client:
    user = User.objects.create_superuser("root", "root@example.com", "pw")
    client = Client(**options)
    client.force_login(user)
    return client


def client_with(*codenames: str) -> Client:
    """A logged-in staff user holding exactly these permissions of the duraflow app."""
    user = User.objects.create_user(f"u{uuid.uuid4().hex[:8]}", password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="duraflow",
                                                        codename__in=codenames))
    assert sorted(user.user_permissions.values_list("codename", flat=True)) == sorted(codenames)
    client = Client()
    client.force_login(user)
    return client


def run_url(task_id: str, view: str = "change") -> str:
    return f"{RUNS}{quote(task_id)}/{view}/"


def listed(html: str) -> list[str]:
    """The task ids the list of runs shows, in page order."""
    return [admin_unquote(unescape(found))
            for found in re.findall(r'href="/admin/duraflow/run/([^/"]+)/change/[^"]*"', html)]


def text_of(html: str) -> str:
    """The page's text, tags removed and entities decoded, whitespace collapsed."""
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", html)).split())


def section(html: str, element_id: str) -> str:
    """The text of the page's element with this id, up to the element's end."""
    match = re.search(rf'<fieldset class="module" id="{element_id}">(.*?)</fieldset>', html,
                      re.S)
    assert match, f"the page has no {element_id} section"
    return text_of(match.group(1))


def status_of(app: Celery, task_id: str) -> str:
    run = get_run(task_id, app=app)
    assert run is not None
    return str(run.status)


def messages_of(html: str) -> str:
    match = re.search(r'<ul class="messagelist">(.*?)</ul>', html, re.S)
    return text_of(match.group(1)) if match else ""


# -- the list of runs -------------------------------------------------------------------------


def test_list_is_newest_first_filters_searches_and_pages(each_app: Celery, alias: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The run list, read from the store's alias, is newest first, filters, searches, pages."""
    tasks = define_tasks(each_app)
    ok = [tasks.book.apply(args=(n,)).id for n in range(3)]
    bad = tasks.broken.apply(args=("card declined",)).id
    waiting = tasks.approval.apply(args=(5,)).id
    client = client_with("view_run")

    response = client.get(RUNS)
    assert response.status_code == 200
    html = response.content.decode()
    assert listed(html) == [waiting, bad, *reversed(ok)]
    page = text_of(html)
    assert "signal 'approval' (no timeout)" in page
    assert tasks.book.name in page and tasks.broken.name in page
    # The sidebar offers every status and every task name recorded.
    assert "?status__exact=failed" in html and f"?task_name={tasks.approval.name}" in html

    failed = client.get(RUNS, {"status__exact": "failed"}).content.decode()
    assert listed(failed) == [bad]
    by_task = client.get(RUNS, {"task_name": tasks.book.name}).content.decode()
    assert listed(by_task) == list(reversed(ok))
    both = client.get(RUNS, {"task_name": tasks.book.name, "status__exact": "waiting"})
    assert listed(both.content.decode()) == []

    found = client.get(RUNS, {"q": f"  {bad} "}).content.decode()
    assert listed(found) == [bad]
    # The whole id, not a part of it.
    assert listed(client.get(RUNS, {"q": bad[:8]}).content.decode()) == []

    # Two runs a page: three pages, each run on exactly one, in the same order.
    monkeypatch.setattr(type(admin.site._registry[Run]), "list_per_page", 2)
    pages = [listed(client.get(RUNS, {"p": n}).content.decode()) for n in (1, 2, 3)]
    assert pages == [[waiting, bad], [ok[2], ok[1]], [ok[0]]]
    assert "5 runs" in text_of(client.get(RUNS, {"p": 1}).content.decode())

    # What the list read came from the store's alias, not from another database.
    assert Run.objects.using(alias).count() == 5
    other = "lite" if alias == "default" else "default"
    assert not _has_runs_table(other) or Run.objects.using(other).count() == 0


def _has_runs_table(alias: str) -> bool:
    return Run._meta.db_table in connections[alias].introspection.table_names()


def test_a_user_without_the_view_permission_sees_no_runs(app: Celery) -> None:
    """Staff without duraflow.view_run get 403 for the list and a run's page."""
    tasks = define_tasks(app)
    done = tasks.book.apply(args=(1,)).id
    client = client_with()
    assert client.get(RUNS).status_code == 403
    assert client.get(run_url(done)).status_code == 403
    assert client_with("view_run").get(run_url(done)).status_code == 200


# -- one run ----------------------------------------------------------------------------------


def test_run_page_shows_steps_waits_and_signals(each_app: Celery) -> None:
    """A run's page shows its fields, what it waits for, its steps and its signals."""
    app = each_app
    tasks = define_tasks(app)
    waiting = tasks.approval.apply(args=(7,)).id
    bad = tasks.broken.apply(args=("card declined",)).id
    client = client_with("view_run")

    html = client.get(run_url(waiting)).content.decode()
    page = text_of(html)
    assert waiting in page and tasks.approval.name in page and "waiting" in page
    assert "Waits for signal 'approval' (no timeout)." in section(html, "duraflow-waits")
    assert "approval" in section(html, "duraflow-waits")
    steps = section(html, "duraflow-steps")
    assert "Steps (2)" in steps
    assert re.search(r"quote completed 1 .* 7", steps), steps
    assert re.search(r"approval waiting", steps), steps
    assert "No signal was sent." in section(html, "duraflow-signals")
    # The arguments, decoded as the library stores them.
    assert "[7]" in page.replace(" ", "").replace("\n", "")
    # No button without a permission to act.
    assert "duraflow-actions" not in html

    assert send_signal(waiting, "approval", {"approved": True, "by": "<b>ops</b>"}, app=app)
    html = client.get(run_url(waiting)).content.decode()
    signals = section(html, "duraflow-signals")
    assert "Signals (1)" in signals and "approval" in signals
    assert '"approved": true' in signals and '"by": "<b>ops</b>"' in signals
    # Stored values are text on the page, never markup.
    assert "<b>ops</b>" not in html and "&lt;b&gt;ops&lt;/b&gt;" in html

    failed = client.get(run_url(bad)).content.decode()
    steps = section(failed, "duraflow-steps")
    assert re.search(r"prepare completed", steps) and re.search(r"explode failed", steps)
    assert "card declined" in steps
    assert "Waits for nothing." in section(failed, "duraflow-waits")

    # An unknown run: back to the list with a message, not an error page.
    missing = client.get(run_url("no-such-run"), follow=True)
    assert missing.status_code == 200
    assert "doesn\N{RIGHT SINGLE QUOTATION MARK}t exist" in messages_of(missing.content.decode())


def test_run_page_of_a_parent_links_its_child_and_back(app: Celery) -> None:
    """A parent's page lists its child runs, and a child's page links to its parent."""
    tasks = define_tasks(app)

    @app.task(base=DurableTask)
    def parent() -> Any:
        return child("booking", tasks.book.s(3))

    with worker(app):
        result = parent.delay()
        assert result.get(timeout=30) == {"booked": True}
    client = client_with("view_run")
    child_run = Run.objects.using("default").get(parent_id=result.id)
    html = client.get(run_url(result.id)).content.decode()
    waits = section(html, "duraflow-waits")
    assert child_run.task_id in waits and "succeeded" in waits
    assert f'href="{run_url(child_run.task_id)}"' in html
    child_html = client.get(run_url(child_run.task_id)).content.decode()
    assert f"Child of run {result.id}" in section(child_html, "duraflow-waits")
    assert f'href="{run_url(result.id)}"' in child_html


def test_run_page_of_a_fan_out_counts_its_children_by_status(app: Celery) -> None:
    """A parent of a children() join shows how many of them ended, by status, and lists its
    child runs."""
    tasks = define_tasks(app)

    @app.task(base=DurableTask)
    def parent() -> Any:
        return children("bookings", [tasks.book.s(n) for n in range(3)])

    with worker(app):
        result = parent.delay()
        assert result.get(timeout=30) == [{"booked": True}] * 3
    client = client_with("view_run")
    waits = section(client.get(run_url(result.id)).content.decode(), "duraflow-waits")
    assert "Children of step 'bookings': 3 of 3 ended (3 succeeded)." in waits
    assert waits.count("test_django_admin.book succeeded") == 3


# -- actions ----------------------------------------------------------------------------------


def test_approve_from_the_list_wakes_the_run_and_it_succeeds(app: Celery) -> None:
    """The approve action sends {"approved": true}; the run goes on and succeeds; it is logged."""
    tasks = define_tasks(app)
    client = client_with("view_run", "approve_run")
    with worker(app):
        result = tasks.approval.delay(50)
        wait_for_status(app, result.id, "waiting")
        listing = client.get(RUNS).content.decode()
        assert 'value="approve_runs"' in listing and 'value="cancel_runs"' not in listing
        response = client.post(RUNS, {"action": "approve_runs", "_selected_action": [result.id]},
                               follow=True)
        assert response.status_code == 200
        assert result.get(timeout=30) == {"approved": True, "amount": 50}
    said = messages_of(response.content.decode())
    assert f'Approved (signal payload {{"approved": true}}): {result.id}.' in said
    assert status_of(app, result.id) == "succeeded"
    signal = Signal.objects.using("default").get(run_id=result.id)
    assert signal.name == "approval" and '"approved":true' in (signal.payload or "")
    entry = LogEntry.objects.get(object_id=result.id)
    assert "Approved: signal 'approval'" in entry.get_change_message()


def test_reject_from_the_run_page_and_approving_a_run_that_does_not_wait(app: Celery) -> None:
    """Reject on a run's page sends {"approved": false}; approving a run not waiting is refused."""
    tasks = define_tasks(app)
    done = tasks.book.apply(args=(1,)).id
    client = client_with("view_run", "approve_run")
    with worker(app):
        result = tasks.approval.delay(8)
        wait_for_status(app, result.id, "waiting")
        html = client.get(run_url(result.id)).content.decode()
        assert ">Approve</button>" in html and ">Reject</button>" in html
        # Cancel and retry need their own permissions.
        assert ">Cancel run</button>" not in html and ">Retry</button>" not in html
        response = client.post(run_url(result.id, "reject"), {"signal": "approval"})
        assert response.status_code == 302 and response["Location"] == run_url(result.id)
        assert result.get(timeout=30) == {"approved": False, "amount": 8}
    after = client.get(run_url(result.id)).content.decode()
    assert f"Rejected (signal payload {{\"approved\": false}}): {result.id}." in messages_of(
        after)
    assert status_of(app, result.id) == "succeeded"
    assert ">Approve</button>" not in after

    refused = client.post(RUNS, {"action": "approve_runs", "_selected_action": [done]},
                          follow=True)
    said = messages_of(refused.content.decode())
    assert f"Run {done} was not approved: it does not wait for a signal (succeeded)." in said
    assert not Signal.objects.using("default").filter(run_id=done).exists()


def test_a_stale_run_page_sends_nothing(app: Celery) -> None:
    """A button for a signal the run no longer waits for sends nothing."""
    tasks = define_tasks(app)
    waiting = tasks.approval.apply(args=(2,)).id
    client = client_with("view_run", "approve_run")
    response = client.post(run_url(waiting, "approve"), {"signal": "payment"}, follow=True)
    said = messages_of(response.content.decode())
    assert f"Run {waiting} was not approved: it does not wait for signal 'payment'" in said
    assert not Signal.objects.using("default").filter(run_id=waiting).exists()
    assert status_of(app, waiting) == "waiting"


def test_cancel_stops_a_waiting_run_and_compensates_it(app: Celery) -> None:
    """The cancel action ends a waiting run cancelled, its completed step compensated."""
    tasks = define_tasks(app)
    client = client_with("view_run", "cancel_run")
    with worker(app):
        waiting = tasks.approval.delay(3).id
        wait_for_status(app, waiting, "waiting")
        response = client.post(RUNS, {"action": "cancel_runs", "_selected_action": [waiting]},
                               follow=True)
        wait_for_status(app, waiting, "cancelled")
    said = messages_of(response.content.decode())
    assert "Cancellation requested (each stops at its next step" in said and waiting in said
    keys = set(Step.objects.using("default").filter(run_id=waiting)
               .values_list("step_key", flat=True))
    assert "quote" in keys and any(key != "quote" and key.endswith("quote") for key in keys)

    # A run that already ended: said, nothing else.
    again = client.post(run_url(waiting, "cancel"), follow=True)
    assert f"Run {waiting} had already ended: nothing to cancel." in messages_of(
        again.content.decode())
    assert status_of(app, waiting) == "cancelled"


def test_retry_sends_a_failed_run_again_and_refusals_are_messages(app: Celery) -> None:
    """Retry makes a failed run succeed; a retry the library refuses is a message, not a 500."""
    tasks = define_tasks(app)
    flaky = tasks.flaky.apply().id
    done = tasks.book.apply(args=(4,)).id
    waiting = tasks.approval.apply(args=(4,)).id
    assert status_of(app, flaky) == "failed"
    client = client_with("view_run", "retry_run")
    html = client.get(run_url(flaky)).content.decode()
    assert ">Retry</button>" in html and '<option value="once">once</option>' in html
    with worker(app):
        response = client.post(RUNS, {"action": "retry_runs", "_selected_action": [flaky]},
                               follow=True)
        wait_for_status(app, flaky, "succeeded")
    said = messages_of(response.content.decode())
    assert f"Sent again under the same task id, replaying their recorded steps: {flaky}." in said

    # The library's refusals (RunStateError) are shown, and nothing changes.
    refused = client.post(RUNS, {"action": "retry_runs", "_selected_action": [waiting]},
                          follow=True)
    assert refused.status_code == 200
    said = messages_of(refused.content.decode())
    assert f"Retry of run {waiting} refused: run {waiting} is waiting, so it cannot be " \
           "retried" in said
    assert status_of(app, waiting) == "waiting"
    unknown_step = client.post(run_url(done, "retry"), {"from_step": "nope"}, follow=True)
    assert "has no step 'nope'" in messages_of(unknown_step.content.decode())
    assert status_of(app, done) == "succeeded"


def test_actions_without_their_permission_are_refused(app: Celery) -> None:
    """Without approve_run, cancel_run or retry_run an action is refused and nothing changes."""
    tasks = define_tasks(app)
    waiting = tasks.approval.apply(args=(9,)).id
    bad = tasks.broken.apply(args=("no",)).id
    viewer = client_with("view_run")

    listing = viewer.get(RUNS).content.decode()
    assert 'name="action"' not in listing and 'name="_selected_action"' not in listing
    for action in ("approve_runs", "reject_runs", "cancel_runs", "retry_runs"):
        response = viewer.post(RUNS, {"action": action, "_selected_action": [waiting, bad]},
                               follow=True)
        assert response.status_code == 200 and messages_of(response.content.decode()) == ""
    for action in ("approve", "reject", "cancel"):
        assert viewer.post(run_url(waiting, action), {"signal": "approval"}).status_code == 403
    assert viewer.post(run_url(bad, "retry")).status_code == 403

    # One permission does not grant another.
    approver = client_with("view_run", "approve_run")
    for action in ("cancel_runs", "retry_runs"):
        response = approver.post(RUNS, {"action": action, "_selected_action": [waiting, bad]},
                                 follow=True)
        assert "No action selected." in messages_of(response.content.decode())
    assert approver.post(run_url(waiting, "cancel")).status_code == 403
    assert approver.post(run_url(bad, "retry")).status_code == 403
    canceller = client_with("view_run", "cancel_run")
    assert canceller.post(run_url(waiting, "approve"), {"signal": "approval"}).status_code == 403

    assert status_of(app, waiting) == "waiting" and status_of(app, bad) == "failed"
    assert not Signal.objects.using("default").filter(run_id=waiting).exists()
    assert Run.objects.using("default").get(task_id=waiting).unwinding is None
    assert not LogEntry.objects.exists()


def test_a_post_without_the_csrf_token_is_refused(app: Celery) -> None:
    """An action POSTed without Django's CSRF token gets 403 and sends nothing."""
    tasks = define_tasks(app)
    waiting = tasks.approval.apply(args=(6,)).id
    client = superuser_client(enforce_csrf_checks=True)
    refused = client.post(RUNS, {"action": "approve_runs", "_selected_action": [waiting]})
    assert refused.status_code == 403 and b"CSRF" in refused.content
    for action in ("approve", "cancel"):
        response = client.post(run_url(waiting, action), {"signal": "approval"})
        assert response.status_code == 403 and b"CSRF" in response.content
    assert status_of(app, waiting) == "waiting"
    assert not Signal.objects.using("default").filter(run_id=waiting).exists()
    assert Run.objects.using("default").get(task_id=waiting).unwinding is None

    # The page's own token makes the same POST go through.
    html = client.get(run_url(waiting)).content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html)
    assert token is not None
    sent = client.post(run_url(waiting, "approve"),
                       {"signal": "approval", "csrfmiddlewaretoken": token.group(1)})
    assert sent.status_code == 302
    assert Signal.objects.using("default").filter(run_id=waiting).exists()


def test_nothing_can_be_added_changed_or_deleted(app: Celery) -> None:
    """Even a superuser cannot add, change or delete runs, steps or signals in the admin."""
    tasks = define_tasks(app)
    done = tasks.book.apply(args=(1,)).id
    client = superuser_client()

    assert client.get(f"{RUNS}add/").status_code == 403
    assert client.post(f"{RUNS}add/", {"task_id": "new", "task_name": "x"}).status_code == 403
    html = client.get(run_url(done)).content.decode()
    assert 'name="_save"' not in html and "Delete" not in text_of(html).split("Steps")[0]
    assert client.post(run_url(done), {"task_name": "renamed", "status": "failed"}
                       ).status_code == 403
    assert client.get(run_url(done, "delete")).status_code == 403
    assert client.post(run_url(done, "delete"), {"post": "yes"}).status_code == 403
    listing = client.get(RUNS).content.decode()
    assert 'value="delete_selected"' not in listing and "Add run" not in listing
    gone = client.post(RUNS, {"action": "delete_selected", "_selected_action": [done],
                              "post": "yes"}, follow=True)
    assert "No action selected." in messages_of(gone.content.decode())
    # Steps and signals are shown on the run's page only.
    assert client.get("/admin/duraflow/step/").status_code == 404
    assert client.get("/admin/duraflow/signal/").status_code == 404

    run = Run.objects.using("default").get(task_id=done)
    assert (run.task_name, run.status) == (tasks.book.name, "succeeded")
    assert Step.objects.using("default").filter(run_id=done).count() == 2
    with pytest.raises(TypeError, match="written by celery-duraflow only"):
        run.save(using="default")
    with pytest.raises(TypeError, match="deleted by `celery duraflow prune` only"):
        run.delete(using="default")
    runs = Run.objects.using("default").filter(task_id=done)
    for write in (lambda: runs.update(status="failed"), runs.delete,
                  lambda: Step.objects.using("default").filter(run_id=done).delete()):
        with pytest.raises(TypeError, match="written by the library only"):
            write()
    assert Run.objects.using("default").get(task_id=done).status == "succeeded"
    # No add, change or delete permission exists to be granted.
    codenames = set(Permission.objects.filter(content_type__app_label="duraflow")
                    .values_list("codename", flat=True))
    assert codenames == {"view_run", "approve_run", "cancel_run", "retry_run",
                         "view_schedule", "pause_schedule", "backfill_schedule"}


def test_the_celery_app_is_the_setting_or_celerys_current_app(settings: Any) -> None:
    """DURAFLOW_CELERY_APP names the actions' Celery app (object or dotted path); else None."""
    from tests.djangoproj.celery_app import app as project_app

    settings.DURAFLOW_CELERY_APP = None
    assert celery_app() is None  # the library then takes celery.current_app
    for name in ("tests.djangoproj.celery_app.app", "tests.djangoproj.celery_app:app"):
        settings.DURAFLOW_CELERY_APP = name
        assert celery_app() is project_app
    settings.DURAFLOW_CELERY_APP = project_app
    assert celery_app() is project_app
    settings.DURAFLOW_CELERY_APP = "tests.djangoproj.no_such_module.app"
    with pytest.raises(ImproperlyConfigured, match="DURAFLOW_CELERY_APP"):
        celery_app()


def test_makemigrations_has_nothing_to_write_for_the_run_models() -> None:
    """The unmanaged run and schedule models are in the app's migrations: makemigrations
    --check is clean."""
    call_command("makemigrations", "duraflow", "--check", "--dry-run", verbosity=0)
    # The admin's configuration passes Django's system checks too.
    call_command("check", "duraflow", fail_level="WARNING", verbosity=0)
    for model in (Run, Step, Signal, Schedule):
        assert model._meta.managed is False
        assert model._meta.db_table.startswith(conf.table_prefix())


# -- how stored values and times are shown ------------------------------------------------------


def test_run_page_shows_times_with_seconds_and_pretty_json(each_app: Celery) -> None:
    """A run's page shows its times to the second and its stored values as indented JSON."""
    app = each_app
    tasks = define_tasks(app)
    task_id = tasks.book.apply(args=(5,)).id
    run = get_run(task_id, app=app)
    assert run is not None
    client = client_with("view_run")
    html = client.get(run_url(task_id)).content.decode()
    created = f"{run.created_at:%Y-%m-%d %H:%M:%S}"
    started = f"{run.step('quote').started_at:%Y-%m-%d %H:%M:%S}"
    assert created in text_of(html), (created, text_of(html))
    assert started in section(html, "duraflow-steps")
    # The arguments, the result and a step's output keep their line breaks and indentation.
    pres = [unescape(found) for found in re.findall(r"<pre[^>]*>(.*?)</pre>", html, re.S)]
    assert '{\n  "args": [\n    5\n  ],' in "".join(pres), pres
    assert '{\n  "booked": true\n}' in pres, pres
    assert '{\n  "amount": 5\n}' in pres, pres
    # The list says the times to the second as well.
    listing = client.get(RUNS).content.decode()
    assert created in text_of(listing)


def test_run_page_shows_a_lone_surrogate_escaped(each_app: Celery) -> None:
    """Stored JSON holding a lone surrogate is shown escaped on the page and the list, not a 500."""
    app = each_app
    tasks = define_tasks(app)
    task_id = tasks.book.apply(args=(6,)).id
    store = store_for(config_for_app(app))
    runs, steps = store.tables.runs, store.tables.steps
    odd = '{"args": ["\\ud800 <i>x</i>"], "kwargs": {}}'
    with store.engine.begin() as conn:
        conn.execute(runs.update().where(runs.c.task_id == task_id)
                     .values(args=odd, result='"\\udfff"', task_name="shop.\\ud800"))
        conn.execute(steps.update().where(steps.c.task_id == task_id,
                                          steps.c.step_key == "quote")
                     .values(output='{"k": "\\ud83d"}'))
    client = client_with("view_run")
    response = client.get(run_url(task_id))
    assert response.status_code == 200
    html = response.content.decode()
    assert "\\ud800 &lt;i&gt;x&lt;/i&gt;" in html and "<i>x</i>" not in html
    assert "\\udfff" in html and "\\ud83d" in html
    assert client.get(RUNS).status_code == 200


def test_retry_of_a_succeeded_run_needs_a_step_as_on_every_surface(app: Celery) -> None:
    """The admin retries a succeeded run from a named step only, as the CLI and web view do."""
    tasks = define_tasks(app)
    done = tasks.book.apply(args=(3,)).id
    client = client_with("view_run", "retry_run")
    html = client.get(run_url(done)).content.decode()
    assert ">Retry</button>" in html and '<option value="charge">charge</option>' in html
    assert "(replay the recorded steps)" not in html

    refused = client.post(RUNS, {"action": "retry_runs", "_selected_action": [done]},
                          follow=True)
    said = messages_of(refused.content.decode())
    assert f"Retry of run {done} refused: run {done} succeeded, so sending it again as " \
           "recorded would replay every step and change nothing" in said
    assert status_of(app, done) == "succeeded"

    with worker(app):
        sent = client.post(run_url(done, "retry"), {"from_step": "charge"}, follow=True)
        assert "Sent again under the same task id, from step 'charge'" in messages_of(
            sent.content.decode())
        run = wait_for_status(app, done, "succeeded")
    assert [s.key for s in run.steps] == ["quote", "charge"]


def test_run_page_of_a_run_queued_for_a_slot_shows_its_place(each_app: Celery) -> None:
    """A run waiting for a concurrency slot: the admin says which key and its place in line."""
    from celery_duraflow import Concurrency
    from celery_duraflow._store import Delivery

    app = each_app

    @app.task(base=DurableTask, name="shop.limited",
              duraflow_limits=[Concurrency(1, key="tenant")])
    def limited(tenant: str) -> None:
        pass

    store = store_for(config_for_app(app))
    for task_id, owner in (("holder", "w-1"), ("queued", "w-2")):
        store.begin_attempt(task_id, Delivery(task_name=limited.name, owner=owner, first=True))
    assert store.acquire_slot("holder", "w-1", scope="shop.limited", key="acme", limit=1,
                              grace=5.0, sweep_after=None).state == "granted"
    assert store.acquire_slot("queued", "w-2", scope="shop.limited", key="acme", limit=1,
                              grace=5.0, sweep_after=None).state == "waiting"
    html = unescape(client_with("view_run").get(run_url("queued")).content.decode())
    waits = section(html, "duraflow-waits")
    assert "Waits for a concurrency slot of 'shop.limited/acme'." in waits
    assert "place 1 in the queue of 'shop.limited/acme', 1 of 1 slots taken" in waits
