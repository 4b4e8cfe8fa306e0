"""DurableAgent runs the tool calls of one model response the way Pydantic AI would: in parallel.

The step of each call gets its key in the order the calls appear in the model response,
before any of them runs, so a replay matches the records whatever order the calls start or
end in, and runs recorded while the calls ran one at a time replay unchanged. Every call
that started runs to its end and its outcome is recorded once; the first failure in
response order is raised. A wait inside a call that runs beside others is refused; a user
who asks for sequential tool calls still gets them. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery
from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.tools import RunContext, ToolDefinition

from celery_duraflow import DurableTask, UnsupportedCode, get_run, step, wait_for_signal
from celery_duraflow.contrib import _pydantic_ai_steps
from celery_duraflow.contrib.pydantic_ai import DurableAgent, tool_step
from celery_duraflow.signals import step_replayed
from tests.conftest import run_worker
from tests.test_pydantic_ai import (  # the autouse fixture applies here too, once imported
    Flaky,
    _collect_garbage,  # noqa: F401
    _returns,
    _turn,
)

RESULT_TIMEOUT = 30.0
KEYS = ["fetcher:model", "fetcher:tool:fetch", "fetcher:tool:fetch#2", "fetcher:tool:fetch#3",
        "fetcher:model#2"]


@dataclass
class Fetcher:
    """An agent whose model asks for fetch(n=1), fetch(n=2), fetch(n=3) in one response.

    Each call records its span and its step's key; ``sleeps[n]`` is how long call ``n``
    takes, ``fail[n]`` how many of its first calls raise Flaky. ``model_failures`` makes
    the second model request fail that many times (a failure after the calls).
    """

    sleeps: dict[int, float] = field(default_factory=lambda: {1: 0.2, 2: 0.2, 3: 0.2})
    fail: dict[int, int] = field(default_factory=dict)
    model_failures: int = 0
    calls: Counter[str] = field(default_factory=Counter)
    spans: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    keys: dict[int, list[str]] = field(default_factory=dict)
    ended: list[int] = field(default_factory=list)

    def agent(self, *capabilities: AbstractCapability[Any]) -> Agent[None, str]:
        def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            self.calls["model"] += 1
            if _turn(messages) == 0:
                return ModelResponse(parts=[ToolCallPart("fetch", {"n": n}, tool_call_id=f"c{n}")
                                            for n in (1, 2, 3)])
            self.calls["answer"] += 1
            if self.calls["answer"] <= self.model_failures:
                raise Flaky("model provider down")
            return ModelResponse(parts=[TextPart(f"got {_returns(messages)}")])

        agent: Agent[None, str] = Agent(FunctionModel(model), name="fetcher",
                                        capabilities=list(capabilities))

        @agent.tool_plain
        async def fetch(n: int) -> int:
            self.calls[f"fetch{n}"] += 1
            self.keys.setdefault(n, []).append(tool_step().key)
            start = time.monotonic()
            await asyncio.sleep(self.sleeps.get(n, 0.0))
            self.spans.setdefault(n, []).append((start, time.monotonic()))
            self.ended.append(n)
            if self.calls[f"fetch{n}"] <= self.fail.get(n, 0):
                raise Flaky(f"fetch {n} failed")
            return n * 10

        return agent


def _overlap(spans: list[tuple[float, float]]) -> bool:
    """Whether every one of the intervals overlaps every other one."""
    return max(start for start, _ in spans) < min(end for _, end in spans)


def _steps(app: Celery, task_id: str) -> list[tuple[str, str, int]]:
    run = get_run(task_id, app=app)
    assert run is not None
    return [(s.key, s.status, s.attempts) for s in run.steps]


@dataclass
class DelayBeforeCall(AbstractCapability[Any]):
    """Holds each call of fetch(n) back ``delays[n]`` seconds before the tool is called,
    from the attempt ``attempt[0]`` names on: the calls reach the tool in another order."""

    delays: dict[int, float] = field(default_factory=dict)
    attempt: list[int] = field(default_factory=lambda: [0])
    from_attempt: int = 2

    async def before_tool_execute(self, ctx: RunContext[Any], *, call: ToolCallPart,
                                  tool_def: ToolDefinition, args: dict[str, Any],
                                  ) -> dict[str, Any]:
        if self.attempt[0] >= self.from_attempt:
            await asyncio.sleep(self.delays.get(int(args["n"]), 0.0))
        return args


# -- (a) the calls of one response run at the same time ---------------------------------------


def test_tool_calls_of_one_response_run_at_the_same_time_with_keys_in_response_order(
        make_app: Callable[..., Celery]) -> None:
    """Three calls of one response overlap in time; their keys follow the response order."""
    app = make_app()
    fetcher = Fetcher(sleeps={1: 0.3, 2: 0.2, 3: 0.1})
    durable = DurableAgent(fetcher.agent())

    @app.task(base=DurableTask)
    def fetch_all() -> str:
        return durable.run_sync("fetch three").output

    result = fetch_all.apply()
    assert result.successful(), result.traceback
    assert result.get() == "got [10, 20, 30]"
    assert _overlap([fetcher.spans[n][0] for n in (1, 2, 3)])
    assert fetcher.ended == [3, 2, 1]  # they ended in the reverse order...
    # ... and each call's step (tool_step()) still has the key of its place in the response.
    assert fetcher.keys == {1: ["fetcher:tool:fetch"], 2: ["fetcher:tool:fetch#2"],
                            3: ["fetcher:tool:fetch#3"]}
    assert _steps(app, result.id) == [(key, "completed", 1) for key in KEYS]


# -- (b) a retry replays them whatever order they come and end in -----------------------------


def test_retry_replays_parallel_calls_whatever_order_they_reach_the_tool_in(
        make_app: Callable[..., Celery]) -> None:
    """A later failure: the retry answers all three calls from the store, in another order."""
    app = make_app()
    fetcher = Fetcher(sleeps={1: 0.05, 2: 0.15, 3: 0.25}, model_failures=1)
    # On the second attempt call 3 reaches the tool first and call 1 last.
    delay = DelayBeforeCall(delays={1: 0.2, 2: 0.1, 3: 0.0})
    durable = DurableAgent(fetcher.agent(delay))
    reached: dict[int, list[str]] = {}

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def fetch_all() -> str:
        delay.attempt[0] += 1
        return durable.run_sync("fetch three").output

    def on_replayed(sender: Any, step_key: str, **kwargs: Any) -> None:
        if ":tool:" in step_key:
            reached.setdefault(delay.attempt[0], []).append(step_key)

    step_replayed.connect(on_replayed)
    try:
        result = fetch_all.apply()
    finally:
        step_replayed.disconnect(on_replayed)
    assert result.successful(), result.traceback
    assert result.get() == "got [10, 20, 30]"
    assert fetcher.calls == {"model": 3, "answer": 2, "fetch1": 1, "fetch2": 1, "fetch3": 1}
    assert fetcher.ended == [1, 2, 3]
    assert _overlap([fetcher.spans[n][0] for n in (1, 2, 3)])
    # The second attempt replayed the calls in the order they reached the tool: 3, 2, 1.
    assert reached == {2: ["fetcher:tool:fetch#3", "fetcher:tool:fetch#2", "fetcher:tool:fetch"]}
    assert _steps(app, result.id) == [
        (key, "completed", 2 if key == "fetcher:model#2" else 1) for key in KEYS]


# -- (c) a failing call among its siblings ----------------------------------------------------


def test_a_failing_call_lets_its_siblings_finish_and_the_retry_runs_only_it(
        make_app: Callable[..., Celery]) -> None:
    """Call 2 fails early: calls 1 and 3 still finish and record once; the retry runs call 2."""
    app = make_app()
    fetcher = Fetcher(sleeps={1: 0.3, 2: 0.05, 3: 0.3}, fail={2: 1})
    durable = DurableAgent(fetcher.agent())

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def fetch_all() -> str:
        return durable.run_sync("fetch three").output

    result = fetch_all.apply()
    assert result.successful(), result.traceback
    assert result.get() == "got [10, 20, 30]"
    assert fetcher.calls == {"model": 2, "answer": 1, "fetch1": 1, "fetch2": 2, "fetch3": 1}
    # The first attempt ran all three together; the second ran call 2 alone.
    assert _overlap([fetcher.spans[n][0] for n in (1, 2, 3)])
    assert fetcher.ended == [2, 1, 3, 2] or fetcher.ended == [2, 3, 1, 2]
    assert _steps(app, result.id) == [
        (key, "completed", 2 if key == "fetcher:tool:fetch#2" else 1) for key in KEYS]


def test_the_first_failure_in_response_order_is_raised_after_every_call_ended(
        make_app: Callable[..., Celery]) -> None:
    """Calls 2 and 3 fail, 3 first: call 2's error is raised, once call 1 has finished too."""
    app = make_app()
    fetcher = Fetcher(sleeps={1: 0.3, 2: 0.15, 3: 0.05}, fail={2: 1, 3: 1})
    durable = DurableAgent(fetcher.agent())

    @app.task(base=DurableTask)
    def fetch_all() -> str:
        return durable.run_sync("fetch three").output

    result = fetch_all.apply()
    assert result.failed()
    assert isinstance(result.result, Flaky) and str(result.result) == "fetch 2 failed"
    assert fetcher.ended == [3, 2, 1]
    assert _steps(app, result.id) == [
        ("fetcher:model", "completed", 1), ("fetcher:tool:fetch", "completed", 1),
        ("fetcher:tool:fetch#2", "failed", 1), ("fetcher:tool:fetch#3", "failed", 1)]


