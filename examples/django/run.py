"""``python -m examples.django``: migrate the example shop, place one order, and report.

What it does, in order: ``manage.py migrate`` (Django's tables, the shop's, and
celery-duraflow's step store, all in one database); ``manage.py place_order``,
which saves a checkout and queues ``place_order`` with ``delay_on_commit()``;
then it waits for the durable run to finish and prints what each step did,
how many order rows and charges there are, and whether that is what it should
be. The payment API's first reply is always lost, so Celery retries the task
once: the retry replays the atomic ``save-order`` step from the store instead
of writing the order again, and the payment API gets the same idempotency key.

Where it runs:

* by default, with no service at all: a fresh SQLite file in a temporary
  directory, the ``memory://`` broker and a Celery worker in a thread of this
  process;
* ``--database-url`` (or ``EXAMPLE_DATABASE_URL``) chooses the database, SQLite
  (``sqlite:///path``) or PostgreSQL (``postgresql://user@host:5432/name``; the
  database must exist);
* ``--broker-url`` (or ``EXAMPLE_BROKER_URL``), Redis for example, sends the task
  through that broker to a real ``celery -A shopsite worker`` process (prefork,
  two processes) started for the occasion and stopped at the end;
  ``--queue`` (``EXAMPLE_QUEUE``) names its queue.

The exit code is 0 when the run succeeded with one order row, one charge and
the atomic step replayed on the retry; 1 when the outcome is any different;
2 when the order could not be run at all (no worker, a timeout).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from sqlalchemy.engine import make_url

#: The folder that holds manage.py: the Django project's root, put on sys.path.
PROJECT_DIR = Path(__file__).resolve().parent
SETTINGS_MODULE = "shopsite.settings"
#: The steps of ``orders.tasks.place_order`` and whether each is atomic.
STEPS = {"save-order": True, "charge-card": False, "mark-paid": True}
#: How often each step's body runs when the payment API loses its first reply.
EXPECTED_BODY_RUNS = {"save-order": 1, "charge-card": 2, "mark-paid": 1}
FINISHED = ("succeeded", "failed", "compensated", "cancelled")
APPLYING = re.compile(r"Applying (\S+)\.\.\.")


class DemoError(Exception):
    """The order could not be run (no worker, a timeout, a dead worker process)."""


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m examples.django",
        description="Migrate the example Django shop, place one order through its durable "
                    "task, and print what happened.")
    parser.add_argument(
        "--database-url", default=os.environ.get("EXAMPLE_DATABASE_URL") or None,
        help="sqlite:///path or postgresql://user:password@host:port/name (default: "
             "$EXAMPLE_DATABASE_URL, else a new SQLite file in a temporary directory)")
    parser.add_argument(
        "--broker-url", default=os.environ.get("EXAMPLE_BROKER_URL") or None,
        help="Celery broker, e.g. redis://localhost:6379/0; a `celery worker` process is "
             "started for it (default: $EXAMPLE_BROKER_URL, else memory:// and a worker "
             "thread in this process)")
    parser.add_argument(
        "--queue", default=os.environ.get("EXAMPLE_QUEUE") or "shopsite",
        help="the Celery queue to use (default: $EXAMPLE_QUEUE, else shopsite)")
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="seconds to wait for the order to be done (default 90)")
    args = parser.parse_args(argv)
    if args.broker_url and args.broker_url.startswith("memory://"):
        args.broker_url = None
    return args


def _describe(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def _configure(database_url: str, broker_url: str, queue: str) -> None:
    """Point the project's settings at these services, and set Django up."""
    os.environ.update(EXAMPLE_DATABASE_URL=database_url, EXAMPLE_BROKER_URL=broker_url,
                      EXAMPLE_QUEUE=queue, DJANGO_SETTINGS_MODULE=SETTINGS_MODULE)
    if str(PROJECT_DIR) not in sys.path:
        sys.path.insert(0, str(PROJECT_DIR))
    import django

    django.setup()


def _migrate() -> list[str]:
    """``manage.py migrate``; the names of the migrations it applied."""
    from django.core.management import call_command

    out = io.StringIO()
    call_command("migrate", interactive=False, verbosity=1, stdout=out)
    return APPLYING.findall(out.getvalue())


@contextlib.contextmanager
def _worker_thread() -> Iterator[None]:
    from celery.contrib.testing.worker import start_worker
    from shopsite.celery import app

    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="ERROR",
                      shutdown_timeout=20.0, hostname=f"shop-demo-{os.getpid()}@local"):
        yield


