"""Three durable schedulers on one schedule, one SIGKILLed and restarted: each slot once.

Real processes on PostgreSQL and Redis, started from :mod:`tests.fleetproj`:
three ``celery beat -S celery_duraflow.beat:DurableScheduler``, a prefork
``celery worker``, and the recovery sweep (``celery duraflow recover``, every
second), which sends a run whose message a killed scheduler committed but never
sent. The schedule (a ``beat_schedule`` entry) fires every second, ``catchup="all"``
with a window longer than the test, ``overlap="allow_all"``; its task adds one
row per execution to a ledger of the test's own that has no unique key.

Mid-way one scheduler is SIGKILLed in the worst moment of a pass: the run of the
slot it fired is committed and its message not sent yet (the test holds it there,
see ``FLEET_HOLD_FILE`` in :mod:`tests.fleetproj`, checks that the row is
committed, and kills it). It is started again a few seconds later, while the
other two go on firing. Once the schedulers are stopped and every run has ended:

* the slots fired are every slot from the schedule's first (the first after it
  was stored) to its last, each with exactly one run whose id is
  ``schedule_run_id(name, slot)``, and the task has no other run;
* every run succeeded, and the ledger has exactly one row per run;
* no run was sent by two schedulers (the publish log of every process says who
  sent what; the sweep may send a run again, which the run's lease turns away), and
  the run whose message the kill lost was sent by the sweep, and ran once;
* the schedule counts as many fired slots as there are runs, and none skipped.

The short scenario (about 25 slots) runs with the suite; the issue's ten minutes
(600 slots) is marked ``long`` and ``chaos`` (``make chaos``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection
from sqlalchemy import Engine, create_engine, text

from celery_duraflow import schedule_run_id
from tests.conftest import drop_tables
from tests.workers import delete_queue

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.subprocess]

REPO_ROOT = Path(__file__).resolve().parent.parent
TASK_NAME = "fleet.tick"
EVERY = timedelta(seconds=1)
SCHEDULERS = 3
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
LEASE_SECONDS = 3


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of a live process (Linux), or 0 when it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Fleet:
    """The processes of one scenario, their logs, and the tables and queue they share."""

    pg_url: str
    env: dict[str, str]
    logs: Path
    prefix: str
    queue: str
    name: str
    engine: Engine
    beats: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def publish_log(self) -> Path:
        return self.logs / "published.log"

    @property
    def hold_file(self) -> Path:
        return self.logs / "hold"

    def published(self) -> list[tuple[str, str, str]]:
        """The publish log's lines as (role, event, task id), oldest first (a line still
        being written, without its newline yet, is left for the next read)."""
        with contextlib.suppress(FileNotFoundError):
            lines = self.publish_log.read_text().split("\n")[:-1]
            return [(role, event, task_id) for _at, _pid, role, event, task_id in
                    (line.split() for line in lines)]
        return []

    def _start(self, role: str, *arguments: str) -> subprocess.Popen[bytes]:
        with (self.logs / f"{role}.log").open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.fleetproj", *arguments],
                cwd=REPO_ROOT, env={**self.env, "FLEET_ROLE": role},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        self.processes.append(process)
        return process

    def start_beat(self, role: str) -> subprocess.Popen[bytes]:
        """A durable scheduler, with a schedule file and pidfile of its own."""
        process = self._start(
            role, "beat", "-S", "celery_duraflow.beat:DurableScheduler", "-l", "info",
            "--schedule", str(self.logs / f"{role}.schedule"),
            "--pidfile", str(self.logs / f"{role}.pid"))
        self.beats[role] = process
        return process

    def start_worker(self) -> subprocess.Popen[bytes]:
        return self._start("worker", "worker", "--pool", "prefork", "--concurrency", "2",
                    "-l", "info", "-Q", self.queue, "-n", f"{self.queue}@%h",
                    "--without-heartbeat", "--without-gossip", "--without-mingle")

    def start_sweeper(self) -> subprocess.Popen[bytes]:
        return self._start("sweep", "duraflow", "recover", "--interval", "1")

    def wait_for_log(self, role: str, process: subprocess.Popen[bytes], marker: str) -> None:
        """Wait until the log of ``role`` shows ``marker``; fail with its end if it does
        not, or if the process ends first."""
        log = self.logs / f"{role}.log"
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if marker in log.read_text(errors="replace"):
                return
            if process.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{role} did not log {marker!r}:\n{self.log_tail(role)}")

    def log_tail(self, role: str, lines: int = 40) -> str:
        try:
            text_ = (self.logs / f"{role}.log").read_text(errors="replace")
        except OSError as exc:
            return f"(no log for {role}: {exc})"
        return "\n".join(text_.splitlines()[-lines:])

    def all_logs(self, lines: int = 25) -> str:
        return "\n".join(f"--- {path.stem}\n{self.log_tail(path.stem, lines)}"
                         for path in sorted(self.logs.glob("*.log"))
                         if path != self.publish_log)

    def sql(self, statement: str, **params: Any) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.execute(text(statement), params).all())

    def schedule(self) -> Any:
        """The schedule's row, or None before a scheduler has stored it."""
        with contextlib.suppress(Exception):  # no table until a scheduler created it
            rows = self.sql(f'SELECT * FROM "{self.prefix}schedules" WHERE name = :name',
                            name=self.name)
            return rows[0] if rows else None
        return None

    def kill_in_the_send_window(self) -> tuple[str, str]:
        """SIGKILL the next scheduler to send a slot's run, once the run is committed and
        before its message leaves; (that scheduler, the run's task id)."""
        self.hold_file.touch()
        try:
            deadline = time.monotonic() + 10
            held = None
            while held is None:
                assert time.monotonic() < deadline, "no scheduler sent a run:\n" + (
                    self.all_logs())
                held = next(((role, task_id) for role, event, task_id in self.published()
                             if event == "hold"), None)
                time.sleep(0.005)
            role, task_id = held
            process = self.beats[role]
            self.cpu[role] = _cpu_seconds(process.pid)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(STOP_TIMEOUT)
        finally:
            self.hold_file.unlink()
        return role, task_id

    def stop(self, process: subprocess.Popen[bytes]) -> None:
        """SIGTERM (a warm shutdown), then SIGKILL to the process group if it lingers."""
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(STOP_TIMEOUT)
        self.kill(process)

    def kill(self, process: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(STOP_TIMEOUT)


@contextlib.contextmanager
def fleet(pg_url: str, redis_url: str, tmp_path: Path) -> Iterator[Fleet]:
    """The environment, ledger table and queue of one scenario; every process it starts is
    killed, and its tables and queue dropped, however the test ends."""
    suffix = uuid.uuid4().hex[:8]
    prefix, queue, name = f"f{suffix}_", f"fleet-{suffix}", f"fleet-every-second-{suffix}"
    logs = tmp_path / "logs"
    logs.mkdir()
    # The subprocesses must import the tree under test, not another checkout the
    # package happens to be installed from.
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH"))
                                 if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1",
           "FLEET_BROKER_URL": redis_url, "FLEET_DATABASE_URL": pg_url,
           "FLEET_TABLE_PREFIX": prefix, "FLEET_QUEUE": queue, "FLEET_SCHEDULE": name,
           "FLEET_LEASE_SECONDS": str(LEASE_SECONDS), "FLEET_CATCHUP_WINDOW": "3600",
           "FLEET_PUBLISH_LOG": str(logs / "published.log"),
           "FLEET_HOLD_FILE": str(logs / "hold")}
    engine = create_engine(pg_url)
    f = Fleet(pg_url=pg_url, env=env, logs=logs, prefix=prefix, queue=queue, name=name,
              engine=engine)
    try:
        with engine.begin() as conn:
            conn.execute(text(f'CREATE TABLE "{prefix}fleet_ledger" ('
                              "id BIGSERIAL PRIMARY KEY, task_id VARCHAR(255) NOT NULL, "
                              "pid INTEGER NOT NULL, ran_at TIMESTAMPTZ NOT NULL)"))
        yield f
    finally:
        try:
            for process in f.processes:
                with contextlib.suppress(Exception):
                    f.kill(process)
            with Connection(redis_url, connect_timeout=5) as conn:
                delete_queue(conn, queue)
        finally:
            with engine.begin() as conn:
                conn.execute(text(f'DROP TABLE IF EXISTS "{prefix}fleet_ledger"'))
            engine.dispose()
            drop_tables(pg_url, prefix)


