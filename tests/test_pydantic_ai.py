"""celery_duraflow.contrib.pydantic_ai: a real Pydantic AI agent (offline models) made durable.

Model requests and tool calls are steps: a retry asks the model nothing it already
answered and runs no tool that already returned; approvals are signals. On SQLite and
PostgreSQL.
"""

from __future__ import annotations

import asyncio
import gc
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from pydantic_ai import Agent, ModelRetry, RunContext
from pydantic_ai.messages import (
    AgentStreamEvent,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

from celery_duraflow import (
    DurableTask,
    InvalidStepName,
    NonDeterministicReplay,
    NotInDurableTask,
    StepInputChanged,
    UnsupportedCode,
    get_run,
    send_signal,
)
from celery_duraflow.contrib.pydantic_ai import DurableAgent, tool_step
from tests.conftest import run_worker, wait_for_status

RESULT_TIMEOUT = 30.0


@pytest.fixture(autouse=True)
def _collect_garbage() -> Iterator[None]:
    """Finalize what an agent run left for the garbage collector before the next test.

    Pydantic AI leaves coroutines and async generators behind; on CPython 3.11, one
    finalized by a collection that happens inside ``ast.parse`` (as the import graph test
    does) trips "AST constructor recursion depth mismatch". Collect them here instead.
    """
    yield
    gc.collect()


class Flaky(Exception):
    """Raised by a tool to make Celery retry the task."""


# -- a scripted model: call the tools in PLAN one after the other, then answer ---------------

PLAN = [("search", {"origin": "FRA"}), ("book", {"flight": "LH1"}), ("notify", {"ref": "R1"})]


def _turn(messages: list[ModelMessage]) -> int:
    return sum(isinstance(m, ModelResponse) for m in messages)


def _returns(messages: list[ModelMessage]) -> list[Any]:
    return [part.content for m in messages if isinstance(m, ModelRequest)
            for part in m.parts if isinstance(part, ToolReturnPart)]


def scripted(calls: Counter[str], plan: list[tuple[str, dict[str, Any]]] = PLAN,
             ) -> FunctionModel:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        calls["model"] += 1
        turn = _turn(messages)
        if turn < len(plan):
            name, args = plan[turn]
            return ModelResponse(parts=[ToolCallPart(name, args, tool_call_id=f"call-{turn}")])
        return ModelResponse(parts=[TextPart(f"done: {_returns(messages)}")])

    return FunctionModel(model)


def travel_agent(calls: Counter[str], *, notify_failures: int = 0,
                 keys: list[tuple[str, str, int, bool]] | None = None,
                 model: FunctionModel | None = None) -> Agent[None, str]:
    agent: Agent[None, str] = Agent(model or scripted(calls), name="travel")

    @agent.tool_plain
    def search(origin: str) -> list[str]:
        calls["search"] += 1
        return [f"{origin}-LH1", f"{origin}-BA9"]

    @agent.tool_plain
    def book(flight: str) -> dict[str, str]:
        calls["book"] += 1
        s = tool_step()
        if keys is not None:
            keys.append((s.key, s.idempotency_key, s.attempt, s.in_doubt))
        return {"flight": flight, "key": s.idempotency_key}

    @agent.tool_plain
    async def notify(ref: str) -> str:
        calls["notify"] += 1
        await asyncio.sleep(0)
        if calls["notify"] <= notify_failures:
            raise Flaky("mailer down")
        return f"sent {ref}"

    return agent


TRAVEL_KEYS = ["travel:model", "travel:tool:search", "travel:model#2", "travel:tool:book",
               "travel:model#3", "travel:tool:notify", "travel:model#4"]


def _keys(app: Celery, task_id: str) -> list[str]:
    run = get_run(task_id, app=app)
    assert run is not None
    return [s.key for s in run.steps]


# -- replay ---------------------------------------------------------------------------------


def test_retry_replays_model_responses_and_runs_each_tool_once(
        make_app: Callable[..., Celery]) -> None:
    """A tool failing twice: the retries ask the model nothing again and rerun only that tool."""
    app = make_app()
    calls: Counter[str] = Counter()
    durable = DurableAgent(travel_agent(calls, notify_failures=2))

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=5)
    def trip() -> str:
        return durable.run_sync("Book me a flight from FRA").output

    result = trip.apply()
    assert result.successful(), result.traceback
    assert calls == {"model": 4, "search": 1, "book": 1, "notify": 3}
    assert result.get().startswith("done: [['FRA-LH1', 'FRA-BA9'], {'flight': 'LH1'")
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded" and run.attempts == 3
    assert [(s.key, s.status, s.attempts) for s in run.steps] == [
        (key, "completed", 3 if key == "travel:tool:notify" else 1) for key in TRAVEL_KEYS]
    # The model step stores the response as JSON data.
    first = run.step("travel:model").result
    assert first["kind"] == "response"
    assert first["parts"][0]["tool_name"] == "search"


