"""A store that fails after a step's body ran: the step is in doubt next time, and no retry
of the user's is spent.

The server stopped is the session's private cluster (``outage_pg``); the pooler restarted
is a PgBouncer of this module's own, on a port of its own, never the shared one. Step
bodies log to lists in this process or, in worker processes, to a file outside the
database: that ledger, not the store, says how often a body really ran.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine, text

from celery_duraflow import ConfigurationError, DurableTask, StoreUnavailable, get_run, step
from celery_duraflow._store import close_all_stores
from tests.conftest import (
    REQUIRE_SERVICES,
    Broker,
    OutageServer,
    app_factory,
    drop_tables,
    run_worker,
)
from tests.test_chaos import Cluster, cluster, read_events, wait_for_runs

pytestmark = [pytest.mark.postgres, pytest.mark.chaos]


class Flaky(Exception):
    """A failure of the user's own, listed in autoretry_for."""


@pytest.fixture
def outages(outage_pg: OutageServer) -> Iterator[list[threading.Timer]]:
    """Timers that start the private cluster again; the cluster is up after the test."""
    timers: list[threading.Timer] = []
    yield timers
    for timer in timers:
        timer.join(30)
    outage_pg._ctl("start", check=False)
    assert outage_pg.ready(60), "the private cluster did not come back"


def stop_for(server: OutageServer, seconds: float, timers: list[threading.Timer]) -> None:
    """Stop the cluster now (the caller's connection breaks) and start it ``seconds`` later."""
    server._ctl("stop", "-m", "fast")
    timer = threading.Timer(seconds, lambda: server._ctl("start", check=False))
    timer.start()
    timers.append(timer)


@pytest.fixture
def worker_app(outage_pg: OutageServer, redis_url: str, table_prefix: str) -> Iterator[Celery]:
    """An app on Redis whose store is the private cluster, for an in-process worker."""
    queue = f"doubt-{uuid.uuid4().hex[:8]}"
    app = app_factory(outage_pg.url, table_prefix)(
        eager=False, broker=redis_url, duraflow_lease_seconds=2, task_default_queue=queue)
    yield app
    close_all_stores()
    drop_tables(outage_pg.url, table_prefix)
    with app.connection_for_write() as conn:
        conn.default_channel.client.delete(queue)


def test_a_body_whose_end_was_not_recorded_is_in_doubt_and_spends_no_retry(
        worker_app: Celery, outage_pg: OutageServer, outages: list[threading.Timer]) -> None:
    """Record lost after the body: the next attempt runs it in doubt, retries stay at 0."""
    app = worker_app
    runs: list[tuple[str, bool, int]] = []

    @app.task(base=DurableTask, bind=True, autoretry_for=(ConnectionError,), max_retries=3,
              default_retry_delay=0)
    def trip(self: Any) -> str:
        with step("search") as s:
            runs.append(("search", s.in_doubt, self.request.retries))
            s.result = "found"
        with step("book") as s:
            runs.append(("book", s.in_doubt, self.request.retries))
            if len(runs) == 2:
                stop_for(outage_pg, 1.0, outages)  # the store goes away under the body
            s.result = "booked"
        with step("mail") as s:
            runs.append(("mail", s.in_doubt, self.request.retries))
            s.result = "mailed"
        return str(s.result)

    with run_worker(app):
        result = trip.delay()
        assert result.get(timeout=60) == "mailed"
    assert runs == [("search", False, 0), ("book", False, 0),
                    ("book", True, 0), ("mail", False, 0)]
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded" and run.retries == 0
    assert [(v.key, v.result) for v in run.steps] == [
        ("search", "found"), ("book", "booked"), ("mail", "mailed")]


