"""The web view's handlers, through Starlette's TestClient, on SQLite and PostgreSQL.

Every run shown is a real one, made by running a DurableTask: eagerly for runs
that end (or reach a wait), and on an in-process worker where a signal must
wake the run again.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from html import unescape
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
from celery import Celery
from sqlalchemy import update
from starlette.applications import Starlette
from starlette.testclient import TestClient

from celery_duraflow import DurableTask, get_run, step, wait_for_signal
from celery_duraflow._config import config_for_app
from celery_duraflow._store import Store, store_for
from celery_duraflow.web import create_app
from celery_duraflow.web._security import SESSION_COOKIE
from tests.conftest import run_worker, wait_for_status

TOKEN = "correct horse battery staple"
XSS = "<script>alert(1)</script>"


def new_app(make_app: Callable[..., Celery], **conf: Any) -> Celery:
    """An app on this test's database that publishes to a queue of its own.

    Runs are made with ``task.apply()``, which runs them here whatever the
    app says; the app is not eager so that what the web view sends again (a
    woken, cancelled or retried run) is published, not refused. The in-memory
    broker is shared by the whole process, so each app has its own queue: no
    other test's worker picks those messages up.
    """
    conf.setdefault("eager", False)
    return make_app(task_default_queue=f"web-{uuid.uuid4().hex[:10]}", **conf)


def client_for(app: Celery, token: str | None = None) -> TestClient:
    return TestClient(create_app(app, token=token), follow_redirects=False)


def logged_in(app: Celery) -> TestClient:
    client = client_for(app, TOKEN)
    response = client.post("/login", data={"token": TOKEN, "next": "/"})
    assert response.status_code == 303, response.text
    return client


def store_of(app: Celery) -> Store:
    return store_for(config_for_app(app))


def csrf_of(html: str) -> str:
    match = re.search(r'name="csrf" value="([0-9a-f]+)"', html)
    assert match, "the page has no CSRF field"
    return match.group(1)


def run_links(html: str) -> list[str]:
    """The task ids the runs table links to, in page order."""
    return [unquote(unescape(found)) for found in re.findall(r'<a href="/runs/([^"?]+)">', html)]


def counts_of(html: str) -> dict[str, int]:
    """The counts at the top of the runs page, by status ("all" for the total)."""
    found = re.findall(r'class="count[^"]*">(\w+) <span class="n">(\d+)</span>', html)
    return {name: int(count) for name, count in found}


def next_link(html: str) -> str | None:
    match = re.search(r'<a href="([^"]+)" rel="next">', html)
    return unescape(match.group(1)) if match else None


def text_of(html: str) -> str:
    """The page's text, tags removed and entities decoded, whitespace collapsed."""
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", html)).split())


def define_tasks(app: Celery) -> SimpleNamespace:
    """The tasks most tests run, registered on ``app``."""
    failures: Counter[str] = Counter()

    @app.task(base=DurableTask)
    def book(amount: int, who: str = "ana") -> dict[str, Any]:
        with step("quote") as s:
            s.result = {"amount": amount, "who": who}
        with step("charge") as s:
            s.result = f"charge-{amount}"
        return {"booked": True, "total": amount * 2}

    @app.task(base=DurableTask)
    def broken(reason: str) -> None:
        with step("prepare") as s:
            s.result = "ready"
        with step("explode"):
            raise ValueError(reason)

    @app.task(base=DurableTask)
    def flaky() -> str:
        with step("once") as s:
            failures["flaky"] += 1
            if failures["flaky"] == 1:
                raise RuntimeError("first attempt fails")
            s.result = "ok"
        return "done"

    @app.task(base=DurableTask)
    def undone() -> None:
        with step("reserve", compensate=lambda seat: None) as s:
            s.result = "seat 12A"
        raise ValueError("no payment method")

    @app.task(base=DurableTask)
    def approval(amount: int) -> dict[str, Any]:
        with step("quote") as s:
            s.result = amount
        decision = wait_for_signal("approval")
        with step("book") as s:
            s.result = {"approved": decision["approved"], "amount": amount}
        return dict(s.result)

    @app.task(base=DurableTask)
    def hostile(text: str) -> str:
        with step("echo") as s:
            s.result = text
        return text

    return SimpleNamespace(book=book, broken=broken, flaky=flaky, undone=undone,
                           approval=approval, hostile=hostile, failures=failures)


