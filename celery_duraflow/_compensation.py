"""Compensation: undoing the completed steps of a run that failed for good or was cancelled.

``step(name, compensate=undo)`` registers ``undo`` for the step's result when
the step completes, and again when a replay answers it from the store. When
the run fails for good (an exception Celery will not retry) or is cancelled,
the registered undos run in reverse order. Each is recorded like a step, under
``compensate:<step key>``: before the first one runs, the run is marked as
being unwound, so an attempt that dies while compensating is followed by one
that replays the run up to its first unfinished step, skips the undos already
recorded and runs the rest. An undo that raises is tried again a few times;
if it still fails the run ends ``failed`` with its error, after the other
undos have had their turn.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import _clock
from ._context import RunContext
from ._store import (
    CANCELLED,
    COMPENSATED,
    FAILED,
    STEP_COMPLETED,
    STEP_FAILED,
    RunRecord,
    RunStatus,
)
from .errors import LeaseLost
from .signals import compensation_ran, run_finished, run_unwound

logger = logging.getLogger("celery_duraflow.compensation")

COMPENSATION_PREFIX = "compensate:"
# Tries per undo, and the pause before the first retry (doubled each time).
UNDO_ATTEMPTS = 3
UNDO_BACKOFF = 0.2


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__qualname__}: {exc}"
    return text if len(text) <= 2000 else text[:1997] + "..."


def unwind(ctx: RunContext, run: RunRecord, reason: str, error: str | None) -> RunStatus:
    """Run the registered compensations in reverse order and end the run; its final status.

    ``reason`` is ``"cancel"`` or ``"failure"``; ``error`` what made the run
    fail (kept in the run's error).
    """
    store = ctx.store
    if not store.begin_unwinding(ctx.task_id, ctx.owner, reason, error):
        raise LeaseLost(
            f"task {ctx.task_id} lost its lease before its compensations could start; the "
            "attempt that owns the run now will run them. Nothing needs to be done.",
            task_id=ctx.task_id)
    if reason == "cancel":
        logger.info("task %s was cancelled; undoing %d step(s)", ctx.task_id,
                    len(ctx.compensations))
    else:
        logger.warning("task %s failed for good (%s); undoing %d step(s)", ctx.task_id, error,
                       len(ctx.compensations))
    failures: list[str] = []
    for key, undo, value in reversed(ctx.compensations):
        problem = _compensate(ctx, key, undo, value)
        if problem is not None:
            failures.append(problem)
    final_error: str | None
    status: RunStatus
    if failures:
        status = FAILED
        final_error = "; ".join([*([error] if error else []), *failures])
    else:
        status = CANCELLED if reason == "cancel" else COMPENSATED
        final_error = error if reason != "cancel" else (error or "cancelled")
    # A wait the run was stopped at will never end now.
    store.close_waits(ctx.task_id, ctx.owner,
                      "cancelled while waiting" if reason == "cancel" else "the run failed")
    if not store.finish_run(ctx.task_id, ctx.owner, status, error=final_error):
        raise LeaseLost(f"task {ctx.task_id} lost its lease while compensating",
                        task_id=ctx.task_id)
    log = logger.warning if failures else logger.info
    log("task %s is %s", ctx.task_id, status)
    if run_finished.receivers:
        run_finished.send(sender=ctx.task, task_id=ctx.task_id, status=status)
    if run_unwound.receivers:
        run_unwound.send(sender=ctx.task, task_id=ctx.task_id, reason=reason, status=status)
    return status


def _compensate(ctx: RunContext, key: str, undo: Any, value: Any) -> str | None:
    """Undo one step unless that is recorded already; None, or what went wrong."""
    record_key = COMPENSATION_PREFIX + key
    record = ctx.recorded.get(record_key)
    if record is not None and record.status == STEP_COMPLETED:
        logger.debug("step %r of task %s was undone earlier", key, ctx.task_id)
        return None
    new = record is None
    for attempt in range(1, UNDO_ATTEMPTS + 1):
        started = _clock.now()
        try:
            outcome = undo(value)
        except Exception as exc:
            ctx.record(record_key, f"the undo of step {key!r}", status=STEP_FAILED,
                       started_at=started, error=_error_text(exc), new=new)
            new = False
            logger.warning("undoing step %r of task %s failed (try %d of %d): %s", key,
                           ctx.task_id, attempt, UNDO_ATTEMPTS, _error_text(exc))
            if compensation_ran.receivers:
                compensation_ran.send(sender=ctx.task, task_id=ctx.task_id, step_key=key,
                                      attempt=attempt, exception=exc)
            if attempt == UNDO_ATTEMPTS:
                return f"undoing step {key!r} failed: {_error_text(exc)}"
            time.sleep(UNDO_BACKOFF * 2 ** (attempt - 1))
            continue
        try:
            data = ctx.serializer.dumps(outcome)
        except Exception:
            data = ctx.serializer.dumps(None)
        ctx.record(record_key, f"the undo of step {key!r}", status=STEP_COMPLETED,
                   started_at=started, output=data, serializer=ctx.serializer_name, new=new)
        logger.info("step %r of task %s undone", key, ctx.task_id)
        if compensation_ran.receivers:
            compensation_ran.send(sender=ctx.task, task_id=ctx.task_id, step_key=key,
                                  attempt=attempt, exception=None)
        return None
    return None  # pragma: no cover - the loop always returns
