"""A per-attempt trace of the agent, written to the database for the demo to print.

The task wraps every step in ``journal.record(s)``. What gets written is what
the library reported for that step in this attempt: ``cached`` when
``s.cached`` is true (the body was skipped and the stored output handed back),
``ran`` when the body ran and finished, ``failed`` when it raised. The trace is
deliberately not a step itself: it is a log of attempts, so every attempt adds
its own lines.

A wait for a signal is not a ``with step()`` block, so it has its own entry,
``journal.wait(name, asking)``: a ``waiting`` line the first time the run
reaches it, then ``ran`` in the attempt that received the signal and
``cached`` in the attempts that replayed it.

An undo given to a step as ``compensate=`` is wrapped by
``journal.compensation(step_name, label, undo)``, so that when the library
calls it (the run failed for good, or was cancelled) it writes a line too,
under the key the library records it with, ``compensate:<step key>``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from celery_duraflow import get_run

from .db import ExampleDB, TraceRow
from .planner import (
    APPROVAL,
    BOOK_FLIGHT,
    DONE,
    NOTIFY_USER,
    PICK_BEST,
    SEARCH_FLIGHTS,
    is_approved,
)
from .services import money

# The library records the undo of the step with key K as the step "compensate:K".
COMPENSATION_PREFIX = "compensate:"

R = TypeVar("R")


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
class WaitEntry:
    """A wait for a signal as the journal sees it; the task sets ``result`` to the payload."""

    key: str
    result: Any = None


@dataclass
class CallCounter:
    """Numbers repeated names like the library numbers step keys: plan, plan#2, ..."""

    seen: dict[str, int] = field(default_factory=dict)

    def next(self, name: str) -> PlainCall:
        count = self.seen[name] = self.seen.get(name, 0) + 1
        return PlainCall(name if count == 1 else f"{name}#{count}")


def summarize(key: str, result: Any) -> str:
    """A short human description of a step's output."""
    if key.startswith(COMPENSATION_PREFIX):  # what an undo returned
        undone = key.removeprefix(COMPENSATION_PREFIX).split("#", 1)[0]
        if undone == BOOK_FLIGHT:
            return (f"booking {result['booking_ref']} cancelled, "
                    f"{money(result['amount_cents'])} refunded")
        return repr(result)[:60]
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
    if name == APPROVAL:
        return "approved" if is_approved(result) else "declined"
    if name == DONE:
        return str(result)
    return repr(result)[:60]


class Journal:
    """Writes the trace lines of one attempt of one trip.

    ``recorded`` maps the key of each step the store held when this attempt
    began to its status (``completed``, ``waiting``, ...): that is how a wait,
    which offers no ``cached`` flag, knows whether it is being replayed.
    """

    def __init__(self, db: ExampleDB, trip_id: str, attempt: int,
                 recorded: Mapping[str, str] | None = None) -> None:
        self.db = db
        self.trip_id = trip_id
        self.attempt = attempt
        self.recorded = dict(recorded or {})
        # Numbers the waits the way the library numbers their keys: approval, approval#2, ...
        self._waits = CallCounter()
        # The same for the steps given an undo (every step of that name must get one).
        self._undoable = CallCounter()

    @classmethod
    def for_durable_run(cls, db: ExampleDB, trip_id: str, app: Any) -> Journal:
        """The journal of the durable attempt running now, numbered by the run's own counter.

        That counter counts every delivery that ran the task body, the one a
        signal woke included; Celery's retry counter only counts retries.
        """
        run = get_run(trip_id, app=app)
        if run is None:  # only outside a DurableTask attempt, which has begun by now
            raise RuntimeError(f"trip {trip_id} has no durable run recorded")
        return cls(db, trip_id, attempt=run.attempts,
                   recorded={s.key: s.status for s in run.steps})

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

    @contextmanager
    def wait(self, name: str, asking: str) -> Iterator[WaitEntry]:
        """Record a wait for the signal ``name``; ``asking`` says what a person is asked.

        The ``waiting`` line is written before the wait, and only when the run
        reaches it for the first time. If the wait suspends the run, the library
        ends the attempt with an exception that is not an ``Exception`` (so that
        no ``except Exception`` can swallow it); it passes through untouched and
        the line that ends the wait is written by a later attempt.
        """
        entry = WaitEntry(self._waits.next(name).key)
        before = self.recorded.get(entry.key)
        if before is None:
            self._write(entry.key, "waiting", asking)
        try:
            yield entry
        except Exception as exc:  # e.g. SignalTimeout, for a wait with a timeout
            self._write(entry.key, "failed", f"{type(exc).__name__}: {exc}")
            raise
        outcome = "cached" if before == "completed" else "ran"
        self._write(entry.key, outcome, summarize(entry.key, entry.result))

    def compensation(self, step_name: str, label: str,
                     undo: Callable[[Any], R]) -> Callable[[Any], R]:
        """``undo``, made to write a trace line (``label`` first) each time it is called.

        Pass the result as ``compensate=`` to the step named ``step_name``,
        and do so for every step of that name: the journal numbers them the
        way the library numbers their keys (``book_flight``, ``book_flight#2``,
        ...) to name the line as the library names the undo's record. The
        line is ``ran``, or ``failed`` with the error, which is re-raised so
        that the library tries the undo again.
        """
        key = COMPENSATION_PREFIX + self._undoable.next(step_name).key

        def undo_and_record(result: Any) -> R:
            try:
                outcome = undo(result)
            except Exception as exc:
                self._write(key, "failed", f"{label}: {type(exc).__name__}: {exc}")
                raise
            self._write(key, "ran", f"{label}: {summarize(key, outcome)}")
            return outcome

        return undo_and_record

    def _write(self, key: str, outcome: str, detail: str) -> None:
        self.db.add_trace(self.trip_id, TraceRow(self.attempt, key, outcome, detail))
