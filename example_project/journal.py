"""A per-attempt trace of the agent, written to the database for the demo to print.

The task wraps every step in ``journal.record(s)``. What gets written is what
the library reported for that step in this attempt: ``cached`` when
``s.cached`` is true (the body was skipped and the stored output handed back),
``ran`` when the body ran and finished, ``failed`` when it raised. The trace is
deliberately not a step itself: it is a log of attempts, so every attempt adds
its own lines.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from .db import ExampleDB, TraceRow
from .planner import BOOK_FLIGHT, DONE, NOTIFY_USER, PICK_BEST, SEARCH_FLIGHTS
from .services import money


class StepLike(Protocol):
    """What the journal needs from a step: celery-duraflow's StepContext fits."""

    @property
    def key(self) -> str: ...

    @property
    def cached(self) -> bool: ...

    @property
    def result(self) -> Any: ...


@dataclass
class PlainCall:
    """A tool call of the naive agent, which has no steps: never cached."""

    key: str
    result: Any = None
    cached: bool = False


@dataclass
class CallCounter:
    """Numbers repeated names like the library numbers step keys: plan, plan#2, ..."""

    seen: dict[str, int] = field(default_factory=dict)

    def next(self, name: str) -> PlainCall:
        count = self.seen[name] = self.seen.get(name, 0) + 1
        return PlainCall(name if count == 1 else f"{name}#{count}")


def summarize(key: str, result: Any) -> str:
    """A short human description of a step's output."""
    name = key.split("#", 1)[0]
    if name == "plan":
        return f"next: {result['tool']}"
    if name == SEARCH_FLIGHTS:
        return f"{len(result)} flights found"
    if name == PICK_BEST:
        stops = "nonstop" if result["stops"] == 0 else f"{result['stops']} stop(s)"
        return f"{result['flight_id']}, {stops}, {money(result['price_cents'])}"
    if name == BOOK_FLIGHT:
        return f"booking {result['booking_ref']}, {money(result['amount_cents'])}"
    if name == NOTIFY_USER:
        return f"confirmation e-mailed to {result['to']}"
    if name == DONE:
        return str(result)
    return repr(result)[:60]


class Journal:
    """Writes the trace lines of one attempt of one trip."""

    def __init__(self, db: ExampleDB, trip_id: str, attempt: int) -> None:
        self.db = db
        self.trip_id = trip_id
        self.attempt = attempt

    @contextmanager
    def record(self, call: StepLike) -> Iterator[None]:
        """Record how the step ``call`` ended in this attempt. Re-raises any error."""
        try:
            yield
        except Exception as exc:
            self._write(call.key, "failed", f"{type(exc).__name__}: {exc}")
            raise
        outcome = "cached" if call.cached else "ran"
        self._write(call.key, outcome, summarize(call.key, call.result))

    def _write(self, key: str, outcome: str, detail: str) -> None:
        self.db.add_trace(self.trip_id, TraceRow(self.attempt, key, outcome, detail))
