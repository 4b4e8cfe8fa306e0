"""``DurableTask``: the Celery task base class that gives a run its memory."""

from __future__ import annotations

import functools
import inspect
import logging
import random
import time
import types
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from celery.result import ResultBase
from kombu.utils.imports import symbol_by_name

from . import _clock, _flow
from ._canvas import CELERY_BUILTIN_PREFIX, install_canvas_fixes, sent_as_celery_does
from ._compensation import unwind
from ._config import Config, config_for_app
from ._context import RunContext, Suspended, Unwind, current_run, describe, enter_run, leave_run
from ._fingerprint import code_fingerprint
from ._lease import keeper, new_owner, owner_is_gone
from ._limits import check_task_id
from ._rewrite import prepare, refuse_async
from ._send import is_recorded, priority_of, send_recorded, wake_parent
from ._serialization import (
    Serializer,
    decode,
    encode_arguments,
    find_unstorable,
    get_serializer,
    stored_text,
)
from ._signals import install_signal_handlers
from ._store import (
    FAILED,
    IGNORED,
    NOT_RERUN,
    REJECTED,
    REPLACED,
    SUCCEEDED,
    Delivery,
    RunRecord,
    RunStatus,
    StepRecord,
    Store,
    store_for,
)
from ._telemetry import install_telemetry
from .errors import (
    ConfigurationError,
    LeaseLost,
    RunArgumentsMismatch,
    RunCancelled,
    StepOutputNotSerializable,
    StoreUnavailable,
    UnsupportedCode,
)
from .signals import attempt_finished, attempt_started, run_finished, store_unavailable

logger = logging.getLogger("celery_duraflow.task")

# The message header that carries a store outage from one re-send to the next.
OUTAGE_HEADER = "duraflow_outage"
# How many leases after a retry was due the sweep waits before re-sending it.
RETRY_GRACE_LEASES = 10
# How long a retry that arrives before its predecessor let go of the run waits for it.
RETRY_HANDOVER_SECONDS = 2.0
# The run key of a durable replacement: Celery gives a replacement the replaced task's
# id, and the run of that id belongs to the replaced task.
REPLACEMENT_MARK = "~r"

# (Celery task id, run key) of the replacement an eager Task.replace is applying right
# now: eager requests carry no replacement nesting, so the key is passed this way.
_eager_replacement: ContextVar[tuple[str, str] | None] = ContextVar(
    "duraflow_eager_replacement", default=None)
# The attempt whose retry(args=..., kwargs=...) is building its signature right now.
_retry_arguments: ContextVar[RunContext | None] = ContextVar(
    "duraflow_retry_arguments", default=None)


def replacement_key(task_id: str, level: int) -> str:
    """The run key of the replacement of ``task_id`` at replacement nesting ``level``."""
    return f"{task_id}{REPLACEMENT_MARK}{level}"


def _level_of(run_key: str) -> int:
    """The replacement nesting a run key stands for (0 for a task id of its own)."""
    _, mark, level = run_key.rpartition(REPLACEMENT_MARK)
    return int(level) if mark and level.isdigit() else 0


def _nesting(request: Any) -> int:
    try:
        return int(request.get("replaced_task_nesting") or 0)
    except (TypeError, ValueError):
        return 0


def _app_task_class(app: Any, bases: tuple[type, ...]) -> type | None:
    """The app's own task class (``task_cls``), when a task class made for ``app`` from
    ``bases`` should have it too: it is a Celery Task subclass other than Task itself
    (Django's fix-up makes it ``DjangoTask``, with ``delay_on_commit()``), and none of
    ``bases`` has it already."""
    task_cls = getattr(app, "task_cls", None)
    if task_cls is None:
        return None
    try:
        cls = symbol_by_name(task_cls)  # type: ignore[no-untyped-call]
    except Exception:  # Celery reports a task_cls it cannot import itself, in app.Task
        return None
    if (not isinstance(cls, type) or cls is Task or not issubclass(cls, Task)
            or issubclass(cls, DurableTask) or any(issubclass(base, cls) for base in bases)):
        return None
    return cls


class _DurableTaskType(type):
    """The class of DurableTask classes: ``@app.task(base=DurableTask)`` keeps what the
    app's own task class adds.

    Celery builds a decorated task's class from ``base`` alone, so with
    ``base=DurableTask`` the methods of the app's ``task_cls`` would be lost: in a
    Django project, ``delay_on_commit()`` and ``apply_async_on_commit()`` of Celery's
    ``DjangoTask``. The app's class is added after the bases, so DurableTask's own
    methods come first and reach it through ``super()``.
    """

    def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any],
                **kwargs: Any) -> _DurableTaskType:
        app_class = (_app_task_class(namespace["app"], bases)
                     if "app" in namespace and bases else None)
        if app_class is not None:
            try:
                return super().__new__(mcs, name, (*bases, app_class), namespace, **kwargs)
            except TypeError:
                # No consistent method order with it (a task_cls that derives from one
                # of the bases in another order): the task is built as Celery would.
                logger.warning("task %s cannot also derive from the app's task class %s",
                               namespace.get("name", name), app_class.__qualname__)
        return super().__new__(mcs, name, bases, namespace, **kwargs)


