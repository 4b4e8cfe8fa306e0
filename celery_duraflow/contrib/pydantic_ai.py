"""Durable Pydantic AI agents: model requests and tool calls as steps, approvals as signals.

:class:`DurableAgent` wraps a Pydantic AI :class:`~pydantic_ai.Agent`. Inside a
durable task run, every request to the model is a step (``<name>:model``,
``<name>:model#2``, ...) whose output is the model's response, and every tool
call is a step (``<name>:tool:<tool name>``, ...) whose output is the tool's
return value. On a retry the agent runs from its prompt again, and each request
and call that completed earlier is answered from the store: the provider is not
asked again and the tool does not run again, so the agent takes the same
decisions and the side effects happen once.

It follows the structure of Pydantic AI's own durable-execution wrappers
(``pydantic_ai.durable_exec``): the model is wrapped in a
:class:`~pydantic_ai.models.wrapper.WrapperModel` and the run's toolset in a
:class:`~pydantic_ai.toolsets.WrapperToolset`, both installed for the run by a
capability (``get_wrapper_model`` / ``get_wrapper_toolset``), so whatever model
serves a request (the agent's, a run's ``model=``, an ``agent.override``) and
whatever toolsets the run has go through them. Tool calls run one at a time
(``parallel_tool_call_execution_mode('sequential')``), since the steps of a run
must be reached in the same order on every attempt.

Outside a durable task the wrapped agent runs unchanged: nothing is stored.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Generator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic

from pydantic_ai import Agent
from pydantic_ai.agent import EventStreamHandler
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.exceptions import ModelRetry
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
)
from pydantic_ai.models import (
    CompletedStreamedResponse,
    Model,
    ModelRequestParameters,
    StreamedResponse,
)
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.run import AgentRunResult
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import (
    AgentDepsT,
    DeferredToolRequests,
    DeferredToolResults,
    RunContext,
    ToolDenied,
)
from pydantic_ai.toolsets import AbstractToolset, WrapperToolset
from pydantic_ai.toolsets.abstract import ToolsetTool
from pydantic_core import to_jsonable_python

from .._context import ReplayStop, Suspended, Unwind, current_run
from .._step import StepContext, _name_problem, step
from .._waits import wait_for_signal
from ..errors import DuraflowError, InvalidStepName, NotInDurableTask, SignalTimeout

__all__ = ["DurableAgent", "tool_step"]

# The stored output of a tool call that raised ModelRetry: the retry is part of the
# conversation, so a replay raises it again rather than calling the tool.
_MODEL_RETRY = "model_retry"
_MARKER = "duraflow"
_MODEL_RETRY_MARK = "pydantic_ai.ModelRetry"

# Fields of a message that change from one attempt to the next without changing what
# the model is asked: left out of a model step's input fingerprint.
_UNSTABLE_FIELDS = frozenset({"timestamp", "run_id", "conversation_id"})

# The StepContext of the tool call running in this context (see tool_step()).
_current_tool_step: ContextVar[StepContext | None] = ContextVar(
    "celery_duraflow_pydantic_ai_tool_step", default=None)
# The run's event_stream_handler, for the model step that streams a live response.
_stream_handler: ContextVar[EventStreamHandler[Any] | None] = ContextVar(
    "celery_duraflow_pydantic_ai_stream_handler", default=None)


def tool_step() -> StepContext:
    """The step that the running tool call is, inside a tool called by a :class:`DurableAgent`.

    Its ``idempotency_key`` is the same on every attempt of this call of this
    run (pass it to payment and booking APIs), ``in_doubt`` is True when an
    earlier attempt started this call and never recorded its end, and
    ``attempt`` counts the attempts of this call.

    Raises :class:`~celery_duraflow.NotInDurableTask` anywhere else: outside a
    tool, or in a tool of an agent run outside a durable task.
    """
    current = _current_tool_step.get()
    if current is None:
        run = current_run.get()
        raise NotInDurableTask(
            "tool_step() was called outside a tool call that a DurableAgent runs as a step "
            "(outside a tool, or in an agent run outside a durable task), so there is no step "
            "to describe. Call it inside a tool of an agent wrapped in DurableAgent, run from a "
            "task with base=DurableTask.",
            task_id=run.task_id if run is not None else None)
    return current


# -- (de)serializing what the model says and is told ----------------------------------------


def _dump_response(response: ModelResponse) -> dict[str, Any]:
    data: dict[str, Any] = ModelMessagesTypeAdapter.dump_python([response], mode="json")[0]
    # The graph fills these in for the run that receives the response; a replay belongs
    # to another run (attempt) and must get them filled in afresh.
    data["run_id"] = None
    data["conversation_id"] = None
    return data


def _load_response(data: Any) -> ModelResponse:
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


def _request_view(messages: Sequence[ModelMessage],
                  parameters: ModelRequestParameters) -> dict[str, Any]:
    """What a model request sends, as attempt-stable JSON data: the input fingerprinted.

    Part kinds, contents, tool names, arguments and call ids, instructions, and the
    names of the tools offered; not the timestamps and run ids that every attempt
    makes anew.
    """
    return {
        "messages": _stable(ModelMessagesTypeAdapter.dump_python(list(messages), mode="json")),
        "tools": [tool.name for tool in parameters.function_tools],
        "output_tools": [tool.name for tool in parameters.output_tools],
    }


def _jsonable(value: Any) -> Any:
    # Validated tool arguments may hold models and dataclasses; anything that has no
    # JSON form is named by its type, never by a repr with an address in it.
    return to_jsonable_python(value, fallback=lambda obj: f"<{type(obj).__qualname__}>")


# -- the model and the toolset of a durable run ---------------------------------------------


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
            return _dump_response(response)

        s = step(self.step_name, input=_request_view(messages, model_request_parameters))
        return _load_response(await s.arun(send))

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
        handler = _stream_handler.get()

        async def stream() -> dict[str, Any]:
            # The live attempt: the handler gets the real stream's events here, inside the
            # step; only the final response is recorded.
            async with self.wrapped.request_stream(messages, model_settings,
                                                   model_request_parameters,
                                                   run_context) as streamed:
                if handler is not None and run_context is not None:
                    await handler(run_context, streamed)
                async for _ in streamed:
                    pass
            return _dump_response(streamed.get())

        s = step(self.step_name, input=_request_view(messages, model_request_parameters))
        response = _load_response(await s.arun(stream))
        # No events: the live attempt delivered them, and a replay must not deliver them again.
        yield CompletedStreamedResponse(response, model_request_parameters=model_request_parameters,
                                        replay_events=False)


@dataclass
class DurableToolset(WrapperToolset[AgentDepsT]):
    """A toolset whose tool calls are steps of the durable run (``<agent name>:tool:<tool>``)."""

    step_prefix: str = ""

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[AgentDepsT],
                        tool: ToolsetTool[AgentDepsT]) -> Any:
        if current_run.get() is None:
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)
        s = step(f"{self.step_prefix}{name}", input={"args": _jsonable(tool_args)})

        async def call() -> Any:
            token = _current_tool_step.set(s)
            try:
                return await self.wrapped.call_tool(name, tool_args, ctx, tool)
            except ModelRetry as retry:
                # Part of the conversation: recorded, and raised again on every replay.
                return {_MODEL_RETRY: retry.message, _MARKER: _MODEL_RETRY_MARK}
            finally:
                _current_tool_step.reset(token)

        value = await s.arun(call)
        if (isinstance(value, dict) and value.keys() == {_MODEL_RETRY, _MARKER}
                and value[_MARKER] == _MODEL_RETRY_MARK):
            raise ModelRetry(str(value[_MODEL_RETRY]))
        return value


@dataclass
class _Durability(AbstractCapability[AgentDepsT]):
    """Installs the durable model and toolset for one run of a :class:`DurableAgent`."""

    name: str = ""

    def get_wrapper_model(self, model: Model) -> Model | None:
        if isinstance(model, DurableModel):
            return None
        return DurableModel(model, step_name=f"{self.name}:model")

    def get_wrapper_toolset(self, toolset: AbstractToolset[AgentDepsT],
                            ) -> AbstractToolset[AgentDepsT] | None:
        return DurableToolset(toolset, step_prefix=f"{self.name}:tool:")


# -- approvals ------------------------------------------------------------------------------


def _approval(tool_name: str, payload: Any) -> bool | ToolDenied:
    """The answer to an approval request from the payload of its signal."""
    if payload is True:
        return True
    if isinstance(payload, dict):
        if payload.get("approved") is True:
            return True
        message = payload.get("message")
        if isinstance(message, str) and message.strip():
            return ToolDenied(message)
    # False, None, {"approved": false} and anything else: refused (fail closed).
    return ToolDenied(f"The call of {tool_name} was not approved.")


def _has_deferred(output_type: Any) -> bool:
    if output_type is DeferredToolRequests:
        return True
    if isinstance(output_type, Sequence) and not isinstance(output_type, str):
        return any(_has_deferred(item) for item in output_type)
    return False


def _leaf(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The exception to raise in place of an exception group from the agent's task group.

    A wait's Suspended, an Unwind, a replay check's stop and the library's own errors
    come first; otherwise the group's only exception, if it has one.
    """
    leaves: list[BaseException] = []

    def collect(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                collect(inner)
        else:
            leaves.append(exc)

    collect(group)
    for kinds in ((Suspended, Unwind, ReplayStop), (DuraflowError,)):
        for exc in leaves:
            if isinstance(exc, kinds):
                return exc
    return leaves[0] if len(leaves) == 1 else None


# -- the wrapper ----------------------------------------------------------------------------


class DurableAgent(Generic[AgentDepsT]):
    """A Pydantic AI agent whose model requests and tool calls are durable steps.

    ``name`` (by default the agent's own ``name``) starts the key of every step the
    agent records: ``<name>:model``, ``<name>:tool:<tool name>`` and
    ``<name>:approval:<tool name>`` (each numbered ``#2``, ``#3``... when reached
    again). It must stay the same across deploys and may not contain ``/`` or ``#``.

    ``approval_timeout`` (seconds or a ``timedelta``; None waits forever) is how
    long a call of a ``requires_approval=True`` tool waits for its signal before
    it is refused.

    Inside a durable task run, :meth:`run_sync` and :meth:`run` run the agent with
    every model request and tool call as a step, tool calls one at a time; a run
    that ends with approval requests waits for the signal
    ``<name>:approval:<tool name>`` of each (holding no worker) and then goes on
    with the answers. Outside a durable task they run the agent unchanged, as
    plain Pydantic AI does: there an approval-required tool needs
    ``DeferredToolRequests`` in the output type, and nothing waits for a signal.
    """

    def __init__(self, agent: Agent[AgentDepsT, Any], *, name: str | None = None,
                 approval_timeout: float | timedelta | None = None) -> None:
        chosen = name if name is not None else agent.name
        if chosen is None:
            raise ValueError(
                "DurableAgent needs a name to key its steps: give the agent a name "
                "(Agent(..., name='travel-agent')) or pass DurableAgent(agent, name=...). "
                "Keep it the same across deploys.")
        problem = _name_problem(chosen) if isinstance(chosen, str) else "is not a string"
        if problem:
            raise InvalidStepName(
                f"DurableAgent name {chosen!r} {problem}. It starts the key of every step the "
                "agent records; give it a short, stable name such as 'travel-agent'.",
                step_key=str(chosen))
        if approval_timeout is not None and not isinstance(approval_timeout,
                                                           int | float | timedelta):
            raise TypeError("approval_timeout must be seconds (a number), a timedelta or None, "
                            f"got {type(approval_timeout).__name__}")
        self.agent = agent
        self.name: str = chosen
        self.approval_timeout = approval_timeout

    def __repr__(self) -> str:
        return f"<DurableAgent {self.name!r}>"

    # -- running ----------------------------------------------------------------------------

    def run_sync(self, user_prompt: Any = None, **kwargs: Any) -> AgentRunResult[Any]:
        """Run the agent synchronously: :meth:`pydantic_ai.Agent.run_sync` with durable steps.

        Takes the arguments of ``Agent.run_sync`` and returns its ``AgentRunResult``.
        Approvals are waited for between the agent's runs, outside its event loop.
        """
        if current_run.get() is None:
            return self.agent.run_sync(user_prompt, **kwargs)
        plan = self._plan(user_prompt, kwargs)
        segment = next(plan)
        while True:
            handler = segment.pop("event_stream_handler", None)
            with self._segment(handler):
                result = self.agent.run_sync(**segment, event_stream_handler=handler)
            try:
                segment = plan.send(result)
            except StopIteration as done:
                final: AgentRunResult[Any] = done.value
                return final

    async def run(self, user_prompt: Any = None, **kwargs: Any) -> AgentRunResult[Any]:
        """Run the agent: :meth:`pydantic_ai.Agent.run` with durable steps.

        Takes the arguments of ``Agent.run`` and returns its ``AgentRunResult``.
        """
        if current_run.get() is None:
            return await self.agent.run(user_prompt, **kwargs)
        plan = self._plan(user_prompt, kwargs)
        segment = next(plan)
        while True:
            handler = segment.pop("event_stream_handler", None)
            with self._segment(handler):
                result = await self.agent.run(**segment, event_stream_handler=handler)
            try:
                segment = plan.send(result)
            except StopIteration as done:
                final: AgentRunResult[Any] = done.value
                return final

    @contextmanager
    def _segment(self, handler: EventStreamHandler[Any] | None) -> Iterator[None]:
        """Around one of the agent's runs: its stream handler for the model steps, tool
        calls one at a time, and the library's own exception in place of a group."""
        token = _stream_handler.set(handler)
        try:
            with self.agent.parallel_tool_call_execution_mode("sequential"):
                yield
        except BaseExceptionGroup as group:
            leaf = _leaf(group)
            if leaf is None:
                raise
            raise leaf from None
        finally:
            _stream_handler.reset(token)

    def _plan(self, user_prompt: Any, kwargs: dict[str, Any],
              ) -> Generator[dict[str, Any], AgentRunResult[Any], AgentRunResult[Any]]:
        """The agent's runs of one durable run: yields the arguments of each, gets its result.

        The first run is the caller's; each run that ends with approval requests is
        followed by one that carries the answers (waited for here, between the runs,
        so a wait's Suspended never passes through the agent's event loop).
        """
        kwargs = dict(kwargs)
        capabilities = [_Durability[Any](name=self.name), *(kwargs.pop("capabilities", None) or ())]
        output_type = kwargs.pop("output_type", None)
        wanted = output_type if output_type is not None else self.agent.output_type
        caller_handles_deferred = _has_deferred(wanted)
        if caller_handles_deferred:
            run_output_type = output_type
        elif output_type is None and getattr(self.agent, "_output_validators", None):
            # Pydantic AI refuses a run's output_type on an agent with output validators.
            run_output_type = None
        else:
            run_output_type = [wanted, DeferredToolRequests]
        segment = {**kwargs, "user_prompt": user_prompt, "capabilities": capabilities,
                   "output_type": run_output_type}
        while True:
            result = yield dict(segment)
            output = result.output
            if not isinstance(output, DeferredToolRequests) or caller_handles_deferred:
                return result
            if output.calls:
                names = ", ".join(sorted({call.tool_name for call in output.calls}))
                raise NotImplementedError(
                    f"agent {self.name!r} deferred the calls of {names} for external execution; "
                    "DurableAgent answers approvals only. Put DeferredToolRequests in the "
                    "output_type to handle deferred calls yourself.")
            approvals: dict[str, bool | ToolDenied] = {}
            for call in output.approvals:
                signal = f"{self.name}:approval:{call.tool_name}"
                try:
                    payload = wait_for_signal(signal, timeout=self.approval_timeout)
                except SignalTimeout:
                    approvals[call.tool_call_id] = ToolDenied(
                        f"No approval for the call of {call.tool_name} came in time, so it was "
                        "not run.")
                else:
                    approvals[call.tool_call_id] = _approval(call.tool_name, payload)
            segment = {**segment, "user_prompt": None, "message_history": result.all_messages(),
                       "deferred_tool_results": DeferredToolResults(approvals=dict(approvals))}
            segment.pop("conversation", None)

