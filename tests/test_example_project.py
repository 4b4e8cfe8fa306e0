"""The example project: the essay's flight-booking agent, run the way a user runs it.

The demo is started as ``python -m example_project`` in a subprocess, from an
empty directory and with an environment that holds little more than PATH, and
the tests read what it prints and what it left in the database (a SQLite file
the test chose, or PostgreSQL in the real-services mode). The approval the
agent waits for is given by the demo itself, or, with ``--wait-for-human``, by
the test running the real ``celery ... duraflow signal`` command. With
``--mailer-down`` the trip fails for good after booking, and the booking's
undo cancels it and refunds the card.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy import create_engine, func, select

from celery_duraflow import RunView, get_run
from celery_duraflow._store import close_all_stores
from example_project.db import ExampleDB, build_tables
from example_project.journal import COMPENSATION_PREFIX
from example_project.planner import (
    APPROVAL,
    BOOK_FLIGHT,
    DONE,
    NOTIFY_USER,
    PICK_BEST,
    SEARCH_FLIGHTS,
    Observation,
    ScriptedPlanner,
    is_approved,
)
from example_project.services import FakeAirline, FlakyMailer, Flight, MailerDown, UnknownBooking
from tests.conftest import drop_tables

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_TIMEOUT = 120.0
TRACE_LINE = re.compile(r"^\s+attempt (\d+)\s+(\S+)\s+(ran|cached|failed|waiting)\b",
                        re.MULTILINE)
TRIP_LINE = re.compile(r"^trip (\S+) for ", re.MULTILINE)
APPROVED = {"approved": True}
# Every step of an approved trip, in the order the run first reached them.
APPROVED_STEP_KEYS = ["plan", SEARCH_FLIGHTS, "plan#2", PICK_BEST, "plan#3", APPROVAL,
                      BOOK_FLIGHT, "plan#4", NOTIFY_USER, "plan#5"]
UNDO_BOOKING = COMPENSATION_PREFIX + BOOK_FLIGHT
# With the mailer down: the steps up to the e-mail that never went out, then the undo.
COMPENSATED_STEP_KEYS = [*APPROVED_STEP_KEYS[:-1], UNDO_BOOKING]
# The task's max_retries: the e-mail is tried once more than that before the trip fails.
MAX_RETRIES = 3
# The Pydantic AI variant (`--pydantic-ai`): DurableAgent(name="travel-agent") names its steps.
AGENT_MODEL = "travel-agent:model"
AGENT_APPROVAL = "travel-agent:approval:book_flight"
AGENT_TOOLS = [f"travel-agent:tool:{tool}"
               for tool in (SEARCH_FLIGHTS, PICK_BEST, BOOK_FLIGHT, NOTIFY_USER)]
# Every step of its approved trip, in the order the run first reached them: one model
# request before each tool call, the approval before the booking, and the final answer.
AGENT_STEP_KEYS = [AGENT_MODEL, AGENT_TOOLS[0], f"{AGENT_MODEL}#2", AGENT_TOOLS[1],
                   f"{AGENT_MODEL}#3", AGENT_APPROVAL, AGENT_TOOLS[2], f"{AGENT_MODEL}#4",
                   AGENT_TOOLS[3], f"{AGENT_MODEL}#5"]


def _env(**extra: str) -> dict[str, str]:
    """PATH, the repository on PYTHONPATH (the example is not installed), and ``extra``."""
    env = {"PATH": os.environ.get("PATH", os.defpath), "PYTHONPATH": str(REPO_ROOT)}
    if "COVERAGE_PROCESS_START" in os.environ:  # let subprocess coverage keep working
        env["COVERAGE_PROCESS_START"] = os.environ["COVERAGE_PROCESS_START"]
    env.update(extra)
    return env


def _run_demo(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "example_project", *args]
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=DEMO_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the demo turns SIGTERM into a clean stop of its worker
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"the demo did not finish in {DEMO_TIMEOUT:.0f}s\nstdout:\n{out}\n"
                    f"stderr:\n{err}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _trip_id(stdout: str) -> str:
    match = TRIP_LINE.search(stdout)
    assert match is not None, stdout
    return match.group(1)


def _ledger_charges(url: str, example_prefix: str, trip_id: str) -> int:
    """The charges for a trip, counted in the database itself (not from the demo's output)."""
    ledger = build_tables(example_prefix).ledger
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(ledger)
                                    .where(ledger.c.trip_id == trip_id)).scalar_one())
    finally:
        engine.dispose()


