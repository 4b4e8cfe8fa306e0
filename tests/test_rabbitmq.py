"""RabbitMQ's ``consumer_timeout``: the library never holds a delivery past it.

RabbitMQ closes a channel (PRECONDITION_FAILED, "delivery acknowledgement on
channel N timed out") that keeps a delivery unacknowledged longer than
``consumer_timeout`` (30 minutes by default), and redelivers what it held.
A Celery worker holds a message with a countdown (an ETA) unacknowledged
until its time, and with ``task_acks_late`` until its attempt ends.

These tests shorten the server's timeout to 5 seconds for their duration
(RabbitMQ 3.10 has no per-queue ``x-consumer-timeout``, so the node-wide
setting is changed at runtime, with the channel tick that checks it, and
always restored) and run a real worker through waits several times longer:
a durable sleep and a signal wait end their attempt and are woken from
PostgreSQL by the sweep, and a sleep under ``duraflow_eta_threshold`` is not
sent as an ETA the worker would hold past the timeout.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from amqp.exceptions import PreconditionFailed
from celery import Celery
from celery.result import AsyncResult
from kombu import Connection, Consumer, Producer, Queue

from celery_duraflow import RunView, get_run, send_signal
from tests.conftest import REQUIRE_SERVICES, Broker
from tests.workers import (
    REPO_ROOT,
    client_app,
    end_project,
    log_tail,
    proj_env,
    start_worker_process,
    wait_for_run,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.subprocess]

CONSUMER_TIMEOUT = 5.0  # seconds
# A wait several times longer than the consumer timeout.
WAIT = 4 * CONSUMER_TIMEOUT
# What the worker's log shows when RabbitMQ closes a channel that held a delivery too long.
CLOSED_CHANNEL = ("PRECONDITION_FAILED", "delivery acknowledgement", "PreconditionFailed",
                  "Connection to broker lost", "Unrecoverable error", "channel closed",
                  "Channel closed")


def _rabbitmqctl_eval(expression: str) -> str:
    done = subprocess.run(["rabbitmqctl", "eval", expression], capture_output=True, text=True,
                          timeout=60, check=False)
    if done.returncode != 0:
        raise AssertionError(f"rabbitmqctl eval {expression!r} failed: {done.stderr}")
    return done.stdout.strip()


def _restore(key: str, saved: str) -> None:
    """Put back ``rabbit``'s ``key`` as ``application:get_env`` returned it (``saved``)."""
    found = re.fullmatch(r"\{ok,(.*)\}", saved, flags=re.DOTALL)
    if found is None:  # "undefined"
        _rabbitmqctl_eval(f"application:unset_env(rabbit, {key}).")
    else:
        _rabbitmqctl_eval(f"application:set_env(rabbit, {key}, {found.group(1)}).")


def _held_delivery_is_closed(url: str, timeout: float) -> str:
    """Hold one delivery unacknowledged on a new channel; the broker's error once it closes it."""
    queue = Queue(f"duraflow-probe-{uuid.uuid4().hex[:12]}", auto_delete=False)
    with Connection(url) as conn:
        try:
            Producer(conn.channel()).publish({"probe": 1}, routing_key=queue.name,
                                             declare=[queue])
            held: list[object] = []
            with Consumer(conn.channel(), [queue], callbacks=[lambda _b, m: held.append(m)]):
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    try:
                        conn.drain_events(timeout=0.5)
                    except TimeoutError:
                        continue
                    except PreconditionFailed as exc:
                        assert held, "the probe was closed before it held its delivery"
                        return str(exc)
        finally:
            with Connection(url) as cleanup:
                queue(cleanup.channel()).delete()
    raise AssertionError(f"RabbitMQ did not close a channel holding a delivery for {timeout}s")


@pytest.fixture(scope="module")
def short_consumer_timeout(rabbitmq_url: str) -> Iterator[float]:
    """RabbitMQ's consumer_timeout at 5 s (checked every second) for these tests; restored."""
    if shutil.which("rabbitmqctl") is None:
        message = "needs rabbitmqctl on the machine that runs RabbitMQ"
        if REQUIRE_SERVICES:
            pytest.fail(f"{message}, and DURAFLOW_REQUIRE_SERVICES=1", pytrace=False)
        pytest.skip(message)
    keys = ("consumer_timeout", "channel_tick_interval")
    saved = {key: _rabbitmqctl_eval(f"application:get_env(rabbit, {key}).") for key in keys}
    try:
        _rabbitmqctl_eval(
            f"application:set_env(rabbit, consumer_timeout, {int(CONSUMER_TIMEOUT * 1000)}).")
        # The timeout is checked on the channel's tick, once a minute by default.
        _rabbitmqctl_eval("application:set_env(rabbit, channel_tick_interval, 1000).")
        # Both are read when a channel opens: a new one must be closed within seconds.
        error = _held_delivery_is_closed(rabbitmq_url, timeout=4 * CONSUMER_TIMEOUT)
        assert "PRECONDITION_FAILED" in error and "5000 ms" in error, error
        yield CONSUMER_TIMEOUT
    finally:
        for key, value in saved.items():
            _restore(key, value)
        assert {key: _rabbitmqctl_eval(f"application:get_env(rabbit, {key}).")
                for key in keys} == saved


