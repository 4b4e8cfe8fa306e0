"""What the pages show, read from the store: a page of runs, one run in full, and the
schedules.

These functions block (they read the store); the handlers call them in a
thread. The queries are the store's and :mod:`celery_duraflow._admin`'s (the
CLI's listing), a run is shown through its ``RunView``, and schedules through
the library's own functions (:mod:`celery_duraflow._schedules`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from .. import _admin
from .._compensation import COMPENSATION_PREFIX
from .._config import config_for_app
from .._format import join_summary, json_text, step_duration
from .._schedules import Schedule, list_schedules, next_fire_times
from .._serialization import Unreadable, decode
from .._store import (
    FINISHED,
    STEP_COMPLETED,
    STEP_RUNNING,
    STEP_WAITING,
    RunRecord,
    Store,
    store_for,
)
from .._view import RunView, StepView, _run_view, with_queue
from ..errors import ConfigurationError, ScheduleNotFound

#: Runs per page, unless the address asks for another number (at most MAX_PAGE_SIZE).
PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
#: Longest text shown for one value; the rest is cut with a note saying how much.
MAX_SHOWN = 20_000
#: Length of the one-line preview of a step's output in the timeline.
PREVIEW = 120
#: How many of each schedule's next fire times the schedules page shows.
UPCOMING = 3


def store_of(celery_app: Any) -> Store:
    return store_for(config_for_app(celery_app))


# -- the runs page --------------------------------------------------------------------------


@dataclass(frozen=True)
class Cursor:
    """Where a page of runs ends: the (created_at, task_id) of its last row.

    The next page holds the runs strictly after it in the listing's order
    (created_at, then task_id, both descending), so it is found through the
    index on created_at whatever the page number, and a run is never listed
    twice even when several share a creation time.
    """

    created_at: datetime
    task_id: str

    def params(self) -> dict[str, str]:
        return {"before": self.created_at.isoformat(), "before_id": self.task_id}

    @classmethod
    def parse(cls, before: str | None, before_id: str | None) -> Cursor | None:
        """The cursor in a page address; None for the first page, ValueError if malformed."""
        if not before and before_id is None:
            return None
        if not before or before_id is None:
            raise ValueError("a page address needs both 'before' and 'before_id'")
        moment = datetime.fromisoformat(before)
        moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
        return cls(moment, before_id)


@dataclass(frozen=True)
class RunsPage:
    #: The runs' rows, read without their arguments and results.
    rows: list[RunRecord]
    #: Where the next page starts; None on the last page.
    next_cursor: Cursor | None
    #: Runs per status, for the task name filter alone (statuses with none left out),
    #: each counted up to a cap (:class:`~celery_duraflow._admin.StatusCounts`).
    counts: _admin.StatusCounts


def page_query(store: Store, *, status: str | None, task_name: str | None,
               cursor: Cursor | None, limit: int) -> Any:
    """The SELECT of a page: the CLI's listing (:func:`_admin.listing_query`).

    Up to ``limit`` runs, newest first, after ``cursor``: one indexed range
    scan (``(status, created_at)`` with a status, ``(task_name, created_at)``
    with a task name, otherwise ``(created_at)``), with no OFFSET.
    """
    return _admin.listing_query(store, statuses=_statuses(status), task_name=task_name,
                                before=_before(cursor), limit=limit, brief=True)


def _statuses(status: str | None) -> list[str]:
    return [status] if status is not None else []


def _before(cursor: Cursor | None) -> tuple[datetime, str] | None:
    return (cursor.created_at, cursor.task_id) if cursor is not None else None


def load_runs_page(store: Store, *, status: str | None, task_name: str | None,
                   cursor: Cursor | None, limit: int) -> RunsPage:
    """One page of runs (one query, asking for one row more to learn whether a page
    follows) and the counts per status, each up to :data:`_admin.COUNT_CAP` (one
    query whose cost does not grow with the table)."""
    rows = _admin.list_runs(store, statuses=_statuses(status), task_name=task_name,
                            before=_before(cursor), limit=limit + 1, brief=True)
    counts = _admin.count_by_status_bounded(store, task_name=task_name)
    next_cursor = None
    if len(rows) > limit:
        rows = rows[:limit]
        next_cursor = Cursor(rows[-1].created_at, rows[-1].task_id)
    return RunsPage(rows=rows, next_cursor=next_cursor, counts=counts)


# -- one run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shown:
    """A stored value ready to print: its text, or why it could not be read."""

    #: Indented JSON, cut to MAX_SHOWN characters.
    text: str | None = None
    #: Compact JSON on one line, cut to PREVIEW characters.
    preview: str = ""
    problem: str | None = None
    #: Characters left out of ``text``.
    cut: int = 0
    #: Too long for the preview: shown folded, with the whole text inside.
    long: bool = False


def show(value: Any) -> Shown:
    """A value as JSON (``repr`` for what JSON cannot write), indented and on one line.

    A value left undecoded because its row names a serializer that is not
    accepted is shown as that problem.
    """
    if isinstance(value, Unreadable):
        return Shown(problem=str(value))
    text = json_text(value, 2)
    line = json_text(value)
    cut = max(0, len(text) - MAX_SHOWN)
    long = cut > 0 or len(line) > PREVIEW
    return Shown(text=text[:MAX_SHOWN], preview=line[:PREVIEW - 3] + "..." if long else line,
                 cut=cut, long=long)


def _decoded(data: str | None, stored_with: str | None, configured: str, *,
             accept: tuple[str, ...], task_id: str, step_key: str | None,
             what: str | None = None) -> Shown:
    try:
        return show(decode(data, stored_with, configured, accept=accept, task_id=task_id,
                           step_key=step_key, what=what, placeholder=True))
    except ConfigurationError as exc:
        return Shown(problem=str(exc))


@dataclass(frozen=True)
class StepItem:
    """One step of the timeline."""

    view: StepView
    output: Shown | None
    #: Started, and no end was ever recorded.
    in_doubt: bool

    @property
    def duration(self) -> timedelta | None:
        return step_duration(self.view)

    @property
    def compensation(self) -> bool:
        return self.view.key.startswith(COMPENSATION_PREFIX)

    @property
    def undoes(self) -> str:
        """For a compensation record, the key of the step it undoes."""
        return self.view.key.removeprefix(COMPENSATION_PREFIX)


@dataclass(frozen=True)
class RunPage:
    view: RunView
    #: The run's recorded arguments (the view has none).
    args: Shown
    result: Shown | None
    steps: list[StepItem]
    #: Set when some stored value could not be decoded with the configured serializer.
    problem: str | None = None
    errors: list[tuple[str, str]] = field(default_factory=list)
    #: How far each of the run's children() joins has got, one line each.
    joins: list[str] = field(default_factory=list)

    @property
    def compensations(self) -> list[StepItem]:
        return [item for item in self.steps if item.compensation]

    @property
    def finished(self) -> bool:
        return self.view.status in FINISHED


def _step_output(view: StepView) -> Shown | None:
    if view.status in (STEP_COMPLETED, STEP_WAITING):
        return show(view.result)
    return None


def _unreadable(view: RunView) -> str | None:
    """Why the first value the view left undecoded is unreadable, if it left any."""
    for value in (view.result, *(s.result for s in view.steps)):
        if isinstance(value, Unreadable):
            return value.reason
    return None


def load_run_page(celery_app: Any, task_id: str) -> RunPage | None:
    """Everything the run page shows; None when no run has this task id."""
    config = config_for_app(celery_app)
    store = store_for(config)
    record = store.get_run(task_id)
    if record is None:
        return None
    stored_steps = list(store.load_steps(task_id).values())
    problem = None
    try:
        view = with_queue(_run_view(record, stored_steps, config), store)
    except ConfigurationError as exc:
        # A value its (accepted) serializer cannot read: show the rest, each value
        # decoded on its own, and say which.
        problem = str(exc)
        view = _run_view(record, stored_steps, None)
        configured, accept = config.serializer, config.accept_serializers
        result = (_decoded(record.result, record.serializer, configured, accept=accept,
                           task_id=task_id, step_key=None, what="result")
                  if record.result is not None else None)
        outputs = {s.key: (_decoded(s.output, s.serializer, configured, accept=accept,
                                    task_id=task_id, step_key=s.key)
                           if s.status in (STEP_COMPLETED, STEP_WAITING) else None)
                   for s in stored_steps}
    else:
        # Values whose rows name a serializer that is not accepted were left undecoded.
        problem = _unreadable(view)
        result = show(view.result) if view.result is not None else None
        outputs = {s.key: _step_output(s) for s in view.steps}
    args = (_decoded(record.args, None, config.serializer, accept=config.accept_serializers,
                     task_id=task_id, step_key=None, what="arguments")
            if record.args is not None else Shown(problem="the arguments were not recorded"))
    steps = [StepItem(view=s, output=outputs.get(s.key), in_doubt=s.status == STEP_RUNNING)
             for s in view.steps]
    errors = [("run", view.error)] if view.error else []
    errors += [(f"step {s.key}", s.error) for s in view.steps if s.error]
    joins = [join_summary(key, counts) for key, counts in store.join_progress(task_id).items()]
    return RunPage(view=view, args=args, result=result, steps=steps,
                   problem=problem, errors=errors, joins=joins)


# -- the schedules page ---------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduleItem:
    """One schedule of the schedules page."""

    schedule: Schedule
    #: Its next fire times (none while it is paused).
    upcoming: list[datetime]
    #: The status of the run of its last slot; None when it fired none, or that run is
    #: no longer recorded.
    last_status: str | None


def load_schedules_page(celery_app: Any) -> list[ScheduleItem]:
    """Every stored schedule by name, with its next :data:`UPCOMING` fire times and the
    status of its last run."""
    store = store_for(config_for_app(celery_app))
    items = []
    for schedule in list_schedules(app=celery_app):
        try:
            upcoming = next_fire_times(schedule.name, UPCOMING, app=celery_app)
        except ScheduleNotFound:  # removed since the list was read
            continue
        last = store.get_run(schedule.last_run_id) if schedule.last_run_id else None
        items.append(ScheduleItem(schedule=schedule, upcoming=upcoming,
                                  last_status=last.status if last is not None else None))
    return items
