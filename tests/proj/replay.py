"""A task whose code the replay-check tests change between the worker and the check.

``PROJ_REPLAY_VARIANT`` picks the code this process has: ``recorded`` (the default,
what the worker ran), ``renamed`` (the first step has another name), ``inserted`` (a
step added before the run's wait) or ``after`` (only code after the wait changed).
"""

from __future__ import annotations

import os

from celery_duraflow import DurableTask, sleep, step, wait_for_signal

from .app import app

VARIANT = os.environ.get("PROJ_REPLAY_VARIANT", "recorded")


@app.task(base=DurableTask, name="proj.replay_order")
def replay_order(order: str, mode: str) -> str:
    """Reserve and charge, then wait for approval (or sleep a day), then ship."""
    with step("hold-stock" if VARIANT == "renamed" else "reserve-stock") as s:
        s.result = f"reserved {order}"
    if VARIANT == "inserted":
        with step("fraud-check") as s:
            s.result = "clean"
    with step("charge") as s:
        s.result = f"charged {order}"
    if mode == "wait":
        wait_for_signal("approval", timeout=86400)
    else:
        sleep("cool-off", 86400)
    with step("ship-by-courier" if VARIANT == "after" else "ship") as s:
        s.result = f"shipped {order}"
    return str(s.result)
