"""DurableAgent: every decision a tool can raise, and every return Pydantic AI serializes, replays.

A tool's ``ModelRetry``, ``ToolFailed``, ``ApprovalRequired`` and ``CallDeferred`` are
the call's outcome, recorded like a return value: a Celery retry replays them and the
tool body does not run again. Pydantic models, dataclasses, ``ToolReturn`` and file
content returned by a tool are stored in their JSON form and rebuilt on replay.
Also here: stream handlers attached to the agent, agents delegating to agents from a
tool, output validators with approvals, the run forms that are refused, and two agents
under one name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from pydantic import BaseModel
from pydantic_ai import Agent, ModelRetry, RunContext
from pydantic_ai.capabilities import ProcessEventStream
from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, ToolFailed
from pydantic_ai.messages import (
    AgentStreamEvent,
    BinaryContent,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    ToolCallPart,
    ToolReturn,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel
from pydantic_ai.tools import DeferredToolRequests

from celery_duraflow import (
    DurableTask,
    InvalidStepName,
    UnsupportedCode,
    get_run,
    send_signal,
    step,
)
from celery_duraflow.contrib.pydantic_ai import DurableAgent
from tests.conftest import run_worker, wait_for_status

RESULT_TIMEOUT = 30.0


@pytest.fixture(autouse=True)
def _collect_garbage() -> Iterator[None]:
    """Finalize what an agent run left behind before the next test (see test_pydantic_ai)."""
    yield
    gc.collect()


class Flaky(Exception):
    """Raised by a tool or a step to make Celery retry the task."""


def _turn(messages: list[ModelMessage]) -> int:
    return sum(isinstance(m, ModelResponse) for m in messages)


def _tool_returns(messages: list[ModelMessage]) -> list[ToolReturnPart]:
    return [part for m in messages if isinstance(m, ModelRequest)
            for part in m.parts if isinstance(part, ToolReturnPart)]


def _model_view(messages: list[ModelMessage]) -> list[str]:
    """What the model was told of each tool call: the text Pydantic AI sends."""
    return [part.model_response_str() for part in _tool_returns(messages)]


def scripted(calls: Counter[str], plan: list[tuple[str, dict[str, Any]]],
             seen: list[list[str]] | None = None) -> FunctionModel:
    """A model that calls the tools of ``plan`` one per turn, then answers."""
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        calls["model"] += 1
        if seen is not None:
            seen.append(_model_view(messages))
        turn = _turn(messages)
        if turn < len(plan):
            name, args = plan[turn]
            return ModelResponse(parts=[ToolCallPart(name, args, tool_call_id=f"call-{turn}")])
        return ModelResponse(parts=[TextPart(f"done: {_model_view(messages)}")])

    return FunctionModel(model)


def _with_notify(agent: Agent[Any, Any], calls: Counter[str], failures: int = 1) -> None:
    """Add a ``notify`` tool that fails ``failures`` times (each a Celery retry)."""
    @agent.tool_plain
    def notify(ref: str) -> str:
        calls["notify"] += 1
        if calls["notify"] <= failures:
            raise Flaky("mailer down")
        return f"sent {ref}"


def _steps(app: Celery, task_id: str) -> list[tuple[str, str]]:
    run = get_run(task_id, app=app)
    assert run is not None
    return [(s.key, s.status) for s in run.steps]


# -- 1. the decisions a tool raises are its call's outcome -----------------------------------


def test_model_retry_replays_across_self_retry_without_rerunning_the_tool(
        make_app: Callable[..., Celery]) -> None:
    """A tool's ModelRetry is recorded; a self.retry() replays it and the body runs once."""
    app = make_app()
    calls: Counter[str] = Counter()
    plan = [("lookup", {"code": "fra"}), ("lookup", {"code": "FRA"}), ("notify", {"ref": "R"})]
    agent: Agent[None, str] = Agent(scripted(calls, plan), name="travel")

    @agent.tool_plain
    def lookup(code: str) -> str:
        calls[f"lookup:{code}"] += 1
        if code != code.upper():
            raise ModelRetry("airport codes are upper case")
        return f"airport {code}"

    @agent.tool_plain
    def notify(ref: str) -> str:
        calls["notify"] += 1
        return f"sent {ref}"

    durable = DurableAgent(agent)

    @app.task(base=DurableTask, bind=True, max_retries=3)
    def trip(self: Any) -> str:
        output = durable.run_sync("Where is FRA?").output
        with step("deliver") as s:
            calls["deliver"] += 1
            if calls["deliver"] == 1:
                raise self.retry(countdown=0)
            s.result = output
        return str(s.result)

    result = trip.apply()
    assert result.successful(), result.traceback
    assert calls == {"model": 4, "lookup:fra": 1, "lookup:FRA": 1, "notify": 1, "deliver": 2}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded" and run.attempts == 2
    assert run.step("travel:tool:lookup").result == {
        "model_retry": "airport codes are upper case", "duraflow": "pydantic_ai.ModelRetry"}