def _refunded(url: str, example_prefix: str, trip_id: str) -> list[tuple[str, int]]:
    """The (booking reference, amount) of every refund of a trip, read from the database."""
    refunds = build_tables(example_prefix).refunds
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(refunds.c.booking_ref, refunds.c.amount_cents)
                                .where(refunds.c.trip_id == trip_id))
            return [(ref, amount) for ref, amount in rows]
    finally:
        engine.dispose()


def _recorded_run(url: str, trip_id: str, table_prefix: str = "duraflow_") -> RunView | None:
    """What celery-duraflow recorded for a trip, read through a Celery app of our own."""
    app = Celery("example-check", set_as_current=False)
    app.conf.update(duraflow_database_url=url, duraflow_table_prefix=table_prefix)
    try:
        return get_run(trip_id, app=app)
    finally:
        close_all_stores()


def _approval_payload(run: RunView, key: str = APPROVAL) -> object:
    """The payload the run's approval wait received."""
    wait = run.step(key)
    assert wait.status == "completed", wait
    return wait.result["payload"]


def _trace(stdout: str) -> list[tuple[int, str, str]]:
    """The (attempt, step key, outcome) lines the demo printed."""
    return [(int(a), key, outcome) for a, key, outcome in TRACE_LINE.findall(stdout)]


def _outcomes(trace: list[tuple[int, str, str]], key: str) -> list[tuple[int, str]]:
    return [(attempt, outcome) for attempt, k, outcome in trace if k == key]


def _explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def _check_replays(trace: list[tuple[int, str, str]]) -> None:
    """Every attempt replays, in order, exactly what the attempts before it finished."""
    for attempt in range(2, max(a for a, _, _ in trace) + 1):
        finished = [key for a, key, outcome in trace
                    if a == attempt - 1 and outcome in ("ran", "cached")]
        cached = [key for a, key, outcome in trace if a == attempt and outcome == "cached"]
        assert cached == finished, (attempt, trace)


def _check_durable_trace(trace: list[tuple[int, str, str]]) -> None:
    """Attempt 1 waits for approval, 2 books and fails to e-mail, 3 e-mails."""
    assert _outcomes(trace, APPROVAL) == [(1, "waiting"), (2, "ran"), (3, "cached")]
    assert _outcomes(trace, BOOK_FLIGHT) == [(2, "ran"), (3, "cached")]
    assert _outcomes(trace, NOTIFY_USER) == [(2, "failed"), (3, "ran")]
    _check_replays(trace)
    assert max(attempt for attempt, _, _ in trace) == 3


def _check_approved_run(run: RunView | None) -> None:
    """The store's side of an approved trip: done, every step once, the approval kept."""
    assert run is not None and run.status == "succeeded"
    assert [s.key for s in run.steps] == APPROVED_STEP_KEYS
    assert all(s.status == "completed" for s in run.steps)
    assert _approval_payload(run) == APPROVED
    assert run.step(BOOK_FLIGHT).attempts == 1
    assert run.step(NOTIFY_USER).attempts == 2


def _check_compensated_trace(trace: list[tuple[int, str, str]]) -> None:
    """Attempt 1 waits, 2 books, every attempt fails to e-mail, the last one undoes the booking."""
    last = 2 + MAX_RETRIES
    assert _outcomes(trace, APPROVAL) == [(1, "waiting"), (2, "ran"),
                                          *((a, "cached") for a in range(3, last + 1))]
    assert _outcomes(trace, BOOK_FLIGHT) == [(2, "ran"),
                                             *((a, "cached") for a in range(3, last + 1))]
    assert _outcomes(trace, NOTIFY_USER) == [(a, "failed") for a in range(2, last + 1)]
    assert _outcomes(trace, UNDO_BOOKING) == [(last, "ran")]
    assert trace[-1][1] == UNDO_BOOKING  # the undo runs after the last failure
    _check_replays(trace)
    assert max(attempt for attempt, _, _ in trace) == last


