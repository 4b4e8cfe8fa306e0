"""The outside world the agent talks to: a fake airline and a flaky mailer.

Both keep their state in the database (see :mod:`example_project.db`), not in
memory, so what they did survives the process: the demo can count the charges
and refunds after a real worker process did the booking, and the mailer
remembers that it already failed once for a trip even when the retry runs in
another process. That is also how the demo tells the mailer to refuse every
message of one trip (``--mailer-down``): a row in a table, which the worker
sees wherever it runs.
"""

from __future__ import annotations

import hashlib
import uuid
import zlib
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.exc import IntegrityError

# Not typing's: before Python 3.12 pydantic, which turns the Pydantic AI agent's tool
# arguments into JSON schemas (example_project.agent), only accepts this TypedDict.
from typing_extensions import TypedDict

from .db import ExampleDB, now
from .planner import BOOK_FLIGHT, NOTIFY_USER, PICK_BEST, SEARCH_FLIGHTS, Action


class Flight(TypedDict):
    flight_id: str
    origin: str
    destination: str
    date: str
    departs: str
    stops: int
    price_cents: int


class Booking(TypedDict):
    booking_ref: str
    flight_id: str
    amount_cents: int


class Refund(TypedDict):
    booking_ref: str
    amount_cents: int


class Receipt(TypedDict):
    to: str
    message_id: str


class MailerDown(Exception):
    """The mail server refused a message: a transient failure, worth a retry."""


class UnknownBooking(Exception):
    """The airline has no booking with this reference for this trip."""


def money(cents: int) -> str:
    return f"${cents / 100:,.2f}"


class FakeAirline:
    """Searches and books flights; every booking charges the card once, in the ledger.

    ``book`` behaves like a real payment API with idempotency keys: a request
    whose key was seen before returns the booking made the first time, and
    charges nothing. A request with a new key (or none) is a new booking and a
    new charge, whatever it looks like. The airline cannot tell a retry from a
    second purchase; only the key can.
    """

    def __init__(self, db: ExampleDB) -> None:
        self.db = db

    def search(self, origin: str, destination: str, date: str) -> list[Flight]:
        """Three flights, always the same for the same route and date."""
        base = 30_000 + zlib.crc32(f"{origin}-{destination}-{date}".encode()) % 40_000
        offers = [("BA117", "08:20", 0, base + 4_500),
                  ("VS3", "11:05", 0, base),
                  ("AA6143", "06:40", 1, base - 6_000)]
        return [
            {"flight_id": fid, "origin": origin, "destination": destination, "date": date,
             "departs": departs, "stops": stops, "price_cents": price}
            for fid, departs, stops, price in offers
        ]

    def book(self, *, trip_id: str, user_id: str, flight: Flight,
             idempotency_key: str | None) -> Booking:
        """Book ``flight`` and charge its price, unless ``idempotency_key`` was used before."""
        key = idempotency_key or str(uuid.uuid4())  # no key: each call is a new purchase
        ledger = self.db.tables.ledger
        existing = select(ledger).where(ledger.c.idempotency_key == key)
        try:
            with self.db.engine.begin() as conn:
                row = conn.execute(existing).first()
                if row is None:
                    conn.execute(insert(ledger).values(
                        idempotency_key=key, trip_id=trip_id, user_id=user_id,
                        flight_id=flight["flight_id"], amount_cents=flight["price_cents"],
                        booking_ref="PNR-" + hashlib.sha256(key.encode()).hexdigest()[:6].upper(),
                        charged_at=now()))
                    row = conn.execute(existing).one()
        except IntegrityError:
            # A concurrent request with the same key won the insert: answer with its booking.
            with self.db.engine.connect() as conn:
                row = conn.execute(existing).one()
        return {"booking_ref": row.booking_ref, "flight_id": row.flight_id,
                "amount_cents": row.amount_cents}

    def cancel(self, booking: Booking, *, trip_id: str) -> Refund:
        """Cancel ``booking`` (made for ``trip_id``) and refund what was charged for it.

        Idempotent, keyed on the booking reference: cancelling a booking that
        was cancelled before refunds nothing more and returns the first refund.
        The amount comes from the ledger, not from ``booking``: the airline
        gives back what it took. Raises :class:`UnknownBooking` if the trip
        has no such booking.
        """
        ref = booking["booking_ref"]
        ledger, refunds = self.db.tables.ledger, self.db.tables.refunds
        charge = (select(ledger.c.amount_cents)
                  .where(ledger.c.booking_ref == ref, ledger.c.trip_id == trip_id))
        existing = select(refunds).where(refunds.c.booking_ref == ref)
        try:
            with self.db.engine.begin() as conn:
                amount = conn.execute(charge).scalar()
                if amount is None:
                    raise UnknownBooking(f"no booking {ref} for trip {trip_id}")
                row = conn.execute(existing).first()
                if row is None:
                    conn.execute(insert(refunds).values(
                        booking_ref=ref, trip_id=trip_id, amount_cents=amount,
                        refunded_at=now()))
                    row = conn.execute(existing).one()
        except IntegrityError:
            # A concurrent cancel of the same booking refunded it first: report that refund.
            with self.db.engine.connect() as conn:
                row = conn.execute(existing).one()
        return {"booking_ref": row.booking_ref, "amount_cents": row.amount_cents}


