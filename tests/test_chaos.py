"""Faults on real processes: SIGKILLed worker children, a PostgreSQL outage, duplicate sends.

The atomic variant runs :func:`tests.proj.chaos.chaos_ledger`, whose steps write
their ledger rows in the step's own transaction: there the ledger table itself
shows that no row was ever written twice.

The tests run real ``celery worker`` processes (prefork) on PostgreSQL and a
broker (the main chaos test and the duplicate-delivery test once on Redis and
once on RabbitMQ, where the main one's workers reach PostgreSQL through
PgBouncer; the atomic one on Redis) with the instrumented task
:func:`tests.proj.chaos.chaos_trip`, whose step bodies log ``start``/``end``
events to a file. The checks read that file and the database:

* every run succeeded and was charged exactly once;
* no step body ever ran at the same time as another execution of itself
  (a killed execution ends when the test killed its process);
* no step body ran again after it had completed, except the in-doubt window
  (its process died after the body but before the output was recorded), which
  the library reports through ``s.in_doubt``.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy import create_engine, text

from celery_duraflow._store import close_all_stores
from tests.conftest import Broker, OutageServer, drop_project_tables

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.subprocess]

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Cluster:
    """Worker processes on one queue, with the files and tables they share."""

    env: dict[str, str]
    queue: str
    prefix: str
    database_url: str
    event_log: Path
    logs: Path
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    kills: dict[int, float] = field(default_factory=dict)
    sweeper: subprocess.Popen[bytes] | None = None

    def start_worker(self, index: int, concurrency: int = 2) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"worker{index}-{len(self.workers)}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.proj", "worker", "--pool", "prefork",
             "--concurrency", str(concurrency), "--loglevel", "INFO", "-Q", self.queue,
             "-n", f"chaos{index}-{uuid.uuid4().hex[:6]}@%h", "--without-heartbeat",
             "--without-gossip", "--without-mingle"],
            cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.workers.append(proc)
        return proc

    def children(self) -> list[int]:
        pids: list[int] = []
        for worker in self.workers:
            if worker.poll() is not None:
                continue
            out = subprocess.run(["ps", "-o", "pid=,stat=", "--ppid", str(worker.pid)],
                                 capture_output=True, text=True, check=False).stdout
            # A killed child stays a zombie until its worker reaps it: it is not a target.
            pids.extend(int(line.split()[0]) for line in out.splitlines()
                        if line.split() and not line.split()[1].startswith("Z"))
        return pids

    def kill_random_child(self) -> bool:
        children = self.children()
        if not children:
            return False
        pid = random.choice([p for p in children if p not in self.kills] or [0])
        if not pid:
            return False
        # Taken before the signal: SIGKILL lets the process run no further code, so its
        # step body ended at the latest here (a time taken after os.kill() could be late
        # by however long this process was descheduled). Only the first kill of a pid
        # counts: a second one could only hit its zombie, and would move its end later.
        at = time.time()
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            self.kills[pid] = at
            return True
        return False

    def start_with_sweeper(self, concurrency: int = 2) -> None:
        """Two prefork workers (of ``concurrency`` pool processes each), ready, and the
        recovery sweep running every second."""
        self.start_worker(0, concurrency)
        self.start_worker(1, concurrency)
        self.wait_ready(2)
        self.sweeper = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.proj", "duraflow", "recover",
             "--interval", "1"], cwd=REPO_ROOT, env=self.env,
            stdout=open(self.logs / "sweeper.log", "ab"),  # noqa: SIM115
            stderr=subprocess.STDOUT, start_new_session=True)

    def kill_and_restart(self) -> None:
        """Kill one worker child; start a whole worker again if one died with it."""
        self.kill_random_child()
        for index, worker in enumerate(list(self.workers)):
            if worker.poll() is not None:
                self.workers.remove(worker)
                self.start_worker(index)

    def wait_ready(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = sum(log.read_text(errors="replace").count(" ready.")
                        for log in self.logs.glob("worker*.log"))
            if ready >= count:
                return
            time.sleep(0.2)
        raise AssertionError("workers did not become ready:\n" + self.log_tail())

    def log_tail(self, lines: int = 40) -> str:
        parts = []
        for log in sorted(self.logs.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def stop(self) -> None:
        procs = [*self.workers, *([self.sweeper] if self.sweeper else [])]
        for proc in procs:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def sql(self, statement: str) -> list[tuple[object, ...]]:
        engine = create_engine(self.database_url)
        try:
            with engine.connect() as conn:
                return [tuple(row) for row in conn.execute(text(statement))]
        finally:
            engine.dispose()


@contextmanager
def cluster(pg_url: str, broker: Broker, tmp_path: Path, *,
            lease_seconds: float, workers_url: str | None = None) -> Iterator[Cluster]:
    """Workers on ``broker`` and PostgreSQL (reached at ``workers_url`` when given: through
    PgBouncer), with tables and a queue of their own."""
    prefix = f"c{uuid.uuid4().hex[:8]}_"
    queue = f"chaos-{uuid.uuid4().hex[:8]}"
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**os.environ, "PROJ_BROKER_URL": broker.url,
           "PROJ_RESULT_BACKEND": broker.result_backend,
           "PROJ_DATABASE_URL": workers_url or pg_url,
           "PROJ_TABLE_PREFIX": prefix, "PROJ_LEASE_SECONDS": str(lease_seconds),
           "PROJ_EVENT_LOG": str(tmp_path / "events.log")}
    c = Cluster(env=env, queue=queue, prefix=prefix, database_url=pg_url,
                event_log=tmp_path / "events.log", logs=logs)
    try:
        yield c
    finally:
        c.stop()
        close_all_stores()
        try:
            drop_project_tables(pg_url, prefix)
        finally:
            broker.delete_queue(queue)


def client_app(c: Cluster, broker: Broker) -> Celery:
    app = Celery("chaos-client", broker=broker.url, backend=broker.result_backend,
                 set_as_current=False)
    app.conf.update(task_default_queue=c.queue, broker_connection_retry_on_startup=True)
    return app


@dataclass
class Execution:
    pid: int
    start: float
    in_doubt: bool
    end: float | None = None
    outcome: str | None = None


def read_events(c: Cluster) -> tuple[dict[tuple[str, str], list[Execution]],
                                     list[tuple[str, int]]]:
    """Step executions by (task id, step), and deliveries as (task id, retries)."""
    executions: dict[tuple[str, str], list[Execution]] = defaultdict(list)
    open_by_pid: dict[tuple[int, str, str], Execution] = {}
    deliveries: list[tuple[str, int]] = []
    for line in c.event_log.read_text().splitlines():
        stamp, pid_text, kind, *rest = line.split()
        pid, at = int(pid_text), float(stamp)
        if kind == "deliver":
            deliveries.append((rest[0], int(rest[1])))
        elif kind == "start":
            task_id, name, doubt = rest
            run = Execution(pid=pid, start=at, in_doubt=doubt == "1")
            executions[(task_id, name)].append(run)
            open_by_pid[(pid, task_id, name)] = run
        elif kind == "end":
            task_id, name, outcome = rest
            run = open_by_pid.pop((pid, task_id, name))
            run.end, run.outcome = at, outcome
    return executions, deliveries


def check_executions(c: Cluster, executions: dict[tuple[str, str], list[Execution]]
                     ) -> tuple[list[str], int, int]:
    """Overlaps and duplicates found, and how many in-doubt re-runs happened."""
    problems: list[str] = []
    duplicates = 0
    in_doubt = 0
    for (task_id, name), runs in executions.items():
        runs.sort(key=lambda r: r.start)
        completed_before = False
        for previous, current in itertools.pairwise(runs):
            end = previous.end if previous.end is not None else c.kills.get(previous.pid)
            if end is None or end > current.start:
                problems.append(f"{task_id} {name}: pid {current.pid} started at "
                                f"{current.start:.6f} while pid {previous.pid} (started "
                                f"{previous.start:.6f}, ended {previous.end}, killed "
                                f"{c.kills.get(previous.pid)}) was still running it")
        for run in runs:
            if completed_before and not run.in_doubt:
                duplicates += 1
                problems.append(f"{task_id} {name}: ran again after it had completed")
            in_doubt += run.in_doubt
            completed_before = completed_before or run.outcome == "ok"
    return problems, duplicates, in_doubt


def wait_for_runs(c: Cluster, count: int, timeout: float,
                  ended: tuple[str, ...] = ("succeeded",)) -> dict[str, int]:
    """Wait until ``count`` runs have one of the ``ended`` statuses; the count by status."""
    deadline = time.monotonic() + timeout
    statuses: dict[str, int] = {}
    while time.monotonic() < deadline:
        with suppress(Exception):
            statuses = {str(s): int(str(n)) for s, n in c.sql(
                f'SELECT status, count(*) FROM "{c.prefix}runs" GROUP BY status')}
            if sum(statuses.get(status, 0) for status in ended) >= count:
                return statuses
        time.sleep(0.5)
    return statuses


@pytest.mark.chaos
@pytest.mark.one_broker
def test_chaos_kills_and_outage(outage_pg: OutageServer, broker: Broker,
                                tmp_path: Path) -> None:
    """200 runs survive SIGKILLed children and a PostgreSQL outage: each done, charged once.
    On Redis the workers reach PostgreSQL directly, on RabbitMQ through PgBouncer in
    transaction pooling mode. The server stopped is the session's private cluster."""
    _kills_and_outage(outage_pg, broker, tmp_path, through_pgbouncer=broker.name == "rabbitmq")