def test_async_run_replays_like_run_sync(make_app: Callable[..., Celery]) -> None:
    """`await durable.run()` in an event loop of the task replays the same way as run_sync()."""
    app = make_app()
    calls: Counter[str] = Counter()
    durable = DurableAgent(travel_agent(calls, notify_failures=1))

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=5)
    def trip() -> str:
        async def main() -> str:
            return (await durable.run("Book me a flight from FRA")).output
        return asyncio.run(main())

    result = trip.apply()
    assert result.successful(), result.traceback
    assert calls == {"model": 4, "search": 1, "book": 1, "notify": 2}
    assert _keys(app, result.id) == TRAVEL_KEYS


def test_tool_step_idempotency_key_is_stable_across_attempts(
        make_app: Callable[..., Celery]) -> None:
    """tool_step() inside a tool: the same idempotency key on every attempt of that call."""
    app = make_app()
    calls: Counter[str] = Counter()
    keys: list[tuple[str, str, int, bool]] = []
    agent = travel_agent(calls, keys=keys)

    @agent.tool_plain
    def charge(amount: int) -> str:
        calls["charge"] += 1
        s = tool_step()
        keys.append((s.key, s.idempotency_key, s.attempt, s.in_doubt))
        if calls["charge"] == 1:
            raise Flaky("card processor timed out")
        return f"charged {amount}"

    plan = [("book", {"flight": "LH1"}), ("charge", {"amount": 120})]
    agent._model = scripted(calls, plan)  # type: ignore[assignment]
    durable = DurableAgent(agent)

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def trip() -> str:
        return durable.run_sync("Book and pay").output

    result = trip.apply()
    assert result.successful(), result.traceback
    assert calls == {"model": 3, "book": 1, "charge": 2}
    (book_key, book_ikey, _, _), first, second = keys
    assert book_key == "travel:tool:book"
    assert first[0] == second[0] == "travel:tool:charge"
    assert first[1] == second[1] != book_ikey
    assert (first[2], second[2]) == (1, 2) and not first[3] and not second[3]
    # The booking's result carries its key; the replay returned the stored one.
    assert result.get().count(book_ikey) == 1


def test_tool_step_outside_a_durable_tool_call_is_refused() -> None:
    """tool_step() outside a tool that a DurableAgent runs as a step raises NotInDurableTask."""
    with pytest.raises(NotInDurableTask, match="tool_step"):
        tool_step()


def test_model_retry_from_a_tool_is_recorded_and_replayed(
        make_app: Callable[..., Celery]) -> None:
    """A tool's ModelRetry is its step's output: the replay raises it again without the tool."""
    app = make_app()
    calls: Counter[str] = Counter()
    seen_retries: list[str] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        calls["model"] += 1
        turn = _turn(messages)
        seen_retries.extend(repr(p) for m in messages if isinstance(m, ModelRequest)
                            for p in m.parts if "upper case" in repr(p))
        if turn == 0:
            return ModelResponse(parts=[ToolCallPart("lookup", {"code": "fra"}, tool_call_id="a")])
        if turn == 1:
            return ModelResponse(parts=[ToolCallPart("lookup", {"code": "FRA"}, tool_call_id="b")])
        if turn == 2:
            return ModelResponse(parts=[ToolCallPart("notify", {"ref": "R"}, tool_call_id="c")])
        return ModelResponse(parts=[TextPart("ok")])

    agent = travel_agent(calls, notify_failures=1, model=FunctionModel(model))

    @agent.tool_plain
    def lookup(code: str) -> str:
        calls["lookup"] += 1
        if code != code.upper():
            raise ModelRetry("airport codes are upper case")
        return f"airport {code}"

    durable = DurableAgent(agent)

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def trip() -> str:
        return durable.run_sync("Where is FRA?").output

    result = trip.apply()
    assert result.successful(), result.traceback
    assert result.get() == "ok"
    assert calls == {"model": 4, "lookup": 2, "notify": 2}
    run = get_run(result.id, app=app)
    assert run is not None
    assert run.step("travel:tool:lookup").result == {
        "model_retry": "airport codes are upper case", "duraflow": "pydantic_ai.ModelRetry"}
    assert run.step("travel:tool:lookup#2").result == "airport FRA"
    # The model was told of the retry (and the replay told it the same, from the store).
    assert seen_retries and "upper case" in seen_retries[0]


