"""The durable task the subprocess tests drive: a four-step trip booking."""

from __future__ import annotations

import logging
from typing import Any

from celery_duraflow import DurableTask, durable, step

from . import ledger
from .app import app

logger = logging.getLogger(__name__)


class MailerUnavailable(Exception):
    """The simulated e-mail service is down (it is, once per run)."""


def search_flights(query: str) -> list[dict[str, Any]]:
    return [
        {"code": f"{query}-101", "price_cents": 23900},
        {"code": f"{query}-202", "price_cents": 18950},
        {"code": f"{query}-303", "price_cents": 31000},
    ]


@app.task(
    base=DurableTask,
    bind=True,
    name="proj.book_trip",
    autoretry_for=(MailerUnavailable,),
    max_retries=3,
    retry_backoff=False,
    default_retry_delay=0,
)
def book_trip(self: DurableTask, user_id: str, query: str) -> dict[str, Any]:
    """Search, pick the cheapest flight, charge for it, then e-mail the user.

    The mailer fails the first time each run reaches it, so every run is
    retried once from the top; the charge must still happen only once.
    """
    task_id = self.request.id
    with step("search") as s:
        s.result = search_flights(query)
    flights = s.result
    with step("pick") as s:
        s.result = min(flights, key=lambda flight: flight["price_cents"])
    flight = s.result
    with step("book") as s:
        s.result = ledger.charge_card(task_id, user_id, flight, s.idempotency_key)
    booking = s.result
    with step("notify") as s:
        if ledger.first_notify_of_run(task_id):
            raise MailerUnavailable(f"mailer down while notifying {user_id} (task {task_id})")
        logger.info("notified %s of booking %s", user_id, booking["charge_id"])
        s.result = {"to": user_id, "charge_id": booking["charge_id"]}
    return {"booking": booking, "notice": s.result}


class Booking:
    """What a careless airline client returns: an object no serializer was told about."""

    def __init__(self, charge: dict[str, Any]) -> None:
        self.charge = charge


@app.task(base=DurableTask, bind=True, name="proj.book_unstorable",
          autoretry_for=(Exception,), max_retries=2, default_retry_delay=0)
def book_unstorable(self: DurableTask, user_id: str, query: str) -> dict[str, Any]:
    """Charge, then hand back an output the JSON serializer refuses (README's autoretry)."""
    with step("book") as s:
        charge = ledger.charge_card(self.request.id, user_id, search_flights(query)[0],
                                    s.idempotency_key)
        s.result = {"booking": Booking(charge)}
    return dict(s.result)


@app.task(base=DurableTask, bind=True, name="proj.book_deep",
          autoretry_for=(Exception,), max_retries=3, default_retry_delay=0)
def book_deep(self: DurableTask, user_id: str, query: str, depth: int) -> Any:
    """Charge in a step nested ``depth`` levels deep under 200-character names."""
    return _nested(self.request.id, user_id, query, depth)


@durable
def _nested(task_id: str, user_id: str, query: str, depth: int) -> Any:
    if depth == 0:
        with step("charge") as s:
            s.result = ledger.charge_card(task_id, user_id, search_flights(query)[0],
                                          s.idempotency_key)
        return s.result
    with step(f"level{depth}".ljust(200, "x")) as s:
        s.result = _nested(task_id, user_id, query, depth - 1)
    return s.result
