"""Fan-out: start many child runs at one step and join their results, durably.

``children("charge-all", [charge.s(order) for order in orders])`` starts one child
run per signature and returns their results in the order given. The children's
task ids are derived from the run's id, the step key and each child's place, so an
attempt that starts them again (after a crash, a retry) inserts no second copy; and
their rows are written before any message is sent, so a child whose message is lost
is sent by the sweep from its row. While any child is open the parent is
``waiting`` and holds no worker: the end that leaves no child of the join open
sends it again, and that attempt replays to the join, which records the outcome of
every child once (a step like any other: later attempts read it from there).

The rule for failures: the join waits for every child to end. Then, if some
failed for good, it raises :class:`~celery_duraflow.ChildFailed` for the first of
them in the order given (its message says how many failed), or, with
``return_exceptions=True``, returns the list with a ``ChildFailed`` in the place of
each failed child. A child never runs again because a sibling failed, and
retrying the parent starts none again. ``timeout`` bounds the wait: past it the
join raises :class:`~celery_duraflow.ChildTimeout` and the open children go on.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from . import _clock
from ._joins_store import JoinChild, NewChild
from ._send import send_recorded
from ._serialization import decode
from ._store import FINISHED, STEP_COMPLETED, STEP_WAITING, SUCCEEDED, WAITING
from ._waits import _task_name, _Wait, child_row
from .errors import ChildFailed, ChildTimeout, NonDeterministicReplay

logger = logging.getLogger("celery_duraflow.waits")

# Join children's task ids: uuid5(namespace, "<parent task id>/<step key>/<place>"); a
# namespace of their own, so that no child() id can be one of them.
_JOIN_NAMESPACE = uuid.UUID("5d0e3c1a-8f6b-5e2d-9a47-b1c2d3e4f506")


def join_child_id(parent_id: str, key: str, index: int) -> str:
    """The task id of the child at place ``index`` of the join at step ``key`` of run
    ``parent_id``."""
    return str(uuid.uuid5(_JOIN_NAMESPACE, f"{parent_id}/{key}/{index}"))


def children(name: str, signatures: Iterable[Any], *,
             timeout: float | timedelta | None = None,
             return_exceptions: bool = False) -> list[Any]:
    """Run each of ``signatures`` (durable tasks) as a child of this run, and return their
    results in the same order once every one of them has ended.

    The children start at once and run in parallel on whatever workers take them;
    the parent waits without holding a worker. Each child's task id is derived from
    this run, the step key and its place, so a replay never starts a second copy,
    and a changed number of signatures at a replay is refused
    (:class:`~celery_duraflow.NonDeterministicReplay`). A child that failed for good
    raises :class:`~celery_duraflow.ChildFailed` once all have ended (the first in
    order), unless ``return_exceptions``, which puts the ``ChildFailed`` in its
    place in the list. Past ``timeout`` seconds the join raises
    :class:`~celery_duraflow.ChildTimeout`; the open children go on.
    """
    wait = _Wait("children", name)
    length = wait.duration(timeout, "the timeout of children")
    wait.stop_if_unwinding()
    if wait.done:
        return _outcome(wait, wait.stored(), return_exceptions)
    given = list(signatures)
    names = [_task_name(signature, wait) for signature in given]
    ctx = wait.ctx
    ids = [join_child_id(ctx.task_id, wait.key, index) for index in range(len(given))]
    if wait.waiting:
        recorded = wait.stored().get("children")
        if recorded != len(given):
            raise NonDeterministicReplay(
                f"children {wait.key!r} of task {ctx.task_id} started {recorded} children, "
                f"and this attempt reached it with {len(given)} signatures: the code or its "
                "inputs changed under the running run. The children started stand; give "
                "the join the same signatures, or let the run fail and start a new one.",
                task_id=ctx.task_id, step_key=wait.key)
        deadline = wait.until()
    else:
        deadline = wait.deadline(length)
        wait.write(STEP_WAITING, {"children": len(given), "until": deadline})
    if given:
        _start(wait, given, names, ids)
    while True:
        found = ctx.store.join_children(ctx.task_id, wait.key)
        if _all_ended(ids, found):
            outcome = _ended(wait, ids, found)
            wait.write(STEP_COMPLETED, outcome)
            return _outcome(wait, outcome, return_exceptions)
        if deadline is not None and _clock.now() >= deadline:
            ended = sum(1 for child_id in ids
                        if child_id in found and found[child_id].status in FINISHED)
            outcome = {"children": len(ids), "timed_out": True, "until": deadline,
                       "ended": ended}
            wait.write(STEP_COMPLETED, outcome)
            return _outcome(wait, outcome, return_exceptions)
        wait.suspend(WAITING, wait.key, deadline)
        # Not suspended: every child ended meanwhile (or the lease was lost, which the
        # next read shows as a child still open).
        found = ctx.store.join_children(ctx.task_id, wait.key)
        if not _all_ended(ids, found):
            raise wait.lease_lost()


def _start(wait: _Wait, given: list[Any], names: list[str], ids: list[str]) -> None:
    """Record the children not recorded yet and send them; on a later attempt, send again
    the recorded ones no delivery has taken yet (their message may never have left)."""
    ctx = wait.ctx
    rows: list[NewChild] = []
    for signature, task_name, child_id in zip(given, names, ids, strict=True):
        blob, routing = child_row(wait, signature, child_id, task_name)
        rows.append(NewChild(task_id=child_id, task_name=task_name, args=blob, **routing))
    inserted = set(ctx.store.create_join_children(ctx.task_id, wait.key, rows))
    unsent = inserted
    if len(inserted) < len(ids):
        # An earlier attempt recorded some: those never taken are sent again (a copy of
        # a message still queued costs one delivery that finds the run taken or ended).
        found = ctx.store.join_children(ctx.task_id, wait.key)
        unsent = {child_id for child_id, child in found.items()
                  if child.status == "running" and child.attempts == 0}
    for signature, child_id in zip(given, ids, strict=True):
        if child_id in unsent:
            clone = signature.clone()
            clone.set(task_id=child_id)
            send_recorded(clone)
    logger.info("task %s started %d of %d children at %r", ctx.task_id, len(inserted),
                len(ids), wait.key)


def _all_ended(ids: list[str], found: Mapping[str, JoinChild]) -> bool:
    return all(child_id in found and found[child_id].status in FINISHED for child_id in ids)


def _ended(wait: _Wait, ids: list[str], found: Mapping[str, JoinChild]) -> dict[str, Any]:
    """The join's outcome once every child ended: results in order, and the failures."""
    ctx = wait.ctx
    accept = ctx.config.accept_serializers if ctx.config else ()
    results: list[Any] = []
    failed: list[dict[str, Any]] = []
    for index, child_id in enumerate(ids):
        child = found[child_id]
        if child.status == SUCCEEDED:
            results.append(decode(child.result, child.serializer, ctx.serializer_name,
                                  accept=accept, task_id=child_id, step_key=None,
                                  what="result"))
        else:
            results.append(None)
            failed.append({"index": index, "child": child_id, "status": child.status,
                           "error": child.error})
    return {"children": len(ids), "results": results, "failed": failed}


