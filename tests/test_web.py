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
#: Where the test clients say they are: a name the view allows by default.
LOCAL = "http://localhost"
#: A Host header the view must refuse (a DNS-rebinding page sends its own name).
FOREIGN = "attacker.example"


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


def client_for(app: Celery, token: str | None = None, **options: Any) -> TestClient:
    """A client of a new web view of ``app``, sending ``Host: localhost`` (an allowed name)."""
    return TestClient(create_app(app, token=token, **options), base_url=LOCAL,
                      follow_redirects=False)


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
    """The runs page lists newest first, counts by status, and filters by status and task."""
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
    """Paging through the runs shows each run once, even runs created in the same instant."""
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
    """A run page shows arguments, result, timeline, errors, undos and steps in doubt."""
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
    """A waiting run's page says what it waits for; an unknown task id is a 404."""
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
    """Values the view cannot decode (another serializer) are marked so; the page still shows."""
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
    """Without a token the view is read-only: no buttons, and every action is refused with 403."""
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
    """With a token nothing shows before login, and the session cookie holds no token."""
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
    other = client_for(app, "another token, just as long")
    other.cookies.set(SESSION_COOKIE, value)
    assert other.get("/").status_code == 303

    logout = client.post("/logout", data={"csrf": csrf_of(page.text)})
    assert logout.status_code == 303 and logout.headers["location"] == "/login"
    client.cookies.clear()
    assert client.get("/").status_code == 303


def test_login_only_returns_to_pages_of_this_site(make_app: Callable[..., Celery]) -> None:
    """After login the view redirects only to a page of its own site, never to another host."""
    app = new_app(make_app)
    for target in ("//evil.example/x", "https://evil.example/", "/\\evil.example", "runs"):
        client = client_for(app, TOKEN)
        response = client.post("/login", data={"token": TOKEN, "next": target})
        assert response.status_code == 303 and response.headers["location"] == "/", target


def test_posts_need_a_session_and_its_csrf_field(make_app: Callable[..., Celery]) -> None:
    """An action needs a session and that session's own CSRF field; otherwise nothing is sent."""
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
    """Approve sends the run's signal; the run wakes and succeeds; the page says what was sent."""
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
    """Reject and valid JSON payloads are sent; invalid JSON or a stale page sends nothing."""
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
    """Cancel and Retry are offered where they apply, and the page says what each did or why not."""
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
    """A note in a page's address is shown only if the app signed it for that run."""
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
    """HTML in outputs, errors and task ids is escaped on every page."""
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
    """Every response has a strict CSP, nosniff and no framing; an oversized post gets a 413."""
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
    """When the store cannot be reached, the view answers with a 503 page saying so."""
    app = new_app(make_app, duraflow_database_url="postgresql+psycopg://nobody@127.0.0.1:1/none",
                   duraflow_engine_options={"connect_args": {"connect_timeout": 1}})
    response = client_for(app).get("/")
    assert response.status_code == 503
    assert "The step store cannot be read" in response.text


def test_the_page_query_reads_an_index_and_uses_no_offset(sqlite_app: Celery) -> None:
    """The runs page's query reads an index and pages with a cursor, never an OFFSET."""
    from sqlalchemy import text
    from sqlalchemy.dialects import postgresql

    from celery_duraflow.web._data import Cursor, page_query

    store = store_of(sqlite_app)
    store.ensure_schema()
    cursor = Cursor(datetime.now(UTC), "some-task-id")
    for status, task_name, index in ((None, None, "runs_created"),
                                     ("failed", None, "runs_status_created"),
                                     (None, "proj.tasks.book", "runs_task_status_created")):
        query = page_query(store, status=status, task_name=task_name, cursor=cursor, limit=51)
        # (SQLite's compiler writes OFFSET 0 after any LIMIT; PostgreSQL's writes what is asked.)
        on_postgres = str(query.compile(dialect=postgresql.dialect()))
        assert "OFFSET" not in on_postgres.upper() and "LIMIT" in on_postgres.upper()
        sql = str(query.compile(store.engine, compile_kwargs={"literal_binds": True}))
        with store.engine.connect() as conn:
            plan = " ".join(str(row[-1]) for row in conn.execute(text(f"EXPLAIN QUERY PLAN {sql}")))
        assert f"USING INDEX {store.config.table_prefix}{index} " in plan, plan
        # (The listing by task merges one range per status: SQLite scans those results.)
        assert f"SCAN {store.config.table_prefix}" not in plan, plan


