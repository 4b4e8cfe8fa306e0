"""Durable schedules: periodic runs of durable tasks that fire each slot exactly once.

A schedule lives in the store, so every scheduler process (``celery beat -S
celery_duraflow.beat:DurableScheduler``, or anything calling
:func:`fire_schedules`) shares it. Each slot fires as a run whose task id is
derived from the schedule's name and the slot (:func:`schedule_run_id`), inserted
before its message is sent: however many schedulers run, and whichever of them
dies when, a slot has one run, and a run whose message was lost is sent by the
recovery sweep.

Schedules come from ``beat_schedule`` (kept in step by the scheduler when it
starts) or from :func:`add_schedule` at run time. A bad definition is refused
before anything is written (:class:`~celery_duraflow.InvalidSchedule`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule

from . import _schedule_spec as spec_
from ._canvas import CELERY_BUILTIN_PREFIX
from ._config import app_and_config
from ._operations import cancel
from ._schedules_store import MAX_BACKFILL, Definition, Schedule, SlotRun, schedule_run_id
from ._send import routing_of, send_run
from ._serialization import encode_arguments, get_serializer
from ._store import store_for
from ._task import DurableTask
from .errors import DuraflowError, InvalidSchedule, RunArgumentsNotSerializable, ScheduleNotFound
from .signals import schedule_fired, schedule_skipped

logger = logging.getLogger("celery_duraflow.schedules")

__all__ = ["MAX_BACKFILL", "FirePass", "Schedule", "add_schedule", "backfill_schedule",
           "fire_schedules", "get_schedule", "list_schedules", "next_fire_times",
           "pause_schedule", "remove_schedule", "resume_schedule", "schedule_run_id"]

#: How far back ``catchup="all"`` fires missed slots when no window is given.
DEFAULT_CATCHUP_WINDOW = timedelta(days=1)
NAME_LENGTH = 200
#: The options of a ``beat_schedule`` entry a durable schedule keeps (its routing).
ROUTING_OPTIONS = ("queue", "routing_key", "exchange", "priority")


@dataclass(frozen=True)
class FirePass:
    """What one call of :func:`fire_schedules` did."""

    #: The task ids of the runs it fired (each sent, or left to the sweep if sending failed).
    fired: list[str]
    #: The earliest next slot of a schedule that is not paused; None when there is none.
    next_due: datetime | None
    #: The schedules that were due and not fired, by name, with the reason (also logged).
    broken: dict[str, str] = field(default_factory=dict)


def _refuse(name: Any, why: str) -> InvalidSchedule:
    return InvalidSchedule(f"schedule {name!r}: {why}. Nothing was stored.",
                           schedule=name if isinstance(name, str) else None)


def _check_name(name: Any) -> str:
    if (not isinstance(name, str) or not name.strip() or len(name) > NAME_LENGTH
            or any(ord(ch) < 32 for ch in name)):
        raise _refuse(name, f"a schedule's name must be a non-empty string of at most "
                            f"{NAME_LENGTH} characters without control characters")
    return name


def _task_of(app: Any, name: str, task: Any) -> str:
    """The name of the registered durable task ``task`` (a task or a task name)."""
    task_name = task if isinstance(task, str) else getattr(task, "name", None)
    if not isinstance(task_name, str):
        raise _refuse(name, f"{task!r} is neither a task nor a task name")
    if task_name.startswith(CELERY_BUILTIN_PREFIX):
        raise _refuse(name, f"{task_name} is one of Celery's own tasks, not a durable task")
    registered = app.tasks.get(task_name)
    if registered is None:
        raise _refuse(name, f"the task {task_name} is not registered in this app; import "
                            "the module that defines it (or fix the name)")
    if not isinstance(registered, DurableTask):
        raise _refuse(name, f"the task {task_name} is not a durable task, so its slots cannot "
                            "be fired exactly once; declare it with base=DurableTask, or "
                            "schedule it with plain Celery beat")
    return task_name


def _duration(name: str, value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | timedelta):
        raise _refuse(name, f"{what} {value!r} is not a number of seconds or a timedelta")
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds > 0 or seconds == float("inf"):
        raise _refuse(name, f"{what} must be a positive duration, not {value!r}")
    return seconds


def _spec(name: str, cron: Any, every: Any, timezone: str | None,
          start_at: datetime | None) -> spec_.Spec:
    if (cron is None) == (every is None):
        raise _refuse(name, "give exactly one of cron= (an expression or a crontab) and "
                            "every= (seconds or a timedelta)")
    try:
        if cron is not None:
            if start_at is not None:
                raise spec_.SpecError("start_at= anchors an interval; a cron schedule has none")
            zone = timezone or "UTC"
            if isinstance(cron, crontab):
                return spec_.Cron.from_crontab(cron, zone)
            if not isinstance(cron, str):
                raise spec_.SpecError(f"cron= {cron!r} is neither a cron expression nor a "
                                      "celery.schedules.crontab")
            return spec_.Cron.parse(cron, zone)
        if timezone not in (None, "UTC"):
            raise spec_.SpecError("an interval counts seconds, not wall-clock time: timezone= "
                                  "belongs to cron schedules")
        if isinstance(every, interval_schedule):
            every = every.run_every
        return spec_.Every.make(every, start_at)
    except spec_.SpecError as exc:
        raise _refuse(name, str(exc)) from None


def define(app: Any, name: str, task: Any, *, cron: Any = None, every: Any = None,
           timezone: str | None = None, start_at: datetime | None = None,
           args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
           options: Mapping[str, Any] | None = None, catchup: str = "skip",
           catchup_window: float | timedelta | None = None,
           overlap: str = "skip") -> Definition:
    """Check a schedule's definition and encode it for its row; InvalidSchedule if not."""
    name = _check_name(name)
    task_name = _task_of(app, name, task)
    spec = _spec(name, cron, every, timezone, start_at)
    if catchup not in spec_.CATCHUP_POLICIES:
        raise _refuse(name, f"catchup={catchup!r} is not one of "
                            f"{', '.join(spec_.CATCHUP_POLICIES)}")
    if overlap not in spec_.OVERLAP_POLICIES:
        raise _refuse(name, f"overlap={overlap!r} is not one of "
                            f"{', '.join(spec_.OVERLAP_POLICIES)}")
    window: float | None = None
    if catchup == "all":
        window = _duration(name, DEFAULT_CATCHUP_WINDOW if catchup_window is None
                           else catchup_window, "catchup_window")
    elif catchup_window is not None:
        raise _refuse(name, "catchup_window= bounds catchup='all'; the other policies never "
                            "fire a slot found more than a minute late")
    given = dict(options or {})
    unknown = sorted(set(given) - set(ROUTING_OPTIONS))
    if unknown:
        raise _refuse(name, f"the options {', '.join(unknown)} cannot be kept by a durable "
                            f"schedule (it keeps {', '.join(ROUTING_OPTIONS)})")
    if not isinstance(args, list | tuple) or not isinstance(kwargs or {}, Mapping):
        raise _refuse(name, "args= must be a list or tuple and kwargs= a dict")
    config = app_and_config(app)[1]
    try:
        blob, _ = encode_arguments(tuple(args), dict(kwargs or {}),
                                   get_serializer(config.serializer), task_name=task_name,
                                   serializer_name=config.serializer)
    except RunArgumentsNotSerializable as exc:
        raise _refuse(name, f"its arguments cannot be stored: {exc}") from None
    routing = routing_of(given)
    if given.get("priority") is not None and routing["priority"] is None:
        raise _refuse(name, f"priority={given['priority']!r} is not an int from 0 to 255")
    return Definition(name=name, task_name=task_name, spec=spec, args=blob,
                      exchange=routing["exchange"], routing_key=routing["routing_key"],
                      priority=routing["priority"], catchup=catchup,
                      catchup_window=window, overlap=overlap)


