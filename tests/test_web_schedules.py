"""The web view's schedules page and its Pause, Resume and Backfill forms, through
Starlette's TestClient, on SQLite and PostgreSQL.

Schedules are added with :func:`add_schedule` on an app that publishes (not
eager), under the library's clock set by the test; what a form did is read
back from the store: the schedule's row, and the runs a backfill created.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from html import unescape
from urllib.parse import unquote

import pytest
from celery import Celery

from celery_duraflow import (
    DurableTask,
    add_schedule,
    fire_schedules,
    get_run,
    get_schedule,
    next_fire_times,
    pause_schedule,
    schedule_run_id,
    step,
)
from tests.conftest import CLOCK_START, Clock
from tests.test_schedules import nightly_fired_minutely_paused
from tests.test_web import (
    FOREIGN,
    TOKEN,
    XSS,
    client_for,
    csrf_of,
    logged_in,
    new_app,
    text_of,
)

START = CLOCK_START
PAGE = "/schedules"




@pytest.fixture
def app(make_app: Callable[..., Celery], clock: Clock) -> Celery:
    """An app on the test's database (publishing to a queue of its own) with a durable task."""
    app = new_app(make_app)

    @app.task(base=DurableTask, name="report")
    def report(kind: str = "daily") -> str:
        with step("send") as s:
            s.result = kind
        return str(s.result)

    return app


def note_of(client: object, response: object) -> str:
    """The text of the page a redirect after an action leads to."""
    location = response.headers["location"]  # type: ignore[attr-defined]
    assert location.startswith(f"{PAGE}?note="), location
    return text_of(client.get(location).text)  # type: ignore[attr-defined]


def rows_of(html: str) -> dict[str, str]:
    """Each schedule's table row, as text, by the schedule's name (its first cell)."""
    rows = re.findall(r'<tr class="schedule">(.*?)</tr>', html, re.S)
    found = {}
    for row in rows:
        first = re.search(r"<td[^>]*>(.*?)(?:<br>|</td>)", row, re.S)
        assert first is not None
        found[unescape(first.group(1)).strip()] = text_of(row)
    return found


def action_urls(html: str) -> list[str]:
    """Where the page's forms post, in page order, but for the log-out form."""
    return [unescape(url) for url in re.findall(r'<form method="post" action="([^"]+)"', html)
            if not url.endswith("/logout")]


# -- the page --------------------------------------------------------------------------------


def test_page_lists_each_schedule_with_timing_policies_next_times_and_last_run(
        app: Celery, clock: Clock) -> None:
    """The schedules page shows each schedule's timing, policies, state and note, its next
    three fire times (with a cron zone's clock time) and a link to its last run."""
    last = nightly_fired_minutely_paused(app, clock)
    client = client_for(app)

    response = client.get(PAGE)
    assert response.status_code == 200
    rows = rows_of(response.text)
    assert list(rows) == ["minutely", "nightly"]
    nightly = rows["nightly"]
    assert "cron 0 3 * * * (Europe/Paris)" in nightly
    assert "catch-up all within 6h00m overlap skip" in nightly and "active" in nightly
    upcoming = next_fire_times("nightly", 3, app=app)
    assert [t.day for t in upcoming] == [3, 4, 5]
    for moment in upcoming:
        assert f"{moment:%Y-%m-%d %H:%M:%S} {moment:%Y-%m-%d} 03:00:00 CEST (Europe/Paris)" \
            in nightly
    assert f"{last} slot 2026-06-02 01:00:00 running" in nightly
    assert f'href="/runs/{last}"' in response.text
    assert client.get(f"/runs/{last}").status_code == 200

    minutely = rows["minutely"]
    assert "every 60 s" in minutely and "overlap buffer_one" in minutely
    assert "paused mailer down" in minutely and "none while paused" in minutely
    # Every page links to it.
    assert f'href="{PAGE}"' in client.get("/").text


def test_page_without_schedules_says_how_to_add_one(app: Celery) -> None:
    """With no schedule stored the page says so, and how to add one."""
    page = text_of(client_for(app).get(PAGE).text)
    assert "No schedule is stored. Add one with add_schedule()" in page


def test_read_only_view_has_no_forms_and_refuses_every_schedule_post(
        app: Celery, clock: Clock) -> None:
    """Without a token the page has no form, each action is refused with 403, a foreign
    Host gets 400, and the schedule is left as it was."""
    add_schedule("minutely", "report", every=60, app=app)
    client = client_for(app)
    page = client.get(PAGE)
    assert page.status_code == 200 and "Read-only" in page.text
    assert 'method="post"' not in page.text and "<button" not in page.text
    clock.now = START + timedelta(minutes=5)
    for action in ("pause", "resume", "backfill"):
        refused = client.post(f"{PAGE}/minutely/{action}",
                              data={"csrf": "x", "start": "2026-06-01T12:01",
                                    "end": "2026-06-01T12:02"})
        assert refused.status_code == 403, action
        assert "read-only" in refused.text
    assert client.get(PAGE, headers={"host": FOREIGN}).status_code == 400
    schedule = get_schedule("minutely", app=app)
    assert (schedule.paused, schedule.fired) == (False, 0)
    assert get_run(schedule_run_id("minutely", START + timedelta(minutes=1)), app=app) is None


