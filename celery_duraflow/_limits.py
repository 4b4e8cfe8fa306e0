"""What the step store can hold, checked in Python before anything runs or is written.

PostgreSQL refuses a task id longer than its ``VARCHAR(255)`` column, a step
key or signal name longer than ``VARCHAR(1024)`` and any text containing NUL;
SQLite accepts all of them. Found by the database, such a value shows up only
after a step's body ran, as a driver error that names neither the task nor the
step. Checked here instead, the limits are the same on every database and a
value the store cannot hold is refused before any body runs.

The same goes for the length of a wait: a duration that is NaN, infinite,
negative or too long for a timestamp is refused before the wait is recorded.
The lengths are counted in characters, as PostgreSQL counts ``VARCHAR(n)``.
"""

from __future__ import annotations

import math
import numbers
from datetime import UTC, datetime, timedelta

from ._schema import STEP_KEY_LENGTH, TASK_ID_LENGTH
from .errors import InvalidDuration, InvalidStepName, InvalidTaskId

__all__ = [
    "MAX_WAIT_SECONDS",
    "STEP_KEY_LENGTH",
    "TASK_ID_LENGTH",
    "check_key",
    "check_signal_name",
    "check_task_id",
    "moment",
    "seconds",
    "shown",
]

# The longest sleep or timeout: 100 years (of 365 days). Any wait a run can mean is
# shorter, and its end stays well inside what a timestamp holds.
MAX_WAIT_SECONDS = 100 * 365 * 24 * 3600
# How much of a long value an error message shows.
_SHOWN = 80


def shown(value: object) -> str:
    """``value`` for an error message: whole when short, else its start (and its length)."""
    if isinstance(value, str):
        if len(value) <= _SHOWN:
            return repr(value)
        return f"{value[:_SHOWN]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}..."


def _run(task_id: str) -> str:
    """A task id for an error message: as it is, the way other messages show it, unless
    it is long or holds characters that would garble the line."""
    return task_id if len(task_id) <= _SHOWN and task_id.isprintable() else shown(task_id)


def check_task_id(task_id: object) -> str:
    """Refuse a task id the store cannot hold: not a string, too long, or containing NUL."""
    if not isinstance(task_id, str):
        raise InvalidTaskId(
            f"task id {shown(task_id)} ({type(task_id).__name__}) is not a string, so the run "
            "cannot be recorded. Send the task with a string task_id (Celery's default ids "
            "are).")
    if len(task_id) > TASK_ID_LENGTH:
        problem = (f"is longer than the {TASK_ID_LENGTH} characters the store can hold",
                   "Use a shorter id (Celery's default ids are 36 characters), such as a "
                   "uuid, or a hash of a long natural key.")
    elif "\x00" in task_id:
        problem = ("contains a NUL character, which PostgreSQL cannot store",
                   "Leave NUL out of task ids.")
    else:
        return task_id
    raise InvalidTaskId(
        f"task id {shown(task_id)} {problem[0]}, so it was refused before anything ran or "
        f"was recorded. {problem[1]}",
        task_id=task_id)


def check_key(task_id: str, key: str) -> None:
    """Refuse a step key (a nested one, a wait's) longer than the store can hold."""
    if len(key) <= STEP_KEY_LENGTH:
        return
    depth = key.count("/") + 1
    nesting = f", nested {depth} levels deep," if depth > 1 else ""
    raise InvalidStepName(
        f"step key {shown(key)}{nesting} in task {_run(task_id)} is longer than the "
        f"{STEP_KEY_LENGTH} characters the store can hold (a nested step's key is its "
        "parent's key, '/', then its own name, and a repeated name adds '#N'). Use shorter "
        "step names or nest fewer steps. The run fails rather than retries: a retry would "
        "reach the same key.",
        task_id=task_id, step_key=key)


def check_signal_name(task_id: str, name: object) -> str:
    """Refuse a signal name the store cannot hold, or that no wait could have as its key."""
    if not isinstance(name, str):
        raise InvalidStepName(
            f"signal name {shown(name)} ({type(name).__name__}) for task "
            f"{_run(task_id)} is not a string. A signal's name is the key of the "
            "wait_for_signal() that receives it, such as 'approval'.",
            task_id=task_id)
    problem = None
    if not name:
        problem = "is empty"
    elif len(name) > STEP_KEY_LENGTH:
        problem = f"is longer than the {STEP_KEY_LENGTH} characters the store can hold"
    elif "\x00" in name:
        problem = "contains a NUL character, which PostgreSQL cannot store"
    if problem is not None:
        raise InvalidStepName(
            f"signal name {shown(name)} for task {_run(task_id)} {problem}, so it was not "
            "sent. A signal's name is the key of the wait_for_signal() that receives it "
            "(such as 'approval', or 'parent/approval#2'): send it under that key.",
            task_id=task_id, step_key=name)
    return name


def seconds(value: object, *, task_id: str, key: str, what: str) -> float:
    """The length of a wait in seconds, or InvalidDuration if it cannot be one.

    ``value`` is a number of seconds or a :class:`~datetime.timedelta`; it must be
    finite, not negative, and at most :data:`MAX_WAIT_SECONDS` (100 years).
    ``what`` names the duration in the message, such as "the timeout of signal".
    """
    where = f"{shown(key)} in task {_run(task_id)}"
    if isinstance(value, timedelta):
        result = value.total_seconds()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            result = float(value)
        except (OverflowError, ValueError) as error:
            raise InvalidDuration(
                f"{what} {where} is {shown(value)}, which is not a usable number of "
                f"seconds ({error}). Give a number of seconds up to {MAX_WAIT_SECONDS} "
                "(100 years) or a timedelta.", task_id=task_id, step_key=key) from None
    else:
        raise InvalidDuration(
            f"{what} {where} is {shown(value)} ({type(value).__name__}), not a number "
            "of seconds or a timedelta. Give a number of seconds or a timedelta.",
            task_id=task_id, step_key=key)
    problem = None
    if math.isnan(result):
        problem = "NaN"
    elif math.isinf(result):
        problem = "infinite"
    elif result < 0:
        problem = "negative"
    elif result > MAX_WAIT_SECONDS:
        problem = f"longer than the most a wait may last ({MAX_WAIT_SECONDS}s, 100 years)"
    if problem is not None:
        raise InvalidDuration(
            f"{what} {where} is {problem} ({shown(value)}), so nothing was recorded for "
            f"it. Give a finite number of seconds from 0 to {MAX_WAIT_SECONDS} (100 years), "
            "or a timedelta in that range.",
            task_id=task_id, step_key=key)
    return result


def moment(value: object, *, task_id: str, key: str, what: str) -> datetime:
    """``until=`` as an aware datetime (a naive one is taken as UTC), or InvalidDuration."""
    if not isinstance(value, datetime):
        raise InvalidDuration(
            f"{what} {shown(key)} in task {_run(task_id)} is {shown(value)} "
            f"({type(value).__name__}), not a datetime. Give a datetime (naive ones are taken "
            "as UTC), or a number of seconds.",
            task_id=task_id, step_key=key)
    aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    try:
        aware.astimezone(UTC)
    except (OverflowError, ValueError):
        raise InvalidDuration(
            f"{what} {shown(key)} in task {_run(task_id)} is {value.isoformat()}, which is "
            "out of the range of a timestamp in UTC. Give an earlier moment.",
            task_id=task_id, step_key=key) from None
    return aware
