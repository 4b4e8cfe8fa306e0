"""The benchmark harness runs end to end with tiny sizes (no timing is asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import trace_intervals, trace_statements

REPO_ROOT = Path(__file__).resolve().parent.parent
SECTIONS = (
    "## Fresh step overhead",
    "## Empty durable task",
    "## Replay",
    "## SQLite",
    "## WAL per task",
    "## DBOS side by side",
    "## End to end through Celery",
    "### Redis",
    "### RabbitMQ",
    "## Memory",
    "## Atomic steps against plain ones",
    "## OpenTelemetry cost",
    "## Large tables",
    "## Flow control",
    "### What the limit adds to an attempt",
    "## Scaling the fleet",
    "## Concurrent steps",
    "## Per-attempt profile",
    "## Targets",
)
TARGET_TITLES = (
    "empty durable task: fixed cost of an attempt (durable - plain) / raw durable commit",
    "empty durable task: client CPU per attempt beyond a plain task",
    "each statement of start and finish <= 4096 chars",
    "fresh step overhead / raw durable commit",
    "round trips to replay a run of 100 completed steps",
    "client CPU per replayed step, 100-step replay",
    "SQLite fresh step overhead / raw BEGIN IMMEDIATE+INSERT+COMMIT",
    "SQLite transactions per fresh step",
    "WAL bytes per durable 10-step task / hand-written twelve commits",
    "DBOS per-step overhead / celery-duraflow's",
    "e2e throughput durable / hand-written twelve commits (Redis)",
    "e2e throughput durable / hand-written twelve commits (RabbitMQ)",
    "worker RSS growth over 10,000 durable runs",
    "large tables: each operation on 1M runs / on empty tables (worst)",
    "flow: throughput with Concurrency(2, key) not binding / no limit, 3 trivial steps, "
    "4 processes (Redis)",
    "flow: throughput with Concurrency(2, key) not binding / no limit, 3 trivial steps, "
    "4 processes (RabbitMQ)",
    "fleet: durable / hand-written throughput at 1, 2, 4 and 8 prefork processes (worst)",
    "parallel: ten concurrent 50 ms I/O steps / one such step (worst of aparallel, gather, "
    "parallel)",
)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.subprocess
@pytest.mark.long
def test_quick_benchmark_run_prints_every_section_and_the_targets(
    pg_url: str, redis_url: str, tmp_path: Path
) -> None:
    """`python -m benchmarks --quick --profile` prints every section and a verdict per target."""
    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
    json_path = tmp_path / "results.json"
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--profile", "--database-url", pg_url,
         "--broker-url", redis_url, "--json", str(json_path)],
        cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=180,
    )
    output = completed.stdout
    assert completed.returncode == 0, f"stdout:\n{output}\nstderr:\n{completed.stderr[-4000:]}"
    for section in SECTIONS:
        assert section in output, output
    targets = output.split("## Targets", 1)[1]
    for title in TARGET_TITLES:
        line = next((row for row in targets.splitlines() if title in row), None)
        assert line is not None, targets
        # DBOS may be absent from the test environment, RabbitMQ unreachable: then the
        # target says it was skipped.
        assert any(v in line for v in ("| met", "| NOT met", "| skipped")), line
    assert json_path.exists()


# A libpq protocol trace with timestamps, as psycopg's pgconn.trace() writes it: the SQL
# text of a Parse message runs over several lines, and may hold quotes.
_TRACE = (
    '2026-01-02 10:11:12.000100\tF\t80\tParse\t "" "SELECT "a"\n'
    "FROM t WHERE x = $1::VARCHAR\" 1 1043\n"
    '2026-01-02 10:11:12.000110\tF\t40\tBind\t "" "" 0 1 2 \'ab\' 1 0\n'
    "2026-01-02 10:11:12.000120\tF\t4\tSync\n"
    "2026-01-02 10:11:12.000900\tB\t4\tParseComplete\n"
    "2026-01-02 10:11:12.001100\tB\t5\tReadyForQuery\t I\n"
    '2026-01-02 10:11:12.002000\tF\t20\tQuery\t "COMMIT"\n'
    "2026-01-02 10:11:12.002500\tB\t5\tReadyForQuery\t I\n"
)


def test_trace_parsing_finds_each_statement_text_and_round_trip() -> None:
    """The harness reads SQL texts, their parameter counts and round trips from a libpq trace."""
    sent = trace_statements(_TRACE)
    assert [(s.text, s.params) for s in sent] == [
        ('SELECT "a"\nFROM t WHERE x = $1::VARCHAR', 1), ("COMMIT", 0)]
    intervals = trace_intervals(_TRACE)
    assert len(intervals) == 2
    assert [round(end - start, 6) for start, end in intervals] == [0.001, 0.0005]


@pytest.mark.postgres
def test_anatomy_runs_the_stores_own_start_and_finish_and_sees_which_updates_are_hot(
    pg_url: str,
) -> None:
    """`benchmarks.profile --anatomy` writes with the store's statements; only a key-only copy's
    finish is a HOT update."""
    import psycopg

    from benchmarks.common import libpq_url
    from benchmarks.profile import run_row_anatomy

    with psycopg.connect(libpq_url(pg_url)) as conn:
        if conn.info.server_version < 150000:
            pytest.skip("before PostgreSQL 15 a backend's counts reach pg_stat_user_tables "
                        "only about once a second")
    report = run_row_anatomy(pg_url, 20)
    lines = report.splitlines()
    ours = next(line for line in lines if "start + finish, the store's runs table" in line)
    bare = next(line for line in lines if "start + finish, a copy with its primary key" in line)
    # The finish changes the run's status, which the store's indexes hold: never HOT.
    assert ours.endswith("HOT updates 0 of 120"), report
    assert bare.endswith("HOT updates 120 of 120"), report
