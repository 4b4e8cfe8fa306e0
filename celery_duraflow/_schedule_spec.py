"""When a schedule fires: cron expressions in a time zone, fixed intervals, and catch-up.

A schedule's *slots* are the instants it is meant to fire at, in UTC. Every
scheduler process computes them from what the schedules table stores, with the
functions below, so they agree on every slot to the microsecond; a slot's run id
is derived from the schedule's name and the slot (see ``_schedules``).

Cron expressions are parsed by Celery's own :class:`celery.schedules.crontab`
(five fields: minute, hour, day of month, month, day of week; a day must match
both day fields, as in Celery beat) and read as wall-clock times in the
schedule's time zone (:mod:`zoneinfo`). Daylight-saving changes:

- a wall time the clocks skip (02:30 on the night clocks go from 02:00 to 03:00)
  fires at the instant of the jump; several skipped slots fire once there;
- a wall time the clocks repeat (01:30 on the night clocks go back from 02:00 to
  01:00) fires once, at its first occurrence.

Intervals are counted from an anchor (the Unix epoch unless the schedule names
one): slot *k* is ``anchor + k * every``, in whole microseconds.
"""

from __future__ import annotations

import zoneinfo
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Literal

from celery.schedules import crontab

#: What happens to the slots a scheduler finds late (see :func:`due_slots`).
Catchup = Literal["skip", "latest", "all"]
CATCHUP_POLICIES: tuple[Catchup, ...] = ("skip", "latest", "all")
#: What happens to a slot while the run of an earlier slot has not ended.
Overlap = Literal["skip", "buffer_one", "allow_all", "cancel_other"]
OVERLAP_POLICIES: tuple[Overlap, ...] = ("skip", "buffer_one", "allow_all", "cancel_other")

#: How late a slot may be found and still fire under the ``skip`` and ``latest`` policies:
#: a scheduler that stops for less than this loses no slot.
ON_TIME = timedelta(minutes=1)
#: The shortest interval a schedule may have.
MIN_EVERY = timedelta(seconds=1)
#: How far ahead a cron expression is searched for its next slot: eight years holds
#: every day a valid expression can name (29 February on a given weekday included).
_SEARCH_DAYS = 366 * 8 + 2
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICRO = timedelta(microseconds=1)
#: More than any change of a zone's clocks: a wall time further than this before (or
#: after) the wall time searched from is an earlier (a later) instant whatever the clocks did.
_MARGIN = timedelta(hours=3)


class SpecError(ValueError):
    """A schedule's definition cannot be used; the message says which part and why."""


def time_zone(name: str) -> zoneinfo.ZoneInfo:
    """The IANA time zone ``name``; SpecError when this machine does not know it."""
    if not isinstance(name, str) or not name:
        raise SpecError(f"the time zone {name!r} is not a time zone name such as "
                        "'Europe/Paris' or 'UTC'")
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
        raise SpecError(f"the time zone {name!r} is unknown here ({exc}); give an IANA name "
                        "such as 'America/New_York' (install tzdata where the system has none)"
                        ) from None


