"""DurableAgent in real ``celery worker`` processes, on Redis and PostgreSQL.

The agents are in :mod:`tests.proj.agents` (a worker loads them with ``-I``);
every model request and tool body adds a row to ``<prefix>agent_events``, so
the counts below are what really ran, across processes, retries and a SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from celery import Celery
from celery.result import AsyncResult

from celery_duraflow import RunView, get_run, send_signal
from tests.workers import (
    REPO_ROOT,
    _wait_until_ready,
    client_app,
    end_project,
    fetch_all,
    log_tail,
    proj_env,
    wait_for_run,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.subprocess]

RESULT_TIMEOUT = 30.0
TRIP_STEPS = ["trip:model", "trip:tool:search", "trip:model#2", "trip:tool:book",
              "trip:model#3", "trip:tool:wait_for_airline", "trip:model#4",
              "trip:tool:notify", "trip:model#5"]


@dataclass
class Project:
    """tests.proj with its agents, on this test's queue and tables."""

    pg_url: str
    prefix: str
    queue: str
    log_path: Path
    client: Celery
    env: dict[str, str]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start_worker(self, concurrency: int = 1) -> subprocess.Popen[bytes]:
        command = [
            sys.executable, "-m", "celery", "-A", "tests.proj", "worker", "-I",
            "tests.proj.agents", "--pool", "prefork", "--concurrency", str(concurrency),
            "--loglevel", "INFO", "-Q", self.queue, "-n", f"{self.queue}@%h",
            "--without-heartbeat", "--without-gossip", "--without-mingle",
        ]
        with self.log_path.open("ab") as log:
            start = log.tell()
            process = subprocess.Popen(command, cwd=REPO_ROOT, env=self.env,
                                       stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(process)
        _wait_until_ready(process, self.log_path, start)
        return process

    def send(self, name: str, **kwargs: object) -> AsyncResult:
        return self.client.send_task(name, kwargs=kwargs, queue=self.queue)

    def until(self, task_id: str, status: str, timeout: float = 30.0) -> RunView:
        return wait_for_run(self.client, task_id, status, self.log_path, timeout)

    def events(self, task_id: str) -> list[str]:
        if fetch_all(self.pg_url, "SELECT to_regclass(:t)",
                     {"t": f"{self.prefix}agent_events"})[0][0] is None:
            return []
        rows = fetch_all(self.pg_url, f'SELECT event FROM "{self.prefix}agent_events" '
                         "WHERE task_id = :t ORDER BY id", {"t": task_id})
        return [row[0] for row in rows]

    def wait_for_event(self, task_id: str, event: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if event in self.events(task_id):
                return
            time.sleep(0.05)
        raise AssertionError(f"no {event!r} for {task_id}\n{log_tail(self.log_path)}")

    def result(self, result: AsyncResult) -> object:
        try:
            return result.get(timeout=RESULT_TIMEOUT)
        except Exception as exc:
            raise AssertionError(f"{exc!r}\n{log_tail(self.log_path)}") from exc


@pytest.fixture
def project(pg_url: str, redis_url: str, table_prefix: str,
            tmp_path: Path) -> Iterator[Project]:
    queue = f"duraflow-agents-{uuid.uuid4().hex[:12]}"
    env = proj_env(pg_url, redis_url, table_prefix, PROJ_LEASE_SECONDS="3")
    proj = Project(pg_url=pg_url, prefix=table_prefix, queue=queue,
                   log_path=tmp_path / "workers.log",
                   client=client_app(pg_url, redis_url, table_prefix), env=env)
    try:
        yield proj
    finally:
        end_project(proj.client, pg_url, table_prefix, proj.processes, [queue])


def _children(worker: subprocess.Popen[bytes]) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=,stat=", "--ppid", str(worker.pid)],
                         capture_output=True, text=True, check=False).stdout
    return [int(line.split()[0]) for line in out.splitlines()
            if line.split() and not line.split()[1].startswith("Z")]


def test_a_failing_tool_retries_without_asking_the_model_again(project: Project) -> None:
    """The mailer fails once: the retry asks the model only what it had not answered."""
    project.start_worker()
    result = project.send("proj.agent_trip", mailer_down_once=True)
    output = project.result(result)
    assert isinstance(output, str) and output.startswith("done: [['FRA-LH1', 'FRA-BA9']")
    events = project.events(result.id)
    # Five requests in the whole run (the retry asked for the last one only), each tool
    # once, notify twice (it failed, then it ran again).
    assert events.count("model") == 5
    assert [e for e in events if e.startswith("tool:")] == [
        "tool:search", "tool:book", "tool:wait_for_airline:attempt1:in_doubt=False",
        "tool:notify", "tool:notify"]
    run = get_run(result.id, app=project.client)
    assert run is not None and run.status == "succeeded" and run.attempts == 2
    assert [s.key for s in run.steps] == TRIP_STEPS
    assert run.step("trip:tool:notify").attempts == 2


def test_an_approval_waits_without_holding_the_only_worker_slot(project: Project) -> None:
    """A run waiting for approval holds no worker: another run completes on the one slot."""
    project.start_worker(concurrency=1)
    approved = project.send("proj.agent_payment")
    rejected = project.send("proj.agent_payment")
    for waiting in (approved, rejected):
        run = project.until(waiting.id, "waiting")
        assert (run.wait_kind, run.waiting_for) == ("signal", "payer:approval:charge_card")
    # Meanwhile the one slot takes a whole other run.
    other = project.send("proj.agent_trip")
    assert isinstance(project.result(other), str)
    assert project.until(approved.id, "waiting").status == "waiting"

    assert send_signal(approved.id, "payer:approval:charge_card", {"approved": True},
                       app=project.client)
    assert send_signal(rejected.id, "payer:approval:charge_card",
                       {"approved": False, "message": "over budget"}, app=project.client)
    approved_output = project.result(approved)
    rejected_output = project.result(rejected)
    assert isinstance(approved_output, str) and "'charged': 420" in approved_output
    assert rejected_output == "done: ['over budget']"
    assert project.events(approved.id) == ["model", "tool:charge_card", "model"]
    assert project.events(rejected.id) == ["model", "model"]
    for task_id, steps in ((approved.id, ["payer:model", "payer:approval:charge_card",
                                          "payer:tool:charge_card", "payer:model#2"]),
                           (rejected.id, ["payer:model", "payer:approval:charge_card",
                                          "payer:model#2"])):
        run = get_run(task_id, app=project.client)
        assert run is not None and run.status == "succeeded"
        assert [s.key for s in run.steps] == steps


def test_a_worker_killed_in_a_tool_call_resumes_without_asking_the_model_again(
        project: Project) -> None:
    """SIGKILL of the worker child inside a tool: the run resumes; no recorded request is resent."""
    worker = project.start_worker()
    result = project.send("proj.agent_trip", hold_first_call=60.0)
    project.wait_for_event(result.id, "tool:wait_for_airline:attempt1:in_doubt=False")
    before = project.events(result.id)
    assert before.count("model") == 3
    for pid in _children(worker):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    output = project.result(result)
    assert isinstance(output, str) and output.startswith("done:")
    events = project.events(result.id)
    # The three recorded requests were answered from the store; two more were asked.
    assert events.count("model") == 5
    assert [e for e in events if e.startswith("tool:")] == [
        "tool:search", "tool:book", "tool:wait_for_airline:attempt1:in_doubt=False",
        "tool:wait_for_airline:attempt1:in_doubt=True", "tool:notify"]
    run = get_run(result.id, app=project.client)
    assert run is not None and run.status == "succeeded"
    assert [s.key for s in run.steps] == TRIP_STEPS
