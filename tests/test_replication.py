"""A failover to a standby: nothing recorded is lost where the standby is synchronous.

Two private clusters of the test's own (``pg_createcluster``: a primary on 5441
and a streaming standby on 5442, made with ``pg_basebackup``), never the shared
server. The app reaches them through one multi-host URL with
``target_session_attrs=read-write``, as a deployment would, and keeps running
across the failover without a restart.

The standby is stopped before the run starts, so that it receives nothing of
the run: the widest lag a standby can have. With asynchronous replication the
primary commits anyway, the client sees its steps recorded, and the failover
loses them; with synchronous replication no commit returns until the standby
has it, so the client never sees a record the failover could lose.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from celery_duraflow import DurableTask, StoreUnavailable, get_run, step
from celery_duraflow._replication import Replication, read_replication, replication_warning
from celery_duraflow._signals import _announce_store
from celery_duraflow._store import close_all_stores
from tests.conftest import REQUIRE_SERVICES, OutageServer, app_factory

pytestmark = [pytest.mark.postgres, pytest.mark.chaos]

PRIMARY, STANDBY = "dfprimary", "dfstandby"
PRIMARY_PORT, STANDBY_PORT = 5441, 5442


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, check=check, capture_output=True, text=True)


@dataclass
class Pair:
    """A primary and its streaming standby, both private clusters."""

    version: str

    def url(self, port: int) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"

    def sql(self, port: int, statement: str) -> list[tuple[Any, ...]]:
        engine = create_engine(self.url(port), isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                result = conn.execute(text(statement))
                return [tuple(row) for row in result] if result.returns_rows else []
        finally:
            engine.dispose()

    def server(self, cluster: str) -> OutageServer:
        port = PRIMARY_PORT if cluster == PRIMARY else STANDBY_PORT
        return OutageServer(version=self.version, url=self.url(port), pgbouncer_url="",
                            cluster=cluster, port=port)

    def ctl(self, cluster: str, action: str, *options: str) -> None:
        self.server(cluster)._ctl(action, *options)

    def caught_up(self, timeout: float = 30) -> None:
        """Wait until the standby has replayed everything the primary has written."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.sql(PRIMARY_PORT, "SELECT replay_lsn >= pg_current_wal_lsn() "
                                          "FROM pg_stat_replication")
            if rows and rows[0][0]:
                return
            time.sleep(0.1)
        raise AssertionError("the standby did not catch up with the primary")

    def promote(self) -> None:
        self.ctl(STANDBY, "promote")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if not self.sql(STANDBY_PORT, "SELECT pg_is_in_recovery()")[0][0]:
                    return
            except Exception:  # still starting
                pass
            time.sleep(0.2)
        raise AssertionError("the standby was not promoted")


def _unavailable(reason: str) -> None:
    if REQUIRE_SERVICES:
        pytest.fail(f"a primary and a standby cannot be built here: {reason}", pytrace=False)
    pytest.skip(reason)


def _drop() -> None:
    if os.path.isdir("/etc/postgresql"):
        for version in os.listdir("/etc/postgresql"):
            for cluster in (STANDBY, PRIMARY):
                _run("pg_dropcluster", "--stop", version, cluster, check=False)


@pytest.fixture
def pair() -> Iterator[Pair]:
    """A fresh primary (5441) and standby (5442); both dropped after the test."""
    if shutil.which("pg_createcluster") is None or shutil.which("pg_basebackup") is None:
        _unavailable("needs Debian's postgresql-common and pg_basebackup")
    if os.geteuid() != 0:
        _unavailable("creating clusters needs root")
    _drop()
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    pair = Pair(version=version)
    try:
        _run("pg_createcluster", version, PRIMARY, "-p", str(PRIMARY_PORT), "--",
             "--auth=trust")
        with open(f"/etc/postgresql/{version}/{PRIMARY}/pg_hba.conf", "a") as hba:
            hba.write("host replication all 127.0.0.1/32 trust\n")
        pair.ctl(PRIMARY, "start")
        assert pair.server(PRIMARY).ready(60), "the primary did not start"
        _run("pg_createcluster", version, STANDBY, "-p", str(STANDBY_PORT), "--",
             "--auth=trust")
        data = f"/var/lib/postgresql/{version}/{STANDBY}"
        shutil.rmtree(data)
        _run("pg_basebackup", "-h", "127.0.0.1", "-p", str(PRIMARY_PORT), "-U", "postgres",
             "-D", data, "-X", "stream", "-R", "-d",
             f"host=127.0.0.1 port={PRIMARY_PORT} user=postgres application_name={STANDBY}")
        _run("chown", "-R", "postgres:postgres", data)
        os.chmod(data, 0o700)
        pair.ctl(STANDBY, "start")
        assert pair.server(STANDBY).ready(60), "the standby did not start"
        pair.caught_up()
    except (subprocess.CalledProcessError, AssertionError, OSError) as exc:
        _drop()
        detail = getattr(exc, "stderr", "") or str(exc)
        _unavailable(f"building the pair failed: {detail.strip()}")
    try:
        yield pair
    finally:
        close_all_stores()
        _drop()


