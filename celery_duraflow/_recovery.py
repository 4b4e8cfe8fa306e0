"""The sweep: send runs that need a delivery back to the broker.

It wakes sleeping and waiting runs whose time is up (and waiting runs whose
signal or child end arrived without waking them), and recovers lost runs.

A run is lost when its attempt's process died (SIGKILL, OOM, a machine gone)
without the broker delivering its message again, or when a retry Celery
scheduled never arrived. Either way its row says ``running`` and its lease has
expired. The sweep finds such rows and publishes the task again with the same
task id, arguments, retry count and routing; the new delivery takes the lease
and resumes the run, skipping every completed step.

Several sweepers may run at once: each run is claimed for recovery with a
conditional update on its lease expiry, so only one of them re-sends it, and
the lease it sets gives the new delivery time to arrive before another sweep.

Due runs (an expired lease, a sleep or a timeout that is up) are read through
the lease index on every pass, so a pass costs the same however many runs wait.
A stored signal wakes its run in the transaction that stores it, and a child's
end that races with its parent's suspension is seen by one side or the other
(``Store.suspend``): neither needs a look. One case is due by no time: a child
whose end was recorded while the worker ending it died before waking its parent.
Finding one means looking at every run that waits for a child, so a sweep looks
on its first pass in a process and then at most every :data:`PARENTS_EVERY`
seconds: such a parent is woken within about that long, as a dead worker's own
runs are within their lease. The first pass also looks at every waiting run for
a signal that an older version stored without waking it.

A run the sweep cannot send (its arguments were not recorded or cannot be
decoded, or its task name is not registered in the sweep's app) would
otherwise be found again by every sweep, first in line, and a page of them
would keep every other run from being sent. Such a run is marked failed the
first time it is met, with the reason in its error, and the sweep goes on
with the next runs in the same pass. The sweep must therefore run with the
workers' app (``celery -A proj``), whose task modules it imports first.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Container
from dataclasses import dataclass, field, replace
from typing import Any

from celery import shared_task

from ._config import Config, app_and_config, config_for_app
from ._flow import send_woken
from ._send import recorded_arguments, send_run, wake_parent
from ._store import FAILED, RUNNING, RunRecord, store_for
from .signals import run_recovered

logger = logging.getLogger("celery_duraflow.recovery")

RECOVER_TASK_NAME = "celery_duraflow.recover"


@dataclass(frozen=True)
class SweepResult:
    """What one sweep did: the runs it sent, and those it failed because it cannot send them."""

    sent: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


# The stores whose sweep in this process has looked at every waiting run once.
_arrivals_checked: weakref.WeakSet[Any] = weakref.WeakSet()


def _arrivals_due(store: Any) -> bool:
    """True on the first sweep of ``store`` in this process: it also looks at every waiting
    run for a signal stored without waking it (as versions before 14 could leave one)."""
    if store in _arrivals_checked:
        return False
    _arrivals_checked.add(store)
    return True


#: Seconds between two looks, by a sweep in one process, at every run that waits for a
#: child: for a parent whose child ended while the worker ending it died before waking
#: it. The first pass in a process takes one. Every other way a child's end reaches its
#: parent needs no look (see ``Store.suspend``); this one costs what the waiting parents
#: cost, so it is not taken on every pass.
PARENTS_EVERY = 60.0

# When each store's sweep in this process last looked at the waiting parents.
_parents_looked: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def _parents_due(store: Any) -> bool:
    """True on the first sweep of ``store`` in this process, and then once
    :data:`PARENTS_EVERY` seconds have passed since the last look at waiting parents."""
    now = time.monotonic()
    last = _parents_looked.get(store)
    if last is not None and now - last < PARENTS_EVERY:
        return False
    _parents_looked[store] = now
    return True


# Apps whose task modules a sweep in this process has imported.
_imported: weakref.WeakSet[Any] = weakref.WeakSet()


def _registered(app: Any) -> Container[str] | None:
    """The task names ``app`` knows, once its task modules are imported; None if unknown.

    A sweep started from the command line has only imported the app's module,
    so the modules a worker imports at start (``include``, ``imports``, the
    autodiscovered ones) are imported here too. If that fails, no run is
    judged by its task name.
    """
    if app not in _imported:
        try:
            app.loader.import_default_modules()
        except Exception:
            logger.exception("the recovery sweep could not import the task modules of app %s, "
                             "so it sends runs without checking that their task is known",
                             app.main)
            return None
        _imported.add(app)
    return app.tasks  # type: ignore[no-any-return]


def _unsendable(run: RunRecord, config: Config,
                registered: Container[str] | None) -> str | None:
    """Why the sweep cannot send ``run`` (stored as its error), or None if it can."""
    advice = ("The run was marked failed, since no sweep can ever send it; send the work "
              "again under a new task id.")
    if (run.status == RUNNING and run.lease_owner is not None
            and run.recoveries >= config.max_recoveries):
        return (f"the recovery sweep has sent task {run.task_id} ({run.task_name}) again "
                f"{run.recoveries} times after its attempt was lost (a worker that died or was "
                "killed mid-attempt), and "
                f"duraflow_max_recoveries is {config.max_recoveries}. The run was marked "
                "failed rather than sent again, since the same thing would likely happen; "
                "find why its attempts die (memory, a time limit, a crash), then run "
                "`retry` on it, or raise duraflow_max_recoveries.")
    if registered is not None and run.task_name not in registered:
        return (f"the recovery sweep cannot send task {run.task_id}: its task "
                f"{run.task_name!r} is not registered in the sweep's Celery app (renamed or "
                f"removed?). Run the sweep with the workers' app. {advice}")
    if run.args is None:
        return (f"the recovery sweep cannot send task {run.task_id} ({run.task_name}): its "
                f"arguments were not recorded (they could not be serialized). {advice}")
    try:
        recorded_arguments(run, config)
    except Exception as exc:
        return (f"the recovery sweep cannot send task {run.task_id} ({run.task_name}): its "
                f"recorded arguments cannot be decoded ({type(exc).__name__}: {exc}). {advice}")
    return None


def _fail(app: Any, run: RunRecord, reason: str) -> bool:
    """Mark a run the sweep cannot send failed, and wake a parent that waits for it."""
    store = store_for(config_for_app(app))
    if not store.fail_unsendable(run, reason):
        return False  # a delivery or another sweeper got to it first
    logger.error("%s (It was %s.)", reason, run.status)
    try:
        wake_parent(app, replace(run, status=FAILED))
    except Exception:
        # The parent's wait for a finished child is found by the next sweep.
        logger.warning("task %s: could not wake the parent %s", run.task_id, run.parent_id,
                       exc_info=True)
    return True


def sweep(app: Any = None, *, limit: int = 100) -> SweepResult:
    """Wake or re-send up to ``limit`` runs that need it, failing those it cannot send.

    Runs are taken oldest expiry first. A run that cannot be sent (no
    recorded arguments, arguments that cannot be decoded, a task name the app
    does not know) is marked failed with the reason in its error, does not
    count against ``limit``, and the sweep reads on until it has sent
    ``limit`` runs or none is left.
    """
    app, config = app_and_config(app)
    store = store_for(config)
    registered = _registered(app)
    result = SweepResult()
    seen: set[str] = set()
    arrivals = _arrivals_due(store)
    parents = _parents_due(store)
    # Slots whose holders died: handed to the runs queued for them.
    for run in store.settle_queues(grace=config.lease_seconds, limit=limit):
        send_woken(app, [run])
        result.sent.append(run.task_id)
    while len(result.sent) < limit:
        found = store.recoverable_runs(limit, arrivals=arrivals, parents=parents)
        fresh = [run for run in found if run.task_id not in seen]
        for run in fresh:
            if len(result.sent) >= limit:
                break
            seen.add(run.task_id)
            reason = _unsendable(run, config, registered)
            if reason is not None:
                if _fail(app, run, reason):
                    result.failed.append(run.task_id)
                continue
            claimed = store.claim_to_send(run, grace=config.lease_seconds)
            if claimed is None:
                continue  # another sweeper got it
            send_run(app, claimed)
            if run_recovered.receivers:
                run_recovered.send(sender=app, task_id=run.task_id, task_name=run.task_name,
                                   status=run.status)
            if run.status == RUNNING:
                logger.warning("task %s (%s) had no live owner; sent it again (recovery %d)",
                               run.task_id, run.task_name, run.recoveries + 1)
            else:
                logger.info("task %s (%s) was %s for %s %r; woke it", run.task_id,
                            run.task_name, run.status, run.wait_kind, run.waiting_for)
            result.sent.append(run.task_id)
        if len(found) < limit or not fresh:
            break  # every run that needs it has been seen
    return result


def recover(app: Any = None, *, limit: int = 100) -> list[str]:
    """Wake or re-send up to ``limit`` runs that need it; return their task ids.

    Runs that cannot be sent (no recorded or decodable arguments, a task the
    app does not register, more than ``duraflow_max_recoveries`` recoveries)
    are marked failed on the way, with the reason as their error.
    Safe to call from several processes at once, and from a beat task.
    """
    return sweep(app, limit=limit).sent


def recover_forever(app: Any = None, *, interval: float = 10.0, limit: int = 100,
                    iterations: int | None = None) -> int:
    """Sweep every ``interval`` seconds; return how many runs were re-sent."""
    total = 0
    done = 0
    while iterations is None or done < iterations:
        try:
            total += len(recover(app, limit=limit))
        except Exception:
            # A database or broker outage must not end the loop.
            logger.exception("recovery sweep failed; trying again in %.1fs", interval)
        done += 1
        if iterations is None or done < iterations:
            time.sleep(interval)
    return total


@shared_task(name=RECOVER_TASK_NAME, bind=True, ignore_result=True)  # type: ignore[untyped-decorator]
def recover_task(self: Any, limit: int = 100) -> int:
    """The beat-schedulable form of :func:`recover`."""
    return len(recover(self.app, limit=limit))


def recovery_beat_entry(every: float = 30.0, *, limit: int = 100) -> dict[str, Any]:
    """A ``beat_schedule`` entry that runs the recovery sweep every ``every`` seconds.

    For example::

        app.conf.beat_schedule = {"duraflow-recover": recovery_beat_entry()}
    """
    return {
        "task": RECOVER_TASK_NAME,
        "schedule": every,
        "kwargs": {"limit": limit},
        # A sweep that could not start in time is skipped; the next one does its work.
        "options": {"expires": every},
    }
