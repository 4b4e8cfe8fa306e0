"""The web view in a real browser: Debian's Chromium, headless, driven by Playwright.

The app is served by uvicorn in a thread of this process, and real runs are
made by DurableTasks (a waiting one on the in-process worker). These tests are
skipped when /usr/bin/chromium is missing, unless DURAFLOW_REQUIRE_BROWSER=1
(as in CI), where that is a failure. No browser is ever downloaded.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import uvicorn
from celery import Celery
from starlette.applications import Starlette

from celery_duraflow import DurableTask, get_run, step, wait_for_signal
from celery_duraflow._config import config_for_app
from celery_duraflow._store import store_for
from celery_duraflow.web import create_app
from celery_duraflow.web._security import SESSION_COOKIE
from tests.conftest import run_worker, wait_for_status

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM = Path("/usr/bin/chromium")
REQUIRE_BROWSER = os.environ.get("DURAFLOW_REQUIRE_BROWSER") == "1"
#: Where screenshots are copied for a reviewer (git-ignored).
SCREENSHOTS = Path(__file__).resolve().parent.parent / "test-output" / "web"
TOKEN = "browser-test-token-5f1c"
XSS = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One headless Chromium for the module."""
    if not CHROMIUM.exists():
        message = f"Chromium is not installed at {CHROMIUM}"
        if REQUIRE_BROWSER:
            pytest.fail(f"{message}, and DURAFLOW_REQUIRE_BROWSER=1", pytrace=False)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh page in a context of its own: no cookies from another test."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(10_000)
    try:
        yield context.new_page()
    finally:
        context.close()


def new_app(make_app: Callable[..., Celery]) -> Celery:
    """A worker app on this test's database, with a queue no other test's worker reads."""
    return make_app(eager=False, task_default_queue=f"web-{uuid.uuid4().hex[:10]}")


@contextmanager
def served(app: Starlette) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a thread on a free loopback port; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", ws="none", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name="uvicorn")
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def save_screenshot(page: Page, tmp_path: Path, name: str) -> Path:
    """A full-page screenshot in the test's directory, copied to test-output/web/."""
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, SCREENSHOTS / name)
    return path


def status_of(page: Page) -> str:
    return page.locator("#run-status").inner_text().strip()


def test_log_in_and_approve_a_waiting_run(make_app: Callable[..., Celery], page: Page,
                                          tmp_path: Path) -> None:
    """In a browser, an operator logs in, approves a waiting run, and sees it succeed."""
    from playwright.sync_api import expect

    app = new_app(make_app)

    @app.task(base=DurableTask)
    def refund(order: str, amount: int) -> str:
        with step("check-order") as s:
            s.result = {"order": order, "amount": amount, "customer": "Ana <ana@example.com>"}
        decision = wait_for_signal("approval")
        with step("refund") as s:
            s.result = f"refunded {amount} on {order}" if decision["approved"] else "kept"
        return str(s.result)

    with run_worker(app), served(create_app(app, token=TOKEN)) as base:
        result = refund.delay("A-17", 40)
        wait_for_status(app, result.id, "waiting")

        # The runs page asks for the token first.
        page.goto(f"{base}/")
        expect(page).to_have_url(re.compile(r"/login\?next="))
        expect(page.get_by_role("heading", name="Log in")).to_be_visible()
        assert result.id not in page.inner_text("body")
        page.get_by_label("Token").fill(TOKEN)
        page.get_by_role("button", name="Log in").click()

        expect(page.get_by_role("heading", name="Runs")).to_be_visible()
        row = page.locator("tr", has=page.get_by_role("link", name=result.id))
        expect(row).to_contain_text("waiting")
        expect(row).to_contain_text("signal 'approval'")
        save_screenshot(page, tmp_path, "runs-page.png")
        page.get_by_role("link", name=result.id).click()

        expect(page.locator("#run-status")).to_have_text("waiting")
        expect(page.get_by_text("Ana <ana@example.com>")).to_be_visible()
        save_screenshot(page, tmp_path, "run-page.png")

        page.get_by_role("button", name="Approve").click()
        expect(page.get_by_role("status")).to_contain_text(
            "Approved: signal 'approval' sent with payload {\"approved\": true}")
        deadline = time.monotonic() + 20
        while status_of(page) != "succeeded":
            assert time.monotonic() < deadline, f"the run is still {status_of(page)}"
            page.wait_for_timeout(100)
            page.reload()
        expect(page.get_by_text('"refunded 40 on A-17"').first).to_be_visible()
        expect(page.get_by_role("button", name="Approve")).to_have_count(0)
        save_screenshot(page, tmp_path, "run-page-succeeded.png")
        assert result.get(timeout=10) == "refunded 40 on A-17"
    assert (tmp_path / "run-page.png").stat().st_size > 10_000
    assert (SCREENSHOTS / "run-page.png").exists()