def add_schedule(name: str, task: Any, *, cron: str | crontab | None = None,
                 every: float | timedelta | None = None, timezone: str | None = None,
                 start_at: datetime | None = None, args: Sequence[Any] = (),
                 kwargs: Mapping[str, Any] | None = None,
                 options: Mapping[str, Any] | None = None, catchup: str = "skip",
                 catchup_window: float | timedelta | None = None, overlap: str = "skip",
                 app: Any = None) -> Schedule:
    """Store a schedule that fires durable ``task`` (a task or its registered name).

    Give ``cron`` (five fields, read in ``timezone``, UTC by default) or ``every``
    (seconds or a timedelta, counted from ``start_at``, by default the Unix epoch).
    ``options`` may route its runs (``queue``, ``routing_key``, ``exchange``,
    ``priority``). ``catchup`` says what happens to slots found more than a minute
    late: ``"skip"`` them, fire the ``"latest"`` of them, or fire ``"all"`` within
    ``catchup_window`` (a day by default). ``overlap`` says what happens to a slot
    while the run of the last one has not ended: ``"skip"`` it, ``"buffer_one"``,
    ``"allow_all"``, or ``"cancel_other"``.

    Adding a name again changes that schedule (its pause and counts stay). Raises
    :class:`~celery_duraflow.InvalidSchedule` for a bad definition, or a name
    already declared in ``beat_schedule``.
    """
    app, config = app_and_config(app)
    definition = define(app, name, task, cron=cron, every=every, timezone=timezone,
                        start_at=start_at, args=args, kwargs=kwargs, options=options,
                        catchup=catchup, catchup_window=catchup_window, overlap=overlap)
    return save(store_for(config), definition, origin="api")