# -- what fails the run for good ------------------------------------------------------------


def test_unstorable_tool_result_fails_the_run_for_good(make_app: Callable[..., Celery]) -> None:
    """A tool result the serializer cannot store fails the run naming the step; no rerun."""
    app = make_app()
    calls: Counter[str] = Counter()
    agent: Agent[None, str] = Agent(scripted(calls, [("opaque", {})]), name="travel")

    @agent.tool_plain
    def opaque() -> Any:
        calls["opaque"] += 1
        return {"handle": object()}

    durable = DurableAgent(agent)

    @app.task(base=DurableTask, autoretry_for=(Exception,), retry_backoff=False, max_retries=3)
    def trip() -> str:
        return durable.run_sync("go").output

    result = trip.apply()
    assert result.failed()
    assert "travel:tool:opaque" in str(result.result)
    assert calls == {"model": 1, "opaque": 1}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed"
    assert [(s.key, s.status) for s in run.steps] == [
        ("travel:model", "completed"), ("travel:tool:opaque", "failed")]


def test_changed_prompt_is_a_non_deterministic_replay(make_app: Callable[..., Celery]) -> None:
    """A prompt that changed between attempts raises StepInputChanged at the model step."""
    app = make_app()
    calls: Counter[str] = Counter()
    prompts = iter(["Book me a flight from FRA", "Book me a flight from CDG"])
    durable = DurableAgent(travel_agent(calls, notify_failures=1))
    errors: list[BaseException] = []

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def trip() -> str:
        try:
            return durable.run_sync(next(prompts)).output
        except NonDeterministicReplay as exc:
            errors.append(exc)
            raise

    result = trip.apply()
    assert result.failed()
    assert len(errors) == 1 and isinstance(errors[0], StepInputChanged)
    assert errors[0].step_key == "travel:model"
    assert "'travel:model'" in str(errors[0])
    assert calls == {"model": 3, "search": 1, "book": 1, "notify": 1}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed" and run.attempts == 2


def test_changed_tool_arguments_are_a_non_deterministic_replay(
        make_app: Callable[..., Celery]) -> None:
    """Tool arguments that changed between attempts raise StepInputChanged at the tool step."""
    app = make_app()
    calls: Counter[str] = Counter()
    errors: list[BaseException] = []
    agent = travel_agent(calls, notify_failures=1)
    shift = {"n": 0}

    @agent.tool_plain
    def pick(flights: list[str]) -> str:
        calls["pick"] += 1
        return flights[0]

    # The arguments the tool gets are rewritten by a prepare step that changed between
    # attempts (as a deploy might): the recorded response is the same, the call is not.
    from pydantic_ai.capabilities import AbstractCapability

    class Rewrite(AbstractCapability[Any]):
        async def before_tool_execute(self, ctx: RunContext[Any], *, call: Any,
                                      tool_def: Any, args: dict[str, Any]) -> dict[str, Any]:
            if tool_def.name == "pick":
                return {"flights": [f"{f}-{shift['n']}" for f in args["flights"]]}
            return args

    plan = [("pick", {"flights": ["LH1"]}), ("notify", {"ref": "R"})]
    agent._model = scripted(calls, plan)  # type: ignore[assignment]
    durable = DurableAgent(agent)

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def trip() -> str:
        shift["n"] += 1
        try:
            return durable.run_sync("pick one", capabilities=[Rewrite()]).output
        except NonDeterministicReplay as exc:
            errors.append(exc)
            raise

    result = trip.apply()
    assert result.failed()
    assert [type(e) for e in errors] == [StepInputChanged]
    assert errors[0].step_key == "travel:tool:pick"  # type: ignore[attr-defined]
    assert calls == {"model": 2, "pick": 1, "notify": 1}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed"


