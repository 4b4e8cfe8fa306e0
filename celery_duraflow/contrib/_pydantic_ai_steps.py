"""The steps of a durable Pydantic AI run: the model, the toolset and what they store.

Private to :mod:`celery_duraflow.contrib.pydantic_ai`, which documents the behaviour.
A model request is a step whose output is the response as JSON data; a tool call is a
step whose output is the call's outcome: its return value, or one of the decisions a
tool may raise for Pydantic AI to act on (``ModelRetry``, ``ToolFailed``,
``CallDeferred``, ``ApprovalRequired``, and ``RunCancelled`` from an agent run inside
the tool), which a replay raises again without running the tool.

The calls of one model response may run at the same time (Pydantic AI's parallel modes),
so the step of each call is created when the call's arguments pass validation: the graph
validates the calls of a response one after the other, in response order, before any of
them runs, so the keys follow the response, whatever order the calls start and end in.
A call takes its step by its ``tool_call_id`` when it reaches the toolset.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import TypeAdapter
from pydantic_ai.agent import EventStreamHandler
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.exceptions import (
    ApprovalRequired,
    CallDeferred,
    ModelRetry,
    RunCancelled,
    RunTimedOut,
    SkipToolValidation,
    ToolFailed,
)
from pydantic_ai.messages import (
    AgentStreamEvent,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
    ModelResponseStreamEvent,
    ToolCallPart,
    ToolReturn,
    is_multi_modal_content,
)
from pydantic_ai.models import (
    CompletedStreamedResponse,
    Model,
    ModelRequestParameters,
    StreamedResponse,
)
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import AgentDepsT, RunContext, ToolDefinition
from pydantic_ai.toolsets import AbstractToolset, WrapperToolset
from pydantic_ai.toolsets.abstract import ToolsetTool
from pydantic_core import PydanticSerializationError, to_jsonable_python

from .._context import current_run
from .._parallel import branch_note, branch_of
from .._step import BodyTasks, StepContext, step

# Every stored outcome that is not a plain return value is a dict with this key, whose
# value names the kind; the payload sits under the kind's own key.
_MARKER = "duraflow"
_MODEL_RETRY, _MODEL_RETRY_MARK = "model_retry", "pydantic_ai.ModelRetry"
_TOOL_FAILED, _TOOL_FAILED_MARK = "tool_failed", "pydantic_ai.ToolFailed"
_DEFERRED, _DEFERRED_MARK = "call_deferred", "pydantic_ai.CallDeferred"
_APPROVAL, _APPROVAL_MARK = "approval_required", "pydantic_ai.ApprovalRequired"
_CANCELLED, _CANCELLED_MARK = "run_cancelled", "pydantic_ai.RunCancelled"
# A ToolReturn, and a return value that only Pydantic AI can serialize (a model, a
# dataclass, file content), stored as a ToolReturn's JSON form: its content is
# validated back on replay, so file items come back as file items.
_TOOL_RETURN, _TOOL_RETURN_MARK = "tool_return", "pydantic_ai.ToolReturn"
_CONTENT, _CONTENT_MARK = "content", "pydantic_ai.content"

_tool_return_adapter: TypeAdapter[ToolReturn[Any]] = TypeAdapter(ToolReturn[Any])

# Fields of a message that change from one attempt to the next without changing what
# the model is asked: left out of a model step's input fingerprint.
_UNSTABLE_FIELDS = frozenset({"timestamp", "run_id", "conversation_id"})
# What the store's JSON serializer keeps as it is (kombu's JSON adds these to JSON's own).
_PLAIN_SCALARS: tuple[type, ...] = (str, int, float, bool, type(None))

# The StepContext of the tool call running in this context (see tool_step()).
current_tool_step: ContextVar[StepContext | None] = ContextVar(
    "celery_duraflow_pydantic_ai_tool_step", default=None)


@dataclass
class LiveEvents:
    """The run handler of one agent run and the model events it was handed live.

    The run handler gets a live request's events inside the step, as they stream
    in; the same events then go through the graph (for the handlers attached to the
    agent), and :meth:`filtered` keeps the run handler from getting them twice. The
    graph hands on copies, so they are matched by value, in order.
    """

    handler: EventStreamHandler[Any] | None = None
    delivered: deque[ModelResponseStreamEvent] = field(default_factory=deque)

    def filtered(self) -> EventStreamHandler[Any] | None:
        handler = self.handler
        if handler is None:
            return None
        delivered = self.delivered

        async def without_live(ctx: RunContext[Any],
                               stream: AsyncIterable[AgentStreamEvent]) -> None:
            async def rest() -> AsyncIterator[AgentStreamEvent]:
                async for event in stream:
                    if delivered and event == delivered[0]:
                        delivered.popleft()
                        continue
                    yield event
            await handler(ctx, rest())

        return without_live


live_events: ContextVar[LiveEvents | None] = ContextVar(
    "celery_duraflow_pydantic_ai_live_events", default=None)


# -- (de)serializing what the model says and is told ----------------------------------------


def dump_response(response: ModelResponse) -> dict[str, Any]:
    data: dict[str, Any] = ModelMessagesTypeAdapter.dump_python([response], mode="json")[0]
    # The graph fills these in for the run that receives the response; a replay belongs
    # to another run (attempt) and must get them filled in afresh.
    data["run_id"] = None
    data["conversation_id"] = None
    return data


def load_response(data: Any) -> ModelResponse:
    message = ModelMessagesTypeAdapter.validate_python([data])[0]
    if not isinstance(message, ModelResponse):  # pragma: no cover - we store responses only
        raise TypeError(f"a stored model step holds a {type(message).__name__}, not a response")
    return message


def _stable(value: Any) -> Any:
    """``value`` (JSON data) without the fields that change between attempts."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in _UNSTABLE_FIELDS}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def request_view(messages: Sequence[ModelMessage],
                 parameters: ModelRequestParameters) -> dict[str, Any]:
    """What a model request sends, as attempt-stable JSON data: the input fingerprinted."""
    return {
        "messages": _stable(ModelMessagesTypeAdapter.dump_python(list(messages), mode="json")),
        "tools": [tool.name for tool in parameters.function_tools],
        "output_tools": [tool.name for tool in parameters.output_tools],
    }