def save(store: Any, definition: Definition, *, origin: str) -> Schedule:
    """Write a checked definition; InvalidSchedule if the name belongs to the other origin."""
    try:
        schedule, outcome = store.save_schedule(definition, origin=origin)
    except ValueError as exc:
        raise _refuse(definition.name, str(exc)) from None
    if outcome != "unchanged":
        logger.info("schedule %r %s: %s of %s, next slot %s", schedule.name, outcome,
                    schedule.describe(), schedule.task_name, schedule.next_fire_at.isoformat())
    return cast(Schedule, schedule)


def _store(app: Any) -> Any:
    return store_for(app_and_config(app)[1])


def get_schedule(name: str, *, app: Any = None) -> Schedule:
    """The stored schedule ``name``; :class:`~celery_duraflow.ScheduleNotFound` if none."""
    schedule = _store(app).get_schedule(name)
    if schedule is None:
        raise _not_found(name)
    return cast(Schedule, schedule)


def _not_found(name: str) -> ScheduleNotFound:
    return ScheduleNotFound(f"no schedule named {name!r} is stored; list them with "
                            "`celery duraflow schedules`", schedule=name)


def list_schedules(*, app: Any = None) -> list[Schedule]:
    """Every stored schedule, by name."""
    return cast(list[Schedule], _store(app).list_schedules())


def remove_schedule(name: str, *, app: Any = None) -> bool:
    """Delete schedule ``name`` (its runs stay); False if there was none."""
    return bool(_store(app).remove_schedule(name))


def pause_schedule(name: str, *, note: str | None = None, app: Any = None) -> Schedule:
    """Stop schedule ``name`` from firing until it is resumed; ``note`` says why."""
    schedule = _store(app).set_paused(name, True, note)
    if schedule is None:
        raise _not_found(name)
    logger.info("schedule %r paused", name)
    return cast(Schedule, schedule)


def resume_schedule(name: str, *, app: Any = None) -> Schedule:
    """Let schedule ``name`` fire again from its next slot after now; the slots it was
    paused over stay unfired (:func:`backfill_schedule` fires them)."""
    schedule = _store(app).set_paused(name, False)
    if schedule is None:
        raise _not_found(name)
    logger.info("schedule %r resumed, next slot %s", name, schedule.next_fire_at.isoformat())
    return cast(Schedule, schedule)


