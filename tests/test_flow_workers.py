"""Flow control under real ``celery worker`` processes: slots per key, SIGKILLs, rate limits.

The tasks are :mod:`tests.proj.flow`'s. Every body and every attempt of them
appends its start and end (``time.time()``, pid) to a ledger file outside the
store, so the checks are made on what the worker processes did:

* at no instant did more bodies of one key run than its Concurrency limit (a
  body whose process was SIGKILLed ends at the moment it was killed);
* an attempt that found its run queued for a slot, or over its rate, ended at
  once instead of holding its worker process;
* no window of the rate limit's length holds more body starts than its limit,
  across three worker processes;
* every run succeeded with its own result.

The workers are prefork ``celery -A tests.proj worker`` subprocesses, on Redis
and on RabbitMQ (the ``broker`` fixture), each test with its own queue and tables.
The sweep does not run inside workers: where a test needs it (a killed holder's
slot is handed on by it once the lease expires) it runs ``celery -A tests.proj
duraflow recover`` beside them, as a deployment does.
"""

from __future__ import annotations

import bisect
import math
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy.exc import ProgrammingError

from celery_duraflow import get_run
from tests.conftest import Broker
from tests.workers import (
    REPO_ROOT,
    _wait_until_ready,
    client_app,
    end_project,
    fetch_all,
    proj_env,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.subprocess]

#: tests.proj.flow.LIMIT: how many bodies of one key proj.flow_limited runs at once.
LIMIT = 2
#: How long an attempt may keep its worker process before its body starts (or, for one
#: whose run was queued or rate-limited, before it ends): far more than taking a slot or
#: queueing costs, even on a busy machine, and far less than waiting for a slot would.
QUEUED_ATTEMPT_SLACK = 3.0


# -- the ledger --------------------------------------------------------------------------------


@dataclass
class Body:
    """One execution of a run's body, as its worker process logged it."""

    pid: int
    task_id: str
    key: str
    start: float
    end: float | None = None


@dataclass
class Attempt:
    """One attempt of a run in a worker process: task_prerun to task_postrun."""

    pid: int
    task_id: str
    begin: float
    body: float | None = None
    end: float | None = None
    state: str | None = None

    def held_before_body(self) -> float | None:
        """How long it kept its process before its body started, or before it ended
        without running it; None if it was killed first."""
        until = self.body if self.body is not None else self.end
        return None if until is None else until - self.begin


def read_ledger(path: Path) -> tuple[list[Body], list[Attempt]]:
    """The bodies and the attempts the ledger file records, in the order they began."""
    bodies: list[Body] = []
    attempts: list[Attempt] = []
    if not path.exists():
        return bodies, attempts
    text = path.read_text()
    lines = text.split("\n")[:-1]  # a line still being written has no newline yet
    open_bodies: dict[int, Body] = {}
    open_attempts: dict[int, Attempt] = {}
    for line in lines:
        stamp, pid_text, kind, task_id, detail = line.split()
        at, pid = float(stamp), int(pid_text)
        if kind == "prerun":
            attempt = Attempt(pid=pid, task_id=task_id, begin=at)
            attempts.append(attempt)
            open_attempts[pid] = attempt
        elif kind == "postrun":
            ended = open_attempts.pop(pid, None)
            if ended is not None and ended.task_id == task_id:
                ended.end, ended.state = at, detail
        elif kind == "start":
            body = Body(pid=pid, task_id=task_id, key=detail, start=at)
            bodies.append(body)
            open_bodies[pid] = body
            running = open_attempts.get(pid)
            if running is not None and running.task_id == task_id:
                running.body = at
        elif kind == "end":
            finished = open_bodies.pop(pid, None)
            if finished is not None:
                finished.end = at
    return bodies, attempts


def body_end(body: Body, kills: dict[int, float]) -> float:
    """When ``body`` stopped running: its end line, else when its process was killed
    (infinity if neither: it is counted as running for ever)."""
    if body.end is not None:
        return body.end
    killed = kills.get(body.pid)
    return killed if killed is not None and killed >= body.start else math.inf


def most_at_once(bodies: Iterable[Body], kills: dict[int, float]) -> dict[str, int]:
    """The most bodies of each key that were running at one instant."""
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for body in bodies:
        events[body.key] += [(body.start, 1), (body_end(body, kills), -1)]
    most: dict[str, int] = {}
    for key, changes in events.items():
        current = 0
        most[key] = 0
        # An end and a start at the same instant: the end first (the slot was free).
        for _, change in sorted(changes):
            current += change
            most[key] = max(most[key], current)
    return most


