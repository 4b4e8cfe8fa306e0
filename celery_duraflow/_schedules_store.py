"""The statements of durable schedules: define them, fire their slots, steer them.

Firing is one transaction per pass. It locks the schedules that are due
(``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so two scheduler processes never hold
one schedule at once; SQLite's ``BEGIN IMMEDIATE`` locks the database), decides
which slots fire under the schedule's catch-up and overlap policies, inserts one
run row per slot whose task id derives from the schedule's name and the slot,
and moves ``next_fire_at`` past them. The runs are written before their messages
are sent, as a join's children are: a message that never leaves (the scheduler
died after the commit) is sent by the recovery sweep from the row. A second
insert of a slot's run, by any path, finds the row and adds nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.engine import Connection

from . import _schedule_spec as spec_
from ._db import Database
from ._records import FINISHED, RUNNING, RunRecord, as_utc, utc_now
from ._schedule_spec import Catchup, Overlap, Spec

#: Due schedules one pass locks and fires, and slots it fires of one schedule.
SCHEDULES_PER_PASS = 50
SLOTS_PER_PASS = 500
#: The most slots one backfill fires.
MAX_BACKFILL = 10_000

# Scheduled runs' task ids: uuid5(namespace, "<schedule name>/<slot, ISO 8601 UTC>").
_SLOT_NAMESPACE = uuid.UUID("0b6c1f5e-3a52-5f0c-8e21-7d9a4c6b2f10")


def schedule_run_id(name: str, slot: datetime) -> str:
    """The task id of the run that fires schedule ``name`` at ``slot`` (an aware datetime).

    Every scheduler process derives the same id for a slot, so a slot fired twice
    finds its run recorded and adds nothing.
    """
    moment = slot.astimezone(UTC).isoformat(timespec="microseconds")
    return str(uuid.uuid5(_SLOT_NAMESPACE, f"{name}/{moment}"))


@dataclass(frozen=True)
class Schedule:
    """A durable schedule as stored: its definition, policies and where it stands."""

    name: str
    task_name: str
    origin: str
    cron: str | None
    timezone: str
    every: float | None
    anchor_at: datetime | None
    args: str | None
    exchange: str | None
    routing_key: str | None
    priority: int | None
    catchup: str
    catchup_window: float | None
    overlap: str
    paused: bool
    note: str | None
    next_fire_at: datetime
    buffered_at: datetime | None
    last_slot_at: datetime | None
    last_run_id: str | None
    fired: int
    skipped: int
    created_at: datetime
    updated_at: datetime

    @property
    def spec(self) -> Spec:
        """When it fires, as :mod:`._schedule_spec` computes slots."""
        if self.cron is not None:
            return spec_.Cron.parse(self.cron, self.timezone)
        return spec_.Every.make(float(self.every or 0), self.anchor_at)

    def describe(self) -> str:
        """``cron 0 3 * * * (Europe/Paris)`` or ``every 60 s``."""
        return self.spec.describe()


@dataclass(frozen=True)
class Definition:
    """What a schedule is, checked, as it is written to its row."""

    name: str
    task_name: str
    spec: Spec
    args: str | None
    exchange: str | None
    routing_key: str | None
    priority: int | None
    catchup: Catchup
    catchup_window: float | None
    overlap: Overlap

    def columns(self) -> dict[str, Any]:
        cron = self.spec if isinstance(self.spec, spec_.Cron) else None
        every = self.spec if isinstance(self.spec, spec_.Every) else None
        return {"task_name": self.task_name,
                "cron": cron.expression if cron else None,
                "timezone": cron.timezone if cron else "UTC",
                "every": every.every.total_seconds() if every else None,
                "anchor_at": every.anchor if every and every.anchor != spec_.EPOCH else None,
                "args": self.args, "exchange": self.exchange, "routing_key": self.routing_key,
                "priority": self.priority, "catchup": self.catchup,
                "catchup_window": self.catchup_window, "overlap": self.overlap}


@dataclass(frozen=True)
class SlotRun:
    """The run a schedule's slot fired."""

    schedule: str
    slot: datetime
    run: RunRecord