def next_fire_times(name: str, count: int = 5, *, app: Any = None) -> list[datetime]:
    """The next ``count`` slots of schedule ``name``, from the one it waits for (empty
    while it is paused)."""
    schedule = get_schedule(name, app=app)
    if schedule.paused or count <= 0:
        return []
    # A slot kept back by buffer_one fires first; the slots dropped after it never do.
    held = [schedule.buffered_at] if schedule.buffered_at is not None else []
    following = spec_.next_fires(schedule.spec, schedule.next_fire_at, count - len(held) - 1)
    return [*held, schedule.next_fire_at, *following][:count]


def backfill_schedule(name: str, start: datetime, end: datetime, *,
                      app: Any = None) -> list[str]:
    """Fire every slot of schedule ``name`` from ``start`` to ``end`` (past, both
    included) that has no run yet, whatever its policies; the task ids sent.

    A slot that fired already keeps its one run, so a backfill repeated over the same
    range sends nothing new.
    """
    app, config = app_and_config(app)
    for moment, what in ((start, "start"), (end, "end")):
        if not isinstance(moment, datetime) or moment.tzinfo is None:
            raise _refuse(name, f"the backfill's {what} must be a timezone-aware datetime")
    try:
        runs, count = store_for(config).backfill(name, start, end)
    except LookupError:
        raise _not_found(name) from None
    except ValueError as exc:
        raise _refuse(name, str(exc)) from None
    logger.info("schedule %r backfilled: %d of %d slot(s) from %s to %s had no run",
                name, len(runs), count, start.isoformat(), end.isoformat())
    return _send(app, runs)


def _send(app: Any, fired: Sequence[SlotRun]) -> list[str]:
    sent = []
    for each in fired:
        run = each.run
        if schedule_fired.receivers:
            schedule_fired.send(sender=app, schedule=each.schedule, slot=each.slot,
                                task_id=run.task_id, task_name=run.task_name)
        try:
            send_run(app, run)
        except Exception:  # the row is written: the recovery sweep sends it
            logger.warning("could not send run %s (%s) of schedule %r; the recovery sweep "
                           "sends it from its row", run.task_id, run.task_name, each.schedule,
                           exc_info=True)
        sent.append(run.task_id)
    return sent


def _not_durable(app: Any, schedule: Schedule) -> str | None:
    """Why this process may not fire ``schedule``'s task, if it may not."""
    if isinstance(app.tasks.get(schedule.task_name), DurableTask):
        return None
    return (f"its task {schedule.task_name} is not registered in this app as a durable task "
            "(import the module that defines it in the scheduler's app)")


def fire_schedules(app: Any = None) -> FirePass:
    """One firing pass: fire every due slot of every schedule, once, and send its run.

    Any number of processes may call it at once; each slot fires in exactly one.
    """
    app, config = app_and_config(app)
    fired = store_for(config).fire_due(refuse=lambda schedule: _not_durable(app, schedule))
    for name, why in fired.broken:
        logger.error("schedule %r is not fired: %s. Its slots wait (and follow its catch-up "
                     "policy) until this is fixed.", name, why)
    for name, count, first, last, reason, policy in fired.skipped:
        span = f" from {first.isoformat()} to {last.isoformat()}" if first and last else ""
        logger.warning("schedule %r: %d slot(s)%s not fired (%s, %s)", name, count, span,
                       reason, policy)
        if schedule_skipped.receivers:
            schedule_skipped.send(sender=app, schedule=name, count=count, reason=reason,
                                  first=first, last=last)
    for task_id in fired.cancel:
        try:
            cancel(task_id, app=app)
            logger.info("cancelled run %s: a newer slot of its schedule fired", task_id)
        except DuraflowError:
            logger.warning("could not cancel run %s", task_id, exc_info=True)
    return FirePass(fired=_send(app, fired.runs), next_due=fired.next_due,
                    broken=dict(fired.broken))