def test_a_record_that_fails_while_the_store_answers_is_in_doubt_next_time(
        pg_url: str, redis_url: str, table_prefix: str) -> None:
    """The record alone fails (it times out behind a lock), the lease is let go normally:
    the next attempt still runs the body in doubt, and no retry is spent."""
    queue = f"doubt-{uuid.uuid4().hex[:8]}"
    app = app_factory(pg_url, table_prefix)(
        eager=False, broker=redis_url, task_default_queue=queue,
        duraflow_engine_options={"connect_args": {"options": "-c statement_timeout=1000"}})
    runs: list[tuple[bool, int]] = []
    locked, done = threading.Event(), threading.Event()

    def hold_steps_table() -> None:
        engine = create_engine(pg_url)
        try:
            with engine.begin() as conn:
                conn.execute(text(f'LOCK TABLE "{table_prefix}steps" IN ACCESS EXCLUSIVE MODE'))
                locked.set()
                done.wait(2.5)
        finally:
            engine.dispose()

    @app.task(base=DurableTask, bind=True, autoretry_for=(ConnectionError,), max_retries=3,
              default_retry_delay=1)
    def trip(self: Any) -> str:
        with step("book") as s:
            runs.append((s.in_doubt, self.request.retries))
            if len(runs) == 1:
                threading.Thread(target=hold_steps_table, daemon=True).start()
                assert locked.wait(10)
            s.result = "booked"
        return str(s.result)

    try:
        with run_worker(app):
            result = trip.delay()
            assert result.get(timeout=60) == "booked"
        assert runs == [(False, 0), (True, 0)]
        run = get_run(result.id, app=app)
        assert run is not None and run.status == "succeeded" and run.retries == 0
    finally:
        done.set()
        close_all_stores()
        drop_tables(pg_url, table_prefix)
        with app.connection_for_write() as conn:
            conn.default_channel.client.delete(queue)


def test_a_failure_whose_record_was_lost_is_in_doubt_and_spends_no_retry(
        worker_app: Celery, outage_pg: OutageServer, outages: list[threading.Timer]) -> None:
    """The body fails while the store is down: no retry is spent, the rerun is in doubt."""
    app = worker_app
    runs: list[tuple[bool, int]] = []

    @app.task(base=DurableTask, bind=True, autoretry_for=(Flaky,), max_retries=3,
              default_retry_delay=0)
    def trip(self: Any) -> str:
        with step("book") as s:
            runs.append((s.in_doubt, self.request.retries))
            if len(runs) == 1:
                stop_for(outage_pg, 1.0, outages)
                raise Flaky("the airline timed out")
            s.result = "booked"
        return str(s.result)

    with run_worker(app):
        result = trip.delay()
        assert result.get(timeout=60) == "booked"
    assert runs == [(False, 0), (True, 0)]
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded" and run.retries == 0


def test_code_that_swallows_the_store_error_does_not_finish_the_run(
        worker_app: Celery, outage_pg: OutageServer, outages: list[threading.Timer]) -> None:
    """A task that catches StoreUnavailable and returns is handed over, not finished."""
    app = worker_app
    runs: list[tuple[str, bool]] = []

    @app.task(base=DurableTask, bind=True)
    def trip(self: Any) -> str:
        try:
            with step("book") as s:
                runs.append(("book", s.in_doubt))
                if len(runs) == 1:
                    stop_for(outage_pg, 1.0, outages)
                s.result = "booked"
            with step("mail") as s:
                runs.append(("mail", s.in_doubt))
                s.result = "mailed"
        except StoreUnavailable:
            return "gave up"
        return str(s.result)

    with run_worker(app):
        result = trip.delay()
        assert result.get(timeout=60) == "mailed"
    assert runs == [("book", False), ("book", True), ("mail", False)]
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded"


def test_the_error_says_the_body_ran_and_the_next_attempt_is_in_doubt(
        outage_pg: OutageServer, table_prefix: str, outages: list[threading.Timer]) -> None:
    """Eager: the error names task and step and says the body ran; the rerun is in doubt."""
    app = app_factory(outage_pg.url, table_prefix)(duraflow_lease_seconds=1)
    runs: list[bool] = []

    @app.task(base=DurableTask)
    def trip() -> str:
        with step("book") as s:
            runs.append(s.in_doubt)
            if len(runs) == 1:
                stop_for(outage_pg, 0.5, outages)
            s.result = "booked"
        return str(s.result)

    try:
        first = trip.apply()
        error = first.result
        assert isinstance(error, StoreUnavailable)
        assert (error.task_id, error.step_key) == (first.id, "book")
        assert "The body of step 'book' ran, but its end was not recorded" in str(error)
        assert "did not run" not in str(error)
        for timer in outages:
            timer.join(30)
        assert outage_pg.ready(60)
        time.sleep(1.2)  # the attempt could not let go of its one-second lease
        assert trip.apply(task_id=first.id).get() == "booked"
        assert runs == [False, True]
    finally:
        close_all_stores()
        drop_tables(outage_pg.url, table_prefix)


