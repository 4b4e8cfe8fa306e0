"""``celery -A proj duraflow ...`` run as a real command."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import update

from celery_duraflow._config import load_config
from celery_duraflow._serialization import encode_arguments, get_serializer
from celery_duraflow._store import Delivery, Store, close_all_stores
from tests.conftest import drop_tables
from tests.workers import REPO_ROOT, proj_env

# For commands that never reach the broker: nothing listens on port 1.
NO_BROKER = "redis://127.0.0.1:1/0"


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.subprocess
def test_recover_once_resends_a_lost_run(pg_url: str, redis_url: str,
                                         table_prefix: str) -> None:
    """`duraflow recover --once` re-sends a run whose lease expired, and says which."""
    store = Store(load_config({"duraflow_database_url": pg_url,
                               "duraflow_table_prefix": table_prefix}, environ={}))
    task_id = str(uuid.uuid4())
    queue = f"recover-{uuid.uuid4().hex[:8]}"
    try:
        blob, fingerprint = encode_arguments(["u1", "LHR"], {}, get_serializer("json"))
        store.begin_attempt(task_id, Delivery(
            task_name="proj.book_trip", owner="gone-host|x|1|abc", args=blob,
            args_fingerprint=fingerprint, routing_key=queue))
        runs = store.tables.runs
        with store.engine.begin() as conn:
            conn.execute(update(runs).values(
                lease_expires_at=datetime.now(UTC) - timedelta(seconds=5)))
        env = proj_env(pg_url, redis_url, table_prefix)
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.proj", "duraflow", "recover",
             "--once"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60,
            check=False)
        assert done.returncode == 0, done.stderr
        assert f"sent 1 run(s): {task_id}" in done.stdout
        run = store.get_run(task_id)
        assert run is not None and run.recoveries == 1 and run.lease_owner is None

        import redis

        client = redis.Redis.from_url(redis_url)
        try:
            assert client.llen(queue) == 1  # the message waits in the run's own queue
        finally:
            client.delete(queue)
            client.close()
    finally:
        store.close()
        close_all_stores()
        drop_tables(pg_url, table_prefix)


@pytest.mark.postgres
@pytest.mark.subprocess
def test_patch_lists_the_runs_that_may_take_the_old_branch(pg_url: str,
                                                          table_prefix: str) -> None:
    """`duraflow patch NAME` names unfinished runs from before the patch; exit 0 once none."""
    store = Store(load_config({"duraflow_database_url": pg_url,
                               "duraflow_table_prefix": table_prefix}, environ={}))
    old, new = f"old-{uuid.uuid4()}", f"new-{uuid.uuid4()}"
    env = proj_env(pg_url, NO_BROKER, table_prefix)

    def patch_command() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.proj", "duraflow", "patch",
             "price-check"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
            timeout=60, check=False)

    try:
        owner = "some-host|x|1|abc"
        store.begin_attempt(old, Delivery(task_name="proj.book_trip", owner=owner))
        assert store.record_step(old, "search", owner, status="completed", output="1",
                                 serializer="json", started_at=datetime.now(UTC), new=True,
                                 position=1)
        store.begin_attempt(new, Delivery(task_name="proj.book_trip", owner=owner))
        assert store.record_step(new, "patched:price-check", owner, status="completed",
                                 output="true", serializer="json",
                                 started_at=datetime.now(UTC), new=True)

        waiting = patch_command()
        assert waiting.returncode == 3, waiting.stderr
        assert "patch 'price-check': recorded by 1 run(s)" in waiting.stdout
        assert old in waiting.stdout and new not in waiting.stdout

        assert store.finish_run(old, owner, "succeeded")
        done = patch_command()
        assert done.returncode == 0, done.stderr
        assert "the old branch can go" in done.stdout
    finally:
        store.close()
        close_all_stores()
        drop_tables(pg_url, table_prefix)


@pytest.mark.postgres
@pytest.mark.subprocess
def test_runs_and_show_as_real_commands(pg_url: str, table_prefix: str) -> None:
    """`duraflow runs --json` and `duraflow show` in a real `celery` process."""
    store = Store(load_config({"duraflow_database_url": pg_url,
                               "duraflow_table_prefix": table_prefix}, environ={}))
    done, waiting = f"done-{uuid.uuid4()}", f"waiting-{uuid.uuid4()}"
    env = proj_env(pg_url, NO_BROKER, table_prefix, COLUMNS="300")

    def duraflow(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.proj", "duraflow", *args],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)

    try:
        owner = "some-host|x|1|abc"
        store.begin_attempt(done, Delivery(task_name="proj.book_trip", owner=owner))
        assert store.record_step(done, "search", owner, status="completed",
                                 output='["LHR-101"]', serializer="json",
                                 started_at=datetime.now(UTC), new=True, position=1)
        assert store.finish_run(done, owner, "succeeded", result='"ok"', serializer="json")
        store.begin_attempt(waiting, Delivery(task_name="proj.approve_booking", owner=owner))
        assert store.suspend(waiting, owner, status="waiting", kind="signal",
                             waiting_for="approval", wake_at=None, sweep_at=None)

        listed = duraflow("runs", "--json")
        assert listed.returncode == 0, listed.stderr
        data = json.loads(listed.stdout)
        assert [(r["task_id"], r["status"], r["steps_completed"]) for r in data] == [
            (waiting, "waiting", 0), (done, "succeeded", 1)]
        assert data[0]["waiting_for"] == "approval"

        shown = duraflow("show", done)
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert "status    succeeded" in lines and 'result    "ok"' in lines
        assert lines[-1].split()[:3] == ["search", "completed", "1"]
        assert lines[-1].endswith('["LHR-101"]')

        missing = duraflow("show", "no-such-run")
        assert missing.returncode == 1
        assert missing.stderr.splitlines() == [
            "error: no run with task id no-such-run is recorded"]
    finally:
        store.close()
        close_all_stores()
        drop_tables(pg_url, table_prefix)


@pytest.mark.postgres
@pytest.mark.subprocess
def test_web_command_serves_the_runs_page(pg_url: str, table_prefix: str) -> None:
    """`duraflow web` listens on loopback, read-only without a token."""
    import socket
    import time
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = proj_env(pg_url, NO_BROKER, table_prefix)
    env.pop("DURAFLOW_WEB_TOKEN", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.proj", "duraflow", "web", "--port",
         str(port)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        page = ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as response:
                    page = response.read().decode()
                    break
            except OSError:
                time.sleep(0.2)
        assert "read-only" in page.lower(), page[:500]
    finally:
        server.terminate()
        output = server.communicate(timeout=15)[0].decode()
        close_all_stores()
        drop_tables(pg_url, table_prefix)
    assert f"serving the runs on http://127.0.0.1:{port}/ (read-only (no --token))" in output


@pytest.mark.postgres
@pytest.mark.subprocess
def test_show_prints_outputs_whole_into_a_pipe(pg_url: str, table_prefix: str) -> None:
    """`duraflow show` into a real pipe, without $COLUMNS, prints long outputs and errors whole."""
    store = Store(load_config({"duraflow_database_url": pg_url,
                               "duraflow_table_prefix": table_prefix}, environ={}))
    task_id = f"long-{uuid.uuid4()}"
    output = json.dumps({"tail": "x" * 400 + "END"})
    env = proj_env(pg_url, NO_BROKER, table_prefix)
    env.pop("COLUMNS", None)
    try:
        owner = "some-host|x|1|abc"
        store.begin_attempt(task_id, Delivery(task_name="proj.book_trip", owner=owner))
        assert store.record_step(task_id, "search", owner, status="completed", output=output,
                                 serializer="json", started_at=datetime.now(UTC), new=True,
                                 position=1)
        assert store.finish_run(task_id, owner, "failed", error="boom " + "y" * 400 + " ERREND")
        shown = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.proj", "duraflow", "show", task_id],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60,
            check=False)  # capture_output: stdout is a pipe, not a terminal
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert lines[-1].split()[:2] == ["search", "completed"]
        assert lines[-1].endswith(output)
        assert any(line.endswith(" ERREND") for line in lines)
    finally:
        store.close()
        close_all_stores()
        drop_tables(pg_url, table_prefix)