def _kills_and_outage(outage_pg: OutageServer, broker: Broker, tmp_path: Path, *,
                      through_pgbouncer: bool) -> None:
    pg_url = outage_pg.url
    workers_url = outage_pg.pgbouncer_url if through_pgbouncer else None
    runs, kills = 200, 40
    with cluster(pg_url, broker, tmp_path, lease_seconds=3, workers_url=workers_url) as c:
        c.start_with_sweeper()
        app = client_app(c, broker)
        task_ids = [str(uuid.uuid4()) for _ in range(runs)]
        for n, task_id in enumerate(task_ids):
            app.send_task("proj.chaos_trip", args=(n,), task_id=task_id, queue=c.queue)

        outage_errors: list[BaseException] = []

        def outage() -> None:
            try:
                with outage_pg.stopped():  # always started again, even if this thread fails
                    time.sleep(3)
            except BaseException as exc:  # reported by the main thread
                outage_errors.append(exc)

        started = time.monotonic()
        outage_thread = threading.Thread(target=outage, name="postgres-outage")
        try:
            # A kill every half second or so, 40 in all (about 20 s); a try that finds no
            # child (a pool is restarting one) does not count.
            while len(c.kills) < kills and time.monotonic() - started < 40:
                c.kill_and_restart()
                if not outage_thread.is_alive() and time.monotonic() - started > 8 and (
                        outage_thread.ident is None):
                    outage_thread.start()
                time.sleep(random.uniform(0.3, 0.7))
        finally:
            if outage_thread.ident is not None:
                outage_thread.join(120)
        assert outage_errors == []
        assert outage_thread.ident is not None

        statuses = wait_for_runs(c, runs, timeout=100)
        failures = c.sql(f'SELECT error, count(*) FROM "{c.prefix}runs" '
                         "WHERE status <> 'succeeded' GROUP BY error")
        assert statuses.get("succeeded") == runs, f"{statuses}\n{failures}\n{c.log_tail()}"

        charges = dict(c.sql(f'SELECT task_id, count(*) FROM "{c.prefix}chaos_charges" '
                             "GROUP BY task_id"))
        assert sorted(charges) == sorted(task_ids)
        assert set(charges.values()) == {1}

        executions, deliveries = read_events(c)
        problems, duplicates, in_doubt = check_executions(c, executions)
        recoveries = int(str(c.sql(f'SELECT sum(recoveries) FROM "{c.prefix}runs"')[0][0]))
        redeliveries = len(deliveries) - len(set(deliveries))
        route = "pgbouncer" if workers_url else "direct"
        print(f"\nchaos: broker={broker.name} store={route} runs={runs} kills={len(c.kills)} "
              f"redeliveries={redeliveries} "
              f"in-doubt re-runs={in_doubt} sweep recoveries={recoveries} "
              f"duplicates={duplicates}")
        assert problems == [], "\n".join(problems[:20])
        assert duplicates == 0
        assert len(c.kills) == kills