def test_actions_without_the_token_are_refused(make_app: Callable[..., Celery],
                                               page: Page) -> None:
    """Without the token, a session or its CSRF field, a browser cannot send a signal."""
    from playwright.sync_api import expect

    app = new_app(make_app)

    @app.task(base=DurableTask)
    def release(batch: str) -> Any:
        with step("prepare") as s:
            s.result = f"batch {batch} ready"
        return wait_for_signal("approval")

    task_id = release.apply(args=("B-9",)).id
    form = {"signal": "approval", "payload": "true", "csrf": "0" * 64}

    # No token: read-only, no buttons, and a direct POST is refused.
    with served(create_app(app)) as base:
        page.goto(f"{base}/runs/{task_id}")
        expect(page.locator(".banner")).to_contain_text("Read-only")
        expect(page.locator("#run-status")).to_have_text("waiting")
        expect(page.get_by_role("button")).to_have_count(0)
        for action in ("approve", "reject", "signal", "cancel"):
            response = page.request.post(f"{base}/runs/{task_id}/{action}", form=form)
            assert response.status == 403, action

    # A token: the run page is behind the login, and a POST without a session is refused.
    with served(create_app(app, token=TOKEN)) as base:
        page.goto(f"{base}/runs/{task_id}")
        expect(page).to_have_url(re.compile(r"/login\?next="))
        assert "batch B-9 ready" not in page.content()
        response = page.request.post(f"{base}/runs/{task_id}/approve", form=form,
                                     max_redirects=0)
        assert response.status == 403
        # A wrong token gets no session either.
        page.get_by_label("Token").fill("not-the-token")
        page.get_by_role("button", name="Log in").click()
        expect(page.get_by_role("alert")).to_contain_text("not the token")
        assert page.context.cookies() == []
        # Logged in, a POST still needs the page's CSRF field.
        page.get_by_label("Token").fill(TOKEN)
        page.get_by_role("button", name="Log in").click()
        expect(page.locator("#run-status")).to_have_text("waiting")
        response = page.request.post(f"{base}/runs/{task_id}/approve",
                                     form={"signal": "approval"})
        assert response.status == 403

    store = store_for(config_for_app(app))
    assert store.get_signal(task_id, "approval") is None
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "waiting"


