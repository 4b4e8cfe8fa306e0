"""The example project: the essay's flight-booking agent, run the way a user runs it.

The demo is started as ``python -m example_project`` in a subprocess, from an
empty directory and with an environment that holds little more than PATH, and
the tests read what it prints and, for the real-services mode, what it left in
PostgreSQL.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy import create_engine, func, select

from celery_duraflow import get_run
from celery_duraflow._store import close_all_stores
from example_project.db import ExampleDB, build_tables
from example_project.planner import (
    BOOK_FLIGHT,
    DONE,
    NOTIFY_USER,
    PICK_BEST,
    SEARCH_FLIGHTS,
    Observation,
    ScriptedPlanner,
)
from example_project.services import FakeAirline, Flight
from tests.conftest import drop_tables

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_TIMEOUT = 120.0
TRACE_LINE = re.compile(r"^\s+attempt (\d+)\s+(\S+)\s+(ran|cached|failed)\b", re.MULTILINE)
TRIP_LINE = re.compile(r"^trip (\S+) for ", re.MULTILINE)


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


def _trace(stdout: str) -> list[tuple[int, str, str]]:
    """The (attempt, step key, outcome) lines the demo printed."""
    return [(int(a), key, outcome) for a, key, outcome in TRACE_LINE.findall(stdout)]


def _outcomes(trace: list[tuple[int, str, str]], key: str) -> list[tuple[int, str]]:
    return [(attempt, outcome) for attempt, k, outcome in trace if k == key]


def _explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def _check_durable_trace(trace: list[tuple[int, str, str]]) -> None:
    assert _outcomes(trace, BOOK_FLIGHT) == [(1, "ran"), (2, "cached")]
    assert _outcomes(trace, NOTIFY_USER) == [(1, "failed"), (2, "ran")]
    first = [key for attempt, key, outcome in trace if attempt == 1 and outcome == "ran"]
    cached = [key for attempt, key, outcome in trace if attempt == 2 and outcome == "cached"]
    assert cached == first  # everything that finished in attempt 1 was replayed, in order
    assert max(attempt for attempt, _, _ in trace) == 2


def _check_naive_trace(trace: list[tuple[int, str, str]]) -> None:
    assert _outcomes(trace, BOOK_FLIGHT) == [(1, "ran"), (2, "ran")]
    assert _outcomes(trace, NOTIFY_USER) == [(1, "failed"), (2, "ran")]
    assert all(outcome != "cached" for _, _, outcome in trace)


# -- the embedded demo (no server) --------------------------------------------------------


def test_embedded_demo_charges_once_and_replays_cached_steps(tmp_path: Path) -> None:
    """`python -m example_project` with no settings: one charge, attempt 2 replays from SQLite."""
    result = _run_demo(cwd=tmp_path, env=_env())
    assert result.returncode == 0, _explain(result)
    assert "ledger: 1 charge for this trip (expected 1)" in result.stdout, _explain(result)
    assert "in-process worker, memory:// broker" in result.stdout
    assert "duraflow: run succeeded after 2 attempts" in result.stdout
    _check_durable_trace(_trace(result.stdout))
    assert list(tmp_path.iterdir()) == []  # its SQLite file lived in a temporary directory


def test_naive_demo_charges_the_card_twice(tmp_path: Path) -> None:
    """`--naive` reruns the whole agent on retry: booked and charged twice, exit code 0."""
    result = _run_demo("--naive", cwd=tmp_path, env=_env())
    assert result.returncode == 0, _explain(result)
    assert "ledger: 2 charges for this trip (expected 2)" in result.stdout, _explain(result)
    _check_naive_trace(_trace(result.stdout))


def test_no_worker_without_a_shared_broker_is_refused(tmp_path: Path) -> None:
    """`--no-worker` with the in-memory broker exits with a usage error instead of hanging."""
    result = _run_demo("--no-worker", cwd=tmp_path, env=_env())
    assert result.returncode == 2, _explain(result)
    assert "CELERY_BROKER_URL" in result.stderr


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
    match = TRIP_LINE.search(result.stdout)
    assert match is not None, _explain(result)
    trip_id = match.group(1)
    url = services_env["DURAFLOW_DATABASE_URL"]
    ledger = build_tables(services_env["EXAMPLE_TABLE_PREFIX"]).ledger
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            charges = conn.execute(select(func.count()).select_from(ledger)
                                   .where(ledger.c.trip_id == trip_id)).scalar_one()
    finally:
        engine.dispose()
    assert charges == expected

    app = Celery("example-check", set_as_current=False)
    app.conf.update(duraflow_database_url=url,
                    duraflow_table_prefix=services_env["DURAFLOW_TABLE_PREFIX"])
    run = get_run(trip_id, app=app)
    if naive:
        assert run is None  # a plain Celery task leaves no run behind
    else:
        assert run is not None and run.status == "succeeded"
        assert run.step(BOOK_FLIGHT).attempts == 1
        assert run.step(NOTIFY_USER).attempts == 2


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
