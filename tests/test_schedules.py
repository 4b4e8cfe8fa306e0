"""Durable schedules: slots fire once, the policies decide late and overlapping slots.

Time is the library's clock, set by each test (``_clock.use``), so a day of slots
passes in milliseconds; the runs are real runs of an eager app on SQLite and on
PostgreSQL, and the side effects are counted in the task bodies.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab

from celery_duraflow import (
    DurableTask,
    InvalidSchedule,
    ScheduleNotFound,
    add_schedule,
    backfill_schedule,
    fire_schedules,
    get_run,
    get_schedule,
    list_schedules,
    next_fire_times,
    pause_schedule,
    remove_schedule,
    resume_schedule,
    schedule_run_id,
    send_signal,
    step,
    wait_for_signal,
)
from celery_duraflow._config import config_for_app
from celery_duraflow._schedule_spec import Cron, Every, due_slots, next_fires, slots, time_zone
from celery_duraflow._store import store_for
from tests.conftest import CLOCK_START, Clock

NEW_YORK = "America/New_York"
START = CLOCK_START






def schedule_app(make_app: Callable[..., Celery], **conf: Any) -> Celery:
    """An app on the test's database (eager unless ``conf`` says otherwise) with a durable
    task ``report`` that counts its bodies in ``app.conf.calls``, a durable ``approve`` that
    waits for the signal ``go``, and a plain task ``plain``."""
    app = make_app(**conf)
    app.conf.calls = Counter()

    @app.task(base=DurableTask, name="report")
    def report(kind: str = "daily") -> str:
        with step("send") as s:
            app.conf.calls[report.request.id] += 1
            s.result = kind
        return str(s.result)

    @app.task(base=DurableTask, name="approve")
    def approve() -> Any:
        app.conf.calls[approve.request.id] += 1
        return wait_for_signal("go")

    @app.task(name="plain")
    def plain() -> None:
        return None

    return app


@pytest.fixture
def app(make_app: Callable[..., Celery]) -> Celery:
    """An eager app of :func:`schedule_app` on the test's database."""
    return schedule_app(make_app)


def nightly_fired_minutely_paused(app: Celery, clock: Clock) -> str:
    """A cron schedule in Paris that fired its 03:00 slot, and a paused interval schedule
    beside it: the task id of the fired run."""
    add_schedule("nightly", "report", cron="0 3 * * *", timezone="Europe/Paris",
                 catchup="all", catchup_window=timedelta(hours=6), app=app)
    add_schedule("minutely", "report", every=60, overlap="buffer_one", app=app)
    clock.now = datetime(2026, 6, 2, 1, 0, 5, tzinfo=UTC)
    last = schedule_run_id("nightly", datetime(2026, 6, 2, 1, tzinfo=UTC))
    assert last in fire_schedules(app).fired
    pause_schedule("minutely", note="mailer down", app=app)
    return last


def _walls(slots: list[datetime]) -> list[str]:
    tz = time_zone(NEW_YORK)
    return [slot.astimezone(tz).strftime("%m-%d %H:%M %Z") for slot in slots]


# -- when slots fall ---------------------------------------------------------------------


def test_a_skipped_local_time_fires_once_at_the_jump() -> None:
    """On the night clocks go from 02:00 to 03:00, a 02:30 slot fires at 03:00, once."""
    daily = Cron.parse("30 2 * * *", NEW_YORK)
    slots = next_fires(daily, datetime(2026, 3, 7, 12, tzinfo=UTC), 3)
    assert _walls(slots) == ["03-08 03:00 EDT", "03-09 02:30 EDT", "03-10 02:30 EDT"]
    quarter = Cron.parse("*/15 * * * *", NEW_YORK)
    slots = next_fires(quarter, datetime(2026, 3, 8, 6, 40, tzinfo=UTC), 4)
    assert _walls(slots) == ["03-08 01:45 EST", "03-08 03:00 EDT", "03-08 03:15 EDT",
                             "03-08 03:30 EDT"]


def test_a_repeated_local_time_fires_once_at_its_first_occurrence() -> None:
    """On the night clocks go back from 02:00 to 01:00, 01:30 fires in EDT only, and the
    slots of the repeated hour do not fire again in EST."""
    daily = Cron.parse("30 1 * * *", NEW_YORK)
    slots = next_fires(daily, datetime(2026, 10, 31, 12, tzinfo=UTC), 2)
    assert _walls(slots) == ["11-01 01:30 EDT", "11-02 01:30 EST"]
    twenty = Cron.parse("*/20 * * * *", NEW_YORK)
    slots = next_fires(twenty, datetime(2026, 11, 1, 4, 50, tzinfo=UTC), 5)
    assert _walls(slots) == ["11-01 01:00 EDT", "11-01 01:20 EDT", "11-01 01:40 EDT",
                             "11-01 02:00 EST", "11-01 02:20 EST"]