# -- the runs page --------------------------------------------------------------------------


def test_runs_page_lists_newest_first_with_counts_and_filters(
        make_app: Callable[..., Celery]) -> None:
    app = new_app(make_app)
    tasks = define_tasks(app)
    ok = [tasks.book.apply(args=(n,)).id for n in range(3)]
    bad = tasks.broken.apply(args=("card declined",)).id
    waiting = tasks.approval.apply(args=(5,)).id
    client = client_for(app)

    response = client.get("/")
    assert response.status_code == 200
    assert run_links(response.text) == [waiting, bad, *reversed(ok)]
    page = text_of(response.text)
    assert counts_of(response.text) == {"all": 5, "waiting": 1, "succeeded": 3, "failed": 1}
    assert "signal 'approval' (no timeout)" in page
    assert tasks.book.name in page and tasks.broken.name in page
    # Each count links to the list filtered by its status.
    assert 'href="/?status=failed"' in response.text

    failed = client.get("/?status=failed")
    assert run_links(failed.text) == [bad]
    by_task = client.get("/", params={"task": tasks.book.name})
    assert run_links(by_task.text) == list(reversed(ok))
    assert counts_of(by_task.text) == {"all": 3, "succeeded": 3}
    both = client.get("/", params={"task": tasks.book.name, "status": "failed"})
    assert run_links(both.text) == [] and "No run matches." in both.text

    assert client.get("/?status=bogus").status_code == 400
    assert client.get("/?limit=0").status_code == 400
    assert client.get("/?before=yesterday&before_id=x").status_code == 400


def test_pagination_follows_the_cursor_and_lists_every_run_once(
        make_app: Callable[..., Celery]) -> None:
    app = new_app(make_app)
    tasks = define_tasks(app)
    ids = [tasks.book.apply(args=(n,)).id for n in range(7)]
    # Four runs created in the same instant: the task id orders them.
    store = store_of(app)
    runs = store.tables.runs
    same = get_run(ids[3], app=app)
    assert same is not None
    with store.engine.begin() as conn:
        conn.execute(update(runs).where(runs.c.task_id.in_(ids[1:5]))
                     .values(created_at=same.created_at))
    expected = [ids[6], ids[5], *sorted(ids[1:5], reverse=True), ids[0]]
    client = client_for(app)

    seen: list[str] = []
    pages = 0
    url: str | None = "/?limit=2"
    while url is not None:
        response = client.get(url)
        assert response.status_code == 200
        listed = run_links(response.text)
        assert 1 <= len(listed) <= 2
        seen += listed
        pages += 1
        url = next_link(response.text)
        if url is not None:
            query = parse_qs(urlsplit(url).query)
            assert query["limit"] == ["2"] and query["before_id"] == [listed[-1]]
            assert "offset" not in query
    assert seen == expected
    assert len(set(seen)) == len(seen) and pages == 4

    # The cursor keeps the filters: the second page of one task's failed runs.
    first = client.get(f"/?status=succeeded&task={tasks.book.name}&limit=3")
    second_url = next_link(first.text)
    assert second_url is not None and "status=succeeded" in second_url
    assert run_links(client.get(second_url).text) == expected[3:6]


# -- the run page ---------------------------------------------------------------------------


