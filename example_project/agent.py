"""The flight-booking agent again, written as a Pydantic AI agent and made durable.

:mod:`example_project.tasks` runs its own agent loop and makes each decision
and tool call a step by hand. Here the loop belongs to Pydantic AI: an
:class:`~pydantic_ai.Agent` with the same four tools (the same
:class:`~example_project.services.Toolbox` calls), wrapped in
:class:`~celery_duraflow.contrib.pydantic_ai.DurableAgent` and run inside the
durable task :func:`book_trip_agent`. The wrapper makes every model request a
step (``travel-agent:model``, ``travel-agent:model#2``, ...) and every tool
call a step (``travel-agent:tool:search_flights``, ...), so when the mailer
fails and Celery retries the task, the model's answers and the tools' results
come back from the store: the model is not asked again and the card is not
charged again.

``book_flight`` is declared with ``requires_approval=True``: before it runs,
the run waits for the signal ``travel-agent:approval:book_flight``
(:data:`APPROVAL_SIGNAL`), holding no worker. ``{"approved": true}`` (or
``true``) lets the booking go ahead; ``{"approved": false}`` (or ``false``)
refuses it, and the model is told so.

The model: without ``DURAFLOW_DEMO_MODEL`` in the environment it is a
:class:`~pydantic_ai.models.function.FunctionModel` that makes the same
decisions as :class:`~example_project.planner.ScriptedPlanner`, so the demo
runs offline and the same way every time. ``DURAFLOW_DEMO_MODEL`` names a real
one in Pydantic AI's ``provider:model`` form, for example
``openai:gpt-4o-mini`` (then ``OPENAI_API_KEY`` must be set and the provider's
package installed, ``pip install 'pydantic-ai-slim[openai]'``). A provider key
alone does not switch the model: the demo stays scripted unless asked.

The trace the demo prints (``attempt 2  travel-agent:model  cached``) is
written from celery-duraflow's step signals (:mod:`celery_duraflow.signals`):
what the library reports it did for each step of each attempt.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from celery import Task
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import Model
from pydantic_ai.models.function import AgentInfo, FunctionModel

from celery_duraflow import DurableTask, StoreUnavailable, get_run
from celery_duraflow import signals as duraflow_signals
from celery_duraflow.contrib.pydantic_ai import DurableAgent, tool_step

from .app import app
from .db import ExampleDB, TraceRow, example_db
from .journal import summarize
from .planner import BOOK_FLIGHT, DONE, PICK_BEST, Observation, ScriptedPlanner, TripRequest
from .services import Booking, Flight, MailerDown, Receipt, Toolbox, pick_best
from .tasks import RETRY_OPTIONS

AGENT_NAME = "travel-agent"
# The environment variable that puts a real model behind the agent ("openai:gpt-4o-mini").
MODEL_ENV = "DURAFLOW_DEMO_MODEL"
# The signal book_flight waits for: "<agent name>:approval:<tool name>".
APPROVAL_SIGNAL = f"{AGENT_NAME}:approval:{BOOK_FLIGHT}"
MODEL_STEP = f"{AGENT_NAME}:model"
TOOL_STEP_PREFIX = f"{AGENT_NAME}:tool:"

INSTRUCTIONS = (
    "You book flights. Search the flights for the user's trip, pick the best one with "
    "pick_best, book it with book_flight, then e-mail the confirmation with notify_user. "
    "If the booking is refused, do not try again: say that nothing was booked. "
    "End with one sentence for the user."
)


@dataclass(frozen=True)
class TripDeps:
    """What the tools need: the trip (the Celery task id), the traveller and the services."""

    trip_id: str
    user_id: str
    tools: Toolbox


# -- the scripted model -------------------------------------------------------------------

_PROMPT = re.compile(r"from (?P<origin>[A-Z]{3}) to (?P<destination>[A-Z]{3}) "
                     r"on (?P<date>\d{4}-\d{2}-\d{2})")


def prompt_for(request: TripRequest) -> str:
    """The user prompt of a trip (the scripted model reads the trip back out of it)."""
    return (f"Book me the best flight from {request['origin']} to {request['destination']} "
            f"on {request['date']}, and e-mail me the confirmation.")


def _trip_request(messages: Sequence[ModelMessage]) -> TripRequest:
    for message in messages:
        if not isinstance(message, ModelRequest):
            continue
        for part in message.parts:
            if isinstance(part, UserPromptPart) and isinstance(part.content, str):
                found = _PROMPT.search(part.content)
                if found:
                    return {"origin": found["origin"], "destination": found["destination"],
                            "date": found["date"]}
    raise ValueError("the scripted model found no trip (from XXX to YYY on DATE) in the prompt")


def _observations(messages: Sequence[ModelMessage]) -> list[Observation]:
    """The tool calls made so far and what they returned, as the scripted planner sees them."""
    calls: dict[str, ToolCallPart] = {}
    history: list[Observation] = []
    for message in messages:
        for part in message.parts:
            if isinstance(part, ToolCallPart):
                calls[part.tool_call_id] = part
            elif isinstance(part, ToolReturnPart) and part.tool_call_id in calls:
                history.append({"tool": part.tool_name,
                                "args": calls[part.tool_call_id].args_as_dict(),
                                "result": part.content})
    return history


def scripted_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """A stand-in for a language model that decides like :class:`ScriptedPlanner`.

    It reads the trip from the user's prompt and the tool results from the
    conversation, and answers with the next tool call, or with the final text.
    A refused booking (the tool "returned" the refusal message) ends the trip.
    """
    history = _observations(messages)
    for obs in history:
        if obs["tool"] == BOOK_FLIGHT and not isinstance(obs["result"], dict):
            flight_id = obs["args"].get("flight", {}).get("flight_id", "the flight")
            return ModelResponse(parts=[TextPart(
                f"Not booked: the booking of {flight_id} was declined, "
                "and the card was not charged.")])
    action = ScriptedPlanner(_trip_request(messages)).decide(history)
    if action["tool"] == DONE:
        return ModelResponse(parts=[TextPart(str(action["args"]["answer"]))])
    turn = sum(isinstance(m, ModelResponse) for m in messages) + 1
    return ModelResponse(parts=[ToolCallPart(action["tool"], action["args"],
                                             tool_call_id=f"call-{turn}")])


def make_model() -> Model | str:
    """The model named by ``DURAFLOW_DEMO_MODEL``, or the scripted one when it is unset."""
    name = os.environ.get(MODEL_ENV, "").strip()
    if name:
        return name
    return FunctionModel(scripted_model, model_name="scripted-travel-agent")


def describe_model() -> str:
    """One line for the demo's output: which model the agent asks."""
    name = os.environ.get(MODEL_ENV, "").strip()
    if name:
        return f"model {name} (from {MODEL_ENV})"
    return (f"model: a scripted FunctionModel, offline (set {MODEL_ENV}, e.g. "
            "openai:gpt-4o-mini, for a real one)")