def _check_compensated_run(run: RunView | None) -> str:
    """The store's side of a trip whose mailer was down; returns the booking's reference."""
    assert run is not None and run.status == "compensated", run
    assert [s.key for s in run.steps] == COMPENSATED_STEP_KEYS
    assert _approval_payload(run) == APPROVED
    failed = [s.key for s in run.steps if s.status != "completed"]
    assert failed == [NOTIFY_USER]
    assert run.step(NOTIFY_USER).attempts == 1 + MAX_RETRIES
    assert run.error is not None and "MailerDown" in run.error
    booking = run.step(BOOK_FLIGHT)
    assert booking.attempts == 1
    undo = run.step(UNDO_BOOKING)
    assert undo.status == "completed" and undo.attempts == 1
    assert undo.result == {"booking_ref": booking.result["booking_ref"],
                           "amount_cents": booking.result["amount_cents"]}
    ref: str = booking.result["booking_ref"]
    return ref


def _check_agent_trace(trace: list[tuple[int, str, str]]) -> None:
    """The Pydantic AI agent: later attempts replay the model's answers and the tools' results."""
    model = [(a, key, outcome) for a, key, outcome in trace if key.split("#")[0] == AGENT_MODEL]
    # Attempt 1 asks three times and waits; 2 replays those, asks once more and fails to
    # e-mail; 3 replays four answers and asks for the last one.
    assert [(a, o) for a, _, o in model] == [
        (1, "ran"), (1, "ran"), (1, "ran"),
        (2, "cached"), (2, "cached"), (2, "cached"), (2, "ran"),
        (3, "cached"), (3, "cached"), (3, "cached"), (3, "cached"), (3, "ran")], trace
    for tool in AGENT_TOOLS:  # each tool's body ran once, whatever it took to get there
        assert [o for _, key, o in trace if key == tool].count("ran") == 1, (tool, trace)
    assert _outcomes(trace, AGENT_APPROVAL) == [(1, "waiting"), (2, "ran"), (3, "cached")]
    assert _outcomes(trace, AGENT_TOOLS[2]) == [(2, "ran"), (3, "cached")]
    assert _outcomes(trace, AGENT_TOOLS[3]) == [(2, "failed"), (3, "ran")]
    _check_replays(trace)
    assert max(attempt for attempt, _, _ in trace) == 3


def _check_agent_run(run: RunView | None) -> None:
    """The store's side of the agent's approved trip: every model request and tool call once."""
    assert run is not None and run.status == "succeeded", run
    assert [s.key for s in run.steps] == AGENT_STEP_KEYS
    assert all(s.status == "completed" for s in run.steps)
    assert _approval_payload(run, AGENT_APPROVAL) == APPROVED
    assert run.step(AGENT_TOOLS[2]).attempts == 1
    assert run.step(AGENT_TOOLS[3]).attempts == 2
    assert run.result["booking"]["booking_ref"] == run.step(AGENT_TOOLS[2]).result["booking_ref"]


def _check_naive_trace(trace: list[tuple[int, str, str]]) -> None:
    assert _outcomes(trace, BOOK_FLIGHT) == [(1, "ran"), (2, "ran")]
    assert _outcomes(trace, NOTIFY_USER) == [(1, "failed"), (2, "ran")]
    assert all(outcome != "cached" for _, _, outcome in trace)


# -- the embedded demo (no server) --------------------------------------------------------


