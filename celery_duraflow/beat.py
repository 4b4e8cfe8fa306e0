"""A Celery beat scheduler that fires durable tasks' slots exactly once, fleet-wide.

::

    celery -A proj beat -S celery_duraflow.beat:DurableScheduler

Run it in as many processes as you like. When it starts, the ``beat_schedule``
entries of durable tasks become durable schedules in the store (changed ones
are updated, ones no longer declared are removed). Each tick it fires the due
slots of every durable schedule, those added at run time included; the store
decides which process fires a slot, and the slot's run id makes a second run
impossible. Nothing is kept in a local file.

An entry of a task that is not durable is refused when the scheduler starts,
because its slots could not be fired exactly once; only Celery's own
maintenance tasks (``celery.*``) and the recovery sweep's task, which may run
once per scheduler without harm, stay plain beat entries of each process.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from celery.beat import Scheduler
from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule

from . import _clock
from ._canvas import CELERY_BUILTIN_PREFIX
from ._config import config_for_app
from ._recovery import RECOVER_TASK_NAME
from ._schedules import define, fire_schedules, save
from ._schedules_store import Definition
from ._store import store_for
from ._task import DurableTask
from .errors import DuraflowError, InvalidSchedule, StoreUnavailable

__all__ = ["DurableScheduler", "entry_definition"]

logger = logging.getLogger("celery_duraflow.schedules")

#: The keys a durable ``beat_schedule`` entry may have: Celery's, and the policies.
ENTRY_KEYS = frozenset({"task", "schedule", "args", "kwargs", "options", "relative",
                        "catchup", "catchup_window", "overlap", "timezone", "start_at"})
#: The longest a scheduler goes without reading the store's schedules, whatever beat's
#: ``max_interval``: a schedule added, changed or resumed by another process meanwhile, or
#: a slot kept back for a run that ended, is found within this many seconds (well within
#: the minute a slot may be late and still fire).
STORE_POLL = 5.0
#: How soon a scheduler looks again at schedules another scheduler was firing.
BUSY_RETRY = 0.5


def _plain_allowed(task_name: str) -> bool:
    return task_name.startswith(CELERY_BUILTIN_PREFIX) or task_name == RECOVER_TASK_NAME


def entry_definition(app: Any, name: str, entry: Mapping[str, Any]) -> Definition:
    """The durable schedule a ``beat_schedule`` entry of a durable task declares."""
    unknown = sorted(set(entry) - ENTRY_KEYS)
    if unknown:
        raise InvalidSchedule(f"beat_schedule entry {name!r} has keys a durable schedule does "
                              f"not know: {', '.join(unknown)}. Nothing was stored.",
                              schedule=name)
    if entry.get("relative"):
        raise InvalidSchedule(f"beat_schedule entry {name!r} is relative=True: a durable "
                              "interval counts from a fixed anchor (start_at=) so that every "
                              "scheduler finds the same slots. Nothing was stored.",
                              schedule=name)
    when = entry.get("schedule")
    cron: crontab | None = None
    every: Any = None
    if isinstance(when, crontab):
        cron = when
    elif isinstance(when, interval_schedule):
        every = when.run_every
    elif isinstance(when, timedelta | int | float) and not isinstance(when, bool):
        every = when
    else:
        raise InvalidSchedule(f"beat_schedule entry {name!r}: its schedule {when!r} is not a "
                              "crontab, a celery.schedules.schedule or a number of seconds, "
                              "which are what a durable schedule keeps. Nothing was stored.",
                              schedule=name)
    timezone = entry.get("timezone")
    if cron is not None and timezone is None:
        timezone = str(app.conf.timezone or "UTC")
    return define(app, name, entry.get("task"), cron=cron, every=every, timezone=timezone,
                  start_at=entry.get("start_at"), args=entry.get("args") or (),
                  kwargs=entry.get("kwargs") or {}, options=entry.get("options") or {},
                  catchup=entry.get("catchup", "skip"),
                  catchup_window=entry.get("catchup_window"),
                  overlap=entry.get("overlap", "skip"))


class DurableScheduler(Scheduler):  # type: ignore[misc]
    """Celery beat's scheduler, with durable tasks' schedules kept in the store."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # When the next pass over the store's schedules is due (the library's clock).
        self._store_pass_at: datetime | None = None
        super().__init__(*args, **kwargs)

    def setup_schedule(self) -> None:
        """Store the durable entries of ``beat_schedule``; keep the others in memory."""
        self.install_default_entries(self.data)
        declared: Mapping[str, Any] = self.app.conf.beat_schedule or {}
        plain: dict[str, Any] = {}
        definitions: list[Definition] = []
        for name, entry in declared.items():
            task_name = entry.get("task") if isinstance(entry, Mapping) else None
            if not isinstance(task_name, str):
                raise InvalidSchedule(f"beat_schedule entry {name!r} names no task. Nothing "
                                      "was stored.", schedule=name)
            if isinstance(self.app.tasks.get(task_name), DurableTask):
                definitions.append(entry_definition(self.app, name, entry))
            elif _plain_allowed(task_name):
                plain[name] = entry
            else:
                raise InvalidSchedule(
                    f"beat_schedule entry {name!r} fires {task_name}, which is not a durable "
                    "task (or not registered in this app): the durable scheduler fires each "
                    "slot exactly once through the store, which a plain task cannot do. Make "
                    "it a DurableTask, or run it under Celery's own beat. Nothing was stored.",
                    schedule=name)
        store = store_for(config_for_app(self.app))
        for definition in definitions:
            save(store, definition, origin="code")
        removed = store.remove_code_schedules([d.name for d in definitions])
        if removed:
            logger.info("removed schedule(s) no longer in beat_schedule: %s", ", ".join(removed))
        self.merge_inplace(plain)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Fire what is due in the store, then Celery's plain entries; the seconds to sleep."""
        if self._store_pass_at is None or _clock.now() >= self._store_pass_at:
            self._store_pass_at = _clock.now() + timedelta(seconds=self._fire())
        plain = float(super().tick(*args, **kwargs))
        return max(0.0, min(plain, (self._store_pass_at - _clock.now()).total_seconds()))

    def _fire(self) -> float:
        """One pass over the store; how long until the next one should start."""
        try:
            fired = fire_schedules(self.app)
        except (StoreUnavailable, DuraflowError) as exc:
            logger.error("could not fire schedules: %s; trying again in %g s", exc, STORE_POLL)
            return min(STORE_POLL, float(self.max_interval))
        cap = min(STORE_POLL, float(self.max_interval))
        if not fired.fired and fired.next_due is not None and fired.next_due <= _clock.now():
            # Due, yet nothing fired: another scheduler holds those rows right now.
            return min(BUSY_RETRY, cap)
        return _until(fired.next_due, cap)

    @property
    def info(self) -> str:
        return "    . durable schedules: in the store (celery-duraflow)"


def _until(moment: datetime | None, cap: float) -> float:
    if moment is None:
        return cap
    return max(0.0, min(cap, (moment - _clock.now()).total_seconds()))
