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
whatever toolsets the run has go through them.

Tool calls run the way Pydantic AI runs them: the calls of one model response at
the same time by default, one at a time where the user asked for that
(``Agent.parallel_tool_call_execution_mode('sequential')``, a tool's
``sequential=True``). The step of each call is created when the call passes
validation, which Pydantic AI does for every call of a response, in response
order, before any of them runs: the keys follow the response whatever order the
calls start or end in, and are the keys one-at-a-time calls had. The rule for
failures is the one of :func:`~celery_duraflow.parallel`: every call that started
runs to its end and its outcome is recorded once; once none runs any more, the
first failure in response order is raised, and a retry runs only the calls that
did not complete. A wait (an approval inside the tool, ``sleep``,
``wait_for_signal``, ``child``) in a call that runs beside others is refused with
:class:`~celery_duraflow.UnsupportedCode`, for good: the run cannot suspend while
its siblings run. A call alone in its response may wait.

Outside a durable task the wrapped agent runs unchanged: nothing is stored.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Generic

from pydantic_ai import Agent
from pydantic_ai.capabilities import HandleDeferredToolCalls
from pydantic_ai.run import AgentRunResult
from pydantic_ai.tools import (
    AgentDepsT,
    DeferredToolApprovalResult,
    DeferredToolRequests,
    DeferredToolResults,
    RunContext,
    ToolDenied,
)

from .._context import ReplayStop, Suspended, Unwind, current_run
from .._context import RunContext as DurableRun
from .._step import StepContext, _name_problem
from .._waits import wait_for_signal
from ..errors import (
    DuraflowError,
    InvalidStepName,
    NotInDurableTask,
    SignalTimeout,
    UnsupportedCode,
)
from ._pydantic_ai_steps import Durability, LiveEvents, current_tool_step, live_events

__all__ = ["DurableAgent", "tool_step"]

# The agents a durable run's attempt has run, by name: one name, one agent.
_AGENTS_ATTR = "_duraflow_pydantic_ai_agents"