def test_embedded_demo_charges_once_and_replays_cached_steps(tmp_path: Path) -> None:
    """`python -m example_project` with no settings: approved, one charge, replays from SQLite."""
    result = _run_demo(cwd=tmp_path, env=_env())
    assert result.returncode == 0, _explain(result)
    trip_id = _trip_id(result.stdout)
    assert (f"waiting for approval: run {trip_id} is waiting for signal 'approval'; "
            "approving in 1s") in result.stdout, _explain(result)
    assert (f"celery -A example_project.app duraflow signal {trip_id} approval "
            "'{\"approved\": true}'") in result.stdout
    assert "approved: sent signal 'approval'" in result.stdout
    assert ("ledger: 1 charge, 0 refunds for this trip (expected 1 and 0): "
            "the retry reused the booking") in result.stdout, _explain(result)
    assert "in-process worker, memory:// broker" in result.stdout
    assert "mailer is down" not in result.stdout
    assert "duraflow: run succeeded after 3 attempts" in result.stdout
    _check_durable_trace(_trace(result.stdout))
    assert list(tmp_path.iterdir()) == []  # its SQLite file lived in a temporary directory


@pytest.mark.long
def test_embedded_demo_auto_approval_is_recorded_in_the_store(tmp_path: Path) -> None:
    """The embedded demo on a SQLite file of ours: the store and the ledger agree with it."""
    url = f"sqlite:///{tmp_path / 'demo.sqlite3'}"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    result = _run_demo(cwd=workdir, env=_env(DURAFLOW_DATABASE_URL=url))
    assert result.returncode == 0, _explain(result)
    trip_id = _trip_id(result.stdout)
    assert f"run {trip_id} is waiting for signal 'approval'" in result.stdout
    assert _ledger_charges(url, "example_", trip_id) == 1
    _check_approved_run(_recorded_run(url, trip_id))


@pytest.mark.long
def test_embedded_demo_decline_books_nothing(tmp_path: Path) -> None:
    """`--decline`: the agent stops at the approval, books nothing, and the run succeeds."""
    url = f"sqlite:///{tmp_path / 'demo.sqlite3'}"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    result = _run_demo("--decline", cwd=workdir, env=_env(DURAFLOW_DATABASE_URL=url))
    assert result.returncode == 0, _explain(result)
    assert "declined: sent signal 'approval'" in result.stdout, _explain(result)
    assert ("ledger: 0 charges, 0 refunds for this trip (expected 0 and 0)"
            in result.stdout), _explain(result)
    trace = _trace(result.stdout)
    assert _outcomes(trace, APPROVAL) == [(1, "waiting"), (2, "ran")]
    assert _outcomes(trace, BOOK_FLIGHT) == [] and _outcomes(trace, NOTIFY_USER) == []
    _check_replays(trace)

    trip_id = _trip_id(result.stdout)
    assert _ledger_charges(url, "example_", trip_id) == 0
    run = _recorded_run(url, trip_id)
    assert run is not None and run.status == "succeeded"
    assert not is_approved(_approval_payload(run))
    assert run.result["booking"] is None and "declined" in run.result["answer"]
    assert [s.key for s in run.steps] == APPROVED_STEP_KEYS[:6]  # up to the approval


def test_naive_demo_charges_the_card_twice(tmp_path: Path) -> None:
    """`--naive` reruns the whole agent on retry: booked and charged twice, exit code 0."""
    result = _run_demo("--naive", cwd=tmp_path, env=_env())
    assert result.returncode == 0, _explain(result)
    assert ("ledger: 2 charges, 0 refunds for this trip (expected 2 and 0)"
            in result.stdout), _explain(result)
    _check_naive_trace(_trace(result.stdout))


def test_embedded_demo_mailer_down_cancels_and_refunds_the_booking(tmp_path: Path) -> None:
    """`--mailer-down`: the retries run out, the run is compensated, the card refunded once."""
    url = f"sqlite:///{tmp_path / 'demo.sqlite3'}"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    result = _run_demo("--mailer-down", cwd=workdir, env=_env(DURAFLOW_DATABASE_URL=url))
    assert result.returncode == 0, _explain(result)
    trip_id = _trip_id(result.stdout)
    assert "the mailer is down for this trip" in result.stdout, _explain(result)
    assert "result: FAILURE (MailerDown(" in result.stdout, _explain(result)
    assert (f"duraflow: run compensated after {2 + MAX_RETRIES} attempts; undone: book_flight;"
            in result.stdout), _explain(result)
    assert ("ledger: 1 charge, 1 refund for this trip (expected 1 and 1): the booking was "
            "cancelled and refunded") in result.stdout, _explain(result)
    assert "cancel-booking: booking PNR-" in result.stdout, _explain(result)
    assert "Traceback" not in result.stderr, _explain(result)  # an expected failure
    _check_compensated_trace(_trace(result.stdout))

    ref = _check_compensated_run(_recorded_run(url, trip_id))
    assert _ledger_charges(url, "example_", trip_id) == 1
    db = ExampleDB(url)
    try:
        assert (db.charges(trip_id), db.refunds(trip_id)) == (1, 1)
    finally:
        db.dispose()
    [(refunded_ref, amount)] = _refunded(url, "example_", trip_id)
    assert refunded_ref == ref and amount > 0