@contextlib.contextmanager
def _worker_process(scratch: Path, queue: str) -> Iterator[subprocess.Popen[bytes]]:
    """``celery -A shopsite worker`` in the project's folder, stopped (warm shutdown)
    when the block ends. It inherits this process's EXAMPLE_* settings."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PROJECT_DIR), env.get("PYTHONPATH", "")) if p)
    log_path = scratch / "worker.log"
    command = [sys.executable, "-m", "celery", "-A", "shopsite", "worker",
               "--pool=prefork", "--concurrency=2", "--loglevel=INFO", "-Q", queue,
               "--without-gossip", "--without-mingle", "--without-heartbeat",
               f"--hostname=shop-demo-{os.getpid()}@%h"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, cwd=PROJECT_DIR, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: warm shutdown; the pool processes exit with it
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if proc.returncode not in (0, -signal.SIGTERM):
            tail = log_path.read_text(errors="replace").splitlines()[-20:]
            print(f"worker exited with code {proc.returncode}; last lines of its log:",
                  *tail, sep="\n  ", file=sys.stderr)


def _wait_for_run(reference: str, deadline: float, worker: subprocess.Popen[bytes] | None,
                  queue: str) -> Any:
    """The durable run of the checkout ``reference`` once it has finished."""
    from orders.models import Order
    from shopsite.celery import app

    from celery_duraflow import get_run

    while True:
        task_id = (Order.objects.filter(checkout__reference=reference)
                   .values_list("task_id", flat=True).first())
        if task_id is not None:
            run = get_run(task_id, app=app)
            if run is not None and run.status in FINISHED:
                return run
        if worker is not None and worker.poll() is not None:
            raise DemoError(f"the worker process exited (code {worker.returncode}) before "
                            "the order was done")
        if time.monotonic() > deadline:
            if task_id is None:
                raise DemoError(f"no order was written: is a worker consuming queue "
                                f"{queue!r}?")
            raise DemoError(f"run {task_id} did not finish in time")
        time.sleep(0.1)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _report(run: Any, reference: str) -> bool:
    """Print what the run, the orders table and the payment provider say; True if it all
    is as it should be."""
    from orders.models import Charge, Order

    retried = run.attempts - 1
    print(f"run {run.task_id}: {run.status} after {_plural(run.attempts, 'attempt')} "
          f"(Celery retried it {'once' if retried == 1 else f'{retried} times'})")
    width = max(len(key) for key in STEPS)
    body_runs = {}
    for view in run.steps:
        body_runs[view.key] = view.attempts
        kind = "atomic" if STEPS.get(view.key) else "plain"
        print(f"  step {view.key:<{width}}  {kind:<6}  {view.status:<9}  "
              f"body ran {view.attempts}x")
    replayed = list(run.result.get("replayed", [])) if isinstance(run.result, dict) else []
    print(f"  attempt {run.attempts} replayed from the store: {', '.join(replayed) or 'nothing'}")

    orders = list(Order.objects.filter(checkout__reference=reference))
    order_ids = [order.pk for order in orders]
    charges = list(Charge.objects.filter(order_id__in=order_ids))
    described = "; ".join(f"order {o.pk} {o.status}, charge {o.charge_id or 'none'}"
                          for o in orders)
    print(f"orders: {_plural(len(orders), 'row')} for checkout {reference} ({described})")
    requests = sum(charge.requests for charge in charges)
    print(f"charges: {len(charges)} (the payment API got {_plural(requests, 'request')}, "
          "all with the charge-card step's idempotency key)")

    ok = (run.status == "succeeded" and run.attempts == 2 and len(orders) == 1
          and len(charges) == 1 and body_runs == EXPECTED_BODY_RUNS
          and replayed == ["save-order"] and orders[0].status == "paid")
    if ok:
        print("OK: the retry replayed save-order instead of writing the order again, and "
              "the card was charged once")
    else:
        print("UNEXPECTED: expected 1 order row, 1 charge, and save-order replayed on the "
              "second attempt")
    return ok


def _stop_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that the worker is stopped on the way out."""
    def handler(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    with contextlib.suppress(ValueError):  # not in the main thread
        signal.signal(signal.SIGTERM, handler)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    _stop_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="shop-demo-") as tmp, \
            contextlib.ExitStack() as stack:
        scratch = Path(tmp)
        database_url = args.database_url or f"sqlite:///{scratch / 'shop.sqlite3'}"
        broker_url = args.broker_url or "memory://"
        try:
            _configure(database_url, broker_url, args.queue)
        except Exception as exc:
            print(f"error: the project could not be set up: {exc}", file=sys.stderr)
            return 2
        from django.db import connections

        from celery_duraflow._store import close_all_stores

        stack.callback(close_all_stores)
        stack.callback(connections.close_all)

        print(f"database: {_describe(database_url)} (Django's 'default' alias, which "
              "also stores the durable steps)")
        if args.broker_url:
            print(f"broker: {_describe(broker_url)}, queue {args.queue!r}; worker: "
                  "`celery -A shopsite worker` (prefork x2)")
        else:
            print("broker: memory://; worker: a Celery worker thread in this process")

        try:
            applied = _migrate()
        except Exception as exc:
            print(f"error: manage.py migrate failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            return 2
        ours = [name for name in applied if name.startswith(("duraflow.", "orders."))]
        if applied:
            print(f"migrate: applied {_plural(len(applied), 'migration')}, among them "
                  f"{', '.join(ours) or 'none of duraflow or orders'}")
        else:
            print("migrate: nothing to apply, the database is up to date")

        from django.core.management import call_command

        worker: subprocess.Popen[bytes] | None = None
        if args.broker_url:
            worker = stack.enter_context(_worker_process(scratch, args.queue))
        else:
            stack.enter_context(_worker_thread())
        reference = f"co-{uuid.uuid4().hex[:12]}"
        out = io.StringIO()
        call_command("place_order", "--reference", reference, stdout=out)
        print(out.getvalue().strip())
        try:
            run = _wait_for_run(reference, time.monotonic() + args.timeout, worker,
                                args.queue)
        except DemoError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0 if _report(run, reference) else 1
