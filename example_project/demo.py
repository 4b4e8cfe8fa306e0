"""``python -m example_project``: book one trip and show what every attempt did.

Where it runs is chosen by the environment and ``--no-worker``:

* no ``CELERY_BROKER_URL``: the embedded demo. A fresh SQLite file in a
  temporary directory, the in-memory broker and a real Celery worker running
  in this process (no server needed);
* ``CELERY_BROKER_URL`` set (Redis, say) and ``DURAFLOW_DATABASE_URL`` set
  (PostgreSQL, say): the same trip through those services, with a
  ``celery -A example_project.app worker`` process started for the occasion
  (prefork, two processes) and stopped at the end;
* ``--no-worker``: as above, but the worker is already running elsewhere (the
  ``worker`` service of docker-compose.yml).

Before booking, the durable agent waits for a person's approval. Who gives it:

* by default the demo itself: once the run is ``waiting`` it shows the
  ``celery ... duraflow signal`` command a person would use, pauses a second
  and sends ``{"approved": true}`` with :func:`~celery_duraflow.send_signal`;
* ``--decline``: the same, with ``{"approved": false}``: nothing is booked;
* ``--wait-for-human``: nobody; the demo prints the exact command (with the
  settings it needs) for you to run in another shell, and waits. The command
  talks to the broker and the database, so this needs ``CELERY_BROKER_URL``.

``--naive`` runs the same agent as a plain Celery task without steps (and
without approval), to show the card being charged twice.

``--pydantic-ai`` runs the agent written with Pydantic AI instead
(:mod:`example_project.agent`, task ``book_trip_agent``): the same tools,
wrapped in ``DurableAgent(name="travel-agent")``, whose model requests and
tool calls are the steps. Its approval is the signal
``travel-agent:approval:book_flight``, answered the same ways. The model is
scripted unless ``DURAFLOW_DEMO_MODEL`` names a real one
(``openai:gpt-4o-mini``). It has no undo for the booking, so it does not
combine with ``--mailer-down`` (nor with ``--naive``).

``--mailer-down`` makes the mailer refuse every message of the trip (the demo
lists the trip in the ``mail_outages`` table before sending it, so the worker
sees it wherever it runs). The e-mail step then fails on every retry, the trip
fails for good once ``max_retries`` is used up, and celery-duraflow runs the
undo of the booking step: the booking is cancelled and the card refunded, and
the run ends ``compensated``.

The exit code is 0 when the ledger shows the expected charges and refunds
(one charge for an approved durable trip, plus one refund if the mailer was
down; nothing for a declined one; two charges for the naive agent) and the
run ended as expected, 1 when it does not, 2 when the trip could not be run
at all.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from celery.contrib.testing.worker import start_worker
from sqlalchemy.engine import make_url

from celery_duraflow import RunView, get_run, send_signal

from .app import app
from .db import ExampleDB, example_db
from .journal import COMPENSATION_PREFIX
from .planner import APPROVAL, BOOK_FLIGHT, TripRequest, is_approved
from .services import FlakyMailer, MailerDown
from .tasks import book_trip, book_trip_naive

REQUEST: TripRequest = {"origin": "LHR", "destination": "JFK", "date": "2025-06-01"}
APPROVE = {"approved": True}
DECLINE = {"approved": False}
# How long the demo lets the run sit in "waiting" before it answers for the person.
AUTO_ANSWER_DELAY = 1.0
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


@dataclass(frozen=True)
class Trip:
    """A trip sent to the workers, and what the demo keeps an eye on while it runs."""

    result: Any  # Celery's AsyncResult
    trip_id: str
    worker: subprocess.Popen[bytes] | None  # the worker process this demo started, if any
    timeout: float
    deadline: float  # time.monotonic() value after which the demo gives up

    def check(self, not_yet: str) -> None:
        """Raise DemoError if the worker process died or the time is up; sleep a little."""
        if self.worker is not None and self.worker.poll() is not None:
            raise DemoError(f"the worker process exited (code {self.worker.returncode}) "
                            "before the trip finished")
        if time.monotonic() > self.deadline:
            raise DemoError(f"{not_yet} after {self.timeout:.0f}s")
        time.sleep(0.05)

    def finish(self, *, human: bool) -> None:
        """Wait until the task has a result."""
        if human:
            not_yet = (f"no answer: run {self.trip_id} is still waiting for approval (it holds "
                       "no worker; a signal sent later wakes it for any worker on the queue)")
        else:
            not_yet = (f"no result: is a worker consuming queue "
                       f"{app.conf.task_default_queue!r}?")
        while not self.result.ready():
            self.check(not_yet)


def _cli_environment() -> dict[str, str]:
    """The settings a `celery ... duraflow signal` command in another shell needs."""
    env = {"CELERY_BROKER_URL": str(app.conf.broker_url),
           "DURAFLOW_DATABASE_URL": str(app.conf.duraflow_database_url)}
    for name in ("DURAFLOW_TABLE_PREFIX", "EXAMPLE_QUEUE"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    if Path.cwd().resolve() != PACKAGE_PARENT:
        env["PYTHONPATH"] = str(PACKAGE_PARENT)  # celery finds example_project from there
    return env


def _celery_launcher() -> list[str]:
    """``celery`` if the one on PATH belongs to this Python, else ``python -m celery``."""
    found = shutil.which("celery")
    if found and Path(found).parent.absolute() == Path(sys.executable).parent.absolute():
        return ["celery"]
    return [sys.executable, "-m", "celery"]


def _signal_command(trip_id: str, name: str, payload: dict[str, bool], *,
                   runnable: bool = False) -> str:
    """The shell command that sends the signal ``name`` to a trip.

    With ``runnable`` it carries the environment and the Python it needs, so
    that it can be pasted into another shell as it is; passwords in the URLs
    are written out too, as that shell needs them.
    """
    words = ["-A", "example_project.app", "duraflow", "signal", trip_id, name,
             json.dumps(payload)]
    if not runnable:
        return shlex.join(["celery", *words])
    assignments = [f"{key}={shlex.quote(value)}" for key, value in _cli_environment().items()]
    return " ".join([*assignments, shlex.join([*_celery_launcher(), *words])])


def _until_waiting(trip: Trip) -> RunView | None:
    """The run once it waits (for the approval), or None if it finished without waiting."""
    while not trip.result.ready():
        run = get_run(trip.trip_id, app=app)
        if run is not None and run.status == "waiting":
            return run
        trip.check("the trip never got to its approval")
    return None


def _handle_approval(trip: Trip, answer: bool | None) -> None:
    """Answer the approval the agent asks for: ``answer`` after a pause, or leave it to a person.

    The signal's name is read from the run (``waiting_for``) rather than
    assumed, so this keeps working if the agent names its wait differently.
    """
    run = _until_waiting(trip)
    if run is None or run.waiting_for is None:
        return  # it ended before asking; the summary says how
    name = run.waiting_for
    if answer is None:
        print(f"waiting for approval: run {trip.trip_id} is waiting for signal {name!r}. "
              "To approve, run this in another shell:")
        print(f"  {_signal_command(trip.trip_id, name, APPROVE, runnable=True)}")
        print(f"  (or with '{json.dumps(DECLINE)}' to decline); waiting up to "
              f"{trip.timeout:.0f}s for the trip to finish")
        return
    payload = APPROVE if answer else DECLINE
    doing = "approving" if answer else "declining"
    print(f"waiting for approval: run {trip.trip_id} is waiting for signal {name!r}; "
          f"{doing} in {AUTO_ANSWER_DELAY:g}s")
    print(f"  (by hand, against real services: "
          f"{_signal_command(trip.trip_id, name, payload)})")
    time.sleep(AUTO_ANSWER_DELAY)  # only so that the waiting run can be seen
    send_signal(trip.trip_id, name, payload, app=app)
    print(f"{'approved' if answer else 'declined'}: sent signal {name!r} with "
          f"{json.dumps(payload)}; the run resumes")


def _print_trace(db: ExampleDB, trip_id: str,
                 describe: Callable[[str], str] | None = None) -> None:
    """Print the trace; ``describe(key)`` gives the detail of a line written without one."""
    print("what each attempt did:")
    rows = db.trace(trip_id)
    width = max([15, *(len(row.step_key) for row in rows)])
    for row in rows:
        detail = row.detail or (describe(row.step_key) if describe else "")
        print(f"  attempt {row.attempt}  {row.step_key:<{width}} {row.outcome:<7} {detail}")


def _agent_step_describer(trip_id: str) -> Callable[[str], str]:
    """Describe the agent's steps from what the store recorded for them."""
    from .agent import describe_step

    run = get_run(trip_id, app=app)
    recorded = {s.key: s for s in run.steps} if run is not None else {}

    def describe(key: str) -> str:
        found = recorded.get(key)
        if found is None or found.status != "completed":
            return ""
        return describe_step(key, found.result)

    return describe