def test_pydantic_ai_demo_replays_model_requests_and_tool_calls(tmp_path: Path) -> None:
    """`--pydantic-ai` on SQLite: attempt 2 replays the model's answers; one charge."""
    url = f"sqlite:///{tmp_path / 'demo.sqlite3'}"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    result = _run_demo("--pydantic-ai", cwd=workdir, env=_env(DURAFLOW_DATABASE_URL=url))
    assert result.returncode == 0, _explain(result)
    trip_id = _trip_id(result.stdout)
    assert "DurableAgent(name='travel-agent')" in result.stdout, _explain(result)
    assert "a scripted FunctionModel" in result.stdout, _explain(result)
    assert (f"run {trip_id} is waiting for signal {AGENT_APPROVAL!r}; approving in 1s"
            in result.stdout), _explain(result)
    assert (f"duraflow signal {trip_id} {AGENT_APPROVAL} '{{\"approved\": true}}'"
            in result.stdout), _explain(result)
    assert f"approved: sent signal {AGENT_APPROVAL!r}" in result.stdout
    assert "model: asked 5 times; 7 answers replayed from the store" in result.stdout
    assert ("ledger: 1 charge, 0 refunds for this trip (expected 1 and 0): "
            "the retry reused the booking") in result.stdout, _explain(result)
    assert "duraflow: run succeeded after 3 attempts" in result.stdout
    _check_agent_trace(_trace(result.stdout))
    assert _ledger_charges(url, "example_", trip_id) == 1
    _check_agent_run(_recorded_run(url, trip_id))


@pytest.mark.long
def test_pydantic_ai_demo_decline_books_nothing(tmp_path: Path) -> None:
    """`--pydantic-ai --decline`: book_flight never runs, the model is told, nothing charged."""
    url = f"sqlite:///{tmp_path / 'demo.sqlite3'}"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    result = _run_demo("--pydantic-ai", "--decline", cwd=workdir,
                       env=_env(DURAFLOW_DATABASE_URL=url))
    assert result.returncode == 0, _explain(result)
    assert ("ledger: 0 charges, 0 refunds for this trip (expected 0 and 0)"
            in result.stdout), _explain(result)
    trace = _trace(result.stdout)
    assert _outcomes(trace, AGENT_APPROVAL) == [(1, "waiting"), (2, "ran")]
    assert [o for _, key, o in trace if key in (AGENT_TOOLS[2], AGENT_TOOLS[3])
            and o == "ran"] == []
    _check_replays(trace)
    trip_id = _trip_id(result.stdout)
    assert _ledger_charges(url, "example_", trip_id) == 0
    run = _recorded_run(url, trip_id)
    assert run is not None and run.status == "succeeded", run
    assert run.result["booking"] is None and "declined" in run.result["answer"]


@pytest.mark.parametrize(("args", "complaint"), [
    (["--no-worker"], "CELERY_BROKER_URL"),
    (["--wait-for-human"], "CELERY_BROKER_URL"),
    (["--naive", "--decline"], "naive agent does not ask for approval"),
    (["--decline", "--wait-for-human"], "not allowed with argument"),
    (["--mailer-down", "--naive"], "naive agent has no compensation"),
    (["--mailer-down", "--decline"], "declined trip books nothing"),
    (["--pydantic-ai", "--naive"], "two different agents"),
    (["--pydantic-ai", "--mailer-down"], "no undo for its booking"),
], ids=["no-worker", "wait-for-human", "naive-decline", "decline-and-wait",
        "mailer-down-naive", "mailer-down-decline", "pydantic-ai-naive",
        "pydantic-ai-mailer-down"])
