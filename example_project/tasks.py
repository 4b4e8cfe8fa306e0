"""The flight-booking agent, twice: as a durable task and as a plain Celery task.

Both run the same loop: ask the planner for the next tool, run it, add the
result to the history, until the planner says ``done``. Both retry
automatically when the mailer fails (it always fails the first time).

* :func:`book_trip` is a :class:`~celery_duraflow.DurableTask`: the planner's
  decisions and the tool calls are steps, so the retry replays them from the
  database and only the failed e-mail runs again. The card is charged once.
  Before booking it waits for a person's approval (the ``approval`` signal),
  holding no worker meanwhile; a "no" ends the trip without a booking.
  The booking step has an undo (``compensate=``): if the trip fails for good
  after booking (the mailer is still down when the retries run out), the
  library cancels the booking, which refunds the card, and the run ends
  ``compensated``.
* :func:`book_trip_naive` has no steps: the retry starts the loop over, the
  airline sees a second booking request, and the card is charged twice. It
  books without asking: it is only there to show that double charge.
"""

from __future__ import annotations

from typing import Any

from celery import Task

from celery_duraflow import DurableTask, StoreUnavailable, step, wait_for_signal

from .app import app
from .db import example_db
from .journal import CallCounter, Journal
from .planner import (
    APPROVAL,
    BOOK_FLIGHT,
    DONE,
    TOOL_NAMES,
    Action,
    Observation,
    TripRequest,
    is_approved,
    make_planner,
)
from .services import Booking, MailerDown, Refund, Toolbox, money

# A planner that never says "done" must not loop forever.
MAX_TURNS = 10

# Retry settings shared by both tasks. retry_backoff=True gives Celery's exponential
# backoff with jitter; retry_backoff_max=1 caps every wait at one second so the
# demo finishes quickly (a real deployment would leave the default cap).
RETRY_OPTIONS: dict[str, Any] = {
    "max_retries": 3,
    "retry_backoff": True,
    "retry_backoff_max": 1,
    "retry_jitter": True,
}


class AgentGaveUp(Exception):
    """The planner did not finish within MAX_TURNS."""


def _checked(action: Action) -> Action:
    # The tool name becomes a step name, so refuse anything that is not a known tool.
    if action["tool"] != DONE and action["tool"] not in TOOL_NAMES:
        raise ValueError(f"the planner chose an unknown tool {action['tool']!r}")
    return action


# throws=: a trip whose mailer stays down after the last retry is an outcome the agent
# handles (its booking is undone), not a bug, so the worker logs that failure as expected
# (one line at INFO) instead of an error with a traceback. The task still fails.
@app.task(base=DurableTask, bind=True, name="example_project.book_trip",
          autoretry_for=(MailerDown, StoreUnavailable), throws=(MailerDown,),
          **RETRY_OPTIONS)
def book_trip(self: Task, user_id: str, request: TripRequest) -> dict[str, Any]:
    """Book a trip for ``user_id``; every decision and tool call is a durable step."""
    trip_id: str = self.request.id
    db = example_db(self.app)
    db.create_tables()
    tools = Toolbox.for_db(db)
    journal = Journal.for_durable_run(db, trip_id, self.app)
    planner = make_planner(request)
    history: list[Observation] = []

    def cancel_booking(booking: Booking) -> Refund:
        # The undo of book_flight, called with that step's result. The library calls it
        # again if it raises, or if the process dies before its end is recorded; the
        # airline refunds a booking only once, so a second call costs nothing.
        return tools.airline.cancel(booking, trip_id=trip_id)

    for _turn in range(MAX_TURNS):
        # The decision is a step: on a retry the stored choice comes back and the
        # planner (a model, in real life) is not asked again. Keys: plan, plan#2, ...
        with step("plan") as s, journal.record(s):
            s.result = _checked(planner.decide(history))
        action: Action = s.result
        if action["tool"] == DONE:
            return {"trip_id": trip_id, **action["args"]}

        if action["tool"] == BOOK_FLIGHT:
            # A person approves the charge first. The first time the run gets here the
            # attempt ends and the run is "waiting", holding no worker, until someone
            # calls send_signal(trip_id, "approval", {"approved": true}); the run then
            # comes back through the broker, the steps above are answered from the
            # store, and wait_for_signal returns that payload (on every later attempt
            # too). The wait is reached the same way each time because the decisions
            # that lead here are steps, so its key ("approval") never changes.
            flight = action["args"]["flight"]
            asking = (f"asked for approval to book {flight['flight_id']}, "
                      f"{money(flight['price_cents'])}")
            with journal.wait(APPROVAL, asking) as w:
                w.result = wait_for_signal(APPROVAL)
            if not is_approved(w.result):
                return {"trip_id": trip_id, "booking": None,
                        "answer": f"Not booked: the booking of {flight['flight_id']} "
                                  "was declined, and the card was not charged."}

        # The tool call is a step named after the tool. Its idempotency key is the
        # same on every attempt, so even a booking whose result was never recorded
        # (the process died right after the airline answered) is not charged twice.
        # The booking is the one call with an undo: if the run later fails for good (or
        # is cancelled), the library calls cancel_booking with this step's result, the
        # booking, and records that call as the step "compensate:book_flight".
        undo = None
        if action["tool"] == BOOK_FLIGHT:
            undo = journal.compensation(BOOK_FLIGHT, "cancel-booking", cancel_booking)
        with step(action["tool"], compensate=undo) as s, journal.record(s):
            s.result = tools.call(action, trip_id=trip_id, user_id=user_id,
                                  idempotency_key=s.idempotency_key)
        # Read outputs from s.result, never from names bound inside the body:
        # on a replay the body is skipped and those names are never assigned.
        history.append({"tool": action["tool"], "args": action["args"], "result": s.result})

    raise AgentGaveUp(f"trip {trip_id}: no decision to stop after {MAX_TURNS} turns")


@app.task(bind=True, name="example_project.book_trip_naive",
          autoretry_for=(MailerDown,), **RETRY_OPTIONS)
def book_trip_naive(self: Task, user_id: str, request: TripRequest) -> dict[str, Any]:
    """The same agent without steps: what most retry decorators give you."""
    trip_id: str = self.request.id
    db = example_db(self.app)
    db.create_tables()
    tools = Toolbox.for_db(db)
    journal = Journal(db, trip_id, attempt=self.request.retries + 1)
    calls = CallCounter()
    planner = make_planner(request)
    history: list[Observation] = []

    for _turn in range(MAX_TURNS):
        plan = calls.next("plan")
        with journal.record(plan):
            plan.result = _checked(planner.decide(history))
        action: Action = plan.result
        if action["tool"] == DONE:
            return {"trip_id": trip_id, **action["args"]}

        call = calls.next(action["tool"])
        with journal.record(call):
            # No memory of the previous attempt, hence no stable key to offer the airline.
            call.result = tools.call(action, trip_id=trip_id, user_id=user_id,
                                     idempotency_key=None)
        history.append({"tool": action["tool"], "args": action["args"], "result": call.result})

    raise AgentGaveUp(f"trip {trip_id}: no decision to stop after {MAX_TURNS} turns")