def test_run_page_shows_timeline_arguments_result_and_errors(
        make_app: Callable[..., Celery]) -> None:
    app = new_app(make_app)
    tasks = define_tasks(app)
    ok = tasks.book.apply(args=(21,), kwargs={"who": "bea"}).id
    bad = tasks.broken.apply(args=("card declined: insufficient funds",)).id
    undone = tasks.undone.apply().id
    client = client_for(app)

    page = client.get(f"/runs/{ok}")
    assert page.status_code == 200
    text = text_of(page.text)
    assert tasks.book.name in text and "succeeded" in text
    assert re.search(r'"args": \[\s*21\s*\]', unescape(page.text))
    assert '"who": "bea"' in unescape(page.text)
    assert '"booked": true' in unescape(page.text) and '"total": 42' in unescape(page.text)
    # The timeline, in order, with outputs.
    assert text.index("quote") < text.index("charge")
    assert '{"amount": 21, "who": "bea"}' in unescape(page.text)
    assert '"charge-21"' in unescape(page.text)

    failed = text_of(client.get(f"/runs/{bad}").text)
    assert "Errors" in failed
    assert "ValueError: card declined: insufficient funds" in failed
    assert "step explode" in failed

    compensated = client.get(f"/runs/{undone}")
    text = text_of(compensated.text)
    assert "compensated" in text and "Compensations" in text
    assert "compensate:reserve" in text
    assert "Undoes step" in text and "no payment method" in text

    # A step that was started and never recorded an end is marked in doubt.
    store = store_of(app)
    steps = store.tables.steps
    with store.engine.begin() as conn:
        conn.execute(update(steps).where(steps.c.task_id == ok, steps.c.step_key == "charge")
                     .values(status="running", completed_at=None, output=None))
    doubt = client.get(f"/runs/{ok}")
    assert 'class="in-doubt"' in doubt.text and "in doubt" in text_of(doubt.text)


def test_run_page_of_a_waiting_run_and_an_unknown_run(make_app: Callable[..., Celery]) -> None:
    app = new_app(make_app)
    tasks = define_tasks(app)
    waiting = tasks.approval.apply(args=(7,)).id
    client = client_for(app)
    text = text_of(client.get(f"/runs/{waiting}").text)
    assert "Waits for" in text and "Signal approval" in text and "no timeout" in text

    missing = client.get(f"/runs/{uuid.uuid4()}")
    assert missing.status_code == 404
    assert "No run with task id" in missing.text
    assert client.get("/runs/has%2Fslash%3Fand%23more").status_code == 404


def test_values_stored_with_another_serializer_do_not_break_the_page(
        make_app: Callable[..., Celery]) -> None:
    pickling = new_app(make_app, duraflow_serializer="pickle")
    tasks = define_tasks(pickling)
    task_id = tasks.book.apply(args=(3,)).id
    # The JSON app refuses to unpickle what the pickle app stored, and says so.
    reader = new_app(make_app)
    page = client_for(reader).get(f"/runs/{task_id}")
    assert page.status_code == 200
    text = text_of(page.text)
    assert "could not be decoded" in text and "pickle" in text
    assert "quote" in text and "charge" in text


# -- read-only mode -------------------------------------------------------------------------


def test_without_a_token_the_view_is_read_only(make_app: Callable[..., Celery]) -> None:
    app = new_app(make_app)
    tasks = define_tasks(app)
    waiting = tasks.approval.apply(args=(7,)).id
    failed = tasks.broken.apply(args=("x",)).id
    client = client_for(app)

    for task_id in (waiting, failed):
        page = client.get(f"/runs/{task_id}")
        assert page.status_code == 200
        assert "Read-only" in page.text
        assert "<button" not in page.text and 'method="post"' not in page.text
    assert "Read-only" in client.get("/").text

    for action in ("approve", "reject", "signal", "cancel", "retry"):
        refused = client.post(f"/runs/{waiting}/{action}",
                              data={"signal": "approval", "payload": "true", "csrf": "x"})
        assert refused.status_code == 403, action
        assert "read-only" in refused.text
    assert client.post("/login", data={"token": ""}).status_code == 403
    assert client.post("/logout").status_code == 403
    # Nothing was sent, nothing changed.
    assert store_of(app).get_signal(waiting, "approval") is None
    run = get_run(waiting, app=app)
    assert run is not None and run.status == "waiting"
    # No login page either: it sends the visitor back to the runs.
    assert client.get("/login").status_code == 303


