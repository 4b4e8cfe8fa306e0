"""PostgreSQL crashes under load: what a crash may lose is rebuilt, and nothing runs twice.

A run's success is committed without waiting for the WAL flush (every step's record
waits for it). The private cluster is stopped with ``-m immediate`` while two prefork
workers run many short runs, so the server dies with commits it had not flushed; it
recovers on start. Every run must then end succeeded, with its own result, no step
body whose end was recorded may run again, and every body that runs again must be
flagged in doubt. The step bodies log to a file outside the database (see
``tests/proj/chaos.py``): that ledger, not the store, says what really ran.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from tests.conftest import Broker, OutageServer
from tests.test_chaos import check_executions, client_app, cluster, read_events, wait_for_runs

pytestmark = [pytest.mark.postgres, pytest.mark.chaos]

RUNS, STEPS = 240, 3


def test_a_crash_under_load_loses_no_run_and_runs_no_recorded_step_again(
        outage_pg: OutageServer, redis_url: str, tmp_path: Path) -> None:
    """PostgreSQL killed (-m immediate) twice under 240 runs of 3 short steps: every run
    succeeds once with its result, no recorded step body runs again, every rerun is in doubt."""
    broker = Broker("redis", redis_url, redis_url)
    with cluster(outage_pg.url, broker, tmp_path, lease_seconds=2) as c:
        c.start_with_sweeper()
        app = client_app(c, broker)
        task_ids = [str(uuid.uuid4()) for _ in range(RUNS)]
        for n, task_id in enumerate(task_ids):
            app.send_task("proj.outage_steps", args=(n,),
                          kwargs={"steps": STEPS, "seconds": 0.005},
                          task_id=task_id, queue=c.queue)
        for pause in (1.0, 1.5):
            time.sleep(pause)
            with outage_pg.stopped(mode="immediate"):
                time.sleep(0.5)
        statuses = wait_for_runs(c, RUNS, timeout=120)
        assert statuses == {"succeeded": RUNS}, f"{statuses}\n{c.log_tail()}"
        results = dict(c.sql(f'SELECT task_id, result FROM "{c.prefix}runs"'))
        assert results == {task_id: f'"s{STEPS - 1}-{n}"'
                           for n, task_id in enumerate(task_ids)}
        executions, deliveries = read_events(c)
        problems, duplicates, in_doubt = check_executions(c, executions)
        names = Counter(task_id for task_id, _ in executions)
        recovered = c.sql(f'SELECT count(*) FROM "{c.prefix}runs" WHERE recoveries > 0')[0][0]
        print(f"\ncrash: runs={RUNS} steps={STEPS} deliveries={len(deliveries)} "
              f"bodies run again={sum(len(runs) - 1 for runs in executions.values())} "
              f"in doubt={in_doubt} recorded steps run again={duplicates} "
              f"runs taken over={recovered}")
        # A step whose record its attempt saw written never ran again, in doubt or not.
        recorded: dict[tuple[str, str], float] = {}
        for line in c.event_log.read_text().splitlines():
            stamp, _, kind, *rest = line.split()
            if kind == "recorded":
                recorded.setdefault((rest[0], rest[1]), float(stamp))
        lost = [f"{task_id} {name}: ran at {run.start:.6f}, recorded at "
                f"{recorded[(task_id, name)]:.6f}"
                for (task_id, name), runs in executions.items() for run in runs
                if (task_id, name) in recorded and run.start > recorded[(task_id, name)]]
        assert lost == [], "\n".join(lost[:20])
        assert problems == [], "\n".join(problems[:20])
        assert duplicates == 0
        # Every step of every run ran (a body that ran more than once was in doubt).
        assert names == Counter({task_id: STEPS for task_id in task_ids})


def _server_setting(server: OutageServer, name: str, value: str | None) -> None:
    """ALTER SYSTEM on the private cluster (None resets it), applied at once."""
    engine = create_engine(server.url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            if value is None:
                conn.execute(text(f"ALTER SYSTEM RESET {name}"))
            else:
                conn.execute(text(f"ALTER SYSTEM SET {name} = '{value}'"))
            conn.execute(text("SELECT pg_reload_conf()"))
    finally:
        engine.dispose()


def test_a_success_the_crash_lost_is_recorded_again_without_running_a_step(
        outage_pg: OutageServer, redis_url: str, tmp_path: Path) -> None:
    """A run's success not yet flushed when PostgreSQL crashes is lost; the run is taken over
    once its lease ends and succeeds again by replay, with no step body run twice."""
    broker = Broker("redis", redis_url, redis_url)
    # The WAL writer flushes what asynchronous commits left within three of its delays:
    # a long delay keeps the success unflushed until the crash, whenever the test gets to it.
    _server_setting(outage_pg, "wal_writer_delay", "10s")
    try:
        # A lease long enough to read the lost success before the sweep takes the run over.
        with cluster(outage_pg.url, broker, tmp_path, lease_seconds=8) as c:
            c.start_with_sweeper()
            task_id = str(uuid.uuid4())
            client_app(c, broker).send_task(
                "proj.outage_steps", args=(7,), kwargs={"steps": 2, "seconds": 0.01},
                task_id=task_id, queue=c.queue)
            assert wait_for_runs(c, 1, timeout=30) == {"succeeded": 1}, c.log_tail()
            with outage_pg.stopped(mode="immediate"):
                pass
            assert outage_pg.ready(60)
            lost = c.sql(f'SELECT status, recoveries FROM "{c.prefix}runs"')
            assert lost == [("running", 0)], lost
            assert wait_for_runs(c, 1, timeout=60) == {"succeeded": 1}, c.log_tail()
            row = c.sql(f'SELECT result, recoveries FROM "{c.prefix}runs"')
            assert row == [('"s1-7"', 1)], row
            executions, deliveries = read_events(c)
            assert sorted((name, len(runs)) for (_, name), runs in executions.items()) == [
                ("s0", 1), ("s1", 1)]
            assert len(deliveries) == 2  # the first delivery and the sweep's
    finally:
        _server_setting(outage_pg, "wal_writer_delay", None)


def test_an_at_most_once_steps_claim_survives_a_crash_during_its_body(
        outage_pg: OutageServer, table_prefix: str) -> None:
    """PostgreSQL crashes while an on_in_doubt='raise' step's body runs: its claim was
    durable, so the next attempt raises StepInDoubt instead of running the body again."""
    from celery_duraflow import DurableTask, StepInDoubt, StoreUnavailable, step
    from celery_duraflow._store import close_all_stores
    from tests.conftest import app_factory, drop_tables

    app = app_factory(outage_pg.url, table_prefix)(duraflow_lease_seconds=1)
    charges: list[int] = []
    down: list[Any] = [None]

    @app.task(base=DurableTask, name="crash.charge")
    def charge() -> str:
        with step("charge", on_in_doubt="raise") as s:
            charges.append(1)
            if not down:
                # The database dies while the card is being charged. An asynchronous commit
                # of the claim would still sit in the WAL buffers (the writer waits 10 s).
                down.append(outage_pg.stopped(mode="immediate"))
                down[0].__enter__()
            s.result = "charged"
        return str(s.result)

    _server_setting(outage_pg, "wal_writer_delay", "10s")
    try:
        assert charge.apply(task_id=f"warm-{uuid.uuid4()}").get() == "charged"  # tables
        charges.clear()
        down.clear()
        task_id = str(uuid.uuid4())
        try:
            first = charge.apply(task_id=task_id)
        finally:
            if down:
                down[0].__exit__(None, None, None)  # the server starts again, and recovers
        assert isinstance(first.result, StoreUnavailable), first.result
        time.sleep(1.2)  # the first attempt could not let go of its 1 s lease
        again = charge.apply(task_id=task_id)
        assert isinstance(again.result, StepInDoubt), again.result
        assert again.result.step_key == "charge"
        assert charges == [1]  # never charged twice
    finally:
        _server_setting(outage_pg, "wal_writer_delay", None)
        close_all_stores()
        drop_tables(outage_pg.url, table_prefix)