# -- the agent and its tools ----------------------------------------------------------------

# defer_model_check: a real model's provider is looked up when the agent first runs, so
# importing this module (a worker does) needs no API key.
agent: Agent[TripDeps, str] = Agent(
    make_model(), name=AGENT_NAME, deps_type=TripDeps, output_type=str,
    instructions=INSTRUCTIONS, defer_model_check=True)


@agent.tool
def search_flights(ctx: RunContext[TripDeps], origin: str, destination: str,
                   date: str) -> list[Flight]:
    """List the flights between two airports (IATA codes) on a date (YYYY-MM-DD)."""
    return ctx.deps.tools.airline.search(origin, destination, date)


@agent.tool_plain(name=PICK_BEST)
def pick_best_flight(flights: list[Flight]) -> Flight:
    """Choose the best flight of a search result (stops count as extra cost)."""
    return pick_best(flights)


@agent.tool(requires_approval=True)
def book_flight(ctx: RunContext[TripDeps], flight: Flight) -> Booking:
    """Book a flight and charge the user's card. A person approves it first."""
    # The same key on every attempt of this tool call, so the airline charges once even
    # if the worker died after the airline answered and before the result was recorded.
    key = tool_step().idempotency_key
    return ctx.deps.tools.airline.book(trip_id=ctx.deps.trip_id, user_id=ctx.deps.user_id,
                                       flight=flight, idempotency_key=key)


