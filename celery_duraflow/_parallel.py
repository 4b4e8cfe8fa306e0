"""Parallel branches inside one run: ``parallel()`` in threads, ``aparallel()`` in asyncio.

``parallel("quotes", [partial(quote, "a"), partial(quote, "b")])`` is a step
named ``quotes`` whose body runs each branch at the same time, each as a step of
its own: ``quotes/0``, ``quotes/1``, ... in the order the branches were given.
Those keys are taken before any branch starts, so they never depend on which
branch ends first, and a step inside branch ``i`` is nested in ``quotes/i``:
each branch has a scope of its own, and a replay matches every record whatever
order the branches ended in.

The rule for failures: every branch runs to its end (none is stopped because
another failed). Each branch's outcome is recorded once, as its step's. If some
failed, the exception of the first failed branch in the order given is raised
once all have ended, and ``quotes`` fails with it: a retry answers the branches
that completed from the store and runs only the others again. Once every branch
completed, ``quotes`` records their results as its own output, and later
attempts read the list from there without entering any branch.

A branch may not wait (``sleep``, ``wait_for_signal``, ``child``): the run cannot
suspend while other branches run. Fan out to ``children()`` for work that waits.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from contextvars import ContextVar
from typing import Any, TypeVar

from ._context import RunContext, current_run, describe
from ._step import StepContext, is_async, step
from .errors import NotInDurableTask, UnsupportedCode

R = TypeVar("R")

#: The most threads one parallel() runs its branches in at once.
MAX_THREADS = 32

# The key of the parallel branch the code here runs in (None outside any): a wait there
# is refused, since the run cannot suspend while the other branches run.
branch_of: ContextVar[str | None] = ContextVar("celery_duraflow_branch", default=None)
# Set with branch_of by concurrent work that is not a parallel() branch (a durable agent's
# tool calls run in parallel): what a refused wait calls the place, and what to do instead.
branch_note: ContextVar[tuple[str, str] | None] = ContextVar("celery_duraflow_branch_note",
                                                             default=None)


def parallel(name: str, branches: Iterable[Callable[[], R]], *,
             max_threads: int | None = None) -> list[R]:
    """Run each of ``branches`` (functions taking no arguments) at the same time, in
    threads, each as a step of its own, and return their results in the order given.

    ``name`` is a step whose branches are ``name/0``, ``name/1``, ...; the steps a
    branch takes are nested in its own. Every branch runs to its end; if some
    failed, the first failure in the order given is raised once all have ended,
    and a retry runs only the branches that did not complete. ``max_threads``
    bounds the threads used at once (default: one per branch, at most 32).
    Use :func:`aparallel` in asyncio code.
    """
    fns = _branches(name, branches, asynchronous=False)
    threads = max_threads if max_threads is not None else min(len(fns), MAX_THREADS)
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"max_threads of parallel {name!r} must be a positive integer, "
                         f"got {describe(max_threads)}")
    return step(name).run(_in_threads, name, fns, threads)


async def aparallel(name: str, branches: Iterable[Callable[[], Awaitable[R]]]) -> list[R]:
    """Await each of ``branches`` (coroutine functions taking no arguments) at the same
    time, each as a step of its own, and return their results in the order given.

    The asyncio form of :func:`parallel`, with the same keys and rules: ``name`` is
    a step whose branches are ``name/0``, ``name/1``, ...; each branch runs in an
    asyncio task of its own; the first failure in the order given is raised once
    every branch ended.
    """
    fns = _branches(name, branches, asynchronous=True)
    return await step(name).arun(_in_tasks, name, fns)


def _branches(name: str, branches: Iterable[Any], *, asynchronous: bool) -> list[Any]:
    ctx = current_run.get()
    if ctx is None:
        raise NotInDurableTask(
            f"parallel {name!r} was reached outside a durable task run. Call it from a task "
            "with base=DurableTask that runs through Celery.", step_key=name)
    fns = list(branches)
    for index, fn in enumerate(fns):
        if not callable(fn):
            raise TypeError(f"branch {index} of parallel {name!r} in task {ctx.task_id} must be "
                            f"a function taking no arguments, got {describe(fn)}")
        if asynchronous and not is_async(fn):
            raise TypeError(f"branch {index} of aparallel {name!r} in task {ctx.task_id} must "
                            f"be a coroutine function (async def), got {describe(fn)}; use "
                            "parallel() for plain functions")
    return fns


def _branch_steps(count: int) -> list[StepContext]:
    """The branches' steps, created here in order before any of them runs."""
    return [step(str(index)) for index in range(count)]


def _in_threads(name: str, fns: list[Callable[[], Any]], threads: int) -> list[Any]:
    steps = _branch_steps(len(fns))
    with ThreadPoolExecutor(max_workers=threads,
                            thread_name_prefix=f"duraflow-{name}") as pool:
        futures = [pool.submit(contextvars.copy_context().run, _branch, s, fn)
                   for s, fn in zip(steps, fns, strict=True)]
        wait(futures)
    # Every branch has ended: the first failure in the order given, if any.
    for future in futures:
        error = future.exception()
        if error is not None:
            raise error
    return [future.result() for future in futures]


def _branch(s: StepContext, fn: Callable[[], Any]) -> Any:
    branch_of.set(s.key)
    return s.run(fn)


async def _in_tasks(name: str, fns: list[Callable[[], Awaitable[Any]]]) -> list[Any]:
    steps = _branch_steps(len(fns))

    async def branch(s: StepContext, fn: Callable[[], Awaitable[Any]]) -> Any:
        branch_of.set(s.key)
        return await s.arun(fn)

    outcomes = await asyncio.gather(*(branch(s, fn) for s, fn in zip(steps, fns, strict=True)),
                                    return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return list(outcomes)


def refuse_wait_in_branch(kind: str, name: str, ctx: RunContext) -> None:
    """A wait reached in a parallel branch is refused, for good: the run cannot suspend
    there, and a retry would reach it again."""
    branch = branch_of.get()
    if branch is None:
        return
    where, advice = branch_note.get() or (
        f"parallel branch {branch!r}: a run cannot suspend while its other branches run",
        "Wait before or after the parallel steps, or fan out with children() for work "
        "that waits.")
    error = UnsupportedCode(
        f"{kind} {name!r} of task {ctx.task_id} was reached in {where}. {advice}",
        task_id=ctx.task_id, step_key=name)
    ctx.fatal = error
    raise error