def test_tool_failed_is_recorded_and_replayed_without_rerunning_the_tool(
        make_app: Callable[..., Celery]) -> None:
    """A tool's ToolFailed is its call's outcome: a Celery retry replays it, the body runs once."""
    app = make_app()
    calls: Counter[str] = Counter()
    seen: list[list[str]] = []
    agent: Agent[None, str] = Agent(
        scripted(calls, [("lookup", {"code": "XXX"}), ("notify", {"ref": "R"})], seen),
        name="travel")

    @agent.tool_plain
    def lookup(code: str) -> str:
        calls["lookup"] += 1
        raise ToolFailed(f"no airport {code}")

    _with_notify(agent, calls)
    durable = DurableAgent(agent)

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def trip() -> str:
        return durable.run_sync("Where is XXX?").output

    result = trip.apply()
    assert result.successful(), result.traceback
    assert calls == {"model": 3, "lookup": 1, "notify": 2}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded" and run.attempts == 2
    assert run.step("travel:tool:lookup").result == {
        "tool_failed": "no airport XXX", "duraflow": "pydantic_ai.ToolFailed"}
    assert run.step("travel:tool:lookup").attempts == 1
    # The model was told of the failure as a plain run tells it, and the replay told it the same.
    assert seen[1] == ['{"error":"no airport XXX"}']
    assert "no airport XXX" in result.get()


def test_call_deferred_is_recorded_and_replayed_without_rerunning_the_tool(
        make_app: Callable[..., Celery]) -> None:
    """A tool's CallDeferred (metadata, kind) is recorded; a retry replays it, body runs once."""
    app = make_app()
    calls: Counter[str] = Counter()
    agent: Agent[None, str] = Agent(scripted(calls, [("transfer", {"amount": 5})]),
                                    name="bank")

    @agent.tool_plain
    def transfer(amount: int) -> str:
        calls["transfer"] += 1
        raise CallDeferred({"queue": "payments", "amount": amount}, kind="question")

    durable = DurableAgent(agent)

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def pay() -> dict[str, Any]:
        output = durable.run_sync("pay 5", output_type=[str, DeferredToolRequests]).output
        assert isinstance(output, DeferredToolRequests)
        with step("hand-over") as s:
            calls["hand-over"] += 1
            if calls["hand-over"] == 1:
                raise Flaky("queue down")
            s.result = {"ids": [c.tool_call_id for c in output.calls],
                        "metadata": output.metadata, "kind": output.kind("call-0")}
        return dict(s.result)

    result = pay.apply()
    assert result.successful(), result.traceback
    assert calls == {"model": 1, "transfer": 1, "hand-over": 2}
    assert result.get() == {"ids": ["call-0"], "kind": "question",
                            "metadata": {"call-0": {"queue": "payments", "amount": 5}}}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded" and run.attempts == 2
    assert run.step("bank:tool:transfer").result == {
        "duraflow": "pydantic_ai.CallDeferred", "call_deferred": {
            "metadata": {"queue": "payments", "amount": 5}, "kind": "question"}}


def _delete_agent(calls: Counter[str]) -> Agent[None, str]:
    agent: Agent[None, str] = Agent(
        scripted(calls, [("delete_file", {"path": "/tmp/x"}), ("notify", {"ref": "R"})]),
        name="files")

    @agent.tool
    def delete_file(ctx: RunContext[None], path: str) -> str:
        calls["delete_file"] += 1
        if not ctx.tool_call_approved:
            raise ApprovalRequired({"path": path})
        calls["deleted"] += 1
        return f"deleted {path}"

    _with_notify(agent, calls)
    return agent