@agent.tool
def notify_user(ctx: RunContext[TripDeps], booking: Booking) -> Receipt:
    """E-mail the booking confirmation to the user."""
    return ctx.deps.tools.mailer.send(
        trip_id=ctx.deps.trip_id, user_id=ctx.deps.user_id,
        subject=f"Your flight {booking['flight_id']} is booked ({booking['booking_ref']})")


# Model requests and tool calls become steps; the approval of book_flight, a signal.
durable_agent = DurableAgent(agent, name=AGENT_NAME)


def booking_of(messages: Sequence[ModelMessage]) -> Booking | None:
    """The booking book_flight returned in this conversation, or None if it booked nothing."""
    for obs in _observations(messages):
        if obs["tool"] == BOOK_FLIGHT and isinstance(obs["result"], dict):
            booking: Booking = obs["result"]  # type: ignore[assignment]
            return booking
    return None


@app.task(base=DurableTask, bind=True, name="example_project.book_trip_agent",
          autoretry_for=(MailerDown, StoreUnavailable), throws=(MailerDown,),
          **RETRY_OPTIONS)
def book_trip_agent(self: Task, user_id: str, request: TripRequest) -> dict[str, Any]:
    """Book a trip for ``user_id`` with the Pydantic AI agent; its steps are durable."""
    trip_id: str = self.request.id
    db = example_db(self.app)
    db.create_tables()
    deps = TripDeps(trip_id=trip_id, user_id=user_id, tools=Toolbox.for_db(db))
    with AgentTrace.attach(db, trip_id, self.app):
        result = durable_agent.run_sync(prompt_for(request), deps=deps)
    return {"trip_id": trip_id, "answer": result.output,
            "booking": booking_of(result.all_messages())}


# -- the trace ------------------------------------------------------------------------------


def is_approval_key(key: str) -> bool:
    """Whether a step key is the approval wait of one of the agent's tools."""
    return key.rsplit("/", 1)[-1].split("#", 1)[0].startswith(f"{AGENT_NAME}:approval:")


def agent_approved(payload: Any) -> bool:
    """Whether an approval payload says yes, as DurableAgent reads it."""
    return payload is True or (isinstance(payload, dict) and payload.get("approved") is True)


@dataclass
class AgentTrace:
    """Writes the trace lines of one attempt of a trip, from the library's step signals.

    A replayed step sends ``step_replayed`` (``cached``), a step whose body ran
    ``step_succeeded`` (``ran``) or ``step_failed`` (``failed``), and a wait
    ``wait_reached`` (``waiting``) and then ``wait_ended`` (``ran``). A wait
    that had already ended sends nothing when it is replayed: its ``cached``
    line is written when the next step recorded after it is reached.
    """

    db: ExampleDB
    trip_id: str
    attempt: int
    recorded: list[tuple[str, str]]  # (key, status) of every step stored before this attempt
    _written: set[str] = field(default_factory=set)

    @classmethod
    @contextmanager
    def attach(cls, db: ExampleDB, trip_id: str, celery_app: Any) -> Iterator[AgentTrace]:
        """Trace the steps of ``trip_id`` while the block runs (the attempt's body)."""
        run = get_run(trip_id, app=celery_app)
        if run is None:  # only outside a DurableTask attempt, which has begun by now
            raise RuntimeError(f"trip {trip_id} has no durable run recorded")
        trace = cls(db, trip_id, run.attempts, [(s.key, s.status) for s in run.steps])
        _connect_receivers()
        with _traces_lock:
            _traces[trip_id] = trace
        try:
            yield trace
        finally:
            with _traces_lock:
                _traces.pop(trip_id, None)

    def event(self, key: str, outcome: str, detail: str = "") -> None:
        keys = [k for k, _ in self.recorded]
        if key in keys:  # replayed waits recorded before this step come first
            for earlier, status in self.recorded[:keys.index(key)]:
                if (is_approval_key(earlier) and status == "completed"
                        and earlier not in self._written):
                    self._write(earlier, "cached", "")
        self._write(key, outcome, detail)

    def _write(self, key: str, outcome: str, detail: str) -> None:
        self._written.add(key)
        self.db.add_trace(self.trip_id, TraceRow(self.attempt, key, outcome, detail))