def test_concurrent_agent_runs_in_one_task_are_refused(make_app: Callable[..., Celery]) -> None:
    """Two agent runs gathered in one task reach steps concurrently: UnsupportedCode, failed."""
    app = make_app()
    calls: Counter[str] = Counter()

    async def slow(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        calls["model"] += 1
        await asyncio.sleep(0.05)
        return ModelResponse(parts=[TextPart("hello")])

    durable = DurableAgent(Agent(FunctionModel(slow), name="greeter"))
    errors: list[BaseException] = []

    @app.task(base=DurableTask, autoretry_for=(Exception,), retry_backoff=False, max_retries=2)
    def both() -> list[str]:
        async def main() -> list[str]:
            results = await asyncio.gather(durable.run("a"), durable.run("b"))
            return [r.output for r in results]
        try:
            return asyncio.run(main())
        except UnsupportedCode as exc:
            errors.append(exc)
            raise

    result = both.apply()
    assert result.failed()
    assert len(errors) == 1 and "running in another asyncio task" in str(errors[0])
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed" and run.attempts == 1


def test_tool_calls_of_one_response_run_together_as_steps_numbered_in_order(
        make_app: Callable[..., Celery]) -> None:
    """Several tool calls in one model response run at once, numbered in the response's order."""
    app = make_app()
    calls: Counter[str] = Counter()
    running = {"now": 0, "max": 0}
    order: list[int] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        calls["model"] += 1
        if _turn(messages) == 0:
            return ModelResponse(parts=[ToolCallPart("fetch", {"n": n}, tool_call_id=f"c{n}")
                                        for n in (1, 2, 3)])
        return ModelResponse(parts=[TextPart(f"got {_returns(messages)}")])

    agent: Agent[None, str] = Agent(FunctionModel(model), name="fetcher")

    @agent.tool_plain
    async def fetch(n: int) -> int:
        calls["fetch"] += 1
        running["now"] += 1
        running["max"] = max(running["max"], running["now"])
        await asyncio.sleep(0.02 * (4 - n))
        running["now"] -= 1
        order.append(n)
        return n * 10

    durable = DurableAgent(agent)

    @app.task(base=DurableTask)
    def fetch_all() -> str:
        return durable.run_sync("fetch three").output

    result = fetch_all.apply()
    assert result.successful(), result.traceback
    assert result.get() == "got [10, 20, 30]"
    assert running["max"] == 3 and order == [3, 2, 1]
    assert _keys(app, result.id) == ["fetcher:model", "fetcher:tool:fetch",
                                     "fetcher:tool:fetch#2", "fetcher:tool:fetch#3",
                                     "fetcher:model#2"]


# -- streaming ------------------------------------------------------------------------------


def test_streamed_events_are_delivered_once_across_retries(
        make_app: Callable[..., Celery]) -> None:
    """With event_stream_handler, each recorded response's events reach the handler once."""
    app = make_app()
    calls: Counter[str] = Counter()
    events: list[AgentStreamEvent] = []

    async def stream(messages: list[ModelMessage], info: AgentInfo,
                     ) -> AsyncIterator[str | dict[int, DeltaToolCall]]:
        calls["model"] += 1
        turn = _turn(messages)
        if turn < len(PLAN):
            name, args = PLAN[turn]
            import json
            yield {0: DeltaToolCall(name=name, json_args=json.dumps(args),
                                    tool_call_id=f"call-{turn}")}
        else:
            yield "all "
            yield "done"

    agent = travel_agent(calls, notify_failures=1,
                         model=FunctionModel(stream_function=stream))
    durable = DurableAgent(agent)

    async def handler(ctx: RunContext[None], stream: AsyncIterable[AgentStreamEvent]) -> None:
        async for event in stream:
            events.append(event)

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def trip() -> str:
        return durable.run_sync("Book me a flight", event_stream_handler=handler).output

    result = trip.apply()
    assert result.successful(), result.traceback
    assert result.get() == "all done"
    assert calls == {"model": 4, "search": 1, "book": 1, "notify": 2}
    starts = [e for e in events if isinstance(e, PartStartEvent)]
    assert [type(e.part).__name__ for e in starts] == [
        "ToolCallPart", "ToolCallPart", "ToolCallPart", "TextPart"]
    assert [e.part.tool_name for e in starts[:3]] == [  # type: ignore[union-attr]
        "search", "book", "notify"]
    assert sum(isinstance(e, PartDeltaEvent) for e in events) == 1  # "done" after "all "
    assert _keys(app, result.id) == TRAVEL_KEYS


# -- approvals ------------------------------------------------------------------------------


def approval_agent(calls: Counter[str], answers: list[Any]) -> Agent[None, str]:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        calls["model"] += 1
        if _turn(messages) == 0:
            return ModelResponse(parts=[ToolCallPart("book", {"flight": "LH1"},
                                                     tool_call_id="book-1")])
        answers.extend(_returns(messages))
        return ModelResponse(parts=[TextPart(f"finished: {_returns(messages)[-1]}")])

    agent: Agent[None, str] = Agent(FunctionModel(model), name="travel")

    @agent.tool_plain(requires_approval=True)
    def book(flight: str) -> dict[str, str]:
        calls["book"] += 1
        return {"flight": flight, "ref": "BK1"}

    return agent


@pytest.mark.parametrize(("payload", "booked", "told"), [
    (True, 1, "{'flight': 'LH1', 'ref': 'BK1'}"),
    ({"approved": True}, 1, "{'flight': 'LH1', 'ref': 'BK1'}"),
    ({"approved": False, "message": "too expensive"}, 0, "too expensive"),
    (False, 0, "The call of book was not approved."),
    (None, 0, "The call of book was not approved."),
], ids=["true", "approved", "rejected-with-message", "false", "none"])
def test_approval_waits_for_the_signal_and_applies_its_answer(
        make_app: Callable[..., Celery], payload: Any, booked: int, told: str) -> None:
    """A requires_approval tool waits (run `waiting`); the signal approves or rejects the call."""
    app = make_app(eager=False)
    calls: Counter[str] = Counter()
    answers: list[Any] = []
    durable = DurableAgent(approval_agent(calls, answers))

    @app.task(base=DurableTask)
    def trip() -> str:
        return durable.run_sync("Book LH1").output

    with run_worker(app):
        result = trip.delay()
        waiting = wait_for_status(app, result.id, "waiting")
        assert (waiting.wait_kind, waiting.waiting_for) == ("signal", "travel:approval:book")
        assert calls == {"model": 1}
        assert send_signal(result.id, "travel:approval:book", payload, app=app) is True
        assert result.get(timeout=RESULT_TIMEOUT) == f"finished: {told}"
    assert calls == {"model": 2, **({"book": 1} if booked else {})}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded"
    expected = ["travel:model", "travel:approval:book"]
    expected += ["travel:tool:book"] if booked else []
    assert [s.key for s in run.steps] == [*expected, "travel:model#2"]
    assert run.step("travel:approval:book").result == {
        "signal": "travel:approval:book", "payload": payload}


def test_approval_that_never_comes_is_a_rejection(make_app: Callable[..., Celery]) -> None:
    """No signal within approval_timeout: the call is refused and the model is told so."""
    app = make_app(eager=False)
    calls: Counter[str] = Counter()
    answers: list[Any] = []
    durable = DurableAgent(approval_agent(calls, answers), approval_timeout=0.3)

    @app.task(base=DurableTask)
    def trip() -> str:
        return durable.run_sync("Book LH1").output

    with run_worker(app):
        result = trip.delay()
        output = result.get(timeout=RESULT_TIMEOUT)
    assert "No approval for the call of book came in time" in output
    assert calls == {"model": 2}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded"
    assert run.step("travel:approval:book").result["timed_out"] is True


# -- outside a durable task, and the wrapper itself ------------------------------------------


def test_outside_a_durable_task_the_agent_runs_unchanged(tmp_path: Any) -> None:
    """Called outside a durable task, the wrapper runs the plain agent: no steps, no store."""
    calls: Counter[str] = Counter()
    agent: Agent[None, str] = Agent(scripted(calls, PLAN[:2]), name="travel")
    seen: list[str] = []

    @agent.tool_plain
    def search(origin: str) -> list[str]:
        calls["search"] += 1
        return [f"{origin}-LH1"]

    @agent.tool_plain
    def book(flight: str) -> str:
        calls["book"] += 1
        try:
            tool_step()
        except NotInDurableTask:
            seen.append("no step")
        return "booked"

    durable = DurableAgent(agent)
    plain = agent.run_sync("go").output
    wrapped = durable.run_sync("go").output

    async def main() -> str:
        return (await durable.run("go")).output

    assert plain == wrapped == asyncio.run(main()) == "done: [['FRA-LH1'], 'booked']"
    assert calls == {"model": 9, "search": 3, "book": 3}
    assert seen == ["no step"] * 3
    assert not list(tmp_path.iterdir())


def test_the_name_defaults_to_the_agents_and_must_be_a_step_name() -> None:
    """DurableAgent takes the agent's name; no name, or one with '/' or '#', is refused."""
    agent: Agent[None, str] = Agent(FunctionModel(lambda m, i: ModelResponse(parts=[])),
                                    name="travel")
    assert DurableAgent(agent).name == "travel"
    assert DurableAgent(agent, name="other").name == "other"
    assert DurableAgent(agent).agent is agent
    with pytest.raises(ValueError, match="needs a name"):
        DurableAgent(Agent(FunctionModel(lambda m, i: ModelResponse(parts=[]))))
    for bad in ("a/b", "a#2", ""):
        with pytest.raises(InvalidStepName):
            DurableAgent(agent, name=bad)
    assert not isinstance(UserPromptPart("x"), ModelResponse)
