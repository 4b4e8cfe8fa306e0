"""Durable Pydantic AI agents for the tests that start ``celery worker`` processes.

Loaded with ``celery -A tests.proj worker -I tests.proj.agents``. The model is a
scripted :class:`~pydantic_ai.models.function.FunctionModel` (offline), and every
model request and tool body adds a row to ``<prefix>agent_events``, so the tests
count how often each really ran, across worker processes, retries and kills.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from datetime import UTC, datetime
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
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Integer,
    MetaData,
    String,
    Table,
    func,
    insert,
    select,
)

from celery_duraflow import DurableTask
from celery_duraflow.contrib.pydantic_ai import DurableAgent, tool_step

from .app import TABLE_PREFIX, app
from .ledger import engine


class MailerDown(Exception):
    """The simulated mailer outage: Celery retries the task."""


METADATA = MetaData()
EVENTS = Table(
    f"{TABLE_PREFIX}agent_events",
    METADATA,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
           autoincrement=True),
    Column("task_id", String(255), nullable=False, index=True),
    Column("event", String(200), nullable=False),
    Column("at", DateTime(timezone=True), nullable=False),
)

# The Celery task id of the run the agent works for, for the model function (which
# sees no deps); a ContextVar reaches the agent's event loop and its tool threads.
_task_id: ContextVar[str] = ContextVar("proj_agent_task_id", default="?")


def record(event: str) -> None:
    with engine().begin() as conn:
        conn.execute(insert(EVENTS).values(task_id=_task_id.get(), event=event,
                                           at=datetime.now(UTC)))


def count(event: str) -> int:
    with engine().connect() as conn:
        found = conn.execute(select(func.count()).select_from(EVENTS).where(
            EVENTS.c.task_id == _task_id.get(), EVENTS.c.event == event)).scalar_one()
    return int(found)


def _turn(messages: list[ModelMessage]) -> int:
    return sum(isinstance(m, ModelResponse) for m in messages)


def _returns(messages: list[ModelMessage]) -> list[Any]:
    return [part.content for m in messages if isinstance(m, ModelRequest)
            for part in m.parts if isinstance(part, ToolReturnPart)]


def _scripted(plan: list[tuple[str, dict[str, Any]]]) -> FunctionModel:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        record("model")
        turn = _turn(messages)
        if turn < len(plan):
            name, args = plan[turn]
            return ModelResponse(parts=[ToolCallPart(name, args, tool_call_id=f"call-{turn}")])
        return ModelResponse(parts=[TextPart(f"done: {_returns(messages)}")])

    return FunctionModel(model, model_name="scripted")


# -- the trip agent: search, book (approval optional), a slow step, notify -------------------

TRIP_PLAN = [("search", {"origin": "FRA"}), ("book", {"flight": "FRA-LH1"}),
             ("wait_for_airline", {"seconds": 0.0}), ("notify", {"ref": "BK1"})]

trip_agent: Agent[dict[str, Any], str] = Agent(_scripted(TRIP_PLAN), name="trip",
                                               deps_type=dict)


@trip_agent.tool_plain
def search(origin: str) -> list[str]:
    record("tool:search")
    return [f"{origin}-LH1", f"{origin}-BA9"]


@trip_agent.tool_plain
def book(flight: str) -> dict[str, str]:
    record("tool:book")
    return {"flight": flight, "key": tool_step().idempotency_key}


@trip_agent.tool
def wait_for_airline(ctx: RunContext[dict[str, Any]], seconds: float) -> str:
    """Slow on the first attempt when the run asks for it: the worker is killed here."""
    s = tool_step()
    record(f"tool:wait_for_airline:attempt{s.attempt}:in_doubt={s.in_doubt}")
    hold = float(ctx.deps.get("hold_first_call", 0.0))
    if hold and not s.in_doubt:
        time.sleep(hold)
    return "airline answered"


@trip_agent.tool
def notify(ctx: RunContext[dict[str, Any]], ref: str) -> str:
    record("tool:notify")
    if ctx.deps.get("mailer_down_once") and count("tool:notify") == 1:
        raise MailerDown("the mailer is down")
    return f"sent {ref}"


durable_trip = DurableAgent(trip_agent)


@app.task(base=DurableTask, bind=True, name="proj.agent_trip", autoretry_for=(MailerDown,),
          retry_backoff=False, default_retry_delay=0, max_retries=3)
def agent_trip(self: Task, mailer_down_once: bool = False,
               hold_first_call: float = 0.0) -> str:
    """Run the trip agent; optionally the mailer fails once, or the slow tool holds."""
    METADATA.create_all(engine(), checkfirst=True)
    _task_id.set(self.request.id)
    deps = {"mailer_down_once": mailer_down_once, "hold_first_call": hold_first_call}
    return durable_trip.run_sync("Book me a flight from FRA", deps=deps).output


# -- the approval agent: one booking that a person approves --------------------------------

approval_agent: Agent[None, str] = Agent(
    _scripted([("charge_card", {"amount": 420})]), name="payer")


@approval_agent.tool_plain(requires_approval=True)
def charge_card(amount: int) -> dict[str, Any]:
    record("tool:charge_card")
    return {"charged": amount, "key": tool_step().idempotency_key}


durable_payer = DurableAgent(approval_agent)


@app.task(base=DurableTask, bind=True, name="proj.agent_payment")
def agent_payment(self: Task) -> str:
    """Charge a card once a person approves (signal 'payer:approval:charge_card')."""
    METADATA.create_all(engine(), checkfirst=True)
    _task_id.set(self.request.id)
    return durable_payer.run_sync("Pay for the trip").output
