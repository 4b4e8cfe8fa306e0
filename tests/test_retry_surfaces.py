"""One meaning of retry on every surface: Python, the command line and the web view.

(The Django admin, the fourth surface, is tested in tests/djangoproj/test_django_admin.py.)
Each surface is asked the same three things: a failed run as it is, a succeeded run as it
is (refused: replayed whole it would change nothing) and a succeeded run from a step. The
runs are real task executions on an eager app, so what a retry sends runs here at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import update

from celery_duraflow import DurableTask, RunStateError, get_run, retry_run, step
from celery_duraflow._config import config_for_app
from celery_duraflow._store import store_for
from tests.test_admin import duraflow
from tests.test_web import csrf_of, logged_in, text_of


def python_surface(app: Celery, task_id: str, from_step: str | None) -> bool:
    try:
        retry_run(task_id, from_step=from_step, app=app)
    except RunStateError:
        return False
    return True


def cli_surface(app: Celery, task_id: str, from_step: str | None) -> bool:
    result = duraflow(app, "retry", task_id, *(["--from-step", from_step] if from_step else []))
    assert result.exit_code in (0, 1), result.output
    return result.exit_code == 0


def web_surface(app: Celery, task_id: str, from_step: str | None) -> bool:
    client = logged_in(app)
    csrf = csrf_of(client.get(f"/runs/{task_id}").text)
    response = client.post(f"/runs/{task_id}/retry",
                           data={"csrf": csrf, **({"from_step": from_step} if from_step else {})})
    assert response.status_code == 303
    said = text_of(client.get(response.headers["location"]).text)
    return "Sent again under the same task id" in said


SURFACES = {"python": python_surface, "cli": cli_surface, "web": web_surface}


def shop(app: Celery) -> tuple[Any, Counter[str], dict[str, bool]]:
    """A three-step task whose last step fails while the mailer is down."""
    calls: Counter[str] = Counter()
    mailer = {"up": True}

    @app.task(base=DurableTask, name="shop.book", autoretry_for=(ConnectionError,),
              max_retries=2)
    def book(user: str) -> str:
        with step("search") as s:
            calls["search"] += 1
            s.result = "LHR-101"
        with step("charge") as s:
            calls["charge"] += 1
            s.result = f"charged {user}"
        with step("notify") as s:
            calls["notify"] += 1
            if not mailer["up"]:
                raise ConnectionError("mailer down")
            s.result = "sent"
        return f"{user}: {s.result}"

    return book, calls, mailer


@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_every_surface_retries_alike(make_app: Callable[..., Celery], surface: str) -> None:
    """Failed run: sent as it is; succeeded run: refused as it is, accepted from a step."""
    app = make_app(eager=True)
    book, calls, mailer = shop(app)
    ask = SURFACES[surface]

    mailer["up"] = False
    failed = book.apply(args=("ann",)).id
    assert get_run(failed, app=app).status == "failed"  # type: ignore[union-attr]
    mailer["up"] = True
    calls.clear()
    assert ask(app, failed, None) is True
    assert get_run(failed, app=app).status == "succeeded"  # type: ignore[union-attr]
    assert (calls["search"], calls["charge"], calls["notify"]) == (0, 0, 1)

    calls.clear()
    assert ask(app, failed, None) is False           # succeeded: nothing to replay
    assert calls == Counter()
    view = get_run(failed, app=app)
    assert view is not None and view.status == "succeeded" and view.result == "ann: sent"

    assert ask(app, failed, "charge") is True        # from a step: it and later ones run
    assert calls == {"charge": 1, "notify": 1}
    assert get_run(failed, app=app).status == "succeeded"  # type: ignore[union-attr]


def test_retry_starts_the_retry_and_recovery_counts_over(
        make_app: Callable[..., Celery]) -> None:
    """After a retry, retries and recoveries count from 0 again; attempts go on counting."""
    app = make_app(eager=True)
    book, _calls, mailer = shop(app)
    mailer["up"] = False
    task_id = book.apply(args=("bob",)).id
    before = get_run(task_id, app=app)
    assert before is not None and (before.status, before.attempts, before.retries) == (
        "failed", 3, 2)
    # As if the sweep had used up its recoveries on this run before it failed.
    store = store_for(config_for_app(app))
    with store.engine.begin() as conn:
        conn.execute(update(store.tables.runs).where(store.tables.runs.c.task_id == task_id)
                     .values(recoveries=5))

    reset = retry_run(task_id, app=app)     # fails again: two more Celery retries
    assert (reset.retries, reset.recoveries) == (0, 0)
    after = get_run(task_id, app=app)
    assert after is not None and after.status == "failed"
    assert (after.attempts, after.retries, after.recoveries) == (6, 2, 0)

    mailer["up"] = True
    retry_run(task_id, app=app)
    done = get_run(task_id, app=app)
    assert done is not None and done.status == "succeeded"
    assert (done.attempts, done.retries, done.recoveries) == (7, 0, 0)
    assert done.step("notify").attempts == 7
