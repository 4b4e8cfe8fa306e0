"""`celery -A proj duraflow schedules ...`: list, show, pause, resume, backfill, remove.

Each command runs through Celery's own top-level click command with the test's
app object (``-A app``), on SQLite and on PostgreSQL. Schedules are added with
:func:`add_schedule` (or stored as the durable beat scheduler stores a
``beat_schedule`` entry); the library's clock is the test's, so slots fall at
known instants. What a command changed is read back from the store.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from celery import Celery
from celery.schedules import crontab

from celery_duraflow import (
    DurableTask,
    add_schedule,
    fire_schedules,
    get_run,
    get_schedule,
    list_schedules,
    next_fire_times,
    pause_schedule,
    schedule_run_id,
    wait_for_signal,
)
from celery_duraflow._config import config_for_app
from celery_duraflow._schedules import save
from celery_duraflow._store import store_for
from celery_duraflow.beat import entry_definition
from celery_duraflow.errors import ScheduleNotFound
from tests.conftest import CLOCK_START, Clock
from tests.test_admin import duraflow, failed, ok
from tests.test_schedules import schedule_app

START = CLOCK_START


def header_of(lines: list[str]) -> dict[str, str]:
    """The ``label  value`` lines at the top of `schedules show`, as a dict."""
    width = len("last slot")
    return {line[:width].strip(): line[width + 2:] for line in lines[:lines.index("")]}




@pytest.fixture
def app(make_app: Callable[..., Celery], clock: Clock) -> Celery:
    """An eager app on the test's database with a durable task that counts its bodies."""
    return schedule_app(make_app)


# -- list and show -------------------------------------------------------------------------


def test_list_shows_each_schedule_with_its_timing_policies_and_state(app: Celery) -> None:
    """`schedules` (and `schedules list`) prints one row per schedule: timing, policies,
    paused or not, next slot, counts; --json prints the stored fields."""
    add_schedule("nightly", "report", cron="0 3 * * *", timezone="Europe/Paris",
                 catchup="all", catchup_window=timedelta(hours=6), app=app)
    add_schedule("minutely", "report", every=60, overlap="buffer_one", app=app)
    pause_schedule("minutely", note="mailer down", app=app)

    for args in (("schedules",), ("schedules", "list")):
        lines = ok(duraflow(app, *args))
        assert lines[0].split() == ["NAME", "TASK", "TIMING", "CATCH-UP", "OVERLAP", "STATE",
                                    "NEXT", "(UTC)", "LAST", "SLOT", "(UTC)", "FIRED",
                                    "SKIPPED"]
        minutely, nightly = lines[1], lines[2]
        assert minutely.split()[:9] == ["minutely", "report", "every", "60", "s", "skip",
                                        "buffer_one", "paused", "-"]
        assert nightly.startswith(
            "nightly   report  cron 0 3 * * * (Europe/Paris)  all within 6h00m")
        assert " active " in nightly
        assert "2026-06-02 01:00:00" in nightly  # 03:00 in Paris, in UTC
        assert lines[-1] == "2 schedule(s), 1 paused"

    data = json.loads("\n".join(ok(duraflow(app, "schedules", "list", "--json"))))
    assert [(s["name"], s["paused"], s["note"], s["timing"]) for s in data] == [
        ("minutely", True, "mailer down", "every 60 s"),
        ("nightly", False, None, "cron 0 3 * * * (Europe/Paris)")]
    assert data[1]["next_fire_at"] == "2026-06-02T01:00:00+00:00"
    assert data[1]["catchup_window"] == 6 * 3600 and "args" not in data[1]


def test_list_of_no_schedules_says_so(app: Celery) -> None:
    """With no schedule stored, the list says so and exits 0; --json prints []."""
    assert ok(duraflow(app, "schedules")) == [
        "no schedules are stored (add one with add_schedule() or a durable entry of "
        "beat_schedule)"]
    assert json.loads("\n".join(ok(duraflow(app, "schedules", "list", "--json")))) == []