def _print_model_use(db: ExampleDB, trip_id: str) -> None:
    """How often the agent's model was asked, and how often the store answered instead."""
    from .agent import MODEL_STEP

    rows = [r for r in db.trace(trip_id) if r.step_key.split("#", 1)[0] == MODEL_STEP]
    asked = sum(r.outcome == "ran" for r in rows)
    replayed = sum(r.outcome == "cached" for r in rows)
    print(f"model: asked {_plural(asked, 'time')}; {_plural(replayed, 'answer')} replayed "
          "from the store on later attempts, without asking it again")


def _undone(run: RunView) -> list[str]:
    """The keys of the steps whose undo is recorded as completed, in the order they ran."""
    return [s.key.removeprefix(COMPENSATION_PREFIX) for s in run.steps
            if s.key.startswith(COMPENSATION_PREFIX) and s.status == "completed"]


def _is_scripted_approval(key: str) -> bool:
    return key.split("#")[0] == APPROVAL


def _print_durable_summary(
        trip_id: str, *, is_approval: Callable[[str], bool] = _is_scripted_approval,
        approves: Callable[[Any], bool] = is_approved) -> tuple[RunView | None, bool | None]:
    """Print what celery-duraflow recorded for the run.

    Returns the run (None if nothing was recorded) and the answer recorded at
    the approval wait (None if the run never got one). ``is_approval`` tells
    the approval wait's key, ``approves`` whether its payload says yes.
    """
    run = get_run(trip_id, app=app)
    if run is None:
        print("duraflow: no run recorded for this trip")
        return None, None
    # A wait's row is written twice (when it starts waiting, when it ends), which its
    # attempt counter shows as 2; it has no body, so it is left out here.
    retried = ", ".join(f"{s.key} x{s.attempts}" for s in run.steps
                        if s.attempts > 1 and not is_approval(s.key))
    if run.status == "succeeded":
        completed = [s for s in run.steps if s.status == "completed"]
        done = f"{len(completed)}/{len(run.steps)} steps completed"
    else:
        done = f"undone: {', '.join(_undone(run)) or 'nothing'}"
    print(f"duraflow: run {run.status} after {run.attempts} attempts; {done}; "
          f"bodies run more than once: {retried or 'none'}")
    if run.status not in ("succeeded", "compensated") and run.error:
        print(f"duraflow: the run's error: {run.error}")
    approved: bool | None = None
    wait = next((s for s in run.steps if is_approval(s.key)), None)
    if wait is not None and wait.status == "completed":
        approved = approves(wait.result.get("payload"))
    return run, approved