# -- with a token ---------------------------------------------------------------------------


def test_with_a_token_nothing_is_shown_before_logging_in(make_app: Callable[..., Celery]) -> None:
    app = new_app(make_app)
    tasks = define_tasks(app)
    task_id = tasks.book.apply(args=(1,)).id
    client = client_for(app, TOKEN)

    for path in ("/", f"/runs/{task_id}", "/?status=succeeded"):
        response = client.get(path)
        assert response.status_code == 303
        location = response.headers["location"]
        assert location.startswith("/login?next=")
        assert parse_qs(urlsplit(location).query)["next"] == [path]
        assert task_id not in response.text
    assert client.get("/runs/nope").status_code == 303

    login = client.get("/login")
    assert login.status_code == 200 and task_id not in login.text
    wrong = client.post("/login", data={"token": "guess", "next": "/"})
    assert wrong.status_code == 403
    assert "not the token" in wrong.text and SESSION_COOKIE not in wrong.headers.get(
        "set-cookie", "")
    assert client.get("/").status_code == 303

    right = client.post("/login", data={"token": TOKEN, "next": f"/runs/{task_id}"})
    assert right.status_code == 303 and right.headers["location"] == f"/runs/{task_id}"
    cookie = right.headers["set-cookie"]
    assert cookie.startswith(f"{SESSION_COOKIE}=")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    value = cookie.split(";")[0].split("=", 1)[1]
    assert TOKEN not in value and "horse" not in value
    page = client.get(f"/runs/{task_id}")
    assert page.status_code == 200 and task_id in page.text and "Log out" in page.text
    assert "Read-only" not in page.text

    # A session made for another token is worthless here.
    other = client_for(app, "another token")
    other.cookies.set(SESSION_COOKIE, value)
    assert other.get("/").status_code == 303

    logout = client.post("/logout", data={"csrf": csrf_of(page.text)})
    assert logout.status_code == 303 and logout.headers["location"] == "/login"
    client.cookies.clear()
    assert client.get("/").status_code == 303


def test_login_only_returns_to_pages_of_this_site(make_app: Callable[..., Celery]) -> None:
    app = new_app(make_app)
    for target in ("//evil.example/x", "https://evil.example/", "/\\evil.example", "runs"):
        client = client_for(app, TOKEN)
        response = client.post("/login", data={"token": TOKEN, "next": target})
        assert response.status_code == 303 and response.headers["location"] == "/", target


def test_posts_need_a_session_and_its_csrf_field(make_app: Callable[..., Celery]) -> None:
    app = new_app(make_app)
    tasks = define_tasks(app)
    waiting = tasks.approval.apply(args=(7,)).id
    url = f"/runs/{waiting}/approve"

    anonymous = client_for(app, TOKEN)
    assert anonymous.post(url, data={"signal": "approval"}).status_code == 403

    client = logged_in(app)
    csrf = csrf_of(client.get(f"/runs/{waiting}").text)
    assert client.post(url, data={"signal": "approval"}).status_code == 403
    assert client.post(url, data={"signal": "approval", "csrf": "0" * 64}).status_code == 403
    # A CSRF field belongs to its session: another visitor's is refused.
    stranger = logged_in(app)
    refused = stranger.post(url, data={"signal": "approval", "csrf": csrf})
    assert refused.status_code == 403 and "CSRF" in refused.text
    # The session cookie sent as the CSRF field (a form could not know it) is refused too.
    own_cookie = client.cookies[SESSION_COOKIE]
    assert client.post(url, data={"signal": "approval", "csrf": own_cookie}).status_code == 403
    assert store_of(app).get_signal(waiting, "approval") is None

    # With both, the signal is stored.
    sent = client.post(url, data={"signal": "approval", "csrf": csrf})
    assert sent.status_code == 303
    signal = store_of(app).get_signal(waiting, "approval")
    assert signal is not None and '"approved":true' in (signal.payload or "")


