"""Flow-limited tasks, with a ledger of what each worker process really did.

The ledger is a plain file (``PROJ_FLOW_LOG``), kept outside the store: every
line is ``<time.time()> <pid> <kind> <task id> <detail>``, appended with
``O_APPEND`` so lines of many processes never interleave. Kinds:

* ``start`` / ``end``: a body (the step of a run that does the work) began or
  finished; the detail is the run's key. A process killed mid-body has no
  ``end`` line: the test knows when it killed which pid.
* ``prerun`` / ``postrun``: an attempt of a flow task began or ended in a worker
  process (Celery's ``task_prerun`` and ``task_postrun`` signals), whatever it
  did: ran its body, or found its run queued for a slot or over a rate and
  ended without running it. The detail of ``postrun`` is Celery's state.

From the file a test can tell how many bodies of one key ran at once, how many
started in any window, and how long an attempt that did not run its body held
its worker process.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery.signals import task_postrun, task_prerun

from celery_duraflow import Concurrency, DurableTask, RateLimit, step

from .app import app

FLOW_LOG = os.environ.get("PROJ_FLOW_LOG")
#: How many runs of one key run their bodies at once (proj.flow_limited).
LIMIT = 2
#: The longest a body waits for its hold file to go (a test that forgot to remove it).
HOLD_LIMIT = 120.0


def log_flow(kind: str, task_id: object, detail: object) -> None:
    """Append one line ``<time> <pid> <kind> <task id> <detail>`` to the flow ledger."""
    if not FLOW_LOG:
        return
    line = f"{time.time():.6f} {os.getpid()} {kind} {task_id} {detail}\n"
    fd = os.open(FLOW_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _is_flow_task(sender: Any) -> bool:
    return str(getattr(sender, "name", "")).startswith("proj.flow_")


@task_prerun.connect
def _attempt_begins(sender: Any = None, task_id: str | None = None, **_kwargs: Any) -> None:
    if _is_flow_task(sender):
        log_flow("prerun", task_id, "-")


@task_postrun.connect
def _attempt_ends(sender: Any = None, task_id: str | None = None, state: str | None = None,
                  **_kwargs: Any) -> None:
    if _is_flow_task(sender):
        log_flow("postrun", task_id, state or "-")


def _body(task_id: str, key: str, seconds: float, hold: str | None) -> None:
    """The work: logged from its first to its last line; waits while ``hold`` exists."""
    log_flow("start", task_id, key)
    if hold:
        deadline = time.monotonic() + HOLD_LIMIT
        while os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.02)
    time.sleep(seconds)
    log_flow("end", task_id, key)


@app.task(base=DurableTask, bind=True, name="proj.flow_limited",
          duraflow_limits=[Concurrency(LIMIT, key="key")])
def flow_limited(self: Any, key: str, n: int, seconds: float, hold: str | None = None) -> str:
    """At most LIMIT bodies per key at once; returns ``key:n``.

    A ``hold`` path keeps the body going while that file exists (then ``seconds``
    more): a test holds the key's slots with it, and kills the holders.
    """
    with step("work") as s:
        _body(self.request.id, key, seconds, hold)
        s.result = f"{key}:{n}"
    return str(s.result)


@app.task(base=DurableTask, bind=True, name="proj.flow_rated_short",
          duraflow_limits=[RateLimit(10, per=2.0)])
def flow_rated_short(self: Any, n: int, seconds: float = 0.01) -> int:
    """At most 10 body starts in any 2 s, across every worker; returns ``n``."""
    with step("call") as s:
        _body(self.request.id, "api", seconds, None)
        s.result = n
    return int(s.result)


@app.task(base=DurableTask, bind=True, name="proj.flow_rated_long",
          duraflow_limits=[RateLimit(50, per=10.0)])
def flow_rated_long(self: Any, n: int, seconds: float = 0.01) -> int:
    """At most 50 body starts in any 10 s, across every worker; returns ``n``."""
    with step("call") as s:
        _body(self.request.id, "api", seconds, None)
        s.result = n
    return int(s.result)