def test_show_prints_the_schedule_and_its_next_fire_times(app: Celery,
                                                          clock: Clock) -> None:
    """`schedules show` prints the definition, the last run and the next --count slots in
    UTC with the schedule's wall-clock time; a paused one has none; --json has them too."""
    add_schedule("nightly", "report", cron=crontab(minute="0", hour="3"),
                 timezone="Europe/Paris", options={"priority": 5}, app=app)
    clock.now = datetime(2026, 6, 2, 1, 0, 10, tzinfo=UTC)
    fired = fire_schedules(app).fired
    assert fired == [schedule_run_id("nightly", datetime(2026, 6, 2, 1, tzinfo=UTC))]

    lines = ok(duraflow(app, "schedules", "show", "nightly", "--count", "3"))
    header = header_of(lines)
    assert header["timing"] == "cron 0 3 * * * (Europe/Paris)"
    assert header["origin"] == "added at run time"
    assert (header["catch-up"], header["overlap"], header["state"]) == ("skip", "skip", "active")
    assert header["routing"] == "priority 5"
    assert header["last slot"] == "2026-06-02 01:00:00"
    assert header["last run"] == f"{fired[0]} (succeeded)"
    assert (header["fired"], header["skipped"]) == ("1", "0")
    upcoming = lines[lines.index("") + 1:]
    assert upcoming == [
        "next 3 fire time(s) (UTC):",
        "  2026-06-03 01:00:00  2026-06-03 03:00:00 CEST (Europe/Paris)",
        "  2026-06-04 01:00:00  2026-06-04 03:00:00 CEST (Europe/Paris)",
        "  2026-06-05 01:00:00  2026-06-05 03:00:00 CEST (Europe/Paris)"]

    data = json.loads("\n".join(ok(duraflow(app, "schedules", "show", "nightly", "--json"))))
    assert data["next_fire_times"] == [t.isoformat() for t in
                                       next_fire_times("nightly", 5, app=app)]
    assert data["last_run_id"] == fired[0] and data["last_run_status"] == "succeeded"

    pause_schedule("nightly", note="holiday", app=app)
    paused = ok(duraflow(app, "schedules", "show", "nightly"))
    assert header_of(paused)["state"] == "paused: holiday"
    assert paused[-1] == ("paused: no slot fires until it is resumed (duraflow schedules "
                          "resume nightly)")


def test_show_of_an_unknown_schedule_is_a_one_line_error(app: Celery) -> None:
    """`schedules show NAME` for a name not stored exits 1 naming it and how to list them."""
    assert failed(duraflow(app, "schedules", "show", "nope")) == (
        "error: no schedule named 'nope' is stored; list them with `celery duraflow "
        "schedules`")


# -- pause and resume ----------------------------------------------------------------------


def test_pause_and_resume_change_the_stored_schedule(app: Celery,
                                                     clock: Clock) -> None:
    """`pause --note` stops the slots from firing and keeps the note; `resume` fires again
    from the next slot after now, leaving the paused-over slots unfired."""
    add_schedule("minutely", "report", every=60, app=app)
    assert ok(duraflow(app, "schedules", "pause", "minutely", "--note", "mailer down")) == [
        "schedule 'minutely' paused: no slot fires until `duraflow schedules resume "
        "minutely`"]
    schedule = get_schedule("minutely", app=app)
    assert (schedule.paused, schedule.note) == (True, "mailer down")
    clock.now = START + timedelta(minutes=5, seconds=30)
    assert fire_schedules(app).fired == []

    again = ok(duraflow(app, "schedules", "pause", "minutely", "--note", "still down"))
    assert "(it was paused already)" in again[0]
    assert get_schedule("minutely", app=app).note == "still down"

    assert ok(duraflow(app, "schedules", "resume", "minutely")) == [
        "schedule 'minutely' resumed: its next slot is 2026-06-01 12:06:00 UTC; the slots "
        "it was paused over stay unfired (backfill them to run them)"]
    schedule = get_schedule("minutely", app=app)
    assert (schedule.paused, schedule.note) == (False, None)
    assert schedule.next_fire_at == START + timedelta(minutes=6)
    clock.now = START + timedelta(minutes=6)
    assert fire_schedules(app).fired == [
        schedule_run_id("minutely", START + timedelta(minutes=6))]

    assert ok(duraflow(app, "schedules", "resume", "minutely")) == [
        "schedule 'minutely' is not paused; nothing changed"]


def test_pause_and_resume_of_an_unknown_schedule_fail(app: Celery) -> None:
    """Pausing or resuming a name that is not stored exits 1 naming it; nothing is stored."""
    for command in ("pause", "resume"):
        assert "no schedule named 'ghost' is stored" in failed(
            duraflow(app, "schedules", command, "ghost"))
    assert list_schedules(app=app) == []


# -- backfill ------------------------------------------------------------------------------


def test_backfill_sends_the_slots_without_a_run_once(app: Celery,
                                                     clock: Clock) -> None:
    """`backfill --from --to` creates and runs one run per slot of the range, prints their
    task ids, and sends nothing the second time."""
    add_schedule("minutely", "report", every=60, args=("hourly",), app=app)
    pause_schedule("minutely", app=app)
    clock.now = START + timedelta(minutes=10, seconds=30)

    lines = ok(duraflow(app, "schedules", "backfill", "minutely",
                        "--from", "2026-06-01T12:01:00Z", "--to", "2026-06-01T14:05:00+02:00"))
    slots = [START + timedelta(minutes=n) for n in range(1, 6)]
    expected = [schedule_run_id("minutely", slot) for slot in slots]
    assert lines == [
        "schedule 'minutely' from 2026-06-01 12:01:00 to 2026-06-01 12:05:00 UTC: sent 5 "
        "run(s) for the slots that had none:", *expected]
    for task_id in expected:
        run = get_run(task_id, app=app)
        assert run is not None and (run.status, run.result) == ("succeeded", "hourly")
        assert app.conf.calls[task_id] == 1
    assert get_schedule("minutely", app=app).fired == 5

    again = ok(duraflow(app, "schedules", "backfill", "minutely",
                        "--from", "2026-06-01T12:00:00Z", "--to", "2026-06-01T12:05:00Z"))
    assert again == [
        "schedule 'minutely' from 2026-06-01 12:00:00 to 2026-06-01 12:05:00 UTC: sent 1 "
        "run(s) for the slots that had none:", schedule_run_id("minutely", START)]
    nothing = ok(duraflow(app, "schedules", "backfill", "minutely",
                          "--from", "2026-06-01T12:00:00Z", "--to", "2026-06-01T12:05:00Z"))
    assert nothing == [
        "schedule 'minutely' from 2026-06-01 12:00:00 to 2026-06-01 12:05:00 UTC: every "
        "slot had a run already (or there is none in the range); nothing was sent"]
    assert sum(app.conf.calls.values()) == 6


