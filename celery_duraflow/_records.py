"""What the store's rows are: the record types and the vocabulary of their columns.

A record is one row as the rest of the package sees it (timestamps always UTC-aware).
The statuses, wait kinds and body exits are the only values those columns hold.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal, TypeVar, get_args

from . import _clock

RunStatus = Literal["running", "sleeping", "waiting", "succeeded", "failed", "compensated",
                    "cancelled", "ignored", "rejected", "replaced"]
StepStatus = Literal["running", "completed", "failed", "waiting"]
WaitKind = Literal["sleep", "signal", "child", "children", "slot", "rate", "debounce"]
BodyExit = Literal["return", "break", "continue", "fatal"]

# Run statuses.
RUNNING: Final = "running"
SLEEPING: Final = "sleeping"
WAITING: Final = "waiting"
SUCCEEDED: Final = "succeeded"
FAILED: Final = "failed"
COMPENSATED: Final = "compensated"
CANCELLED: Final = "cancelled"
# Ended the way Celery ends a task without a result: the task raised Ignore, raised
# Reject(requeue=False), or was replaced by another signature (Task.replace).
IGNORED: Final = "ignored"
REJECTED: Final = "rejected"
REPLACED: Final = "replaced"
# A run in one of these has ended for good; nothing runs it again by itself.
FINISHED: tuple[RunStatus, ...] = (SUCCEEDED, FAILED, COMPENSATED, CANCELLED, IGNORED,
                                   REJECTED, REPLACED)
RUN_STATUSES: tuple[RunStatus, ...] = get_args(RunStatus)
# A delivery of a run in one of these never runs it again: a succeeded run answers with its
# result, a replaced run's work belongs to its replacement.
NOT_RERUN: tuple[RunStatus, ...] = (SUCCEEDED, REPLACED)

# Step statuses.
STEP_RUNNING: Final = "running"
STEP_COMPLETED: Final = "completed"
STEP_FAILED: Final = "failed"
# A wait (sleep, signal, child) that was reached and has not ended; its output holds
# what it waits for and until when.
STEP_WAITING: Final = "waiting"

# How a step's `with` body was left (the steps' body_exit column). NULL: it ran to its end.
BODY_RETURN: Final = "return"
BODY_BREAK: Final = "break"
BODY_CONTINUE: Final = "continue"
# On a failed step: the failure is final, no later attempt may run the body by itself.
BODY_FATAL: Final = "fatal"


def as_utc(value: datetime | None) -> datetime | None:
    # SQLite hands timestamps back without a zone; they were written in UTC.
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


@dataclass(frozen=True)
class RunRecord:
    """One row of the runs table."""

    task_id: str
    task_name: str
    status: RunStatus
    attempts: int
    result: str | None
    serializer: str | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    args: str | None = None
    args_fingerprint: str | None = None
    exchange: str | None = None
    routing_key: str | None = None
    retries: int = 0
    recoveries: int = 0
    interrupted: bool = False
    wait_kind: WaitKind | None = None
    waiting_for: str | None = None
    wake_at: datetime | None = None
    parent_id: str | None = None
    code_fingerprint: str | None = None
    unwinding: str | None = None
    #: When prune deleted the run's history, leaving this row as its tombstone.
    pruned_at: datetime | None = None
    #: Set on the row of a Celery task id that was replaced (Task.replace): the run key
    #: of its first durable replacement, ``<task id>~r<nesting>``.
    replaced_by: str | None = None
    #: The broker priority of the message that sent the run (None: the queue's default).
    priority: int | None = None
    #: A child started by ``children()``: the step key of its parent's join.
    join_key: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> RunRecord:
        return from_columns(cls, row._mapping)


@dataclass(frozen=True)
class Delivery:
    """What an attempt knows about the message that started it."""

    task_name: str
    owner: str
    args: str | None = None
    args_fingerprint: str | None = None
    exchange: str | None = None
    routing_key: str | None = None
    retries: int = 0
    code_fingerprint: str | None = None
    priority: int | None = None
    #: The message looks like the run's first: no retry, not flagged as redelivered, not
    #: re-sent after an outage, not marked by the library as a run it recorded. The start
    #: then tries a plain insert of the run's row first (one cheap statement), and only
    #: where the row exists takes the general path.
    first: bool = False


@dataclass(frozen=True)
class StepRecord:
    """One row of the steps table."""

    task_id: str
    key: str
    status: StepStatus
    attempts: int
    output: str | None
    serializer: str | None
    error: str | None
    started_at: datetime
    completed_at: datetime | None
    position: int | None = None
    input_fingerprint: str | None = None
    code_fingerprint: str | None = None
    body_exit: BodyExit | None = None
    returned: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> StepRecord:
        return cls.from_mapping(row._mapping)

    @classmethod
    def from_mapping(cls, m: Any, prefix: str = "") -> StepRecord:
        return from_columns(cls, m, prefix, {"key": "step_key"})


@dataclass(frozen=True)
class SignalRecord:
    """One row of the signals table."""

    task_id: str
    name: str
    payload: str | None
    serializer: str | None
    sent_at: datetime


_R = TypeVar("_R", RunRecord, StepRecord, SignalRecord)


def from_columns(cls: type[_R], m: Any, prefix: str = "",
                  columns: dict[str, str] | None = None) -> _R:
    """A record from a row: each field from its column, timestamps made UTC-aware."""
    names = columns or {}
    values: dict[str, Any] = {}
    for name in (field.name for field in dataclasses.fields(cls)):
        value = m[prefix + names.get(name, name)]
        values[name] = as_utc(value) if isinstance(value, datetime) else value
    return cls(**values)


@functools.lru_cache(maxsize=64)
def _positions(record: str, names: tuple[str, ...], prefix: str,
               renamed: tuple[tuple[str, str], ...]) -> tuple[int, ...]:
    columns = dict(renamed)
    where = {name: i for i, name in enumerate(names)}
    return tuple(where[prefix + columns.get(name, name)] for name in _FIELDS[record])


def reader(cls: type[_R], names: Sequence[str], prefix: str = "",
           columns: dict[str, str] | None = None,
           aware: bool = False) -> Callable[[Sequence[Any]], _R]:
    """Turn rows whose columns are ``names`` into records, finding each column once.

    For result sets read straight from the driver, where a record per row is
    built many times over (a replay reads every step of a run): the positions
    are looked up once per result, not once per row and field. ``aware``: the
    driver already returns zone-aware timestamps (psycopg), so none is fixed.
    """
    positions = _positions(cls.__name__, tuple(names), prefix,
                           tuple(sorted(columns.items())) if columns else ())
    build: Any = cls
    if aware:
        def read_aware(row: Sequence[Any]) -> _R:
            record: _R = build(*map(row.__getitem__, positions))
            return record

        return read_aware

    def read(row: Sequence[Any]) -> _R:
        record: _R = build(*[as_utc(value) if isinstance(value, datetime) else value
                             for value in map(row.__getitem__, positions)])
        return record

    return read


# Each record type's fields, in the order its constructor takes them.
_FIELDS: dict[str, tuple[str, ...]] = {
    cls.__name__: tuple(field.name for field in dataclasses.fields(cls))
    for cls in (RunRecord, StepRecord, SignalRecord)}


def utc_now() -> datetime:
    return _clock.now()
