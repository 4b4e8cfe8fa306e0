"""A parent that fans out to child runs and joins them, instrumented for fault tests.

The bodies of the children's step and of the parent's step after the join append
``start`` and ``end`` events to the chaos event log (see :mod:`.chaos`), and each
delivery of either task a ``deliver`` event, so a test can tell whether a body ever
ran twice, and how often the parent was delivered.
"""

from __future__ import annotations

import random
import time
from typing import Any

from sqlalchemy.exc import OperationalError

from celery_duraflow import DurableTask, StoreUnavailable, children, step

from .app import app
from .chaos import log_event


def _delivered(task: Any) -> None:
    log_event("deliver", task.request.id, task.request.retries,
              int(bool((task.request.delivery_info or {}).get("redelivered"))))


@app.task(base=DurableTask, bind=True, name="proj.fanout_child",
          autoretry_for=(StoreUnavailable, OperationalError), max_retries=50,
          retry_backoff=False, default_retry_delay=0.2)
def fanout_child(self: Any, n: int, index: int) -> int:
    """One step that logs its body; returns ``n * 10,000 + index``."""
    _delivered(self)
    with step("work") as s:
        log_event("start", self.request.id, "work", int(s.in_doubt))
        outcome = "error"
        try:
            time.sleep(random.uniform(0.002, 0.02))
            s.result = n * 10_000 + index
            outcome = "ok"
        finally:
            log_event("end", self.request.id, "work", outcome)
    return int(s.result)


@app.task(base=DurableTask, bind=True, name="proj.fanout_parent",
          autoretry_for=(StoreUnavailable, OperationalError), max_retries=50,
          retry_backoff=False, default_retry_delay=0.2)
def fanout_parent(self: Any, n: int, count: int) -> int:
    """Fan out to ``count`` children, join them, and add their results in one step."""
    _delivered(self)
    results = children("fan", [fanout_child.s(n, index) for index in range(count)])
    with step("total") as s:
        log_event("start", self.request.id, "total", int(s.in_doubt))
        s.result = sum(results)
        log_event("end", self.request.id, "total", "ok")
    return int(s.result)
