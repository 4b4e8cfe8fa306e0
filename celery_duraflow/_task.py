"""``DurableTask``: the Celery task base class that gives a run its memory."""

from __future__ import annotations

import inspect
import logging
import random
import time
import types
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from ._compensation import unwind
from ._config import Config, config_for_app
from ._context import RunContext, Suspended, Unwind, current_run, describe
from ._lease import keeper, new_owner, owner_is_gone
from ._limits import check_task_id
from ._rewrite import code_fingerprint, prepare, refuse_async
from ._serialization import (
    Serializer,
    decode,
    encode_arguments,
    find_unstorable,
    get_serializer,
)
from ._signals import install_signal_handlers
from ._store import FAILED, SUCCEEDED, Delivery, RunRecord, StepRecord, Store, store_for
from ._waits import wake_parent
from .errors import (
    LeaseLost,
    RunArgumentsMismatch,
    RunCancelled,
    StepOutputNotSerializable,
    StoreUnavailable,
    UnsupportedCode,
)

logger = logging.getLogger("celery_duraflow.task")

# The message header that carries a store outage from one re-send to the next.
OUTAGE_HEADER = "duraflow_outage"
# How many leases after a retry was due the sweep waits before re-sending it.
RETRY_GRACE_LEASES = 10


class DurableTask(Task):  # type: ignore[misc]
    """Base class for Celery tasks whose steps survive retries.

    Use it as ``@app.task(base=DurableTask)`` (with or without ``bind=True``)
    or subclass it and define ``run``. The Celery task id identifies the run;
    Celery keeps it across ``retry()``, autoretry and redelivery, so every
    attempt of a run finds the steps its predecessors recorded.

    ``run`` is prepared when the class is created, so ``with step(...)``
    blocks directly in it can be skipped on a replay.
    """

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
        if run is not None:
            # Fingerprint the code now, where the task is defined, rather than in the
            # first attempt of some worker thread (the result is cached per code object).
            code_fingerprint(cls.run)
        install_signal_handlers()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        task_id = self.request.id
        if task_id is None:
            # Called like a function (task(...)): no id, so no run of its own. Inside a
            # durable run its steps join that run, like a @durable helper's would.
            return super().__call__(*args, **kwargs)
        check_task_id(task_id)  # before anything is recorded or run

        config = config_for_app(self._get_app())
        store = store_for(config)
        serializer = get_serializer(config.serializer)
        outer = current_run.get()
        # An eager retry nested in its caller's attempt continues under the caller's lease.
        owner = outer.owner if outer is not None and outer.task_id == task_id else new_owner()
        delivery = self._delivery(owner, args, kwargs, serializer, config.serializer)
        # Every statement of this attempt goes to one connection, kept until it ends.
        with store.held_connection():
            try:
                run, recorded = store.begin_attempt(task_id, delivery)
            except StoreUnavailable as exc:
                self._come_back_later(exc, config)
            if run.lease_owner != owner:
                taken = self._not_ours(store, config, run, delivery)
                if taken is None:
                    return decode(run.result, run.serializer, config.serializer,
                                  accept=config.accept_serializers, task_id=task_id,
                                  step_key=None, what="result")
                run, recorded = taken, None

            keeper().hold(store, task_id, owner)
            try:
                return self._attempt(store, config, serializer, run, recorded, owner, args,
                                     kwargs)
            finally:
                keeper().release(store, task_id, owner)

    def _attempt(self, store: Store, config: Config, serializer: Serializer, run: RunRecord,
                 recorded: dict[str, StepRecord] | None, owner: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        task_id = run.task_id
        if recorded is None:
            try:
                recorded = store.load_steps(task_id)
            except StoreUnavailable as exc:
                self._release(store, task_id, owner, recover_after=config.lease_seconds)
                self._come_back_later(exc, config)
        ctx = RunContext(task_id=task_id, task_name=self.name, owner=owner, store=store,
                         serializer=serializer, serializer_name=config.serializer,
                         recorded=recorded, interrupted=run.interrupted, task=self,
                         config=config, unwinding=run.unwinding)
        token = current_run.set(ctx)
        try:
            result = super().__call__(*args, **kwargs)
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
                          + RETRY_GRACE_LEASES * config.lease_seconds)
            raise
        except Reject as exc:
            self._release(store, task_id, owner,
                          recover_after=config.lease_seconds if exc.requeue else None)
            raise
        except Ignore:
            # The task chose to stop here (Task.replace, say): nothing to resume.
            self._release(store, task_id, owner, recover_after=None)
            raise
        except LeaseLost as exc:
            logger.warning("task %s: %s", task_id, exc)
            raise Ignore() from exc
        except BaseException as exc:
            logger.warning("task %s (%s) failed for good%s: %s", task_id, self.name,
                           f" at step {ctx.failed_step!r}" if ctx.failed_step else "",
                           type(exc).__qualname__)
            if isinstance(exc, Exception) and ctx.compensations:
                # Failed for good, with completed steps to undo.
                status = unwind(ctx, run, "failure", f"{type(exc).__qualname__}: {exc}"[:4000])
                wake_parent(self._get_app(), replace(run, status=status))
            elif self._record_failure(ctx, exc):
                wake_parent(self._get_app(), run)
            raise
        finally:
            current_run.reset(token)

        try:
            data = serializer.dumps(result)
        except Exception as error:
            found = find_unstorable(result, serializer, root="result")
            what = (f"{describe(result)}, in which {found[0]} is {found[1]}" if found
                    else describe(result))
            refused = StepOutputNotSerializable(
                f"task {task_id} ({self.name}) returned {what}, which the "
                f"{config.serializer!r} serializer cannot store ({error}). Return plain data, or "
                "configure duraflow_serializer.",
                task_id=task_id,
            )
            if self._record_failure(ctx, refused):
                wake_parent(self._get_app(), run)
            raise refused from error
        if store.finish_run(task_id, owner, SUCCEEDED, result=data,
                            serializer=config.serializer):
            wake_parent(self._get_app(), run)
        else:
            logger.warning("task %s finished, but another attempt owns the run now; its "
                           "result was not recorded", task_id)
        return result

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
                        retries=int(request.retries or 0),
                        code_fingerprint=code_fingerprint(self.run))

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
        # A live attempt owns the run (a duplicate delivery): leave the run to it. If
        # that owner dies, its lease expires and the run is delivered again.
        logger.info("task %s is being run by %s; this duplicate delivery leaves it alone",
                    task_id, run.lease_owner)
        raise Ignore()

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``, except for a run whose replay diverged from its record.

        Retrying such a run would only diverge again (and ``autoretry_for``
        would do it for any exception class it lists), so the divergence is
        raised instead and the run fails.
        """
        ctx = current_run.get()
        if ctx is not None and ctx.task_id == self.request.id and ctx.fatal is not None:
            raise ctx.fatal
        return super().retry(*args, **kwargs)

    def _come_back_later(self, exc: StoreUnavailable, config: Config) -> NoReturn:
        """The store is down before the run could start: send this delivery again later.

        Re-sending keeps the user's retry count untouched. The waits grow
        exponentially (1 s, 2 s, 4 s... up to a minute, with jitter), and the
        outage is waited out for at most ``duraflow_store_outage_timeout``,
        counted from the first delivery that found the store down (the time is
        carried in the re-sent message's headers); after that the task fails
        with StoreUnavailable. An eager call has no broker to come back
        through, so there the error is raised as it is.
        """
        request = self.request
        if request.is_eager:
            raise exc
        now = time.time()
        retries = int(request.retries or 0)
        outage = request.get(OUTAGE_HEADER)
        since, resends = now, 0
        if isinstance(outage, dict) and outage.get("retries") == retries:
            try:
                since, resends = float(outage["since"]), int(outage["resends"])
            except (KeyError, TypeError, ValueError):
                since, resends = now, 0
        elapsed = max(0.0, now - since)
        left = config.store_outage_timeout - elapsed
        if left <= 0:
            logger.error("task %s: the store has been unavailable for %.0fs (%d re-sends), "
                         "longer than duraflow_store_outage_timeout (%.0fs); the task fails",
                         request.id, elapsed, resends, config.store_outage_timeout)
            raise StoreUnavailable(
                f"{exc} The store stayed unavailable for {elapsed:.0f}s and {resends} re-sends "
                f"of task {request.id}, longer than duraflow_store_outage_timeout "
                f"({config.store_outage_timeout:.0f}s), so the task failed; nothing of it ran. "
                "Send it again once the database is back.",
                task_id=request.id) from exc
        delay = min(left, random.uniform(0.5, 1.0) * min(60.0, 2.0 ** resends))
        headers = {OUTAGE_HEADER: {"since": since, "resends": resends + 1, "retries": retries}}
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
                 recover_after: float | None) -> None:
        try:
            store.release_lease(task_id, owner, recover_after=recover_after)
        except StoreUnavailable:
            # The lease simply expires and the sweep (or a redelivery) takes over.
            logger.warning("could not release the lease of task %s", task_id, exc_info=True)

    def _record_failure(self, ctx: RunContext, exc: BaseException) -> bool:
        """Record that the run failed for good; True if it was recorded."""
        try:
            return ctx.store.finish_run(ctx.task_id, ctx.owner, FAILED,
                                        error=f"{type(exc).__qualname__}: {exc}"[:4000])
        except StoreUnavailable:
            logger.warning("could not record the failure of task %s", ctx.task_id, exc_info=True)
            return False

    def _send_later(self, countdown: float) -> None:
        """Send this run again in ``countdown`` seconds (a short sleep or timeout)."""
        try:
            self.signature_from_request(self.request, countdown=countdown).apply_async()
        except Exception:
            # The sweep wakes the run a lease after its time instead.
            logger.warning("task %s: could not send itself for %.1fs from now; the sweep will "
                           "wake it", self.request.id, countdown, exc_info=True)


def _seconds_until(when: Any) -> float:
    """A retry's countdown (seconds) or eta (datetime), as seconds from now."""
    if isinstance(when, datetime):
        moment = when if when.tzinfo else when.replace(tzinfo=UTC)
        return max(0.0, (moment - datetime.now(UTC)).total_seconds())
    try:
        return max(0.0, float(when or 0))
    except (TypeError, ValueError):
        return 0.0