@dataclass
class Fired:
    """What one firing pass did: runs to send, runs to cancel, and what it passed over."""

    runs: list[SlotRun] = field(default_factory=list)
    #: Runs of earlier slots that the ``cancel_other`` policy stops.
    cancel: list[str] = field(default_factory=list)
    #: (schedule, slots skipped, first, last, reason: "missed" or "overlap", policy).
    skipped: list[tuple[str, int, datetime | None, datetime | None, str, str]] = field(
        default_factory=list)
    #: Schedules left unfired because they cannot be fired faithfully: (name, why).
    broken: list[tuple[str, str]] = field(default_factory=list)
    #: The earliest next slot of an unpaused schedule after the pass, those in
    #: :attr:`broken` left out (None: none).
    next_due: datetime | None = None


@dataclass(frozen=True)
class Overlapping:
    fire: list[datetime]
    buffered: datetime | None
    cancel: bool
    dropped: int


def overlapping(policy: str, due: list[datetime], buffered: datetime | None,
                running: bool) -> Overlapping:
    """Which of the ``due`` slots fire while an earlier slot's run is (or is not) ``running``.

    ``allow_all`` fires each; ``skip`` fires the first only when no run is open;
    ``buffer_one`` keeps one slot back until the open run ends and drops the
    others; ``cancel_other`` fires the newest and stops the open run.
    """
    if policy == "allow_all":
        return Overlapping([*([buffered] if buffered else []), *due], None, False, 0)
    if policy == "cancel_other":
        if not due:
            return Overlapping([], None, False, 0)
        return Overlapping([due[-1]], None, running, len(due) - 1)
    if policy == "buffer_one":
        queue = [*([buffered] if buffered else []), *due]
        if running:
            return Overlapping([], queue[0] if queue else None, False, max(0, len(queue) - 1))
        return Overlapping(queue[:1], queue[1] if len(queue) > 1 else None, False,
                           max(0, len(queue) - 2))
    if running:
        return Overlapping([], None, False, len(due))
    return Overlapping(due[:1], None, False, max(0, len(due) - 1))


