"""Messages the library sends for a run it has already recorded say so, and their start
skips the first delivery's insert.

A message that looks like a run's first delivery starts with a plain insert of the run's
row (one statement) on PostgreSQL. A child run, a re-sent run and a run woken from a wait
already have their row, so the library marks their messages and their start takes the
run at once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from celery import Celery

from celery_duraflow import DurableTask, child, get_run, step
from celery_duraflow._config import config_for_app
from celery_duraflow._send import is_recorded, send_run
from celery_duraflow._store import store_for
from celery_duraflow.signals import attempt_started
from tests.test_store import count_round_trips

RESULT_TIMEOUT = 30.0


def test_a_run_sent_again_starts_in_one_round_trip(make_app: Callable[..., Celery]) -> None:
    """A run the library sends again (here, a succeeded one, in an eager app) starts with
    one statement: its message is marked as recorded, so no first-delivery insert."""
    app = make_app()
    bodies: list[int] = []

    @app.task(base=DurableTask)
    def task() -> int:
        with step("s"):
            bodies.append(1)
        return 7

    task_id = str(uuid.uuid4())
    assert task.apply(task_id=task_id).get() == 7
    run = store_for(config_for_app(app)).get_run(task_id)
    assert run is not None
    with count_round_trips(store_for(config_for_app(app))) as round_trips:
        send_run(app, run)
    assert round_trips[0] == 1
    assert bodies == [1]


def test_a_child_and_its_woken_parent_arrive_marked_as_recorded(
        make_app: Callable[..., Celery]) -> None:
    """On a real worker, a child run's message and the message that wakes its parent
    carry the recorded header to the task's request; the parent's first message does
    not, nor is a plain first delivery taken for a recorded one."""
    from tests.conftest import run_worker

    app = make_app(eager=False)
    seen: list[tuple[str, int, bool]] = []

    def on_attempt(sender: Any = None, task_id: str = "", attempt: int = 0,
                   **_: Any) -> None:
        seen.append((sender.name.rsplit(".", 1)[-1], attempt, is_recorded(sender.request)))

    parents: list[str] = []

    @app.task(base=DurableTask)
    def kid(n: int) -> int:
        # The parent waits before the child ends, so that the child's end wakes it (a child
        # that ends first is seen by the parent's suspension, and there is no wake-up).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            waiting = get_run(parents[0], app=app) if parents else None
            if waiting is not None and waiting.status == "waiting":
                break
            time.sleep(0.02)
        with step("work") as s:
            s.result = n * 2
        return int(s.result)

    @app.task(base=DurableTask, bind=True)
    def parent(self: Any, n: int) -> int:
        parents.append(self.request.id)
        return int(child("kid", kid.s(n))) + 1

    attempt_started.connect(on_attempt)
    try:
        with run_worker(app, pool="threads", concurrency=2):
            result = parent.delay(20)
            assert result.get(timeout=RESULT_TIMEOUT) == 41
    finally:
        attempt_started.disconnect(on_attempt)
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded"
    assert sorted(seen) == [("kid", 1, True), ("parent", 1, False), ("parent", 2, True)]
