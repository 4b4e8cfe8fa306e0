"""The replay check and run histories: runs left in flight by a real worker, code changed.

A real ``celery worker`` (tests.proj) leaves one run waiting for a signal and one
sleeping for a day. Then ``celery duraflow replay`` runs with the task's code changed
three ways (``PROJ_REPLAY_VARIANT``, see :mod:`tests.proj.replay`): a step renamed
and a step inserted before the wait are divergent, a change after the wait is
compatible, and nothing is written or sent (row counts, ``updated_at`` and the queue
are unchanged, while the worker keeps running and would act on any message).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from celery_duraflow import (
    ConfigurationError,
    DurableTask,
    RunNotFound,
    check_history,
    check_replay,
    export_history,
    step,
    wait_for_signal,
)
from celery_duraflow._store import close_all_stores
from tests.conftest import Broker, app_factory, drop_tables
from tests.test_waits_worker import Project, project
from tests.workers import REPO_ROOT

__all__ = ["project"]  # the fixture, shared with the waits tests


def snapshot(proj: Project) -> dict[str, Any]:
    """What a replay check must leave alone: every row count, every run's status and time."""
    engine = create_engine(proj.pg_url)
    try:
        with engine.connect() as conn:
            counts = {table: conn.execute(text(
                f'SELECT count(*) FROM "{proj.prefix}{table}"')).scalar()
                for table in ("runs", "steps", "signals")}
            runs = conn.execute(text(
                f'SELECT task_id, status, updated_at, attempts FROM "{proj.prefix}runs" '
                "ORDER BY task_id")).all()
    finally:
        engine.dispose()
    return {"counts": counts, "runs": [tuple(row) for row in runs]}


def replay_cli(proj: Project, variant: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.proj", "duraflow", "replay", *args],
        cwd=REPO_ROOT, env={**proj.env, "PROJ_REPLAY_VARIANT": variant},
        capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def broker(redis_url: str) -> Broker:
    """Redis only: the replay check reads the store and the code, not the broker (the
    delivery tests that share the ``project`` fixture run on both brokers)."""
    return Broker("redis", redis_url, redis_url)


@pytest.fixture
def in_flight(project: Project) -> tuple[Project, str, str]:
    """A waiting and a sleeping run of proj.replay_order, left by a real worker."""
    project.start_worker()
    waiting = project.send("proj.replay_order", "o-1", "wait").id
    sleeping = project.send("proj.replay_order", "o-2", "sleep").id
    project.until(waiting, "waiting")
    project.until(sleeping, "sleeping")
    return project, waiting, sleeping


def test_replay_check_finds_renamed_and_inserted_steps(
        in_flight: tuple[Project, str, str]) -> None:
    """Renamed or inserted steps before the wait diverge; a change after it is compatible."""
    proj, waiting, sleeping = in_flight
    before = snapshot(proj)

    renamed = replay_cli(proj, "renamed")
    assert renamed.returncode == 1, renamed.stderr
    assert f"{waiting}  proj.replay_order  waiting  divergent  at position 1: recorded " \
           "'reserve-stock', reached 'hold-stock'" in renamed.stdout
    assert f"{sleeping}  proj.replay_order  sleeping  divergent" in renamed.stdout
    assert "2 run(s) checked: 0 compatible, 2 not" in renamed.stdout

    inserted = replay_cli(proj, "inserted", waiting)
    assert inserted.returncode == 1
    assert ("divergent  at position 2: recorded 'charge', reached 'fraud-check'"
            in inserted.stdout)

    after = replay_cli(proj, "after")
    assert after.returncode == 0, after.stdout + after.stderr
    assert f"{waiting}  proj.replay_order  waiting  compatible  carries on at 'approval'" \
        in after.stdout
    assert f"{sleeping}  proj.replay_order  sleeping  compatible  carries on at 'cool-off'" \
        in after.stdout

    as_json = replay_cli(proj, "inserted", "--json", sleeping)
    [result] = json.loads(as_json.stdout)
    assert (result["verdict"], result["position"], result["recorded_key"],
            result["reached_key"]) == ("divergent", 2, "charge", "fraud-check")
    assert result["recorded_code"] and result["current_code"]

    # Nothing written, nothing sent: the running worker would have acted on a message.
    proj.until(waiting, "waiting")
    assert snapshot(proj) == before


def test_exported_history_replays_without_the_store(in_flight: tuple[Project, str, str],
                                                    tmp_path: Path) -> None:
    """`export` writes a versioned history that `replay --history` checks against new code."""
    proj, waiting, _ = in_flight
    exported = proj.cli("export", waiting)
    assert exported.returncode == 0, exported.stderr
    document = json.loads(exported.stdout)
    assert (document["format"], document["version"]) == ("celery-duraflow/run-history", 1)
    assert document["run"]["task_id"] == waiting
    assert document["wait"] == {"kind": "signal", "waiting_for": "approval",
                                "wake_at": document["wait"]["wake_at"]}
    assert [s["key"] for s in document["steps"]] == ["reserve-stock", "charge", "approval"]
    path = tmp_path / "run.json"
    path.write_text(exported.stdout)

    # The check reads only the file: the store's URL points where nothing listens.
    offline = {"PROJ_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none"}
    env = {**proj.env, **offline}
    for variant, code, expected in (("inserted", 1, "divergent"), ("after", 0, "compatible")):
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.proj", "duraflow", "replay",
             "--history", str(path)], cwd=REPO_ROOT,
            env={**env, "PROJ_REPLAY_VARIANT": variant},
            capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == code, done.stdout + done.stderr
        assert f"{waiting}  proj.replay_order  waiting  {expected}" in done.stdout


