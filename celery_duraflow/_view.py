"""Read-only views of recorded runs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from ._config import Config, app_and_config
from ._flow_store import QueuePlace
from ._serialization import decode
from ._store import STEP_COMPLETED, STEP_WAITING, RunRecord, StepRecord, store_for


@dataclass(frozen=True)
class StepView:
    """One recorded step of a run."""

    key: str
    status: str
    attempts: int
    started_at: datetime
    completed_at: datetime | None
    #: The stored output; for a wait that has not ended (status ``waiting``), what it
    #: waits for and until when. An ``Unreadable`` placeholder
    #: when its row names a serializer the configuration does not accept.
    result: Any
    error: str | None
    position: int | None = None
    #: Fingerprints of the step's ``input=`` and of its code, as recorded.
    input_fingerprint: str | None = None
    code_fingerprint: str | None = None


@dataclass(frozen=True)
class RunView:
    """A run as the store knows it, with its steps in the order they first started."""

    task_id: str
    task_name: str
    status: str
    attempts: int
    result: Any
    error: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    steps: tuple[StepView, ...]
    #: While ``sleeping`` or ``waiting``: what for ("sleep", "signal" or "child"), and
    #: the sleep's step key, the signal's name or the child's task id.
    wait_kind: str | None = None
    waiting_for: str | None = None
    #: When a sleep ends or a wait times out (None: no timeout).
    wake_at: datetime | None = None
    #: The run that started this one with child(), if any.
    parent_id: str | None = None
    #: The fingerprint of the task's code when the run started.
    code_fingerprint: str | None = None
    #: Celery's retry count of the latest delivery, and how often the sweep re-sent the
    #: run after its worker vanished.
    retries: int = 0
    recoveries: int = 0
    #: "cancel" once cancel() was asked for, "failure" while a failed run is compensated.
    unwinding: str | None = None
    #: Who holds the run now (the attempt's process) and until when, if anyone.
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    #: Set when the task was replaced (Task.replace): the task id under which its first
    #: durable replacement's run is recorded (``<task id>~r<nesting>``).
    replaced_by: str | None = None
    #: While waiting for a concurrency slot (``wait_kind`` "slot"): its place in the
    #: queue of each key it is queued for.
    queue: tuple[QueuePlace, ...] = ()

    def step(self, key: str) -> StepView:
        """The step stored under ``key``; ``KeyError`` if there is none."""
        for view in self.steps:
            if view.key == key:
                return view
        raise KeyError(f"run {self.task_id} has no step {key!r}")


def _step_view(record: StepRecord, config: Config | None) -> StepView:
    result = None
    if config is not None and record.status in (STEP_COMPLETED, STEP_WAITING):
        result = decode(record.output, record.serializer, config.serializer,
                        accept=config.accept_serializers, task_id=record.task_id,
                        step_key=record.key, placeholder=True)
    return StepView(key=record.key, status=record.status, attempts=record.attempts,
                    started_at=record.started_at, completed_at=record.completed_at,
                    result=result, error=record.error, position=record.position,
                    input_fingerprint=record.input_fingerprint,
                    code_fingerprint=record.code_fingerprint)


def _run_view(run: RunRecord, steps: list[StepRecord], config: Config | None) -> RunView:
    """The view of a run's row and its step rows, its values decoded as ``config`` says.

    With ``config`` None nothing is decoded (the run's and the steps' ``result``
    are None): for a reader that decodes them one at a time because one of them
    cannot be decoded (``ConfigurationError``).
    """
    result = None
    if config is not None:
        result = decode(run.result, run.serializer, config.serializer,
                        accept=config.accept_serializers, task_id=run.task_id, step_key=None,
                        what="result", placeholder=True)
    return RunView(task_id=run.task_id, task_name=run.task_name, status=run.status,
                   attempts=run.attempts, result=result, error=run.error,
                   created_at=run.created_at, updated_at=run.updated_at,
                   finished_at=run.finished_at,
                   steps=tuple(_step_view(s, config) for s in steps),
                   wait_kind=run.wait_kind, waiting_for=run.waiting_for, wake_at=run.wake_at,
                   parent_id=run.parent_id, code_fingerprint=run.code_fingerprint,
                   retries=run.retries, recoveries=run.recoveries, unwinding=run.unwinding,
                   lease_owner=run.lease_owner, lease_expires_at=run.lease_expires_at,
                   replaced_by=run.replaced_by)


def get_run(task_id: str, *, app: Any = None) -> RunView | None:
    """The recorded state of the run with this Celery task id, or ``None``.

    ``app`` defaults to Celery's current app; its ``duraflow_*`` settings
    say which database to read. A value whose row names a serializer that is
    neither ``duraflow_serializer`` nor in ``duraflow_accept_serializers`` is
    not decoded: an ``Unreadable`` placeholder stands
    in for it (``str()`` of it says so).
    """
    app, config = app_and_config(app)
    store = store_for(config)
    run = store.get_run(task_id)
    if run is None:
        return None
    view = _run_view(run, list(store.load_steps(task_id).values()), config)
    return with_queue(view, store)


def with_queue(view: RunView, store: Any) -> RunView:
    """``view`` with its place in the queues of its concurrency limits, if it waits in any."""
    if view.wait_kind != "slot":
        return view
    return replace(view, queue=tuple(store.queued(view.task_id)))
