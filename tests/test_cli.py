"""``celery -A proj duraflow ...`` run as a real command."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from celery_duraflow._config import load_config
from celery_duraflow._serialization import encode_arguments, get_serializer
from celery_duraflow._store import Delivery, Store, close_all_stores
from tests.conftest import drop_tables

REPO_ROOT = Path(__file__).resolve().parent.parent


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
        env = {**os.environ, "PROJ_BROKER_URL": redis_url, "PROJ_DATABASE_URL": pg_url,
               "PROJ_TABLE_PREFIX": table_prefix}
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