def _imported_tree(env: dict[str, str]) -> str:
    """Where a subprocess started like the fleet's imports celery_duraflow from."""
    return subprocess.run(
        [sys.executable, "-c", "import celery_duraflow; print(celery_duraflow.__file__)"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip()


def _run_fleet(pg_url: str, redis_url: str, tmp_path: Path, *, slots: int, kill_at: int,
               restart_after: float) -> None:
    """Fire ``slots`` slots with three schedulers, SIGKILL one once ``kill_at`` slots have
    fired and start it again ``restart_after`` seconds later; then check every slot."""
    began = time.monotonic()
    with fleet(pg_url, redis_url, tmp_path) as f:
        assert _imported_tree(f.env) == str(REPO_ROOT / "celery_duraflow" / "__init__.py")
        # All at once: a slot fired before the worker is ready waits in the queue.
        worker = f.start_worker()
        f.start_sweeper()
        roles = [f"beat{index}" for index in range(SCHEDULERS)]
        for role in roles:
            f.start_beat(role)
        for role in roles:
            f.wait_for_log(role, f.beats[role], "beat: Starting...")
        f.wait_for_log("worker", worker, " ready.")
        started = time.monotonic()

        # (role, the run whose message it held, slots fired, monotonic time)
        killed: tuple[str, str, int, float] | None = None
        restarted: str | None = None
        deadline = time.monotonic() + slots * EVERY.total_seconds() + 90
        fired = 0
        while fired < slots:
            assert time.monotonic() < deadline, (
                f"only {fired} of {slots} slots fired in time\n{f.all_logs()}")
            for role, process in f.beats.items():
                gone = killed is not None and role == killed[0]
                assert gone or process.poll() is None, (
                    f"{role} exited with {process.returncode}\n{f.log_tail(role)}")
            row = f.schedule()
            fired = int(row.fired) if row is not None else 0
            if killed is None and fired >= kill_at:
                victim, held = f.kill_in_the_send_window()
                killed = (victim, held, fired, time.monotonic())
                # Rows first, then messages: the run whose message was never sent is
                # stored already, so the sweep can send it.
                assert f.sql(f'SELECT status FROM "{f.prefix}runs" WHERE task_id = :id',
                             id=held) == [("running",)]
            elif killed is not None and restarted is None and (
                    time.monotonic() - killed[3] >= restart_after):
                restarted = f"{killed[0]}-restarted"
                f.wait_for_log(restarted, f.start_beat(restarted), "beat: Starting...")
            time.sleep(0.2)
        assert killed is not None and restarted is not None

        stop_requested = datetime.now(UTC)
        stopping = time.monotonic()
        fired_for = stopping - started
        for role, process in f.beats.items():
            if process.poll() is None:
                f.cpu[role] = _cpu_seconds(process.pid)
            f.stop(process)
        stopped_in = time.monotonic() - stopping
        schedule = f.schedule()
        assert schedule is not None

        # Every fired run ends: those whose message a killed scheduler never sent are
        # sent by the sweep once their lease (LEASE_SECONDS) has expired.
        wait_until = time.monotonic() + 60 + LEASE_SECONDS
        statuses: dict[str, int] = {}
        while time.monotonic() < wait_until:
            statuses = {str(status): int(count) for status, count in f.sql(
                f'SELECT status, count(*) FROM "{f.prefix}runs" WHERE task_name = :task '
                "GROUP BY status", task=TASK_NAME)}
            if sum(statuses.values()) >= schedule.fired and set(statuses) <= {"succeeded"}:
                break
            if set(statuses) - {"succeeded", "running"}:
                break
            time.sleep(0.25)
        # Nothing of the worker's or the sweep's shutdown matters any more.
        for process in f.processes:
            f.kill(process)
        assert set(statuses) == {"succeeded"}, f"{statuses}\n{f.all_logs()}"

        runs = {str(task_id): created_at for task_id, created_at in f.sql(
            f'SELECT task_id, created_at FROM "{f.prefix}runs" WHERE task_name = :task',
            task=TASK_NAME)}
        ledger = f.sql(f'SELECT task_id, ran_at FROM "{f.prefix}fleet_ledger"')
        bodies = Counter(str(task_id) for task_id, _ in ledger)

        # The slots of the schedule's life: from the first after it was stored to the
        # last it recorded; every run must be one of them.
        first = schedule.created_at.replace(microsecond=0) + EVERY
        last = schedule.last_slot_at
        expected = []
        slot = first
        while slot <= last:
            expected.append(slot)
            slot += EVERY
        slot_of = {schedule_run_id(f.name, slot): slot for slot in expected}
        missing = [slot.isoformat() for slot in expected
                   if schedule_run_id(f.name, slot) not in runs]
        others = sorted(set(runs) - set(slot_of))
        doubled = {task_id: n for task_id, n in bodies.items() if n != 1}
        no_body = [task_id for task_id in runs if task_id not in bodies]
        stray_bodies = sorted(set(bodies) - set(runs))

        # Who sent what: each run once by a scheduler, perhaps again by the sweep.
        senders: dict[str, list[str]] = defaultdict(list)
        for role, event, task_id in f.published():
            if event == "sent":
                senders[task_id].append(role)
        by_two = {task_id: roles_ for task_id, roles_ in senders.items()
                  if sum(role != "sweep" for role in roles_) > 1}
        swept_first = [task_id for task_id, roles_ in senders.items() if roles_[0] == "sweep"]
        resent = sum(role == "sweep" for roles_ in senders.values() for role in roles_)
        per_scheduler = Counter(roles_[0] for roles_ in senders.values()
                                if roles_[0] != "sweep")
        fire_lag = max((runs[task_id] - slot).total_seconds()
                       for task_id, slot in slot_of.items() if task_id in runs)
        body_lag = max((ran_at - slot_of[str(task_id)]).total_seconds()
                       for task_id, ran_at in ledger if str(task_id) in slot_of)
        beat_errors = sum(f.log_tail(role, 100_000).count("ERROR") for role in f.beats)
        cpu = " ".join(f"{role}={seconds:.1f}s" for role, seconds in sorted(f.cpu.items()))

        victim, lost, fired_at_kill, _ = killed
        print(f"\nschedule fleet: slots={len(expected)} ({first:%H:%M:%S}..{last:%H:%M:%S}) "
              f"schedulers={SCHEDULERS} kills=1 ({victim} after {fired_at_kill} slots, between "
              f"the commit and the send of {slot_of.get(lost, lost)}, "
              f"restarted after {restart_after:g} s) runs={len(runs)} "
              f"bodies={sum(bodies.values())} missing={len(missing)} "
              f"doubled={len(doubled)} other runs={len(others)} "
              f"sent by {dict(sorted(per_scheduler.items()))} "
              f"lost then sent by the sweep={len(swept_first)} sweep sends={resent} "
              f"max fire lag={fire_lag:.2f}s max body lag={body_lag:.2f}s "
              f"beat errors logged={beat_errors} beat cpu: {cpu} "
              f"schedulers ran {fired_for:.1f}s (stopped in {stopped_in:.1f}s), "
              f"test {time.monotonic() - began:.0f}s")

        assert missing == [], f"slots without a run: {missing}\n{f.all_logs()}"
        assert others == [], f"runs of {TASK_NAME} that are no slot: {others}"
        assert doubled == {} and no_body == [] and stray_bodies == [], (
            f"ledger rows per run not 1: {doubled}, no row: {no_body}, rows of no run: "
            f"{stray_bodies}")
        assert by_two == {}, f"runs sent by more than one scheduler: {by_two}"
        assert len(expected) >= slots
        assert schedule.fired == len(runs) == len(expected)
        assert schedule.skipped == 0
        assert schedule.next_fire_at == last + EVERY
        # The fleet kept up to the end: the last slot is no older than a pass or two
        # before the schedulers were stopped.
        assert last >= stop_requested - 3 * EVERY, (last, stop_requested)
        assert set(per_scheduler) <= {*roles, restarted}
        # The run the kill lost: sent by no scheduler, by the sweep, and run once.
        assert senders[lost][0] == "sweep" and victim not in senders[lost], senders[lost]
        assert swept_first == [lost] and bodies[lost] == 1


def test_three_schedulers_fire_each_slot_once_through_a_kill(
        pg_url: str, redis_url: str, tmp_path: Path) -> None:
    """Three durable beats fire 24 one-second slots, one SIGKILLed and restarted: each once."""
    _run_fleet(pg_url, redis_url, tmp_path, slots=24, kill_at=10, restart_after=4)


@pytest.mark.chaos
@pytest.mark.long
def test_three_schedulers_for_ten_minutes_fire_600_slots_once(
        pg_url: str, redis_url: str, tmp_path: Path) -> None:
    """Three durable beats, ten minutes of one-second slots, one killed and restarted: 600
    slots, each fired and run exactly once."""
    _run_fleet(pg_url, redis_url, tmp_path, slots=600, kill_at=300, restart_after=5)
