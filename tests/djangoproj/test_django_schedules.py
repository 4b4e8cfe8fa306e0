"""The Django admin of durable schedules, through Django's test client, on the test
project's databases (PostgreSQL ``default`` and SQLite ``lite``).

Schedules are added with :func:`add_schedule` on a Celery app whose store is the
database pytest-django created for the alias, under the library's clock set by
the test. The admin's actions must go through the library (pause_schedule,
resume_schedule, backfill_schedule): what they did is read back from the store.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from html import unescape
from typing import Any

import pytest
from celery import Celery
from django.contrib.admin.models import LogEntry
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Permission
from sqlalchemy import delete

from celery_duraflow import (
    DurableTask,
    add_schedule,
    get_run,
    get_schedule,
    pause_schedule,
    schedule_run_id,
    step,
)
from celery_duraflow._config import config_for_app
from celery_duraflow._store import store_for
from celery_duraflow.contrib.django import conf
from celery_duraflow.contrib.django.models import Schedule
from tests.conftest import CLOCK_START, Clock
from tests.djangoproj.test_django_admin import app_on, client_with, messages_of, text_of
from tests.test_schedules import nightly_fired_minutely_paused

pytestmark = pytest.mark.django_db(databases=["default", "lite"], transaction=True)

SCHEDULES = "/admin/duraflow/schedule/"
START = CLOCK_START


def schedule_url(name: str) -> str:
    return f"{SCHEDULES}{quote(name)}/change/"


def listed(html: str) -> list[str]:
    """The schedule names the list shows, in page order."""
    return [unescape(found) for found in
            re.findall(r'href="/admin/duraflow/schedule/([^/"]+)/change/[^"]*"', html)]




@pytest.fixture(params=["default", "lite"])
def app(request: pytest.FixtureRequest, settings: Any, clock: Clock) -> Iterator[Celery]:
    """A Celery app on the alias's test database (PostgreSQL, then SQLite), named to the
    admin, with a durable task; the store's schedules are deleted before and after."""
    for celery_app in app_on(str(request.param), settings):
        clear_schedules(celery_app)

        @celery_app.task(base=DurableTask, name="report")
        def report(kind: str = "daily") -> str:
            with step("send") as s:
                s.result = kind
            return str(s.result)

        yield celery_app
        clear_schedules(celery_app)


def clear_schedules(app: Celery) -> None:
    """Delete every schedule: the table outlives each test (Django's flush leaves unmanaged
    tables alone)."""
    store = store_for(config_for_app(app))
    with store.engine.begin() as conn:
        conn.execute(delete(store.tables.schedules))


def act(client: Any, action: str, names: list[str], **data: Any) -> Any:
    """Post admin action ``action`` on the schedules ``names`` of the list."""
    return client.post(SCHEDULES, {"action": action, "_selected_action": names, **data},
                       follow=True)


# -- reading ---------------------------------------------------------------------------------


def test_list_and_page_show_timing_policies_state_and_next_fire_times(
        app: Celery, clock: Clock) -> None:
    """The list shows each schedule's timing, policies, state and next slot; a schedule's
    page adds its next five fire times and links its last run."""
    last = nightly_fired_minutely_paused(app, clock)
    client = client_with("view_schedule", "view_run")

    html = client.get(SCHEDULES).content.decode()
    assert listed(html) == ["minutely", "nightly"]
    page = text_of(html)
    assert "cron 0 3 * * * (Europe/Paris)" in page
    assert "catch-up all within 6h00m, overlap skip" in page
    assert "catch-up skip, overlap buffer_one" in page
    assert "paused: mailer down" in page and "- (paused)" in page
    assert "2026-06-03 01:00:00 UTC" in page  # nightly's next slot: 03:00 in Paris
    assert f'href="/admin/duraflow/run/{quote(last)}/change/"' in html

    detail = client.get(schedule_url("nightly"))
    assert detail.status_code == 200
    shown = text_of(detail.content.decode())
    for day in range(3, 8):
        assert (f"2026-06-0{day} 01:00:00 UTC (2026-06-0{day} 03:00:00 CEST (Europe/Paris))"
                in shown)
    assert "2026-06-08" not in shown
    assert f"{last}" in shown and "2026-06-02 01:00:00 UTC" in shown
    assert 'name="_save"' not in detail.content.decode()
    assert "none while it is paused" in text_of(
        client.get(schedule_url("minutely")).content.decode())