def test_sessions_expire_and_cannot_be_forged() -> None:
    """Sessions expire after their maximum age, and a tampered or tokenless one is never valid."""
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
    """serve() listens on 127.0.0.1 by default and warns when exposed on plain HTTP or read-only."""
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


# -- failing closed: the Host allow-list, logout, the URL prefix, the token -----------------


def not_acted_on(app: Celery, task_id: str) -> bool:
    """True when the waiting run is still waiting, with no cancel asked and no signal stored."""
    store = store_of(app)
    record = store.get_run(task_id)
    return (record is not None and record.status == "waiting" and record.unwinding is None
            and store.get_signal(task_id, "approval") is None)


def test_a_foreign_host_header_is_refused_on_every_route(make_app: Callable[..., Celery]) -> None:
    """A request whose Host is not allowed gets a short plain 400 and no data, on every route."""
    app = new_app(make_app)
    tasks = define_tasks(app)
    secret = "passport 123-secret"
    task_id = tasks.book.apply(args=(9,), kwargs={"who": secret}).id
    waiting = tasks.approval.apply(args=(3,)).id
    foreign = {"host": FOREIGN}

    read_only = client_for(app)
    assert secret in unescape(read_only.get(f"/runs/{task_id}").text)
    for path in ("/", f"/runs/{task_id}", "/static/duraflow.css", "/login", "/nowhere"):
        refused = read_only.get(path, headers=foreign)
        assert refused.status_code == 400, path
        assert refused.headers["content-type"].startswith("text/plain"), path
        assert len(refused.text) < 100 and secret not in refused.text, path
        assert task_id not in refused.text and "set-cookie" not in refused.headers, path

    client = logged_in(app)
    csrf = csrf_of(client.get(f"/runs/{waiting}").text)
    assert client.get(f"/runs/{waiting}", headers=foreign).status_code == 400
    assert client.get("/login", headers=foreign).status_code == 400
    login = client.post("/login", data={"token": TOKEN, "next": "/"}, headers=foreign)
    assert login.status_code == 400 and "set-cookie" not in login.headers
    for action in ("cancel", "approve", "reject", "signal", "retry"):
        posted = client.post(f"/runs/{waiting}/{action}", headers=foreign,
                             data={"csrf": csrf, "signal": "approval", "payload": "true"})
        assert posted.status_code == 400, action
    assert client.post("/logout", data={"csrf": csrf}, headers=foreign).status_code == 400
    assert not_acted_on(app, waiting)
    # The refused logout did nothing either: the session still works on an allowed name.
    assert client.get(f"/runs/{waiting}").status_code == 200


def test_loopback_names_are_allowed_and_allowed_hosts_adds_names(
        make_app: Callable[..., Celery]) -> None:
    """Loopback names pass with or without a port; allowed_hosts adds names and subdomains."""
    app = new_app(make_app)
    client = client_for(app)
    for host in ("localhost", "localhost:8765", "LOCALHOST", "127.0.0.1", "127.0.0.1:8765",
                 "[::1]", "[::1]:8765"):
        assert client.get("/", headers={"host": host}).status_code == 200, host
    for host in (FOREIGN, "localhost.attacker.example", "127.0.0.1.nip.io", "ops.example.com",
                 "::1", "localhost:x"):
        assert client.get("/", headers={"host": host}).status_code == 400, host

    more = client_for(app, allowed_hosts=["ops.example.com", ".corp.example", "*.svc.example"])
    for host in ("ops.example.com", "OPS.example.com:443", "corp.example", "a.corp.example",
                 "b.svc.example", "localhost:8765"):
        assert more.get("/", headers={"host": host}).status_code == 200, host
    for host in ("svc.example", "ops.example.com.attacker.example", "evilcorp.example",
                 "example.com", FOREIGN):
        assert more.get("/", headers={"host": host}).status_code == 400, host

    for bad in ("*", "", " ", "a*.example", "*example.com", "ops.example.com:8443", "a/b",
                "http://ops.example.com"):
        with pytest.raises(ValueError, match="allowed host"):
            create_app(app, allowed_hosts=[bad])


