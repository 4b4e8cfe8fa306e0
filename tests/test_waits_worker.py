"""Waits across real ``celery worker`` processes, PostgreSQL and each broker.

Every test runs once on Redis and once on RabbitMQ, each on a queue of its own
that is deleted afterwards.

A sleep outlives the worker that started it and is woken by the sweep within
a second of its time; a signal sent with the CLI while no worker runs is
delivered once one starts again.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from celery import Celery
from celery.result import AsyncResult

from celery_duraflow import RunView, get_run
from tests.conftest import Broker
from tests.workers import (
    REPO_ROOT,
    client_app,
    end_project,
    fetch_all,
    log_tail,
    proj_env,
    start_worker_process,
    stop_process,
    wait_for_run,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.subprocess]

RESULT_TIMEOUT = 60.0


@dataclass
class Project:
    """tests.proj on this test's queue and tables, with workers started on demand."""

    pg_url: str
    broker: Broker
    prefix: str
    queue: str
    log_path: Path
    client: Celery
    env: dict[str, str]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start_worker(self) -> subprocess.Popen[bytes]:
        process = start_worker_process(self.queue, self.log_path, self.env)
        self.processes.append(process)
        return process

    def start_sweeper(self, interval: float) -> subprocess.Popen[bytes]:
        with self.log_path.open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.proj", "duraflow", "wake",
                 "--interval", str(interval)],
                cwd=REPO_ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(process)
        return process

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.proj", "duraflow", *args],
            cwd=REPO_ROOT, env=self.env, capture_output=True, text=True, timeout=60,
            check=False)

    def send(self, name: str, *args: object) -> AsyncResult:
        return self.client.send_task(name, args=args, queue=self.queue)

    def until(self, task_id: str, status: str, timeout: float = 30.0) -> RunView:
        return wait_for_run(self.client, task_id, status, self.log_path, timeout)

    def events(self, task_id: str) -> list[str]:
        rows = fetch_all(self.pg_url, f'SELECT event FROM "{self.prefix}wait_events" '
                         "WHERE task_id = :t ORDER BY id", {"t": task_id})
        return [row[0] for row in rows]


@pytest.fixture
def project(pg_url: str, broker: Broker, table_prefix: str,
            tmp_path: Path) -> Iterator[Project]:
    queue = f"duraflow-waits-{uuid.uuid4().hex[:12]}"
    # No broker countdowns: every wake-up below comes from PostgreSQL through the sweep.
    env = proj_env(pg_url, broker.url, table_prefix, result_backend=broker.result_backend,
                   PROJ_ETA_THRESHOLD="0")
    proj = Project(pg_url=pg_url, broker=broker, prefix=table_prefix, queue=queue,
                   log_path=tmp_path / "workers.log",
                   client=client_app(pg_url, broker.url, table_prefix,
                                     result_backend=broker.result_backend), env=env)
    try:
        yield proj
    finally:
        end_project(proj.client, pg_url, table_prefix, proj.processes, [queue])


def test_sleep_spans_a_worker_restart_and_wakes_on_time(project: Project) -> None:
    """A sleep outlives a restart of every worker, and the run wakes within a second of its time."""
    project.start_sweeper(interval=0.2)
    first = project.start_worker()
    # Long enough for a worker restart on a loaded 2-core machine (about 2 to 5 s on Redis,
    # up to 8 s seen on RabbitMQ, whose workers take longer to shut down there).
    result = project.send("proj.nap", 12.0)
    sleeping = project.until(result.id, "sleeping")
    assert sleeping.wait_kind == "sleep" and sleeping.waiting_for == "nap"
    assert sleeping.wake_at is not None
    stop_process(first)  # every worker goes away while the run sleeps
    project.start_worker()
    assert time.time() < sleeping.wake_at.timestamp(), "the restart outlasted the sleep"

    woke_at = result.get(timeout=RESULT_TIMEOUT)
    late = woke_at - sleeping.wake_at.timestamp()
    assert 0 <= late < 1.0, f"woke {late:.2f}s after its time\n{log_tail(project.log_path)}"
    assert project.events(result.id) == ["before", "after"]
    run = get_run(result.id, app=project.client)
    assert run is not None and run.status == "succeeded" and run.wake_at is None


def test_signal_sent_from_the_cli_while_no_worker_runs(project: Project) -> None:
    """A signal sent with the CLI while no worker runs is stored once and wakes the run later."""
    worker = project.start_worker()
    result = project.send("proj.approve_booking", 120)
    waiting = project.until(result.id, "waiting")
    assert (waiting.wait_kind, waiting.waiting_for) == ("signal", "approval")
    stop_process(worker)

    sent = project.cli("signal", result.id, "approval", '{"approved": true}')
    assert sent.returncode == 0, sent.stderr
    assert f"signal 'approval' stored for {result.id}" in sent.stdout
    again = project.cli("signal", result.id, "approval", '{"approved": false}')
    assert again.returncode == 0, again.stderr
    assert "already stored" in again.stdout
    unknown = project.cli("signal", "no-such-run", "approval")
    assert unknown.returncode == 1
    assert unknown.stderr.strip().splitlines()[-1].startswith(
        "error: no run with task id no-such-run is recorded")
    bad = project.cli("signal", result.id, "approval", "{not json")
    assert bad.returncode == 2 and "not JSON" in bad.stderr

    project.start_worker()
    assert result.get(timeout=RESULT_TIMEOUT) == {"approved": True, "amount": 120}
    assert project.events(result.id) == ["quote", "book"]
