"""Steering runs from outside: cancel one, retry one."""

from __future__ import annotations

import logging
from typing import Any

from ._admin import request_cancel, reset_for_retry
from ._compensation import COMPENSATION_PREFIX
from ._config import app_and_config
from ._send import send_run
from ._store import FINISHED, RunRecord, store_for
from .errors import RunNotFound

logger = logging.getLogger("celery_duraflow.operations")


def cancel(task_id: str, *, app: Any = None) -> bool:
    """Ask run ``task_id`` to stop; False if it had already ended.

    A running run stops at its next step that has not completed (its worker
    learns of the cancellation when it renews its lease, within a third of
    ``duraflow_lease_seconds``); a sleeping or waiting run is sent at once and
    stops where it waits. Either way the compensations of its completed steps
    run, and it ends ``cancelled``. Raises :class:`~celery_duraflow.RunNotFound`
    for an unknown task id.
    """
    app, config = app_and_config(app)
    store = store_for(config)
    run, send = request_cancel(store, task_id, grace=config.lease_seconds)
    if run is None:
        raise RunNotFound(f"no run with task id {task_id} is recorded, so there is nothing to "
                          "cancel; check the id.", task_id=task_id)
    if run.status in FINISHED and run.unwinding is None:
        logger.info("task %s already ended (%s); nothing to cancel", task_id, run.status)
        return False
    if send:
        send_run(app, run)
    logger.info("task %s: cancellation requested", task_id)
    return True


def retry_run(task_id: str, *, from_step: str | None = None, app: Any = None) -> RunRecord:
    """Send an ended run again under the same task id; return its reset record.

    With ``from_step`` the recorded outcomes of that step and of everything
    after it are discarded first (in one transaction), so they run again.
    This is the one meaning of a retry, whichever surface asks for it (this
    function, ``celery duraflow retry``, the web view, the Django admin):

    * a failed, cancelled, ignored or rejected run is sent as it is (its
      completed steps replayed) or from ``from_step``;
    * a compensated run, and a succeeded one, only from ``from_step``: a
      compensated run's undone steps must run again, and a succeeded run
      replayed as recorded would change nothing;
    * a run that has not ended, or was replaced, is refused.

    The retry count (what ``max_retries`` is compared with) and the recovery
    count (``duraflow_max_recoveries``) start over, so the retried run has
    its full budget of both; the attempt count goes on, numbering every
    attempt the run ever had. Raises :class:`~celery_duraflow.RunNotFound`
    or :class:`~celery_duraflow.RunStateError`.
    """
    app, config = app_and_config(app)
    store = store_for(config)
    run = reset_for_retry(store, task_id, from_step=from_step, grace=config.lease_seconds,
                          compensation_prefix=COMPENSATION_PREFIX)
    send_run(app, run)
    logger.info("task %s sent again%s", task_id, f" from step {from_step!r}" if from_step else "")
    return run