def test_a_multi_host_url_the_driver_cannot_parse_is_a_configuration_error(
        table_prefix: str) -> None:
    """host=a:p,b:p fails closed as a configuration error naming the setting; no body runs."""
    app = app_factory(
        "postgresql+psycopg://postgres@/test?host=127.0.0.1:5511,127.0.0.1:5432",
        table_prefix)()
    runs: list[int] = []

    @app.task(base=DurableTask, autoretry_for=(ConnectionError,), max_retries=3)
    def trip() -> None:
        with step("book"):
            runs.append(1)

    error = trip.apply().result
    assert isinstance(error, ConfigurationError) and not isinstance(error, StoreUnavailable)
    assert "duraflow_database_url" in str(error)
    assert "host=127.0.0.1:5511&host=127.0.0.1:5432" in str(error)
    assert runs == []


def test_the_repeated_host_form_of_a_multi_host_url_works(
        pg_url: str, table_prefix: str) -> None:
    """One host= per server (the first one down) reaches the second and records the step."""
    url = pg_url.replace("@127.0.0.1:5432/", "@/") + "?host=127.0.0.1:1&host=127.0.0.1:5432"
    app = app_factory(url, table_prefix)()

    @app.task(base=DurableTask)
    def trip() -> str:
        with step("book") as s:
            s.result = "booked"
        return str(s.result)

    try:
        assert trip.apply().get() == "booked"
    finally:
        close_all_stores()
        drop_tables(pg_url, table_prefix)


# -- worker processes under a real restart ---------------------------------------------------

PGBOUNCER = "/usr/sbin/pgbouncer"
POOLER_PORT = 6439