def first_overlap(bodies: Iterable[Body], kills: dict[int, float]) -> float | None:
    """The first instant at which two of ``bodies`` were running at once, if any."""
    current = 0
    changes = [event for body in bodies
               for event in ((body.start, 1), (body_end(body, kills), -1))]
    for at, change in sorted(changes):
        current += change
        if current >= 2:
            return at
    return None


def busiest_window(starts: Iterable[float], per: float) -> int:
    """The most body starts in any window [t, t + per)."""
    ordered = sorted(starts)
    return max((bisect.bisect_left(ordered, start + per) - index
                for index, start in enumerate(ordered)), default=0)


def held_too_long(attempts: Iterable[Attempt], limit: float) -> list[str]:
    """Attempts that kept their worker process longer than ``limit`` before running their
    body, or before ending without it (a run queued for a slot, or over its rate)."""
    return [f"pid {a.pid} task {a.task_id}: {'body started' if a.body else 'ended, no body,'} "
            f"{held:.3f}s after the attempt began"
            for a in attempts
            if (held := a.held_before_body()) is not None and held > limit]


# -- the project: workers, a sweeper, a client -----------------------------------------------


@dataclass
class FlowProject:
    """Worker processes on one queue and tables of their own, the ledger they write, and a
    client that sends to them and reads their runs."""

    pg_url: str
    prefix: str
    queue: str
    env: dict[str, str]
    client: Celery
    ledger: Path
    logs: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    #: When each killed pid was killed (taken just before the signal).
    kills: dict[int, float] = field(default_factory=dict)

    def _spawn(self, name: str, command: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        log_path = self.logs / f"{name}.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.proj", *command], cwd=REPO_ROOT,
                env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        # Listed before it is waited for: the project ends it whatever happens next.
        self.processes.append(process)
        return process, log_path

    def start_workers(self, count: int, *, concurrency: int) -> list[subprocess.Popen[bytes]]:
        """Start ``count`` prefork workers together; return them once every one is ready."""
        started = []
        for _ in range(count):
            name = f"worker{len(self.processes)}"
            started.append(self._spawn(name, [
                "worker", "--pool", "prefork", "--concurrency", str(concurrency),
                "--loglevel", "INFO", "-Q", self.queue,
                "-n", f"{self.queue}-{name}-{uuid.uuid4().hex[:6]}@%h",
                "--without-heartbeat", "--without-gossip", "--without-mingle"]))
        for process, log_path in started:
            _wait_until_ready(process, log_path, 0)
        return [process for process, _ in started]

    def start_sweeper(self, interval: float) -> None:
        """``celery -A tests.proj duraflow recover --interval ...``, once it sweeps."""
        process, log_path = self._spawn("sweeper", ["duraflow", "recover",
                                                    "--interval", str(interval)])
        wait_until(lambda: "waking due runs" in log_path.read_text(errors="replace"),
                   30, lambda: f"the sweeper did not start:\n{self.log_tail()}",
                   alive=[process])

    def send(self, task: str, *args: Any, **kwargs: Any) -> str:
        task_id = str(uuid.uuid4())
        self.client.send_task(task, args=args, kwargs=kwargs, task_id=task_id,
                              queue=self.queue)
        return task_id

    def sql(self, statement: str) -> list[Any]:
        return fetch_all(self.pg_url, statement, {})

    def statuses(self) -> dict[str, str]:
        """Each recorded run's status, by task id (none before a worker made the tables)."""
        try:
            rows = self.sql(f'SELECT task_id, status FROM "{self.prefix}runs"')
        except ProgrammingError:
            return {}
        return {str(task_id): str(status) for task_id, status in rows}

    def wait_succeeded(self, expected: dict[str, Any], timeout: float) -> None:
        """Wait until every run in ``expected`` succeeded; then check each one's result."""
        def done() -> bool:
            statuses = self.statuses()
            if any(statuses.get(task_id) in ("failed", "cancelled") for task_id in expected):
                return True  # reported below
            return all(statuses.get(task_id) == "succeeded" for task_id in expected)

        wait_until(done, timeout, lambda: f"runs not done: {self.summary(expected)}\n"
                                          f"{self.log_tail()}")
        problems = []
        for task_id, result in expected.items():
            run = get_run(task_id, app=self.client)
            if run is None or run.status != "succeeded" or run.result != result:
                problems.append(f"{task_id}: {run.status if run else 'no run'} "
                                f"{run.result if run else ''!r} {run.error if run else ''}, "
                                f"expected {result!r}")
        assert problems == [], "\n".join(problems[:20]) + "\n" + self.log_tail()

    def summary(self, task_ids: Iterable[str]) -> dict[str, int]:
        statuses = self.statuses()
        counts: dict[str, int] = defaultdict(int)
        for task_id in task_ids:
            counts[statuses.get(task_id, "not recorded")] += 1
        return dict(counts)

    def kill_worker(self, worker: subprocess.Popen[bytes]) -> float:
        """SIGKILL a whole worker (its main process and every pool child); when."""
        pids = process_group(worker.pid)
        # Taken before the signal: no body of those processes ran past it.
        at = time.time()
        with suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        for pid in pids:
            self.kills.setdefault(pid, at)
        worker.wait(15)
        return at

    def kill_pid(self, pid: int) -> bool:
        """SIGKILL one pool child; False if it was gone already."""
        at = time.time()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.kills.setdefault(pid, at)
        return True

    def flow_rows(self) -> dict[str, int]:
        """How many rows the slot and queue tables still hold."""
        return {table: int(self.sql(f'SELECT count(*) FROM "{self.prefix}{table}"')[0][0])
                for table in ("flow_slots", "flow_waits")}

    def log_tail(self, lines: int = 30) -> str:
        parts = []
        for log in sorted(self.logs.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(parts)


@contextmanager
def flow_project(pg_url: str, broker: Broker, tmp_path: Path, *,
                 lease_seconds: float = 30.0) -> Iterator[FlowProject]:
    """A project whose processes are SIGKILLed, queue deleted and tables dropped at the end,
    whatever happened."""
    prefix = f"f{uuid.uuid4().hex[:8]}_"
    queue = f"flow-{uuid.uuid4().hex[:8]}"
    logs = tmp_path / "logs"
    logs.mkdir()
    ledger = tmp_path / "flow.log"
    env = proj_env(pg_url, broker.url, prefix, result_backend=broker.result_backend,
                   PROJ_FLOW_LOG=str(ledger), PROJ_LEASE_SECONDS=str(lease_seconds))
    client = client_app(pg_url, broker.url, prefix, result_backend=broker.result_backend)
    project = FlowProject(pg_url=pg_url, prefix=prefix, queue=queue, env=env, client=client,
                          ledger=ledger, logs=logs)
    try:
        yield project
    finally:
        end_project(client, pg_url, prefix, project.processes, [queue])


def wait_until(condition: Callable[[], bool], timeout: float, failure: Callable[[], str], *,
               alive: Iterable[subprocess.Popen[bytes]] = ()) -> None:
    """Poll ``condition`` until it holds; AssertionError with ``failure()`` after ``timeout``
    seconds, or as soon as one of the ``alive`` processes has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if any(process.poll() is not None for process in alive):
            break
        time.sleep(0.1)
    raise AssertionError(failure())


def process_group(pgid: int) -> list[int]:
    """The pids of the processes in process group ``pgid`` (a worker and its pool)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids


# -- concurrency on prefork workers -----------------------------------------------------------

RUNS = 300
KEYS = 6
#: How long a body lasts: short, so that 300 of them take seconds.
BODY_SECONDS = 0.08


@pytest.mark.one_broker
def test_concurrency_limit_holds_across_prefork_processes(pg_url: str, broker: Broker,
                                                          tmp_path: Path) -> None:
    """300 runs over 6 keys on 4 prefork processes, Concurrency(2): never 3 bodies of a key
    at once, each body once, every run succeeds, and a queued attempt frees its process."""
    with flow_project(pg_url, broker, tmp_path) as project:
        project.start_workers(1, concurrency=4)
        started = time.monotonic()
        expected: dict[str, Any] = {}
        for n in range(RUNS):
            # In blocks of ten runs of one key: the four processes mostly get runs of the
            # same key at once, so most of them find both slots taken and queue.
            key = f"k{(n // 10) % KEYS}"
            expected[project.send("proj.flow_limited", key, n, BODY_SECONDS)] = f"{key}:{n}"
        project.wait_succeeded(expected, timeout=150)
        elapsed = time.monotonic() - started
        bodies, attempts = read_ledger(project.ledger)

        most = most_at_once(bodies, project.kills)
        held = sorted(h for a in attempts if (h := a.held_before_body()) is not None)
        queued = [a for a in attempts if a.body is None]
        print(f"\nflow ({broker.name}): {RUNS} runs in {elapsed:.1f}s, {len(attempts)} attempts, "
              f"{len(queued)} without a body; most bodies at once per key {most}; held before "
              f"the body or the end: median {held[len(held) // 2]:.3f}s, max {held[-1]:.3f}s")
        assert sorted(body.task_id for body in bodies) == sorted(expected)
        assert all(body.end is not None for body in bodies)
        assert most == {f"k{k}": LIMIT for k in range(KEYS)}
        # Runs did queue (the test exercised the queue), and not one of their attempts kept
        # its process waiting for a slot.
        assert len(queued) > 0
        assert all(a.state == "IGNORED" for a in queued), {a.state for a in queued}
        assert held_too_long(attempts, BODY_SECONDS + QUEUED_ATTEMPT_SLACK) == []
        assert project.flow_rows() == {"flow_slots": 0, "flow_waits": 0}


# -- SIGKILLed slot holders -------------------------------------------------------------------

#: duraflow_lease_seconds of the kill tests' workers, and the sweep's interval.
LEASE = 3.0
SWEEP_INTERVAL = 1.0
#: What a busy machine may add to a lease and a sweep before a freed slot's run starts.
HANDOVER_SLACK = 4.0
#: The queued runs' bodies: long enough that two runs handed the two freed slots overlap.
QUEUED_BODY = 1.0


@pytest.mark.chaos
@pytest.mark.one_broker
def test_a_killed_worker_frees_its_slots_within_a_lease(pg_url: str, broker: Broker,
                                                        tmp_path: Path) -> None:
    """A worker SIGKILLed while its processes hold a key's 2 slots: both go to the queued
    runs within a lease and a sweep, never 3 live bodies of the key, every run succeeds."""
    with flow_project(pg_url, broker, tmp_path, lease_seconds=LEASE) as project:
        project.start_sweeper(SWEEP_INTERVAL)
        [holding] = project.start_workers(1, concurrency=2)
        gate = tmp_path / "hold"
        gate.touch()
        holders = {project.send("proj.flow_limited", "hot", n, 0.2, hold=str(gate)): f"hot:{n}"
                   for n in range(2)}

        def holders_running() -> bool:
            return {b.task_id for b in read_ledger(project.ledger)[0]} >= set(holders)

        wait_until(holders_running, 30, lambda: f"holders not running\n{project.log_tail()}")
        holder_pids = {b.pid for b in read_ledger(project.ledger)[0] if b.task_id in holders}
        assert holder_pids <= set(process_group(holding.pid))

        # A second worker, which the runs sent from now on go to: the first one's two
        # processes are busy with the holders.
        project.start_workers(1, concurrency=3)
        queued = {project.send("proj.flow_limited", "hot", n, QUEUED_BODY): f"hot:{n}"
                  for n in range(2, 8)}
        wait_until(lambda: all(project.statuses().get(t) == "waiting" for t in queued), 30,
                   lambda: f"not all queued: {project.summary(queued)}\n{project.log_tail()}")
        # Six runs wait for the key, and no process is held by them: another key's runs go
        # through on the second worker's three processes.
        others = {project.send("proj.flow_limited", "cool", n, 0.05): f"cool:{n}"
                  for n in range(8, 14)}
        project.wait_succeeded(others, timeout=30)
        assert all(project.statuses()[t] == "waiting" for t in queued)

        killed_at = project.kill_worker(holding)
        gate.unlink()
        project.wait_succeeded({**holders, **queued}, timeout=90)

        bodies, attempts = read_ledger(project.ledger)
        kills = project.kills
        # Both slots were handed on: two of the queued runs ran at once, within a lease and
        # a sweep of the kill (one slot alone would run them one by one).
        both_free_at = first_overlap([b for b in bodies if b.task_id in queued], kills)
        first_start = min(b.start for b in bodies if b.task_id in queued)
        print(f"\nkill ({broker.name}): first queued body {first_start - killed_at:.2f}s after "
              f"the kill, both slots in use again after "
              f"{(both_free_at or math.inf) - killed_at:.2f}s (lease {LEASE}s, sweep every "
              f"{SWEEP_INTERVAL}s)")
        assert first_start > killed_at
        assert both_free_at is not None
        assert both_free_at <= killed_at + LEASE + SWEEP_INTERVAL + HANDOVER_SLACK
        most = most_at_once(bodies, kills)
        assert most["hot"] == LIMIT and most["cool"] <= LIMIT
        killed = [b for b in bodies if b.end is None]
        assert sorted(b.task_id for b in killed) == sorted(holders)
        # Each holder ran its body again after the kill; no other run's body ran twice.
        assert sorted(b.task_id for b in bodies) == sorted([*holders, *holders, *queued,
                                                            *others])
        assert held_too_long(attempts, QUEUED_BODY + QUEUED_ATTEMPT_SLACK) == []
        assert project.flow_rows() == {"flow_slots": 0, "flow_waits": 0}


@pytest.mark.long
def test_a_run_handed_a_slot_behind_a_broker_backlog_still_succeeds(
        pg_url: str, redis_url: str, tmp_path: Path) -> None:
    """A run handed a slot whose message waits behind a backlog of 6+ leases still succeeds
    (it was never lost: it waited its turn in the broker)."""
    broker = Broker("redis", redis_url, redis_url)
    with flow_project(pg_url, broker, tmp_path, lease_seconds=1.0) as project:
        project.start_sweeper(0.5)
        project.start_workers(1, concurrency=3)
        gate = tmp_path / "hold"
        gate.touch()
        holders = {project.send("proj.flow_limited", "hot", n, 0.0, hold=str(gate)): f"hot:{n}"
                   for n in range(2)}
        wait_until(lambda: {b.task_id for b in read_ledger(project.ledger)[0]} >= set(holders),
                   30, lambda: f"holders not running\n{project.log_tail()}")
        queued = project.send("proj.flow_limited", "hot", 2, 0.0)
        wait_until(lambda: project.statuses().get(queued) == "waiting", 30,
                   lambda: f"not queued: {project.summary([queued])}\n{project.log_tail()}")
        # A backlog of about 15 s (90 bodies of 0.5 s on 3 processes), on keys that never wait.
        backlog = {project.send("proj.flow_limited", f"f{n % 10}", n, 0.5): f"f{n % 10}:{n}"
                   for n in range(3, 93)}
        gate.unlink()  # the holders end; the queued run is handed a slot, behind the backlog
        seen: set[str] = set()

        def all_done() -> bool:
            statuses = project.statuses()
            seen.add(statuses.get(queued, "not recorded"))
            return all(statuses.get(t) == "succeeded" for t in [*holders, *backlog, queued])

        wait_until(all_done, 90, lambda: f"runs not done: {project.summary(backlog)}\n"
                                         f"{project.log_tail()}")
        project.wait_succeeded({**holders, queued: "hot:2", **backlog}, timeout=10)
        run = get_run(queued, app=project.client)
        assert run is not None
        # It waited its turn in the broker: nothing was lost, so nothing was sent again.
        assert ("failed" in seen, run.recoveries) == (False, 0), project.log_tail(8)


CHAOS_RUNS = 300
CHAOS_KEYS = 5
CHAOS_KILLS = 20


@pytest.mark.chaos
@pytest.mark.long
def test_random_kills_of_slot_holders_never_exceed_the_limit(pg_url: str, broker: Broker,
                                                             tmp_path: Path) -> None:
    """Pool children SIGKILLed in their bodies (20) and whole workers (2) under 300 runs of
    Concurrency(2) over 5 keys: never 3 live bodies of a key, every run succeeds."""
    rng = random.Random(20240607)
    with flow_project(pg_url, broker, tmp_path, lease_seconds=LEASE) as project:
        project.start_sweeper(SWEEP_INTERVAL)
        workers = project.start_workers(2, concurrency=3)
        expected: dict[str, Any] = {}
        for n in range(CHAOS_RUNS):
            # In blocks of twenty runs of one key: most first deliveries find the key's
            # slots taken and queue at once, so every run is recorded within seconds.
            key = f"k{(n // 20) % CHAOS_KEYS}"
            expected[project.send("proj.flow_limited", key, n,
                                  round(rng.uniform(0.3, 0.9), 3))] = f"{key}:{n}"
        # Kills start once every run is recorded: a first delivery lost with a killed
        # worker (Redis keeps it unacknowledged for an hour) would leave no run to recover.
        wait_until(lambda: len(project.statuses()) == CHAOS_RUNS, 60,
                   lambda: f"runs not all recorded\n{project.log_tail()}")
        started = time.monotonic()
        whole_kills = 0
        child_kills = 0
        while child_kills < CHAOS_KILLS and time.monotonic() - started < 60:
            time.sleep(rng.uniform(0.3, 0.8))
            if whole_kills < 2 and child_kills >= (whole_kills + 1) * CHAOS_KILLS // 3:
                # A whole worker, then a fresh one in its place.
                victim = workers.pop(0)
                project.kill_worker(victim)
                workers += project.start_workers(1, concurrency=3)
                whole_kills += 1
                continue
            live = {pid for worker in workers if worker.poll() is None
                    for pid in process_group(worker.pid) if pid != worker.pid}
            in_body = [b.pid for b in read_ledger(project.ledger)[0]
                       if b.end is None and b.pid in live and b.pid not in project.kills]
            if in_body and project.kill_pid(rng.choice(in_body)):
                child_kills += 1
        project.wait_succeeded(expected, timeout=120)

        bodies, _attempts = read_ledger(project.ledger)
        killed = sum(1 for b in bodies if b.end is None)
        recoveries = project.sql(f'SELECT sum(recoveries) FROM "{project.prefix}runs"')[0][0]
        most = most_at_once(bodies, project.kills)
        print(f"\nflow chaos ({broker.name}): {child_kills} children and {whole_kills} workers "
              f"killed, {killed} bodies cut short, {recoveries} sweep recoveries, most "
              f"bodies at once per key {most}")
        assert child_kills == CHAOS_KILLS and whole_kills == 2
        # Most kills cut a body short (a body may end between the look and the kill).
        assert killed >= CHAOS_KILLS // 2
        assert max(most.values()) <= LIMIT
        assert {b.task_id for b in bodies if b.end is not None} == set(expected)
        assert project.flow_rows() == {"flow_slots": 0, "flow_waits": 0}


# -- rate limits across worker processes ------------------------------------------------------


def _rate_limit_holds(pg_url: str, broker: Broker, tmp_path: Path, *, task: str, limit: int,
                      per: float, runs: int) -> None:
    """``runs`` runs of ``task`` (RateLimit(limit, per)) on 3 separate worker processes."""
    with flow_project(pg_url, broker, tmp_path) as project:
        workers = project.start_workers(3, concurrency=1)
        expected = {project.send(task, n): n for n in range(runs)}
        project.wait_succeeded(expected, timeout=runs / limit * per + 90)
        bodies, attempts = read_ledger(project.ledger)
        starts = [b.start for b in bodies]
        busiest = busiest_window(starts, per)
        by_worker = {worker.pid: 0 for worker in workers}
        pools = {pid: worker.pid for worker in workers for pid in process_group(worker.pid)}
        for body in bodies:
            by_worker[pools[body.pid]] += 1
        print(f"\nrate ({broker.name}): {runs} runs at {limit} per {per:g}s over "
              f"{max(starts) - min(starts):.1f}s, {len(attempts)} attempts; busiest window "
              f"{busiest}; bodies per worker {sorted(by_worker.values())}")
        assert sorted(b.task_id for b in bodies) == sorted(expected)
        assert busiest == limit
        # The limit spaced the runs out: `runs` starts need runs / limit windows at least.
        assert max(starts) - min(starts) >= (math.ceil(runs / limit) - 1) * per
        # The three workers shared the limit: each ran bodies.
        assert all(count > 0 for count in by_worker.values()), by_worker
        assert held_too_long(attempts, QUEUED_ATTEMPT_SLACK) == []


@pytest.mark.one_broker
def test_rate_limit_holds_across_worker_processes(pg_url: str, broker: Broker,
                                                  tmp_path: Path) -> None:
    """RateLimit(10, per=2) over 3 worker processes for 8 s: no 2 s window has 11 starts."""
    _rate_limit_holds(pg_url, broker, tmp_path, task="proj.flow_rated_short", limit=10,
                      per=2.0, runs=40)


@pytest.mark.long
def test_rate_limit_holds_across_worker_processes_for_a_minute(pg_url: str, broker: Broker,
                                                               tmp_path: Path) -> None:
    """RateLimit(50, per=10) over 3 worker processes for 60 s: no 10 s window has 51 starts."""
    # 350 starts at 50 per 10 s: the first 50 at once, the last ones 60 s later.
    _rate_limit_holds(pg_url, broker, tmp_path, task="proj.flow_rated_long", limit=50,
                      per=10.0, runs=350)
