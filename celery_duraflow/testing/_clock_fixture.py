"""A clock a test moves by hand, and the sweep that runs whenever it moves.

The library reads one clock (``celery_duraflow._clock``) for every time it
stores or compares. :func:`controlled_clock` replaces it, for a ``with``
block, with a :class:`DuraflowClock` that stands still until the test
advances it. Advancing stops at every moment a sleep ends or a wait times out
on the way and runs the recovery sweep there, so a run that sleeps for a day
wakes on time, in this process when the app is eager, in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

from .. import _clock
from .._recovery import sweep
from ._store_fixture import DuraflowStore

# More sweeps than this in one advance() means runs keep waking each other for ever.
_MAX_SWEEPS = 10_000


def _aware(moment: datetime) -> datetime:
    if not isinstance(moment, datetime):
        raise TypeError(f"expected a datetime, got {moment!r}")
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


class DuraflowClock:
    """The time as the library sees it during a test: what ``duraflow_clock`` gives.

    It stands still between calls to :meth:`advance`, so every timestamp the
    library stores meanwhile is exactly :meth:`now`.
    """

    def __init__(self, store: DuraflowStore, start: datetime) -> None:
        self._store = store
        self._now = _aware(start)

    def __repr__(self) -> str:
        return f"<DuraflowClock {self._now.isoformat()}>"

    def now(self) -> datetime:
        """The current test time (timezone-aware, UTC)."""
        return self._now

    def advance(self, delta: timedelta | float | None = None, /, *, days: float = 0,
                hours: float = 0, minutes: float = 0, seconds: float = 0) -> list[str]:
        """Move the clock forward and wake every run that falls due on the way.

        Give a ``timedelta`` or a number of seconds, and/or ``days=``,
        ``hours=``, ``minutes=``, ``seconds=`` (they add up); nothing at all
        just runs the sweep at the current time. Returns the task ids of the
        runs the sweep sent, in order (a run woken twice appears twice).
        """
        if isinstance(delta, bool) or not isinstance(delta, timedelta | int | float | None):
            raise TypeError(f"advance() takes a timedelta or a number of seconds, not {delta!r}")
        step = delta if isinstance(delta, timedelta) else timedelta(seconds=delta or 0)
        step += timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
        if step < timedelta(0):
            raise ValueError(f"the test clock only moves forward; advance() was given {step}")
        return self.advance_to(self._now + step)

    def advance_to(self, moment: datetime) -> list[str]:
        """Move the clock forward to ``moment`` (naive means UTC), waking runs on the way.

        The clock stops at each moment a run falls due (a sleep's end, a wait's
        timeout, a lease that ran out), oldest first, and sweeps there: a run
        woken at one of them may fall due again before ``moment`` and is woken
        then too, as a sweeper running all along would. Returns the task ids
        sent, in order.
        """
        target = _aware(moment)
        if target < self._now:
            raise ValueError(f"the test clock only moves forward: it is {self._now.isoformat()}, "
                             f"and {target.isoformat()} is earlier")
        app = self._store.app
        store = self._store._store
        woken: list[str] = []
        for _ in range(_MAX_SWEEPS):
            due = store.next_due(target)
            self._now = target if due is None else max(self._now, due)
            result = sweep(app)
            woken.extend(result.sent)
            if result.sent or result.failed:
                continue
            if self._now >= target:
                return woken
            # A run due now that the sweep did not take (another sweeper has it): go on.
            self._now = target
        raise RuntimeError(
            f"advancing the test clock to {target.isoformat()} swept {_MAX_SWEEPS} times and "
            f"runs were still falling due (last sent: {woken[-5:]}); do runs keep waking one "
            "another without end?")


@contextmanager
def controlled_clock(store: DuraflowStore,
                     start: datetime | None = None) -> Iterator[DuraflowClock]:
    """Make a :class:`DuraflowClock` the library's clock for the ``with`` block.

    It starts at ``start`` (default: the current time) and sweeps ``store``'s
    app when advanced. The clock in use before comes back when the block ends.
    """
    clock = DuraflowClock(store, datetime.now(UTC) if start is None else start)
    previous = _clock.use(clock.now)
    try:
        yield clock
    finally:
        _clock.use(previous)
