"""The state of the attempt that is running in this thread (or task)."""

from __future__ import annotations

import asyncio
import logging
import threading
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._lease import keeper
from ._limits import check_key
from .errors import (
    DuraflowError,
    LeaseLost,
    NonDeterministicReplay,
    StoreUnavailable,
    UnsupportedCode,
)

logger = logging.getLogger("celery_duraflow.replay")

if TYPE_CHECKING:
    from ._config import Config
    from ._serialization import Serializer
    from ._step import StepContext
    from ._store import StepRecord, Store


@dataclass(eq=False)
class RunContext:
    """One attempt of one run: what the store recorded, and where the code is now."""

    task_id: str
    task_name: str
    owner: str
    store: Store
    serializer: Serializer
    serializer_name: str
    recorded: dict[str, StepRecord]
    # The task object of this attempt (its app sends child runs) and the configuration.
    task: Any = None
    config: Config | None = None
    # The run was taken over from an owner that died: its first unfinished step is in doubt.
    interrupted: bool = False
    # Whether this attempt has recorded the end of any step yet.
    recorded_any: bool = False
    # Occurrences of each step name, counted within its parent step ("" at the top).
    occurrences: dict[tuple[str, str], int] = field(default_factory=dict)
    # How many steps this attempt has reached in each parent step ("" at the top).
    reached: dict[str, int] = field(default_factory=dict)
    # Steps whose body is running, by the key of their parent step ("" at the top): a
    # step reached beside one of them by another task or thread is refused (see
    # :meth:`check_concurrent`).
    active: dict[str, list[StepContext]] = field(default_factory=dict)
    # Per thread: the steps entered by a `with` statement whose body has not started yet
    # (the body's guard hands them its code fingerprint); see :attr:`entered`.
    _entered: dict[int, list[StepContext]] = field(default_factory=dict)
    # An error that ends the run for good (a divergence, an output that cannot be
    # stored, a key the store cannot hold): no retry may run it again on the same record.
    fatal: DuraflowError | None = None
    # (parent key, position) -> the key recorded there; built on first use.
    _positions: dict[tuple[str, int], str] | None = None
    # Why the run is being unwound ("cancel" or "failure"), or None: at the first step
    # that has not completed, the attempt stops and the compensations run.
    unwinding: str | None = None
    # (step key, undo, the step's result) of every completed step with compensate=, in
    # the order they completed (or were replayed).
    compensations: list[tuple[str, Any, Any]] = field(default_factory=list)
    # The key of the last step whose body raised in this attempt, for the log.
    failed_step: str | None = None
    # The Celery task id of the delivery (``task_id`` is the run key: the same, except
    # for a durable replacement, whose key is ``<task id>~r<nesting>``), and the
    # replacement nesting of the run.
    celery_id: str = ""
    level: int = 0
    # Set when the attempt asked for a retry without raising it (retry(throw=False)):
    # the Retry Celery sent. The attempt then ends without ending the run.
    retry_sent: Any = None
    # Set by DurableTask.replace: the attempt ends with the run replaced.
    replaced: bool = False
    # A replay check (celery_duraflow._replay): recorded steps are replayed, nothing is
    # written, and the first thing a live attempt would do for real stops it (ReplayStop).
    dry: bool = False
    # What a replay check noticed on its way without stopping (a step whose code changed).
    notes: list[str] = field(default_factory=list)
    # The first store error of this attempt: no further step starts, and the attempt is
    # handed over (sent again without spending a retry) instead of retried or finished.
    outage: StoreUnavailable | None = None
    # A step body ran in this attempt and its end was not recorded: whatever way the
    # attempt ends, the run is left interrupted, so the next attempt finds it in doubt.
    unrecorded: bool = False

    @property
    def stack(self) -> tuple[StepContext, ...]:
        """The steps entered and not yet exited in this context (thread or asyncio task),
        innermost last. Each context has its own: the branches of a parallel() and the
        tasks of an asyncio.gather() start from the steps open where they were created,
        and what one of them enters the others do not see."""
        run, steps = _frames.get(_NO_FRAMES)
        return steps if run is self else ()

    def push(self, step: StepContext) -> None:
        """``step`` is entered in this context."""
        _frames.set((self, (*self.stack, step)))

    def pop(self, step: StepContext) -> None:
        """``step`` is exited in this context (a no-op where it was not entered)."""
        steps = self.stack
        if steps and steps[-1] is step:
            _frames.set((self, steps[:-1]))
        elif step in steps:  # pragma: no cover - a generator left a step open
            _frames.set((self, tuple(s for s in steps if s is not step)))

    @property
    def entered(self) -> list[StepContext]:
        """This thread's steps entered by a ``with`` whose body has not started yet (a
        ``with`` statement and the guard of its body run in one thread, with no await
        between them)."""
        return self._entered.setdefault(threading.get_ident(), [])

    @entered.setter
    def entered(self, steps: list[StepContext]) -> None:
        self._entered[threading.get_ident()] = steps

    def check_concurrent(self, parent: str, name: str) -> None:
        """Refuse a step reached in ``parent`` while a sibling's body runs in another task
        or thread: which of the two reaches its key first would depend on timing, and
        their records could not be matched on a replay. A step that is nested in the one
        whose body runs here, or that another task starts for it (``BodyTasks``), is
        not beside it. Branches of :func:`~celery_duraflow.parallel` each have a parent
        of their own."""
        running = self.active.get(parent)
        if not running:
            return
        here = runner()
        for sibling in running:
            if sibling.runner is here or body_of.get() is sibling:
                continue
            error = UnsupportedCode(
                f"step {name!r} of task {self.task_id} was reached while step "
                f"{sibling.key!r} is running in another asyncio task or thread. Steps that "
                "run at the same time must get their keys in an order that does not depend "
                "on timing: create them before they run (asyncio.gather(step('a').arun(f), "
                "step('b').arun(g))), or give each branch a scope of its own with "
                "parallel() or aparallel().", task_id=self.task_id, step_key=name)
            self.fatal = error
            raise error

    def store_failed(self, error: StoreUnavailable, key: str, *, ran: bool,
                     atomic: bool = False) -> StoreUnavailable:
        """Note a store error at step ``key``; return it as raised to the task's code.

        The returned error says truthfully whether the step's body ran. The first
        error of the attempt is kept in :attr:`outage`.
        """
        if ran and not atomic:
            self.unrecorded = True
            what = (f"The body of step {key!r} ran, but its end was not recorded: the next "
                    "attempt runs it again as in doubt (s.in_doubt is True), with the same "
                    "s.idempotency_key, so pass that key to the API the step calls.")
        elif ran:
            what = (f"The body of atomic step {key!r} ran; its writes commit together with "
                    "its record or not at all, and the next attempt finds out which.")
        else:
            what = f"The body of step {key!r} did not run."
        raised = StoreUnavailable(f"{error.message} {what} {self._after_outage()}",
                                  task_id=self.task_id, step_key=key)
        if self.outage is None:
            self.outage = raised
        return raised

    def stop_for_outage(self, key: str) -> None:
        """Refuse to start step ``key`` after the store failed earlier in this attempt."""
        first = self.outage
        if first is None:
            return
        raise StoreUnavailable(
            f"step {key!r} of task {self.task_id} was not started, and its body did not run: "
            f"the store failed earlier in this attempt, at step {first.step_key!r}. "
            f"{self._after_outage()}", task_id=self.task_id, step_key=key)

    def _after_outage(self) -> str:
        """What happens to an attempt the store failed in, as its errors say."""
        request = getattr(self.task, "request", None)
        if request is not None and request.is_eager:
            return ("The attempt stops here; an eager call is not sent again: call it again "
                    "once the store answers.")
        return ("The attempt stops here; the task is sent again once the store answers, "
                "without spending one of its retries.")

    def left_in_doubt(self) -> bool:
        """Whether the run must stay interrupted when this attempt lets go of it: a body
        ran unrecorded, or the in-doubt step it inherited was never resolved."""
        return self.unrecorded or (self.interrupted and not self.recorded_any)

    def stop_if_unwinding(self, key: str) -> None:
        """At a step boundary: stop the run here if it is being cancelled or unwound."""
        if self.unwinding is None:
            if not keeper().cancelled(self.task_id, self.owner):
                return
            self.unwinding = "cancel"
        raise Unwind(self.task_id, key, self.unwinding)

    def recorded_at(self, parent: str, position: int) -> str | None:
        """The key of the step recorded at ``position`` among ``parent``'s steps."""
        if self._positions is None:
            self._positions = {
                (key.rpartition("/")[0], record.position): key
                for key, record in self.recorded.items() if record.position is not None}
        return self._positions.get((parent, position))

    def check_order(self, key: str, position: int, kind: str = "step") -> None:
        """Compare a step the code reached with what the run recorded at that place."""
        parent = key.rpartition("/")[0]
        recorded_key = self.recorded_at(parent, position)
        record = self.recorded.get(key)
        if recorded_key is not None and recorded_key != key:
            found = f"the code now reaches {kind} {key!r} there"
        elif record is not None and record.position is not None and record.position != position:
            recorded_key = key
            found = (f"the code now reaches it at position {position} instead of "
                     f"{record.position}")
            position = record.position
        else:
            return
        where = f"inside step {parent!r}" if parent else "among the run's top-level steps"
        self.diverged(NonDeterministicReplay(
            f"task {self.task_id} ({self.task_name}) does not replay the way it ran: at "
            f"position {position} {where} the run recorded step {recorded_key!r}, but "
            f"{found}. The task's code changed while this run was in progress (or the order "
            "of its steps depends on something outside a step), so the recorded outputs "
            "cannot be matched to the steps safely.",
            task_id=self.task_id, step_key=key, position=position,
            recorded_key=recorded_key, reached_key=key))

    def diverged(self, error: NonDeterministicReplay, policy: str | None = None) -> None:
        """Raise ``error`` and mark the run as failed for good, or only log it ("warn")."""
        setting = "duraflow_on_code_change" if policy is not None else "duraflow_on_divergence"
        if policy is None:
            policy = self.config.on_divergence if self.config is not None else "fail"
        if self.dry:
            # A replay check reports every divergence a live attempt would fail on, and
            # notes the code changes it would only warn about.
            if policy == "warn" and setting == "duraflow_on_code_change":
                self.notes.append(str(error))
                return
            raise error
        if policy == "warn":
            logger.warning("%s %s is 'warn', so the run goes on.", error, setting)
            return
        error.message += (
            " The run is failed rather than retried. Put code changes that runs in progress "
            f"must not see behind patched(); set {setting} = 'warn' to go on regardless.")
        self.fatal = error
        raise error

    def peek_key(self, name: str) -> tuple[str, str, int]:
        """The key the next occurrence of ``name`` in the current parent step would get:
        (parent key, key, occurrence count). Nothing is taken until :meth:`take_key`.

        Keys count within the parent, never across the run: when a parent step is
        answered from the store its body and its children are not reached, and the
        steps after it must keep their keys all the same. A key longer than the store
        can hold is refused here, before anything runs or is written, and ends the run
        for good: a retry would reach the same key.
        """
        stack = self.stack
        parent = stack[-1].key if stack else ""
        if self.active.get(parent):
            self.check_concurrent(parent, name)
        count = self.occurrences.get((parent, name), 0) + 1
        key = name if count == 1 else f"{name}#{count}"
        key = f"{parent}/{key}" if parent else key
        try:
            check_key(self.task_id, key)
        except DuraflowError as error:
            self.fatal = error
            raise
        return parent, key, count

    def take_key(self, parent: str, name: str, count: int) -> None:
        """Count the occurrence of ``name`` that :meth:`peek_key` looked at as reached."""
        self.occurrences[(parent, name)] = count

    def next_key(self, name: str) -> tuple[str, int]:
        """The key of the next occurrence of ``name`` in the current parent step, and its
        position among that parent's steps (1 for the first); see :meth:`peek_key`."""
        parent, key, count = self.peek_key(name)
        self.take_key(parent, name, count)
        position = self.reached[parent] = self.reached.get(parent, 0) + 1
        return key, position

    def record(self, key: str, what: str, **fields: Any) -> None:
        """Write the record of ``key`` (a step, a wait, a patch marker, an undo) under this
        attempt's lease.

        The one way anything of a run is recorded while it runs: ``fields`` go to
        :meth:`Store.record_step`. If the write did not apply, another attempt took
        the run over, and LeaseLost (naming ``what``) stops this one.
        """
        if self.dry:
            raise ReplayStop(key, what)
        if not self.store.record_step(self.task_id, key, self.owner, **fields):
            raise LeaseLost(
                f"task {self.task_id} lost its lease at {what}: another attempt took the run "
                "over, so this one stops here without recording anything. Nothing needs to be "
                "done.", task_id=self.task_id, step_key=key)
        self.recorded_any = True