# -- (d) runs recorded while the calls ran one at a time --------------------------------------


async def _call_tool_as_before(self: Any, name: str, tool_args: dict[str, Any],
                               ctx: RunContext[Any], tool: Any) -> Any:
    """DurableToolset.call_tool as it was when tool calls ran one at a time: the step is
    created when the call reaches the tool."""
    s = step(f"{self.steps.prefix}{name}",
             input={"args": _pydantic_ai_steps._jsonable(tool_args)})

    async def body() -> Any:
        return await self.wrapped.call_tool(name, tool_args, ctx, tool)

    async def call() -> Any:
        token = _pydantic_ai_steps.current_tool_step.set(s)
        try:
            with _pydantic_ai_steps.BodyTasks(s):
                return await _pydantic_ai_steps.call_outcome(body)
        finally:
            _pydantic_ai_steps.current_tool_step.reset(token)

    return _pydantic_ai_steps.replay_outcome(await s.arun(call))


def test_a_run_recorded_with_sequential_tool_calls_replays_with_parallel_ones(
        make_app: Callable[..., Celery], monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps recorded by the one-at-a-time code replay under the parallel code, tools unrun."""
    app = make_app()
    fetcher = Fetcher(sleeps={1: 0.05, 2: 0.05, 3: 0.05}, model_failures=1)
    delay = DelayBeforeCall(delays={1: 0.2, 2: 0.1, 3: 0.0})
    agent = fetcher.agent(delay)
    durable = DurableAgent(agent)
    new_call_tool = _pydantic_ai_steps.DurableToolset.call_tool
    new_wrap_tool_validate = _pydantic_ai_steps.Durability.wrap_tool_validate

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def fetch_all() -> str:
        delay.attempt[0] += 1
        if delay.attempt[0] == 1:
            # The first attempt as the earlier release ran it: calls one at a time, each
            # step created as its call reached the tool, nothing prepared ahead.
            monkeypatch.setattr(_pydantic_ai_steps.DurableToolset, "call_tool",
                                _call_tool_as_before)
            monkeypatch.setattr(_pydantic_ai_steps.Durability, "wrap_tool_validate",
                                AbstractCapability.wrap_tool_validate)
            try:
                with agent.parallel_tool_call_execution_mode("sequential"):
                    return durable.run_sync("fetch three").output
            finally:
                monkeypatch.setattr(_pydantic_ai_steps.DurableToolset, "call_tool",
                                    new_call_tool)
                monkeypatch.setattr(_pydantic_ai_steps.Durability, "wrap_tool_validate",
                                    new_wrap_tool_validate)
        return durable.run_sync("fetch three").output

    result = fetch_all.apply()
    assert result.successful(), result.traceback
    assert result.get() == "got [10, 20, 30]"
    assert fetcher.calls == {"model": 3, "answer": 2, "fetch1": 1, "fetch2": 1, "fetch3": 1}
    assert fetcher.ended == [1, 2, 3]  # one at a time, the first attempt
    assert _steps(app, result.id) == [
        (key, "completed", 2 if key == "fetcher:model#2" else 1) for key in KEYS]


# -- (e) the user's own sequential mode --------------------------------------------------------


def test_a_sequential_mode_set_by_the_user_still_runs_the_calls_one_at_a_time(
        make_app: Callable[..., Celery]) -> None:
    """Agent.parallel_tool_call_execution_mode('sequential') around the run: one call at a time."""
    app = make_app()
    fetcher = Fetcher(sleeps={1: 0.06, 2: 0.04, 3: 0.02})
    agent = fetcher.agent()
    durable = DurableAgent(agent)

    @app.task(base=DurableTask)
    def fetch_all() -> str:
        with agent.parallel_tool_call_execution_mode("sequential"):
            return durable.run_sync("fetch three").output

    result = fetch_all.apply()
    assert result.successful(), result.traceback
    assert fetcher.ended == [1, 2, 3]
    spans = [fetcher.spans[n][0] for n in (1, 2, 3)]
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(2))
    assert _steps(app, result.id) == [(key, "completed", 1) for key in KEYS]


# -- waits inside parallel calls ---------------------------------------------------------------


def test_a_wait_inside_a_call_that_runs_beside_others_is_refused(
        make_app: Callable[..., Celery]) -> None:
    """wait_for_signal in one of two parallel calls: UnsupportedCode naming the run and step."""
    app = make_app()
    ran: Counter[str] = Counter()

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if _turn(messages) == 0:
            return ModelResponse(parts=[ToolCallPart("ask", {"q": "go?"}, tool_call_id="a"),
                                        ToolCallPart("note", {"text": "hi"}, tool_call_id="b")])
        return ModelResponse(parts=[TextPart(f"got {_returns(messages)}")])

    agent: Agent[None, str] = Agent(FunctionModel(model), name="asker")

    @agent.tool_plain
    def ask(q: str) -> Any:
        ran["ask"] += 1
        return wait_for_signal("answer")

    @agent.tool_plain
    async def note(text: str) -> str:
        ran["note"] += 1
        await asyncio.sleep(0.05)
        return text

    durable = DurableAgent(agent)

    @app.task(base=DurableTask, autoretry_for=(Exception,), retry_backoff=False, max_retries=2)
    def ask_all() -> str:
        return durable.run_sync("ask").output

    result = ask_all.apply()
    assert result.failed()
    error = result.result
    assert isinstance(error, UnsupportedCode)
    assert error.task_id == result.id and error.step_key == "answer"
    assert "'asker:tool:ask'" in str(error) and "parallel" in str(error)
    # Refused for good, once; the sibling finished and recorded its result.
    assert ran == {"ask": 1, "note": 1}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed" and run.attempts == 1
    assert dict((k, s) for k, s, _ in _steps(app, result.id)) == {
        "asker:model": "completed", "asker:tool:ask": "failed", "asker:tool:note": "completed"}


def test_a_wait_inside_the_only_call_of_a_response_suspends_and_resumes(
        make_app: Callable[..., Celery]) -> None:
    """A call alone in its response may still wait: the run suspends, the signal resumes it."""
    from celery_duraflow import send_signal
    from tests.conftest import wait_for_status

    app = make_app(eager=False)
    ran: Counter[str] = Counter()

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        turn = _turn(messages)
        if turn == 0:
            return ModelResponse(parts=[ToolCallPart("ask", {"q": "go?"}, tool_call_id="a")])
        if turn == 1:
            return ModelResponse(parts=[ToolCallPart("note", {"text": "x"}, tool_call_id="b"),
                                        ToolCallPart("note", {"text": "y"}, tool_call_id="c")])
        return ModelResponse(parts=[TextPart(f"got {_returns(messages)}")])

    agent: Agent[None, str] = Agent(FunctionModel(model), name="asker")

    @agent.tool_plain
    def ask(q: str) -> Any:
        ran["ask"] += 1
        return wait_for_signal("answer")

    @agent.tool_plain
    async def note(text: str) -> str:
        ran["note"] += 1
        return text

    durable = DurableAgent(agent)

    @app.task(base=DurableTask)
    def ask_all() -> str:
        return durable.run_sync("ask").output

    with run_worker(app):
        result = ask_all.delay()
        waiting = wait_for_status(app, result.id, "waiting")
        assert waiting.waiting_for == "asker:tool:ask/answer"
        assert send_signal(result.id, "asker:tool:ask/answer", "yes", app=app) is True
        assert result.get(timeout=RESULT_TIMEOUT) == "got ['yes', 'x', 'y']"
    assert ran == {"ask": 2, "note": 2}
    assert [k for k, s, _ in _steps(app, result.id)] == [
        "asker:model", "asker:tool:ask/answer", "asker:tool:ask", "asker:model#2",
        "asker:tool:note", "asker:tool:note#2", "asker:model#3"]