def test_approval_required_from_a_tool_runs_its_body_once_per_decision(
        make_app: Callable[..., Celery]) -> None:
    """A tool raising ApprovalRequired runs twice in all (asking, then approved), across retries."""
    app = make_app(eager=False)
    calls: Counter[str] = Counter()
    durable = DurableAgent(_delete_agent(calls))

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3,
              default_retry_delay=0)
    def clean() -> str:
        return durable.run_sync("delete /tmp/x").output

    with run_worker(app):
        result = clean.delay()
        waiting = wait_for_status(app, result.id, "waiting")
        assert waiting.waiting_for == "files:approval:delete_file"
        assert send_signal(result.id, "files:approval:delete_file", True, app=app) is True
        output = result.get(timeout=RESULT_TIMEOUT)
    assert "deleted /tmp/x" in output
    assert calls == {"model": 3, "delete_file": 2, "deleted": 1, "notify": 2}
    assert _steps(app, result.id) == [
        ("files:model", "completed"), ("files:tool:delete_file", "completed"),
        ("files:approval:delete_file", "completed"), ("files:tool:delete_file#2", "completed"),
        ("files:model#2", "completed"), ("files:tool:notify", "completed"),
        ("files:model#3", "completed")]
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded"
    assert run.step("files:tool:delete_file").result == {
        "duraflow": "pydantic_ai.ApprovalRequired",
        "approval_required": {"metadata": {"path": "/tmp/x"}}}


# -- 6. returns Pydantic AI serializes are stored and replayed --------------------------------


class Flight(BaseModel):
    """A tool's structured return value."""

    number: str
    seats: int


@dataclasses.dataclass
class Seat:
    """A dataclass return value."""

    row: int
    letter: str


def test_pydantic_model_and_dataclass_returns_are_stored_and_replayed(
        make_app: Callable[..., Celery]) -> None:
    """Tools returning a BaseModel or a dataclass run once; the replay tells the model the same."""
    app = make_app()
    calls: Counter[str] = Counter()
    seen: list[list[str]] = []
    plan = [("find", {"number": "LH1"}), ("seat", {}), ("notify", {"ref": "R"})]
    agent: Agent[None, str] = Agent(scripted(calls, plan, seen), name="travel")

    @agent.tool_plain
    def find(number: str) -> Flight:
        calls["find"] += 1
        return Flight(number=number, seats=3)

    @agent.tool_plain
    def seat() -> list[Seat]:
        calls["seat"] += 1
        return [Seat(row=12, letter="A")]

    _with_notify(agent, calls)
    durable = DurableAgent(agent)

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def trip() -> str:
        return durable.run_sync("find LH1").output

    result = trip.apply()
    assert result.successful(), result.traceback
    assert calls == {"model": 4, "find": 1, "seat": 1, "notify": 2}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded" and run.attempts == 2
    assert run.step("travel:tool:find").result == {"number": "LH1", "seats": 3}
    assert run.step("travel:tool:seat").result == [{"row": 12, "letter": "A"}]
    # The last request (asked on the retry, after two replayed calls) saw what the first saw.
    assert seen[-1][:2] == seen[2][:2] == ['{"number":"LH1","seats":3}',
                                           '[{"row":12,"letter":"A"}]']


