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
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import shared_task

from ._config import app_and_config, config_for_app
from ._serialization import decode
from ._store import RUNNING, RunRecord, store_for

logger = logging.getLogger("celery_duraflow.recovery")

RECOVER_TASK_NAME = "celery_duraflow.recover"


def _route(run: RunRecord) -> dict[str, Any]:
    if run.exchange and run.routing_key:
        return {"exchange": run.exchange, "routing_key": run.routing_key}
    if run.routing_key:
        # The default exchange routes by queue name.
        return {"queue": run.routing_key}
    return {}


def send_run(app: Any, run: RunRecord) -> None:
    """Publish a run's task again, with its task id, arguments, retry count and routing."""
    config = config_for_app(app)
    if run.args is None:
        raise ValueError(f"task {run.task_id} ({run.task_name}) has no recorded arguments")
    payload = decode(run.args, config.serializer, config.serializer,
                     task_id=run.task_id, step_key=None)
    app.send_task(run.task_name, args=payload.get("args", []),
                  kwargs=payload.get("kwargs", {}), task_id=run.task_id,
                  retries=run.retries, **_route(run))


def recover(app: Any = None, *, limit: int = 100) -> list[str]:
    """Wake or re-send up to ``limit`` runs that need it; return their task ids.

    Safe to call from several processes at once, and from a beat task.
    """
    app, config = app_and_config(app)
    store = store_for(config)
    sent: list[str] = []
    for run in store.recoverable_runs(limit):
        if run.args is None:
            logger.error("task %s (%s) needs sending but its arguments were not recorded (they "
                         "could not be serialized), so it cannot be sent", run.task_id,
                         run.task_name)
            continue
        if not store.mark_recovering(run, grace=config.lease_seconds):
            continue  # another sweeper got it
        send_run(app, run)
        if run.status == RUNNING:
            logger.warning("task %s (%s) had no live owner; sent it again (recovery %d)",
                           run.task_id, run.task_name, run.recoveries + 1)
        else:
            logger.info("task %s (%s) was %s for %s %r; woke it", run.task_id,
                        run.task_name, run.status, run.wait_kind, run.waiting_for)
        sent.append(run.task_id)
    return sent


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
    """A ``beat_schedule`` entry that runs the recovery sweep every ``every`` seconds::

        app.conf.beat_schedule = {"duraflow-recover": recovery_beat_entry()}
    """
    return {
        "task": RECOVER_TASK_NAME,
        "schedule": every,
        "kwargs": {"limit": limit},
        # A sweep that could not start in time is skipped; the next one does its work.
        "options": {"expires": every},
    }
