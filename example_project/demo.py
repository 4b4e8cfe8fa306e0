"""``python -m example_project``: book one trip and show what every attempt did.

Modes, chosen by the environment and two flags:

* no ``CELERY_BROKER_URL``: the embedded demo. A fresh SQLite file in a
  temporary directory, the in-memory broker and a real Celery worker running
  in this process (no server needed);
* ``CELERY_BROKER_URL`` set (Redis, say) and ``DURAFLOW_DATABASE_URL`` set
  (PostgreSQL, say): the same trip through those services, with a
  ``celery -A example_project.app worker`` process started for the occasion
  (prefork, two processes) and stopped at the end;
* ``--no-worker``: as above, but the worker is already running elsewhere (the
  ``worker`` service of docker-compose.yml);
* ``--naive``: the same agent as a plain Celery task without steps, to show
  the card being charged twice.

The exit code is 0 when the ledger shows the expected number of charges (one
for the durable agent, two for the naive one), 1 when it does not, 2 when the
trip could not be run at all.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from celery.contrib.testing.worker import start_worker
from sqlalchemy.engine import make_url

from celery_duraflow import get_run

from .app import app
from .db import ExampleDB, example_db
from .planner import TripRequest
from .tasks import book_trip, book_trip_naive

REQUEST: TripRequest = {"origin": "LHR", "destination": "JFK", "date": "2025-06-01"}
PACKAGE_PARENT = Path(__file__).resolve().parent.parent


class DemoError(Exception):
    """The trip could not be run (no worker, a timeout, a crash)."""


def _describe_url(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


@contextlib.contextmanager
def _in_process_worker() -> Iterator[None]:
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="ERROR",
                      shutdown_timeout=15.0):
        yield


@contextlib.contextmanager
def _worker_process(scratch: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real ``celery worker`` process, stopped (warm shutdown) when the block ends."""
    env = dict(os.environ)
    # The worker must see exactly the settings this process resolved.
    env["CELERY_BROKER_URL"] = str(app.conf.broker_url)
    env["CELERY_RESULT_BACKEND"] = str(app.conf.result_backend)
    env["DURAFLOW_DATABASE_URL"] = str(app.conf.duraflow_database_url)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PACKAGE_PARENT), env.get("PYTHONPATH", "")) if p)
    log_path = scratch / "worker.log"
    command = [sys.executable, "-m", "celery", "-A", "example_project.app", "worker",
               "--pool=prefork", "--concurrency=2", "--loglevel=WARNING",
               "--without-gossip", "--without-mingle", "--without-heartbeat",
               f"--hostname=example-demo-{os.getpid()}@%h"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: warm shutdown, the pool processes exit with it
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if proc.returncode not in (0, -signal.SIGTERM):
            tail = log_path.read_text(errors="replace").splitlines()[-20:]
            print(f"worker exited with code {proc.returncode}; last lines of its log:",
                  *tail, sep="\n  ", file=sys.stderr)


def _wait(result: Any, worker: subprocess.Popen[bytes] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not result.ready():
        if worker is not None and worker.poll() is not None:
            raise DemoError(f"the worker process exited (code {worker.returncode}) "
                            "before the trip finished")
        if time.monotonic() > deadline:
            raise DemoError(f"no result after {timeout:.0f}s: is a worker consuming queue "
                            f"{app.conf.task_default_queue!r}?")
        time.sleep(0.05)


def _print_trace(db: ExampleDB, trip_id: str) -> None:
    for row in db.trace(trip_id):
        print(f"  attempt {row.attempt}  {row.step_key:<15} {row.outcome:<7} {row.detail}")


def _print_durable_summary(trip_id: str) -> bool:
    """Print what celery-duraflow recorded for the run; True if it looks right."""
    run = get_run(trip_id, app=app)
    if run is None:
        print("duraflow: no run recorded for this trip")
        return False
    completed = [s for s in run.steps if s.status == "completed"]
    retried = ", ".join(f"{s.key} x{s.attempts}" for s in run.steps if s.attempts > 1)
    print(f"duraflow: run {run.status} after {run.attempts} attempts; "
          f"{len(completed)}/{len(run.steps)} steps completed; "
          f"bodies run more than once: {retried or 'none'}")
    return run.status == "succeeded" and len(completed) == len(run.steps)


def _install_sigterm_handler() -> None:
    # Turn SIGTERM into an exception so the finally blocks stop the worker.
    def _handler(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    with contextlib.suppress(ValueError):  # not in the main thread
        signal.signal(signal.SIGTERM, _handler)


def run_demo(*, naive: bool, start_own_worker: bool, timeout: float, user: str) -> int:
    in_memory = str(app.conf.broker_url).startswith("memory://")
    with tempfile.TemporaryDirectory(prefix="duraflow-demo-") as tmp, \
            contextlib.ExitStack() as stack:
        scratch = Path(tmp)
        if not os.environ.get("DURAFLOW_DATABASE_URL"):
            # A fresh file for every demo run: nothing left over from an earlier one.
            app.conf.duraflow_database_url = f"sqlite:///{scratch / 'demo.sqlite3'}"
        db = example_db(app)
        stack.callback(db.dispose)
        db.create_tables()

        task = book_trip_naive if naive else book_trip
        if naive:
            kind = "naive agent: plain Celery task + autoretry, no steps"
        else:
            kind = "durable agent: DurableTask + step() + autoretry"
        if in_memory:
            where = "in-process worker, memory:// broker"
        elif start_own_worker:
            where = "`celery -A example_project.app worker` (prefork x2)"
        else:
            where = "a worker started elsewhere (--no-worker)"
        print(f"{kind}")
        print(f"database {_describe_url(str(app.conf.duraflow_database_url))}; {where}")

        worker: subprocess.Popen[bytes] | None = None
        if in_memory:
            stack.enter_context(_in_process_worker())
        elif start_own_worker:
            worker = stack.enter_context(_worker_process(scratch))

        result = task.delay(user, REQUEST)
        trip_id = str(result.id)
        print(f"trip {trip_id} for {user}: {REQUEST['origin']} -> {REQUEST['destination']} "
              f"on {REQUEST['date']}")
        _wait(result, worker, timeout)

        _print_trace(db, trip_id)
        if result.successful():
            print(f"result: {result.result['answer']}")
        else:
            print(f"result: {result.state} ({result.result!r})")
        healthy = bool(result.successful())
        if not naive:
            healthy = _print_durable_summary(trip_id) and healthy

        charges = db.charges(trip_id)
        expected = 2 if naive else 1
        noun = "charge" if charges == 1 else "charges"
        ok = charges == expected and healthy
        if not ok:
            verdict = "UNEXPECTED"
        elif naive:
            verdict = "the retry booked and charged again"
        else:
            verdict = "the retry reused the booking"
        print(f"ledger: {charges} {noun} for this trip (expected {expected}): {verdict}")
        return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m example_project",
        description="Book a flight with an agent whose e-mail step fails once, and count "
                    "how many times the card was charged.")
    parser.add_argument("--naive", action="store_true",
                        help="run the agent as a plain Celery task without durable steps "
                             "(the card is charged twice)")
    parser.add_argument("--no-worker", action="store_true",
                        help="do not start a worker: one is already consuming from "
                             "CELERY_BROKER_URL (e.g. the compose `worker` service)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds to wait for the trip to finish (default: 60)")
    parser.add_argument("--user", default="alice", help="who is travelling (default: alice)")
    args = parser.parse_args(argv)

    if args.no_worker and str(app.conf.broker_url).startswith("memory://"):
        parser.error("--no-worker needs a broker a separate worker can reach: set "
                     "CELERY_BROKER_URL (e.g. redis://localhost:6379/0)")
    _install_sigterm_handler()
    try:
        return run_demo(naive=args.naive, start_own_worker=not args.no_worker,
                        timeout=args.timeout, user=args.user)
    except DemoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
