"""Real ``celery worker`` subprocesses on tests.proj, for the tests that need them.

Each worker gets its own queue, node name, log file and (through the
environment, see :mod:`tests.proj.app`) its own table prefix.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from celery import Celery
from kombu import Connection, Exchange, Queue
from sqlalchemy import create_engine, text

from celery_duraflow import RunView, get_run
from celery_duraflow._store import close_all_stores
from tests.conftest import drop_project_tables

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0


def proj_env(pg_url: str, broker_url: str, prefix: str, *, result_backend: str | None = None,
             **extra: str) -> dict[str, str]:
    """The environment that points tests.proj at this test's services and tables.

    The result backend is the broker (Redis) unless given (RabbitMQ needs one).
    """
    env = dict(os.environ)
    env.update(PROJ_BROKER_URL=broker_url, PROJ_RESULT_BACKEND=result_backend or broker_url,
               PROJ_DATABASE_URL=pg_url, PROJ_TABLE_PREFIX=prefix, PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def client_app(pg_url: str, broker_url: str, prefix: str, *,
               result_backend: str | None = None) -> Celery:
    """An app that sends to the workers and reads their runs."""
    client = Celery("proj-client", broker=broker_url, backend=result_backend or broker_url,
                    set_as_current=False)
    client.conf.update(duraflow_database_url=pg_url, duraflow_table_prefix=prefix,
                       broker_connection_retry_on_startup=True)
    return client


def start_worker_process(queue: str, log_path: Path, env: dict[str, str], *,
                         concurrency: int = 2) -> subprocess.Popen[bytes]:
    """Start a prefork ``celery -A tests.proj worker`` on ``queue``; return once it is ready."""
    command = [
        sys.executable, "-m", "celery", "-A", "tests.proj", "worker",
        "--pool", "prefork", "--concurrency", str(concurrency), "--loglevel", "INFO",
        "-Q", queue, "-n", f"{queue}-{time.monotonic_ns()}@%h",
        "--without-heartbeat", "--without-gossip", "--without-mingle",
    ]
    with log_path.open("ab") as log:
        start = log.tell()
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    _wait_until_ready(process, log_path, start)
    return process


def _wait_until_ready(process: subprocess.Popen[bytes], log_path: Path, start: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT

    def log_text() -> str:
        with log_path.open("rb") as log:
            log.seek(start)
            return log.read().decode(errors="replace")

    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(
                f"celery worker exited with {process.returncode} before it was ready:\n"
                + log_text()[-6000:])
        if " ready." in log_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"celery worker not ready after {READY_TIMEOUT:.0f}s:\n"
                         + log_text()[-6000:])


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (Celery's warm shutdown), then SIGKILL to the whole group if needed."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=STOP_TIMEOUT)
    else:
        # Reap pool processes that might have outlived their parent.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def discard_process(process: subprocess.Popen[bytes]) -> None:
    """End a worker whose test is over: SIGKILL to its whole group, no warm shutdown.

    A warm shutdown takes 2 to 7 seconds (longest on RabbitMQ) and nothing of it
    matters once the test has asserted what it pins: the queue is deleted and the
    tables dropped right after. Tests that rely on a clean shutdown use stop_process.
    """
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=STOP_TIMEOUT)


def end_project(client: Celery, pg_url: str, prefix: str,
                processes: Iterable[subprocess.Popen[bytes]], queues: Iterable[str]) -> None:
    """Undo what a worker test set up: its workers, queues, client, stores and tables."""
    try:
        for process in processes:
            discard_process(process)
        for queue in queues:
            purge_queue(client, queue)
    finally:
        client.close()
        close_all_stores()
        drop_project_tables(pg_url, prefix)


def fetch_all(url: str, sql: str, params: Mapping[str, Any]) -> list[Any]:
    """The rows of one query on a fresh engine (what a worker process wrote)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(sql), dict(params)).all())
    finally:
        engine.dispose()


def purge_queue(client: Celery, queue: str) -> None:
    """Empty and delete ``queue`` on the client's broker (Redis or RabbitMQ)."""
    with client.connection_for_write() as conn:
        delete_queue(conn, queue)


def delete_queue(conn: Connection, queue: str) -> None:
    """Delete ``queue`` and what the broker keeps for it, with any messages left in it."""
    channel = conn.default_channel
    if conn.transport.driver_type == "amqp":
        # RabbitMQ: queue.delete, then the direct exchange Celery declared for the queue.
        Queue(queue, routing_key=queue)(channel).delete()
        Exchange(queue, type="direct")(channel).delete()
        return
    Queue(queue, routing_key=queue)(channel).purge()
    # The Redis transport keeps the queue's bindings in sets of their own.
    channel.client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")


def log_tail(log_path: Path, lines: int = 60) -> str:
    try:
        text = log_path.read_text(errors="replace")
    except OSError as exc:
        return f"(no worker log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def wait_for_run(client: Celery, task_id: str, status: str, log_path: Path,
                 timeout: float = 30.0) -> RunView:
    """The run once it has ``status``; AssertionError with the worker log's end otherwise."""
    deadline = time.monotonic() + timeout
    run = None
    while time.monotonic() < deadline:
        run = get_run(task_id, app=client)
        if run is not None and run.status == status:
            return run
        time.sleep(0.05)
    raise AssertionError(f"run {task_id} is {run.status if run else 'unknown'}, not "
                         f"{status}\n{log_tail(log_path)}")