def invoke_web(app: Celery, monkeypatch: pytest.MonkeyPatch, *args: str,
               env: dict[str, str | None] | None = None) -> tuple[Any, list[Any]]:
    """``duraflow web ARGS`` on ``app`` in this process, with uvicorn's server loop stubbed.

    Returns click's result and the uvicorn configs the command started (none if it refused).
    """
    import uvicorn
    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_duraflow.cli import duraflow

    started: list[Any] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: started.append(
        self.config))
    environment: dict[str, str | None] = {"DURAFLOW_WEB_TOKEN": None}
    environment.update(env or {})
    result = CliRunner().invoke(
        duraflow, ["web", *args], env=environment,
        obj=CLIContext(app=app, no_color=True, workdir=None, quiet=False))
    return result, started


def test_web_command_allowed_host_and_url_prefix_reach_the_app(
        make_app: Callable[..., Celery], monkeypatch: pytest.MonkeyPatch) -> None:
    """`duraflow web --allowed-host NAME --url-prefix /duraflow` serves that name, there."""
    app = new_app(make_app)
    result, started = invoke_web(app, monkeypatch, "--token", TOKEN,
                                 "--allowed-host", "ops.example.com",
                                 "--allowed-host", ".corp.example", "--url-prefix", "/duraflow")
    assert result.exit_code == 0, result.output
    assert "serving the runs on http://127.0.0.1:8765/duraflow/" in result.output
    assert len(started) == 1
    client = TestClient(started[0].app, base_url="http://ops.example.com",
                        follow_redirects=False)
    assert client.get("/duraflow/login").status_code == 200
    for host in ("a.corp.example", "127.0.0.1:8765", "localhost"):
        assert client.get("/duraflow/login", headers={"host": host}).status_code == 200, host
    assert client.get("/duraflow/login", headers={"host": FOREIGN}).status_code == 400
    assert client.get("/login").status_code == 404

    refused, started = invoke_web(app, monkeypatch, "--token", TOKEN, "--allowed-host", "*")
    assert refused.exit_code == 1 and started == []
    assert refused.stderr.startswith("error: ") and "allowed host" in refused.stderr
    bad_prefix, started = invoke_web(app, monkeypatch, "--url-prefix", "/a b")
    assert bad_prefix.exit_code == 1 and started == []
    assert "url prefix" in bad_prefix.stderr.lower()


def test_serve_allows_the_address_it_listens_on(make_app: Callable[..., Celery],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """serve() lets the Host of its own --host address through, besides loopback names."""
    import uvicorn

    from celery_duraflow.web import serve

    started: list[Any] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: started.append(
        self.config))
    app = new_app(make_app)
    serve(app, host="10.1.2.3", token=TOKEN, allowed_hosts=["ops.example.com"])
    client = TestClient(started[0].app, base_url="http://10.1.2.3:8765", follow_redirects=False)
    for host in ("10.1.2.3:8765", "10.1.2.3", "ops.example.com", "localhost:8765"):
        assert client.get("/login", headers={"host": host}).status_code == 200, host
    assert client.get("/login", headers={"host": FOREIGN}).status_code == 400