def _run_as_expected(run: RunView | None, result: Any, *, failed_for_good: bool) -> bool:
    """Whether the durable run ended as it should.

    A trip that failed for good must have failed with the mailer's error and
    had its booking undone; any other must have succeeded with every step
    completed.
    """
    if run is None:
        return False
    if failed_for_good:
        return (run.status == "compensated" and _undone(run) == [BOOK_FLIGHT]
                and result.failed() and isinstance(result.result, MailerDown))
    return (bool(result.successful()) and run.status == "succeeded"
            and all(s.status == "completed" for s in run.steps))


def _install_sigterm_handler() -> None:
    # Turn SIGTERM into an exception so the finally blocks stop the worker.
    def _handler(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    with contextlib.suppress(ValueError):  # not in the main thread
        signal.signal(signal.SIGTERM, _handler)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def run_demo(*, naive: bool, start_own_worker: bool, timeout: float, user: str,
             answer: bool | None = True, mailer_down: bool = False,
             pydantic_ai: bool = False) -> int:
    """Book one trip and print what happened; return the exit code.

    ``answer`` is what the demo replies when the durable agent asks for
    approval: True (approve), False (decline), or None to leave it to a
    person (``--wait-for-human``). ``mailer_down`` makes the mailer refuse
    every message of this trip, so that it fails for good after booking.
    ``pydantic_ai`` runs the Pydantic AI agent (``book_trip_agent``).
    """
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

        task: Any = book_trip_naive if naive else book_trip
        model = ""
        if pydantic_ai:
            # Imported here: it needs the pydantic-ai extra, which the other modes do not.
            from .agent import book_trip_agent, describe_model

            task = book_trip_agent
            kind = ("Pydantic AI agent: DurableAgent(name='travel-agent') in a DurableTask "
                    "+ autoretry; approval by signal")
            model = describe_model()
        elif naive:
            kind = "naive agent: plain Celery task + autoretry, no steps, no approval"
        else:
            kind = "durable agent: DurableTask + step() + autoretry + wait_for_signal()"
        if in_memory:
            where = "in-process worker, memory:// broker"
        elif start_own_worker:
            where = "`celery -A example_project.app worker` (prefork x2)"
        else:
            where = "a worker started elsewhere (--no-worker)"
        print(f"{kind}")
        if model:
            print(model)
        print(f"database {_describe_url(str(app.conf.duraflow_database_url))}; {where}")

        worker: subprocess.Popen[bytes] | None = None
        if in_memory:
            stack.enter_context(_in_process_worker())
        elif start_own_worker:
            worker = stack.enter_context(_worker_process(scratch))

        # The trip's id is chosen here rather than by Celery, so that the mailer can be
        # told about the trip before any worker gets a chance to run it.
        trip_id = str(uuid.uuid4())
        if mailer_down:
            FlakyMailer(db).go_down_for(trip_id)
        result = task.apply_async((user, REQUEST), task_id=trip_id)
        trip = Trip(result=result, trip_id=trip_id, worker=worker, timeout=timeout,
                    deadline=time.monotonic() + timeout)
        print(f"trip {trip.trip_id} for {user}: {REQUEST['origin']} -> "
              f"{REQUEST['destination']} on {REQUEST['date']}")
        if mailer_down:
            print("the mailer is down for this trip: every e-mail will be refused")
        if not naive:
            _handle_approval(trip, answer)
        trip.finish(human=not naive and answer is None)

        _print_trace(db, trip.trip_id,
                     _agent_step_describer(trip.trip_id) if pydantic_ai else None)
        if pydantic_ai:
            _print_model_use(db, trip.trip_id)
        if result.successful():
            print(f"result: {result.result['answer']}")
        else:
            print(f"result: {result.state} ({result.result!r})")
        # Only a booked trip reaches the mailer, so only a booked trip can fail for good.
        failed_for_good = False
        if naive:
            healthy = bool(result.successful())
            expected_charges = 2
        else:
            if pydantic_ai:
                from .agent import agent_approved, is_approval_key

                run, approved = _print_durable_summary(
                    trip.trip_id, is_approval=is_approval_key, approves=agent_approved)
            else:
                run, approved = _print_durable_summary(trip.trip_id)
            failed_for_good = mailer_down and bool(approved)
            # A person may answer either way; the demo's own answer must be the one recorded.
            healthy = (approved is not None and (answer is None or approved == answer)
                       and _run_as_expected(run, result, failed_for_good=failed_for_good))
            expected_charges = 1 if approved else 0
        expected_refunds = 1 if failed_for_good else 0

        charges, refunds = db.charges(trip.trip_id), db.refunds(trip.trip_id)
        ok = healthy and (charges, refunds) == (expected_charges, expected_refunds)
        if not ok:
            verdict = "UNEXPECTED"
        elif naive:
            verdict = "the retry booked and charged again"
        elif failed_for_good:
            verdict = "the booking was cancelled and refunded"
        elif expected_charges:
            verdict = "the retry reused the booking"
        else:
            verdict = "the booking was declined, so nothing was charged"
        print(f"ledger: {_plural(charges, 'charge')}, {_plural(refunds, 'refund')} for this "
              f"trip (expected {expected_charges} and {expected_refunds}): {verdict}")
        return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m example_project",
        description="Book a flight with an agent that asks for approval before it books "
                    "and whose e-mail step fails once, and count how many times the card "
                    "was charged.")
    parser.add_argument("--naive", action="store_true",
                        help="run the agent as a plain Celery task without durable steps "
                             "or approval (the card is charged twice)")
    answers = parser.add_mutually_exclusive_group()
    answers.add_argument("--decline", action="store_true",
                         help="answer the approval with no instead of yes (nothing is "
                              "booked or charged)")
    answers.add_argument("--wait-for-human", action="store_true",
                         help="do not answer the approval: print the `celery ... duraflow "
                              "signal` command that does, and wait for someone to run it "
                              "(needs CELERY_BROKER_URL)")
    parser.add_argument("--pydantic-ai", action="store_true",
                        help="run the agent written with Pydantic AI, wrapped in "
                             "DurableAgent: its model requests and tool calls are the steps "
                             "(a scripted model unless DURAFLOW_DEMO_MODEL names a real one, "
                             "e.g. openai:gpt-4o-mini)")
    parser.add_argument("--mailer-down", action="store_true",
                        help="make the mailer refuse every e-mail of this trip: the retries "
                             "run out, the trip fails for good, and the booking is "
                             "cancelled and refunded (its compensation)")
    parser.add_argument("--no-worker", action="store_true",
                        help="do not start a worker: one is already consuming from "
                             "CELERY_BROKER_URL (e.g. the compose `worker` service)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds to wait for the trip to finish (default: 60, or 600 "
                             "with --wait-for-human)")
    parser.add_argument("--user", default="alice", help="who is travelling (default: alice)")
    args = parser.parse_args(argv)

    in_memory = str(app.conf.broker_url).startswith("memory://")
    if args.no_worker and in_memory:
        parser.error("--no-worker needs a broker a separate worker can reach: set "
                     "CELERY_BROKER_URL (e.g. redis://localhost:6379/0)")
    if args.wait_for_human and in_memory:
        parser.error("--wait-for-human needs a broker the `celery` command in another shell "
                     "can reach: set CELERY_BROKER_URL (e.g. redis://localhost:6379/0) and "
                     "DURAFLOW_DATABASE_URL")
    if args.naive and (args.decline or args.wait_for_human):
        parser.error("the naive agent does not ask for approval: --decline and "
                     "--wait-for-human apply to the durable one")
    if args.mailer_down and args.naive:
        parser.error("the naive agent has no compensation to show: --mailer-down applies "
                     "to the durable one")
    if args.pydantic_ai and args.naive:
        parser.error("--naive and --pydantic-ai are two different agents: choose one")
    if args.pydantic_ai and args.mailer_down:
        parser.error("the Pydantic AI agent has no undo for its booking: --mailer-down "
                     "applies to the scripted durable agent")
    if args.mailer_down and args.decline:
        parser.error("a declined trip books nothing and sends no e-mail: --mailer-down "
                     "needs the booking to be approved")
    timeout = args.timeout if args.timeout is not None else (
        600.0 if args.wait_for_human else 60.0)
    answer = None if args.wait_for_human else not args.decline

    # Whoever reads this output from a pipe (a test, `tee`) needs each line as it comes:
    # the approval command is printed long before the demo ends.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
    _install_sigterm_handler()
    try:
        return run_demo(naive=args.naive, start_own_worker=not args.no_worker,
                        timeout=timeout, user=args.user, answer=answer,
                        mailer_down=args.mailer_down, pydantic_ai=args.pydantic_ai)
    except DemoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
