"""Exceptions raised by celery-duraflow.

Every exception derives from :class:`DuraflowError`, carries the ``task_id``
and ``step_key`` it concerns (``None`` where there is none) and survives a
round trip through :mod:`pickle`, so a Celery result backend can hand it back
to the caller intact::

    DuraflowError
    ├── ChildFailed               a child run failed (or did not finish in time)
    │   └── ChildTimeout              ... did not finish within the child() timeout
    ├── ConfigurationError        a duraflow_* setting or the database URL is wrong
    │   ├── StoreMisconfigured        ... the store refuses for good (no such database, login)
    │   └── InvalidSchedule           ... a schedule that cannot be stored as given
    ├── InvalidStepName           step() got an empty, non-string, malformed or too long name
    ├── InvalidTaskId             a task id the store cannot hold (too long, not a string)
    ├── InvalidDuration           a sleep or timeout that is NaN, infinite or out of range
    ├── NonDeterministicReplay    a replay reached the recorded steps in another order
    │   ├── StepCodeChanged       ... a completed step's code changed (on_code_change="fail")
    │   └── StepInputChanged      ... a completed step was given another input
    ├── NotInDurableTask          step() was used outside a run of a DurableTask
    ├── RunArgumentsMismatch      a task id was sent again with other arguments
    ├── RunArgumentsNotSerializable a run's arguments cannot be recorded
    ├── RunCancelled              the run was cancelled (its compensations ran)
    ├── RunNotFound               no run with that task id is recorded
    ├── RunStateError             the run's status does not allow the operation
    ├── ScheduleNotFound          no schedule of that name is stored
    ├── SignalTimeout             wait_for_signal() reached its timeout first
    ├── StepInDoubt               an interrupted step asks for a human (on_in_doubt="raise")
    ├── StepNotPrepared           `with step(...)` in code that was not prepared
    ├── StepOutputNotSerializable a step output or task result the serializer refuses
    ├── UnsupportedCode           code that cannot be replayed faithfully (async, yield in a step)
    ├── StepConflict              another attempt of the same run owns the step
    │   └── LeaseLost             this attempt no longer owns its run
    └── StoreUnavailable          the database could not be reached
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ChildFailed",
    "ChildTimeout",
    "ConfigurationError",
    "DuraflowError",
    "InvalidDuration",
    "InvalidSchedule",
    "InvalidStepName",
    "InvalidTaskId",
    "LeaseLost",
    "NonDeterministicReplay",
    "NotInDurableTask",
    "RunArgumentsMismatch",
    "RunArgumentsNotSerializable",
    "RunCancelled",
    "RunNotFound",
    "RunStateError",
    "ScheduleNotFound",
    "SignalTimeout",
    "StepCodeChanged",
    "StepConflict",
    "StepInDoubt",
    "StepInputChanged",
    "StepNotPrepared",
    "StepOutputNotSerializable",
    "StoreMisconfigured",
    "StoreUnavailable",
    "UnsupportedCode",
]


def _rebuild(cls: type[DuraflowError], message: str, task_id: str | None,
             step_key: str | None) -> DuraflowError:
    return cls(message, task_id=task_id, step_key=step_key)


class DuraflowError(Exception):
    """Base class of every celery-duraflow error."""

    def __init__(self, message: str, *, task_id: str | None = None,
                 step_key: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.task_id = task_id
        self.step_key = step_key

    def __reduce__(self) -> tuple[Any, ...]:
        # Extra attributes of subclasses travel as the state pickle restores.
        extra = {k: v for k, v in self.__dict__.items()
                 if k not in ("message", "task_id", "step_key")}
        return (_rebuild, (type(self), self.message, self.task_id, self.step_key), extra)

    def __str__(self) -> str:
        return self.message


class ConfigurationError(DuraflowError, ValueError):
    """A ``duraflow_*`` setting has a value that cannot be used."""


class StoreMisconfigured(ConfigurationError):
    """The store answers, and its answer will not change by waiting: the database does
    not exist, the login is refused, the schema is missing or newer than this release.

    The task fails at once instead of being sent again; the message names the
    database URL (without its password) and what to fix.
    """


class InvalidStepName(DuraflowError, ValueError):
    """``step()`` was given a name that cannot be used as a step key."""


class InvalidTaskId(DuraflowError, ValueError):
    """A task id the store cannot hold: not a string, or longer than its column.

    Refused before the run is recorded and before any step body runs.
    """


class FlowKeyError(DuraflowError, ValueError):
    """A flow-control key (of a Concurrency, RateLimit or Dedupe) could not be computed
    from a run's arguments: the run fails, or the send is refused, before anything runs."""


class InvalidDuration(DuraflowError, ValueError):
    """A sleep or timeout that is NaN, infinite, negative where that means nothing, or
    so far away that no timestamp can hold it.

    Refused before anything is recorded for the wait.
    """


class UnsupportedCode(DuraflowError, TypeError):
    """Code the library cannot replay faithfully, refused where it is prepared.

    An ``async def`` task (Celery calls tasks synchronously); ``yield``,
    ``yield from`` or ``await`` inside a ``with step(...)`` body; a plain
    function given to ``step().arun()``; and steps of one run awaited
    concurrently from several asyncio tasks (``asyncio.gather``), whose order
    could not be replayed.
    """