_traces: dict[str, AgentTrace] = {}
_traces_lock = threading.Lock()
_connected = False


def _traced(task_id: str) -> AgentTrace | None:
    with _traces_lock:
        return _traces.get(task_id)


def _on_replayed(sender: Any = None, task_id: str = "", step_key: str = "",
                 **_: Any) -> None:
    trace = _traced(task_id)
    if trace is not None:
        trace.event(step_key, "cached")


def _on_succeeded(sender: Any = None, task_id: str = "", step_key: str = "",
                  **_: Any) -> None:
    trace = _traced(task_id)
    if trace is not None:
        trace.event(step_key, "ran")


def _on_failed(sender: Any = None, task_id: str = "", step_key: str = "",
               exception: BaseException | None = None, **_: Any) -> None:
    trace = _traced(task_id)
    if trace is not None:
        trace.event(step_key, "failed", f"{type(exception).__name__}: {exception}")


def _on_wait_reached(sender: Any = None, task_id: str = "", step_key: str = "",
                     **_: Any) -> None:
    trace = _traced(task_id)
    if trace is not None:
        trace.event(step_key, "waiting", "asked a person to approve the booking")


def _on_wait_ended(sender: Any = None, task_id: str = "", step_key: str = "",
                   timed_out: bool = False, **_: Any) -> None:
    trace = _traced(task_id)
    if trace is not None:
        trace.event(step_key, "ran", "no answer in time: denied" if timed_out else "")


def _connect_receivers() -> None:
    # On first use, not at import: a signal with no receiver is not even sent, so a
    # worker that never runs this agent pays nothing for its trace.
    global _connected
    with _traces_lock:
        if _connected:
            return
        _connected = True
    duraflow_signals.step_replayed.connect(_on_replayed, weak=False)
    duraflow_signals.step_succeeded.connect(_on_succeeded, weak=False)
    duraflow_signals.step_failed.connect(_on_failed, weak=False)
    duraflow_signals.wait_reached.connect(_on_wait_reached, weak=False)
    duraflow_signals.wait_ended.connect(_on_wait_ended, weak=False)


# -- describing recorded steps (the demo's trace) --------------------------------------------


def _tool_calls_in(value: Any) -> list[str]:
    """The tool names a stored model response asks for, whatever shape it is stored in."""
    found: list[str] = []
    if isinstance(value, dict):
        name = value.get("tool_name")
        if isinstance(name, str) and value.get("part_kind", "tool-call") == "tool-call":
            found.append(name)
        for item in value.values():
            found.extend(_tool_calls_in(item))
    elif isinstance(value, list):
        for item in value:
            found.extend(_tool_calls_in(item))
    return found


def _text_in(value: Any) -> str | None:
    if isinstance(value, dict):
        if value.get("part_kind") == "text" and isinstance(value.get("content"), str):
            return str(value["content"])
        for item in value.values():
            text = _text_in(item)
            if text:
                return text
    elif isinstance(value, list):
        for item in value:
            text = _text_in(item)
            if text:
                return text
    return None


def describe_step(key: str, result: Any) -> str:
    """A short description of a recorded step of the agent, for the demo's trace."""
    name = key.rsplit("/", 1)[-1].split("#", 1)[0]
    if name == MODEL_STEP:
        calls = _tool_calls_in(result)
        if calls:
            return "next: " + ", ".join(calls)
        text = _text_in(result)
        return f"answer: {text[:60]}" if text else "answered"
    if is_approval_key(key):
        payload = result.get("payload") if isinstance(result, dict) else result
        return "approved" if agent_approved(payload) else "declined"
    if name.startswith(TOOL_STEP_PREFIX):
        tool = name.removeprefix(TOOL_STEP_PREFIX)
        try:
            return summarize(tool, result)
        except (KeyError, TypeError, IndexError):  # a shape the summary does not know
            return repr(result)[:60]
    return repr(result)[:60]