def test_flags_that_cannot_work_are_refused(tmp_path: Path, args: list[str],
                                            complaint: str) -> None:
    """With the in-memory broker no other process can reach the run: a usage error, no hang."""
    result = _run_demo(*args, cwd=tmp_path, env=_env())
    assert result.returncode == 2, _explain(result)
    assert complaint in result.stderr, _explain(result)


# -- PostgreSQL + Redis + a real `celery worker` process ------------------------------------


@pytest.fixture
def services_env(pg_url: str, redis_url: str, table_prefix: str) -> Iterator[dict[str, str]]:
    """Environment for the demo on this test's own tables and queue; cleaned up afterwards."""
    queue = f"example-{uuid.uuid4().hex[:10]}"
    example_prefix = f"{table_prefix}ex_"
    yield _env(DURAFLOW_DATABASE_URL=pg_url, CELERY_BROKER_URL=redis_url,
               DURAFLOW_TABLE_PREFIX=table_prefix, EXAMPLE_TABLE_PREFIX=example_prefix,
               EXAMPLE_QUEUE=queue)
    close_all_stores()
    drop_tables(pg_url, table_prefix)
    db = ExampleDB(pg_url, example_prefix)
    try:
        db.drop_tables()
    finally:
        db.dispose()
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
    finally:
        client.close()


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.subprocess
@pytest.mark.parametrize("naive", [False, True], ids=["durable", "naive"])
def test_demo_against_postgres_redis_and_a_worker_process(
        tmp_path: Path, services_env: dict[str, str], naive: bool) -> None:
    """With Postgres, Redis and a prefork worker process the ledger shows 1 (durable) or 2."""
    args = ["--naive"] if naive else []
    result = _run_demo(*args, cwd=tmp_path, env=services_env)
    assert result.returncode == 0, _explain(result)
    assert "`celery -A example_project.app worker` (prefork x2)" in result.stdout
    assert "worker exited with code" not in result.stderr, _explain(result)
    expected = 2 if naive else 1
    trace = _trace(result.stdout)
    if naive:
        _check_naive_trace(trace)
    else:
        _check_durable_trace(trace)

    # Check the database directly, not only what the demo printed.
    trip_id = _trip_id(result.stdout)
    url = services_env["DURAFLOW_DATABASE_URL"]
    assert _ledger_charges(url, services_env["EXAMPLE_TABLE_PREFIX"], trip_id) == expected
    run = _recorded_run(url, trip_id, services_env["DURAFLOW_TABLE_PREFIX"])
    if naive:
        assert run is None  # a plain Celery task leaves no run behind
    else:
        _check_approved_run(run)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.subprocess