def test_html_in_a_step_output_is_shown_as_text(make_app: Callable[..., Celery], page: Page,
                                                tmp_path: Path) -> None:
    """HTML in step outputs and errors shows as text in a browser, and no script runs."""
    from playwright.sync_api import ConsoleMessage, Dialog, expect

    app = new_app(make_app)

    @app.task(base=DurableTask)
    def echo(text: str) -> str:
        with step("echo") as s:
            s.result = text
        with step("fail"):
            raise ValueError('<img src=x onerror="alert(2)">')

    task_id = echo.apply(args=(XSS,)).id
    dialogs: list[str] = []
    console: list[str] = []

    def on_dialog(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    def on_console(message: ConsoleMessage) -> None:
        console.append(message.text)

    page.on("dialog", on_dialog)
    page.on("console", on_console)
    with served(create_app(app)) as base:
        page.goto(f"{base}/runs/{task_id}")
        expect(page.locator("#run-status")).to_have_text("failed")
        expect(page.get_by_text(XSS).first).to_be_visible()
        expect(page.get_by_text('<img src=x onerror="alert(2)">').first).to_be_visible()
        expect(page.locator("script")).to_have_count(0)
        expect(page.locator("main img")).to_have_count(0)
        page.goto(f"{base}/")
        expect(page.get_by_role("link", name=task_id)).to_be_visible()
        page.goto(f"{base}/runs/{task_id}")
        save_screenshot(page, tmp_path, "run-page-escaped.png")
    assert dialogs == []
    # Nothing even tried to run: the Content-Security-Policy reported no blocked script.
    assert not [text for text in console if "Content Security Policy" in text], console


def waiting_release(app: Celery) -> str:
    """The id of a run of a fresh task that waits for signal 'approval' (made eagerly)."""

    @app.task(base=DurableTask)
    def release(batch: str) -> Any:
        with step("prepare") as s:
            s.result = f"batch {batch} ready"
        return wait_for_signal("approval")

    return str(release.apply(args=("C-3",)).id)


def test_after_logout_the_old_cookie_opens_nothing(make_app: Callable[..., Celery],
                                                   page: Page) -> None:
    """Log in, log out, put the old session cookie back: pages ask to log in, POSTs get 403."""
    from playwright.sync_api import expect

    app = new_app(make_app)
    task_id = waiting_release(app)
    with served(create_app(app, token=TOKEN)) as base:
        page.goto(f"{base}/runs/{task_id}")
        page.get_by_label("Token").fill(TOKEN)
        page.get_by_role("button", name="Log in").click()
        expect(page.locator("#run-status")).to_have_text("waiting")
        kept = [cookie for cookie in page.context.cookies() if cookie["name"] == SESSION_COOKIE]
        assert len(kept) == 1
        csrf = page.locator('input[name="csrf"]').first.get_attribute("value")
        assert csrf

        page.get_by_role("button", name="Log out").click()
        expect(page.get_by_role("heading", name="Log in")).to_be_visible()
        assert page.url == f"{base}/login"
        assert page.context.cookies() == []

        # The cookie comes back (kept by an extension, copied from a shared machine...).
        page.context.add_cookies(kept)  # type: ignore[arg-type]
        page.goto(f"{base}/runs/{task_id}")
        expect(page).to_have_url(re.compile(r"/login\?next="))
        assert "batch C-3 ready" not in page.content()
        for action in ("cancel", "approve"):
            response = page.request.post(f"{base}/runs/{task_id}/{action}",
                                         form={"csrf": csrf, "signal": "approval"},
                                         max_redirects=0)
            assert response.status == 403, action

    run = get_run(task_id, app=app)
    assert run is not None and run.status == "waiting"
    assert store_for(config_for_app(app)).get_signal(task_id, "approval") is None


def test_the_view_is_navigable_under_a_url_prefix(make_app: Callable[..., Celery], page: Page,
                                                  tmp_path: Path) -> None:
    """Served under /duraflow: log in, the styled runs and run pages, Cancel, Log out all work."""
    from playwright.sync_api import expect

    app = new_app(make_app)
    task_id = waiting_release(app)
    with served(create_app(app, token=TOKEN, url_prefix="/duraflow")) as base:
        root = f"{base}/duraflow"
        page.goto(f"{root}/")
        expect(page).to_have_url(re.compile(r"/duraflow/login\?next="))
        page.get_by_label("Token").fill(TOKEN)
        page.get_by_role("button", name="Log in").click()
        expect(page.get_by_role("heading", name="Runs")).to_be_visible()
        assert page.url == f"{root}/"
        assert [cookie["path"] for cookie in page.context.cookies()] == ["/duraflow/"]
        # The stylesheet was found under the prefix: the header has its dark background.
        background = page.locator("header.top").evaluate(
            "element => getComputedStyle(element).backgroundColor")
        assert background == "rgb(29, 35, 48)"

        page.get_by_role("link", name=task_id).click()
        expect(page.locator("#run-status")).to_have_text("waiting")
        assert page.url == f"{root}/runs/{task_id}"
        save_screenshot(page, tmp_path, "run-page-under-prefix.png")
        page.get_by_role("button", name="Cancel").click()
        expect(page.get_by_role("status")).to_contain_text("Cancellation requested")
        assert page.url.startswith(f"{root}/runs/{task_id}?")

        page.get_by_role("navigation").get_by_role("link", name="Runs").click()
        assert page.url == f"{root}/"
        page.get_by_role("button", name="Log out").click()
        expect(page.get_by_role("heading", name="Log in")).to_be_visible()
        assert page.url == f"{root}/login"
        # A page asked for under another Host name is refused, prefix or not.
        refused = page.request.get(f"{root}/", headers={"Host": "attacker.example"})
        assert refused.status == 400

    record = store_for(config_for_app(app)).get_run(task_id)
    assert record is not None and record.unwinding == "cancel"
