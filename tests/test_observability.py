"""What a run tells the outside world: per-step Celery signals and log lines."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_duraflow import DurableTask, step
from celery_duraflow.signals import (
    run_unwound,
    step_failed,
    step_replayed,
    step_started,
    step_succeeded,
)

SECRET = "PNR-SECRET-4242"


def test_signals_and_logs_of_a_run_with_a_retry_and_a_failure(
        make_app: Callable[..., Celery], caplog: pytest.LogCaptureFixture) -> None:
    """Step signals fire in order through retries, failure and undo; outputs log at DEBUG only."""
    app = make_app()
    seen: list[tuple[str, str, Any]] = []

    def receiver(name: str, detail: str | None = None) -> Callable[..., None]:
        def receive(sender: Any, task_id: str, **kwargs: Any) -> None:
            key = kwargs.get("step_key") or kwargs.get("reason")
            seen.append((name, str(key), kwargs.get(detail) if detail else None))
        return receive

    receivers = [(step_started, receiver("started", "attempt")),
                 (step_succeeded, receiver("succeeded", "attempt")),
                 (step_failed, receiver("failed", "attempt")),
                 (step_replayed, receiver("replayed")),
                 (run_unwound, receiver("unwound", "status"))]
    for signal, fn in receivers:
        signal.connect(fn, weak=False)
    attempts: list[int] = []

    @app.task(base=DurableTask, bind=True, max_retries=1, default_retry_delay=0)
    def trip(self: DurableTask) -> None:
        with step("book", compensate=lambda booking: None) as s:
            s.result = SECRET
        with step("notify"):
            attempts.append(1)
            if len(attempts) == 1:
                raise self.retry(exc=ConnectionError("mail down"))
            raise ValueError("no such user")

    try:
        with caplog.at_level(logging.DEBUG, logger="celery_duraflow"):
            result = trip.apply()
    finally:
        for signal, fn in receivers:
            signal.disconnect(fn)
    assert isinstance(result.result, ValueError)
    assert seen == [
        ("started", "book", 1), ("succeeded", "book", 1),
        ("started", "notify", 1), ("failed", "notify", 1),
        ("replayed", "book", None),
        ("started", "notify", 2), ("failed", "notify", 2),
        ("unwound", "failure", "compensated"),
    ]
    messages = [(r.levelno, r.getMessage()) for r in caplog.records
                if r.name.startswith("celery_duraflow")]
    info = [m for level, m in messages if level >= logging.INFO]
    assert f"task {result.id} ({trip.name}): retry 1 requested after step 'notify' failed" in info
    assert any(m.startswith(f"task {result.id} ({trip.name}) failed for good at step 'notify'")
               for m in info)
    assert any("undone" in m and "'book'" in m for m in info)
    # Outputs may hold personal data: never above DEBUG.
    assert not any(SECRET in m for m in info)