def test_tool_return_and_file_content_are_stored_and_replayed(
        make_app: Callable[..., Celery]) -> None:
    """A ToolReturn (value, content, metadata) and BinaryContent come back whole on replay."""
    app = make_app()
    calls: Counter[str] = Counter()
    plan = [("quote", {}), ("ticket", {}), ("notify", {"ref": "R"})]
    agent: Agent[None, str] = Agent(scripted(calls, plan), name="travel")
    finals: list[list[ModelMessage]] = []

    @agent.tool_plain
    def quote() -> ToolReturn:
        calls["quote"] += 1
        return ToolReturn(Flight(number="LH1", seats=2), content="Prices are in EUR.",
                          metadata={"source": "airline"})

    @agent.tool_plain
    def ticket() -> BinaryContent:
        calls["ticket"] += 1
        return BinaryContent(data=b"%PDF-1.4 ticket", media_type="application/pdf")

    _with_notify(agent, calls)
    durable = DurableAgent(agent)

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def trip() -> str:
        result = durable.run_sync("quote LH1")
        finals.append(result.all_messages())
        return result.output

    result = trip.apply()
    assert result.successful(), result.traceback
    assert calls == {"model": 4, "quote": 1, "ticket": 1, "notify": 2}
    (messages,) = finals
    returns = {part.tool_name: part for part in _tool_returns(messages)}
    assert returns["quote"].metadata == {"source": "airline"}
    assert json.loads(returns["quote"].model_response_str()) == {"number": "LH1", "seats": 2}
    # As a plain run has it: the ToolReturn's content follows its return as a user part.
    assert any(isinstance(part, UserPromptPart) and part.content == "Prices are in EUR."
               for m in messages if isinstance(m, ModelRequest) for part in m.parts)
    tickets = [part for m in messages if isinstance(m, ModelRequest) for part in m.parts
               if isinstance(part, ToolReturnPart | UserPromptPart)
               and "ticket" in repr(part)]
    assert tickets
    assert any(isinstance(item, BinaryContent) and item.data == b"%PDF-1.4 ticket"
               for part in tickets for item in (part.content if isinstance(part.content, list)
                                                else [part.content]))


# -- 7. two agents under one name -----------------------------------------------------------


def test_two_agents_under_one_name_in_one_task_are_refused(
        make_app: Callable[..., Celery]) -> None:
    """A second, different agent under a name already used in the run: refused before any model."""
    app = make_app()
    calls: Counter[str] = Counter()
    first = DurableAgent(Agent(scripted(calls, []), name="helper"))
    second = DurableAgent(Agent(scripted(calls, []), name="other"), name="helper")
    again = DurableAgent(first.agent)  # the same agent under its own name: allowed
    errors: list[BaseException] = []

    @app.task(base=DurableTask, autoretry_for=(Exception,), retry_backoff=False, max_retries=2)
    def both() -> str:
        first.run_sync("a")
        again.run_sync("b")
        try:
            return second.run_sync("c").output
        except InvalidStepName as exc:
            errors.append(exc)
            raise

    result = both.apply()
    assert result.failed()
    assert calls == {"model": 2}
    assert len(errors) == 1
    assert result.id in str(errors[0]) and "'helper'" in str(errors[0])
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed" and run.attempts == 1
    assert [key for key, _ in _steps(app, result.id)] == ["helper:model", "helper:model#2"]


# -- 2. stream handlers attached to the agent ------------------------------------------------


def _streaming_agent(calls: Counter[str], events: list[AgentStreamEvent]) -> Agent[None, str]:
    async def stream(messages: list[ModelMessage], info: AgentInfo,
                     ) -> AsyncIterator[str | dict[int, DeltaToolCall]]:
        calls["model"] += 1
        if _turn(messages) == 0:
            yield {0: DeltaToolCall(name="notify", json_args='{"ref": "R"}',
                                    tool_call_id="call-0")}
        else:
            yield "all "
            yield "done"

    async def handler(ctx: RunContext[None], stream: AsyncIterable[AgentStreamEvent]) -> None:
        async for event in stream:
            events.append(event)

    agent: Agent[None, str] = Agent(FunctionModel(stream_function=stream), name="streamer",
                                    capabilities=[ProcessEventStream(handler)])
    _with_notify(agent, calls)
    return agent


def test_agent_level_stream_handler_gets_each_live_model_event_once(
        make_app: Callable[..., Celery]) -> None:
    """A ProcessEventStream on the agent gets the model's events once per live request."""
    app = make_app()
    calls: Counter[str] = Counter()
    events: list[AgentStreamEvent] = []
    durable = DurableAgent(_streaming_agent(calls, events))

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def talk() -> str:
        return durable.run_sync("hello").output

    result = talk.apply()
    assert result.successful(), result.traceback
    assert result.get() == "all done"
    assert calls == {"model": 2, "notify": 2}
    starts = [e for e in events if isinstance(e, PartStartEvent)]
    assert [type(e.part).__name__ for e in starts] == ["ToolCallPart", "TextPart"]
    assert sum(isinstance(e, PartDeltaEvent) for e in events) == 1

    # Outside a task the same agent's handler sees the same model events.
    events.clear()
    calls.clear()
    calls["notify"] = 1  # the mailer is up now
    assert durable.run_sync("hello").output == "all done"
    assert [type(e.part).__name__ for e in events if isinstance(e, PartStartEvent)] == [
        "ToolCallPart", "TextPart"]


