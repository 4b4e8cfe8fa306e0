"""Exceptions raised by celery-duraflow.

Every exception derives from :class:`DuraflowError`, carries the ``task_id``
and ``step_key`` it concerns (``None`` where there is none) and survives a
round trip through :mod:`pickle`, so a Celery result backend can hand it back
to the caller intact::

    DuraflowError
    ├── ChildFailed               a child run failed (or did not finish in time)
    │   └── ChildTimeout              ... did not finish within the child() timeout
    ├── ConfigurationError        a duraflow_* setting or the database URL is wrong
    ├── InvalidStepName           step() got an empty, non-string or malformed name
    ├── NotInDurableTask          step() was used outside a run of a DurableTask
    ├── RunArgumentsMismatch      a task id was sent again with other arguments
    ├── RunNotFound               no run with that task id is recorded
    ├── SignalTimeout             wait_for_signal() reached its timeout first
    ├── StepInDoubt               an interrupted step asks for a human (on_in_doubt="raise")
    ├── StepNotPrepared           `with step(...)` in code that was not prepared
    ├── StepOutputNotSerializable a step output or task result the serializer refuses
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
    "InvalidStepName",
    "LeaseLost",
    "NotInDurableTask",
    "RunArgumentsMismatch",
    "RunNotFound",
    "SignalTimeout",
    "StepConflict",
    "StepInDoubt",
    "StepNotPrepared",
    "StepOutputNotSerializable",
    "StoreUnavailable",
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
        return (_rebuild, (type(self), self.message, self.task_id, self.step_key))

    def __str__(self) -> str:
        return self.message


class ConfigurationError(DuraflowError, ValueError):
    """A ``duraflow_*`` setting has a value that cannot be used."""


class InvalidStepName(DuraflowError, ValueError):
    """``step()`` was given a name that cannot be used as a step key."""


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


class StepInDoubt(DuraflowError):
    """A step started by an earlier attempt never recorded how it ended.

    Raised instead of running it again when the step was declared with
    ``on_in_doubt="raise"``: someone has to find out whether its side effect
    happened.
    """


class StoreUnavailable(DuraflowError, ConnectionError):
    """The step store could not be reached; nothing was recorded or run.

    It is safe to retry: put it in ``autoretry_for``.
    """


class RunNotFound(DuraflowError, LookupError):
    """No run with the given task id is recorded (it never started, or was pruned)."""


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

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_child, (type(self), self.message, self.task_id, self.step_key,
                                 self.child_id, self.error))


class ChildTimeout(ChildFailed, TimeoutError):
    """A child run did not finish within the ``timeout`` given to ``child()``.

    The child is not stopped; its parent goes on without its result.
    """


def _rebuild_child(cls: type[ChildFailed], message: str, task_id: str | None,
                   step_key: str | None, child_id: str | None,
                   error: str | None) -> ChildFailed:
    return cls(message, task_id=task_id, step_key=step_key, child_id=child_id, error=error)