def test_pydantic_ai_demo_against_postgres_redis_and_a_worker_process(
        tmp_path: Path, services_env: dict[str, str]) -> None:
    """`--pydantic-ai` through Redis and a prefork worker: replayed model requests, 1 charge."""
    result = _run_demo("--pydantic-ai", cwd=tmp_path, env=services_env)
    assert result.returncode == 0, _explain(result)
    assert "`celery -A example_project.app worker` (prefork x2)" in result.stdout
    assert "worker exited with code" not in result.stderr, _explain(result)
    assert ("ledger: 1 charge, 0 refunds for this trip (expected 1 and 0)"
            in result.stdout), _explain(result)
    _check_agent_trace(_trace(result.stdout))

    trip_id = _trip_id(result.stdout)
    url = services_env["DURAFLOW_DATABASE_URL"]
    assert _ledger_charges(url, services_env["EXAMPLE_TABLE_PREFIX"], trip_id) == 1
    _check_agent_run(_recorded_run(url, trip_id, services_env["DURAFLOW_TABLE_PREFIX"]))


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.subprocess
@pytest.mark.long
def test_mailer_down_against_postgres_redis_and_a_worker_process(
        tmp_path: Path, services_env: dict[str, str]) -> None:
    """`--mailer-down` through Redis and a prefork worker: compensated, 1 charge, 1 refund."""
    result = _run_demo("--mailer-down", cwd=tmp_path, env=services_env)
    assert result.returncode == 0, _explain(result)
    assert "`celery -A example_project.app worker` (prefork x2)" in result.stdout
    assert "worker exited with code" not in result.stderr, _explain(result)
    assert "result: FAILURE (MailerDown(" in result.stdout, _explain(result)
    assert ("ledger: 1 charge, 1 refund for this trip (expected 1 and 1)"
            in result.stdout), _explain(result)
    _check_compensated_trace(_trace(result.stdout))

    trip_id = _trip_id(result.stdout)
    url = services_env["DURAFLOW_DATABASE_URL"]
    example_prefix = services_env["EXAMPLE_TABLE_PREFIX"]
    ref = _check_compensated_run(
        _recorded_run(url, trip_id, services_env["DURAFLOW_TABLE_PREFIX"]))
    assert _ledger_charges(url, example_prefix, trip_id) == 1
    [(refunded_ref, _amount)] = _refunded(url, example_prefix, trip_id)
    assert refunded_ref == ref


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.subprocess
@pytest.mark.parametrize("agent", [False, True], ids=["scripted", "pydantic-ai"])
def test_wait_for_human_is_answered_with_the_celery_command(
        tmp_path: Path, services_env: dict[str, str], agent: bool) -> None:
    """`--wait-for-human`: the run waits until `celery ... duraflow signal` approves it."""
    approval = AGENT_APPROVAL if agent else APPROVAL
    command = [sys.executable, "-m", "example_project", "--wait-for-human",
               "--timeout", str(DEMO_TIMEOUT / 2), *(["--pydantic-ai"] if agent else [])]
    proc = subprocess.Popen(command, cwd=tmp_path, env=services_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    # If the demo hangs, stop it, so that reading its output below comes to an end.
    watchdog = threading.Timer(DEMO_TIMEOUT, proc.terminate)
    watchdog.start()
    try:
        assert proc.stdout is not None
        seen: list[str] = []
        while not any("duraflow signal" in line for line in seen):
            line = proc.stdout.readline()
            assert line, "the demo ended without printing the signal command:\n" + "".join(seen)
            seen.append(line)
        trip_id = _trip_id("".join(seen))
        printed = seen[-1]
        assert f"CELERY_BROKER_URL={services_env['CELERY_BROKER_URL']}" in printed
        assert f"DURAFLOW_TABLE_PREFIX={services_env['DURAFLOW_TABLE_PREFIX']}" in printed
        assert f"duraflow signal {trip_id} {approval} '{{\"approved\": true}}'" in printed

        # Nobody answered yet: the run waits, and nothing is charged.
        url = services_env["DURAFLOW_DATABASE_URL"]
        prefix = services_env["DURAFLOW_TABLE_PREFIX"]
        waiting = _recorded_run(url, trip_id, prefix)
        assert waiting is not None and waiting.status == "waiting"
        assert (waiting.wait_kind, waiting.waiting_for) == ("signal", approval)
        assert _ledger_charges(url, services_env["EXAMPLE_TABLE_PREFIX"], trip_id) == 0

        signal = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "example_project.app", "duraflow", "signal",
             trip_id, approval, json.dumps(APPROVED)],
            cwd=tmp_path, env=services_env, capture_output=True, text=True, timeout=60)
        assert signal.returncode == 0, signal.stderr
        assert f"signal {approval!r} stored for {trip_id}" in signal.stdout

        rest = proc.stdout.read()
        returncode = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(seen) + rest
    assert returncode == 0, output
    assert "ledger: 1 charge, 0 refunds for this trip (expected 1 and 0)" in output, output
    assert "worker exited with code" not in output, output
    if agent:
        _check_agent_trace(_trace(output))
    else:
        _check_durable_trace(_trace(output))
    assert _ledger_charges(url, services_env["EXAMPLE_TABLE_PREFIX"], trip_id) == 1
    run = _recorded_run(url, trip_id, prefix)
    if agent:
        _check_agent_run(run)
    else:
        _check_approved_run(run)