@pytest.mark.chaos
@pytest.mark.long
def test_chaos_kills_atomic_steps_write_once(pg_url: str, redis_url: str,
                                             tmp_path: Path) -> None:
    """100 runs of atomic ledger steps under SIGKILLs: all succeed, no ledger row twice."""
    runs = 100
    broker = Broker("redis", redis_url, redis_url)
    with cluster(pg_url, broker, tmp_path, lease_seconds=3) as c:
        c.start_with_sweeper()
        app = client_app(c, broker)
        task_ids = [str(uuid.uuid4()) for _ in range(runs)]
        for n, task_id in enumerate(task_ids):
            app.send_task("proj.chaos_ledger", args=(n,), task_id=task_id, queue=c.queue)
        started = time.monotonic()
        while len(c.kills) < 30 and time.monotonic() - started < 40:
            c.kill_and_restart()
            time.sleep(random.uniform(0.3, 0.7))

        statuses = wait_for_runs(c, runs, timeout=100)
        assert statuses.get("succeeded") == runs, f"{statuses}\n{c.log_tail()}"

        ledger = c.sql(f'SELECT task_id, step, count(*) FROM "{c.prefix}chaos_ledger" '
                       "GROUP BY task_id, step")
        twice = [row for row in ledger if int(str(row[2])) != 1]
        assert twice == [], twice[:10]
        assert sorted((str(t), str(s)) for t, s, _ in ledger) == sorted(
            (t, s) for t in task_ids for s in ("debit", "credit", "fee", "receipt"))

        executions, _deliveries = read_events(c)
        problems, _after_end, in_doubt = check_executions(c, executions)
        # A body killed after its last line but before the commit logged "ok" and yet
        # committed nothing: running it again is right, and the ledger above is the
        # judge of whether anything happened twice. Overlaps are still problems.
        overlaps = [p for p in problems if "was still running it" in p]
        # Bodies a kill cut short, started again: their writes had been rolled back.
        rerun = sum(max(0, len(r) - 1) for r in executions.values())
        print(f"\nchaos (atomic): broker={broker.name} runs={runs} kills={len(c.kills)} "
              f"bodies re-run after a kill={rerun} in-doubt re-runs={in_doubt} "
              f"ledger rows written twice={len(twice)}")
        assert overlaps == [], "\n".join(overlaps[:20])
        assert in_doubt == 0  # an atomic step is never in doubt
        assert len(c.kills) == 30


