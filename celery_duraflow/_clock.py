"""The clock the library reads: every time it stores, and every time it compares one.

On PostgreSQL it is the database server's clock. Each worker, sweep and CLI
reads its host's clock corrected by an offset measured against
``clock_timestamp()`` on the store's connections (see :func:`measure`): when a
connection is opened, and again on an attempt's connection once the last
measure is a minute old. So leases, wake-up times and every stored timestamp
the library compares come from one clock, however far the hosts' own clocks
have drifted: a host whose clock runs minutes ahead neither takes a live run
early nor lets a sleep oversleep. SQLite, a store on one host, keeps the host's
clock (the offset stays 0 until a PostgreSQL store measures one).

A test may replace the clock altogether (``celery_duraflow.testing``'s
``duraflow_clock``), so that sleeps and timeouts of days can be tested in
milliseconds and the stored timestamps agree with the time the test set; no
offset is applied to such a clock.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from datetime import UTC, datetime

logger = logging.getLogger("celery_duraflow.store")

# None: the host clock plus the measured offset. Otherwise a function returning an
# aware UTC datetime.
_source: Callable[[], datetime] | None = None
# Seconds to add to the host clock (time.time()) to read the database server's.
_offset = 0.0
# time.monotonic() of the last measure; None: never measured in this process.
_measured_at: float | None = None
# How old a measure may get before the next attempt's connection takes another.
MEASURE_EVERY = 60.0
# A difference from the database's clock that is worth telling the operator about.
_WORTH_A_WARNING = 1.0
_warned = False
# What takes the first measure of a process, before its first reading of the clock: the
# PostgreSQL store's (a weak reference: a store that is gone measures nothing).
_first_measure: weakref.WeakMethod[Callable[[], None]] | None = None
# time.monotonic() before which a failed first measure is not tried again.
_retry_after = 0.0
RETRY_EVERY = 5.0


def now() -> datetime:
    """The current time, timezone-aware, in UTC."""
    source = _source
    if source is not None:
        return source()
    if _measured_at is None and _first_measure is not None:
        _measure_first()
    return datetime.fromtimestamp(time.time() + _offset, UTC)


def measure_first_with(method: Callable[[], None]) -> None:
    """Have the bound ``method`` take the process's first measure when the clock is first
    read, so that no timestamp is computed from the host's clock alone."""
    global _first_measure
    _first_measure = weakref.WeakMethod(method)


def _measure_first() -> None:
    global _retry_after
    reference = _first_measure
    method = reference() if reference is not None else None
    if method is None or time.monotonic() < _retry_after:
        return
    try:
        method()
    except Exception:
        # The store cannot be reached: the statement that follows fails the same way,
        # and says so. Until then the host's clock is all there is.
        _retry_after = time.monotonic() + RETRY_EVERY
        logger.debug("measuring the database's clock failed", exc_info=True)


def use(source: Callable[[], datetime] | None) -> Callable[[], datetime] | None:
    """Make ``source`` the library's clock (None: the system clock); return the previous one."""
    global _source
    previous, _source = _source, source
    return previous


def offset() -> float:
    """Seconds the database server's clock is ahead of this host's (0 until measured)."""
    return _offset


def due() -> bool:
    """Whether the offset should be measured again (never measured, or a minute old)."""
    measured = _measured_at
    return measured is None or time.monotonic() - measured > MEASURE_EVERY


def measure(server_epoch: Callable[[], float]) -> float:
    """Measure the offset with ``server_epoch()``, one round trip returning the server's
    ``clock_timestamp()`` as seconds since the epoch; return it.

    The server's reading is taken to belong half-way through the round trip, so the
    error is at most half of it (well under a millisecond on a local network).
    """
    global _offset, _measured_at, _warned
    before = time.time()
    server = server_epoch()
    after = time.time()
    _offset = server - (before + after) / 2
    _measured_at = time.monotonic()
    if abs(_offset) > _WORTH_A_WARNING and not _warned:
        _warned = True
        logger.warning(
            "celery-duraflow: this host's clock is %.1f s %s the database server's; leases "
            "and wake-up times follow the database's clock, but check the host's time "
            "synchronization (NTP).", abs(_offset), "behind" if _offset > 0 else "ahead of")
    return _offset