def test_with_a_token_the_page_needs_a_login_and_a_csrf_field(app: Celery) -> None:
    """With a token the page redirects to the login first; a pause without the session's
    CSRF field is refused and changes nothing."""
    add_schedule("minutely", "report", every=60, app=app)
    anonymous = client_for(app, TOKEN)
    first = anonymous.get(PAGE)
    assert first.status_code == 303 and first.headers["location"] == "/login?next=%2Fschedules"
    assert anonymous.post(f"{PAGE}/minutely/pause").status_code == 403

    client = logged_in(app)
    assert client.post(f"{PAGE}/minutely/pause", data={"note": "x"}).status_code == 403
    refused = client.post(f"{PAGE}/minutely/pause", data={"csrf": "0" * 64})
    assert refused.status_code == 403 and "CSRF" in refused.text
    assert get_schedule("minutely", app=app).paused is False


# -- the actions -----------------------------------------------------------------------------


def test_pause_and_resume_from_the_page(app: Celery, clock: Clock) -> None:
    """Pause (with a note) and Resume change the stored schedule, and the page says what was
    done; each form is offered only where it applies."""
    add_schedule("minutely", "report", every=60, app=app)
    client = logged_in(app)
    html = client.get(PAGE).text
    assert action_urls(html) == [f"{PAGE}/minutely/pause", f"{PAGE}/minutely/backfill"]
    csrf = csrf_of(html)

    paused = client.post(f"{PAGE}/minutely/pause", data={"csrf": csrf, "note": "mailer down"})
    assert paused.status_code == 303
    assert ("Paused 'minutely' (mailer down): none of its slots fires until it is resumed."
            in note_of(client, paused))
    schedule = get_schedule("minutely", app=app)
    assert (schedule.paused, schedule.note) == (True, "mailer down")
    after = client.get(PAGE).text
    assert action_urls(after) == [f"{PAGE}/minutely/resume", f"{PAGE}/minutely/backfill"]

    clock.now = START + timedelta(minutes=5, seconds=30)
    assert fire_schedules(app).fired == []
    resumed = client.post(f"{PAGE}/minutely/resume", data={"csrf": csrf})
    assert ("Resumed 'minutely': its next slot is 2026-06-01 12:06:00 UTC."
            in note_of(client, resumed))
    schedule = get_schedule("minutely", app=app)
    assert (schedule.paused, schedule.next_fire_at) == (False, START + timedelta(minutes=6))

    ghost = client.post(f"{PAGE}/ghost/pause", data={"csrf": csrf})
    assert ("No schedule named 'ghost' is stored (it may have just been removed), so nothing "
            "was paused." in note_of(client, ghost))


def test_backfill_from_the_page_creates_one_run_per_slot_once(
        app: Celery, clock: Clock) -> None:
    """Backfill creates and sends a run for each slot of the range (read as UTC), and
    nothing when repeated; the page says how many."""
    add_schedule("minutely", "report", every=60, args=("hourly",), app=app)
    clock.now = START + timedelta(minutes=10)
    client = logged_in(app)
    csrf = csrf_of(client.get(PAGE).text)

    done = client.post(f"{PAGE}/minutely/backfill",
                       data={"csrf": csrf, "start": "2026-06-01T12:01",
                             "end": "2026-06-01T12:04:00"})
    assert done.status_code == 303
    assert ("Backfill of 'minutely' from 2026-06-01 12:01:00 to 2026-06-01 12:04:00 UTC: 4 "
            "run(s) sent, one for each slot that had none." in note_of(client, done))
    for minute in range(1, 5):
        run = get_run(schedule_run_id("minutely", START + timedelta(minutes=minute)), app=app)
        assert run is not None and run.task_name == "report"
    assert get_schedule("minutely", app=app).fired == 4

    # An offset in the field is honoured: 14:04 in Paris is 12:04 UTC.
    again = client.post(f"{PAGE}/minutely/backfill",
                        data={"csrf": csrf, "start": "2026-06-01T12:02:00Z",
                              "end": "2026-06-01T14:04:00+02:00"})
    assert "nothing was sent" in note_of(client, again)
    assert get_schedule("minutely", app=app).fired == 4