def test_web_command_refuses_an_empty_placeholder_or_short_token(
        make_app: Callable[..., Celery], monkeypatch: pytest.MonkeyPatch) -> None:
    """`duraflow web` exits 1 without serving when the token is empty, a placeholder or short."""
    app = new_app(make_app)
    refusals: list[tuple[list[str], dict[str, str | None]]] = [
        (["--token", ""], {}),
        (["--token", "   "], {}),
        (["--token", "change-me"], {}),
        (["--token", "changeme"], {}),
        (["--token", "CHANGE_ME"], {}),
        (["--token", "secret"], {}),
        (["--token", "token"], {}),
        (["--token", "change-me-to-a-long-random-string"], {}),
        (["--token", "please-changeme-0123456789"], {}),
        (["--token", "fifteen-chars-x"], {}),
        ([], {"DURAFLOW_WEB_TOKEN": "change-me-to-a-long-random-string"}),
        ([], {"DURAFLOW_WEB_TOKEN": "short"}),
        # Set but empty (an unset variable in a deployment) is not "no token": it is refused.
        ([], {"DURAFLOW_WEB_TOKEN": ""}),
    ]
    for args, env in refusals:
        result, started = invoke_web(app, monkeypatch, *args, env=env)
        assert result.exit_code == 1, (args, env, result.output)
        assert started == [], (args, env)
        assert result.stderr.startswith("error: ") and "token" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr

    # A long random token works from the option and from the environment.
    accepted: list[tuple[list[str], dict[str, str | None]]] = [
        (["--token", TOKEN], {}), ([], {"DURAFLOW_WEB_TOKEN": TOKEN})]
    for args, env in accepted:
        result, started = invoke_web(app, monkeypatch, *args, env=env)
        assert result.exit_code == 0, result.output
        assert "actions need the token" in result.output and len(started) == 1
        client = TestClient(started[0].app, base_url=LOCAL, follow_redirects=False)
        assert client.get("/").status_code == 303
        assert client.post("/login", data={"token": TOKEN}).status_code == 303
    # No token at all is still the read-only view.
    result, started = invoke_web(app, monkeypatch)
    assert result.exit_code == 0 and "read-only (no --token)" in result.output
    assert len(started) == 1

    from celery_duraflow.web import serve

    for token in ("change-me", "short", ""):
        with pytest.raises(ValueError, match="token"):
            serve(app, token=token)


def test_logout_revokes_the_session_on_the_server(make_app: Callable[..., Celery]) -> None:
    """After logout the old cookie is dead: GET redirects to the login page, POST gets 403."""
    app = new_app(make_app)
    tasks = define_tasks(app)
    waiting = tasks.approval.apply(args=(4,)).id
    client = logged_in(app)
    other = TestClient(client.app, base_url=LOCAL, follow_redirects=False)
    assert other.post("/login", data={"token": TOKEN, "next": "/"}).status_code == 303
    page = client.get(f"/runs/{waiting}")
    csrf = csrf_of(page.text)
    old = {"cookie": f"{SESSION_COOKIE}={client.cookies[SESSION_COOKIE]}"}

    logout = client.post("/logout", data={"csrf": csrf})
    assert logout.status_code == 303 and logout.headers["location"] == "/login"
    client.cookies.clear()

    # The cookie kept (or stolen) from before the logout opens nothing...
    for path in ("/", f"/runs/{waiting}"):
        again = client.get(path, headers=old)
        assert again.status_code == 303, path
        assert again.headers["location"].startswith("/login?next="), path
        assert waiting not in again.text
    # ...and changes nothing.
    for action in ("cancel", "approve", "reject", "retry"):
        refused = client.post(f"/runs/{waiting}/{action}", headers=old,
                              data={"csrf": csrf, "signal": "approval"})
        assert refused.status_code == 403, action
    assert client.post("/logout", headers=old, data={"csrf": csrf}).status_code == 403
    assert not_acted_on(app, waiting)
    # Logging out ends that session only: another browser's stays logged in.
    assert other.get(f"/runs/{waiting}").status_code == 200


def test_sessions_live_in_a_bounded_server_side_table() -> None:
    """A session must be in the guard's table: logged out or evicted ones are refused."""
    from celery_duraflow.web._security import SESSION_MAX_AGE, Guard

    guard = Guard(TOKEN, max_sessions=3)
    now = time.time()
    cookies = [guard.new_session(now + n) for n in range(4)]
    # The table holds three: the oldest session was dropped, so it is logged out (not let in).
    assert not guard.session_valid(cookies[0], now + 10)
    assert all(guard.session_valid(cookie, now + 10) for cookie in cookies[1:])
    guard.revoke(cookies[1])
    assert not guard.session_valid(cookies[1], now + 10)
    assert not guard.csrf_valid(cookies[1], guard.csrf_for(cookies[1]))
    guard.revoke(cookies[1])
    guard.revoke("garbage")
    guard.revoke(None)
    assert guard.session_valid(cookies[2], now + 10)
    # Expired sessions leave the table when a new one is made.
    later = now + SESSION_MAX_AGE + 100
    fresh = guard.new_session(later)
    assert guard.live_sessions() == 1 and guard.session_valid(fresh, later)
    # A valid signature alone is not enough: another guard with the same token never issued it.
    assert not Guard(TOKEN).session_valid(fresh, later)