@dataclass(frozen=True)
class Cron:
    """A five-field cron expression read in a time zone."""

    expression: str
    timezone: str
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 is Sunday, as in cron and Celery

    @classmethod
    def parse(cls, expression: str, timezone: str = "UTC") -> Cron:
        """Parse ``expression`` (``"*/15 9-17 * * 1-5"``); SpecError if it does not parse
        or never fires."""
        fields = expression.split() if isinstance(expression, str) else []
        if len(fields) != 5:
            raise SpecError(f"the cron expression {expression!r} does not have five fields "
                            "(minute hour day-of-month month day-of-week)")
        try:
            parsed = crontab(minute=fields[0], hour=fields[1], day_of_month=fields[2],
                             month_of_year=fields[3], day_of_week=fields[4])
        except (ValueError, TypeError, KeyError) as exc:
            raise SpecError(f"the cron expression {expression!r} does not parse: {exc}"
                            ) from None
        time_zone(timezone)
        return cls(expression=" ".join(fields), timezone=timezone,
                   minutes=tuple(sorted(parsed.minute)), hours=tuple(sorted(parsed.hour)),
                   days=frozenset(parsed.day_of_month), months=frozenset(parsed.month_of_year),
                   weekdays=frozenset(parsed.day_of_week))

    @classmethod
    def from_crontab(cls, schedule: crontab, timezone: str) -> Cron:
        """The same expression as a Celery ``crontab`` (as written in ``beat_schedule``)."""
        fields = [schedule._orig_minute, schedule._orig_hour, schedule._orig_day_of_month,
                  schedule._orig_month_of_year, schedule._orig_day_of_week]
        return cls.parse(" ".join(_field_text(field) for field in fields), timezone)

    def describe(self) -> str:
        return f"cron {self.expression} ({self.timezone})"

    def _matches(self, day: date) -> bool:
        return (day.month in self.months and day.day in self.days
                and (day.weekday() + 1) % 7 in self.weekdays)

    def _walls(self, day: date, *, reverse: bool = False) -> Iterator[datetime]:
        hours = reversed(self.hours) if reverse else self.hours
        for hour in hours:
            minutes = reversed(self.minutes) if reverse else self.minutes
            for minute in minutes:
                yield datetime.combine(day, time(hour, minute))

    def next_after(self, after: datetime) -> datetime:
        """The first slot strictly after ``after`` (aware), in UTC."""
        tz = time_zone(self.timezone)
        wall = after.astimezone(tz).replace(tzinfo=None)
        day = wall.date()
        for _ in range(_SEARCH_DAYS):
            if self._matches(day):
                for candidate in self._walls(day):
                    if candidate + _MARGIN < wall:
                        continue  # well before ``after`` whatever the clocks did
                    instant = resolve(candidate, tz)
                    if instant > after:
                        return instant
            day += timedelta(days=1)
        raise SpecError(f"the cron expression {self.expression!r} never fires")

    def previous_before(self, before: datetime) -> datetime | None:
        """The last slot strictly before ``before``, in UTC; None if there is none in
        eight years."""
        tz = time_zone(self.timezone)
        wall = before.astimezone(tz).replace(tzinfo=None)
        day = wall.date() + timedelta(days=1)
        for _ in range(_SEARCH_DAYS):
            if self._matches(day):
                for candidate in self._walls(day, reverse=True):
                    if candidate > wall + _MARGIN:
                        continue
                    instant = resolve(candidate, tz)
                    if instant < before:
                        return instant
            day -= timedelta(days=1)
        return None


def _field_text(field: object) -> str:
    if isinstance(field, str):
        return field.replace(" ", "")
    if isinstance(field, int):
        return str(field)
    if isinstance(field, list | tuple | set | frozenset):
        return ",".join(str(value) for value in sorted(field))
    raise SpecError(f"the crontab field {field!r} cannot be stored as cron text")


def resolve(wall: datetime, tz: zoneinfo.ZoneInfo) -> datetime:
    """The UTC instant of the naive wall time ``wall`` in ``tz``: the first occurrence of a
    repeated wall time, the instant of the jump for one the clocks skip."""
    first = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
    if first.astimezone(tz).replace(tzinfo=None) == wall:
        return first
    # Skipped: fold 0 read it with the offset before the jump (an instant after it), fold 1
    # with the offset after (an instant before it). The jump lies between the two.
    low = wall.replace(tzinfo=tz, fold=1).astimezone(UTC)
    high, after_offset = first, first.astimezone(tz).utcoffset()
    while high - low > timedelta(seconds=1):
        middle = low + (high - low) / 2
        if middle.astimezone(tz).utcoffset() == after_offset:
            high = middle
        else:
            low = middle
    return high.replace(microsecond=0) if high.microsecond else high


