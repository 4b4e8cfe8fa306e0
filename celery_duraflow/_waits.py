"""Waits: durable sleeps, signals from outside, and child runs.

A wait is a step whose end is decided by the clock, by a signal or by
another run instead of by its own code. Reaching one for the first time
records what it waits for and until when (a step row in status
``waiting``); if the wait is not over yet, the attempt ends there: the run's
row says ``sleeping`` or ``waiting``, its lease is released, and no worker is
held. Whatever ends the wait sends the run again with the same task id: the
sweep (:func:`~celery_duraflow.recover`) when a time is up, :func:`send_signal`
for a signal, the child's own end for a child. That delivery replays the run
to the wait, which now completes like any step (its outcome is recorded, so
every later attempt sees the same one) and the code goes on. Short remaining
times are also sent with a broker countdown, so they end on time with nothing
but a worker running.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import shared_task

from . import _atomic, _clock
from ._config import Config, app_and_config
from ._context import ReplayStop, RunContext, Suspended, current_run, describe
from ._limits import check_signal_name, check_task_id, moment
from ._limits import seconds as checked_seconds
from ._parallel import refuse_wait_in_branch
from ._send import eta_limit, routing_of, send_recorded, send_run
from ._serialization import decode, encode_arguments, get_serializer
from ._step import check_name
from ._store import (
    FINISHED,
    SLEEPING,
    STEP_COMPLETED,
    STEP_WAITING,
    SUCCEEDED,
    WAITING,
    RunRecord,
    RunStatus,
    StepRecord,
    StepStatus,
    WaitKind,
    store_for,
)
from ._task import DurableTask
from .errors import (
    AtomicStepError,
    ChildFailed,
    ChildTimeout,
    LeaseLost,
    NotInDurableTask,
    RunNotFound,
    SignalTimeout,
    StepOutputNotSerializable,
)
from .signals import signal_delivered, wait_ended, wait_reached

logger = logging.getLogger("celery_duraflow.waits")

SEND_SIGNAL_TASK_NAME = "celery_duraflow.send_signal"
# Child task ids: uuid5(namespace, "<parent task id>/<step key>").
_CHILD_NAMESPACE = uuid.UUID("0c5b8f5e-61a4-5b0e-8d2e-3f7a9c1d2b4e")


def child_task_id(parent_id: str, key: str) -> str:
    """The task id of the child started at step ``key`` of run ``parent_id``."""
    return str(uuid.uuid5(_CHILD_NAMESPACE, f"{parent_id}/{key}"))


class _Wait:
    """The bookkeeping every kind of wait shares: its key, its row, its outcome."""

    def __init__(self, kind: WaitKind, name: str) -> None:
        ctx = current_run.get()
        check_name(name, ctx)
        if ctx is None:
            raise NotInDurableTask(
                f"{kind} {name!r} was reached outside a durable task run, so there is no run "
                "to suspend. Call it from a task with base=DurableTask that runs through "
                "Celery.",
                step_key=name,
            )
        refuse_wait_in_branch(kind, name, ctx)
        atomic = _atomic.innermost()
        if atomic is not None:
            # The run would suspend with the step's transaction open: it must end first.
            error = AtomicStepError(
                f"{kind} {name!r} in task {ctx.task_id} is inside atomic step "
                f"{atomic.step_key!r}, whose transaction must commit before the run can "
                f"suspend. Put the {kind} before or after the atomic step.",
                task_id=ctx.task_id, step_key=atomic.step_key)
            ctx.fatal = error
            raise error
        self.ctx: RunContext = ctx
        self.kind = kind
        self.key, self.position = ctx.next_key(name)
        ctx.check_order(self.key, self.position, kind)
        self.record: StepRecord | None = ctx.recorded.get(self.key)
        if ctx.dry and not self.done:
            # A replay check: a live attempt would wait, or end the wait, here.
            raise ReplayStop(self.key, f"{kind} {self.key!r}")
        self.now = _clock.now()
        assert ctx.config is not None
        self.config: Config = ctx.config

    def stop_if_unwinding(self) -> None:
        if not self.done:
            self.ctx.stop_if_unwinding(self.key)

    @property
    def done(self) -> bool:
        return self.record is not None and self.record.status == STEP_COMPLETED

    @property
    def waiting(self) -> bool:
        return self.record is not None and self.record.status == STEP_WAITING

    def stored(self) -> dict[str, Any]:
        assert self.record is not None
        value = decode(self.record.output, self.record.serializer, self.ctx.serializer_name,
                       accept=self.ctx.config.accept_serializers if self.ctx.config else (),
                       task_id=self.ctx.task_id, step_key=self.key)
        return value if isinstance(value, dict) else {}

    def until(self) -> datetime | None:
        """The deadline recorded when the wait was first reached."""
        raw = self.stored().get("until") if self.record is not None else None
        if raw is None:
            return None
        moment = raw if isinstance(raw, datetime) else datetime.fromisoformat(str(raw))
        return moment if moment.tzinfo else moment.replace(tzinfo=UTC)

    def write(self, status: StepStatus, output: dict[str, Any]) -> None:
        ctx = self.ctx
        try:
            data = ctx.serializer.dumps(output)
        except Exception as error:
            raise StepOutputNotSerializable(
                f"the outcome of {self.kind} {self.key!r} in task {ctx.task_id} cannot be stored "
                f"with the {ctx.serializer_name!r} serializer ({error}): {describe(output)}. "
                "Send signal payloads and return child results as plain data.",
                task_id=ctx.task_id,
                step_key=self.key,
            ) from error
        ctx.record(self.key, f"{self.kind} {self.key!r}", status=status, started_at=self.now,
                   output=data, serializer=ctx.serializer_name, new=self.record is None,
                   # A wait that ends is not run again: its attempt count stays.
                   claimed=self.record is not None, position=self.position)
        self.record = StepRecord(
            task_id=ctx.task_id, key=self.key, status=status, attempts=1, output=data,
            serializer=ctx.serializer_name, error=None, started_at=self.now,
            completed_at=self.now if status == STEP_COMPLETED else None, position=self.position)
        if status == STEP_COMPLETED and wait_ended.receivers:
            wait_ended.send(sender=ctx.task, task_id=ctx.task_id, step_key=self.key,
                            kind=self.kind, timed_out=self.kind == "sleep"
                            or bool(output.get("timed_out")))

    def lease_lost(self) -> LeaseLost:
        return LeaseLost(
            f"task {self.ctx.task_id} lost its lease at {self.kind} {self.key!r}: another "
            "attempt took the run over, so this one stops here without recording anything. "
            "Nothing needs to be done.",
            task_id=self.ctx.task_id,
            step_key=self.key,
        )

    def suspend(self, status: RunStatus, waiting_for: str, wake_at: datetime | None) -> bool:
        """End the attempt here (raises Suspended), unless the wait is over meanwhile (False)."""
        ctx = self.ctx
        countdown: float | None = None
        sweep_at = wake_at
        if wake_at is not None:
            remaining = max(0.0, (wake_at - _clock.now()).total_seconds())
            task = ctx.task
            eager = bool(task is not None and task.request.is_eager)
            if remaining < min(self.config.eta_threshold, eta_limit(task)) and not eager:
                # The broker brings the run back on time; the sweep is the safety net,
                # a lease later, should that message be lost.
                countdown = remaining
                sweep_at = wake_at + timedelta(seconds=self.config.lease_seconds)
        if not ctx.store.suspend(ctx.task_id, ctx.owner, status=status, kind=self.kind,
                                 waiting_for=waiting_for, wake_at=wake_at, sweep_at=sweep_at):
            return False
        logger.info("task %s is %s at %s %r%s", ctx.task_id, status, self.kind, self.key,
                    f" until {wake_at.isoformat()}" if wake_at else "")
        if wait_reached.receivers:
            wait_reached.send(sender=ctx.task, task_id=ctx.task_id, step_key=self.key,
                              kind=self.kind, status=status, wake_at=wake_at)
        raise Suspended(ctx.task_id, self.key, status, countdown)

    def duration(self, value: float | timedelta | None, what: str) -> float | None:
        """``value`` in seconds, refused (InvalidDuration) unless a wait can last that long.

        Checked on every attempt, before anything is recorded for the wait.
        """
        if value is None:
            return None
        return checked_seconds(value, task_id=self.ctx.task_id, key=self.key, what=what)

    def deadline(self, length: float | None) -> datetime | None:
        """The end of a wait of ``length`` seconds (checked by :meth:`duration`) from now."""
        return None if length is None else self.now + timedelta(seconds=length)


def sleep(name: str, seconds: float | timedelta | None = None, *,
          until: datetime | None = None) -> None:
    """Pause the run for ``seconds`` (or until the moment ``until``), durably.

    The wake-up time is recorded the first time the run reaches this sleep;
    retries, redeliveries and restarts never start it over. While it lasts the
    run is ``sleeping`` and holds no worker. A sleep whose time has passed
    returns at once. Waking needs the sweep (``celery -A proj duraflow wake``
    or :func:`~celery_duraflow.recovery_beat_entry`) unless the time left is
    under ``duraflow_eta_threshold``, which a broker countdown covers as well.
    ``seconds`` (a number or a timedelta) must be finite and from 0 to 100 years, and
    ``until`` a datetime (naive ones are UTC): anything else raises
    :class:`~celery_duraflow.InvalidDuration` before the sleep is recorded.
    """
    if (seconds is None) == (until is None):
        raise TypeError(f"sleep({name!r}) needs either seconds or until=, not both or neither")
    wait = _Wait("sleep", name)
    if until is not None:
        until = moment(until, task_id=wait.ctx.task_id, key=wait.key, what="until= of sleep")
    length = wait.duration(seconds, "the length of sleep")
    wait.stop_if_unwinding()
    if wait.done:
        return
    if wait.waiting:
        wake_at = wait.until()
        assert wake_at is not None
    elif until is not None:
        wake_at = until
    else:
        wake_at = wait.deadline(length)
        assert wake_at is not None
    if _clock.now() >= wake_at:
        wait.write(STEP_COMPLETED, {"until": wake_at})
        return
    if not wait.waiting:
        wait.write(STEP_WAITING, {"until": wake_at})
    if not wait.suspend(SLEEPING, wait.key, wake_at):
        raise wait.lease_lost()


def wait_for_signal(name: str, *, timeout: float | timedelta | None = None) -> Any:
    """Wait until :func:`send_signal` delivers the signal ``name`` to this run; return its payload.

    The signal's name is this wait's step key: ``name`` itself, ``name#2`` for
    the second wait of that name in the run, ``parent/name`` inside a step. A
    signal sent before the run gets here is kept for it. While waiting the run
    is ``waiting`` and holds no worker. With ``timeout`` (seconds, counted from
    the first time the run reached the wait) :class:`~celery_duraflow.SignalTimeout`
    is raised once it has passed, and on every replay after that.
    """
    wait = _Wait("signal", name)
    length = wait.duration(timeout, "the timeout of signal")
    wait.stop_if_unwinding()
    ctx = wait.ctx
    if wait.done:
        return _signal_outcome(wait, wait.stored())
    deadline = wait.until() if wait.waiting else wait.deadline(length)
    while True:
        signal = ctx.store.get_signal(ctx.task_id, wait.key)
        if signal is not None:
            payload = decode(signal.payload, signal.serializer, ctx.serializer_name,
                             accept=ctx.config.accept_serializers if ctx.config else (),
                             task_id=ctx.task_id, step_key=wait.key,
                             what="signal payload")
            outcome = {"signal": wait.key, "payload": payload}
            wait.write(STEP_COMPLETED, outcome)
            return _signal_outcome(wait, wait.stored())
        if deadline is not None and _clock.now() >= deadline:
            outcome = {"signal": wait.key, "timed_out": True, "until": deadline}
            wait.write(STEP_COMPLETED, outcome)
            return _signal_outcome(wait, outcome)
        if not wait.waiting:
            wait.write(STEP_WAITING, {"signal": wait.key, "until": deadline})
        # Not suspended means the signal arrived in between, or the lease is gone: look.
        wait.suspend(WAITING, wait.key, deadline)
        if ctx.store.get_signal(ctx.task_id, wait.key) is None:
            raise wait.lease_lost()


def _signal_outcome(wait: _Wait, outcome: Mapping[str, Any]) -> Any:
    if outcome.get("timed_out"):
        raise SignalTimeout(
            f"task {wait.ctx.task_id} waited for signal {wait.key!r} until {outcome.get('until')} "
            "and none came. Catch SignalTimeout to go on without it, or send the signal sooner.",
            task_id=wait.ctx.task_id,
            step_key=wait.key,
        )
    return outcome.get("payload")


def child(name: str, signature: Any, *, timeout: float | timedelta | None = None) -> Any:
    """Run ``signature`` (a durable task) as a child of this run and return its result.

    The child's task id is derived from this run's id and the step key, so a
    replay never starts a second child. The parent is ``waiting`` while the
    child runs and holds no worker; the child's end wakes it. A child that
    fails for good raises :class:`~celery_duraflow.ChildFailed` here (with the
    child's error); one that does not finish within ``timeout`` seconds raises
    :class:`~celery_duraflow.ChildTimeout` (the child itself goes on).
    """
    wait = _Wait("child", name)
    length = wait.duration(timeout, "the timeout of child")
    wait.stop_if_unwinding()
    ctx = wait.ctx
    if wait.done:
        return _child_outcome(wait, wait.stored())
    child_id = wait.stored().get("child") if wait.waiting else None
    child_id = str(child_id or child_task_id(ctx.task_id, wait.key))
    deadline = wait.until() if wait.waiting else wait.deadline(length)
    if not wait.waiting:
        wait.write(STEP_WAITING, {"child": child_id, "task": _task_name(signature, wait),
                                  "until": deadline})
    run = ctx.store.get_run(child_id)
    if run is None:
        _start_child(wait, signature, child_id)
        run = ctx.store.get_run(child_id)
    while True:
        if run is not None and run.status in FINISHED:
            return _child_outcome(wait, _finish_child(wait, child_id, run))
        if deadline is not None and _clock.now() >= deadline:
            outcome = {"child": child_id, "timed_out": True, "until": deadline}
            wait.write(STEP_COMPLETED, outcome)
            return _child_outcome(wait, outcome)
        wait.suspend(WAITING, child_id, deadline)
        run = ctx.store.get_run(child_id)
        if run is None or run.status not in FINISHED:
            raise wait.lease_lost()


def _task_name(signature: Any, wait: _Wait) -> str:
    name = getattr(signature, "task", None)
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"child {wait.key!r} of task {wait.ctx.task_id} needs a Celery signature of a "
            f"durable task, such as my_task.s(arg); got {describe(signature)}")
    app = wait.ctx.task.app if wait.ctx.task is not None else None
    registered = app.tasks.get(name) if app is not None else None
    if registered is not None and not isinstance(registered, DurableTask):
        raise TypeError(
            f"child {wait.key!r} of task {wait.ctx.task_id} would run {name}, which is not "
            "a DurableTask: its end could not wake the parent. Give it base=DurableTask.")
    return name


def child_row(wait: _Wait, signature: Any, child_id: str, task_name: str,
              ) -> tuple[str, dict[str, Any]]:
    """A child's recorded arguments and routing, from the signature that starts it."""
    ctx = wait.ctx
    options = dict(getattr(signature, "options", {}) or {})
    args = tuple(getattr(signature, "args", ()) or ())
    kwargs = dict(getattr(signature, "kwargs", {}) or {})
    blob, _ = encode_arguments(args, kwargs, ctx.serializer, task_id=child_id,
                               task_name=task_name, serializer_name=ctx.serializer_name)
    return blob, routing_of(options)


def _start_child(wait: _Wait, signature: Any, child_id: str) -> None:
    ctx = wait.ctx
    task_name = _task_name(signature, wait)
    blob, routing = child_row(wait, signature, child_id, task_name)
    ctx.store.create_child_run(child_id, task_name=task_name,
                               parent_id=ctx.task_id, args=blob, **routing)
    clone = signature.clone()
    clone.set(task_id=child_id)
    # No broker round trip for the child's result: the parent reads it from the store.
    # Its row is written: the child's start goes straight to taking it.
    send_recorded(clone)
    logger.info("task %s started child %s (%s) at %r", ctx.task_id, child_id, signature.task,
                wait.key)


def _finish_child(wait: _Wait, child_id: str, run: RunRecord) -> dict[str, Any]:
    ctx = wait.ctx
    if run.status == SUCCEEDED:
        result = decode(run.result, run.serializer, ctx.serializer_name,
                        accept=ctx.config.accept_serializers if ctx.config else (),
                        task_id=child_id, step_key=None, what="result")
        outcome: dict[str, Any] = {"child": child_id, "result": result}
    else:
        outcome = {"child": child_id, "failed": run.status, "error": run.error}
    wait.write(STEP_COMPLETED, outcome)
    return outcome


def _child_outcome(wait: _Wait, outcome: Mapping[str, Any]) -> Any:
    child_id = str(outcome.get("child"))
    task_id = wait.ctx.task_id
    if outcome.get("timed_out"):
        raise ChildTimeout(
            f"child {child_id} started by task {task_id} at {wait.key!r} did not finish by "
            f"{outcome.get('until')}. The child goes on; catch ChildTimeout to continue "
            "without its result.",
            task_id=task_id, step_key=wait.key, child_id=child_id)
    if outcome.get("failed"):
        error = outcome.get("error")
        raise ChildFailed(
            f"child {child_id} started by task {task_id} at {wait.key!r} ended "
            f"{outcome.get('failed')}: {error}. Catch ChildFailed to handle it; retrying the "
            "parent does not run the child again.",
            task_id=task_id, step_key=wait.key, child_id=child_id,
            error=str(error) if error is not None else None)
    return outcome.get("result")


# -- from outside the run -----------------------------------------------------------------


def send_signal(task_id: str, name: str, payload: Any = None, *, app: Any = None) -> bool:
    """Deliver the signal ``name`` to run ``task_id``; True if this call stored it.

    The first payload sent under a name is the one the run gets: later ones
    are ignored (and this returns False). A run already waiting for the
    signal is sent again at once; one that has not reached the wait yet finds
    the signal there when it does. Raises :class:`~celery_duraflow.RunNotFound`
    for an unknown task id, and :class:`~celery_duraflow.InvalidTaskId` or
    :class:`~celery_duraflow.InvalidStepName` (before the store is touched) for an
    id or a name the store could not hold.
    """
    check_task_id(task_id)
    check_signal_name(task_id, name)
    app, config = app_and_config(app)
    store = store_for(config)
    run = store.get_run(task_id)
    if run is None:
        raise RunNotFound(
            f"no run with task id {task_id} is recorded, so signal {name!r} has nowhere to go. "
            "Check the id; a task that was sent but not yet started by a worker has no run "
            "yet: send the signal once it has started.",
            task_id=task_id, step_key=name)
    serializer = get_serializer(config.serializer)
    try:
        data = serializer.dumps(payload)
    except Exception as error:
        raise StepOutputNotSerializable(
            f"the payload of signal {name!r} for task {task_id} cannot be stored with the "
            f"{config.serializer!r} serializer ({error}): {describe(payload)}. Send plain data.",
            task_id=task_id, step_key=name) from error
    stored, woken = store.put_signal(task_id, name, data, config.serializer,
                                     grace=config.lease_seconds)
    if signal_delivered.receivers:
        signal_delivered.send(sender=app, task_id=task_id, name=name, stored=stored)
    if not stored:
        logger.info("signal %r for task %s was already stored; this one is ignored", name,
                    task_id)
    if run.status in FINISHED:
        logger.info("signal %r for task %s arrived after the run ended (%s)", name, task_id,
                    run.status)
        return stored
    if woken is not None:
        send_run(app, woken)
        logger.info("signal %r woke task %s", name, task_id)
    return stored


@shared_task(name=SEND_SIGNAL_TASK_NAME, bind=True)  # type: ignore[untyped-decorator]
def send_signal_task(self: Any, task_id: str, name: str, payload: Any = None) -> bool:
    """:func:`send_signal` as a Celery task, for code that only has a broker at hand::

        app.send_task("celery_duraflow.send_signal", args=(task_id, "approval", {"ok": True}))
    """
    return send_signal(task_id, name, payload, app=self.app)