@dataclass
class Project:
    """tests.proj on RabbitMQ, on this test's queue and tables, with a sweeper."""

    broker: Broker
    prefix: str
    queue: str
    log_path: Path
    client: Celery
    env: dict[str, str]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, *, sweep_interval: float) -> None:
        self.processes.append(start_worker_process(self.queue, self.log_path, self.env))
        with self.log_path.open("ab") as log:
            self.processes.append(subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.proj", "duraflow", "wake",
                 "--interval", str(sweep_interval)],
                cwd=REPO_ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))

    def send(self, name: str, *args: object) -> AsyncResult:
        return self.client.send_task(name, args=args, queue=self.queue)

    def until(self, task_id: str, status: str, timeout: float = 30.0) -> RunView:
        return wait_for_run(self.client, task_id, status, self.log_path, timeout)

    def closed_channels(self) -> list[str]:
        text = self.log_path.read_text(errors="replace")
        return [line for line in text.splitlines() if any(m in line for m in CLOSED_CHANNEL)]


@pytest.fixture
def rabbit_project(pg_url: str, rabbitmq_url: str, redis_url: str, table_prefix: str,
                   tmp_path: Path, short_consumer_timeout: float) -> Iterator[Project]:
    """tests.proj on RabbitMQ (results in Redis); the test sets its env, then starts it."""
    broker = Broker("rabbitmq", rabbitmq_url, redis_url)
    queue = f"duraflow-rmq-{uuid.uuid4().hex[:12]}"
    project = Project(
        broker=broker, prefix=table_prefix, queue=queue, log_path=tmp_path / "workers.log",
        client=client_app(pg_url, broker.url, table_prefix,
                          result_backend=broker.result_backend),
        env=proj_env(pg_url, broker.url, table_prefix, result_backend=broker.result_backend,
                     PROJ_CONSUMER_TIMEOUT=str(short_consumer_timeout)))
    try:
        yield project
    finally:
        end_project(project.client, pg_url, table_prefix, project.processes, [queue])


def test_long_sleep_and_signal_wait_are_woken_from_postgres(rabbit_project: Project) -> None:
    """Waits past eta_threshold and 4x consumer_timeout end the attempt; the sweep wakes them."""
    project = rabbit_project
    project.env["PROJ_ETA_THRESHOLD"] = "1"
    project.start(sweep_interval=0.5)
    nap = project.send("proj.nap", WAIT)
    approval = project.send("proj.approve_booking", 70)
    sleeping = project.until(nap.id, "sleeping")
    assert sleeping.wake_at is not None
    project.until(approval.id, "waiting")

    time.sleep(WAIT)  # the signal comes after four consumer timeouts
    assert send_signal(approval.id, "approval", {"approved": True}, app=project.client)
    woke_at = nap.get(timeout=60)
    assert woke_at >= sleeping.wake_at.timestamp()
    assert approval.get(timeout=60) == {"approved": True, "amount": 70}
    for result in (nap, approval):
        run = get_run(result.id, app=project.client)
        assert run is not None and run.status == "succeeded"
    assert project.closed_channels() == [], log_tail(project.log_path)


def test_sleep_under_eta_threshold_is_not_held_past_consumer_timeout(
        rabbit_project: Project) -> None:
    """A sleep under eta_threshold but past consumer_timeout is no ETA held past it; it wakes."""
    project = rabbit_project
    project.env["PROJ_ETA_THRESHOLD"] = "60"  # the default: 4x the consumer timeout is under it
    project.start(sweep_interval=0.5)
    nap = project.send("proj.nap", WAIT)
    sleeping = project.until(nap.id, "sleeping")
    assert sleeping.wake_at is not None
    woke_at = nap.get(timeout=WAIT + 60)
    assert woke_at >= sleeping.wake_at.timestamp()
    run = get_run(nap.id, app=project.client)
    assert run is not None and run.status == "succeeded"
    assert project.closed_channels() == [], log_tail(project.log_path)