def test_run_and_agent_stream_handlers_each_get_model_events_once(
        make_app: Callable[..., Celery]) -> None:
    """With both a run handler and an agent handler, each sees every live model event once."""
    app = make_app()
    calls: Counter[str] = Counter()
    agent_events: list[AgentStreamEvent] = []
    run_events: list[AgentStreamEvent] = []
    durable = DurableAgent(_streaming_agent(calls, agent_events))

    async def handler(ctx: RunContext[None], stream: AsyncIterable[AgentStreamEvent]) -> None:
        async for event in stream:
            run_events.append(event)

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def talk() -> str:
        return durable.run_sync("hello", event_stream_handler=handler).output

    result = talk.apply()
    assert result.successful(), result.traceback
    for events in (agent_events, run_events):
        starts = [e for e in events if isinstance(e, PartStartEvent)]
        assert [type(e.part).__name__ for e in starts] == ["ToolCallPart", "TextPart"]
        assert sum(isinstance(e, PartDeltaEvent) for e in events) == 1


# -- 3. an agent run from another agent's tool ----------------------------------------------


def test_an_agent_run_from_a_tool_nests_its_steps_under_the_tool_call(
        make_app: Callable[..., Celery]) -> None:
    """Delegation works: the inner agent's steps are keyed under the outer tool step, replayed."""
    app = make_app()
    calls: Counter[str] = Counter()
    inner: Agent[None, str] = Agent(scripted(calls, [("lookup", {"code": "FRA"})]),
                                    name="researcher")

    @inner.tool_plain
    def lookup(code: str) -> str:
        calls["lookup"] += 1
        return f"airport {code}"

    durable_inner = DurableAgent(inner)

    def outer_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        calls["outer-model"] += 1
        turn = _turn(messages)
        if turn == 0:
            return ModelResponse(parts=[ToolCallPart("research", {"topic": "FRA"},
                                                     tool_call_id="r")])
        if turn == 1:
            return ModelResponse(parts=[ToolCallPart("notify", {"ref": "R"}, tool_call_id="n")])
        return ModelResponse(parts=[TextPart(f"outer: {_model_view(messages)[0]}")])

    outer: Agent[None, str] = Agent(FunctionModel(outer_model), name="planner")

    @outer.tool_plain
    async def research(topic: str) -> str:
        calls["research"] += 1
        return (await durable_inner.run(f"research {topic}")).output

    _with_notify(outer, calls)
    durable_outer = DurableAgent(outer)

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def plan() -> str:
        return durable_outer.run_sync("plan a trip").output

    result = plan.apply()
    assert result.successful(), result.traceback
    assert result.get() == "outer: done: ['airport FRA']"
    assert calls == {"outer-model": 3, "research": 1, "model": 2, "lookup": 1, "notify": 2}
    assert _steps(app, result.id) == [(key, "completed") for key in [
        "planner:model", "planner:tool:research",
        "planner:tool:research/researcher:model",
        "planner:tool:research/researcher:tool:lookup",
        "planner:tool:research/researcher:model#2",
        "planner:model#2", "planner:tool:notify", "planner:model#3"]]


