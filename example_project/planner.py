"""The agent's "brain": a planner that picks the next tool from what happened so far.

The contract is one method, :meth:`Planner.decide`: it receives the history of
tool calls made so far in this trip and returns the next :class:`Action`, or an
action whose tool is ``"done"`` when the agent has finished.

The default :class:`ScriptedPlanner` follows a fixed script, so the demo and the
tests behave the same on every machine and need no network or API key. To put a
real model behind the agent, see the docstring of :class:`ScriptedPlanner`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypedDict

# Tool names. They double as step names, so they must not contain "/" or "#".
SEARCH_FLIGHTS = "search_flights"
PICK_BEST = "pick_best"
BOOK_FLIGHT = "book_flight"
NOTIFY_USER = "notify_user"
DONE = "done"

TOOL_NAMES = (SEARCH_FLIGHTS, PICK_BEST, BOOK_FLIGHT, NOTIFY_USER)

# Before every book_flight the agent waits for a person's answer: the signal of this
# name, with the payload {"approved": true} or {"approved": false}. It is also the
# step key of that wait, so it follows the same rules as the tool names.
APPROVAL = "approval"

# The tools described the way model APIs with tool use expect them (a name, a
# description and a JSON schema of the arguments). The scripted planner does
# not need this; a model-backed planner would send it along with every request.
TOOL_SPECS: list[dict[str, Any]] = [
    {
        "name": SEARCH_FLIGHTS,
        "description": "List the flights between two airports on a date.",
        "input_schema": {
            "type": "object",
            "properties": {
                "origin": {"type": "string"},
                "destination": {"type": "string"},
                "date": {"type": "string", "format": "date"},
            },
            "required": ["origin", "destination", "date"],
        },
    },
    {
        "name": PICK_BEST,
        "description": "Choose the best flight from a search result.",
        "input_schema": {
            "type": "object",
            "properties": {"flights": {"type": "array", "items": {"type": "object"}}},
            "required": ["flights"],
        },
    },
    {
        "name": BOOK_FLIGHT,
        "description": "Book a flight and charge the user's card.",
        "input_schema": {
            "type": "object",
            "properties": {"flight": {"type": "object"}},
            "required": ["flight"],
        },
    },
    {
        "name": NOTIFY_USER,
        "description": "E-mail the booking confirmation to the user.",
        "input_schema": {
            "type": "object",
            "properties": {"booking": {"type": "object"}},
            "required": ["booking"],
        },
    },
]


class TripRequest(TypedDict):
    """What the user asked for."""

    origin: str
    destination: str
    date: str


class Action(TypedDict):
    """One decision of the planner: call ``tool`` with ``args`` (or stop, if ``tool`` is done)."""

    tool: str
    args: dict[str, Any]
    reason: str


class Observation(TypedDict):
    """One entry of the history: a tool call the agent made and what it returned."""

    tool: str
    args: dict[str, Any]
    result: Any


class Planner(Protocol):
    """Anything that can choose the agent's next move."""

    def decide(self, history: Sequence[Observation]) -> Action:
        """Return the next action given every tool call made so far (oldest first).

        The returned action must be plain JSON data: the agent stores it as a
        step, so that a retried attempt reuses the decision instead of asking
        the planner again.
        """
        ...


def is_approved(payload: Any) -> bool:
    """Whether the payload of an approval signal says yes.

    Only ``{"approved": true}`` does: anything else (``"yes"``, a typo, a
    missing key) counts as no, because a wrong yes costs a charge on the card.
    """
    return isinstance(payload, dict) and payload.get("approved") is True


def _action(tool: str, args: dict[str, Any], reason: str) -> Action:
    return {"tool": tool, "args": args, "reason": reason}


class ScriptedPlanner:
    """A deterministic stand-in for a language model.

    It walks the usual path of a booking agent (search, pick, book, notify,
    done), looking at the history to see which of those already happened.

    Plugging in a real model: write a class with the same ``decide`` method
    and return it from :func:`make_planner`. Its ``decide`` would turn the
    trip request and the history into chat messages (each observation becomes
    a tool call plus its tool result), send them with ``TOOL_SPECS`` as the
    tool definitions, and convert the tool call in the reply into an
    :class:`Action`. With the Anthropic SDK, for example, roughly::

        reply = self.client.messages.create(
            model=self.model, max_tokens=1024, tools=TOOL_SPECS,
            messages=to_messages(self.request, history))
        call = next((b for b in reply.content if b.type == "tool_use"), None)
        if call is None:                      # the model answered in text: finished
            return _action(DONE, {"answer": reply.content[0].text}, "model finished")
        return _action(call.name, dict(call.input), "chosen by the model")

    (an OpenAI client works the same way with ``chat.completions.create`` and
    ``tool_calls``). Nothing else changes: because each decision is recorded as
    a step, a retry gets the model's earlier answers back from the database
    instead of asking again and possibly getting a different plan.
    """

    def __init__(self, request: TripRequest) -> None:
        self.request = request

    def decide(self, history: Sequence[Observation]) -> Action:
        seen = {obs["tool"]: obs["result"] for obs in history}
        if SEARCH_FLIGHTS not in seen:
            return _action(SEARCH_FLIGHTS, dict(self.request), "no flights known yet")
        flights = seen[SEARCH_FLIGHTS]
        if not flights:
            return _action(DONE, {"answer": "No flights found for this trip.", "booking": None},
                           "nothing to book")
        if PICK_BEST not in seen:
            return _action(PICK_BEST, {"flights": flights}, "several options to compare")
        if BOOK_FLIGHT not in seen:
            return _action(BOOK_FLIGHT, {"flight": seen[PICK_BEST]}, "a flight was chosen")
        booking = seen[BOOK_FLIGHT]
        if NOTIFY_USER not in seen:
            return _action(NOTIFY_USER, {"booking": booking}, "the user must be told")
        return _action(
            DONE,
            {"answer": f"Booked {booking['flight_id']}, reference {booking['booking_ref']}.",
             "booking": booking},
            "booked and notified",
        )


def make_planner(request: TripRequest) -> Planner:
    """The planner used for a trip: the one place to swap in a model-backed planner."""
    return ScriptedPlanner(request)
