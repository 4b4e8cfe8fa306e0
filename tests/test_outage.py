"""PostgreSQL going away and coming back, with a real server stop.

The server stopped is a private cluster of the test session's (``outage_pg``), never the
shared one the other tests use.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_duraflow import DurableTask, StoreUnavailable, get_run, step
from celery_duraflow._store import close_all_stores
from tests.conftest import OutageServer, app_factory, drop_tables

pytestmark = [pytest.mark.postgres, pytest.mark.chaos]


@pytest.fixture
def pg_app(outage_pg: OutageServer, table_prefix: str) -> Iterator[Celery]:
    """An eager app whose store is on the private cluster, with a one-second lease."""
    yield app_factory(outage_pg.url, table_prefix)(duraflow_lease_seconds=1)
    close_all_stores()
    drop_tables(outage_pg.url, table_prefix)


def test_outage_stops_steps_and_loses_nothing(pg_app: Celery, outage_pg: OutageServer) -> None:
    """Down: StoreUnavailable before any body runs. Back: the pool recovers, outputs kept."""
    calls: Counter[str] = Counter()
    outage: list[object] = []

    @pg_app.task(base=DurableTask)
    def task() -> str:
        with step("book") as s:
            calls["book"] += 1
            s.result = "booked"
        if not outage:
            # The database goes away between two steps of the first attempt.
            outage.append(outage_pg.stopped())
            outage[0].__enter__()  # type: ignore[attr-defined]
        with step("notify") as s:
            calls["notify"] += 1
            s.result = "sent"
        return str(s.result)

    warm = task.apply(task_id=str(uuid.uuid4()))  # warms the pool, and is interrupted
    try:
        assert isinstance(warm.result, StoreUnavailable)
        assert "The body of step 'notify' did not run" in str(warm.result)
        assert warm.result.step_key == "notify"
        assert calls == {"book": 1}  # notify's body never ran without a record

        down = task.apply(task_id=str(uuid.uuid4()))
        assert isinstance(down.result, StoreUnavailable)
        assert down.result.task_id == down.id
        assert calls == {"book": 1}
    finally:
        outage[0].__exit__(None, None, None)  # type: ignore[attr-defined]

    time.sleep(1.2)  # the interrupted attempt could not release its 1 s lease
    again = task.apply(task_id=warm.id)  # the first statement after the restart works
    assert again.get() == "sent"
    assert calls == {"book": 1, "notify": 1}  # book's output survived the outage
    run = get_run(warm.id, app=pg_app)
    assert run is not None and run.status == "succeeded"
    assert run.step("book").result == "booked"


def test_restart_while_idle_needs_no_failed_attempt(pg_app: Celery,
                                                   outage_pg: OutageServer) -> None:
    """Connections the server closed while pooled are replaced before use, not failed on."""
    calls: Counter[str] = Counter()

    @pg_app.task(base=DurableTask)
    def task() -> str:
        with step("work") as s:
            calls["work"] += 1
            s.result = "done"
        return str(s.result)

    assert task.apply().get() == "done"  # leaves connections idle in the pool
    with outage_pg.stopped():
        pass
    assert task.apply().get() == "done"
    assert calls["work"] == 2


def test_restart_inside_a_step_body_records_its_end_on_a_new_connection(
        pg_app: Celery, outage_pg: OutageServer) -> None:
    """The attempt's own connection, closed by a restart mid-body, is replaced, not failed on."""
    calls: Counter[str] = Counter()

    @pg_app.task(base=DurableTask)
    def task() -> str:
        with step("before") as s:
            s.result = 1
        with step("across-restart") as s:
            calls["across"] += 1
            with outage_pg.stopped():
                pass
            s.result = "recorded"
        with step("after") as s:
            calls["after"] += 1
            s.result = "done"
        return str(s.result)

    result = task.apply()
    assert result.get() == "done"
    assert calls == {"across": 1, "after": 1}
    run = get_run(result.id, app=pg_app)
    assert run is not None and run.status == "succeeded" and run.attempts == 1
    assert [(v.key, v.result) for v in run.steps] == [
        ("before", 1), ("across-restart", "recorded"), ("after", "done")]