def test_concurrent_agent_runs_inside_one_tool_are_refused(
        make_app: Callable[..., Celery]) -> None:
    """Two inner agents gathered inside one tool still reach steps concurrently: refused."""
    app = make_app()
    calls: Counter[str] = Counter()

    async def slow(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        calls["inner-model"] += 1
        await asyncio.sleep(0.05)
        return ModelResponse(parts=[TextPart("hi")])

    inner = DurableAgent(Agent(FunctionModel(slow), name="inner"))
    outer: Agent[None, str] = Agent(scripted(calls, [("fan_out", {})]), name="outer")

    @outer.tool_plain
    async def fan_out() -> list[str]:
        calls["fan_out"] += 1
        results = await asyncio.gather(inner.run("a"), inner.run("b"))
        return [r.output for r in results]

    durable = DurableAgent(outer)
    errors: list[BaseException] = []

    @app.task(base=DurableTask, autoretry_for=(Exception,), retry_backoff=False, max_retries=2)
    def fan() -> str:
        try:
            return durable.run_sync("go").output
        except UnsupportedCode as exc:
            errors.append(exc)
            raise

    result = fan.apply()
    assert result.failed()
    assert len(errors) == 1 and "running in another asyncio task" in str(errors[0])
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed" and run.attempts == 1


# -- 4. output validators with approvals ----------------------------------------------------


def test_output_validator_with_an_approval_tool_waits_and_validates(
        make_app: Callable[..., Celery]) -> None:
    """An agent with an output validator and a requires_approval tool waits, then validates."""
    app = make_app(eager=False)
    calls: Counter[str] = Counter()
    agent: Agent[None, str] = Agent(scripted(calls, [("book", {"flight": "LH1"})]),
                                    name="travel")

    @agent.tool_plain(requires_approval=True)
    def book(flight: str) -> str:
        calls["book"] += 1
        return f"booked {flight}"

    @agent.output_validator
    def shout(output: str) -> str:
        calls["validator"] += 1
        return output.upper()

    durable = DurableAgent(agent)

    @app.task(base=DurableTask)
    def trip() -> str:
        return durable.run_sync("book LH1").output

    with run_worker(app):
        result = trip.delay()
        waiting = wait_for_status(app, result.id, "waiting")
        assert waiting.waiting_for == "travel:approval:book"
        assert send_signal(result.id, "travel:approval:book", True, app=app) is True
        assert result.get(timeout=RESULT_TIMEOUT) == "DONE: ['BOOKED LH1']"
    assert calls["book"] == 1 and calls["model"] == 2
    assert [key for key, _ in _steps(app, result.id)] == [
        "travel:model", "travel:approval:book", "travel:tool:book", "travel:model#2"]


# -- 5. the run forms that cannot be durable ------------------------------------------------


@pytest.mark.parametrize("form", ["iter", "run_stream", "run_stream_events", "run_stream_sync"])
def test_streaming_and_iterating_forms_are_refused_before_anything_runs(
        make_app: Callable[..., Celery], form: str) -> None:
    """iter()/run_stream*() in a durable task raise UnsupportedCode naming the task; no model."""
    app = make_app()
    calls: Counter[str] = Counter()
    durable = DurableAgent(Agent(scripted(calls, []), name="travel"))
    errors: list[BaseException] = []

    @app.task(base=DurableTask)
    def talk() -> None:
        async def main() -> None:
            if form == "iter":
                async with durable.iter("hi"):
                    pass
            elif form == "run_stream":
                async with durable.run_stream("hi"):
                    pass
            elif form == "run_stream_events":
                async with durable.run_stream_events("hi") as events:
                    async for _ in events:
                        pass
            else:
                durable.run_stream_sync("hi")
        try:
            asyncio.run(main())
        except UnsupportedCode as exc:
            errors.append(exc)
            raise

    result = talk.apply()
    assert result.failed()
    assert len(errors) == 1
    assert result.id in str(errors[0]) and "run_sync()" in str(errors[0])
    assert calls == {}
    assert _steps(app, result.id) == []


def test_streaming_and_iterating_forms_run_unchanged_outside_a_task() -> None:
    """Outside a durable task iter(), run_stream() and run_stream_events() are the agent's own."""
    calls: Counter[str] = Counter()

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        calls["model"] += 1
        yield "done: []"

    model = FunctionModel(scripted(calls, []).function, stream_function=stream)
    durable = DurableAgent(Agent(model, name="travel"))

    async def main() -> list[str]:
        outputs = []
        async with durable.iter("hi") as run:
            async for _ in run:
                pass
            assert run.result is not None
            outputs.append(run.result.output)
        async with durable.run_stream("hi") as streamed:
            outputs.append(await streamed.get_output())
        async with durable.run_stream_events("hi") as events:
            async for _ in events:
                pass
        return outputs

    assert asyncio.run(main())[:2] == ["done: []", "done: []"]
    assert calls == {"model": 3}