def _outcome(wait: _Wait, outcome: Mapping[str, Any], return_exceptions: bool) -> list[Any]:
    task_id, key = wait.ctx.task_id, wait.key
    count = int(outcome.get("children") or 0)
    if outcome.get("timed_out"):
        raise ChildTimeout(
            f"{outcome.get('ended')} of the {count} children started by task {task_id} at "
            f"{key!r} had ended by {outcome.get('until')}. The others go on; catch "
            "ChildTimeout to continue without their results.",
            task_id=task_id, step_key=key)
    results = list(outcome.get("results") or [])
    entries = list(outcome.get("failed") or [])
    failures = [_failure(task_id, key, count, len(entries), dict(entry)) for entry in entries]
    if failures and not return_exceptions:
        raise failures[0]
    for entry, failure in zip(entries, failures, strict=True):
        results[int(entry["index"])] = failure
    return results


def _failure(task_id: str, key: str, count: int, failed: int,
             entry: dict[str, Any]) -> ChildFailed:
    child_id, error = str(entry.get("child")), entry.get("error")
    return ChildFailed(
        f"child {child_id} (place {entry.get('index')} of {count}; {failed} of them failed) "
        f"started by task {task_id} at {key!r} ended {entry.get('status')}: {error}. "
        "Catch ChildFailed to handle it "
        "(children(..., return_exceptions=True) returns each failure in its place); "
        "retrying the parent runs no child again.",
        task_id=task_id, step_key=key, child_id=child_id,
        error=str(error) if error is not None else None)