# -- the pieces the demo relies on -----------------------------------------------------------


def _flight() -> Flight:
    return {"flight_id": "VS3", "origin": "LHR", "destination": "JFK", "date": "2025-06-01",
            "departs": "11:05", "stops": 0, "price_cents": 42_641}


def test_fake_airline_deduplicates_by_idempotency_key_only(tmp_path: Path) -> None:
    """The airline charges once per idempotency key, and once per call when given none."""
    db = ExampleDB(f"sqlite:///{tmp_path / 'airline.sqlite3'}")
    try:
        db.create_tables()
        airline = FakeAirline(db)
        first = airline.book(trip_id="t1", user_id="u", flight=_flight(), idempotency_key="k1")
        again = airline.book(trip_id="t1", user_id="u", flight=_flight(), idempotency_key="k1")
        assert again == first
        assert db.charges("t1") == 1
        for _ in range(2):
            airline.book(trip_id="t2", user_id="u", flight=_flight(), idempotency_key=None)
        assert db.charges("t2") == 2
    finally:
        db.dispose()


def test_fake_airline_cancel_refunds_a_booking_once(tmp_path: Path) -> None:
    """Cancelling a booking refunds what was charged; cancelling it again refunds nothing."""
    db = ExampleDB(f"sqlite:///{tmp_path / 'airline.sqlite3'}")
    try:
        db.create_tables()
        airline = FakeAirline(db)
        booking = airline.book(trip_id="t1", user_id="u", flight=_flight(), idempotency_key="k1")
        refund = airline.cancel(booking, trip_id="t1")
        assert refund == {"booking_ref": booking["booking_ref"],
                          "amount_cents": _flight()["price_cents"]}
        assert airline.cancel(booking, trip_id="t1") == refund
        assert (db.charges("t1"), db.refunds("t1")) == (1, 1)
        with pytest.raises(UnknownBooking):
            airline.cancel(booking, trip_id="another trip")
        with pytest.raises(UnknownBooking):
            airline.cancel({**booking, "booking_ref": "PNR-NOPE"}, trip_id="t1")
        assert db.refunds("another trip") == 0 and db.refunds("t1") == 1
    finally:
        db.dispose()


def test_flaky_mailer_refuses_everything_for_a_trip_it_is_down_for(tmp_path: Path) -> None:
    """The first message of a trip bounces; every message of a trip listed as down does."""
    db = ExampleDB(f"sqlite:///{tmp_path / 'mailer.sqlite3'}")
    try:
        db.create_tables()
        mailer = FlakyMailer(db)
        mailer.go_down_for("down")
        mailer.go_down_for("down")  # a second listing changes nothing
        for _ in range(3):
            with pytest.raises(MailerDown, match="mail server is down"):
                mailer.send(trip_id="down", user_id="u", subject="s")
        with pytest.raises(MailerDown, match="refused"):
            mailer.send(trip_id="fine", user_id="u", subject="s")
        assert mailer.send(trip_id="fine", user_id="u", subject="s")["to"] == "u"
    finally:
        db.dispose()


def test_scripted_planner_walks_search_pick_book_notify_done() -> None:
    """The scripted planner chooses each tool in turn from the history, then says done."""
    planner = ScriptedPlanner({"origin": "LHR", "destination": "JFK", "date": "2025-06-01"})
    booking = {"booking_ref": "PNR-1", "flight_id": "VS3", "amount_cents": 1}
    results = {SEARCH_FLIGHTS: [_flight()], PICK_BEST: _flight(), BOOK_FLIGHT: booking,
               NOTIFY_USER: {"to": "u", "message_id": "m"}}
    history: list[Observation] = []
    chosen = []
    for _ in range(5):
        action = planner.decide(history)
        chosen.append(action["tool"])
        if action["tool"] == DONE:
            break
        history.append({"tool": action["tool"], "args": action["args"],
                        "result": results[action["tool"]]})
    assert chosen == [SEARCH_FLIGHTS, PICK_BEST, BOOK_FLIGHT, NOTIFY_USER, DONE]