def _jsonable(value: Any) -> Any:
    # Validated tool arguments may hold models and dataclasses; anything that has no
    # JSON form is named by its type, never by a repr with an address in it.
    return to_jsonable_python(value, fallback=lambda obj: f"<{type(obj).__qualname__}>")


# -- a tool call's outcome ------------------------------------------------------------------


def _plain(value: Any) -> bool:
    """Whether the store keeps ``value`` as it is (and a replay cannot mistake it for an
    outcome): JSON data, without the marker key in a dict at its top."""
    if isinstance(value, _PLAIN_SCALARS):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _marked(kind: str, mark: str, payload: Any) -> dict[str, Any]:
    return {kind: payload, _MARKER: mark}


def _holds_files(value: Any) -> bool:
    """Whether ``value`` holds file content (a file item, or one in a list or dict)."""
    if is_multi_modal_content(value):
        return True
    if isinstance(value, list | tuple):
        return any(_holds_files(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_files(item) for item in value.values())
    return False


def _encode_return(value: Any) -> Any:
    """A tool's return value as the store keeps it.

    JSON data is kept as it is. A Pydantic model, a dataclass and the like are kept
    in their JSON form, which is what the model is told of them, so a replay tells
    the model the same and a reader of the run sees plain data. A ``ToolReturn`` and
    file content are kept marked, in Pydantic AI's own JSON form, and validated back
    on replay: file items come back as file items, a ToolReturn as a ToolReturn.
    """
    if isinstance(value, ToolReturn):
        return _marked(_TOOL_RETURN, _TOOL_RETURN_MARK,
                       _tool_return_adapter.dump_python(value, mode="json"))
    if _plain(value):
        if isinstance(value, dict) and _MARKER in value:
            # Could be taken for a recorded outcome on replay: kept marked instead.
            return _marked(_CONTENT, _CONTENT_MARK,
                           _tool_return_adapter.dump_python(ToolReturn(value), mode="json"))
        return value
    if not _holds_files(value):
        try:
            data = to_jsonable_python(value)
        except PydanticSerializationError:
            # Left as it is: the store refuses it (StepOutputNotSerializable), naming the step.
            return value
        if not (isinstance(data, dict) and _MARKER in data):
            return data
    try:
        dumped = _tool_return_adapter.dump_python(ToolReturn(value), mode="json")
    except PydanticSerializationError:
        return value
    return _marked(_CONTENT, _CONTENT_MARK, dumped)


async def call_outcome(call: Any) -> Any:
    """Await the tool call ``call()`` and return its outcome as storable data."""
    try:
        value = await call()
    except ModelRetry as exc:
        return _marked(_MODEL_RETRY, _MODEL_RETRY_MARK, exc.message)
    except ToolFailed as exc:
        return _marked(_TOOL_FAILED, _TOOL_FAILED_MARK, exc.message)
    except CallDeferred as exc:
        return _marked(_DEFERRED, _DEFERRED_MARK,
                       {"metadata": _jsonable(exc.metadata), "kind": exc.kind})
    except ApprovalRequired as exc:
        return _marked(_APPROVAL, _APPROVAL_MARK, {"metadata": _jsonable(exc.metadata)})
    except RunCancelled as exc:
        return _marked(_CANCELLED, _CANCELLED_MARK,
                       {"message": exc.message, "timed_out": isinstance(exc, RunTimedOut)})
    return _encode_return(value)


def replay_outcome(stored: Any) -> Any:
    """The tool call's return value from its stored outcome, or its decision raised again."""
    if not (isinstance(stored, dict) and len(stored) == 2 and isinstance(stored.get(_MARKER), str)):
        return stored
    mark = stored[_MARKER]
    if mark == _MODEL_RETRY_MARK and _MODEL_RETRY in stored:
        raise ModelRetry(str(stored[_MODEL_RETRY]))
    if mark == _TOOL_FAILED_MARK and _TOOL_FAILED in stored:
        raise ToolFailed(str(stored[_TOOL_FAILED]))
    if mark == _DEFERRED_MARK and _DEFERRED in stored:
        deferred = stored[_DEFERRED]
        raise CallDeferred(deferred.get("metadata"),
                           kind="question" if deferred.get("kind") == "question" else "external")
    if mark == _APPROVAL_MARK and _APPROVAL in stored:
        raise ApprovalRequired(stored[_APPROVAL].get("metadata"))
    if mark == _CANCELLED_MARK and _CANCELLED in stored:
        cancelled = stored[_CANCELLED]
        kind = RunTimedOut if cancelled.get("timed_out") else RunCancelled
        raise kind(str(cancelled.get("message")))
    if mark == _TOOL_RETURN_MARK and _TOOL_RETURN in stored:
        return _tool_return_adapter.validate_python(stored[_TOOL_RETURN])
    if mark == _CONTENT_MARK and _CONTENT in stored:
        return _tool_return_adapter.validate_python(stored[_CONTENT]).return_value
    return stored


# -- the model and the toolset of a durable run ---------------------------------------------


async def _captured(stream: StreamedResponse, into: list[ModelResponseStreamEvent],
                    ) -> AsyncIterator[ModelResponseStreamEvent]:
    async for event in stream:
        into.append(event)
        yield event


class DurableModel(WrapperModel):
    """A model whose requests are steps of the durable run (``<agent name>:model``)."""

    def __init__(self, wrapped: Model, *, step_name: str) -> None:
        super().__init__(wrapped)
        self.step_name = step_name

    async def request(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                      model_request_parameters: ModelRequestParameters) -> ModelResponse:
        if current_run.get() is None:
            return await super().request(messages, model_settings, model_request_parameters)

        async def send() -> dict[str, Any]:
            response = await self.wrapped.request(messages, model_settings,
                                                  model_request_parameters)
            return dump_response(response)

        s = step(self.step_name, input=request_view(messages, model_request_parameters))
        return load_response(await s.arun(send))

    @asynccontextmanager
    async def request_stream(self, messages: list[ModelMessage],
                             model_settings: ModelSettings | None,
                             model_request_parameters: ModelRequestParameters,
                             run_context: RunContext[Any] | None = None,
                             ) -> AsyncIterator[StreamedResponse]:
        if current_run.get() is None:
            async with super().request_stream(messages, model_settings, model_request_parameters,
                                              run_context) as streamed:
                yield streamed
            return
        live = live_events.get()
        handler = live.handler if live is not None else None
        events: list[ModelResponseStreamEvent] = []

        async def stream() -> dict[str, Any]:
            # The live attempt: the run's handler gets the real stream's events here, inside
            # the step, as they come; they are kept for the handlers attached to the agent.
            async with self.wrapped.request_stream(messages, model_settings,
                                                   model_request_parameters,
                                                   run_context) as streamed:
                tee = _captured(streamed, events)
                if handler is not None and run_context is not None:
                    await handler(run_context, tee)
                async for _ in tee:
                    pass
            return dump_response(streamed.get())

        s = step(self.step_name, input=request_view(messages, model_request_parameters))
        response = load_response(await s.arun(stream))
        if s.cached or not events:
            # A replay: the live attempt delivered the events, and must not deliver them again.
            yield CompletedStreamedResponse(response,
                                            model_request_parameters=model_request_parameters,
                                            replay_events=False)
            return
        if handler is not None and live is not None:
            live.delivered.extend(events)
        # The live attempt's events, once more, for the handlers the graph feeds (those
        # attached to the agent, and the run's, which skips what it already got).
        yield _RecordedStream(response, model_request_parameters=model_request_parameters,
                              replay_events=events)


class _RecordedStream(CompletedStreamedResponse):
    """Replays captured events and answers with the recorded response itself, so the
    live attempt's history holds what a replay's will."""

    def get(self) -> ModelResponse:
        return replace(super().get(), parts=list(self.response.parts))


# -- the tool calls of one model response -------------------------------------------------


class _Call:
    """One tool call whose step was created, in response order, when it passed validation."""

    __slots__ = ("barrier", "batch", "failed", "step", "taken", "task", "tool_call_id")

    def __init__(self, batch: _Batch, tool_call_id: str, s: StepContext, barrier: bool) -> None:
        self.batch = batch
        self.tool_call_id = tool_call_id
        self.step = s
        # A tool declared sequential=True runs alone, between the others.
        self.barrier = barrier
        self.taken = False
        self.failed = False
        self.task: asyncio.Task[Any] | None = None


class _Batch:
    """The tool calls validated in one step of an agent run: the calls of one response.

    Keeps the rule of parallel calls: every call that started runs to its end, and a failed
    one raises only once no sibling runs any more, the first failure in response order
    first (Pydantic AI's ``parallel`` mode would cancel the siblings still running).
    """

    def __init__(self, key: tuple[Any, ...]) -> None:
        self.key = key
        self.calls: list[_Call] = []
        self.running = 0
        self._idle: asyncio.Event | None = None

    def take(self, tool_call_id: str | None, name: str) -> _Call | None:
        for call in self.calls:
            if not call.taken and call.tool_call_id == tool_call_id and call.step.name == name:
                call.taken = True
                return call
        return None

    def alone(self, call: _Call, mode: str) -> bool:
        """Whether ``call`` runs with no sibling beside it (Pydantic AI's segments: a
        barrier runs alone, the calls between two barriers together)."""
        if mode == "sequential" or call.barrier:
            return True
        index = self.calls.index(call)
        start = index
        while start > 0 and not self.calls[start - 1].barrier:
            start -= 1
        end = index
        while end + 1 < len(self.calls) and not self.calls[end + 1].barrier:
            end += 1
        return start == end

    def begin(self, call: _Call) -> None:
        call.task = asyncio.current_task()
        self.running += 1
        if self._idle is not None:
            self._idle.clear()

    def end(self, call: _Call, *, failed: bool) -> None:
        call.failed = failed
        self.running -= 1
        if self.running == 0 and self._idle is not None:
            self._idle.set()

    async def settle(self, call: _Call) -> None:
        """After ``call`` failed: wait until no sibling runs, then until the failed
        sibling first in response order (if not this one) has raised."""
        while self.running:
            if self._idle is None:
                self._idle = asyncio.Event()
            await self._idle.wait()
        first = next(c for c in self.calls if c.failed)
        if first is not call and first.task is not None and not first.task.done():
            await asyncio.wait({first.task})


@dataclass
class ToolCallSteps:
    """The steps of the tool calls of one DurableAgent run, created as the calls validate."""

    prefix: str = ""
    batch: _Batch | None = None

    def prepare(self, ctx: RunContext[Any], call_id: str, tool_name: str,
                tool_def: ToolDefinition) -> None:
        # Those validated in one run step form a batch (calls validated later in the same
        # step join it: the 'graceful' split and the inline answers to deferred calls).
        key = (ctx.run_id, ctx.run_step)
        if self.batch is None or self.batch.key != key:
            self.batch = _Batch(key)
        self.batch.calls.append(_Call(self.batch, call_id, step(f"{self.prefix}{tool_name}"),
                                      tool_def.sequential))

    def take(self, tool_call_id: str | None, name: str) -> _Call | None:
        return self.batch.take(tool_call_id, name) if self.batch is not None else None


def _runs(tool_def: ToolDefinition, ctx: RunContext[Any]) -> bool:
    """Whether a validated call of this tool is run in the agent's run (not deferred)."""
    return tool_def.kind == "function" or (tool_def.kind == "unapproved"
                                           and ctx.tool_call_approved)


def _mode(ctx: RunContext[Any]) -> str:
    manager = ctx.tool_manager
    return manager.get_parallel_execution_mode() if manager is not None else "parallel"


_PARALLEL_WAIT = (
    "Pydantic AI runs it at the same time as the other tool calls of its model response, and "
    "a run cannot suspend while they run",
    "Wait outside the tool, declare the tool with sequential=True, or run the agent inside "
    "Agent.parallel_tool_call_execution_mode('sequential').")


@dataclass
class DurableToolset(WrapperToolset[AgentDepsT]):
    """A toolset whose tool calls are steps of the durable run (``<agent name>:tool:<tool>``)."""

    steps: ToolCallSteps = field(default_factory=ToolCallSteps)

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[AgentDepsT],
                        tool: ToolsetTool[AgentDepsT]) -> Any:
        run = current_run.get()
        if run is None:
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)
        key_name = f"{self.steps.prefix}{name}"
        arguments = {"args": _jsonable(tool_args)}
        prepared = self.steps.take(ctx.tool_call_id, key_name)
        if prepared is None:
            # A call no validation announced (a hook skipped it there): keyed where it comes.
            s = step(key_name, input=arguments)
            alone = True
        else:
            s = prepared.step
            # The arguments the tool gets, as the step created before them would have had.
            s.input_known(arguments)
            alone = prepared.batch.alone(prepared, _mode(ctx))

        async def body() -> Any:
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)

        async def call() -> Any:
            token = current_tool_step.set(s)
            beside = None if alone else (branch_of.set(s.key), branch_note.set(
                (f"tool call {s.key!r}: {_PARALLEL_WAIT[0]}", _PARALLEL_WAIT[1])))
            try:
                # An agent run inside the tool runs in tasks of its own: its steps nest in this one.
                with BodyTasks(s):
                    return await call_outcome(body)
            finally:
                if beside is not None:
                    branch_note.reset(beside[1])
                    branch_of.reset(beside[0])
                current_tool_step.reset(token)

        if prepared is None:
            return replay_outcome(await s.arun(call))
        batch = prepared.batch
        batch.begin(prepared)
        try:
            outcome = await s.arun(call)
        except asyncio.CancelledError:
            batch.end(prepared, failed=False)
            raise
        except BaseException:
            batch.end(prepared, failed=True)
            await batch.settle(prepared)
            raise
        batch.end(prepared, failed=False)
        return replay_outcome(outcome)


