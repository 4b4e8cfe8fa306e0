"""The clock the library reads: every time it stores, and every time it compares one.

It is the system's UTC clock, unless a test replaced it (``celery_duraflow.testing``'s
``duraflow_clock``), so that sleeps and timeouts of days can be tested in milliseconds and
the stored timestamps agree with the time the test set.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

# None: the system clock. Otherwise a function returning an aware UTC datetime.
_source: Callable[[], datetime] | None = None


def now() -> datetime:
    """The current time, timezone-aware, in UTC."""
    source = _source
    return datetime.now(UTC) if source is None else source()


def use(source: Callable[[], datetime] | None) -> Callable[[], datetime] | None:
    """Make ``source`` the library's clock (None: the system clock); return the previous one."""
    global _source
    previous, _source = _source, source
    return previous
