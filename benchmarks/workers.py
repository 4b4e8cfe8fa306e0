"""Real ``celery worker`` subprocesses for the end-to-end and memory benchmarks.

Each worker has a queue and node name of its own and loads :mod:`benchmarks.celery_app`
with the run's database, table prefix, broker (Redis or RabbitMQ) and result backend
(Redis). :func:`celery_worker` stops it (warm shutdown, then SIGKILL of its process group),
purges its queue (and deletes it on RabbitMQ) and deletes the results the client asked it
for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery
from celery.exceptions import TimeoutError as ResultTimeout
from celery.result import AsyncResult
from kombu.entity import Queue

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0


@dataclass
class Worker:
    """A running worker subprocess and a client app that talks to it."""

    process: subprocess.Popen[bytes]
    log_path: Path
    queue: str
    client: Celery
    sent: list[str] = field(default_factory=list)

    def send(self, name: str, *args: Any, ignore_result: bool = False) -> AsyncResult:
        task_id = f"bench-{uuid.uuid4()}"
        if not ignore_result:
            self.sent.append(task_id)
        result: AsyncResult = self.client.send_task(name, args=args, queue=self.queue,
                                                    task_id=task_id,
                                                    ignore_result=ignore_result)
        return result

    def call(self, name: str, *args: Any, timeout: float = READY_TIMEOUT) -> Any:
        """Send one task and wait for its result, noticing a worker that died."""
        result = self.send(name, *args)
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                return result.get(timeout=0.5, propagate=True)
            except ResultTimeout:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{name} got no result from the worker in {timeout:.0f}s:\n"
                        + self.log_tail()
                    ) from None

    def wait_all(self, results: list[AsyncResult], timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        values = []
        for result in results:
            while True:
                try:
                    values.append(result.get(timeout=1.0, propagate=True))
                    break
                except ResultTimeout:
                    self.check_alive()
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"results not ready after {timeout:.0f}s:\n{self.log_tail()}"
                        ) from None
        return values

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"celery worker exited with {self.process.returncode}:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no worker log: {exc})"
        return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def celery_worker(*, broker_url: str, database_url: str, prefix: str, concurrency: int,
                  label: str, backend_url: str | None = None) -> Iterator[Worker]:
    """``celery worker --pool prefork --concurrency N`` on a queue of its own.

    The result backend is ``backend_url`` (a Redis URL), by default the broker's.
    """
    backend_url = backend_url or broker_url
    queue = f"duraflow-bench-{label}-{uuid.uuid4().hex[:10]}"
    log_dir = Path(tempfile.mkdtemp(prefix="duraflow-bench-"))
    log_path = log_dir / f"{label}.log"
    env = dict(os.environ)
    env.update(
        BENCH_BROKER_URL=broker_url,
        BENCH_BACKEND_URL=backend_url,
        BENCH_DATABASE_URL=database_url,
        BENCH_TABLE_PREFIX=prefix,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p),
    )
    command = [
        sys.executable, "-m", "celery", "-A", "benchmarks.celery_app", "worker",
        "--pool", "prefork", "--concurrency", str(concurrency), "--loglevel", "WARNING",
        "-Q", queue, "-n", f"{queue}@%h",
        "--without-heartbeat", "--without-gossip", "--without-mingle",
    ]
    client = Celery(f"bench-client-{label}", broker=broker_url, backend=backend_url,
                    set_as_current=False)
    client.conf.update(broker_connection_retry_on_startup=True, task_serializer="json",
                       result_serializer="json", accept_content=["json"])
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log_file,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    worker = Worker(process=process, log_path=log_path, queue=queue, client=client)
    try:
        # Ready when it answers: the first task also makes each pool process load the app.
        worker.call("bench.rss", timeout=READY_TIMEOUT)
        yield worker
    finally:
        _stop(process)
        try:
            _purge(client, queue, worker.sent)
        finally:
            client.close()
            with contextlib.suppress(OSError):
                log_path.unlink()
                log_dir.rmdir()


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        # SIGTERM is Celery's warm shutdown: finish the running tasks, then exit.
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_TIMEOUT)
    # Reap pool processes that might have outlived their parent.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_TIMEOUT)


def _purge(client: Celery, queue: str, task_ids: list[str]) -> None:
    with client.connection_for_write() as conn:
        channel = conn.default_channel
        bound = Queue(queue, routing_key=queue)(channel)  # type: ignore[no-untyped-call]
        bound.purge()  # type: ignore[no-untyped-call]
        if conn.transport.driver_type == "redis":
            # The Redis transport keeps the queue's bindings in sets of their own.
            channel.client.delete(f"_kombu.binding.{queue}",
                                  f"_kombu.binding_permanent.{queue}")
        else:
            # RabbitMQ keeps a durable queue until it is deleted.
            bound.delete()  # type: ignore[no-untyped-call]
    backend: Any = client.backend
    redis = getattr(backend, "client", None)
    if redis is None or not hasattr(redis, "delete"):
        return
    for start in range(0, len(task_ids), 1000):
        keys = [f"celery-task-meta-{t}" for t in task_ids[start:start + 1000]]
        redis.delete(*keys)