def test_backfill_refuses_naive_times_future_ranges_and_unknown_names(
        app: Celery, clock: Clock) -> None:
    """A time without an offset is a usage error (2); a range reaching the future or an
    unknown name exits 1 saying why; none of them creates a run."""
    add_schedule("minutely", "report", every=60, app=app)
    clock.now = START + timedelta(minutes=10)
    naive = failed(duraflow(app, "schedules", "backfill", "minutely", "--from",
                            "2026-06-01T12:01:00", "--to", "2026-06-01T12:05:00Z"), code=2)
    assert "'2026-06-01T12:01:00' has no time zone" in naive
    assert "2026-06-01T12:01:00Z" in naive
    garbled = failed(duraflow(app, "schedules", "backfill", "minutely", "--from", "yesterday",
                              "--to", "2026-06-01T12:05:00Z"), code=2)
    assert "'yesterday' is not an ISO 8601 date and time" in garbled

    future = failed(duraflow(app, "schedules", "backfill", "minutely", "--from",
                             "2026-06-01T12:01:00Z", "--to", "2026-06-01T13:00:00Z"))
    assert future.startswith("error: schedule 'minutely': the backfill's end ")
    assert "is in the future" in future
    reversed_range = failed(duraflow(app, "schedules", "backfill", "minutely", "--from",
                                     "2026-06-01T12:05:00Z", "--to", "2026-06-01T12:01:00Z"))
    assert "is before its start" in reversed_range
    unknown = failed(duraflow(app, "schedules", "backfill", "nope", "--from",
                              "2026-06-01T12:01:00Z", "--to", "2026-06-01T12:05:00Z"))
    assert "no schedule named 'nope' is stored" in unknown

    assert app.conf.calls == Counter()
    assert get_run(schedule_run_id("minutely", START + timedelta(minutes=1)), app=app) is None
    assert get_schedule("minutely", app=app).fired == 0


# -- remove --------------------------------------------------------------------------------


def test_remove_deletes_the_schedule_and_keeps_its_runs(app: Celery,
                                                        clock: Clock) -> None:
    """`remove` deletes the schedule (its runs stay); a beat_schedule one gets a note that
    beat stores it again; removing an unknown name exits 1."""
    add_schedule("minutely", "report", every=60, app=app)
    clock.now = START + timedelta(minutes=1)
    fired = fire_schedules(app).fired
    store = store_for(config_for_app(app))
    save(store, entry_definition(app, "declared", {"task": "report", "schedule": 3600}),
         origin="code")

    assert ok(duraflow(app, "schedules", "remove", "minutely")) == [
        "schedule 'minutely' removed; the runs it fired stay"]
    with pytest.raises(ScheduleNotFound):
        get_schedule("minutely", app=app)
    run = get_run(fired[0], app=app)
    assert run is not None and run.status == "succeeded"

    lines = ok(duraflow(app, "schedules", "remove", "declared"))
    assert lines[1] == ("note: 'declared' is declared in beat_schedule, so the durable beat "
                        "scheduler stores it again when it starts: remove it there too")
    assert list_schedules(app=app) == []
    assert "no schedule named 'minutely' is stored" in failed(
        duraflow(app, "schedules", "remove", "minutely"))


# -- a known bug of the library, shown through the CLI -------------------------------------


def test_show_of_a_schedule_holding_a_slot_back_lists_only_slots_that_fire(
        make_app: Callable[..., Celery], clock: Clock) -> None:
    """With overlap=buffer_one holding slot 2 back and slot 3 dropped, the next fire times
    are slot 2, then slot 4 on: never the dropped slot 3."""
    app = make_app()

    @app.task(base=DurableTask, name="approve")
    def approve() -> object:
        return wait_for_signal("go")

    add_schedule("gate", "approve", every=60, overlap="buffer_one", app=app)
    for _ in range(3):
        clock.now += timedelta(minutes=1)
        fire_schedules(app)
    schedule = get_schedule("gate", app=app)
    assert (schedule.buffered_at, schedule.next_fire_at, schedule.skipped) == (
        START + timedelta(minutes=2), START + timedelta(minutes=4), 1)
    lines = ok(duraflow(app, "schedules", "show", "gate", "--count", "3"))
    assert lines[lines.index("") + 2:] == [
        "  2026-06-01 12:02:00", "  2026-06-01 12:04:00", "  2026-06-01 12:05:00"]