def test_duplicate_delivery_runs_each_step_once(pg_url: str, broker: Broker,
                                                tmp_path: Path) -> None:
    """The same task id sent twice at once to two workers: every body runs once, both end."""
    with cluster(pg_url, broker, tmp_path, lease_seconds=10) as c:
        c.start_worker(0, concurrency=1)
        c.start_worker(1, concurrency=1)
        c.wait_ready(2)
        app = client_app(c, broker)
        task_ids = [str(uuid.uuid4()) for _ in range(5)]
        for n, task_id in enumerate(task_ids):
            for _copy in range(2):
                app.send_task("proj.chaos_trip", args=(n,), kwargs={"fail_notify": False},
                              task_id=task_id, queue=c.queue)
        statuses = wait_for_runs(c, len(task_ids), timeout=60)
        assert statuses.get("succeeded") == len(task_ids), f"{statuses}\n{c.log_tail()}"
        # The second copy of each id is turned away without running anything: while the
        # first holds the lease, or with the recorded result once the first succeeded.
        turned_away = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            logs = c.log_tail(10_000)
            turned_away = (logs.count("this duplicate delivery leaves it alone")
                           + logs.count("already succeeded"))
            if turned_away >= len(task_ids):
                break
            time.sleep(0.2)
        assert turned_away == len(task_ids), c.log_tail()
        assert "raised unexpected" not in c.log_tail(10_000)

        executions, deliveries = read_events(c)
        assert sorted(deliveries) == sorted((t, 0) for t in task_ids)
        for task_id in task_ids:
            for name in ("search", "pick", "book", "notify"):
                assert len(executions[(task_id, name)]) == 1, (task_id, name)
        charges = dict(c.sql(f'SELECT task_id, count(*) FROM "{c.prefix}chaos_charges" '
                             "GROUP BY task_id"))
        assert charges == dict.fromkeys(task_ids, 1)