def test_the_view_works_under_a_url_prefix(make_app: Callable[..., Celery]) -> None:
    """Under url_prefix='/duraflow' every page, form, redirect, cookie and stylesheet is there."""
    app = new_app(make_app)
    tasks = define_tasks(app)
    waiting = tasks.approval.apply(args=(2,)).id
    client = client_for(app, TOKEN, url_prefix="/duraflow")

    first = client.get("/duraflow/")
    assert first.status_code == 303
    assert first.headers["location"] == "/duraflow/login?next=%2Fduraflow%2F"
    login_page = client.get("/duraflow/login")
    assert login_page.status_code == 200
    assert 'action="/duraflow/login"' in login_page.text
    assert 'href="/duraflow/static/duraflow.css"' in login_page.text
    assert client.get("/duraflow/static/duraflow.css").status_code == 200

    login = client.post("/duraflow/login",
                        data={"token": TOKEN, "next": f"/duraflow/runs/{waiting}"})
    assert login.status_code == 303 and login.headers["location"] == f"/duraflow/runs/{waiting}"
    assert "Path=/duraflow/" in login.headers["set-cookie"]
    runs = client.get("/duraflow/")
    assert runs.status_code == 200
    assert f'href="/duraflow/runs/{waiting}"' in runs.text
    assert 'href="/duraflow/?status=waiting"' in runs.text
    assert 'action="/duraflow/"' in runs.text and 'action="/duraflow/logout"' in runs.text
    page = client.get(f"/duraflow/runs/{waiting}")
    assert f'action="/duraflow/runs/{waiting}/cancel"' in page.text
    assert f'action="/duraflow/runs/{waiting}/approve"' in page.text

    cancel = client.post(f"/duraflow/runs/{waiting}/cancel", data={"csrf": csrf_of(page.text)})
    assert cancel.status_code == 303
    assert cancel.headers["location"].startswith(f"/duraflow/runs/{waiting}?note=")
    assert "Cancellation requested" in text_of(client.get(cancel.headers["location"]).text)
    record = store_of(app).get_run(waiting)
    assert record is not None and record.unwinding == "cancel"

    # Nothing answers outside the prefix; the bare prefix leads to its page.
    assert client.get("/").status_code == 404
    assert client.get(f"/runs/{waiting}").status_code == 404
    assert client.get("/static/duraflow.css").status_code == 404
    bare = client.get("/duraflow")
    assert bare.status_code in (301, 302, 307, 308)
    assert urlsplit(bare.headers["location"]).path == "/duraflow/"
    # After logging in, the visitor is only ever sent to a page under the prefix.
    elsewhere = client_for(app, TOKEN, url_prefix="/duraflow").post(
        "/duraflow/login", data={"token": TOKEN, "next": "/other-app/"})
    assert elsewhere.headers["location"] == "/duraflow/"

    logout = client.post("/duraflow/logout", data={"csrf": csrf_of(page.text)})
    assert logout.status_code == 303 and logout.headers["location"] == "/duraflow/login"
    assert "Path=/duraflow/" in logout.headers["set-cookie"]

    # The prefix is normalised, and one that cannot be a path is refused.
    same = client_for(app, url_prefix="duraflow/")
    assert same.get("/duraflow/").status_code == 200
    assert client_for(app, url_prefix="/").get("/").status_code == 200
    for bad in ("/a b", "/x?y", "/x#y", "//x", "/x//y", "/{task_id}", "/../x", "/%2e"):
        with pytest.raises(ValueError, match="url prefix"):
            create_app(app, url_prefix=bad)