def test_approve_sends_the_signal_and_the_run_succeeds(make_app: Callable[..., Celery]) -> None:
    app = new_app(make_app, eager=False)
    tasks = define_tasks(app)
    with run_worker(app):
        result = tasks.approval.delay(50)
        wait_for_status(app, result.id, "waiting")
        client = logged_in(app)
        page = client.get(f"/runs/{result.id}")
        assert "Approve" in page.text and "Reject" in page.text
        response = client.post(f"/runs/{result.id}/approve",
                               data={"signal": "approval", "csrf": csrf_of(page.text)})
        assert response.status_code == 303
        location = response.headers["location"]
        assert location.startswith(f"/runs/{result.id}?")
        assert result.get(timeout=30) == {"approved": True, "amount": 50}
        after = client.get(location)
    text = text_of(after.text)
    assert "Approved: signal 'approval' sent with payload {\"approved\": true}." in text
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded"
    assert run.step("approval").result == {"signal": "approval", "payload": {"approved": True}}
    assert ">Approve</button>" not in after.text


def test_reject_custom_payloads_and_stale_pages(make_app: Callable[..., Celery]) -> None:
    app = new_app(make_app)
    tasks = define_tasks(app)
    first, second, third = (tasks.approval.apply(args=(n,)).id for n in range(3))
    client = logged_in(app)
    csrf = csrf_of(client.get(f"/runs/{first}").text)
    store = store_of(app)

    rejected = client.post(f"/runs/{first}/reject", data={"signal": "approval", "csrf": csrf})
    assert rejected.status_code == 303
    signal = store.get_signal(first, "approval")
    assert signal is not None and '"approved":false' in (signal.payload or "")

    # Invalid JSON: the page says so, keeps the text, and sends nothing.
    typed = '{"approved": yes, "by": "<b>ops</b>"}'
    invalid = client.post(f"/runs/{second}/signal",
                          data={"signal": "approval", "csrf": csrf, "payload": typed})
    assert invalid.status_code == 400
    assert "not valid JSON" in invalid.text and "Nothing was sent" in invalid.text
    assert "&lt;b&gt;ops&lt;/b&gt;" in invalid.text and "<b>ops</b>" not in invalid.text
    assert store.get_signal(second, "approval") is None
    empty = client.post(f"/runs/{second}/signal",
                        data={"signal": "approval", "csrf": csrf, "payload": "  "})
    assert empty.status_code == 400 and store.get_signal(second, "approval") is None

    valid = client.post(f"/runs/{second}/signal",
                        data={"signal": "approval", "csrf": csrf,
                              "payload": '{"approved": true, "note": "by phone"}'})
    assert valid.status_code == 303
    signal = store.get_signal(second, "approval")
    assert signal is not None and "by phone" in (signal.payload or "")

    # A page that names another signal than the one the run waits for sends nothing.
    stale = client.post(f"/runs/{third}/approve", data={"signal": "payment", "csrf": csrf})
    assert stale.status_code == 303
    assert "no longer waits for signal 'payment'" in text_of(
        client.get(stale.headers["location"]).text)
    assert store.get_signal(third, "payment") is None

    assert client.post(f"/runs/{uuid.uuid4()}/approve",
                       data={"signal": "approval", "csrf": csrf}).status_code == 404


