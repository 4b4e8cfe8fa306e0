"""What the pages show, read from the store: a page of runs, and one run in full.

These functions block (they run SQL); the handlers call them in a thread.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Select, and_, or_, select

from .. import _admin
from .._compensation import COMPENSATION_PREFIX
from .._config import config_for_app
from .._format import json_default
from .._serialization import Unreadable, decode
from .._store import (
    FINISHED,
    STEP_COMPLETED,
    STEP_RUNNING,
    STEP_WAITING,
    RunRecord,
    StepRecord,
    Store,
    store_for,
)
from .._view import RunView, StepView, get_run
from ..errors import ConfigurationError

#: Runs per page, unless the address asks for another number (at most MAX_PAGE_SIZE).
PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
#: Longest text shown for one value; the rest is cut with a note saying how much.
MAX_SHOWN = 20_000
#: Length of the one-line preview of a step's output in the timeline.
PREVIEW = 120


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
class RunRow:
    """The columns of a run the list shows (never its arguments or result)."""

    task_id: str
    task_name: str
    status: str
    attempts: int
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    wait_kind: str | None
    waiting_for: str | None
    wake_at: datetime | None
    unwinding: str | None


@dataclass(frozen=True)
class RunsPage:
    rows: list[RunRow]
    #: Where the next page starts; None on the last page.
    next_cursor: Cursor | None
    #: Runs per status, for the task name filter alone (statuses with none left out).
    counts: dict[str, int]


_ROW_COLUMNS = tuple(f.name for f in dataclasses.fields(RunRow))


def page_query(store: Store, *, status: str | None, task_name: str | None,
               cursor: Cursor | None, limit: int) -> Select[Any]:
    """Up to ``limit`` runs, newest first, after ``cursor``: one indexed range scan.

    With a status it reads the ``(status, created_at)`` index, with a task
    name the ``(task_name, created_at)`` one, otherwise ``(created_at)``;
    runs created in the same instant are put in task id order. The cursor
    is written as ``created_at <= t AND (created_at < t OR task_id < id)`` so
    that the first half is a plain index bound on every database.
    """
    runs = store.tables.runs
    conditions = []
    if status is not None:
        conditions.append(runs.c.status == status)
    if task_name is not None:
        conditions.append(runs.c.task_name == task_name)
    if cursor is not None:
        conditions.append(and_(runs.c.created_at <= cursor.created_at,
                               or_(runs.c.created_at < cursor.created_at,
                                   runs.c.task_id < cursor.task_id)))
    return (select(*(runs.c[name] for name in _ROW_COLUMNS)).where(*conditions)
            .order_by(runs.c.created_at.desc(), runs.c.task_id.desc()).limit(limit))


def _aware(value: Any) -> Any:
    # SQLite gives timestamps back without a zone; they were written in UTC.
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


def load_runs_page(store: Store, *, status: str | None, task_name: str | None,
                   cursor: Cursor | None, limit: int) -> RunsPage:
    """One page of runs (one query, asking for one row more to learn whether a page
    follows) and the counts per status (one ``GROUP BY``)."""
    query = page_query(store, status=status, task_name=task_name, cursor=cursor,
                       limit=limit + 1)
    store.ensure_schema()
    with store._unavailable("listing runs"), store.engine.connect() as conn:
        rows = [RunRow(**{name: _aware(row._mapping[name]) for name in _ROW_COLUMNS})
                for row in conn.execute(query)]
    counts = _admin.count_by_status(store, task_name=task_name)
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


def _dump(value: Any, indent: int | None) -> str:
    try:
        return json.dumps(value, indent=indent, ensure_ascii=False, default=json_default)
    except ValueError:  # a value that contains itself
        return repr(value)


def show(value: Any) -> Shown:
    """A value as JSON (``repr`` for what JSON cannot write), indented and on one line.

    A value left undecoded because its row names a serializer that is not
    accepted is shown as that problem.
    """
    if isinstance(value, Unreadable):
        return Shown(problem=str(value))
    text = _dump(value, 2)
    line = _dump(value, None)
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
        if self.view.completed_at is None:
            return None
        return self.view.completed_at - self.view.started_at

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
    #: The run's row, for its arguments and unwinding state (None if it just vanished).
    record: RunRecord | None
    args: Shown
    result: Shown | None
    steps: list[StepItem]
    #: Set when some stored value could not be decoded with the configured serializer.
    problem: str | None = None
    errors: list[tuple[str, str]] = field(default_factory=list)

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
    """Why the first value get_run left undecoded is unreadable, if it left any."""
    for value in (view.result, *(s.result for s in view.steps)):
        if isinstance(value, Unreadable):
            return value.reason
    return None


def _fallback_view(record: RunRecord, steps: list[StepRecord], configured: str,
                   accept: tuple[str, ...],
                   ) -> tuple[RunView, Shown | None, dict[str, Shown | None]]:
    """The run without decoding anything, and each value decoded on its own."""
    outputs: dict[str, Shown | None] = {}
    views = []
    for s in steps:
        outputs[s.key] = (_decoded(s.output, s.serializer, configured, accept=accept,
                                   task_id=s.task_id, step_key=s.key)
                          if s.status in (STEP_COMPLETED, STEP_WAITING) else None)
        views.append(StepView(key=s.key, status=s.status, attempts=s.attempts,
                              started_at=s.started_at, completed_at=s.completed_at, result=None,
                              error=s.error, position=s.position,
                              input_fingerprint=s.input_fingerprint,
                              code_fingerprint=s.code_fingerprint))
    result = (_decoded(record.result, record.serializer, configured, accept=accept,
                       task_id=record.task_id, step_key=None, what="result")
              if record.result is not None else None)
    view = RunView(task_id=record.task_id, task_name=record.task_name, status=record.status,
                   attempts=record.attempts, result=None, error=record.error,
                   created_at=record.created_at, updated_at=record.updated_at,
                   finished_at=record.finished_at, steps=tuple(views),
                   wait_kind=record.wait_kind, waiting_for=record.waiting_for,
                   wake_at=record.wake_at, parent_id=record.parent_id,
                   code_fingerprint=record.code_fingerprint)
    return view, result, outputs


def load_run_page(celery_app: Any, task_id: str) -> RunPage | None:
    """Everything the run page shows; None when no run has this task id."""
    config = config_for_app(celery_app)
    store = store_for(config)
    record = store.get_run(task_id)
    if record is None:
        return None
    problem = None
    try:
        view = get_run(task_id, app=celery_app)
    except ConfigurationError as exc:
        # A value its (accepted) serializer cannot read: show the rest, and say which.
        problem = str(exc)
        view, result, outputs = _fallback_view(
            record, list(store.load_steps(task_id).values()), config.serializer,
            config.accept_serializers)
    else:
        if view is None:  # deleted between the two reads
            return None
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
    return RunPage(view=view, record=record, args=args, result=result, steps=steps,
                   problem=problem, errors=errors)