@dataclass
class Pooler:
    """A PgBouncer of this module's own (transaction pooling) in front of one server."""

    directory: Path
    port: int

    @property
    def pidfile(self) -> Path:
        return self.directory / "pgbouncer.pid"

    def start(self) -> None:
        command = [PGBOUNCER, "-d", str(self.directory / "pgbouncer.ini")]
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            command = ["su", "postgres", "-s", "/bin/sh", "-c", " ".join(command)]
        subprocess.run(command, check=True, capture_output=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if subprocess.run(["pg_isready", "-q", "-h", "127.0.0.1", "-p", str(self.port)],
                              check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise AssertionError("the test's PgBouncer did not start")

    def kill(self) -> None:
        """SIGKILL: every client connection breaks at once, as in a crash."""
        with suppress(FileNotFoundError, ProcessLookupError, ValueError):
            os.kill(int(self.pidfile.read_text().strip()), signal.SIGKILL)
        time.sleep(0.1)
        with suppress(FileNotFoundError):
            self.pidfile.unlink()


@pytest.fixture
def pooler(pg_url: str) -> Iterator[Pooler]:
    """A private PgBouncer on port 6439 before the shared server; killed after the test."""
    if not os.path.exists(PGBOUNCER):
        message = f"{PGBOUNCER} is not installed (.ci/pgbouncer.sh installs it)"
        if REQUIRE_SERVICES:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    directory = Path(tempfile.mkdtemp(prefix="duraflow-pooler-"))
    directory.chmod(0o777)
    (directory / "userlist.txt").write_text('"postgres" ""\n')
    (directory / "pgbouncer.ini").write_text(f"""[databases]
* = host=127.0.0.1 port=5432

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {POOLER_PORT}
unix_socket_dir =
auth_type = trust
auth_file = {directory}/userlist.txt
pool_mode = transaction
default_pool_size = 20
max_client_conn = 200
ignore_startup_parameters = extra_float_digits,options
logfile = {directory}/pgbouncer.log
pidfile = {directory}/pgbouncer.pid
""")
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres", "postgres")
    server = Pooler(directory=directory, port=POOLER_PORT)
    server.start()
    try:
        yield server
    finally:
        server.kill()
        shutil.rmtree(directory, ignore_errors=True)


RUNS, STEPS = 24, 5
# Longer than check_ledger waits: a run left to wait out its lease fails the test. The
# attempt the store failed under hands its run to its own re-send instead.
LONG_LEASE = 600


def send_runs(c: Cluster, broker: Broker) -> list[str]:
    from tests.test_chaos import client_app

    app = client_app(c, broker)
    task_ids = [str(uuid.uuid4()) for _ in range(RUNS)]
    for n, task_id in enumerate(task_ids):
        app.send_task("proj.outage_steps", args=(n,), kwargs={"steps": STEPS, "seconds": 0.3},
                      task_id=task_id, queue=c.queue)
    return task_ids


def check_ledger(c: Cluster, task_ids: list[str], what: str) -> None:
    """Every run succeeded; every second run of a body was in doubt; no retry was spent."""
    statuses = wait_for_runs(c, len(task_ids), timeout=120)
    assert statuses.get("succeeded") == len(task_ids), f"{statuses}\n{c.log_tail()}"
    executions, deliveries = read_events(c)
    unflagged, overlaps, in_doubt = [], [], 0
    for (task_id, name), runs in executions.items():
        runs.sort(key=lambda r: r.start)
        for previous, current in itertools.pairwise(runs):
            if previous.end is None or previous.end > current.start:
                overlaps.append(f"{task_id} {name}")
            if not current.in_doubt:
                unflagged.append(f"{task_id} {name}: ran again with in_doubt False")
            in_doubt += 1
    spent = sorted({(t, r) for t, r in deliveries if r != 0})
    retries = c.sql(f'SELECT count(*) FROM "{c.prefix}runs" WHERE retries <> 0')[0][0]
    print(f"\noutage in doubt: {what} runs={len(task_ids)} steps={STEPS} "
          f"bodies run again={in_doubt} unflagged={len(unflagged)} "
          f"deliveries={len(deliveries)} retries spent={len(spent)}")
    assert unflagged == [], "\n".join(unflagged[:20])
    assert overlaps == []
    assert spent == [] and retries == 0
    # The restarts hit bodies that were running: the test saw the window it is about.
    assert in_doubt >= 1, c.log_tail()
    assert sorted(task for task, _ in executions) == sorted(
        t for t in task_ids for _ in range(STEPS))


@contextmanager
def two_workers(c: Cluster) -> Iterator[None]:
    c.start_worker(0)
    c.start_worker(1)
    c.wait_ready(2)
    yield


def test_pgbouncer_restarts_leave_every_rerun_in_doubt(
        pg_url: str, redis_url: str, pooler: Pooler, tmp_path: Path) -> None:
    """PgBouncer killed and started 1 s later, twice, under running steps: each body that
    runs again is flagged in doubt, no Celery retry is spent, and every run finishes without
    waiting out the lease its failed attempt could not let go of."""
    broker = Broker("redis", redis_url, redis_url)
    workers_url = pg_url.replace(":5432/", f":{pooler.port}/")
    with cluster(pg_url, broker, tmp_path, lease_seconds=LONG_LEASE,
                 workers_url=workers_url) as c:
        c.env["PROJ_POOLER"] = "transaction"
        with two_workers(c):
            task_ids = send_runs(c, broker)
            for _ in range(2):
                time.sleep(2.0)
                pooler.kill()
                time.sleep(1.0)
                pooler.start()
            check_ledger(c, task_ids, "pgbouncer")


def test_postgres_restarts_leave_every_rerun_in_doubt(
        outage_pg: OutageServer, redis_url: str, outages: list[threading.Timer],
        tmp_path: Path) -> None:
    """The private cluster stopped and started again, twice, under running steps: each
    body that runs again is flagged in doubt, no Celery retry is spent, and every run
    finishes without waiting out the lease its failed attempt could not let go of."""
    broker = Broker("redis", redis_url, redis_url)
    with cluster(outage_pg.url, broker, tmp_path, lease_seconds=LONG_LEASE) as c, \
            two_workers(c):
        task_ids = send_runs(c, broker)
        for _ in range(2):
            time.sleep(2.0)
            with outage_pg.stopped():
                time.sleep(1.0)
        check_ledger(c, task_ids, "postgres")