def test_the_dst_nights_through_the_store(app: Celery, clock: Clock) -> None:
    """A schedule every 30 minutes in New York fired by a pass every five minutes across
    both changes of 2026: one run per distinct instant, none twice, none missed."""
    counts = []
    for night in (datetime(2026, 3, 8, 4, tzinfo=UTC), datetime(2026, 11, 1, 3, tzinfo=UTC)):
        name = f"half-hourly-{night.month}"
        clock.to(night)
        add_schedule(name, "report", cron="*/30 * * * *", timezone=NEW_YORK, app=app)
        fired: list[str] = []
        while clock.now < night + timedelta(hours=6):
            clock.advance(minutes=5)
            fired += fire_schedules(app).fired
        remove_schedule(name, app=app)
        assert all(app.conf.calls[task_id] == 1 for task_id in fired)
        expected = slots(Cron.parse("*/30 * * * *", NEW_YORK), night + timedelta(seconds=1),
                         night + timedelta(hours=6), 100)
        assert fired == [schedule_run_id(name, slot) for slot in expected]
        counts.append(_walls(expected))
    spring, autumn = counts
    # Spring: 02:00 and 02:30 do not exist (they fall at 03:00 EDT): the 12 half-hours
    # of UTC are 12 slots, none of them at 02:xx.
    assert len(spring) == 12 and "03-08 03:00 EDT" in spring
    assert not any(" 02:" in wall for wall in spring)
    # Autumn: 01:00 and 01:30 fire in EDT only, not again in EST: 10 of 12 half-hours.
    assert len(autumn) == 10 and "11-01 01:30 EDT" in autumn
    assert "11-01 01:30 EST" not in autumn and "11-01 01:00 EST" not in autumn


# -- exactly once ------------------------------------------------------------------------


def test_each_slot_fires_once_however_often_the_pass_runs(app: Celery, clock: Clock) -> None:
    """Passes repeated at the same moment fire nothing again; each slot's body runs once."""
    add_schedule("minutely", "report", every=60, args=("hourly",), app=app)
    assert get_schedule("minutely", app=app).next_fire_at == START + timedelta(minutes=1)
    fired: list[str] = []
    for _ in range(5):
        clock.advance(seconds=30)
        for _ in range(3):
            fired += fire_schedules(app).fired
    slots = [START + timedelta(minutes=n) for n in (1, 2)]
    assert fired == [schedule_run_id("minutely", slot) for slot in slots]
    assert [app.conf.calls[task_id] for task_id in fired] == [1, 1]
    assert get_run(fired[0], app=app).result == "hourly"  # type: ignore[union-attr]
    schedule = get_schedule("minutely", app=app)
    assert (schedule.fired, schedule.last_slot_at) == (2, slots[-1])
    assert schedule.next_fire_at == START + timedelta(minutes=3)


def test_next_fire_times_follow_the_definition(app: Celery, clock: Clock) -> None:
    """The next slots of a cron schedule in its zone, and none while it is paused."""
    add_schedule("nightly", "report", cron=crontab(minute="0", hour="3"), timezone="Europe/Paris",
                 app=app)
    times = next_fire_times("nightly", 3, app=app)
    assert [t.astimezone(time_zone("Europe/Paris")).hour for t in times] == [3, 3, 3]
    assert times[0] == datetime(2026, 6, 2, 1, 0, tzinfo=UTC)
    pause_schedule("nightly", note="maintenance", app=app)
    assert next_fire_times("nightly", 3, app=app) == []
    assert get_schedule("nightly", app=app).note == "maintenance"


# -- catch-up ----------------------------------------------------------------------------


@pytest.mark.parametrize(("catchup", "window", "hours"), [
    ("skip", None, []),
    ("latest", None, [5]),
    ("all", timedelta(hours=3, minutes=1), [3, 4, 5]),
])
def test_catch_up_after_downtime(app: Celery, clock: Clock, catchup: str,
                                 window: timedelta | None, hours: list[int]) -> None:
    """An hourly schedule whose schedulers were down five and a half hours: skip fires
    none of the missed slots, latest the newest, all those within the window."""
    add_schedule("hourly", "report", every=3600, catchup=catchup, catchup_window=window,
                 overlap="allow_all", app=app)
    clock.advance(hours=5, minutes=30)
    fired = fire_schedules(app).fired
    assert fired == [schedule_run_id("hourly", START + timedelta(hours=h)) for h in hours]
    schedule = get_schedule("hourly", app=app)
    assert schedule.skipped == 5 - len(hours)
    assert schedule.next_fire_at == START + timedelta(hours=6)