@dataclass
class Durability(AbstractCapability[AgentDepsT]):
    """Installs the durable model and toolset for one run of a DurableAgent, and creates the
    steps of the tool calls as they pass validation."""

    name: str = ""
    steps: ToolCallSteps = field(default_factory=ToolCallSteps)

    def __post_init__(self) -> None:
        self.steps.prefix = f"{self.name}:tool:"

    def get_wrapper_model(self, model: Model) -> Model | None:
        if isinstance(model, DurableModel):
            return None
        return DurableModel(model, step_name=f"{self.name}:model")

    def get_wrapper_toolset(self, toolset: AbstractToolset[AgentDepsT],
                            ) -> AbstractToolset[AgentDepsT] | None:
        return DurableToolset(toolset, steps=self.steps)

    async def wrap_tool_validate(self, ctx: RunContext[AgentDepsT], *, call: ToolCallPart,
                                 tool_def: ToolDefinition, args: Any, handler: Any) -> Any:
        prepare = current_run.get() is not None and _runs(tool_def, ctx)
        try:
            validated = await handler(args)
        except SkipToolValidation:
            if prepare:
                self.steps.prepare(ctx, call.tool_call_id, call.tool_name, tool_def)
            raise
        if prepare:
            self.steps.prepare(ctx, call.tool_call_id, call.tool_name, tool_def)
        return validated
