"""``step()``: a named, durable unit of work inside a durable task."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import sys
import uuid
from collections.abc import Awaitable, Callable
from contextvars import Token
from datetime import UTC, datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, ParamSpec, TypeVar

from . import _clock
from ._atomic import AtomicTransaction
from ._context import (
    ReplayStop,
    RunContext,
    Suspended,
    Unwind,
    body_of,
    current_run,
    describe,
    runner,
)
from ._fingerprint import code_fingerprint
from ._lease import keeper
from ._limits import shown
from ._serialization import decode, find_unstorable, fingerprint, stored_text
from ._store import (
    BODY_BREAK,
    BODY_CONTINUE,
    BODY_FATAL,
    BODY_RETURN,
    STEP_COMPLETED,
    STEP_FAILED,
    STEP_RUNNING,
    StepRecord,
)
from .errors import (
    AtomicStepError,
    DuraflowError,
    InvalidStepName,
    LeaseLost,
    NonDeterministicReplay,
    NotInDurableTask,
    StepCodeChanged,
    StepConflict,
    StepInDoubt,
    StepInputChanged,
    StepNotPrepared,
    StepOutputNotSerializable,
    StoreUnavailable,
    UnsupportedCode,
)
from .signals import step_failed, step_replayed, step_started, step_succeeded

if TYPE_CHECKING:
    from ._atomic import Connection

logger = logging.getLogger("celery_duraflow.step")

P = ParamSpec("P")
R = TypeVar("R")

MAX_NAME_LENGTH = 200
# Namespace for idempotency keys: uuid5(namespace, "<task id>/<step key>").
_IDEMPOTENCY_NAMESPACE = uuid.UUID("6f1d4c1e-2b7a-5d3e-9c4f-0a8b7e6d5c4b")


_EPOCH = datetime.fromtimestamp(0, UTC)
# The names the rewrite (_rewrite.py) gives the runtime below inside a prepared function.
GUARD_NAME = "__duraflow_guard__"
LEAVE_NAME = "__duraflow_leave__"
# Codes of how a body is left (Block.left).
FELL, RETURNED, BROKE, CONTINUED = 0, 1, 2, 3
# How a body was left (Block.left) <-> the steps' body_exit column.
_EXITS = {FELL: None, RETURNED: BODY_RETURN, BROKE: BODY_BREAK, CONTINUED: BODY_CONTINUE}
_LEFT = {name: code for code, name in _EXITS.items() if name is not None}
# The errors a fatal step record is raised as again; a row names one of these by its
# class name and selects nothing else.
_FATAL_ERRORS: dict[str, type[DuraflowError]] = {
    cls.__name__: cls for cls in (StepOutputNotSerializable, InvalidStepName,
                                  NonDeterministicReplay, StepCodeChanged, StepInputChanged)}
# step(..., input=) left out: no input fingerprint (None is an input like any other).
_NO_INPUT: Any = object()


@functools.lru_cache(maxsize=4096)
def _name_problem(name: str) -> str | None:
    """What is wrong with a step name, or None; once per name (a loop reaches one name
    many times)."""
    if not name.strip():
        return "is empty"
    if len(name) > MAX_NAME_LENGTH:
        return f"is longer than {MAX_NAME_LENGTH} characters"
    if "/" in name or "#" in name:
        return "contains '/' or '#', which the step key uses for nesting and repetition"
    # Controls (C0, DEL, C1), invisible format characters (bidi overrides, embeddings,
    # isolates and marks, zero-width ones), surrogates and line separators: each makes
    # a name look like another where it is shown (a terminal, a web page), or cannot be
    # written at all. Refused, named by code point; printable names are not looked at.
    import unicodedata

    refused = {"Cc": "a control character", "Cs": "a lone surrogate",
               "Cf": "an invisible character that changes how the text around it is shown",
               "Zl": "a line separator", "Zp": "a paragraph separator"}
    for ch in name if not name.isprintable() else ():
        what = refused.get(unicodedata.category(ch))
        if what is not None:
            label = unicodedata.name(ch, "")
            return (f"contains U+{ord(ch):04X}{f' ({label})' if label else ''}, {what}; "
                    "control characters, bidi controls and marks are refused in step names")
    return None


def check_name(name: object, ctx: RunContext | None) -> str:
    where = f" in task {ctx.task_id}" if ctx is not None else ""
    if not isinstance(name, str):
        raise InvalidStepName(
            f"step name must be a string, got {describe(name)}{where}. Give each step a short, "
            "stable name such as 'book-flight'.",
            task_id=ctx.task_id if ctx else None,
        )
    problem = _name_problem(name)
    if problem:
        raise InvalidStepName(
            f"step name {shown(name)}{where} {problem}. Give each step a short, stable name "
            "such as 'book-flight'; repeated names are numbered for you ('book-flight#2').",
            task_id=ctx.task_id if ctx else None,
            step_key=name,
        )
    return name


def _error_text(exc: BaseException) -> str:
    return stored_text(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")



def is_async(fn: Any) -> bool:
    """Whether calling ``fn`` gives a coroutine: a coroutine function, a partial of one,
    or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class StepContext:
    """One step of a durable run; see :func:`step`.

    Attributes:
        name: the name given to :func:`step`.
        key: the key the step is stored under: the name, ``name#2`` for its
            second occurrence, and ``parent/name`` when nested in another step.
        result: the step's output. Set it inside the ``with`` body; on a
            replay it holds the stored output and the body does not run.
        cached: True when ``result`` came from the store.
        in_doubt: True when an earlier attempt started this step and never
            recorded how it ended (its process died inside the body).
        attempt: how many times the body has been started, this time included.
        idempotency_key: a UUID string that is the same on every attempt of
            this step of this run. Pass it to payment and booking APIs.
        position: where the step was reached among its parent's steps (the
            run's top-level steps, or the steps nested in one step): 1 for the first.
        atomic: True for a step declared with ``atomic=True`` (its body writes on
            ``s.connection``).
    """

    __slots__ = (
        "_atask",
        "_block",
        "_claimed",
        "_code_fp",
        "_compensate",
        "_ctx",
        "_entered",
        "_input_fp",
        "_new",
        "_on_in_doubt",
        "_refusal",
        "_running",
        "_should_run",
        "_started_at",
        "_tx",
        "atomic",
        "attempt",
        "cached",
        "in_doubt",
        "key",
        "name",
        "position",
        "result",
        "runner",
    )

    def __init__(self, name: str, *, input: Any = _NO_INPUT,
                 compensate: Callable[[Any], Any] | None = None,
                 on_in_doubt: str = "rerun", atomic: bool = False) -> None:
        ctx = current_run.get()
        self.name = check_name(name, ctx)
        if on_in_doubt not in ("rerun", "raise"):
            raise ValueError(f"on_in_doubt must be 'rerun' or 'raise', got {on_in_doubt!r}")
        self._on_in_doubt = on_in_doubt
        if not isinstance(atomic, bool):
            raise TypeError(f"atomic= of step {name!r} must be True or False, got "
                            f"{describe(atomic)}")
        self.atomic = atomic
        self._tx: AtomicTransaction | None = None
        if ctx is None:
            raise NotInDurableTask(
                f"step {name!r} was reached outside a durable task run, so its output would not "
                "be recorded. Call it from a task with base=DurableTask that runs through Celery "
                "(.delay(), .apply_async(), or .apply() for a local call), not by calling the "
                "task function directly.",
                step_key=name,
            )
        self._ctx: RunContext = ctx
        # The asyncio task whose .arun() is running this step's body (None for a step
        # entered in synchronous code). A step nested in such a body belongs to that task.
        self._atask: asyncio.Task[Any] | None = None
        stack = ctx.stack
        if stack and stack[-1]._atask is not None:
            self._atask = stack[-1]._atask
        #: What runs the step's body (its asyncio task, or else its thread), once begun.
        self.runner: object = None
        # The key is taken here, where the step is created, in the order the code creates
        # steps (a step created next to one whose body runs elsewhere is refused).
        self.key, self.position = ctx.next_key(name)
        ctx.check_order(self.key, self.position)
        self._input_fp: str | None = None
        if input is not _NO_INPUT:
            self._input_fp = fingerprint(input, ctx.serializer)
        self._code_fp: str | None = None
        if compensate is not None and not callable(compensate):
            raise TypeError(f"compensate= of step {self.key!r} in task {ctx.task_id} must be "
                            f"callable, got {describe(compensate)}")
        self._compensate = compensate
        self.result: Any = None
        self.cached = False
        self.in_doubt = False
        self.attempt = 0
        self._claimed = False
        self._new = False
        self._running = False
        self._started_at = _EPOCH
        self._entered = False
        self._should_run = True
        # The `with` block this step was entered by (None for .run()): how its body is left.
        self._block: Block | None = None
        # The error that made this step's end unstorable: it fails the run for good.
        self._refusal: BaseException | None = None

    def __repr__(self) -> str:
        state = "cached" if self.cached else ("running" if self._entered else "new")
        return f"<StepContext {self.key!r} of task {self._ctx.task_id} {state}>"

    @property
    def task_id(self) -> str:
        """The Celery task id of the run this step belongs to."""
        return self._ctx.task_id

    @property
    def idempotency_key(self) -> str:
        return str(uuid.uuid5(_IDEMPOTENCY_NAMESPACE, f"{self._ctx.task_id}/{self.key}"))

    @property
    def connection(self) -> Connection:
        """The SQLAlchemy ``Connection`` of an atomic step's transaction, while its body runs.

        Writes made on it commit together with the step's record when the body
        ends, or not at all. Do not commit or roll it back yourself: raise an
        exception to roll back. In a Django project whose store is a Django
        database alias, ORM calls on that alias in the body are in the same
        transaction, and this is a connection over Django's own.
        """
        tx = self._tx
        if tx is None or tx.ended:
            if not self.atomic:
                why = "it is not atomic: declare it with step(..., atomic=True)"
            elif self.cached:
                why = "it completed in an earlier attempt, so its body does not run"
            else:
                why = "its body is not running"
            raise AtomicStepError(
                f"step {self.key!r} of task {self._ctx.task_id} has no transaction: {why}.",
                task_id=self._ctx.task_id, step_key=self.key)
        return tx.connection

    # -- the two ways in ------------------------------------------------------------------

    def __enter__(self) -> StepContext:
        caller = sys._getframe(1).f_code
        if GUARD_NAME not in caller.co_freevars:
            raise StepNotPrepared(
                f"`with step({self.name!r})` in task {self._ctx.task_id} is in "
                f"{caller.co_qualname}() ({caller.co_filename}:{sys._getframe(1).f_lineno}), "
                "which was not prepared, so its body could not be skipped on a replay. Put the "
                "block in the task function itself, decorate the helper with @durable, or use "
                f"step({self.name!r}).run(fn, ...).",
                task_id=self._ctx.task_id,
                step_key=self.key,
            )
        self._begin()
        # The body's guard tells this step the fingerprint of the body's code.
        self._ctx.entered.append(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._end(exc)

    def run(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run ``fn(*args, **kwargs)`` as this step and return its (stored) result.

        Needs no preparation: on a replay ``fn`` is not called at all.
        """
        if self._start(fn):
            try:
                self.result = fn(*args, **kwargs)
            except BaseException as exc:
                self._end(exc)
                raise
            self._end(None)
        result: R = self.result
        return result

    async def arun(self, fn: Callable[P, Awaitable[R]], /, *args: P.args,
                   **kwargs: P.kwargs) -> R:
        """Await ``fn(*args, **kwargs)`` as this step and return its (stored) result.

        The form of :meth:`run` for coroutine functions, with the same rules: on
        a replay ``fn`` is not called, and the same idempotency key, in-doubt
        and fencing apply. The run's context reaches the tasks of an event loop
        started inside the task (``asyncio.run``). Steps created first and then
        awaited together (``asyncio.gather(step("a").arun(f), step("b").arun(g))``)
        run at the same time: their keys were taken in the order they were
        created, whatever order they end in. A step created while a sibling's
        body runs in another task is refused with
        :class:`~celery_duraflow.UnsupportedCode` (use
        :func:`~celery_duraflow.aparallel` for branches that create their own
        steps). The step's record is written with the store's blocking driver,
        so the loop waits for that commit.
        """
        if not is_async(fn):
            # Refused before the body: whatever a plain function does would happen
            # before this step could know whether it must be skipped.
            error = UnsupportedCode(
                f"step {self.key!r} of task {self._ctx.task_id}: .arun() takes a coroutine "
                f"function (async def), got {describe(fn)}. Use .run() for a plain function.",
                task_id=self._ctx.task_id, step_key=self.key)
            self._ctx.fatal = error
            raise error
        try:
            self._atask = asyncio.current_task()
        except RuntimeError:
            self._atask = None
        if self._start(fn):
            try:
                self.result = await fn(*args, **kwargs)
            except BaseException as exc:
                self._end(exc)
                raise
            self._end(None)
        result: R = self.result
        return result

    def _start(self, fn: Callable[..., Any]) -> bool:
        """Begin the functional form of this step; False when ``fn`` must not be called
        (the step completed earlier, and ``result`` holds its stored output)."""
        self._code_fp = code_fingerprint(fn)
        self._begin()
        if self.cached:
            self.code_seen(self._code_fp)
        if not self._should_run:
            self._end(None)
            return False
        return True

    # -- mechanics ------------------------------------------------------------------------

    def _begin(self) -> None:
        if self._entered:
            raise InvalidStepName(
                f"step {self.key!r} of task {self._ctx.task_id} was entered twice. Call step() "
                "again for each step; the same name reached again is numbered for you.",
                task_id=self._ctx.task_id,
                step_key=self.key,
            )
        self._entered = True
        ctx = self._ctx
        if keeper().lost(ctx.task_id, ctx.owner):
            raise self._lease_lost()
        prior = ctx.recorded.get(self.key)
        if prior is not None and prior.body_exit == BODY_FATAL:
            raise self._fatal_again(prior)
        if prior is not None and prior.status == STEP_COMPLETED:
            self._use_stored(prior)
            if self._compensate is not None:
                ctx.compensations.append((self.key, self._compensate, self.result))
        else:
            if ctx.dry:  # a replay check: a live attempt would run this body
                raise ReplayStop(self.key, f"step {self.key!r}")
            # A step that has not completed: the boundary where a cancelled (or failed,
            # compensating) run stops.
            ctx.stop_if_unwinding(self.key)
            # In doubt: a claimed row that never ended, or, in a run taken over from an
            # owner that died, an unfinished step reached before this attempt has recorded
            # anything (the dead owner was in it, or had not reached it: we cannot tell).
            # A step that claims before its body (on_in_doubt="raise") knows exactly.
            claimed_and_unfinished = prior is not None and prior.status == STEP_RUNNING
            # An atomic step never is: an attempt that died in its body committed nothing.
            self.in_doubt = not self.atomic and (claimed_and_unfinished or (
                self._on_in_doubt != "raise" and ctx.interrupted and not ctx.recorded_any))
            if self.in_doubt and self._on_in_doubt == "raise":
                raise StepInDoubt(
                    f"step {self.key!r} of task {ctx.task_id} may have been started by an "
                    "earlier attempt that never recorded how it ended, and the step says "
                    "on_in_doubt='raise'. Find out whether its side effect happened (its "
                    f"idempotency key is {self.idempotency_key}), then record the step's "
                    "output or let it run again.",
                    task_id=ctx.task_id,
                    step_key=self.key,
                )
            self.attempt = (prior.attempts if prior is not None else 0) + 1
            self._new = prior is None
            ctx.stop_for_outage(self.key)
            try:
                ctx.store.check_reachable(ctx.task_id, self.key)
                if self._on_in_doubt == "raise" and not self.atomic:
                    # Only this policy needs a record that the body started, to recognise
                    # an interruption later; every other step is written once, at its end.
                    claim = ctx.store.claim_step(ctx.task_id, self.key, ctx.owner, prior,
                                                 position=self.position)
            except StoreUnavailable as exc:
                raise ctx.store_failed(exc, self.key, ran=False) from exc
            if self._on_in_doubt == "raise" and not self.atomic:
                if claim is None:
                    self._use_stored(self._lost_claim())
                    ctx.push(self)
                    return
                self._claimed = True
                self.attempt = claim.attempts
            self._started_at = _clock.now()
            self._running = True
            if self.in_doubt:
                logger.warning(
                    "step %r of task %s is in doubt: an earlier attempt may have run it without "
                    "recording its end; running it (attempt %d) with the same idempotency key",
                    self.key, ctx.task_id, self.attempt)
            else:
                logger.debug("step %r of task %s: running (attempt %d)",
                             self.key, ctx.task_id, self.attempt)
            if step_started.receivers:
                step_started.send(sender=ctx.task, task_id=ctx.task_id, step_key=self.key,
                                  attempt=self.attempt, in_doubt=self.in_doubt)
            if self.atomic:
                # Last, so that nothing between here and the body can leave it open.
                try:
                    self._tx = ctx.store.atomic(ctx.task_id, self.key)
                except StoreUnavailable as exc:
                    raise ctx.store_failed(exc, self.key, ran=False) from exc
            # Only a step whose body runs is looked at by check_concurrent.
            self.runner = runner()
            ctx.active.setdefault(self.key.rpartition("/")[0], []).append(self)
        ctx.push(self)

    def _lease_lost(self) -> LeaseLost:
        ctx = self._ctx
        return LeaseLost(
            f"task {ctx.task_id} lost its lease before step {self.key!r}: another attempt "
            "took the run over, so this attempt stops without running or recording anything. "
            "The run goes on under its new owner; nothing needs to be done.",
            task_id=ctx.task_id,
            step_key=self.key,
        )

    def _lost_claim(self) -> StepRecord:
        """The claim matched nothing: find out who got there first, and whether it finished."""
        ctx = self._ctx
        run = ctx.store.get_run(ctx.task_id)
        if run is None or run.lease_owner != ctx.owner:
            raise self._lease_lost()
        latest = ctx.store.get_step(ctx.task_id, self.key)
        if latest is None or latest.status != STEP_COMPLETED:
            raise StepConflict(
                f"step {self.key!r} of task {ctx.task_id} is being run by another attempt of "
                "the same task id. This attempt stops without running it; retry the task later.",
                task_id=ctx.task_id,
                step_key=self.key,
            )
        return latest

    def input_known(self, value: Any) -> None:
        """Give a step created before its input was known (a tool call, created when its
        arguments validated) the input ``step(..., input=)`` would have fingerprinted."""
        self._input_fp = fingerprint(value, self._ctx.serializer)

    def code_seen(self, fingerprint: str | None) -> None:
        """Learn the fingerprint of this step's code; a replayed step compares it."""
        self._code_fp = fingerprint
        ctx = self._ctx
        record = ctx.recorded.get(self.key)
        if (not self.cached or record is None or fingerprint is None
                or record.code_fingerprint is None or record.code_fingerprint == fingerprint):
            return
        policy = ctx.config.on_code_change if ctx.config is not None else "warn"
        ctx.diverged(StepCodeChanged(
            f"step {self.key!r} of task {ctx.task_id} ({ctx.task_name}) completed under other "
            f"code than the code that reaches it now (code fingerprint "
            f"{record.code_fingerprint} when recorded, {fingerprint} now); its stored output "
            "is what the new code gets.",
            task_id=ctx.task_id, step_key=self.key, position=self.position,
            recorded_key=self.key, reached_key=self.key), policy)

    def _use_stored(self, record: StepRecord) -> None:
        ctx = self._ctx
        if (self._input_fp is not None and record.input_fingerprint is not None
                and record.input_fingerprint != self._input_fp):
            ctx.diverged(StepInputChanged(
                f"step {self.key!r} of task {ctx.task_id} ({ctx.task_name}) completed with "
                "another input than the one it is given now (input fingerprint "
                f"{record.input_fingerprint[:16]} when recorded, {self._input_fp[:16]} now), "
                "so its stored output may not fit. The input is computed outside the step "
                "from something that changed between attempts.",
                task_id=ctx.task_id, step_key=self.key, position=self.position,
                recorded_key=self.key, reached_key=self.key))
        self.result = _decode(ctx, record)
        self.cached = True
        self.attempt = record.attempts
        self._should_run = False
        logger.debug("step %r of task %s: completed earlier, body skipped", self.key, ctx.task_id)
        if step_replayed.receivers:
            step_replayed.send(sender=ctx.task, task_id=ctx.task_id, step_key=self.key,
                               attempt=self.attempt)

    def _end(self, exc: BaseException | None) -> None:
        ctx = self._ctx
        ctx.pop(self)
        if not self._running:
            return  # cached: nothing to record
        self._running = False
        beside = ctx.active.get(self.key.rpartition("/")[0])
        if beside is not None and self in beside:
            beside.remove(self)
        tx = self._tx
        if tx is not None:
            self._end_atomic(tx, exc)
            return
        if isinstance(exc, Suspended | Unwind):
            # A wait inside this step suspended the run: the step has not ended. The next
            # attempt enters it again, and its finished children answer from the store.
            return
        if exc is not None and (exc is self._refusal or exc is ctx.fatal):
            # Nothing a retry does can change this end: the body must not run again.
            self._record(STEP_FAILED, error=_error_text(exc), body_exit=BODY_FATAL)
            ctx.failed_step = self.key
            if step_failed.receivers:
                step_failed.send(sender=ctx.task, task_id=ctx.task_id, step_key=self.key,
                                 attempt=self.attempt, exception=exc)
            return
        if exc is not None:
            try:
                self._record(STEP_FAILED, error=_error_text(exc))
            except (StoreUnavailable, LeaseLost):
                # Keep the user's exception; the next attempt treats the step as in doubt.
                logger.warning("could not record the failure of step %r of task %s",
                               self.key, ctx.task_id, exc_info=True)
            ctx.failed_step = self.key
            logger.debug("step %r of task %s: failed (%s)", self.key, ctx.task_id,
                         type(exc).__name__)
            if step_failed.receivers:
                step_failed.send(sender=ctx.task, task_id=ctx.task_id, step_key=self.key,
                                 attempt=self.attempt, exception=exc)
            return
        try:
            data = ctx.serializer.dumps(self.result)
            value = ctx.serializer.loads(data)
        except Exception as error:
            refused = self._unstorable(self.result, "result", error)
            self._record(STEP_FAILED, error=_error_text(refused), body_exit=BODY_FATAL)
            raise refused from error
        block = self._block
        left = block.left if block is not None else FELL
        self._record(STEP_COMPLETED, output=data, body_exit=_EXITS[left],
                     returned=block.data if block is not None and left == RETURNED else None)
        # Hand back what a replay will see, so the first attempt and replays agree.
        self.result = value
        if self._compensate is not None:
            ctx.compensations.append((self.key, self._compensate, value))
        logger.debug("step %r of task %s: completed", self.key, ctx.task_id)
        if step_succeeded.receivers:
            step_succeeded.send(
                sender=ctx.task, task_id=ctx.task_id, step_key=self.key, attempt=self.attempt,
                duration=(_clock.now() - self._started_at).total_seconds())

    def _end_atomic(self, tx: AtomicTransaction, exc: BaseException | None) -> None:
        """End an atomic step: commit its body's writes with its record, or neither."""
        ctx = self._ctx
        store = ctx.store
        self._tx = None
        if exc is None:
            try:
                tx.check()
                if not store.fence_atomic(ctx.task_id, self.key, ctx.owner):
                    raise LeaseLost(
                        f"task {ctx.task_id} lost its lease while its atomic step {self.key!r} "
                        "ran: another attempt took the run over, so nothing of the body was "
                        "committed and nothing was recorded. The run goes on under its new "
                        "owner; nothing needs to be done.",
                        task_id=ctx.task_id, step_key=self.key)
                self._running = True
                self._end(None)  # the record, inside the transaction
            except BaseException as error:
                self._running = False
                tx.abort()
                if error is ctx.fatal:
                    # An output that cannot be stored: the run fails for good, and that
                    # is recorded outside the transaction that was just rolled back.
                    self._record(STEP_FAILED, error=_error_text(error), body_exit=BODY_FATAL)
                    ctx.failed_step = self.key
                raise
            try:
                with store._unavailable("committing the atomic step", ctx.task_id, self.key):
                    tx.finish()
            except StoreUnavailable as down:
                raise ctx.store_failed(down, self.key, ran=True, atomic=True) from down
            return
        # The body failed: roll back first, then record the failure outside the
        # transaction (or in the outer atomic step's), as for any step.
        tx.abort()
        if isinstance(exc, Suspended | Unwind):
            return
        self._running = True
        self._end(exc)

    def _record(self, status: str, *, output: str | None = None, error: str | None = None,
                body_exit: str | None = None, returned: str | None = None) -> None:
        ctx = self._ctx
        stored = output is not None or returned is not None
        try:
            ctx.record(self.key, f"step {self.key!r}", status=status,
                       started_at=self._started_at, output=output,
                       serializer=ctx.serializer_name if stored else None, error=error,
                       claimed=self._claimed, new=self._new, position=self.position,
                       input_fingerprint=self._input_fp, code_fingerprint=self._code_fp,
                       body_exit=body_exit, returned=returned)
        except LeaseLost:
            self._lost_record()  # says why: the lease, or a conflict on the step's row
        except StoreUnavailable as exc:
            # The body ran: say so, and leave the run for the next attempt to find the
            # step in doubt, whichever way this attempt ends.
            raise ctx.store_failed(exc, self.key, ran=True, atomic=self.atomic) from exc

    def _unstorable(self, value: Any, what: str, error: Exception) -> StepOutputNotSerializable:
        """The error for a value of this step that the serializer refuses; it is fatal.

        Retrying would only run the body (and its side effect) again and fail
        the same way, so the run fails for good, as with a divergence.
        """
        ctx = self._ctx
        found = find_unstorable(value, ctx.serializer, root=what)
        where = (f"{found[0]} is {found[1]}, which" if found is not None
                 else f"{describe(value)}, which")
        reason = str(error).splitlines()[0][:200] if str(error).strip() else type(error).__name__
        refused = StepOutputNotSerializable(
            f"the {what} of step {self.key!r} in task {ctx.task_id} cannot be stored: {where} "
            f"the {ctx.serializer_name!r} serializer refuses ({reason}). The step's body ran "
            "but its end could not be recorded, so the run fails for good instead of running "
            "the body again on a retry. Return plain data (dicts, lists, strings, numbers, "
            "datetimes, Decimals, UUIDs, bytes) or configure duraflow_serializer; once the "
            "side effect is checked, `celery duraflow retry --from-step "
            f"{self.key}` runs it again on purpose.",
            task_id=ctx.task_id,
            step_key=self.key,
        )
        ctx.fatal = refused
        return refused

    def _returning(self, value: Any, blocks: tuple[Block, ...]) -> tuple[Any, str]:
        """A value returned from this step's body: as the store gives it back, and as text."""
        ctx = self._ctx
        try:
            data = ctx.serializer.dumps(value)
            return ctx.serializer.loads(data), data
        except Exception as error:
            refused = self._unstorable(value, "returned value", error)
            # Every step the return leaves ends with this error, and fails for good.
            for block in blocks:
                for step in block.steps:
                    step._refusal = refused
            raise refused from error

    def _replayed_exit(self, in_loop: bool) -> tuple[int, Any]:
        """How the recorded run left this (replayed) step's body, and what it returned."""
        ctx = self._ctx
        record = ctx.recorded.get(self.key)
        left = _LEFT.get(record.body_exit, FELL) if record and record.body_exit else FELL
        if left == RETURNED and record is not None:
            return left, decode(record.returned, record.serializer, ctx.serializer_name,
                                accept=ctx.config.accept_serializers if ctx.config else (),
                                task_id=ctx.task_id, step_key=self.key, what="returned value")
        if left in (BROKE, CONTINUED) and not in_loop:
            word = _EXITS[left]
            ctx.diverged(NonDeterministicReplay(
                f"step {self.key!r} of task {ctx.task_id} ({ctx.task_name}) left its loop with "
                f"`{word}` when it ran, but the code that reaches it now has no loop around "
                "it, so the replay cannot go on the way the run went.",
                task_id=ctx.task_id, step_key=self.key, position=self.position,
                recorded_key=self.key, reached_key=self.key))
            return FELL, None
        return left, None

    def _fatal_again(self, record: StepRecord) -> DuraflowError:
        """A step that failed for good is reached again: raise its error, run nothing."""
        ctx = self._ctx
        name, _, text = (record.error or "").partition(": ")
        cls = _FATAL_ERRORS.get(name.rpartition(".")[2], DuraflowError)
        error = cls(
            f"{text or 'the step failed for good'} (Recorded when step {self.key!r} of task "
            f"{ctx.task_id} failed for good; its body is not run again by a retry. Retry the "
            f"run from this step on purpose with `celery duraflow retry {ctx.task_id} "
            f"--from-step {self.key}`.)",
            task_id=ctx.task_id, step_key=self.key)
        ctx.fatal = error
        return error

    def _lost_record(self) -> NoReturn:
        """The end of the step could not be written: say why."""
        ctx = self._ctx
        run = ctx.store.get_run(ctx.task_id)
        if run is None or run.lease_owner != ctx.owner:
            raise LeaseLost(
                f"step {self.key!r} of task {ctx.task_id} ended, but another attempt took "
                "the run over meanwhile, so this attempt's result was not recorded. The new "
                "owner decides what happens to the step; nothing needs to be done.",
                task_id=ctx.task_id,
                step_key=self.key,
            )
        raise StepConflict(
            f"step {self.key!r} of task {ctx.task_id} was completed by another attempt of the "
            "same task id while this one ran it; the recorded output stands and this "
            "attempt's was not stored.",
            task_id=ctx.task_id,
            step_key=self.key,
        )


# -- The runtime of prepared functions -----------------------------------------------------
# The rewrite calls guard() at the top of every `with` body and leave() where control
# leaves one by return, break or continue: they decide, with the step, whether the body
# runs and how a skipped one is left.

class Block:
    """One ``with`` statement's body as it runs: whether it runs, and how it is left.

    ``left`` is one of FELL, RETURNED, BROKE or CONTINUED: set by the code the
    rewrite adds where control leaves the body, and, for a body skipped on a
    replay, taken from the record of the step, so the replay leaves the same way.
    ``value`` is the returned value (as stored), ``data`` its stored text.
    """

    __slots__ = ("data", "left", "run", "steps", "value")

    def __init__(self, run: bool, steps: list[StepContext]) -> None:
        self.run = run
        self.steps = steps
        self.left = FELL
        self.value: Any = None
        self.data: str | None = None


# The block of a `with` that entered no step (or ran outside a durable run): it runs, and
# nothing reads how it is left, so one object serves them all.
_PLAIN = Block(True, [])


def guard(fingerprint: str | None = None, in_loop: bool = False,
          suspends: bool = False) -> Block:
    """The block of the ``with`` statement whose body starts now.

    Called at the top of every ``with`` body with the fingerprint of that
    body's code; the steps entered by that ``with`` statement take it (and a
    replayed one compares it with the fingerprint it recorded). ``in_loop``
    says whether the statement sits in a loop of its function (a recorded
    ``break`` or ``continue`` can only be re-enacted there); ``suspends`` that
    its body contains ``yield`` or ``await``, which no step body may.
    """
    ctx = current_run.get()
    if ctx is None or not ctx.entered:
        return _PLAIN
    entered, ctx.entered = ctx.entered, []
    block = Block(ctx.stack[-1]._should_run, entered)
    for step in entered:
        step._block = block
        step.code_seen(fingerprint)
    innermost = entered[-1]
    if suspends:
        raise UnsupportedCode(
            f"the body of step {innermost.key!r} in task {ctx.task_id} contains yield or "
            "await, which would suspend the step half-way; a replay could not resume it "
            "there. Compute the value inside the step and yield or await outside it.",
            task_id=ctx.task_id, step_key=innermost.key)
    if not block.run:
        block.left, block.value = innermost._replayed_exit(in_loop)
    return block


def leave(blocks: tuple[Block, ...], how: int, value: Any = None) -> Any:
    """Control leaves the bodies of ``blocks`` by return, break or continue.

    Each block's steps record it when they end. A returned value goes
    through the serializer first and what comes back is returned, as with
    ``s.result``, so the first attempt and a replay return equal values.
    """
    if how == RETURNED:
        for block in reversed(blocks):
            running = [step for step in block.steps if step._running]
            if running:
                value, data = running[-1]._returning(value, blocks)
                break
        else:
            data = None
    else:
        data = None
    for block in blocks:
        if block.steps:
            block.left, block.data = how, data
    return value


class BodyTasks:
    """``with BodyTasks(step):`` around the code of ``step``'s body that starts other tasks.

    A step reached from a task created in there, while ``step`` is the innermost
    running step, is nested in ``step`` and allowed, though it runs in another
    asyncio task; a step reached from an unrelated task (a sibling gathered next to
    it) is still refused (:meth:`RunContext.check_concurrent`).
    """

    __slots__ = ("_step", "_token")

    def __init__(self, step: StepContext) -> None:
        self._step = step
        self._token: Token[StepContext | None] | None = None

    def __enter__(self) -> None:
        self._token = body_of.set(self._step)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            body_of.reset(self._token)
            self._token = None


def _decode(ctx: RunContext, record: StepRecord) -> Any:
    """A replayed step's stored output, if its row names a serializer the config accepts."""
    accept = ctx.config.accept_serializers if ctx.config is not None else ()
    return decode(record.output, record.serializer, ctx.serializer_name, accept=accept,
                  task_id=ctx.task_id, step_key=record.key)


def step(name: str, *, input: Any = _NO_INPUT, compensate: Callable[[Any], Any] | None = None,
         on_in_doubt: str = "rerun", atomic: bool = False) -> StepContext:
    """Declare a durable step of the running task.

    ``input``, when given, is fingerprinted and stored with the step: a
    replay that reaches the completed step with another input raises
    :class:`~celery_duraflow.StepInputChanged` instead of handing back an
    output computed from the old one (``duraflow_on_divergence``).

    ``compensate``, when given, is called with the step's result to undo it
    if the run later fails for good or is cancelled: the compensations of
    the completed steps run in reverse order, each recorded like a step.

    ``on_in_doubt`` says what to do when an earlier attempt started this
    step and died before recording its end: ``"rerun"`` (the default) runs
    it again with ``s.in_doubt`` True and the same ``s.idempotency_key``;
    ``"raise"`` raises :class:`~celery_duraflow.StepInDoubt` instead, for
    side effects a human must reconcile.

    Use it as a ``with`` block (the body is skipped when the step completed in
    an earlier attempt, and ``s.result`` holds the stored output)::

        with step("book-flight") as s:
            s.result = airline.book(flight, idempotency_key=s.idempotency_key)
        booking = s.result

    or in its functional form, which works in any code::

        booking = step("book-flight").run(airline.book, flight)

    ``atomic=True`` runs the body inside a transaction on the store's own
    database and writes the step's record in that same transaction: the body's
    writes (on ``s.connection``, or through the Django ORM on the store's alias)
    and the record commit together or not at all, so such a step happens
    exactly once. An atomic step is never in doubt, and may not wait, sleep or
    start a child run inside its body::

        with step("save-order", atomic=True) as s:
            s.connection.execute(orders.insert().values(number=number))
    """
    return StepContext(name, input=input, compensate=compensate, on_in_doubt=on_in_doubt,
                       atomic=atomic)
