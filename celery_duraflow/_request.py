"""The worker-side request of a durable task: Celery's outcome becomes the run's.

Most attempts record their own end. Two cannot: an attempt killed by its hard time
limit, and one whose pool process died (``WorkerLostError``). Celery's worker, in its
main process, decides what became of those tasks; this request class records the same
decision in the store, so a run Celery reported as failed is never left ``running`` for
the recovery sweep to send again.
"""

from __future__ import annotations

import logging
from typing import Any

from billiard.exceptions import WorkerLostError
from celery.exceptions import Terminated
from celery.worker import state
from celery.worker.request import Request

from ._config import config_for_app
from ._send import wake_parent
from ._store import FAILED, store_for

logger = logging.getLogger("celery_duraflow.task")


class DurableRequest(Request):  # type: ignore[misc]
    """Celery's ``Request``, which also ends the run of an attempt Celery gave up on."""

    # Set when Celery keeps the task alive after a failure: the message was put back
    # (reject_on_worker_lost) or a retry was sent (retry_on_worker_lost).
    _duraflow_kept = False

    def reject(self, requeue: bool = False) -> Any:
        if requeue:
            self._duraflow_kept = True
        return super().reject(requeue=requeue)

    def _retry_worker_lost(self, exc: Any, exc_info: Any) -> Any:
        sent = super()._retry_worker_lost(exc, exc_info)
        if sent:
            self._duraflow_kept = True
        return sent

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        outcome = super().on_timeout(soft, timeout)
        if not soft and not state.should_terminate:
            self._end_run(f"TimeLimitExceeded: the hard time limit ({timeout}s) was exceeded "
                          "and the worker killed the attempt")
        return outcome

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> Any:
        exc = exc_info.exception
        exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback
        outcome = super().on_failure(exc_info, send_failed_event=send_failed_event,
                                     return_ok=return_ok)
        if state.should_terminate or self._duraflow_kept:
            return outcome  # a cold shutdown, or Celery delivers the task again
        if isinstance(exc, Terminated):
            if not self._already_cancelled:
                self._end_run(f"Terminated: the task was revoked and its process terminated "
                              f"({exc})")
        elif isinstance(exc, WorkerLostError) or (
                isinstance(exc, SystemExit | KeyboardInterrupt)
                and not (self._already_cancelled or self._already_revoked)):
            self._end_run(f"WorkerLostError: the worker process running the attempt was lost "
                          f"({exc}), and Celery does not deliver the task again")
        return outcome

    def _end_run(self, error: str) -> None:
        task = self.task
        if task.name.startswith("celery."):
            return
        try:
            store = store_for(config_for_app(task.app))
            ended = store.end_lost_attempt(self.id, pid=self.worker_pid, status=FAILED,
                                           error=error)
        except Exception:
            # The run's lease expires, and the sweep sends it again (up to
            # duraflow_max_recoveries times).
            logger.warning("task %s: could not record that Celery ended it (%s)", self.id,
                           error, exc_info=True)
            return
        if ended:
            logger.error("task %s (%s) failed: %s", self.id, task.name, error)
            run = store.get_run(self.id)
            if run is not None:
                try:
                    wake_parent(task.app, run)
                except Exception:
                    logger.warning("task %s: could not wake its parent", self.id,
                                   exc_info=True)
