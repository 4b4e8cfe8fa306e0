"""An eager app runs what a worker would run, in this process, and publishes nothing."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_duraflow import DurableTask, cancel, get_run, send_signal, step, wait_for_signal


@pytest.fixture
def queue(redis_url: str) -> Iterator[tuple[str, redis.Redis]]:
    """A queue name of this test's own on the real Redis broker, and a client to look."""
    name = f"eager-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    yield name, client
    client.delete(name)
    client.close()


@pytest.mark.redis
def test_signal_to_eager_run_runs_here_and_sends_nothing(
        make_app: Callable[..., Celery], redis_url: str,
        queue: tuple[str, redis.Redis]) -> None:
    """send_signal in an eager app resumes the run in this process; the broker gets nothing."""
    name, client = queue
    app = make_app(eager=True, broker=redis_url, task_default_queue=name,
                   result_backend="cache+memory://")
    ran: list[str] = []

    @app.task(base=DurableTask)
    def approve_order(order: str) -> Any:
        with step("reserve") as s:
            ran.append("reserve")
            s.result = f"reserved {order}"
        answer = wait_for_signal("approval", timeout=3600)
        with step("ship") as s:
            ran.append("ship")
            s.result = f"shipped {order}: {answer['by']}"
        return s.result

    result = approve_order.apply(args=("o-1",))
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "waiting"
    assert send_signal(result.id, "approval", {"by": "ada"}, app=app) is True
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded"
    assert run.result == "shipped o-1: ada"
    assert ran == ["reserve", "ship"]
    assert client.llen(name) == 0 and client.keys(f"{name}*") == []


@pytest.mark.redis
def test_cancel_of_eager_waiting_run_runs_here(make_app: Callable[..., Celery], redis_url: str,
                                              queue: tuple[str, redis.Redis]) -> None:
    """cancel() of a waiting run in an eager app ends it here, with nothing published."""
    name, client = queue
    app = make_app(eager=True, broker=redis_url, task_default_queue=name,
                   result_backend="cache+memory://")

    @app.task(base=DurableTask)
    def waits() -> Any:
        return wait_for_signal("never", timeout=3600)

    result = waits.apply()
    assert cancel(result.id, app=app) is True
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "cancelled"
    assert client.llen(name) == 0
