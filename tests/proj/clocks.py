"""A task whose one step runs long, for the workers whose clocks disagree.

Its body adds a ``charge`` row to ``<prefix>wait_events`` when it starts, so the
test can count how often it really ran, then works for ``seconds``.
"""

from __future__ import annotations

import time

from celery_duraflow import DurableTask, step

from .app import app
from .waits import record


@app.task(base=DurableTask, bind=True, name="proj.slow_charge")
def slow_charge(self: DurableTask, seconds: float) -> str:
    """Charge once, in a step that takes ``seconds``."""
    with step("charge"):
        record(self.request.id, "charge")
        time.sleep(seconds)
    return "charged"