def test_cancel_and_retry(make_app: Callable[..., Celery]) -> None:
    app = new_app(make_app)
    tasks = define_tasks(app)
    waiting = tasks.approval.apply(args=(1,)).id
    flaky = tasks.flaky.apply().id
    undone = tasks.undone.apply().id
    ok = tasks.book.apply(args=(1,)).id
    client = logged_in(app)
    csrf = csrf_of(client.get(f"/runs/{waiting}").text)

    # An unfinished run has Cancel and no Retry; an ended one the other way round.
    waiting_page = client.get(f"/runs/{waiting}").text
    assert ">Cancel</button>" in waiting_page and ">Retry</button>" not in waiting_page
    flaky_page = client.get(f"/runs/{flaky}").text
    assert ">Retry</button>" in flaky_page and ">Cancel</button>" not in flaky_page
    ok_page = client.get(f"/runs/{ok}").text
    assert ">Retry</button>" not in ok_page and ">Cancel</button>" not in ok_page

    cancelled = client.post(f"/runs/{waiting}/cancel", data={"csrf": csrf})
    assert cancelled.status_code == 303
    page = client.get(cancelled.headers["location"]).text
    assert "Cancellation requested" in text_of(page)
    assert "Cancellation has been requested." in page and ">Cancel</button>" not in page

    again = client.post(f"/runs/{ok}/cancel", data={"csrf": csrf})
    assert "already ended" in text_of(client.get(again.headers["location"]).text)

    retried = client.post(f"/runs/{flaky}/retry", data={"csrf": csrf})
    assert retried.status_code == 303
    assert "Sent again under the same task id" in text_of(
        client.get(retried.headers["location"]).text)
    run = get_run(flaky, app=app)
    assert run is not None and run.status == "running"

    # retry_run refuses a compensated run unless a step is named; the page shows why.
    refused = client.post(f"/runs/{undone}/retry", data={"csrf": csrf})
    message = text_of(client.get(refused.headers["location"]).text)
    assert "Not retried:" in message and "was compensated" in message
    from_step = client.post(f"/runs/{undone}/retry", data={"csrf": csrf, "from_step": "reserve"})
    assert "from step 'reserve'" in text_of(client.get(from_step.headers["location"]).text)

    succeeded = client.post(f"/runs/{ok}/retry", data={"csrf": csrf})
    assert "only a run that failed" in text_of(client.get(succeeded.headers["location"]).text)


def test_notes_in_the_address_must_be_signed_by_the_app(make_app: Callable[..., Celery]) -> None:
    app = new_app(make_app)
    tasks = define_tasks(app)
    task_id = tasks.book.apply(args=(1,)).id
    other = tasks.book.apply(args=(2,)).id
    client = logged_in(app)
    forged = client.get(f"/runs/{task_id}", params={
        "note": "Your session expired: log in at evil.example", "tone": "ok", "sig": "0" * 64})
    assert forged.status_code == 200 and "evil.example" not in forged.text

    csrf = csrf_of(forged.text)
    location = client.post(f"/runs/{task_id}/cancel", data={"csrf": csrf}).headers["location"]
    assert "already ended" in text_of(client.get(location).text)
    # A note signed for one run is not shown on another.
    moved = location.replace(task_id, other)
    assert "already ended" not in text_of(client.get(moved).text)


# -- escaping and headers -------------------------------------------------------------------


def test_html_in_stored_values_is_escaped(make_app: Callable[..., Celery]) -> None:
    app = new_app(make_app)
    tasks = define_tasks(app)
    task_id = tasks.hostile.apply(args=(XSS,)).id
    failed = tasks.broken.apply(args=('<img src=x onerror="alert(2)">',)).id
    name = tasks.hostile.apply(args=("x",), task_id=f"{XSS}-id").id
    client = logged_in(app)

    for response in (client.get(f"/runs/{task_id}"), client.get(f"/runs/{failed}"),
                     client.get("/")):
        assert response.status_code == 200
        assert "<script>alert" not in response.text and "<img src=x" not in response.text
    page = client.get(f"/runs/{task_id}").text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert XSS in text_of(page)
    assert "&lt;img src=x onerror=" in client.get(f"/runs/{failed}").text
    # A task id with HTML in it is escaped too, in the listing and on its own page.
    assert "&lt;script&gt;alert(1)&lt;/script&gt;-id" in client.get("/").text
    own = client.get(f"/runs/{name}")
    assert own.status_code == 200 and "<script>alert" not in own.text