def test_schedules_need_the_view_permission_and_cannot_be_written(app: Celery) -> None:
    """Staff without view_schedule get 403; nobody can add, change or delete a schedule in
    the admin or through the model, and the only permissions are view, pause and backfill."""
    add_schedule("minutely", "report", every=60, app=app)
    assert client_with("view_run").get(SCHEDULES).status_code == 403
    assert client_with("view_run").get(schedule_url("minutely")).status_code == 403

    client = client_with("view_schedule", "pause_schedule", "backfill_schedule")
    assert client.get(f"{SCHEDULES}add/").status_code == 403
    assert client.post(schedule_url("minutely"), {"task_name": "x"}).status_code == 403
    assert client.post(f"{SCHEDULES}{quote('minutely')}/delete/",
                       {"post": "yes"}).status_code == 403
    listing = client.get(SCHEDULES).content.decode()
    assert 'value="delete_selected"' not in listing and "Add schedule" not in listing

    row = Schedule.objects.using(conf.store_alias()).get(name="minutely")
    with pytest.raises(TypeError, match="written by celery-duraflow only"):
        row.save(using=conf.store_alias())
    with pytest.raises(TypeError, match="remove_schedule"):
        row.delete(using=conf.store_alias())
    with pytest.raises(TypeError, match="written by the library only"):
        Schedule.objects.using(conf.store_alias()).filter(name="minutely").update(paused=True)
    assert get_schedule("minutely", app=app).paused is False
    codenames = set(Permission.objects.filter(content_type__model="schedule")
                    .values_list("codename", flat=True))
    assert codenames == {"view_schedule", "pause_schedule", "backfill_schedule"}


# -- pause and resume ------------------------------------------------------------------------


def test_pause_and_resume_actions_change_the_stored_schedules(
        app: Celery, clock: Clock) -> None:
    """The pause and resume actions go through the library: the rows change, each is logged,
    and a schedule already in that state is said to be and left alone."""
    add_schedule("minutely", "report", every=60, app=app)
    add_schedule("hourly", "report", every=3600, app=app)
    pause_schedule("hourly", note="kept", app=app)
    client = client_with("view_schedule", "pause_schedule")
    listing = client.get(SCHEDULES).content.decode()
    assert 'value="pause_schedules"' in listing and 'value="backfill_schedules"' not in listing

    paused = messages_of(act(client, "pause_schedules", ["minutely", "hourly"]).content.decode())
    assert "Paused (none of their slots fires until they are resumed): minutely." in paused
    assert "Schedule 'hourly' was paused already: nothing changed." in paused
    assert get_schedule("minutely", app=app).paused is True
    assert get_schedule("hourly", app=app).note == "kept"
    assert LogEntry.objects.get(object_id="minutely").get_change_message() == "Paused"

    clock.now = START + timedelta(minutes=5, seconds=30)
    resumed = messages_of(act(client, "resume_schedules", ["minutely"]).content.decode())
    assert "Resumed (each fires from its next slot after now" in resumed
    schedule = get_schedule("minutely", app=app)
    assert (schedule.paused, schedule.next_fire_at) == (False, START + timedelta(minutes=6))
    again = messages_of(act(client, "resume_schedules", ["minutely"]).content.decode())
    assert "Schedule 'minutely' was not paused: nothing changed." in again


def test_actions_without_their_permission_change_nothing(app: Celery,
                                                         clock: Clock) -> None:
    """Without pause_schedule or backfill_schedule the actions are not offered and a posted
    one does nothing."""
    add_schedule("minutely", "report", every=60, app=app)
    clock.now = START + timedelta(minutes=10)
    viewer = client_with("view_schedule")
    assert 'name="action"' not in viewer.get(SCHEDULES).content.decode()
    for action in ("pause_schedules", "resume_schedules", "backfill_schedules"):
        response = act(viewer, action, ["minutely"], apply="1",
                       start="2026-06-01 12:01:00", end="2026-06-01 12:05:00")
        assert response.status_code == 200, action
    pauser = client_with("view_schedule", "pause_schedule")
    refused = act(pauser, "backfill_schedules", ["minutely"], apply="1",
                  start="2026-06-01 12:01:00", end="2026-06-01 12:05:00")
    assert "No action selected." in messages_of(refused.content.decode())

    schedule = get_schedule("minutely", app=app)
    assert (schedule.paused, schedule.fired) == (False, 0)
    assert get_run(schedule_run_id("minutely", START + timedelta(minutes=1)), app=app) is None
    assert not LogEntry.objects.exists()