def test_replay_refuses_bad_input(project: Project, tmp_path: Path) -> None:
    """An unknown task id, a history of another version or an unregistered task: exit 1."""
    unknown = replay_cli(project, "recorded", "no-such-run")
    assert unknown.returncode == 1
    assert "error: no run with task id no-such-run" in unknown.stderr

    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({"format": "celery-duraflow/run-history", "version": 99}))
    refused = replay_cli(project, "recorded", "--history", str(newer))
    assert refused.returncode == 1
    assert "format version 99" in refused.stderr and "reads version 1" in refused.stderr

    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something-else", "version": 1}))
    assert "is not a celery-duraflow run history" in replay_cli(
        project, "recorded", "--history", str(other)).stderr

    unregistered = tmp_path / "unregistered.json"
    unregistered.write_text(json.dumps({
        "format": "celery-duraflow/run-history", "version": 1,
        "run": {"task_id": "t-1", "task_name": "proj.gone", "status": "waiting",
                "attempts": 1, "result": None, "serializer": None, "error": None,
                "created_at": "2026-12-01T00:00:00+00:00",
                "updated_at": "2026-12-01T00:00:00+00:00", "finished_at": None,
                "args": '{"args": [], "kwargs": {}}'},
        "steps": [], "signals": []}))
    gone = replay_cli(project, "recorded", "--history", str(unregistered))
    assert gone.returncode == 1
    assert "t-1  proj.gone  waiting  error" in gone.stdout
    assert "does not register" in gone.stdout


@pytest.mark.postgres
def test_python_api_checks_runs_and_histories(pg_url: str, table_prefix: str,
                                              tmp_path: Path) -> None:
    """check_replay, export_history and check_history give the same verdicts from Python."""
    recorded = app_factory(pg_url, table_prefix)()
    changed = app_factory(pg_url, table_prefix)()
    try:
        @recorded.task(base=DurableTask, name="api.order")
        def order_v1(n: int) -> Any:
            with step("reserve") as s:
                s.result = n
            return wait_for_signal("approval")

        @changed.task(base=DurableTask, name="api.order")
        def order_v2(n: int) -> Any:
            with step("reserve-first") as s:
                s.result = n
            return wait_for_signal("approval")

        task_id = order_v1.apply(args=(1,)).id
        [same] = check_replay([task_id], app=recorded)
        assert same.compatible and same.stopped_at == "approval"
        [moved] = check_replay(app=changed)  # every run in flight: just this one
        assert (moved.verdict, moved.recorded_key, moved.reached_key) == (
            "divergent", "reserve", "reserve-first")

        path = tmp_path / "run.json"
        path.write_text(export_history(task_id, app=recorded))
        close_all_stores()
        offline = app_factory("postgresql+psycopg://nobody@127.0.0.1:1/none", table_prefix)()

        @offline.task(base=DurableTask, name="api.order")
        def order_v3(n: int) -> Any:
            with step("reserve") as s:
                s.result = n
            return wait_for_signal("approval")

        result = check_history(path, app=offline)
        assert result.compatible and result.stopped_at == "approval"
        with pytest.raises(RunNotFound):
            check_replay(["missing"], app=recorded)
        path.write_text("{}")
        with pytest.raises(ConfigurationError, match="not a celery-duraflow run history"):
            check_history(path, app=offline)
    finally:
        close_all_stores()
        drop_tables(pg_url, table_prefix)