def test_backfill_refusals_are_shown_and_create_nothing(app: Celery,
                                                        clock: Clock) -> None:
    """A time that does not parse is a 400 page keeping what was typed; a range reaching
    the future and an unknown schedule are notes; no run is created."""
    add_schedule("minutely", "report", every=60, app=app)
    clock.now = START + timedelta(minutes=10)
    client = logged_in(app)
    csrf = csrf_of(client.get(PAGE).text)

    bad = client.post(f"{PAGE}/minutely/backfill",
                      data={"csrf": csrf, "start": "yesterday", "end": "2026-06-01T12:04"})
    assert bad.status_code == 400
    assert ("Nothing was backfilled for 'minutely': the from time 'yesterday' is not a date "
            "and time such as 2026-06-01T00:00 (UTC)." in text_of(bad.text))
    assert 'value="yesterday"' in bad.text and 'value="2026-06-01T12:04"' in bad.text
    empty = client.post(f"{PAGE}/minutely/backfill", data={"csrf": csrf, "start": "",
                                                           "end": ""})
    assert empty.status_code == 400 and "give the from time" in text_of(empty.text)

    future = client.post(f"{PAGE}/minutely/backfill",
                         data={"csrf": csrf, "start": "2026-06-01T12:01",
                               "end": "2026-06-01T13:00"})
    message = note_of(client, future)
    assert "Not backfilled: schedule 'minutely': the backfill's end" in message
    assert "is in the future" in message
    ghost = client.post(f"{PAGE}/ghost/backfill",
                        data={"csrf": csrf, "start": "2026-06-01T12:01",
                              "end": "2026-06-01T12:02"})
    assert "No schedule named 'ghost' is stored" in note_of(client, ghost)

    assert get_schedule("minutely", app=app).fired == 0
    assert get_run(schedule_run_id("minutely", START + timedelta(minutes=1)), app=app) is None


# -- notes, escaping, odd names, the URL prefix ----------------------------------------------


def test_notes_on_the_schedules_page_must_be_signed_for_it(app: Celery) -> None:
    """A note in the address is shown only when the app signed it for the schedules page: a
    forged one, or one signed for a run's page, is not."""
    add_schedule("minutely", "report", every=60, app=app)
    client = logged_in(app)
    forged = client.get(PAGE, params={"note": "Log in again at evil.example", "tone": "ok",
                                      "sig": "0" * 64})
    assert forged.status_code == 200 and "evil.example" not in forged.text

    csrf = csrf_of(forged.text)
    location = client.post(f"{PAGE}/minutely/pause", data={"csrf": csrf}).headers["location"]
    assert "Paused 'minutely'" in text_of(client.get(location).text)
    query = location.split("?", 1)[1]
    # The same signed note moved to a run's page is not shown there.
    task_id = app.tasks["report"].apply().id
    assert "Paused 'minutely'" not in text_of(client.get(f"/runs/{task_id}?{query}").text)


def test_names_and_notes_are_escaped_and_odd_names_are_addressed(app: Celery) -> None:
    """HTML in a schedule's name or note is shown as text; a name with a slash and a question
    mark gets form addresses that reach it."""
    add_schedule(XSS, "report", every=60, app=app)
    odd = "reports/daily?x=1"
    add_schedule(odd, "report", every=3600, app=app)
    client = logged_in(app)
    csrf = csrf_of(client.get(PAGE).text)
    pause_schedule(XSS, note='<img src=x onerror="alert(2)">', app=app)

    html = client.get(PAGE).text
    assert "<script>alert" not in html and "<img src=x" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=" in html

    urls = [url for url in action_urls(html) if url.endswith("/pause")]
    assert urls == [f"{PAGE}/reports%2Fdaily%3Fx%3D1/pause"]
    assert unquote(urls[0]) == f"{PAGE}/{odd}/pause"
    paused = client.post(urls[0], data={"csrf": csrf})
    assert paused.status_code == 303
    assert get_schedule(odd, app=app).paused is True


def test_the_schedules_page_works_under_a_url_prefix(app: Celery) -> None:
    """Under url_prefix='/duraflow' the page, its link, its forms and redirects carry it."""
    add_schedule("minutely", "report", every=60, app=app)
    client = client_for(app, TOKEN, url_prefix="/duraflow")
    login = client.post("/duraflow/login", data={"token": TOKEN, "next": "/duraflow/schedules"})
    assert login.headers["location"] == "/duraflow/schedules"
    page = client.get("/duraflow/schedules")
    assert page.status_code == 200 and 'href="/duraflow/schedules"' in page.text
    assert action_urls(page.text)[0] == "/duraflow/schedules/minutely/pause"
    assert 'action="/duraflow/logout"' in page.text
    paused = client.post("/duraflow/schedules/minutely/pause", data={"csrf": csrf_of(page.text)})
    assert paused.headers["location"].startswith("/duraflow/schedules?note=")
    assert get_schedule("minutely", app=app).paused is True
    assert client.get(PAGE).status_code == 404