def tool_step() -> StepContext:
    """The step that the running tool call is, inside a tool called by a :class:`DurableAgent`.

    Its ``idempotency_key`` is the same on every attempt of this call of this
    run (pass it to payment and booking APIs), ``in_doubt`` is True when an
    earlier attempt started this call and never recorded its end, and
    ``attempt`` counts the attempts of this call.

    Raises :class:`~celery_duraflow.NotInDurableTask` anywhere else: outside a
    tool, or in a tool of an agent run outside a durable task.
    """
    current = current_tool_step.get()
    if current is None:
        run = current_run.get()
        raise NotInDurableTask(
            "tool_step() was called outside a tool call that a DurableAgent runs as a step "
            "(outside a tool, or in an agent run outside a durable task), so there is no step "
            "to describe. Call it inside a tool of an agent wrapped in DurableAgent, run from a "
            "task with base=DurableTask.",
            task_id=run.task_id if run is not None else None)
    return current


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
    every model request and tool call as a step (the calls of one response in
    parallel, as Pydantic AI runs them, keyed in response order); a run
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
        run = current_run.get()
        if run is None:
            return self.agent.run_sync(user_prompt, **kwargs)
        plan = self._plan(run, user_prompt, kwargs)
        segment = next(plan)
        while True:
            with self._segment(segment) as arguments:
                result = self.agent.run_sync(**arguments)
            try:
                segment = plan.send(result)
            except StopIteration as done:
                final: AgentRunResult[Any] = done.value
                return final

    async def run(self, user_prompt: Any = None, **kwargs: Any) -> AgentRunResult[Any]:
        """Run the agent: :meth:`pydantic_ai.Agent.run` with durable steps.

        Takes the arguments of ``Agent.run`` and returns its ``AgentRunResult``.
        """
        run = current_run.get()
        if run is None:
            return await self.agent.run(user_prompt, **kwargs)
        plan = self._plan(run, user_prompt, kwargs)
        segment = next(plan)
        while True:
            with self._segment(segment) as arguments:
                result = await self.agent.run(**arguments)
            try:
                segment = plan.send(result)
            except StopIteration as done:
                final: AgentRunResult[Any] = done.value
                return final

    # -- the forms that cannot be durable ---------------------------------------------------

    def iter(self, user_prompt: Any = None, **kwargs: Any) -> Any:
        """:meth:`pydantic_ai.Agent.iter` outside a durable task; refused inside one.

        Code that drives the graph node by node runs between the steps and may change
        what the next node does, and a wait for an approval cannot suspend it, so a
        replay could not be trusted to retrace it: inside a durable task this raises
        :class:`~celery_duraflow.UnsupportedCode` before anything runs.
        """
        self._refuse_outside_run("iter()", "drives the agent's graph from your code, "
                                 "node by node")
        return self.agent.iter(user_prompt, **kwargs)

    def run_stream(self, user_prompt: Any = None, **kwargs: Any) -> Any:
        """:meth:`pydantic_ai.Agent.run_stream` outside a durable task; refused inside one.

        It hands the final response back while it is still streaming and leaves the rest
        of the run to the caller, so the response cannot be recorded as one step before
        it is used: inside a durable task this raises
        :class:`~celery_duraflow.UnsupportedCode` before anything runs.
        """
        self._refuse_outside_run("run_stream()", "hands the final response to your code "
                                 "while it is still streaming, before it could be recorded")
        return self.agent.run_stream(user_prompt, **kwargs)

    def run_stream_sync(self, user_prompt: Any = None, **kwargs: Any) -> Any:
        """:meth:`pydantic_ai.Agent.run_stream_sync` outside a durable task; refused inside one."""
        self._refuse_outside_run("run_stream_sync()", "hands the final response to your "
                                 "code while it is still streaming, before it could be recorded")
        return self.agent.run_stream_sync(user_prompt, **kwargs)

    def run_stream_events(self, user_prompt: Any = None, **kwargs: Any) -> Any:
        """:meth:`pydantic_ai.Agent.run_stream_events` outside a durable task; refused inside one.

        Its events are consumed by your code in its own time, in another task, while
        the run goes on; approvals could not wait there. Inside a durable task this
        raises :class:`~celery_duraflow.UnsupportedCode` before anything runs.
        """
        self._refuse_outside_run("run_stream_events()", "runs the agent in a task of its own "
                                 "while your code consumes its events")
        return self.agent.run_stream_events(user_prompt, **kwargs)

    def _refuse_outside_run(self, form: str, why: str) -> None:
        run = current_run.get()
        if run is None:
            return
        run.fatal = UnsupportedCode(
            f"DurableAgent {self.name!r}.{form} was called in task {run.task_id}, and it "
            f"cannot be made durable: it {why}, so a retry could not replay it faithfully. "
            "Nothing ran. Use run_sync() or await run() instead, with "
            "event_stream_handler= (or a ProcessEventStream capability on the agent) to "
            "receive the model's events as they stream in.",
            task_id=run.task_id, step_key=f"{self.name}:model")
        raise run.fatal

    # -- one durable run --------------------------------------------------------------------

    def _claim_name(self, run: DurableRun) -> None:
        """Refuse a second, different agent under a name this attempt already ran."""
        agents: dict[str, Agent[Any, Any]] | None = getattr(run, _AGENTS_ATTR, None)
        if agents is None:
            agents = {}
            setattr(run, _AGENTS_ATTR, agents)
        known = agents.setdefault(self.name, self.agent)
        if known is not self.agent:
            # Fatal: every retry would reach the same two agents (autoretry_for=(Exception,)
            # must not run the first agent's side effects again and again).
            run.fatal = InvalidStepName(
                f"task {run.task_id} runs two different agents under the DurableAgent name "
                f"{self.name!r}; their steps would share the keys {self.name + ':model'!r}, "
                f"{self.name + ':tool:...'!r}, and a replay would hand one agent the other's "
                "answers. Nothing was asked of the model. Give each agent its own name "
                "(DurableAgent(agent, name=...)).",
                task_id=run.task_id, step_key=f"{self.name}:model")
            raise run.fatal

    @contextmanager
    def _segment(self, segment: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Around one of the agent's runs: the run handler's live model events, and the
        library's own exception in place of a group.

        Yields the arguments of the agent's run; its ``event_stream_handler`` is the
        caller's, made to skip the model events it already got live in a step.
        """
        live = LiveEvents(segment.get("event_stream_handler"))
        arguments = {**segment, "event_stream_handler": live.filtered()}
        token = live_events.set(live)
        try:
            yield arguments
        except BaseExceptionGroup as group:
            leaf = _leaf(group)
            if leaf is None:
                raise
            raise leaf from None
        finally:
            live_events.reset(token)

    def _plan(self, run: DurableRun, user_prompt: Any, kwargs: dict[str, Any],
              ) -> Generator[dict[str, Any], AgentRunResult[Any], AgentRunResult[Any]]:
        """The agent's runs of one durable run: yields the arguments of each, gets its result.

        The first run is the caller's; each run that ends with approval requests is
        followed by one that carries the answers (waited for here, between the runs,
        so a wait's Suspended never passes through the agent's event loop). An agent
        with output validators cannot be given DeferredToolRequests as a run's output
        type, so there the approvals are answered inside the run instead, by a
        HandleDeferredToolCalls capability that waits for the same signals.
        """
        self._claim_name(run)
        kwargs = dict(kwargs)
        capabilities: list[Any] = [Durability[Any](name=self.name),
                                   *(kwargs.pop("capabilities", None) or ())]
        output_type = kwargs.pop("output_type", None)
        wanted = output_type if output_type is not None else self.agent.output_type
        caller_handles_deferred = _has_deferred(wanted)
        if caller_handles_deferred:
            run_output_type = output_type
        elif output_type is None and getattr(self.agent, "_output_validators", None):
            # Pydantic AI refuses a run's output_type on an agent with output validators.
            run_output_type = None
            capabilities.append(HandleDeferredToolCalls[Any](handler=self._answer_inline))
        else:
            run_output_type = [wanted, DeferredToolRequests]
        segment = {**kwargs, "user_prompt": user_prompt, "capabilities": capabilities,
                   "output_type": run_output_type}
        while True:
            result = yield dict(segment)
            output = result.output
            if not isinstance(output, DeferredToolRequests) or caller_handles_deferred:
                return result
            self._refuse_external(output)
            segment = {**segment, "user_prompt": None, "message_history": result.all_messages(),
                       "deferred_tool_results": DeferredToolResults(
                           approvals=self._answers(output))}
            segment.pop("conversation", None)

    def _refuse_external(self, requests: DeferredToolRequests) -> None:
        if requests.calls:
            run = current_run.get()
            names = ", ".join(sorted({call.tool_name for call in requests.calls}))
            error = UnsupportedCode(
                f"agent {self.name!r} in task {run.task_id if run else None} deferred the "
                f"calls of {names} for external execution (CallDeferred); DurableAgent answers "
                "approvals only. The deferral is recorded, so a retry would end here again: "
                "the run fails rather than being retried. Put DeferredToolRequests in the "
                "output_type to handle deferred calls yourself.",
                task_id=run.task_id if run else None, step_key=f"{self.name}:tool:{names}")
            if run is not None:
                run.fatal = error
            raise error

    def _answers(self, requests: DeferredToolRequests,
                 ) -> dict[str, bool | DeferredToolApprovalResult]:
        """The answer to each approval request, from its signal (waited for if need be)."""
        approvals: dict[str, bool | DeferredToolApprovalResult] = {}
        for call in requests.approvals:
            signal = f"{self.name}:approval:{call.tool_name}"
            try:
                payload = wait_for_signal(signal, timeout=self.approval_timeout)
            except SignalTimeout:
                approvals[call.tool_call_id] = ToolDenied(
                    f"No approval for the call of {call.tool_name} came in time, so it was "
                    "not run.")
            else:
                approvals[call.tool_call_id] = _approval(call.tool_name, payload)
        return approvals

    async def _answer_inline(self, ctx: RunContext[Any],
                             requests: DeferredToolRequests) -> DeferredToolResults:
        """HandleDeferredToolCalls' handler: the approvals' signals, inside the run."""
        self._refuse_external(requests)
        return DeferredToolResults(approvals=self._answers(requests))