def _on_commit(task: Any, method: str, send: Any) -> None:
    """Run ``send`` when the current Django database transaction commits (at once outside
    one); a clear error outside a Django project."""
    try:
        from django.conf import settings
        from django.db import transaction
    except ImportError:
        settings = None
    if settings is None or not settings.configured:
        raise ConfigurationError(
            f"{task.name}.{method}() sends the task once the Django database transaction "
            "commits, and there is no Django project here ("
            + ("Django is not installed" if settings is None
               else "DJANGO_SETTINGS_MODULE is not set") + "). Call "
            + ("delay()" if method == "delay_on_commit" else "apply_async()") + " instead.")
    transaction.on_commit(send)


class DurableTask(Task, metaclass=_DurableTaskType):  # type: ignore[misc]
    """Base class for Celery tasks whose steps survive retries.

    Use it as ``@app.task(base=DurableTask)`` (with or without ``bind=True``)
    or subclass it and define ``run``. The Celery task id identifies the run;
    Celery keeps it across ``retry()``, autoretry and redelivery, so every
    attempt of a run finds the steps its predecessors recorded.

    ``run`` is prepared when the class is created, so ``with step(...)``
    blocks directly in it can be skipped on a replay.
    """

    #: The worker's request class: it records in the store how Celery ended an attempt
    #: that could not say so itself (a hard time limit, a lost worker process).
    Request = "celery_duraflow._request:DurableRequest"

    #: Flow control across every worker: :class:`~celery_duraflow.Concurrency` and
    #: :class:`~celery_duraflow.RateLimit`, checked before the body of every attempt.
    duraflow_limits: Sequence[_flow.Limit] = ()
    #: :class:`~celery_duraflow.Dedupe`: one run per key and window, checked when sent.
    duraflow_dedupe: _flow.Dedupe | None = None
    #: :class:`~celery_duraflow.Debounce`: one run per burst of sends of a key.
    duraflow_debounce: _flow.Debounce | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        run = cls.__dict__.get("run")
        function = run.__func__ if isinstance(run, staticmethod) else run
        if callable(function):
            refuse_async(function, f"DurableTask {cls.__qualname__}")
            if inspect.isgeneratorfunction(inspect.unwrap(function)):
                raise UnsupportedCode(
                    f"DurableTask {cls.__qualname__}: its run() is a generator function, so "
                    "Celery would store the generator, not what it yields, and the run would "
                    "end before its steps ran. Return a list instead.")
        if isinstance(run, staticmethod):
            cls.run = staticmethod(prepare(run.__func__))
        elif isinstance(run, types.FunctionType):
            cls.run = prepare(run)
        _flow.check_declaration(str(cls.__dict__.get("name") or cls.__qualname__), cls.run,
                                cls.duraflow_limits, cls.duraflow_dedupe,
                                cls.duraflow_debounce)
        if run is not None:
            # Fingerprint the code now, where the task is defined, rather than in the
            # first attempt of some worker thread (the result is cached per code object).
            code_fingerprint(cls.run)
        install_signal_handlers()
        install_canvas_fixes(DurableTask)

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """``delay()`` once the current Django database transaction commits; never if it
        rolls back.

        The app's own task class does it when it has this method (Celery's
        ``DjangoTask`` in a Django project); otherwise Django's
        ``transaction.on_commit()`` does. Outside a Django project it raises
        ConfigurationError.
        """
        own = getattr(super(), "delay_on_commit", None)
        if own is not None:
            own(*args, **kwargs)
            return
        _on_commit(self, "delay_on_commit", functools.partial(self.delay, *args, **kwargs))

    def apply_async_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """``apply_async()`` once the current Django database transaction commits; never
        if it rolls back. See :meth:`delay_on_commit`."""
        own = getattr(super(), "apply_async_on_commit", None)
        if own is not None:
            own(*args, **kwargs)
            return
        _on_commit(self, "apply_async_on_commit",
                   functools.partial(self.apply_async, *args, **kwargs))

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    producer: Any = None, link: Any = None, link_error: Any = None,
                    shadow: Any = None, **options: Any) -> Any:
        """Celery's ``apply_async``; with ``duraflow_dedupe``, a send whose key was sent
        within the window sends nothing and returns that run's result handle; with
        ``duraflow_debounce``, sends of a key close together make one run."""
        def send(args: Any, kwargs: Any, **more: Any) -> Any:
            return super(DurableTask, self).apply_async(
                args, kwargs, producer=producer, link=link, link_error=link_error,
                shadow=shadow, **more)

        if ((self.duraflow_dedupe is None and self.duraflow_debounce is None)
                or options.get("retries") or is_recorded(options)
                or OUTAGE_HEADER in (options.get("headers") or {})):
            return send(args, kwargs, task_id=task_id, **options)
        if self.duraflow_debounce is not None:
            return _flow.debounce_send(self, args, kwargs, task_id, options, send)
        return _flow.dedupe_send(self, args, kwargs, task_id, options, send)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        task_id = request.id
        if task_id is None or self.name.startswith(CELERY_BUILTIN_PREFIX):
            # Called like a function (task(...)): no id, so no run of its own. Inside a
            # durable run its steps join that run, like a @durable helper's would.
            return super().__call__(*args, **kwargs)
        check_task_id(task_id)  # before anything is recorded or run

        config = config_for_app(self._get_app())
        store = store_for(config)
        serializer = get_serializer(config.serializer)
        run_key, nesting = task_id, _nesting(request)
        pending = _eager_replacement.get()
        if pending is not None and pending[0] == task_id and request.is_eager:
            run_key = pending[1]
            nesting = _level_of(run_key)
        outer = current_run.get()
        # An eager retry nested in its caller's attempt continues under the caller's lease.
        owner = (outer.owner if outer is not None and outer.task_id == run_key
                 else new_owner())
        delivery = self._delivery(owner, args, kwargs, serializer, config.serializer)
        # Every statement of this attempt goes to one connection, kept until it ends.
        # A task with one concurrency limit takes its slot as a new run starts, where
        # one is free: a limit that does not bind costs no statement of its own.
        slot = _flow.single_slot(self, args, kwargs, run_key) if delivery.first else None
        held_slot = None
        with store.held_connection():
            try:
                if slot is None:
                    run, recorded = store.begin_attempt(run_key, delivery)
                else:
                    scope, key, limit = slot
                    run, recorded, holding = store.begin_holding(
                        run_key, delivery, scope=scope, key=key, limit=limit)
                    held_slot = (scope, key) if holding else None
                if (run.lease_owner != owner and run.replaced_by is not None
                        and run_key == task_id and nesting >= _level_of(run.replaced_by)):
                    # A replacement (Task.replace gave it the replaced task's id): its run
                    # is its own, never the replaced one's.
                    run_key = check_task_id(replacement_key(task_id, nesting))
                    run, recorded = store.begin_attempt(run_key, delivery)
            except StoreUnavailable as exc:
                self._come_back_later(exc, config, nothing_ran=True)
            if run.lease_owner != owner:
                taken = self._not_ours(store, config, run, delivery)
                if taken is None:
                    return decode(run.result, run.serializer, config.serializer,
                                  accept=config.accept_serializers, task_id=task_id,
                                  step_key=None, what="result")
                run, recorded = taken, None

            keeper().hold(store, run_key, owner)
            freed = _flow.Freed(taken=held_slot) if _flow.holds_slots(self) else None
            if attempt_started.receivers:
                attempt_started.send(sender=self, task_id=run_key, attempt=run.attempts)
            ended: BaseException | None = None
            try:
                return self._attempt(store, config, serializer, run, recorded, owner, args,
                                     kwargs, celery_id=task_id, level=nesting, freed=freed)
            except BaseException as exc:
                ended = exc
                raise
            finally:
                keeper().release(store, run_key, owner)
                if freed is not None:
                    _flow.leave(self, store, run_key, owner, config.lease_seconds, freed)
                if attempt_finished.receivers:
                    attempt_finished.send(sender=self, task_id=run_key, attempt=run.attempts,
                                          exception=ended)

    def _attempt(self, store: Store, config: Config, serializer: Serializer, run: RunRecord,
                 recorded: dict[str, StepRecord] | None, owner: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any], *, celery_id: str, level: int,
                 freed: _flow.Freed | None = None) -> Any:
        task_id = run.task_id
        if recorded is None:
            try:
                recorded = store.load_steps(task_id)
            except StoreUnavailable as exc:
                self._release(store, task_id, owner, recover_after=config.lease_seconds,
                              interrupted=run.interrupted)
                self._come_back_later(exc, config, nothing_ran=True)
        ctx = RunContext(task_id=task_id, task_name=self.name, owner=owner, store=store,
                         serializer=serializer, serializer_name=config.serializer,
                         recorded=recorded, interrupted=run.interrupted, task=self,
                         config=config, unwinding=run.unwinding, celery_id=celery_id,
                         level=level)
        token = enter_run(ctx)
        try:
            _flow.enter(ctx, self, args, kwargs, freed.taken if freed is not None else None)
            result = self._run_body(args, kwargs)
        except Suspended as suspended:
            # The run sleeps or waits; the wait recorded that and released the lease.
            if suspended.countdown is not None:
                self._send_later(suspended.countdown)
            raise Ignore() from None
        except Unwind as stop:
            # Cancelled, or failed for good in an attempt that died while compensating:
            # the replay stopped at the first unfinished step; undo what completed.
            status = unwind(ctx, run, stop.reason, run.error)
            wake_parent(self._get_app(), replace(run, status=status))
            if stop.reason == "cancel":
                raise RunCancelled(
                    f"task {task_id} ({self.name}) was cancelled before step {stop.key!r}; "
                    f"its run is {status}.", task_id=task_id, step_key=stop.key) from None
            raise Ignore() from None
        except Retry as exc:
            logger.info("task %s (%s): retry %d requested%s", task_id, self.name,
                        int(self.request.retries or 0) + 1,
                        f" after step {ctx.failed_step!r} failed" if ctx.failed_step else "")
            # Celery sends the retry itself. Only if it is lost (a broker that dropped it)
            # does the sweep re-send the run, well after it was due: a retry stuck behind a
            # long queue is not lost, and sending it twice would only cost a message.
            self._release(store, task_id, owner, recover_after=_seconds_until(exc.when)
                          + RETRY_GRACE_LEASES * config.lease_seconds,
                          interrupted=ctx.left_in_doubt())
            raise
        except Reject as exc:
            if exc.requeue:
                # Celery puts the message back: the run goes on with that delivery.
                self._release(store, task_id, owner, recover_after=config.lease_seconds,
                              interrupted=ctx.left_in_doubt())
            else:
                self._end(ctx, run, REJECTED, f"Reject: {exc.reason!r}")
            raise
        except Ignore as exc:
            # Celery considers the task done, without a result: so is the run. A
            # replaced run's work goes on in its replacement, under a run key of its own.
            self._end(ctx, run, REPLACED if ctx.replaced else IGNORED,
                      None if ctx.replaced else stored_text(f"Ignore: {exc}") if str(exc) else None)
            raise
        except LeaseLost as exc:
            logger.warning("task %s: %s", task_id, exc)
            raise Ignore() from exc
        except StoreUnavailable as exc:
            # The store failed during the attempt (a step's start or end, a wait, a
            # child): hand the run over instead of spending one of the user's retries.
            self._hand_over(ctx, config, exc)
        except BaseException as exc:
            logger.warning("task %s (%s) failed for good%s: %s", task_id, self.name,
                           f" at step {ctx.failed_step!r}" if ctx.failed_step else "",
                           type(exc).__qualname__)
            if isinstance(exc, Exception) and ctx.compensations:
                # Failed for good, with completed steps to undo.
                status = unwind(ctx, run, "failure",
                                stored_text(f"{type(exc).__qualname__}: {exc}"))
                wake_parent(self._get_app(), replace(run, status=status))
            elif self._record_failure(ctx, exc):
                wake_parent(self._get_app(), run)
            raise
        finally:
            leave_run(token)

        if ctx.outage is not None:
            # The task's code went on after a store error (it caught StoreUnavailable):
            # a step's end may be missing, so the run is not finished on this attempt.
            self._hand_over(ctx, config, ctx.outage)
        if ctx.retry_sent is not None:
            # retry(throw=False): Celery sent the retry and this attempt returns as well.
            # The run goes on in that retry, which replays the completed steps.
            self._release(store, task_id, owner, recover_after=_seconds_until(
                ctx.retry_sent.when) + RETRY_GRACE_LEASES * config.lease_seconds,
                interrupted=ctx.left_in_doubt())
            return result
        data = self._stored_result(ctx, run, serializer, result)
        try:
            if freed is None:
                finished = store.finish_run(task_id, owner, SUCCEEDED, result=data,
                                            serializer=config.serializer)
            else:  # its concurrency slots go in the same statement
                finished, freed.queued = store.finish_freeing(
                    task_id, owner, result=data, serializer=config.serializer)
        except StoreUnavailable as exc:
            # Every step is recorded; the next attempt replays them and records the end.
            self._hand_over(ctx, config, exc)
        if finished:
            if run_finished.receivers:
                run_finished.send(sender=self, task_id=task_id, status=SUCCEEDED)
            wake_parent(self._get_app(), run)
        else:
            logger.warning("task %s finished, but another attempt owns the run now; its "
                           "result was not recorded", task_id)
        return result

    def _stored_result(self, ctx: RunContext, run: RunRecord, serializer: Serializer,
                       result: Any) -> str | None:
        """The run's result as stored: what Celery's result backends would store.

        A result object (an AsyncResult, a GroupResult) is stored as its tuple,
        as Celery's backends store it. A value the serializer cannot store fails
        the run with StepOutputNotSerializable, unless Celery keeps no result of
        this task (``ignore_result``): then the run records that it kept none
        (None), and a late delivery of it returns None. An eager call stores its
        result like any other, since applying the same task id again answers
        with it.
        """
        config = ctx.config
        assert config is not None
        stored = result
        if config.serializer != "pickle" and isinstance(result, ResultBase):
            stored = result.as_tuple()
        try:
            return serializer.dumps(stored)
        except Exception as error:
            if not self._keeps_result():
                logger.info("task %s (%s) returned %s, which the %r serializer cannot store; "
                            "the task ignores its result, so the run records none",
                            ctx.task_id, self.name, describe(result), config.serializer)
                return None
            found = find_unstorable(stored, serializer, root="result")
            what = (f"{describe(result)}, in which {found[0]} is {found[1]}" if found
                    else describe(result))
            refused = StepOutputNotSerializable(
                f"task {ctx.task_id} ({self.name}) returned {what}, which the "
                f"{config.serializer!r} serializer cannot store ({error}). Return plain data, "
                "set ignore_result=True if the result is not needed, or configure "
                "duraflow_serializer.",
                task_id=ctx.task_id,
            )
            if self._record_failure(ctx, refused):
                wake_parent(self._get_app(), run)
            raise refused from error

    def _keeps_result(self) -> bool:
        """Whether the task's result is kept: not with ``ignore_result`` (the task's
        or, as Celery reads it, the request's)."""
        from celery.app.task import get_actual_ignore_result

        return not get_actual_ignore_result(self, self.request)

    def _run_body(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the task's body, as Celery's ``Task.__call__`` would.

        Celery's tracer has already pushed this request (and the task onto the
        current-task stack) before calling the task, and Celery's worker
        patches ``Task.__call__`` not to push them again. An eager call gets
        no such patch; where the next ``__call__`` after this class's is
        Celery's own, the body is called directly, so the request is pushed
        once, as for a plain task. A ``__call__`` of the user's own further
        down the class hierarchy is always called.
        """
        stack = self.request_stack
        request = stack.top
        if (_next_call_is_celerys(type(self)) and request is not None
                and len(stack) == 1 and not request.called_directly):
            return self.run(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def _end(self, ctx: RunContext, run: RunRecord, status: RunStatus,
             error: str | None) -> None:
        """End the run with ``status`` as Celery ended the task (Ignore, Reject, replace)."""
        try:
            ended = ctx.store.finish_run(ctx.task_id, ctx.owner, status, error=error)
        except StoreUnavailable:
            logger.warning("could not record that task %s was %s; the sweep will send it "
                           "again when its lease expires", ctx.task_id, status, exc_info=True)
            return
        if ended:
            logger.info("task %s (%s) was %s", ctx.task_id, self.name, status)
            if run_finished.receivers:
                run_finished.send(sender=self, task_id=ctx.task_id, status=status)
            wake_parent(self._get_app(), replace(run, status=status))

    def replace(self, sig: Any) -> Any:
        """Celery's ``Task.replace``; the replacement's run is its own.

        Celery gives the replacement this task's id. Before the replacement is
        sent, the run of that id records where the replacement's run lives
        (``<task id>~r<nesting>``), so a durable replacement never answers a
        step from the replaced run's record, and the replaced run ends as
        ``replaced`` (in an eager call, which returns the replacement's result,
        as ``succeeded`` with that result).
        """
        ctx = current_run.get()
        request = self.request
        if ctx is None or ctx.celery_id != request.id or ctx.task is not self:
            return super().replace(sig)
        level = (ctx.level if request.is_eager else _nesting(request)) + 1
        key = check_task_id(replacement_key(ctx.celery_id, level))
        ctx.store.mark_replaced(ctx.celery_id, ctx.task_id, ctx.owner, key)
        ctx.replaced = True
        token = _eager_replacement.set((ctx.celery_id, key)) if request.is_eager else None
        try:
            with sent_as_celery_does():
                return super().replace(sig)
        finally:
            if token is not None:
                _eager_replacement.reset(token)

    def _delivery(self, owner: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                  serializer: Serializer, serializer_name: str) -> Delivery:
        """What this attempt records about its message.

        Raises RunArgumentsNotSerializable when the serializer cannot store the
        arguments: before begin_attempt, so nothing is recorded and no step runs.
        """
        request = self.request
        info = request.delivery_info or {}
        blob, fingerprint = encode_arguments(args, kwargs, serializer, task_id=request.id,
                                             task_name=self.name,
                                             serializer_name=serializer_name)
        return Delivery(task_name=self.name, owner=owner, args=blob,
                        args_fingerprint=fingerprint, exchange=info.get("exchange") or None,
                        routing_key=info.get("routing_key") or None,
                        priority=priority_of(info.get("priority")),
                        retries=int(request.retries or 0),
                        code_fingerprint=code_fingerprint(self.run),
                        first=(not request.retries and not info.get("redelivered")
                               and request.get(OUTAGE_HEADER) is None
                               and not is_recorded(request)))

    def _not_ours(self, store: Store, config: Config, run: RunRecord,
                  delivery: Delivery) -> RunRecord | None:
        """Deal with a run this delivery did not get the lease of.

        Returns the run when it could be taken over from a dead owner, None
        when it already succeeded (the caller returns its result), and raises
        otherwise.

        A run that ended and was pruned left only its tombstone (its task id,
        task name and final status): its steps and result are gone, so running
        it would start from nothing and repeat every side effect. A late
        delivery of such an id (a broker redelivery after its visibility
        timeout, a re-sent message) therefore ends at once like a duplicate
        delivery, with Celery's ``Ignore``: no step runs, nothing is recorded,
        and the result backend keeps what the run stored when it ended (a
        return value or an error would overwrite it).
        """
        task_id = run.task_id
        if run.status == REPLACED:
            logger.warning("task %s (%s) was replaced by another task; this late delivery of "
                           "it is ignored and runs no step", task_id, self.name)
            raise Ignore()
        if run.task_name != delivery.task_name or (
                run.args_fingerprint and delivery.args_fingerprint
                and run.args_fingerprint != delivery.args_fingerprint):
            raise RunArgumentsMismatch(
                f"task id {task_id} is recorded as a run of {run.task_name} with other "
                f"arguments than this delivery of {delivery.task_name} brings, so its recorded "
                "steps cannot be used. Send new work under a new task id; to run this id "
                "again with the old arguments, send exactly those.",
                task_id=task_id,
            )
        if run.pruned_at is not None:
            logger.warning("task %s (%s) %s and was pruned at %s; this late delivery of it "
                           "is ignored and runs no step", task_id, self.name, run.status,
                           run.pruned_at.isoformat())
            raise Ignore()
        outage = self.request.get(OUTAGE_HEADER)
        stale = outage.get("owner") if isinstance(outage, dict) else None
        if isinstance(stale, str) and stale != run.lease_owner:
            # Sent again by an attempt the store failed under, which could not let go of
            # the lease: the run was taken from it since (its lease ran out). Its writes
            # after that were refused; this is where that attempt's story ends.
            logger.warning("task %s: %s", task_id, LeaseLost(
                f"task {task_id} lost its lease while its attempt {stale} could not reach "
                f"the store: another attempt took the run over (it is {run.status} now), so "
                "this re-send of the old attempt runs nothing. Nothing needs to be done.",
                task_id=task_id))
        if run.status == SUCCEEDED:
            logger.info("task %s (%s) already succeeded; returning its recorded result",
                        task_id, self.name)
            return None
        if owner_is_gone(run.lease_owner):
            taken = store.take_over(task_id, str(run.lease_owner), delivery)
            if taken is not None:
                logger.warning("task %s: its previous owner %s is gone; taking the run over",
                               task_id, run.lease_owner)
                return taken
        if (isinstance(outage, dict) and run.lease_owner is not None
                and outage.get("owner") == run.lease_owner):
            # Sent by the attempt that holds the lease, after the store failed under it and
            # before it could let go: that attempt has ended, so the run is taken over
            # (and is interrupted: its first unfinished step is in doubt).
            taken = store.take_over(task_id, run.lease_owner, delivery)
            if taken is not None:
                logger.warning("task %s: taking the run over from %s, which the store failed "
                               "under", task_id, run.lease_owner)
                return taken
        if delivery.retries > run.retries:
            # Not a duplicate: the retry this run's owner asked for, delivered before that
            # attempt let go of the lease (Celery sends the retry, then the attempt ends).
            taken = self._after_predecessor(store, config, run, delivery)
            if taken is not None:
                return taken
        # A live attempt owns the run (a duplicate delivery): leave the run to it. If
        # that owner dies, its lease expires and the run is delivered again.
        logger.info("task %s is being run by %s; this duplicate delivery leaves it alone",
                    task_id, run.lease_owner)
        raise Ignore()

    def _after_predecessor(self, store: Store, config: Config, run: RunRecord,
                           delivery: Delivery) -> RunRecord | None:
        """Take the run once the attempt that asked for this retry has released it.

        That attempt ends a moment after Celery sent the retry, so the lease is
        asked for again for up to RETRY_HANDOVER_SECONDS. If it is still held
        then, this delivery is sent again a second later (its retry count
        unchanged, none of max_retries spent) and ends; None if the run could
        not be taken and no re-send was needed (another delivery took it).
        """
        deadline = time.monotonic() + RETRY_HANDOVER_SECONDS
        delivery = replace(delivery, first=False)  # the run's row is there
        while time.monotonic() < deadline:
            time.sleep(0.02)
            current, _ = store.begin_attempt(run.task_id, delivery)
            if current.lease_owner == delivery.owner:
                return current
            if current.status in NOT_RERUN or current.retries >= delivery.retries:
                return None  # finished meanwhile, or this retry is already running
        logger.info("task %s: the attempt before retry %d still holds the run; this retry is "
                    "sent again in 1s", run.task_id, delivery.retries)
        try:
            send_recorded(self.signature_from_request(self.request, countdown=1))
        except Exception:
            # The run stays recoverable: the sweep sends it once its lease expires.
            logger.warning("task %s: could not send retry %d again", run.task_id,
                           delivery.retries, exc_info=True)
        raise Ignore()

    def retry(self, args: Any = None, kwargs: Any = None, exc: Any = None, throw: bool = True,
              eta: Any = None, countdown: Any = None, max_retries: Any = None,
              **options: Any) -> Any:
        """Celery's ``retry``, continuing the same run.

        - A run whose replay diverged from its record, or that failed for good,
          is not retried (it would only fail again; ``autoretry_for`` would do
          it for any exception class it lists): that error is raised instead.
        - ``args``/``kwargs`` (pagination, a cursor) become the run's recorded
          arguments before the retry is sent, under this attempt's lease: the
          retry's delivery matches them, and any other delivery of the task id
          with the old arguments is refused as before.
        - With ``throw=False`` the attempt may return after asking for the
          retry; the run does not end then, and the retry replays the steps
          that completed.
        """
        ctx = current_run.get()
        mine = ctx is not None and ctx.celery_id == self.request.id and ctx.task is self
        if mine and ctx is not None and ctx.fatal is not None:
            raise ctx.fatal
        if mine and ctx is not None and (ctx.outage is not None
                                         or isinstance(exc, StoreUnavailable)):
            # A store outage (autoretry_for listing ConnectionError or StoreUnavailable,
            # or the task's own retry after one) spends none of the task's retries: the
            # attempt is handed over and sent again when the store answers.
            if ctx.outage is None:
                ctx.outage = exc
            raise ctx.outage
        new_arguments = mine and (args is not None or kwargs is not None)
        token = _retry_arguments.set(ctx if new_arguments else None)
        try:
            sent = super().retry(args=args, kwargs=kwargs, exc=exc, throw=throw, eta=eta,
                                 countdown=countdown, max_retries=max_retries, **options)
        finally:
            _retry_arguments.reset(token)
        if mine and ctx is not None and isinstance(sent, Retry):
            ctx.retry_sent = sent
        return sent

    def signature_from_request(self, request: Any = None, args: Any = None,
                               kwargs: Any = None, queue: Any = None,
                               **extra_options: Any) -> Any:
        """Celery's ``signature_from_request``; for a retry with new arguments, the
        arguments it will send are recorded as the run's before it is sent."""
        signature = super().signature_from_request(request, args, kwargs, queue,
                                                   **extra_options)
        ctx = _retry_arguments.get()
        if ctx is not None and "retries" in extra_options:
            _retry_arguments.set(None)
            blob, fingerprint = encode_arguments(
                tuple(signature.args or ()), dict(signature.kwargs or {}), ctx.serializer,
                task_id=ctx.task_id, task_name=self.name,
                serializer_name=ctx.serializer_name)
            if not ctx.store.update_arguments(ctx.task_id, ctx.owner, blob, fingerprint):
                raise LeaseLost(
                    f"task {ctx.task_id} ({self.name}) lost its lease before its retry with "
                    "new arguments could be recorded; the retry was not sent.",
                    task_id=ctx.task_id)
        return signature

    def _come_back_later(self, exc: StoreUnavailable, config: Config, *,
                         nothing_ran: bool = False, owner: str | None = None,
                         progress: bool = False) -> NoReturn:
        """The store is down before the run could start: send this delivery again later.

        Re-sending keeps the user's retry count untouched. The waits grow
        exponentially (1 s, 2 s, 4 s... up to a minute, with jitter), and the
        outage is waited out for at most ``duraflow_store_outage_timeout``,
        counted from the first delivery that found the store down (the time is
        carried in the re-sent message's headers); after that the task fails
        with StoreUnavailable. An eager call has no broker to come back
        through, so there the error is raised as it is. ``owner`` is the
        attempt that could not let go of the run: the re-sent delivery may take
        the run over from it (see :meth:`_not_ours`). An attempt that recorded
        something before the store failed (``progress``) starts the outage
        clock again; one that recorded nothing goes on counting, so a store
        error that comes back at the same place every time ends the task
        instead of running a body again and again.
        """
        request = self.request
        if nothing_ran:
            exc = StoreUnavailable(
                f"{exc.message} Nothing of task {request.id} ran in this attempt.",
                task_id=request.id, step_key=exc.step_key)
        if request.is_eager:
            if store_unavailable.receivers:
                store_unavailable.send(sender=self, task_id=request.id, exception=exc,
                                       giving_up=True)
            raise exc
        now = time.time()
        retries = int(request.retries or 0)
        outage = request.get(OUTAGE_HEADER)
        since, resends = now, 0
        if owner is None and isinstance(outage, dict) and isinstance(outage.get("owner"), str):
            owner = outage["owner"]  # the attempt that still holds the run, if none let go
        if isinstance(outage, dict) and outage.get("retries") == retries and not progress:
            try:
                since, resends = float(outage["since"]), int(outage["resends"])
            except (KeyError, TypeError, ValueError):
                since, resends = now, 0
        elapsed = max(0.0, now - since)
        left = config.store_outage_timeout - elapsed
        if store_unavailable.receivers:
            store_unavailable.send(sender=self, task_id=request.id, exception=exc,
                                   giving_up=left <= 0)
        if left <= 0:
            logger.error("task %s: the store has been unavailable for %.0fs (%d re-sends), "
                         "longer than duraflow_store_outage_timeout (%.0fs); the task fails",
                         request.id, elapsed, resends, config.store_outage_timeout)
            raise StoreUnavailable(
                f"{exc} The store stayed unavailable for {elapsed:.0f}s and {resends} re-sends "
                f"of task {request.id}, longer than duraflow_store_outage_timeout "
                f"({config.store_outage_timeout:.0f}s), so the task failed. Send it again "
                "once the database is back.",
                task_id=request.id) from exc
        delay = min(left, random.uniform(0.5, 1.0) * min(60.0, 2.0 ** resends))
        headers = {OUTAGE_HEADER: {"since": since, "resends": resends + 1, "retries": retries,
                                   "owner": owner}}
        try:
            self.signature_from_request(request, countdown=delay).apply_async(headers=headers)
        except Exception:
            logger.exception("task %s: the store is unavailable and re-sending the task failed",
                             request.id)
            raise exc from None
        logger.warning("task %s: the store is unavailable (%s); re-send %d in %.1fs, %.0fs "
                       "left of duraflow_store_outage_timeout", request.id, exc, resends + 1,
                       delay, left)
        raise Ignore() from exc

    def _release(self, store: Store, task_id: str, owner: str, *,
                 recover_after: float | None, interrupted: bool = False) -> bool:
        """Let go of the run; True if that was recorded. ``interrupted`` leaves the run
        marked so that the next attempt's first unfinished step is in doubt."""
        try:
            store.release_lease(task_id, owner, recover_after=recover_after,
                                interrupted=interrupted)
        except StoreUnavailable:
            # The lease simply expires and the sweep (or a redelivery) takes over; the
            # takeover marks the run interrupted.
            logger.warning("could not release the lease of task %s", task_id, exc_info=True)
            return False
        return True

    def _hand_over(self, ctx: RunContext, config: Config, exc: StoreUnavailable) -> NoReturn:
        """End an attempt the store failed in: let go of the run (left interrupted if a
        body ran unrecorded) and send the task again later, none of its retries spent."""
        if keeper().lost(ctx.task_id, ctx.owner):
            # The lease ran out while the store could not be reached and another attempt
            # has the run: sending it again would only be turned away.
            lost = LeaseLost(
                f"task {ctx.task_id} lost its lease while the store could not be reached: "
                "another attempt took the run over, so this attempt ends without sending it "
                "again" + ("; the step whose body ran unrecorded is in doubt for the new owner"
                           if ctx.unrecorded else "")
                + ". The run goes on under its new owner; nothing needs to be done.",
                task_id=ctx.task_id, step_key=exc.step_key)
            logger.warning("task %s: %s", ctx.task_id, lost)
            raise Ignore() from exc
        logger.warning("task %s (%s): the store failed during the attempt%s; handing the run "
                       "over", ctx.task_id, self.name,
                       "; a step body ran unrecorded and will be in doubt"
                       if ctx.unrecorded else "")
        released = self._release(ctx.store, ctx.task_id, ctx.owner,
                                 recover_after=config.lease_seconds,
                                 interrupted=ctx.left_in_doubt())
        self._come_back_later(exc, config, owner=None if released else ctx.owner,
                              progress=ctx.recorded_any)

    def _record_failure(self, ctx: RunContext, exc: BaseException) -> bool:
        """Record that the run failed for good; True if it was recorded."""
        try:
            ended = ctx.store.finish_run(ctx.task_id, ctx.owner, FAILED,
                                         error=stored_text(f"{type(exc).__qualname__}: {exc}"))
        except StoreUnavailable:
            logger.warning("could not record the failure of task %s", ctx.task_id, exc_info=True)
            return False
        if ended and run_finished.receivers:
            run_finished.send(sender=self, task_id=ctx.task_id, status=FAILED)
        return ended

    def _send_later(self, countdown: float) -> None:
        """Send this run again in ``countdown`` seconds (a short sleep or timeout)."""
        try:
            send_recorded(self.signature_from_request(self.request, countdown=countdown))
        except Exception:
            # The sweep wakes the run a lease after its time instead.
            logger.warning("task %s: could not send itself for %.1fs from now; the sweep will "
                           "wake it", self.request.id, countdown, exc_info=True)


def _next_call_is_celerys(cls: type) -> bool:
    """Whether the ``__call__`` that follows DurableTask's in ``cls``'s MRO is Celery's."""
    cached: bool | None = cls.__dict__.get("_duraflow_plain_call")
    if cached is None:
        mro = cls.__mro__
        following = mro[mro.index(DurableTask) + 1:]
        owner = next((klass for klass in following if "__call__" in klass.__dict__), Task)
        cached = owner is Task
        cls._duraflow_plain_call = cached  # type: ignore[attr-defined]
    return cached


def _seconds_until(when: Any) -> float:
    """A retry's countdown (seconds) or eta (datetime), as seconds from now."""
    if isinstance(when, datetime):
        moment = when if when.tzinfo else when.replace(tzinfo=UTC)
        return max(0.0, (moment - _clock.now()).total_seconds())
    try:
        return max(0.0, float(when or 0))
    except (TypeError, ValueError):
        return 0.0


# OpenTelemetry, when the otel extra is installed: on from the moment the library is imported.
install_telemetry()
