"""The Celery beat scheduler of durable schedules, and firing from many processes at once.

``DurableScheduler`` is built the way ``celery beat -S`` builds it, on SQLite and
PostgreSQL; the concurrent passes run in threads, each with its own connections,
against one store; a slot whose message never left is sent by the recovery sweep.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab, schedule

from celery_duraflow import (
    DurableTask,
    InvalidSchedule,
    add_schedule,
    fire_schedules,
    get_run,
    get_schedule,
    list_schedules,
    pause_schedule,
    recover,
    recovery_beat_entry,
    schedule_run_id,
    step,
)
from celery_duraflow import _schedules as schedules_module
from celery_duraflow.beat import STORE_POLL, DurableScheduler
from tests.conftest import Clock
from tests.test_schedules import START

pytestmark = pytest.mark.filterwarnings("ignore::celery.exceptions.CPendingDeprecationWarning")




def _app(make_app: Callable[..., Celery], **conf: Any) -> Celery:
    app = make_app(**conf)
    app.conf.calls = Counter()

    @app.task(base=DurableTask, name="digest")
    def digest(kind: str = "daily") -> str:
        with step("send"):
            app.conf.calls[digest.request.id] += 1
        return kind

    @app.task(name="plain.cleanup")
    def cleanup() -> None:
        return None

    return app


def _scheduler(app: Celery, beat_schedule: dict[str, Any],
               max_interval: float = 5) -> DurableScheduler:
    app.conf.beat_schedule = beat_schedule
    return DurableScheduler(app=app, max_interval=max_interval)


def test_beat_schedule_entries_of_durable_tasks_become_stored_schedules(
        make_app: Callable[..., Celery], clock: Clock) -> None:
    """Durable entries are stored (a crontab in the app's time zone, an interval, a
    schedule object); the recovery sweep's entry stays a plain in-memory entry."""
    app = _app(make_app, timezone="Europe/Paris")
    scheduler = _scheduler(app, {
        "nightly": {"task": "digest", "schedule": crontab(minute="0", hour="3"),
                    "kwargs": {"kind": "nightly"}, "options": {"queue": "reports"}},
        "minutely": {"task": "digest", "schedule": 60.0, "catchup": "latest",
                     "overlap": "allow_all"},
        "hourly": {"task": "digest", "schedule": schedule(timedelta(hours=1))},
        "sweep": recovery_beat_entry(),
    })
    stored = {s.name: s for s in list_schedules(app=app)}
    assert set(stored) == {"nightly", "minutely", "hourly"}
    assert (stored["nightly"].cron, stored["nightly"].timezone) == ("0 3 * * *", "Europe/Paris")
    assert stored["nightly"].routing_key == "reports"
    assert (stored["minutely"].every, stored["minutely"].catchup,
            stored["minutely"].overlap) == (60.0, "latest", "allow_all")
    assert stored["hourly"].every == 3600.0
    assert {s.origin for s in stored.values()} == {"code"}
    assert "sweep" in scheduler.schedule and "nightly" not in scheduler.schedule


def test_a_plain_task_in_beat_schedule_stops_the_scheduler_before_anything_is_stored(
        make_app: Callable[..., Celery], clock: Clock) -> None:
    """An entry of a task that is not durable is refused with the entry's name, and the
    durable entries beside it are not stored either."""
    app = _app(make_app)
    with pytest.raises(InvalidSchedule, match=r"'cleanup'.*plain\.cleanup.*not a durable task"):
        _scheduler(app, {"minutely": {"task": "digest", "schedule": 60.0},
                         "cleanup": {"task": "plain.cleanup", "schedule": 60.0}})
    assert list_schedules(app=app) == []


@pytest.mark.parametrize(("entry", "message"), [
    ({"task": "digest", "schedule": 60.0, "relative": True}, "relative=True"),
    ({"task": "digest", "schedule": 60.0, "every": 5}, "do.* not know: every"),
    ({"task": "digest", "schedule": "daily"}, "is not a crontab"),
    ({"task": "digest", "schedule": crontab(minute="0"), "timezone": "Nowhere/Land"},
     "unknown here"),
])
def test_a_bad_durable_entry_is_refused(make_app: Callable[..., Celery], clock: Clock,
                                        entry: dict[str, Any], message: str) -> None:
    """A durable entry the store cannot keep faithfully is refused, naming it."""
    app = _app(make_app)
    with pytest.raises(InvalidSchedule, match=message):
        _scheduler(app, {"bad": entry})
    assert list_schedules(app=app) == []