@pytest.mark.parametrize("mode", ["asynchronous", "synchronous"])
def test_a_failover_loses_recorded_steps_only_to_an_asynchronous_standby(
        pair: Pair, mode: str, table_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """Primary crashed, standby promoted, the same app going on through a multi-host URL:
    asynchronous, steps the client saw recorded are lost and run again unflagged (and the
    start-up check warns of it); synchronous, no body runs twice and nothing is lost."""
    if mode == "synchronous":
        pair.sql(PRIMARY_PORT, f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY}'")
        pair.sql(PRIMARY_PORT, "SELECT pg_reload_conf()")
    url = (f"postgresql+psycopg://postgres@/postgres?host=127.0.0.1:{PRIMARY_PORT}"
           f"&host=127.0.0.1:{STANDBY_PORT}&target_session_attrs=read-write")
    app = app_factory(url, table_prefix)(duraflow_lease_seconds=1)
    calls: Counter[str] = Counter()
    flagged: dict[str, list[bool]] = defaultdict(list)

    @app.task(base=DurableTask, name="failover.trip")
    def trip() -> str:
        for name in ("search", "book", "charge"):
            with step(name) as s:
                calls[name] += 1
                flagged[name].append(s.in_doubt)
                s.result = name
        return "done"

    assert trip.apply(task_id=f"warm-{uuid.uuid4()}").get() == "done"  # tables exist
    pair.caught_up()
    engine = create_engine(pair.url(PRIMARY_PORT))
    try:
        with engine.connect() as conn:
            warning = replication_warning(read_replication(conn))
    finally:
        engine.dispose()
    with caplog.at_level(logging.WARNING, logger="celery_duraflow.worker"):
        _announce_store(sender=SimpleNamespace(app=app))  # as a worker starting says it
    logged = [r.getMessage() for r in caplog.records if "synchronous" in r.getMessage()]
    assert logged == ([] if warning is None else [f"celery-duraflow: {warning}"])
    calls.clear()
    flagged.clear()

    pair.ctl(STANDBY, "stop", "-m", "fast")  # the standby receives nothing from here on
    task_id = str(uuid.uuid4())
    first: list[Any] = []
    attempt = threading.Thread(target=lambda: first.append(trip.apply(task_id=task_id)))
    attempt.start()
    attempt.join(3)  # asynchronous: done; synchronous: its first commit waits for the standby
    seen = dict(calls)
    pair.ctl(PRIMARY, "stop", "-m", "immediate")  # the primary crashes
    attempt.join(60)
    assert not attempt.is_alive()
    pair.ctl(STANDBY, "start")
    pair.promote()

    again = trip.apply(task_id=task_id)  # the same app: its pool finds the new primary
    assert again.get() == "done"
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "succeeded"
    ran_twice = sorted(name for name, count in calls.items() if count > 1)
    unflagged = sorted(name for name in ran_twice if not flagged[name][-1])
    print(f"\nfailover, {mode}: before the crash the client saw {first[0].state} and "
          f"{sum(seen.values())} bodies run; after it, bodies run twice: {ran_twice} "
          f"(not flagged in doubt: {unflagged}); start-up warning: {warning is not None}")
    if mode == "asynchronous":
        assert warning is not None and "none is synchronous" in warning
        # The client saw the run succeed; the promoted standby never had it.
        assert first[0].state == "SUCCESS" and seen == {"search": 1, "book": 1, "charge": 1}
        assert ran_twice == ["book", "charge", "search"] and unflagged == ran_twice
    else:
        assert warning is None
        # No commit returned, so no body ran on the old primary; each ran once in all.
        assert isinstance(first[0].result, StoreUnavailable)
        assert seen == {} and calls == {"search": 1, "book": 1, "charge": 1}


@pytest.mark.parametrize(("replication", "warned"), [
    (Replication(0, (), "", "on"), None),
    (Replication(1, (), "", "on"), "none is synchronous"),
    (Replication(1, (), "FIRST 1 (b)", "local"), "synchronous_commit is 'local'"),
    (Replication(2, ("a",), "FIRST 1 (b)", "on"), "standby server(s) a stream"),
    (Replication(2, (), "ANY 1 (a, b)", "remote_apply"), None),
])
def test_the_start_up_check_warns_where_a_failover_could_lose_commits(
        replication: Replication, warned: str | None) -> None:
    """No standby, or every one synchronous and waited for: silent; otherwise a warning
    that names the setting and points to the operating guide."""
    warning = replication_warning(replication)
    if warned is None:
        assert warning is None
    else:
        assert warning is not None and warned in warning and "operating guide" in warning