def test_a_slot_less_than_a_minute_late_is_on_time(app: Celery, clock: Clock) -> None:
    """With catchup=skip, a scheduler that was away 50 seconds still fires the slot."""
    add_schedule("hourly", "report", every=3600, app=app)
    clock.advance(hours=1, seconds=50)
    assert fire_schedules(app).fired == [schedule_run_id("hourly", START + timedelta(hours=1))]


def test_due_slots_fire_at_most_a_pass_limit_at_once() -> None:
    """A day of missed one-second slots under catchup=all fires in passes of the limit."""
    every = Every.make(1)
    due = due_slots(every, START, START + timedelta(days=1), catchup="all",
                    window=timedelta(days=2), limit=500)
    assert len(due.fire) == 500 and due.next_fire_at == START + timedelta(seconds=500)


# -- overlap -----------------------------------------------------------------------------


def _open_then(app: Celery, clock: Clock, overlap: str) -> tuple[list[str], list[str]]:
    """Fire slot 1 (a run waiting for a signal), then slots 2 and 3 while it waits."""
    add_schedule("gate", "approve", every=60, overlap=overlap, app=app)
    clock.advance(minutes=1)
    first = fire_schedules(app).fired
    assert get_run(first[0], app=app).status == "waiting"  # type: ignore[union-attr]
    clock.advance(minutes=1)
    later = fire_schedules(app).fired
    clock.advance(minutes=1)
    later += fire_schedules(app).fired
    return first, later


def _slot(n: int) -> str:
    return schedule_run_id("gate", START + timedelta(minutes=n))


def test_overlap_skip_fires_nothing_while_a_run_is_open(app: Celery, clock: Clock) -> None:
    """overlap=skip: slots 2 and 3 are skipped while slot 1's run waits; slot 4 fires."""
    first, later = _open_then(app, clock, "skip")
    assert later == []
    send_signal(first[0], "go", app=app)
    assert get_run(first[0], app=app).status == "succeeded"  # type: ignore[union-attr]
    clock.advance(minutes=1)
    assert fire_schedules(app).fired == [_slot(4)]
    assert get_schedule("gate", app=app).skipped == 2


def test_overlap_buffer_one_fires_one_kept_slot_after_the_run_ends(
        app: Celery, clock: Clock) -> None:
    """overlap=buffer_one: slot 2 is kept back, slot 3 dropped; slot 2 fires once slot 1's
    run has ended."""
    first, later = _open_then(app, clock, "buffer_one")
    assert later == []
    assert get_schedule("gate", app=app).buffered_at == START + timedelta(minutes=2)
    send_signal(first[0], "go", app=app)
    assert fire_schedules(app).fired == [_slot(2)]
    assert fire_schedules(app).fired == []
    assert get_schedule("gate", app=app).skipped == 1


def test_overlap_allow_all_fires_every_slot(app: Celery, clock: Clock) -> None:
    """overlap=allow_all: slots 2 and 3 fire beside the waiting run of slot 1."""
    _first, later = _open_then(app, clock, "allow_all")
    assert later == [_slot(2), _slot(3)]


def test_overlap_cancel_other_cancels_the_open_run(app: Celery, clock: Clock) -> None:
    """overlap=cancel_other: slot 2 cancels slot 1's waiting run and fires; the cancelled
    run's body did not run again."""
    first, later = _open_then(app, clock, "cancel_other")
    assert later == [_slot(2), _slot(3)]
    assert get_run(first[0], app=app).status == "cancelled"  # type: ignore[union-attr]
    assert get_run(later[0], app=app).status == "cancelled"  # type: ignore[union-attr]
    assert get_run(later[1], app=app).status == "waiting"  # type: ignore[union-attr]


# -- pause, resume, backfill ---------------------------------------------------------------