class FlakyMailer:
    """Sends the confirmation e-mail; the first message for each trip bounces.

    Every call is logged in the mail_log table, and that log is what decides
    the outcome, so "the first call fails" holds across processes and retries.
    A trip listed in the mail_outages table (see :meth:`go_down_for`) gets
    every message refused, so its retries run out.
    """

    def __init__(self, db: ExampleDB) -> None:
        self.db = db

    def go_down_for(self, trip_id: str) -> None:
        """Refuse every message of ``trip_id`` from now on (safe to call twice).

        The demo calls this before it sends the trip to the workers, so the
        worker that runs the trip, in this process or another, sees it.
        """
        outages = self.db.tables.mail_outages
        listed = select(outages.c.trip_id).where(outages.c.trip_id == trip_id)
        try:
            with self.db.engine.begin() as conn:
                if conn.execute(listed).first() is None:
                    conn.execute(insert(outages).values(trip_id=trip_id, since=now()))
        except IntegrityError:
            pass  # listed by a concurrent call: that is all we wanted

    def send(self, *, trip_id: str, user_id: str, subject: str) -> Receipt:
        mail_log, outages = self.db.tables.mail_log, self.db.tables.mail_outages
        earlier = (select(func.count()).select_from(mail_log)
                   .where(mail_log.c.trip_id == trip_id))
        down = select(outages.c.trip_id).where(outages.c.trip_id == trip_id)
        with self.db.engine.begin() as conn:
            tries = int(conn.execute(earlier).scalar_one())
            refused_all = conn.execute(down).first() is not None
            delivered = tries > 0 and not refused_all
            conn.execute(insert(mail_log).values(trip_id=trip_id, user_id=user_id,
                                                 subject=subject, delivered=delivered, at=now()))
        if refused_all:
            raise MailerDown(f"mail server is down: refused the message to {user_id}")
        if not delivered:
            raise MailerDown(f"mail server refused the message to {user_id}")
        return {"to": user_id, "message_id": f"msg-{trip_id[:8]}-{tries + 1}"}


def pick_best(flights: list[Flight]) -> Flight:
    """The cheapest flight, counting each stop as if it cost $80 more."""
    return min(flights, key=lambda f: (f["price_cents"] + 8_000 * f["stops"], f["flight_id"]))


@dataclass(frozen=True)
class Toolbox:
    """Runs the tool an :class:`~example_project.planner.Action` names."""

    airline: FakeAirline
    mailer: FlakyMailer

    @classmethod
    def for_db(cls, db: ExampleDB) -> Toolbox:
        return cls(FakeAirline(db), FlakyMailer(db))

    def call(self, action: Action, *, trip_id: str, user_id: str,
             idempotency_key: str | None) -> Any:
        """Run one tool call and return its (JSON-serializable) result.

        ``idempotency_key`` is passed to the tools that have side effects worth
        deduplicating (the booking); ``None`` means "don't deduplicate".
        """
        tool, args = action["tool"], action["args"]
        if tool == SEARCH_FLIGHTS:
            return self.airline.search(args["origin"], args["destination"], args["date"])
        if tool == PICK_BEST:
            return pick_best(args["flights"])
        if tool == BOOK_FLIGHT:
            return self.airline.book(trip_id=trip_id, user_id=user_id, flight=args["flight"],
                                     idempotency_key=idempotency_key)
        if tool == NOTIFY_USER:
            booking: Booking = args["booking"]
            return self.mailer.send(trip_id=trip_id, user_id=user_id,
                                    subject=f"Your flight {booking['flight_id']} is booked "
                                            f"({booking['booking_ref']})")
        raise ValueError(f"the planner asked for an unknown tool {tool!r}")