@dataclass(frozen=True)
class Every:
    """A fixed interval, counted from an anchor (the Unix epoch by default)."""

    every: timedelta
    anchor: datetime = EPOCH

    @classmethod
    def make(cls, every: float | timedelta, anchor: datetime | None = None) -> Every:
        """Check and build an interval; SpecError under :data:`MIN_EVERY` or not a duration."""
        if isinstance(every, bool) or not isinstance(every, int | float | timedelta):
            raise SpecError(f"the interval {every!r} is not a number of seconds or a timedelta")
        length = every if isinstance(every, timedelta) else timedelta(seconds=every)
        if length < MIN_EVERY:
            raise SpecError(f"the interval {length.total_seconds()} s is shorter than the "
                            f"shortest a schedule takes, {MIN_EVERY.total_seconds():g} s")
        if anchor is not None and anchor.tzinfo is None:
            raise SpecError("the interval's start must be a timezone-aware datetime")
        return cls(every=length, anchor=(anchor or EPOCH).astimezone(UTC))

    def describe(self) -> str:
        return f"every {self.every.total_seconds():g} s"

    def _us(self) -> int:
        return self.every // _MICRO

    def next_after(self, after: datetime) -> datetime:
        """The first slot strictly after ``after``, in UTC."""
        elapsed = (after.astimezone(UTC) - self.anchor) // _MICRO
        count = elapsed // self._us() + 1
        return self.anchor + _MICRO * (count * self._us())

    def previous_before(self, before: datetime) -> datetime | None:
        """The last slot strictly before ``before``, in UTC."""
        elapsed = (before.astimezone(UTC) - self.anchor) // _MICRO
        count = (elapsed - 1) // self._us()
        return self.anchor + _MICRO * (count * self._us())


Spec = Cron | Every


def slots(spec: Spec, start: datetime, end: datetime, limit: int) -> list[datetime]:
    """Up to ``limit`` slots from ``start`` to ``end``, both included, oldest first."""
    found: list[datetime] = []
    slot = spec.next_after(start - _MICRO)
    while slot <= end and len(found) < limit:
        found.append(slot)
        slot = spec.next_after(slot)
    return found


@dataclass(frozen=True)
class Due:
    """What a firing pass does with a schedule's due slots."""

    fire: list[datetime]
    #: Slots passed over by the catch-up policy (their count, the first and the last).
    skipped: int
    skipped_from: datetime | None
    skipped_to: datetime | None
    #: The next slot the schedule waits for after this pass.
    next_fire_at: datetime


def due_slots(spec: Spec, next_fire_at: datetime, now: datetime, *, catchup: Catchup,
              window: timedelta | None, limit: int) -> Due:
    """The slots to fire now, from ``next_fire_at`` (the first slot not handled yet).

    A slot found at most :data:`ON_TIME` after its time is on time and fires under
    every policy. An older one was missed (no scheduler was running):

    - ``skip``: missed slots never fire;
    - ``latest``: the newest missed slot fires, unless a slot on time fires in this pass;
    - ``all``: every missed slot within ``window`` of now fires, oldest first.

    At most ``limit`` slots fire in one pass; the rest are found by the next.
    """
    if next_fire_at > now:
        return Due([], 0, None, None, next_fire_at)
    if catchup == "all":
        lower = now - window if window is not None else next_fire_at
    else:
        lower = now - ON_TIME
    first = max(next_fire_at, lower)
    fire = slots(spec, first, now, limit)
    skipped, skipped_from, skipped_to = 0, None, None
    if next_fire_at < first:
        newest = spec.previous_before(first)  # the newest missed slot
        if catchup == "latest" and not fire and newest is not None:
            fire = [newest]
            newest = spec.previous_before(newest)
        if newest is not None and newest >= next_fire_at:
            skipped_from, skipped_to = next_fire_at, newest
            skipped = _count(spec, next_fire_at, newest)
    last = fire[-1] if fire else None
    if len(fire) >= limit and last is not None:
        following = spec.next_after(last)
    else:
        following = spec.next_after(max(now, last) if last is not None else now)
    return Due(fire, skipped, skipped_from, skipped_to, following)


def _count(spec: Spec, start: datetime, end: datetime, cap: int = 100_000) -> int:
    """How many slots lie from ``start`` to ``end`` (counted up to ``cap``)."""
    if isinstance(spec, Every):
        return int((end - start) // spec.every) + 1
    return len(slots(spec, start, end, cap))


def next_fires(spec: Spec, after: datetime, count: int) -> list[datetime]:
    """The next ``count`` slots after ``after``."""
    found: list[datetime] = []
    slot = after
    for _ in range(count):
        slot = spec.next_after(slot)
        found.append(slot)
    return found
