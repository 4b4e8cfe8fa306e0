"""``patched()``: change the code of a task while runs of it are in progress.

A replay reruns the task's code and answers completed steps from the store,
so changing the steps of a task breaks the runs that started under the old
code (their replays diverge). ``patched(name)`` keeps both versions apart::

    if patched("price-check"):
        with step("check-price") as s:      # new code
            ...
    with step("book-flight") as s:          # both versions reach this
        ...

A run that reaches the marker for the first time under the new code records
it and takes the new branch, then and on every replay. A run whose old code
already went past that point (it recorded a step at the place the marker is
reached) never recorded the marker, and takes the old branch, then and on
every replay. The marker takes no position among the steps, so removing the
``patched()`` call once no old run remains (keeping the new branch) changes
nothing for the runs that recorded it.
"""

from __future__ import annotations

from datetime import UTC, datetime

from ._context import current_run
from ._limits import check_key
from ._step import check_name
from ._store import STEP_COMPLETED
from .errors import DuraflowError, LeaseLost, NotInDurableTask

# Markers are stored as completed steps under this prefix.
MARKER_PREFIX = "patched:"


def patched(name: str) -> bool:
    """True where this run takes the new code of patch ``name``, False where the old.

    New runs, and runs that had not reached this point under the old code,
    get True (and record it); runs whose old code already went past it get
    False. The answer never changes for a run. Once no run started under the
    old code remains, delete the call and keep the new branch: the marker
    takes no position among the steps, so the runs that recorded it replay
    unchanged.
    """
    ctx = current_run.get()
    check_name(name, ctx)
    if ctx is None:
        raise NotInDurableTask(
            f"patched({name!r}) was reached outside a durable task run, so there is no run "
            "to decide for. Call it from a task with base=DurableTask.",
            step_key=name)
    parent = ctx.stack[-1].key if ctx.stack else ""
    marker = MARKER_PREFIX + name
    count = ctx.occurrences.get((parent, marker), 0) + 1
    key = marker if count == 1 else f"{marker}#{count}"
    key = f"{parent}/{key}" if parent else key
    try:
        check_key(ctx.task_id, key)
    except DuraflowError as error:
        ctx.fatal = error  # the same code reaches the same key on every retry
        raise
    record = ctx.recorded.get(key)
    if record is None and ctx.recorded_at(parent, ctx.reached.get(parent, 0) + 1) is not None:
        # The old code recorded a step at the place this marker is reached: it went past
        # here without the marker.
        return False
    ctx.occurrences[(parent, marker)] = count
    if record is None:
        now = datetime.now(UTC)
        if not ctx.store.record_step(
                ctx.task_id, key, ctx.owner, status=STEP_COMPLETED, started_at=now,
                output=ctx.serializer.dumps(True), serializer=ctx.serializer_name, new=True,
                position=None):
            raise LeaseLost(
                f"task {ctx.task_id} lost its lease at patched({name!r}): another attempt "
                "took the run over. Nothing needs to be done.",
                task_id=ctx.task_id, step_key=key)
        ctx.recorded_any = True
    return True