class Suspended(BaseException):
    """The attempt ends at a wait; :class:`DurableTask` turns this into ``Ignore``.

    A ``BaseException``, so that the user's ``except Exception`` cannot swallow it.
    ``countdown`` is set when the task must also be sent again after that many
    seconds (a short remaining time).
    """

    def __init__(self, task_id: str, key: str, status: str, countdown: float | None) -> None:
        super().__init__(f"task {task_id} is {status} at {key!r}")
        self.task_id = task_id
        self.key = key
        self.status = status
        self.countdown = countdown


class ReplayStop(BaseException):
    """A replay check reached what a live attempt would run or record for real."""

    def __init__(self, key: str, what: str) -> None:
        super().__init__(f"a live attempt would carry on at {what}")
        self.key = key
        self.what = what


class Unwind(BaseException):
    """The run stops at this step boundary to be cancelled or compensated."""

    def __init__(self, task_id: str, key: str, reason: str) -> None:
        super().__init__(f"task {task_id} stops before {key!r} ({reason})")
        self.task_id = task_id
        self.key = key
        self.reason = reason


# Reset in a ``finally`` by DurableTask.__call__: worker pools reuse threads.
current_run: ContextVar[RunContext | None] = ContextVar("celery_duraflow_run", default=None)


#: The steps open in one context, and the attempt they belong to: (run, steps). A plain
#: tuple, the cheapest thing to build on the step path.
Frames = tuple["RunContext | None", tuple["StepContext", ...]]