# -- backfill --------------------------------------------------------------------------------


def test_backfill_asks_for_the_range_then_creates_one_run_per_slot(
        app: Celery, clock: Clock) -> None:
    """The backfill action first shows a form for the range; posted, it creates and sends
    one run per slot without one, says how many, and logs it; again, nothing."""
    add_schedule("minutely", "report", every=60, args=("hourly",), app=app)
    pause_schedule("minutely", app=app)
    clock.now = START + timedelta(minutes=10)
    client = client_with("view_schedule", "backfill_schedule")

    form = act(client, "backfill_schedules", ["minutely"])
    assert form.status_code == 200
    html = form.content.decode()
    assert "Backfill schedules" in html and 'name="start"' in html and 'name="end"' in html
    assert 'name="_selected_action" value="minutely"' in html
    assert "minutely : report, every 60 s" in text_of(html)
    assert 'name="action" value="backfill_schedules"' in html and "csrfmiddlewaretoken" in html

    done = act(client, "backfill_schedules", ["minutely"], apply="Backfill",
               start="2026-06-01 12:01:00", end="2026-06-01T12:04:00Z")
    assert done.redirect_chain == [(SCHEDULES, 302)]
    said = messages_of(done.content.decode())
    assert ("Backfilled schedule 'minutely' from 2026-06-01 12:01:00 UTC to 2026-06-01 "
            "12:04:00 UTC: 4 run(s) sent, one for each slot that had none." in said)
    for minute in range(1, 5):
        run = get_run(schedule_run_id("minutely", START + timedelta(minutes=minute)), app=app)
        assert run is not None and run.task_name == "report"
    assert get_schedule("minutely", app=app).fired == 4
    assert "4 run(s) sent" in LogEntry.objects.get(object_id="minutely").get_change_message()

    again = act(client, "backfill_schedules", ["minutely"], apply="Backfill",
                start="2026-06-01 12:01:00", end="2026-06-01 12:04:00")
    assert "every slot had a run already" in messages_of(again.content.decode())
    assert get_schedule("minutely", app=app).fired == 4


def test_backfill_refusals_are_shown_and_create_nothing(app: Celery,
                                                        clock: Clock) -> None:
    """A range that is reversed or does not parse shows the form again with the error; one
    reaching the future is the library's refusal, as a message; no run is created."""
    add_schedule("minutely", "report", every=60, app=app)
    clock.now = START + timedelta(minutes=10)
    client = client_with("view_schedule", "backfill_schedule")

    reversed_range = act(client, "backfill_schedules", ["minutely"], apply="Backfill",
                         start="2026-06-01 12:05:00", end="2026-06-01 12:01:00")
    assert reversed_range.redirect_chain == []
    assert "&#x27;To&#x27; is before &#x27;From&#x27;" in reversed_range.content.decode()
    garbled = act(client, "backfill_schedules", ["minutely"], apply="Backfill",
                  start="yesterday", end="2026-06-01 12:01:00")
    assert garbled.redirect_chain == [] and "Enter a valid date/time." in text_of(
        garbled.content.decode())

    future = act(client, "backfill_schedules", ["minutely"], apply="Backfill",
                 start="2026-06-01 12:01:00", end="2026-06-01 13:00:00")
    said = messages_of(future.content.decode())
    assert "Backfill of schedule 'minutely' refused: schedule 'minutely': the backfill's end" \
        in said and "is in the future" in said

    assert get_schedule("minutely", app=app).fired == 0
    assert get_run(schedule_run_id("minutely", START + timedelta(minutes=1)), app=app) is None