def test_security_headers_and_the_stylesheet(make_app: Callable[..., Celery]) -> None:
    app = new_app(make_app)
    client = client_for(app, TOKEN)
    for response in (client.get("/"), client.get("/login"), client.get("/runs/x"),
                     client.get("/static/duraflow.css"), client.post("/runs/x/approve")):
        policy = response.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "form-action 'self'" in policy
        assert "script-src" not in policy and "unsafe-inline" not in policy
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-frame-options"] == "DENY"
    css = client.get("/static/duraflow.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert client.get("/").headers["cache-control"] == "no-store"
    too_big = logged_in(app).post("/runs/x/signal", content=b"a" * (1024 * 1024 + 1),
                                  headers={"content-type": "application/x-www-form-urlencoded"})
    assert too_big.status_code == 413


def test_store_outage_is_a_503_page(make_app: Callable[..., Celery]) -> None:
    app = new_app(make_app, duraflow_database_url="postgresql+psycopg://nobody@127.0.0.1:1/none",
                   duraflow_engine_options={"connect_args": {"connect_timeout": 1}})
    response = client_for(app).get("/")
    assert response.status_code == 503
    assert "The step store cannot be read" in response.text


def test_the_page_query_reads_an_index_and_uses_no_offset(sqlite_app: Celery) -> None:
    from sqlalchemy import text
    from sqlalchemy.dialects import postgresql

    from celery_duraflow.web._data import Cursor, page_query

    store = store_of(sqlite_app)
    store.ensure_schema()
    cursor = Cursor(datetime.now(UTC), "some-task-id")
    for status, task_name, index in ((None, None, "runs_created"),
                                     ("failed", None, "runs_status_created"),
                                     (None, "proj.tasks.book", "runs_task_created")):
        query = page_query(store, status=status, task_name=task_name, cursor=cursor, limit=51)
        # (SQLite's compiler writes OFFSET 0 after any LIMIT; PostgreSQL's writes what is asked.)
        on_postgres = str(query.compile(dialect=postgresql.dialect()))
        assert "OFFSET" not in on_postgres.upper() and "LIMIT" in on_postgres.upper()
        sql = str(query.compile(store.engine, compile_kwargs={"literal_binds": True}))
        with store.engine.connect() as conn:
            plan = " ".join(str(row[-1]) for row in conn.execute(text(f"EXPLAIN QUERY PLAN {sql}")))
        assert f"USING INDEX {store.config.table_prefix}{index} " in plan, plan
        assert "SCAN " not in plan, plan


def test_sessions_expire_and_cannot_be_forged() -> None:
    from celery_duraflow.web._security import SESSION_MAX_AGE, Guard

    guard = Guard(TOKEN)
    now = time.time()
    cookie = guard.new_session(now)
    assert guard.session_valid(cookie, now + SESSION_MAX_AGE - 1)
    assert not guard.session_valid(cookie, now + SESSION_MAX_AGE + 1)
    issued, nonce, mac = cookie.split(".")
    assert not guard.session_valid(f"{int(issued) + 3600}.{nonce}.{mac}", now)
    assert not guard.session_valid(f"{issued}.{nonce}x.{mac}", now)
    assert not guard.session_valid(f"{issued}.{nonce}", now)
    assert not guard.session_valid(TOKEN, now)
    assert not Guard(None).session_valid(Guard(None).new_session(now), now)
    assert guard.csrf_for(cookie) != guard.csrf_for(guard.new_session(now))
    assert not Guard("").token_matches("") and Guard("").read_only


def test_serve_listens_on_the_loopback_interface_by_default(
        make_app: Callable[..., Celery], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import uvicorn

    from celery_duraflow.web import serve

    started: list[Any] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: started.append(
        self.config))
    app = new_app(make_app)
    with caplog.at_level(logging.WARNING, logger="celery_duraflow.web"):
        serve(app)
        assert caplog.records == []
        serve(app, host="0.0.0.0", port=9000, token=TOKEN)
        assert "plain HTTP" in caplog.text
        serve(app, host="0.0.0.0", port=9001)
        assert "read-only on 0.0.0.0 without a token" in caplog.text
    assert [(config.host, config.port) for config in started] == [
        ("127.0.0.1", 8765), ("0.0.0.0", 9000), ("0.0.0.0", 9001)]
    assert all(isinstance(config.app, Starlette) for config in started)