class ScheduleStatements(Database):
    """Define, fire, pause, resume and backfill schedules."""

    def _schedule(self, row: Any) -> Schedule:
        m = row._mapping
        values: dict[str, Any] = {
            name: as_utc(m[name]) if isinstance(m[name], datetime) else m[name]
            for name in Schedule.__dataclass_fields__}
        values["paused"] = bool(values["paused"])
        return Schedule(**values)

    def get_schedule(self, name: str) -> Schedule | None:
        table = self.tables.schedules
        with self._read("reading a schedule") as conn:
            row = conn.execute(select(table).where(table.c.name == name)).first()
        return self._schedule(row) if row is not None else None

    def list_schedules(self) -> list[Schedule]:
        table = self.tables.schedules
        with self._read("listing schedules") as conn:
            rows = conn.execute(select(table).order_by(table.c.name)).all()
        return [self._schedule(row) for row in rows]

    def save_schedule(self, definition: Definition, *, origin: str) -> tuple[Schedule, str]:
        """Write a schedule; (its row, ``"added"``, ``"changed"`` or ``"unchanged"``).

        A new schedule's first slot is the first after now. A changed one keeps its
        pause and its counts; when its timing changed, its next slot is the first of
        the new timing after the later of now and its last slot (so no slot fires
        twice, and the old timing's pending slot is dropped).

        Raises ValueError when a schedule of that name was added by the other origin
        (code and run time may not overwrite each other's schedules).
        """
        table = self.tables.schedules
        now = utc_now()
        values = definition.columns()
        with self.transaction("saving a schedule") as conn:
            # Two scheduler processes starting at once both try the insert: one adds the
            # row, the other finds it (and then compares, under the row's lock).
            added = conn.execute(
                self._insert(table).values(
                    name=definition.name, origin=origin, paused=False, fired=0, skipped=0,
                    next_fire_at=definition.spec.next_after(now), created_at=now,
                    updated_at=now, **values)
                .on_conflict_do_nothing(index_elements=[table.c.name])
                .returning(table.c.name)).first()
            row = conn.execute(self.for_update(
                select(table).where(table.c.name == definition.name))).one()
            if added is not None:
                return self._schedule(row), "added"
            old = self._schedule(row)
            if old.origin != origin:
                raise ValueError(
                    f"a schedule named {definition.name!r} exists already, "
                    f"{_origin_text(old.origin)}; remove it first or choose another name")
            if all(getattr(old, key) == value for key, value in values.items()):
                return old, "unchanged"
            changes = dict(values, updated_at=now)
            if old.spec != definition.spec:
                since = max(now, old.last_slot_at or now)
                changes.update(next_fire_at=definition.spec.next_after(since), buffered_at=None)
            conn.execute(update(table).where(table.c.name == definition.name).values(**changes))
            saved = conn.execute(select(table).where(table.c.name == definition.name)).one()
        return self._schedule(saved), "changed"

    def remove_schedule(self, name: str) -> bool:
        """Delete a schedule; False if there was none. Its runs stay."""
        table = self.tables.schedules
        with self._write("removing a schedule") as conn:
            return bool(conn.execute(delete(table).where(table.c.name == name)).rowcount)

    def remove_code_schedules(self, keep: Iterable[str]) -> list[str]:
        """Delete the schedules from code whose names are not in ``keep``; their names."""
        table = self.tables.schedules
        stmt = (delete(table).where(table.c.origin == "code", table.c.name.not_in(list(keep)))
                .returning(table.c.name))
        with self._write("removing schedules no longer declared in code") as conn:
            return sorted(str(name) for name in conn.execute(stmt).scalars())

    def set_paused(self, name: str, paused: bool, note: str | None = None) -> Schedule | None:
        """Pause or resume a schedule; None if there is none of that name.

        A resumed schedule fires from its first slot after now: the slots it was paused
        over do not fire (backfill them to run them).
        """
        table = self.tables.schedules
        now = utc_now()
        with self.transaction("pausing or resuming a schedule") as conn:
            row = conn.execute(self.for_update(
                select(table).where(table.c.name == name))).first()
            if row is None:
                return None
            old = self._schedule(row)
            changes: dict[str, Any] = {"paused": paused, "note": note, "updated_at": now}
            if old.paused and not paused:
                changes["next_fire_at"] = old.spec.next_after(now)
                changes["buffered_at"] = None
            conn.execute(update(table).where(table.c.name == name).values(**changes))
            saved = conn.execute(select(table).where(table.c.name == name)).one()
        return self._schedule(saved)

    def _slot_runs(self, conn: Connection, schedule: Schedule, slots: Sequence[datetime],
                   now: datetime) -> list[SlotRun]:
        """Insert the runs of ``slots`` (those not recorded yet); their records."""
        if not slots:
            return []
        runs = self.tables.runs
        expires = now + timedelta(seconds=self.config.lease_seconds)
        rows: list[dict[str, Any]] = [{"task_id": schedule_run_id(schedule.name, slot),
                 "task_name": schedule.task_name, "status": RUNNING, "attempts": 0,
                 "created_at": now, "updated_at": now, "args": schedule.args,
                 "exchange": schedule.exchange, "routing_key": schedule.routing_key,
                 "priority": schedule.priority, "retries": 0, "recoveries": 0,
                 "interrupted": False, "lease_expires_at": expires} for slot in slots]
        records: dict[str, RunRecord] = {}
        for start in range(0, len(rows), SLOTS_PER_PASS):
            stmt = (self._insert(runs).values(rows[start:start + SLOTS_PER_PASS])
                    .on_conflict_do_nothing(index_elements=[runs.c.task_id])
                    .returning(*runs.c))
            records.update((row.task_id, RunRecord.from_row(row)) for row in conn.execute(stmt))
        ids = [schedule_run_id(schedule.name, slot) for slot in slots]
        return [SlotRun(schedule.name, slot, records[task_id])
                for slot, task_id in zip(slots, ids, strict=True) if task_id in records]

    def fire_due(self, *, now: datetime | None = None,
                 refuse: Callable[[Schedule], str | None] | None = None) -> Fired:
        """One firing pass over the schedules due at ``now`` (the store's clock).

        A schedule that cannot be fired faithfully (its stored timing no longer parses
        here, or ``refuse`` gives a reason, such as a task this process does not know as
        durable) is left as it is, due, and reported in :attr:`Fired.broken`; the
        others fire.
        """
        table, runs = self.tables.schedules, self.tables.runs
        now = now or utc_now()
        fired = Fired()
        with self.transaction("firing due schedules") as conn:
            due = (select(table)
                   .where(table.c.paused.is_(False),
                          or_(table.c.next_fire_at <= now, table.c.buffered_at.is_not(None)))
                   .order_by(table.c.next_fire_at).limit(SCHEDULES_PER_PASS))
            rows = [self._schedule(row) for row in
                    conn.execute(self.for_update(due, skip_locked=True))]
            last = [row.last_run_id for row in rows if row.last_run_id]
            running = set(conn.execute(
                select(runs.c.task_id).where(runs.c.task_id.in_(last),
                                             runs.c.status.not_in(FINISHED))).scalars()
                          ) if last else set()
            for schedule in rows:
                reason = _unfirable(schedule, refuse)
                if reason is not None:
                    fired.broken.append((schedule.name, reason))
                    continue
                self._fire_one(conn, schedule, now, schedule.last_run_id in running, fired)
            broken = [name for name, _reason in fired.broken]
            fired.next_due = conn.execute(
                select(func.min(table.c.next_fire_at))
                .where(table.c.paused.is_(False), table.c.name.not_in(broken))).scalar()
        fired.next_due = as_utc(fired.next_due)
        return fired

    def _fire_one(self, conn: Connection, schedule: Schedule, now: datetime, running: bool,
                  fired: Fired) -> None:
        table = self.tables.schedules
        window = (timedelta(seconds=schedule.catchup_window)
                  if schedule.catchup_window is not None else None)
        due = spec_.due_slots(schedule.spec, schedule.next_fire_at, now,
                              catchup=schedule.catchup,  # type: ignore[arg-type]
                              window=window, limit=SLOTS_PER_PASS)
        if due.skipped:
            fired.skipped.append((schedule.name, due.skipped, due.skipped_from, due.skipped_to,
                                  "missed", f"catchup={schedule.catchup!r}"))
        plan = overlapping(schedule.overlap, due.fire, schedule.buffered_at, running)
        if plan.dropped:
            fired.skipped.append((schedule.name, plan.dropped, None, None, "overlap",
                                  f"overlap={schedule.overlap!r}"))
        if plan.cancel and schedule.last_run_id:
            fired.cancel.append(schedule.last_run_id)
        inserted = self._slot_runs(conn, schedule, plan.fire, now)
        fired.runs.extend(inserted)
        changes: dict[str, Any] = {
            "next_fire_at": due.next_fire_at, "buffered_at": plan.buffered,
            "fired": table.c.fired + len(inserted),
            "skipped": table.c.skipped + due.skipped + plan.dropped}
        if plan.fire:
            changes.update(last_slot_at=plan.fire[-1],
                           last_run_id=schedule_run_id(schedule.name, plan.fire[-1]),
                           updated_at=now)
        conn.execute(update(table).where(table.c.name == schedule.name).values(**changes))

    def backfill(self, name: str, start: datetime, end: datetime) -> tuple[list[SlotRun], int]:
        """Fire every slot of schedule ``name`` from ``start`` to ``end`` (both included)
        that has no run yet; (the runs inserted, the slots in the range).

        Raises LookupError for an unknown schedule, ValueError for a range that is not
        in the past or holds more than :data:`MAX_BACKFILL` slots.
        """
        table = self.tables.schedules
        now = utc_now()
        if end < start:
            raise ValueError(f"the backfill's end {end.isoformat()} is before its start "
                             f"{start.isoformat()}")
        if end > now:
            raise ValueError(f"the backfill's end {end.isoformat()} is in the future (now is "
                             f"{now.isoformat()}): backfill fires past slots only")
        with self.transaction("backfilling a schedule") as conn:
            row = conn.execute(self.for_update(
                select(table).where(table.c.name == name))).first()
            if row is None:
                raise LookupError(name)
            schedule = self._schedule(row)
            slots = spec_.slots(schedule.spec, start, end, MAX_BACKFILL + 1)
            if len(slots) > MAX_BACKFILL:
                raise ValueError(f"the range holds more than {MAX_BACKFILL} slots of schedule "
                                 f"{name!r}; backfill it in shorter ranges")
            inserted = self._slot_runs(conn, schedule, slots, now)
            conn.execute(update(table).where(table.c.name == name)
                         .values(fired=table.c.fired + len(inserted), updated_at=now))
        return inserted, len(slots)


def _unfirable(schedule: Schedule, refuse: Callable[[Schedule], str | None] | None,
               ) -> str | None:
    try:
        schedule.spec  # noqa: B018 - parsed here, so that a bad row stops only itself
    except ValueError as exc:
        return f"its stored timing cannot be used here: {exc}"
    if schedule.catchup not in spec_.CATCHUP_POLICIES:
        return f"its catch-up policy {schedule.catchup!r} is unknown to this release"
    if schedule.overlap not in spec_.OVERLAP_POLICIES:
        return f"its overlap policy {schedule.overlap!r} is unknown to this release"
    return refuse(schedule) if refuse is not None else None


def _origin_text(origin: str) -> str:
    return "declared in beat_schedule" if origin == "code" else "added at run time"