# Immutable, set anew on every change: a context copied for a task or a thread keeps what
# was open when it was copied, and nothing it enters shows in another context.
_NO_FRAMES: Frames = (None, ())
_frames: ContextVar[Frames] = ContextVar("celery_duraflow_frames")


def enter_run(ctx: RunContext) -> tuple[Token[RunContext | None], Token[Frames]]:
    """Make ``ctx`` the attempt of this context, with no step open; undo with
    :func:`leave_run` (an eager attempt may run inside a step of another)."""
    return current_run.set(ctx), _frames.set((ctx, ()))


def leave_run(tokens: tuple[Token[RunContext | None], Token[Frames]]) -> None:
    run_token, frames_token = tokens
    _frames.reset(frames_token)
    current_run.reset(run_token)


def runner() -> object:
    """What runs the code here: its asyncio task, or else its thread."""
    loop = asyncio._get_running_loop()  # None outside a loop, without raising
    task = asyncio.current_task(loop) if loop is not None else None
    return task if task is not None else threading.current_thread()


# The step whose body the code in this context is part of, for a body that hands its work
# to asyncio tasks it then waits for (an agent framework runs a tool, or a whole agent run,
# in tasks of its own). The tasks inherit it with the context they are created in; set
# with ``BodyTasks(step)`` (:mod:`._step`).
body_of: ContextVar[StepContext | None] = ContextVar("celery_duraflow_body_of", default=None)


def get_current_run() -> RunContext | None:
    """The attempt running in this context, or ``None`` outside a durable task."""
    return current_run.get()


def describe(value: Any, limit: int = 200) -> str:
    """A short, single-line description of a value for error messages.

    "TypeName repr", at most ``limit`` characters. The repr is a bounded one
    (:mod:`reprlib`: a few levels, a few items per container, long strings and
    numbers cut), so a value nested thousands of levels deep, a huge container
    or a ``__repr__`` that raises cannot make the message itself fail: this
    function never raises.
    """
    import reprlib

    name = type(value).__name__
    limit = max(int(limit), 8)
    bounded = reprlib.Repr()
    bounded.maxlevel = 6
    bounded.maxtuple = bounded.maxlist = bounded.maxset = bounded.maxfrozenset = 20
    bounded.maxdeque = bounded.maxarray = 20
    bounded.maxdict = 12
    bounded.maxstring = bounded.maxlong = bounded.maxother = limit
    try:
        shown = bounded.repr(value)
    except Exception as exc:
        # reprlib lets a few reprs raise (an int too long to print, say).
        shown = f"<{name} that cannot be shown: {type(exc).__name__}>"
    text = f"{name} {shown}".replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."