class AtomicStepError(DuraflowError, RuntimeError):
    """An atomic step whose transaction cannot hold what it promises.

    Its body committed or rolled back the step's transaction itself, left it
    failed, wrote to another database than the store's, waited inside it, or the
    step was nested in an atomic step of another store. Nothing of the body is
    committed and no output is recorded.
    """


class NotInDurableTask(DuraflowError, RuntimeError):
    """A step was reached while no durable run was active in this context."""


class StepNotPrepared(DuraflowError, RuntimeError):
    """``with step(...)`` was entered from a function that was not prepared.

    Task bodies of :class:`~celery_duraflow.DurableTask` are prepared
    automatically; helper functions need :func:`~celery_duraflow.durable`.
    """


class StepOutputNotSerializable(DuraflowError, TypeError):
    """A step output (or a task's return value) cannot be stored."""


class StepConflict(DuraflowError):
    """Another attempt of the same run is executing this step right now."""


class LeaseLost(StepConflict):
    """This attempt's lease on its run expired and another attempt took the run over.

    Nothing this attempt does from then on is recorded; the new owner goes on.
    """


class RunArgumentsMismatch(DuraflowError, ValueError):
    """A task id already recorded was delivered with other arguments or another task name.

    The recorded steps belong to the first arguments; handing them to other
    ones would be wrong, so the delivery is refused.
    """


class RunArgumentsNotSerializable(DuraflowError, TypeError):
    """A run's arguments cannot be recorded with the configured serializer.

    Without them the recovery sweep could not send the run again, and a task
    id re-sent with other arguments could not be told apart, so the run is
    refused at its first attempt, before any step runs.
    """


class StepInDoubt(DuraflowError):
    """A step started by an earlier attempt never recorded how it ended.

    Raised instead of running it again when the step was declared with
    ``on_in_doubt="raise"``: someone has to find out whether its side effect
    happened.
    """


class StoreUnavailable(DuraflowError, ConnectionError):
    """The step store could not be reached.

    The message says whether the step's body ran (a body whose end could not be
    recorded is in doubt on the next attempt). Inside a worker the attempt is
    handed over and the task sent again once the store answers, without
    spending a retry, whether or not ``autoretry_for`` lists it.
    """


class RunNotFound(DuraflowError, LookupError):
    """No run with the given task id is recorded (it never started, or was pruned)."""


class InvalidSchedule(ConfigurationError):
    """A schedule cannot be stored as given: its cron expression does not parse, its time
    zone is unknown, its task is not a registered durable task, its arguments cannot
    be serialized, or a policy is unknown. Nothing is written.

    The schedule's name is in its ``schedule`` attribute; the message says what to change.
    """

    def __init__(self, message: str, *, schedule: str | None = None,
                 task_id: str | None = None, step_key: str | None = None) -> None:
        super().__init__(message, task_id=task_id, step_key=step_key)
        self.schedule = schedule


class ScheduleNotFound(DuraflowError, LookupError):
    """No schedule of the given name is stored (it was never added, or was removed)."""

    def __init__(self, message: str, *, schedule: str | None = None,
                 task_id: str | None = None, step_key: str | None = None) -> None:
        super().__init__(message, task_id=task_id, step_key=step_key)
        self.schedule = schedule


class SignalTimeout(DuraflowError, TimeoutError):
    """``wait_for_signal()`` reached its timeout before the signal arrived.

    Raised again on every later attempt that reaches the same wait: the
    timeout is recorded like any step's outcome.
    """


class ChildFailed(DuraflowError):
    """A child run started with ``child()`` failed for good.

    ``child_id`` is the child's task id and ``error`` the error its run
    recorded.
    """

    def __init__(self, message: str, *, task_id: str | None = None,
                 step_key: str | None = None, child_id: str | None = None,
                 error: str | None = None) -> None:
        super().__init__(message, task_id=task_id, step_key=step_key)
        self.child_id = child_id
        self.error = error


class ChildTimeout(ChildFailed, TimeoutError):
    """A child run did not finish within the ``timeout`` given to ``child()``.

    The child is not stopped; its parent goes on without its result.
    """



class NonDeterministicReplay(DuraflowError):
    """A replay reached the recorded steps in another order than the run recorded them.

    ``position`` is the place among its parent's steps, ``recorded_key`` the
    step recorded there and ``reached_key`` the step the code reached
    instead. The code changed under a running run (or depends on something
    outside its steps). The run is failed, not retried, unless
    ``duraflow_on_divergence = "warn"``.
    """

    def __init__(self, message: str, *, task_id: str | None = None,
                 step_key: str | None = None, position: int | None = None,
                 recorded_key: str | None = None, reached_key: str | None = None) -> None:
        super().__init__(message, task_id=task_id, step_key=step_key)
        self.position = position
        self.recorded_key = recorded_key
        self.reached_key = reached_key


class StepInputChanged(NonDeterministicReplay):
    """A completed step was reached again with another ``input=`` than it recorded."""


class StepCodeChanged(NonDeterministicReplay):
    """A completed step's code is not the code that recorded it.

    Only raised with ``duraflow_on_code_change = "fail"``; by default a warning
    is logged and the stored output is used.
    """


class RunCancelled(DuraflowError):
    """The run was cancelled with ``cancel()``; the compensations of its steps ran."""


class RunStateError(DuraflowError, RuntimeError):
    """The run is in a status that does not allow this (retrying a running run, say)."""
