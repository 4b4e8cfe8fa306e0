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

from . import _clock
from ._context import current_run
from ._step import check_name
from ._store import STEP_COMPLETED
from .errors import NotInDurableTask

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
    marker = MARKER_PREFIX + name
    parent, key, count = ctx.peek_key(marker)
    record = ctx.recorded.get(key)
    if record is None and ctx.recorded_at(parent, ctx.reached.get(parent, 0) + 1) is not None:
        # The old code recorded a step at the place this marker is reached: it went past
        # here without the marker.
        return False
    ctx.take_key(parent, marker, count)
    if record is None and not ctx.dry:  # a replay check writes nothing, and goes on
        ctx.record(key, f"patched({name!r})", status=STEP_COMPLETED,
                   started_at=_clock.now(), output=ctx.serializer.dumps(True),
                   serializer=ctx.serializer_name, new=True, position=None)
    return True
