"""The queries behind the operator commands and the web view: list runs, count them,
prune old ones.

Every function takes a :class:`~celery_duraflow._store.Store` and uses
SQLAlchemy Core on its tables, through the store's ``reading`` and
``transaction`` connections; the CLI and the web view write no SQL of their own.
The listings are written so that the indexes of schema versions 8 and 10 answer
them on a table of millions of runs:

* newest first with no status: ``(created_at)``, or ``(task_name, created_at)``
  with a task name (runs created in the same instant in task id order, so that
  a page of the web view can start after the last run of the previous one);
* newest first with statuses: one branch per status on ``(status, created_at)``,
  each stopping after ``limit`` rows, merged by a ``UNION ALL`` (an ``IN`` list
  would make PostgreSQL read every run of those statuses and sort them);
* prune candidates: ``(status, updated_at)`` of the runs not pruned yet (a
  partial index), oldest first, one status at a time;
* tombstones to delete: ``(pruned_at)`` of the pruned runs (a partial index).

Pruning a run leaves its tombstone: the row keeps its task id, task name,
final status and times (its steps, signals, arguments, result and error go),
so that a late redelivery of the task id is recognised and runs nothing (see
``DurableTask._not_ours``). Tombstones are not listed, counted or shown; a later
prune deletes those older than ``tombstones_older_than`` (by default
:data:`TOMBSTONE_RETENTION`, far longer than any broker redelivery window).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Select,
    and_,
    case,
    delete,
    exists,
    func,
    literal,
    null,
    or_,
    select,
    union_all,
    update,
)

from ._db import LIKE_ESCAPE, like_literal
from ._records import (
    FINISHED,
    REPLACED,
    RUN_STATUSES,
    RUNNING,
    SLEEPING,
    STEP_COMPLETED,
    SUCCEEDED,
    WAITING,
    RunRecord,
    as_utc,
    utc_now,
)
from ._schema import is_marker, marker_name
from ._store import Store
from .errors import RunNotFound, RunStateError

#: The prefix of a patch marker's step name (``_patched.MARKER_PREFIX``, which imports
#: the step machinery this module has no use for).
MARKER_KEY_PREFIX = "patched:"
#: What ``prune`` may delete: runs that have ended.
PRUNABLE = FINISHED
#: Statuses of runs that have not ended; prune never deletes them.
UNFINISHED = tuple(status for status in RUN_STATUSES if status not in FINISHED)
#: The largest prune batch: its task ids are bound parameters of the deletes.
MAX_BATCH_SIZE = 10_000
#: How long a pruned run's tombstone is kept by default. A broker may deliver a message
#: again long after its run ended (Redis after its visibility timeout, one hour by
#: default; SQS after at most twelve hours); a delivery that finds the tombstone runs
#: nothing, one that finds no row would start the run again from nothing.
TOMBSTONE_RETENTION = timedelta(days=7)

_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
_DURATION_PART = re.compile(r"(\d+)([smhdw])")


def parse_duration(text: str) -> timedelta:
    """``30s``, ``15m``, ``2h``, ``30d``, ``1w`` or a sum such as ``1h30m``, as a timedelta.

    Raises ``ValueError`` for anything else (a bare number has no unit and is refused).
    """
    value = text.strip().lower()
    parts = _DURATION_PART.findall(value)
    if not parts or "".join(number + unit for number, unit in parts) != value:
        raise ValueError(f"{text!r} is not a duration: use a number and a unit (s, m, h, d "
                         "or w), such as 30s, 15m, 2h or 30d")
    return timedelta(seconds=sum(int(number) * _UNIT_SECONDS[unit] for number, unit in parts))


def check_statuses(statuses: Iterable[str], allowed: Sequence[str] = RUN_STATUSES) -> list[str]:
    """The statuses without repeats, in the order given; ``ValueError`` for one not allowed."""
    chosen: list[str] = []
    for status in statuses:
        if status not in allowed:
            raise ValueError(f"{status!r} is not one of {', '.join(allowed)}")
        if status not in chosen:
            chosen.append(status)
    return chosen


@dataclass(frozen=True)
class RunSummary:
    """A run as ``runs`` lists it: its row and how many of its steps are recorded."""

    run: RunRecord
    #: Step rows recorded as completed (patch markers and undo records included).
    steps_completed: int
    #: Every step row recorded for the run.
    steps_total: int


def _filters(store: Store, *, task_name: str | None, older_than: timedelta | None,
             newer_than: timedelta | None, now: datetime) -> list[ColumnElement[bool]]:
    runs = store.tables.runs
    # A pruned run's tombstone is not a run to list or count.
    conditions: list[ColumnElement[bool]] = [runs.c.pruned_at.is_(None)]
    if task_name is not None:
        conditions.append(runs.c.task_name == task_name)
    if older_than is not None:
        conditions.append(runs.c.created_at < now - older_than)
    if newer_than is not None:
        conditions.append(runs.c.created_at >= now - newer_than)
    return conditions


#: The columns a brief listing does not read: a run's stored arguments and result, which
#: may be large and which no list of runs shows.
_NOT_LISTED = ("args", "result")


def listing_query(store: Store, *, statuses: Sequence[str] = (), task_name: str | None = None,
                  older_than: timedelta | None = None, newer_than: timedelta | None = None,
                  before: tuple[datetime, str] | None = None, limit: int = 50,
                  now: datetime | None = None, brief: bool = False) -> Select[Any]:
    """The newest ``limit`` runs that match, as one SELECT without OFFSET.

    Newest first by ``created_at``, and runs created in the same instant in
    descending task id order. ``older_than`` and ``newer_than`` compare the
    run's creation time with ``now`` (default: the current time) minus the
    duration. ``before``, the ``(created_at, task_id)`` of the last run of a
    page, keeps only the runs after it in that order (the next page): written
    ``created_at <= t AND (created_at < t OR task_id < id)`` so that its first
    half bounds the index scan on every database. ``brief`` reads NULL instead
    of each run's stored arguments and result.
    """
    runs = store.tables.runs
    columns = [null().label(column.name) if brief and column.name in _NOT_LISTED else column
               for column in runs.c]
    conditions = _filters(store, task_name=task_name, older_than=older_than,
                          newer_than=newer_than, now=now or utc_now())
    if before is not None:
        created_at, task_id = before
        conditions.append(and_(runs.c.created_at <= created_at,
                               or_(runs.c.created_at < created_at, runs.c.task_id < task_id)))
    chosen = check_statuses(statuses)
    if task_name is not None and not chosen:
        # The task's index is (task_name, status, created_at): one range per status.
        chosen = list(RUN_STATUSES)
    newest_first = (runs.c.created_at.desc(), runs.c.task_id.desc())
    if len(chosen) <= 1:
        if chosen:
            conditions.append(runs.c.status == chosen[0])
        return select(*columns).where(*conditions).order_by(*newest_first).limit(limit)
    branches = [
        select(*columns).where(runs.c.status == status, *conditions)
        .order_by(*newest_first).limit(limit).subquery()
        for status in chosen
    ]
    merged = union_all(*(select(branch) for branch in branches)).subquery("matching")
    return (select(merged).order_by(merged.c.created_at.desc(), merged.c.task_id.desc())
            .limit(limit))


def list_runs(store: Store, *, statuses: Sequence[str] = (), task_name: str | None = None,
              older_than: timedelta | None = None, newer_than: timedelta | None = None,
              before: tuple[datetime, str] | None = None, limit: int = 50,
              brief: bool = False) -> list[RunRecord]:
    """The newest ``limit`` runs that match the filters, newest first (one query).

    An empty ``statuses`` means every status; ``older_than`` / ``newer_than``
    keep runs created more / less than that long ago; ``before`` and ``brief``
    are :func:`listing_query`'s (a brief record's ``args`` and ``result`` are None).
    """
    query = listing_query(store, statuses=statuses, task_name=task_name,
                          older_than=older_than, newer_than=newer_than, before=before,
                          limit=limit, brief=brief)
    with store.reading("listing runs") as conn:
        return [RunRecord.from_row(row) for row in conn.execute(query)]


def summary_query(store: Store, **filters: Any) -> Select[Any]:
    """:func:`listing_query` with each run's completed and recorded step counts.

    The counts are subqueries on the steps' primary key, evaluated only for
    the runs on the page.
    """
    steps = store.tables.steps
    page = listing_query(store, **filters).subquery("page")
    total = (select(func.count()).select_from(steps)
             .where(steps.c.task_id == page.c.task_id).scalar_subquery())
    completed = (select(func.count()).select_from(steps)
                 .where(steps.c.task_id == page.c.task_id, steps.c.status == STEP_COMPLETED)
                 .scalar_subquery())
    return (select(page, completed.label("steps_completed"), total.label("steps_total"))
            .order_by(page.c.created_at.desc(), page.c.task_id.desc()))


def summarize_runs(store: Store, *, statuses: Sequence[str] = (), task_name: str | None = None,
                   older_than: timedelta | None = None, newer_than: timedelta | None = None,
                   limit: int = 50) -> list[RunSummary]:
    """Like :func:`list_runs`, with the step counts of each run, in the same single query."""
    query = summary_query(store, statuses=statuses, task_name=task_name,
                          older_than=older_than, newer_than=newer_than, limit=limit)
    with store.reading("listing runs") as conn:
        return [RunSummary(run=RunRecord.from_row(row),
                           steps_completed=int(row._mapping["steps_completed"] or 0),
                           steps_total=int(row._mapping["steps_total"] or 0))
                for row in conn.execute(query)]


def count_by_status(store: Store, *, statuses: Sequence[str] = (), task_name: str | None = None,
                    older_than: timedelta | None = None,
                    newer_than: timedelta | None = None) -> dict[str, int]:
    """How many runs match the filters, per status (statuses with none are left out).

    One ``GROUP BY`` query. Unlike the listing it has no limit, so without a
    task name it reads an index (or the table) from end to end.
    """
    runs = store.tables.runs
    conditions = _filters(store, task_name=task_name, older_than=older_than,
                          newer_than=newer_than, now=utc_now())
    chosen = check_statuses(statuses)
    if chosen:
        conditions.append(runs.c.status.in_(chosen))
    query = (select(runs.c.status, func.count()).where(*conditions)
             .group_by(runs.c.status))
    with store.reading("counting runs") as conn:
        counts = {str(status): int(count) for status, count in conn.execute(query)}
    # In the order of the run statuses, not the database's.
    ordered: dict[str, int] = {status: counts.pop(status) for status in RUN_STATUSES
                               if status in counts}
    ordered.update(counts)
    return ordered


#: How many runs a bounded count reads at most per status (the listings' footers, the
#: dry run of prune, a patch's progress): beyond it, the count says "at least".
COUNT_CAP = 1000


@dataclass(frozen=True)
class StatusCounts:
    """Runs per status, each counted up to :attr:`cap`: a count equal to the cap means
    at least that many (:meth:`at_least`)."""

    counts: dict[str, int]
    cap: int

    def at_least(self, status: str) -> bool:
        """True when the count of ``status`` stopped at the cap: there may be more."""
        return self.counts.get(status, 0) >= self.cap

    @property
    def bounded(self) -> bool:
        """True when some count stopped at the cap."""
        return any(count >= self.cap for count in self.counts.values())

    @property
    def total(self) -> int:
        """The sum of the counts (a lower bound when :attr:`bounded`)."""
        return sum(self.counts.values())

    def text(self, count: int) -> str:
        """A count as shown: ``1,000+`` at the cap, else the number."""
        return f"{count:,}+" if count >= self.cap else f"{count:,}"


def count_by_status_bounded(store: Store, *, statuses: Sequence[str] = (),
                            task_name: str | None = None, older_than: timedelta | None = None,
                            newer_than: timedelta | None = None,
                            cap: int | None = None) -> StatusCounts:
    """How many runs match the filters, per status, each counted up to ``cap``.

    One statement: for each status, a count of at most ``cap`` entries of one
    range of ``(status, created_at)`` (or ``(task_name, status, created_at)``
    with a task name), so its cost does not grow with the table. Statuses with
    none are left out. ``cap`` defaults to :data:`COUNT_CAP`. Use
    :func:`count_by_status` for exact counts, which read every matching run.
    """
    cap = COUNT_CAP if cap is None else cap
    if cap < 1:
        raise ValueError(f"cap must be at least 1, got {cap}")
    runs = store.tables.runs
    conditions = _filters(store, task_name=task_name, older_than=older_than,
                          newer_than=newer_than, now=utc_now())
    chosen = check_statuses(statuses) or list(RUN_STATUSES)
    branches = []
    for status in chosen:
        # In the index's order, so that the planner reads the index (a scan of the
        # table that stops after `cap` rows could read all of it for a rare status).
        some = (select(literal(1).label("one")).where(runs.c.status == status, *conditions)
                .order_by(runs.c.created_at.desc()).limit(cap).subquery())
        branches.append(select(literal(status).label("status"),
                               func.count().label("n")).select_from(some))
    with store.reading("counting runs") as conn:
        counts = {str(status): int(n) for status, n in conn.execute(union_all(*branches)) if n}
    return StatusCounts(counts=counts, cap=cap)


# -- pruning -------------------------------------------------------------------------------


def _prunable(statuses: Iterable[str]) -> list[str]:
    chosen = list(statuses)
    unfinished = [status for status in chosen if status in UNFINISHED]
    if unfinished:
        raise ValueError(f"{', '.join(unfinished)}: prune only deletes runs that have ended "
                         f"({', '.join(PRUNABLE)})")
    return check_statuses(chosen, PRUNABLE) or list(PRUNABLE)


def _may_go(store: Store) -> ColumnElement[bool]:
    """False for a child run whose parent has not ended: the parent may still read it.

    Written as ``parent_id IS NULL OR (the parent's status) NOT IN (...)`` so that
    the check is a primary-key lookup made only for child runs, never a join over
    all runs: a scalar subquery is evaluated per row (PostgreSQL may answer a ``NOT
    EXISTS`` under an ``OR`` with a hash of every unfinished run). A parent that is
    gone does not hold its children back.
    """
    runs = store.tables.runs
    parent = runs.alias("parent")
    parent_status = (select(parent.c.status).where(parent.c.task_id == runs.c.parent_id)
                     .scalar_subquery())
    return or_(runs.c.parent_id.is_(None),
               func.coalesce(parent_status, "").not_in(UNFINISHED))


def prune_candidates_query(store: Store, *, status: str, cutoff: datetime,
                           batch_size: int) -> Select[Any]:
    """The task ids of the next batch to prune for one status, oldest update first.

    On PostgreSQL the rows are locked (``FOR UPDATE SKIP LOCKED``) until the
    batch's transaction ends, so that a concurrent retry cannot bring a run
    back to life between the moment it is chosen and its pruning.
    """
    runs = store.tables.runs
    query = (select(runs.c.task_id)
             .where(runs.c.status == status, runs.c.pruned_at.is_(None),
                    runs.c.updated_at < cutoff, _may_go(store))
             .order_by(runs.c.updated_at)
             .limit(batch_size))
    return store.for_update(query, skip_locked=True, of=runs)


def _check_batch_size(batch_size: int) -> None:
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise ValueError(f"batch_size must be between 1 and {MAX_BATCH_SIZE}, got {batch_size}")


@dataclass(frozen=True)
class PruneBatch:
    """One committed batch of :func:`prune`, as its ``progress`` callback gets it."""

    #: The status this batch pruned.
    status: str
    #: Runs and steps this batch pruned, and the totals so far (this batch included).
    runs: int
    steps: int
    runs_total: int
    steps_total: int
    #: How long the batch's transaction took (choosing, deleting, committing), in seconds:
    #: the longest any of its runs' rows stayed locked.
    seconds: float


def prune(store: Store, *, older_than: timedelta, statuses: Iterable[str] = PRUNABLE,
          batch_size: int = 1000,
          tombstones_older_than: timedelta | None = TOMBSTONE_RETENTION,
          progress: Callable[[PruneBatch], None] | None = None) -> tuple[int, int]:
    """Prune ended runs last updated more than ``older_than`` ago; (runs, steps) pruned.

    Only runs in ``statuses`` (each one of ``succeeded``, ``failed``,
    ``compensated``, ``cancelled``; ``ValueError`` for another) are pruned,
    and never a child run whose parent has not ended. A pruned run loses its
    steps, its signals, its arguments, its result and its error text; its row
    stays as a tombstone (task id, task name, final status, times), so that a
    late redelivery of its task id runs nothing. Each batch of at most
    ``batch_size`` runs is one transaction: choose the task ids, delete their
    steps and signals, then empty the runs' rows into tombstones.

    A batch locks only its own runs' rows, for as long as its transaction
    lasts, and commits before the next one starts: an interrupted prune keeps
    every batch it committed, and running it again goes on from there.
    ``progress``, when given, is called after each committed batch.

    Then tombstones pruned more than ``tombstones_older_than`` ago are
    deleted (see :func:`delete_tombstones`); None keeps them all.
    """
    chosen = _prunable(statuses)
    _check_batch_size(batch_size)
    tables = store.tables
    runs, steps, signals = tables.runs, tables.steps, tables.signals
    now = utc_now()
    cutoff = now - older_than
    runs_pruned = steps_deleted = 0
    for status in chosen:
        candidates = prune_candidates_query(store, status=status, cutoff=cutoff,
                                            batch_size=batch_size)
        while True:
            started = time.perf_counter()
            batch_runs = batch_steps = 0
            with store.transaction("pruning runs") as conn:
                task_ids = list(conn.execute(candidates).scalars())
                if task_ids:
                    batch_steps = conn.execute(
                        delete(steps).where(steps.c.task_id.in_(task_ids))).rowcount
                    conn.execute(delete(signals).where(signals.c.task_id.in_(task_ids)))
                    batch_runs = conn.execute(
                        update(runs).where(runs.c.task_id.in_(task_ids),
                                           runs.c.status == status,
                                           runs.c.pruned_at.is_(None))
                        .values(pruned_at=now, args=None, args_fingerprint=None,
                                result=None, serializer=None, error=None,
                                code_fingerprint=None, exchange=None, routing_key=None,
                                priority=None, lease_owner=None, lease_expires_at=None,
                                wait_kind=None, waiting_for=None, wake_at=None,
                                unwinding=None)).rowcount
            runs_pruned += batch_runs
            steps_deleted += batch_steps
            if task_ids and progress is not None:
                progress(PruneBatch(status=status, runs=batch_runs, steps=batch_steps,
                                    runs_total=runs_pruned, steps_total=steps_deleted,
                                    seconds=time.perf_counter() - started))
            if len(task_ids) < batch_size:
                break
    if tombstones_older_than is not None:
        delete_tombstones(store, older_than=tombstones_older_than, batch_size=batch_size)
    return runs_pruned, steps_deleted


def tombstones_query(store: Store, *, cutoff: datetime, batch_size: int) -> Select[Any]:
    """The task ids of the next batch of tombstones pruned before ``cutoff``, oldest first."""
    runs = store.tables.runs
    query = (select(runs.c.task_id)
             .where(runs.c.pruned_at.is_not(None), runs.c.pruned_at < cutoff)
             .order_by(runs.c.pruned_at)
             .limit(batch_size))
    return store.for_update(query, skip_locked=True, of=runs)


def delete_tombstones(store: Store, *, older_than: timedelta = TOMBSTONE_RETENTION,
                      batch_size: int = 1000) -> int:
    """Delete the tombstones of runs pruned more than ``older_than`` ago; how many went.

    After that a delivery of such a task id is no longer recognised: it
    starts a new run from nothing. Keep ``older_than`` longer than the
    longest time the broker may take to deliver a message again. A signal
    sent to a pruned run is deleted with its tombstone.
    """
    _check_batch_size(batch_size)
    tables = store.tables
    runs, steps, signals = tables.runs, tables.steps, tables.signals
    candidates = tombstones_query(store, cutoff=utc_now() - older_than, batch_size=batch_size)
    deleted = 0
    while True:
        with store.transaction("deleting tombstones of pruned runs") as conn:
            task_ids = list(conn.execute(candidates).scalars())
            if task_ids:
                conn.execute(delete(steps).where(steps.c.task_id.in_(task_ids)))
                conn.execute(delete(signals).where(signals.c.task_id.in_(task_ids)))
                deleted += conn.execute(
                    delete(runs).where(runs.c.task_id.in_(task_ids),
                                       runs.c.pruned_at.is_not(None))).rowcount
        if len(task_ids) < batch_size:
            break
    return deleted


def count_tombstones(store: Store, *, older_than: timedelta = TOMBSTONE_RETENTION,
                     cap: int | None = None) -> int:
    """What :func:`delete_tombstones` would delete now; deletes nothing.

    With ``cap``, counts at most that many (the tombstones' index, oldest first).
    """
    runs = store.tables.runs
    doomed = (select(runs.c.task_id)
              .where(runs.c.pruned_at.is_not(None), runs.c.pruned_at < utc_now() - older_than))
    if cap is not None:
        doomed = doomed.limit(cap)
    query = select(func.count()).select_from(doomed.subquery())
    with store.reading("counting tombstones of pruned runs") as conn:
        return int(conn.execute(query).scalar_one())


def count_prunable(store: Store, *, older_than: timedelta,
                   statuses: Iterable[str] = PRUNABLE,
                   cap: int | None = None) -> tuple[int, int | None]:
    """What :func:`prune` would prune now, as (runs, steps); changes nothing.

    With ``cap``, at most that many runs are counted (oldest update first, one
    range of prune's index per status): a run count equal to the cap means at
    least that many runs, and their steps are not counted (None), so that the
    count costs the same however many runs the store holds. Below the cap, the
    steps of the runs counted are counted too (none are read for no runs).
    """
    chosen = _prunable(statuses)
    runs, steps = store.tables.runs, store.tables.steps
    cutoff = utc_now() - older_than
    branches = [select(runs.c.task_id)
                .where(runs.c.status == status, runs.c.pruned_at.is_(None),
                       runs.c.updated_at < cutoff, _may_go(store))
                for status in chosen]
    if cap is not None:
        # Each branch as a subquery: SQLite refuses a LIMIT inside a compound SELECT.
        limited = [branch.order_by(runs.c.updated_at).limit(cap).subquery()
                   for branch in branches]
        branches = [select(sub.c.task_id) for sub in limited]
    merged = union_all(*branches).subquery("prunable")
    doomed = select(merged.c.task_id)
    if cap is not None:
        doomed = doomed.limit(cap)
    run_count = select(func.count()).select_from(doomed.subquery())
    step_count = (select(func.count()).select_from(steps)
                  .where(steps.c.task_id.in_(doomed)))
    with store.reading("counting runs to prune") as conn:
        doomed_runs = int(conn.execute(run_count).scalar_one())
        if cap is not None and doomed_runs >= cap:
            return doomed_runs, None
        doomed_steps = int(conn.execute(step_count).scalar_one()) if doomed_runs else 0
    return doomed_runs, doomed_steps


# -- operator commands on one run: cancel, retry, and a patch's progress ---------------

def request_cancel(store: Store, task_id: str, *, grace: float) -> tuple[RunRecord | None, bool]:
    """Ask an unfinished run to stop; return it (None if unknown) and whether to send it.

    A sleeping or waiting run is made runnable at once (the caller sends
    it), so that its cancellation and compensations happen now; a running
    run stops at its next step boundary; a run that already ended is
    returned unchanged.
    """
    runs = store.tables.runs
    now = utc_now()
    ask = (
        update(runs)
        .where(runs.c.task_id == task_id, runs.c.status.not_in(FINISHED))
        .values(unwinding=case((runs.c.unwinding == "failure", runs.c.unwinding),
                               else_=literal("cancel")), updated_at=now)
        .returning(*runs.c)
    )
    wake = (
        update(runs)
        .where(runs.c.task_id == task_id, runs.c.status.in_((SLEEPING, WAITING)))
        .values(status=RUNNING, lease_owner=None,
                lease_expires_at=now + timedelta(seconds=grace), updated_at=now,
                wait_kind=None, waiting_for=None, wake_at=None)
        .returning(*runs.c)
    )
    with store.transaction("cancelling the run", task_id) as conn:
        row = conn.execute(ask).first()
        if row is None:
            found = conn.execute(select(runs).where(runs.c.task_id == task_id)).first()
            return (RunRecord.from_row(found) if found is not None else None), False
        woken = conn.execute(wake).first()
    if woken is not None:
        return RunRecord.from_row(woken), True
    return RunRecord.from_row(row), False



def reset_for_retry(store: Store, task_id: str, *, from_step: str | None, grace: float,
                    compensation_prefix: str) -> RunRecord:
    """Make an ended run runnable again under its task id, in one transaction.

    With ``from_step``, the recorded outcome of that step, of the steps
    nested in it and of every step that started after it is discarded, so
    they run again. Refused for a run that has not ended, and, unless
    ``from_step`` is given, for a succeeded run (replaying it would change
    nothing) and for a run whose steps were undone by compensations (their
    recorded outputs describe effects that no longer exist). The retry and
    recovery counts start over; the attempt count goes on.
    """
    runs, steps = store.tables.runs, store.tables.steps
    now = utc_now()
    with store.transaction("resetting the run for a retry", task_id) as conn:
        # A pruned run is gone for this purpose: its steps cannot be replayed.
        query = select(runs).where(runs.c.task_id == task_id, runs.c.pruned_at.is_(None))
        query = store.for_update(query)
        row = conn.execute(query).first()
        if row is None:
            raise RunNotFound(f"no run with task id {task_id} is recorded; check the id.",
                              task_id=task_id)
        run = RunRecord.from_row(row)
        if run.status not in FINISHED or run.unwinding is not None:
            raise RunStateError(
                f"run {task_id} is {run.status}, so it cannot be retried: only a run "
                "that has ended (failed, compensated, cancelled, ignored, rejected or "
                "succeeded) can. Cancel it first if it must stop.", task_id=task_id)
        if run.status == REPLACED:
            replacement = run.replaced_by or "a plain task, not recorded"
            raise RunStateError(
                f"run {task_id} was replaced (Task.replace): its work went on in its "
                "replacement, whose run is recorded under the task id with ~r and the "
                f"replacement's nesting appended (the first: {replacement}). Retry that run "
                "instead.", task_id=task_id)
        if run.status == SUCCEEDED and from_step is None:
            # Every step would be replayed and the same result recorded again: nothing to do.
            raise RunStateError(
                f"run {task_id} succeeded, so sending it again as recorded would replay "
                "every step and change nothing: only a run that failed, was cancelled, "
                "compensated, ignored or rejected is retried as it is. To run steps of a "
                "succeeded run again, name the first of them (--from-step KEY).",
                task_id=task_id)
        undone_keys = [row[0].removeprefix(compensation_prefix) for row in conn.execute(
            select(steps.c.step_key).where(
                steps.c.task_id == task_id,
                steps.c.step_key.like(f"{like_literal(compensation_prefix)}%",
                                      escape=LIKE_ESCAPE),
                steps.c.status == STEP_COMPLETED))]
        undone = len(undone_keys)
        if undone and from_step is None:
            raise RunStateError(
                f"run {task_id} was compensated: {undone} of its steps were undone, so "
                "replaying their recorded outputs would act on effects that no longer "
                "exist. Retry it from the first step that must run again (--from-step "
                "KEY), or send the work again under a new task id.", task_id=task_id)
        if from_step is not None:
            chosen = conn.execute(select(steps).where(
                steps.c.task_id == task_id, steps.c.step_key == from_step)).first()
            if chosen is None:
                raise RunStateError(
                    f"run {task_id} has no step {from_step!r}; `celery -A proj duraflow "
                    f"show {task_id}` lists its steps.", task_id=task_id,
                    step_key=from_step)
            if undone_keys:
                # Every undone step must run again: start no later than the first one.
                first = conn.execute(
                    select(steps.c.step_key, steps.c.started_at)
                    .where(steps.c.task_id == task_id, steps.c.step_key.in_(undone_keys))
                    .order_by(steps.c.started_at).limit(1)).first()
                chosen_at, first_at = as_utc(chosen._mapping["started_at"]), (
                    as_utc(first[1]) if first is not None else None)
                if first is not None and chosen_at and first_at and chosen_at > first_at:
                    raise RunStateError(
                        f"run {task_id} was compensated: step {first[0]!r} was undone, "
                        f"and it comes before {from_step!r}, so a retry from there would "
                        f"replay its recorded output. Retry from {first[0]!r} or an "
                        "earlier step.", task_id=task_id, step_key=from_step)
            # The steps around it failed with it (for good, if it did): they run again.
            parts = from_step.split("/")
            ancestors = ["/".join(parts[:n]) for n in range(1, len(parts))]
            if ancestors:
                conn.execute(update(steps).where(
                    steps.c.task_id == task_id, steps.c.step_key.in_(ancestors),
                    steps.c.status != STEP_COMPLETED).values(body_exit=None))
            conn.execute(steps.delete().where(
                steps.c.task_id == task_id,
                or_(steps.c.step_key == from_step,
                    steps.c.step_key.like(like_literal(from_step) + "/%",
                                          escape=LIKE_ESCAPE),
                    steps.c.started_at >= chosen._mapping["started_at"])))
        # Undo records belong to the ending that is being retried.
        conn.execute(steps.delete().where(
            steps.c.task_id == task_id,
            steps.c.step_key.like(f"{like_literal(compensation_prefix)}%",
                                  escape=LIKE_ESCAPE)))
        updated = conn.execute(
            update(runs).where(runs.c.task_id == task_id)
            .values(status=RUNNING, result=None, serializer=None, error=None,
                    finished_at=None, updated_at=now, lease_owner=None,
                    lease_expires_at=now + timedelta(seconds=grace), retries=0, recoveries=0,
                    unwinding=None, interrupted=False)
            .returning(*runs.c)).one()
    return RunRecord.from_row(updated)



def patch_status(store: Store, marker: str, task_name: str | None = None,
                 limit: int = 100) -> tuple[datetime | None, int, list[RunRecord]]:
    """For a ``patched()`` marker key: when it was first recorded, by how many runs, and
    the unfinished runs that started before that and have not recorded it (they may
    still take the old branch)."""
    first, count, old = patch_progress(store, marker, task_name, limit)
    return first, count, old


def _marker_queries(store: Store, marker: str, *,
                    cap: int | None) -> tuple[ColumnElement[bool], Select[Any], Select[Any]]:
    """The condition on a step key that records ``marker``, the query of its first start
    time, and the one of how many runs recorded it (up to ``cap``)."""
    steps = store.tables.steps
    escaped = like_literal(marker)
    matches = or_(steps.c.step_key == marker,
                  steps.c.step_key.like(f"{escaped}#%", escape=LIKE_ESCAPE),
                  steps.c.step_key.like(f"%/{escaped}", escape=LIKE_ESCAPE),
                  steps.c.step_key.like(f"%/{escaped}#%", escape=LIKE_ESCAPE))
    found: ColumnElement[bool] = matches
    if store.engine.dialect.name == "postgresql" and marker.startswith(MARKER_KEY_PREFIX):
        # The markers' index (version 13) by name; the key match stays, so the rows
        # are exactly those of the match alone.
        found = and_(marker_name(steps) == marker, is_marker(steps), matches)
    first = select(steps.c.started_at).where(found).order_by(steps.c.started_at).limit(1)
    recorded = select(steps.c.task_id).where(found)
    if cap is not None:
        recorded = recorded.limit(cap)
    count = select(func.count(func.distinct(recorded.subquery().c.task_id)))
    return matches, first, count


def patch_progress(store: Store, marker: str, task_name: str | None = None, limit: int = 100,
                   *, cap: int | None = None) -> tuple[datetime | None, int, list[RunRecord]]:
    """:func:`patch_status`, with at most ``cap`` marker rows counted (None: all of them).

    A count equal to ``cap`` means at least that many runs recorded the marker.
    The unfinished runs are read one status at a time, oldest first, through
    ``(status, created_at)`` (or ``(task_name, status, created_at)``), without
    their stored arguments and result (``args`` and ``result`` are None).
    """
    runs, steps = store.tables.runs, store.tables.steps
    matches, first_query, count_query = _marker_queries(store, marker, cap=cap)
    with store.reading("reading a patch marker") as conn:
        first = as_utc(conn.execute(first_query).scalar())
        count = conn.execute(count_query).scalar()
        # Unfinished runs are never pruned: pruned_at IS NULL only lets the live
        # runs' indexes answer.
        conditions = [runs.c.pruned_at.is_(None),
                      ~exists().where(steps.c.task_id == runs.c.task_id, matches)]
        if first is not None:
            conditions.append(runs.c.created_at < first)
        if task_name is not None:
            conditions.append(runs.c.task_name == task_name)
        oldest_first = (runs.c.created_at, runs.c.task_id)
        # Brief rows, as the listings read them: no stored arguments or result.
        columns = [null().label(column.name) if column.name in _NOT_LISTED else column
                   for column in runs.c]
        branches = [select(*columns).where(runs.c.status == status, *conditions)
                    .order_by(*oldest_first).limit(limit).subquery()
                    for status in (RUNNING, SLEEPING, WAITING)]
        merged = union_all(*(select(branch) for branch in branches)).subquery("unfinished")
        stmt = (select(merged).order_by(merged.c.created_at, merged.c.task_id).limit(limit))
        old = [RunRecord.from_row(row) for row in conn.execute(stmt)]
    return first, int(count or 0), old
