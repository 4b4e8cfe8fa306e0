"""Showing runs, schedules, recorded values, times and durations to people.

The one set of display helpers of the CLI (``celery -A proj duraflow ...``),
the web view and the Django admin, so that they say the same thing the same
way. Times are UTC.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import Any, Protocol
from uuid import UUID
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ._flow_store import QueuePlace
from ._store import FINISHED, SLEEPING, WAITING

#: How both surfaces write a moment (always UTC).
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


class ShownRun(Protocol):
    """What the notes about a run read of it: a ``RunRecord`` or a ``RunView``."""

    @property
    def status(self) -> str: ...
    @property
    def wait_kind(self) -> str | None: ...
    @property
    def waiting_for(self) -> str | None: ...
    @property
    def wake_at(self) -> datetime | None: ...
    @property
    def unwinding(self) -> str | None: ...


class ShownStep(Protocol):
    """What :func:`step_duration` reads of a step: a ``StepView`` or a ``StepRecord``."""

    @property
    def started_at(self) -> datetime: ...
    @property
    def completed_at(self) -> datetime | None: ...


def when(moment: datetime | None) -> str:
    """A moment as ``2024-05-01 12:00:00`` (UTC, without saying so); ``-`` for none."""
    return moment.strftime(TIME_FORMAT) if moment is not None else "-"


def waits_for(kind: str | None, waiting_for: str | None, wake_at: datetime | None, *,
              say_no_timeout: bool = True) -> str:
    """What a sleeping or waiting run waits for, in a few words; ``""`` when it does not.

    ``signal 'approval' until 2024-05-01 12:00:00 UTC``, ``child <task id> (no
    timeout)``. ``say_no_timeout=False`` leaves out ``(no timeout)``, for a
    narrow column.
    """
    if kind is None:
        return ""
    if kind == "slot":
        return f"a concurrency slot of {waiting_for!r}"
    if kind in ("rate", "debounce"):
        what = (f"the rate limit of {waiting_for!r}" if kind == "rate"
                else f"the end of a burst of sends of {waiting_for!r}")
        return f"{what} until {when(wake_at)} UTC" if wake_at is not None else what
    if kind == "children":
        what = f"the children of step {waiting_for!r}"
    elif kind in ("sleep", "signal"):
        what = f"{kind} {waiting_for!r}"
    else:
        what = f"{kind} {waiting_for}"
    if wake_at is not None:
        return f"{what} until {when(wake_at)} UTC"
    return f"{what} (no timeout)" if say_no_timeout and kind != "sleep" else what


def join_summary(key: str, counts: Mapping[str, int]) -> str:
    """How far the children a run started at step ``key`` (``children()``) have got:
    ``step 'fan': 412 of 500 ended (3 failed, 88 running, 409 succeeded)``."""
    total = sum(counts.values())
    ended = sum(count for status, count in counts.items() if status in FINISHED)
    parts = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
    return f"step {key!r}: {ended} of {total} ended ({parts})"


def queue_note(places: Sequence[QueuePlace]) -> str:
    """Where a run waiting for concurrency slots stands: ``place 3 in the queue of
    'charge/acme', 2 of 2 slots taken``; ``""`` when it is in no queue."""
    return "; ".join(
        f"place {place.position} in the queue of {place.scope + '/' + place.key!r}, "
        f"{place.holding} of {place.limit} slots taken" for place in places)


def unwinding_note(run: ShownRun) -> str:
    """``cancel requested`` or ``compensating after a failure`` while a run is unwound."""
    if run.status in FINISHED or not run.unwinding:
        return ""
    return "cancel requested" if run.unwinding == "cancel" else "compensating after a failure"


def run_note(run: ShownRun, *, say_no_timeout: bool = True) -> str:
    """The "waits for" column of a list of runs: what it waits for, and whether it is
    being unwound (``signal 'approval' (no timeout); cancel requested``)."""
    notes = [unwinding_note(run)]
    if run.status in (SLEEPING, WAITING):
        notes.insert(0, waits_for(run.wait_kind, run.waiting_for, run.wake_at,
                                  say_no_timeout=say_no_timeout))
    return "; ".join(note for note in notes if note)


class ShownSchedule(Protocol):
    """What the notes about a schedule read of it: a ``Schedule`` or the admin's row."""

    @property
    def catchup(self) -> str: ...
    @property
    def catchup_window(self) -> float | None: ...
    @property
    def overlap(self) -> str: ...
    @property
    def paused(self) -> bool: ...
    @property
    def note(self) -> str | None: ...
    @property
    def next_fire_at(self) -> datetime: ...
    @property
    def buffered_at(self) -> datetime | None: ...


def catchup_note(schedule: ShownSchedule) -> str:
    """A schedule's catch-up policy, with its window for ``all``: ``all within 1d0h``."""
    if schedule.catchup == "all" and schedule.catchup_window is not None:
        return f"all within {span(timedelta(seconds=schedule.catchup_window))}"
    return schedule.catchup


def schedule_policies(schedule: ShownSchedule) -> str:
    """``catch-up skip, overlap buffer_one``: what a schedule does with late and
    overlapping slots."""
    return f"catch-up {catchup_note(schedule)}, overlap {schedule.overlap}"


def schedule_state(schedule: ShownSchedule) -> str:
    """``active``, ``paused``, or ``paused: <note>`` when the pause gave a reason."""
    if not schedule.paused:
        return "active"
    return f"paused: {schedule.note}" if schedule.note else "paused"


def next_slot(schedule: ShownSchedule) -> datetime | None:
    """The slot a schedule fires next (one kept back by ``buffer_one`` first); None while
    it is paused."""
    if schedule.paused:
        return None
    return schedule.buffered_at or schedule.next_fire_at


def wall_time(moment: datetime | None, zone: str | None) -> str:
    """``moment`` as the clocks of time zone ``zone`` read it (``03:00:00 CEST``), for a
    cron schedule read in a zone other than UTC; ``""`` for UTC, no zone or no moment, or
    a zone this machine does not know."""
    if moment is None or not zone or zone == "UTC":
        return ""
    try:
        local = moment.astimezone(ZoneInfo(zone))
    except (ZoneInfoNotFoundError, ValueError):
        return ""
    return f"{local:%Y-%m-%d %H:%M:%S} {local.tzname()} ({zone})"


def step_duration(step: ShownStep) -> timedelta | None:
    """How long a step took; None while no end is recorded."""
    if step.completed_at is None:
        return None
    return step.completed_at - step.started_at


def clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, ending with ``...`` when it was longer."""
    if len(text) <= width:
        return text
    return text[:max(width - 3, 0)] + "..." if width > 3 else text[:width]


def json_text(value: Any, indent: int | None = None) -> str:
    """A recorded value as JSON (see :func:`json_default`); its ``repr`` if it contains itself."""
    try:
        return json.dumps(value, indent=indent, ensure_ascii=False, default=json_default)
    except ValueError:  # a value that contains itself
        return repr(value)


def span(elapsed: timedelta | None) -> str:
    """A duration for people: ``85ms``, ``4.2s``, ``3m05s``, ``2h10m``, ``3d4h``; ``-`` for none."""
    if elapsed is None:
        return "-"
    seconds = elapsed.total_seconds()
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86_400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86_400}d{whole % 86_400 // 3600}h"


def json_default(value: Any) -> Any:
    """What ``json.dumps`` writes for the values kombu's JSON stores and JSON has no type for."""
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    if isinstance(value, Decimal | UUID):
        return str(value)
    return repr(value)