def test_a_restart_keeps_the_state_updates_changes_and_drops_removed_entries(
        make_app: Callable[..., Celery], clock: Clock) -> None:
    """Started again with a changed beat_schedule, the scheduler keeps a paused schedule
    paused, updates a changed entry and removes one no longer declared; a schedule added
    at run time stays, and an entry may not take its name."""
    app = _app(make_app)
    _scheduler(app, {"a": {"task": "digest", "schedule": 60.0},
                     "b": {"task": "digest", "schedule": 60.0}})
    pause_schedule("a", app=app)
    add_schedule("runtime", "digest", every=120, app=app)
    _scheduler(app, {"a": {"task": "digest", "schedule": 30.0}})
    stored = {s.name: s for s in list_schedules(app=app)}
    assert set(stored) == {"a", "runtime"}
    assert (stored["a"].every, stored["a"].paused) == (30.0, True)
    with pytest.raises(InvalidSchedule, match="'runtime' exists already, added at run time"):
        _scheduler(app, {"runtime": {"task": "digest", "schedule": 60.0}})


def test_tick_fires_due_slots_and_sleeps_until_the_next(
        make_app: Callable[..., Celery], clock: Clock) -> None:
    """A tick fires the due slot once and asks to sleep until the next slot (at most the
    scheduler's max_interval); a second tick at the same time fires nothing."""
    app = _app(make_app)
    scheduler = _scheduler(app, {"every-2s": {"task": "digest", "schedule": 2.0}})
    clock.advance(seconds=2.5)
    assert 0 < scheduler.tick() <= 1.5
    slot = START + timedelta(seconds=2)
    assert app.conf.calls == Counter({schedule_run_id("every-2s", slot): 1})
    scheduler.tick()
    assert sum(app.conf.calls.values()) == 1
    assert get_schedule("every-2s", app=app).fired == 1


def test_a_schedule_added_elsewhere_is_found_within_seconds(
        make_app: Callable[..., Celery], clock: Clock) -> None:
    """With beat's max_interval at five minutes and nothing due for an hour, a tick still
    asks to sleep no more than the store's poll, so a schedule another process adds is
    fired on time."""
    app = _app(make_app)
    scheduler = _scheduler(app, {"hourly": {"task": "digest", "schedule": 3600.0}},
                           max_interval=300)
    assert scheduler.tick() <= STORE_POLL
    add_schedule("soon", "digest", every=10, app=app)
    clock.advance(seconds=STORE_POLL + 10)
    scheduler.tick()
    assert sum(app.conf.calls.values()) == 1


def test_concurrent_passes_fire_each_slot_once(make_app: Callable[..., Celery],
                                               clock: Clock) -> None:
    """Eight threads firing at once, over thirty one-second slots: every slot has
    exactly one run and one body, none missing."""
    app = _app(make_app)
    add_schedule("fast", "digest", every=1, catchup="all", overlap="allow_all", app=app)
    fired: list[str] = []
    lock = threading.Lock()
    for _second in range(30):
        clock.advance(seconds=1)
        barrier = threading.Barrier(8)

        def fire(barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            ids = fire_schedules(app).fired
            with lock:
                fired.extend(ids)

        threads = [threading.Thread(target=fire) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    expected = [schedule_run_id("fast", START + timedelta(seconds=n)) for n in range(1, 31)]
    assert sorted(fired) == sorted(expected)
    assert all(app.conf.calls[task_id] == 1 for task_id in expected)


def test_a_slot_whose_message_never_left_is_sent_by_the_sweep(
        make_app: Callable[..., Celery], clock: Clock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler records the slot's run and dies before sending it: the recovery
    sweep sends it once its lease has passed, and its body runs once."""
    app = _app(make_app)
    add_schedule("minutely", "digest", every=60, app=app)
    clock.advance(minutes=1)

    def died(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("the scheduler died before sending")

    monkeypatch.setattr(schedules_module, "send_run", died)
    run_id = schedule_run_id("minutely", START + timedelta(minutes=1))
    assert fire_schedules(app).fired == [run_id]
    monkeypatch.undo()
    run = get_run(run_id, app=app)
    assert run is not None and run.status == "running" and app.conf.calls[run_id] == 0
    assert fire_schedules(app).fired == []
    clock.advance(minutes=5)
    assert run_id in recover(app)
    assert get_run(run_id, app=app).status == "succeeded"  # type: ignore[union-attr]
    assert app.conf.calls[run_id] == 1


def test_next_slot_of_an_interval_counts_from_start_at(
        make_app: Callable[..., Celery], clock: Clock) -> None:
    """start_at anchors an interval: at 12:00, a 7-minute schedule from 12:03 first fires at
    12:03, and one from 11:55 at 12:02."""
    app = _app(make_app)
    later = add_schedule("later", "digest", every=timedelta(minutes=7),
                         start_at=datetime(2026, 6, 1, 12, 3, tzinfo=UTC), app=app)
    assert later.next_fire_at == datetime(2026, 6, 1, 12, 3, tzinfo=UTC)
    earlier = add_schedule("earlier", "digest", every=timedelta(minutes=7),
                           start_at=datetime(2026, 6, 1, 11, 55, tzinfo=UTC), app=app)
    assert earlier.next_fire_at == datetime(2026, 6, 1, 12, 2, tzinfo=UTC)