def test_pause_resume_and_backfill(app: Celery, clock: Clock) -> None:
    """A paused schedule fires nothing; resumed, it fires from its next slot; a backfill
    fires the slots it missed once, and again nothing."""
    add_schedule("minutely", "report", every=60, app=app)
    pause_schedule("minutely", app=app)
    clock.advance(minutes=10, seconds=30)
    assert fire_schedules(app).fired == []
    resumed = resume_schedule("minutely", app=app)
    assert resumed.next_fire_at == START + timedelta(minutes=11)
    assert fire_schedules(app).fired == []
    backfilled = backfill_schedule("minutely", START + timedelta(minutes=1),
                                   START + timedelta(minutes=10), app=app)
    assert backfilled == [schedule_run_id("minutely", START + timedelta(minutes=n))
                          for n in range(1, 11)]
    assert all(app.conf.calls[task_id] == 1 for task_id in backfilled)
    again = backfill_schedule("minutely", START, START + timedelta(minutes=10), app=app)
    assert again == [schedule_run_id("minutely", START)]  # the one slot not fired before
    with pytest.raises(InvalidSchedule, match="in the future"):
        backfill_schedule("minutely", START, START + timedelta(hours=1), app=app)
    with pytest.raises(ScheduleNotFound, match="nope"):
        backfill_schedule("nope", START, START, app=app)


# -- bad input fails closed ----------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"task": "report", "cron": "61 * * * *"}, "does not parse"),
    ({"task": "report", "cron": "0 3 * *"}, "five fields"),
    ({"task": "report", "cron": "0 0 31 2 *"}, "never occurs"),
    ({"task": "report", "cron": "0 3 * * *", "timezone": "Mars/Olympus"}, "unknown here"),
    ({"task": "plain", "every": 60}, "not a durable task"),
    ({"task": "nowhere", "every": 60}, "not registered"),
    ({"task": "report", "every": 60, "args": (object(),)}, "cannot be stored"),
    ({"task": "report", "every": 0.5}, "shorter than"),
    ({"task": "report"}, "exactly one of"),
    ({"task": "report", "every": 60, "cron": "* * * * *"}, "exactly one of"),
    ({"task": "report", "every": 60, "catchup": "some"}, "catchup='some'"),
    ({"task": "report", "every": 60, "overlap": "queue"}, "overlap='queue'"),
    ({"task": "report", "every": 60, "catchup_window": 60}, "bounds catchup='all'"),
    ({"task": "report", "every": 60, "options": {"expires": 10}}, "expires"),
    ({"task": "report", "every": 60, "timezone": NEW_YORK}, "belongs to cron"),
])
def test_a_bad_definition_is_refused_and_nothing_stored(
        app: Celery, clock: Clock, kwargs: dict[str, Any], message: str) -> None:
    """Each bad part of a definition raises InvalidSchedule naming the schedule and the
    fix, and stores no row."""
    kwargs = dict(kwargs)
    task = kwargs.pop("task")
    with pytest.raises(InvalidSchedule, match=message) as raised:
        add_schedule("bad", task, app=app, **kwargs)
    assert raised.value.schedule == "bad" and "'bad'" in str(raised.value)
    assert list_schedules(app=app) == []


def test_adding_again_changes_the_schedule_and_keeps_its_pause(
        app: Celery, clock: Clock) -> None:
    """Adding a name again updates its definition; a paused schedule stays paused."""
    add_schedule("report", "report", every=60, app=app)
    pause_schedule("report", app=app)
    changed = add_schedule("report", "report", every=120, kwargs={"kind": "weekly"}, app=app)
    assert (changed.every, changed.paused) == (120.0, True)
    assert remove_schedule("report", app=app) is True
    assert remove_schedule("report", app=app) is False
    with pytest.raises(ScheduleNotFound):
        get_schedule("report", app=app)


def test_a_schedule_that_cannot_be_fired_faithfully_waits_and_the_others_fire(
        app: Celery, make_app: Callable[..., Celery], clock: Clock) -> None:
    """A scheduler whose app does not know the task as durable, or a stored time zone this
    host does not know, leaves that schedule unfired and due (no run row), names it, and
    fires the others; the right app fires the waiting slot afterwards."""
    add_schedule("durable", "report", every=60, app=app)
    add_schedule("zoned", "report", cron="* * * * *", timezone=NEW_YORK, app=app)
    store = store_for(config_for_app(app))
    with store.transaction("a row written by a host with other time zones") as conn:
        conn.execute(store.tables.schedules.update()
                     .where(store.tables.schedules.c.name == "zoned")
                     .values(timezone="Atlantis/Capital"))
    elsewhere = make_app()

    @elsewhere.task(name="report")
    def report() -> None:
        return None

    clock.advance(minutes=1)
    fired = fire_schedules(elsewhere)
    assert fired.fired == []
    assert "not registered in this app as a durable task" in fired.broken["durable"]
    assert "Atlantis/Capital" in fired.broken["zoned"]
    assert get_run(schedule_run_id("durable", START + timedelta(minutes=1)), app=app) is None
    assert fire_schedules(app).fired == [schedule_run_id("durable",
                                                         START + timedelta(minutes=1))]
    assert list(fire_schedules(app).broken) == ["zoned"]
