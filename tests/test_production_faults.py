"""Production faults on real worker processes: a database that refuses connections, a
database whose disk is full, a worker cut off from the database past its lease.

Each scenario runs two prefork workers on Redis against a private PostgreSQL cluster of
the test's own (never the shared server), sends durable runs of several steps whose
bodies log to a file outside the database, brings the fault in while they run, takes it
away, and prints a ledger: runs sent and finished, step bodies run again (and whether
each was flagged in doubt), steps recorded, Celery retries spent, and what was lost.
The refused connections run with the test suite; the full disk and the partition (both
need root) run with ``make chaos``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.conftest import REQUIRE_SERVICES, Broker, OutageServer
from tests.test_chaos import (
    REPO_ROOT,
    Cluster,
    check_executions,
    cluster,
    read_events,
    wait_for_runs,
)
from tests.test_outage_in_doubt import LONG_LEASE, RUNS, STEPS, send_runs, two_workers

pytestmark = [pytest.mark.postgres, pytest.mark.chaos]


def ledger(c: Cluster, task_ids: list[str], scenario: str, *, timeout: float = 150,
           expect_in_doubt: bool = True) -> None:
    """Print the scenario's ledger and check it: every run succeeded, every step recorded
    once, every body that ran again flagged in doubt, no Celery retry spent."""
    statuses = wait_for_runs(c, len(task_ids), timeout=timeout)
    executions, deliveries = read_events(c)
    ran_again = {key: runs for key, runs in executions.items() if len(runs) > 1}
    unflagged = sorted(f"{task} {name}" for (task, name), runs in ran_again.items()
                       if not all(run.in_doubt for run in sorted(runs, key=lambda r: r.start)[1:]))
    recorded = int(str(c.sql(f'SELECT count(*) FROM "{c.prefix}steps" '
                             "WHERE status = 'completed'")[0][0]))
    retries = int(str(c.sql(f'SELECT count(*) FROM "{c.prefix}runs" WHERE retries <> 0')[0][0]))
    spent = sorted({(task, r) for task, r in deliveries if r != 0})
    lost = RUNS * STEPS - recorded
    print(f"\nledger {scenario}: runs sent={len(task_ids)} "
          f"finished={statuses.get('succeeded', 0)} deliveries={len(deliveries)} "
          f"step bodies run={sum(len(r) for r in executions.values())} "
          f"run again={len(ran_again)} (unflagged {len(unflagged)}) "
          f"steps recorded={recorded} lost={lost} retries spent={len(spent)}")
    assert statuses.get("succeeded") == len(task_ids), f"{statuses}\n{c.log_tail()}"
    assert recorded == len(task_ids) * STEPS and lost == 0
    assert unflagged == [], unflagged[:20]
    assert spent == [] and retries == 0
    if expect_in_doubt:
        assert ran_again, "the fault hit no running body: the test missed its window"


# -- a server that refuses connections --------------------------------------------------------

@contextlib.contextmanager
def every_connection_taken(server: OutageServer) -> Iterator[int]:
    """Hold every connection the server allows and end every other session (the workers'),
    over and over until the block ends: a worker that reconnects into a slot an ended
    session freed is ended again, and its slot taken. Yields how many are held at first."""
    dsn = server.url.replace("postgresql+psycopg://", "postgresql://")
    hogs: list[psycopg.Connection[Any]] = []
    done = threading.Event()

    def fill() -> None:
        while True:
            try:
                hogs.append(psycopg.connect(dsn, autocommit=True))
            except psycopg.OperationalError as exc:
                assert "too many clients" in str(exc) or "reserved" in str(exc), exc
                return

    def end_the_others() -> None:
        mine = [conn.info.backend_pid for conn in hogs]
        hogs[0].execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE backend_type = 'client backend' AND NOT (pid = ANY(%s))",
                        (mine,))

    def keep_them() -> None:
        while not done.wait(0.02):
            end_the_others()
            fill()

    keeper = threading.Thread(target=keep_them, daemon=True)
    try:
        fill()
        assert hogs, "no connection could be taken at all"
        end_the_others()
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # the slots of the ended sessions, as they free
            fill()
            time.sleep(0.02)
        keeper.start()
        yield len(hogs)
    finally:
        done.set()
        if keeper.is_alive():
            keeper.join(5)
        for conn in hogs:
            with contextlib.suppress(Exception):
                conn.close()


def test_a_server_out_of_connections_spends_no_retry_and_loses_nothing(
        outage_pg: OutageServer, redis_url: str, tmp_path: Path) -> None:
    """max_connections reached and the workers' sessions ended, for 4 s, under running
    steps: the workers back off and come back, no retry is spent, nothing is lost, and each
    body that runs again is flagged in doubt."""
    broker = Broker("redis", redis_url, redis_url)
    with cluster(outage_pg.url, broker, tmp_path, lease_seconds=LONG_LEASE) as c, \
            two_workers(c):
        task_ids = send_runs(c, broker)
        time.sleep(2.0)
        with every_connection_taken(outage_pg) as held:
            time.sleep(4.0)
        refused = sum(log.read_text(errors="replace").count("too many clients")
                      for log in c.logs.glob("worker*.log"))
        print(f"\n{held} connections held; the workers were refused {refused} times")
        ledger(c, task_ids, "connections refused")
        assert refused >= 1, c.log_tail()


# -- a full disk -----------------------------------------------------------------------------

FULL_CLUSTER, FULL_PORT = "dfdiskfull", 5444


@pytest.fixture
def small_disk_pg() -> Iterator[tuple[OutageServer, Path]]:
    """A private cluster whose data directory is a 192 MB tmpfs (dropped after the test);
    yields the server and a file path on that tmpfs to fill it with."""
    if os.geteuid() != 0 or shutil.which("pg_createcluster") is None:
        reason = "needs root (to mount a tmpfs) and Debian's postgresql-common"
        if REQUIRE_SERVICES:
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    mount = Path(f"/run/{FULL_CLUSTER}")

    def drop() -> None:
        subprocess.run(["pg_dropcluster", "--stop", version, FULL_CLUSTER],
                       check=False, capture_output=True)
        subprocess.run(["umount", str(mount)], check=False, capture_output=True)

    drop()
    mount.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192m,mode=0755", "tmpfs", str(mount)],
                   check=True)
    shutil.chown(mount, "postgres", "postgres")
    server = OutageServer(
        version=version, url=f"postgresql+psycopg://postgres@127.0.0.1:{FULL_PORT}/postgres",
        pgbouncer_url="", cluster=FULL_CLUSTER, port=FULL_PORT)
    try:
        subprocess.run(["pg_createcluster", version, FULL_CLUSTER, "-p", str(FULL_PORT),
                        "-d", str(mount / "data"), "--", "--auth=trust"],
                       check=True, capture_output=True)
        with open(f"/etc/postgresql/{version}/{FULL_CLUSTER}/postgresql.conf", "a") as conf:
            conf.write("min_wal_size = 32MB\nmax_wal_size = 64MB\nshared_buffers = 16MB\n")
        server._ctl("start")
        assert server.ready(60), "the small-disk cluster did not start"
        yield server, mount / "filler"
    finally:
        drop()


def fill(path: Path) -> int:
    """Write zeros to ``path`` until the file system is full; the bytes written."""
    written = 0
    block = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as out:
        while True:
            try:
                written += out.write(block)
            except OSError:
                break
        with contextlib.suppress(OSError):
            out.write(b"\0" * 4096)  # the last partial block
    return written


@pytest.mark.long
def test_a_full_disk_records_nothing_half_and_every_run_finishes_once_space_returns(
        small_disk_pg: tuple[OutageServer, Path], redis_url: str, tmp_path: Path) -> None:
    """The data directory's disk filled for 5 s under running steps (the server may stop,
    as PostgreSQL does when it cannot write its WAL): writes fail, nothing is recorded half,
    and once the space is back (and the server started, if it stopped) every run finishes,
    no retry spent, each body that ran again flagged in doubt."""
    server, filler = small_disk_pg
    broker = Broker("redis", redis_url, redis_url)
    with cluster(server.url, broker, tmp_path, lease_seconds=LONG_LEASE) as c, \
            two_workers(c):
        task_ids = send_runs(c, broker)
        time.sleep(2.0)
        written = fill(filler)
        try:
            time.sleep(5.0)
        finally:
            filler.unlink()
        stopped = not server.ready(1)
        if stopped:
            server._ctl("start", check=False)
            assert server.ready(60), "the server did not start once the disk had room"
        full = sum(log.read_text(errors="replace").count("No space left on device")
                   for log in c.logs.glob("worker*.log"))
        print(f"\n{written >> 20} MB filled the disk; the server "
              f"{'stopped' if stopped else 'kept running'}; the workers saw 'No space left' "
              f"{full} times")
        ledger(c, task_ids, "disk full", expect_in_doubt=False)
        assert full >= 1 or stopped, c.log_tail()


# -- a worker cut off from the database ------------------------------------------------------

NETNS, HOST_IF, NS_IF = "dfpart", "dfpart0", "dfpart1"
HOST_IP, NS_IP = "10.231.0.1", "10.231.0.2"
PART_CLUSTER, PART_PORT, PART_REDIS_PORT = "dfpartition", 5445, 6391


def _sh(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, check=check, capture_output=True, text=True)


@dataclass
class Partitioned:
    """A network namespace (a second host) joined to this one by a veth pair, with a
    private PostgreSQL cluster and a private Redis listening on both sides."""

    version: str
    redis_pidfile: Path

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{PART_PORT}/postgres"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{PART_REDIS_PORT}/0"

    def cut(self) -> None:
        """Drop every packet the namespace sends, silently: the host is cut off. (A token
        bucket whose burst is smaller than any packet drops them all; it needs no qdisc
        module beyond tbf, which every kernel here has.)"""
        _sh("ip", "netns", "exec", NETNS, "tc", "qdisc", "add", "dev", NS_IF, "root",
            "tbf", "rate", "1kbit", "burst", "1", "latency", "1ms")

    def heal(self) -> None:
        _sh("ip", "netns", "exec", NETNS, "tc", "qdisc", "del", "dev", NS_IF, "root",
            check=False)


def _drop_partition(version: str, redis_pidfile: Path) -> None:
    _sh("pg_dropcluster", "--stop", version, PART_CLUSTER, check=False)
    with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
        os.kill(int(redis_pidfile.read_text().strip()), 15)
    _sh("ip", "link", "del", HOST_IF, check=False)
    _sh("ip", "netns", "del", NETNS, check=False)


@pytest.fixture
def partitioned(tmp_path: Path) -> Iterator[Partitioned]:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        reason = "needs root, iproute2's ip and tc (network namespaces)"
        if REQUIRE_SERVICES:
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    pidfile = tmp_path / "redis.pid"
    _drop_partition(version, pidfile)
    try:
        _sh("ip", "netns", "add", NETNS)
        _sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        _sh("ip", "link", "set", NS_IF, "netns", NETNS)
        _sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOST_IF)
        _sh("ip", "link", "set", HOST_IF, "up")
        _sh("ip", "netns", "exec", NETNS, "ip", "addr", "add", f"{NS_IP}/24", "dev", NS_IF)
        _sh("ip", "netns", "exec", NETNS, "ip", "link", "set", NS_IF, "up")
        _sh("ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up")
        _sh("pg_createcluster", version, PART_CLUSTER, "-p", str(PART_PORT), "--",
            "--auth=trust")
        with open(f"/etc/postgresql/{version}/{PART_CLUSTER}/postgresql.conf", "a") as conf:
            conf.write(f"listen_addresses = '127.0.0.1,{HOST_IP}'\n")
        with open(f"/etc/postgresql/{version}/{PART_CLUSTER}/pg_hba.conf", "a") as hba:
            hba.write(f"host all all {NS_IP}/32 trust\n")
        _sh("pg_ctlcluster", "--skip-systemctl-redirect", version, PART_CLUSTER, "start")
        _sh("redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", HOST_IP,
            "--port", str(PART_REDIS_PORT), "--save", "", "--appendonly", "no",
            "--protected-mode", "no",
            "--pidfile", str(pidfile), "--logfile", str(tmp_path / "redis.log"))
        assert OutageServer(version=version, url="", pgbouncer_url="", cluster=PART_CLUSTER,
                            port=PART_PORT).ready(30), "the partition's cluster did not start"
    except (subprocess.CalledProcessError, AssertionError, OSError) as exc:
        _drop_partition(version, pidfile)
        detail = getattr(exc, "stderr", "") or str(exc)
        pytest.fail(f"the partition could not be built: {detail.strip()}", pytrace=False)
    part = Partitioned(version=version, redis_pidfile=pidfile)
    try:
        yield part
    finally:
        part.heal()
        _drop_partition(version, pidfile)


@pytest.mark.long
def test_a_worker_cut_off_past_its_lease_is_fenced_when_it_comes_back(
        partitioned: Partitioned, tmp_path: Path) -> None:
    """A worker on another host (a network namespace) cut off while running two runs, for
    five leases: a worker here takes the runs over and finishes them; when the first comes
    back its late records are refused, it logs LeaseLost once per run, and no body ran while
    another execution of it was running or again after it was recorded."""
    broker = Broker("redis", partitioned.redis_url, partitioned.redis_url)
    lease = 3.0
    with cluster(partitioned.url, broker, tmp_path, lease_seconds=lease) as c:
        remote_env = {**c.env,
                      "PROJ_DATABASE_URL": f"postgresql+psycopg://postgres@{HOST_IP}:"
                                           f"{PART_PORT}/postgres",
                      "PROJ_BROKER_URL": f"redis://{HOST_IP}:{PART_REDIS_PORT}/0",
                      "PROJ_RESULT_BACKEND": f"redis://{HOST_IP}:{PART_REDIS_PORT}/0"}
        log = open(c.logs / "worker-remote.log", "ab")  # noqa: SIM115
        remote = subprocess.Popen(
            ["ip", "netns", "exec", NETNS, sys.executable, "-m", "celery", "-A", "tests.proj",
             "worker", "--pool", "prefork", "--concurrency", "2", "--prefetch-multiplier", "1",
             "-O", "fair", "--loglevel", "INFO", "-Q", c.queue, "-n", "remote@%h",
             "--without-heartbeat", "--without-gossip", "--without-mingle"],
            cwd=REPO_ROOT, env=remote_env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        c.workers.append(remote)
        c.wait_ready(1)
        from tests.test_chaos import client_app

        app = client_app(c, broker)
        task_ids = [str(uuid.uuid4()) for _ in range(2)]
        for n, task_id in enumerate(task_ids):
            app.send_task("proj.outage_steps", args=(n,), kwargs={"steps": 5, "seconds": 1.0},
                          task_id=task_id, queue=c.queue)
        deadline = time.monotonic() + 30
        while len({line.split()[3] for line in _events(c) if line.split()[2] == "start"}) < 2:
            assert time.monotonic() < deadline, c.log_tail()
            time.sleep(0.1)
        time.sleep(1.5)
        remote_pids = set(_sh("ip", "netns", "pids", NETNS).stdout.split())
        cut_at = time.time()
        partitioned.cut()
        try:
            c.start_with_sweeper()  # two workers here, and the sweep every second
            statuses = wait_for_runs(c, len(task_ids), timeout=5 * lease + 30)
            assert statuses.get("succeeded") == len(task_ids), f"{statuses}\n{c.log_tail()}"
            time.sleep(max(0.0, cut_at + 5 * lease - time.time()))
        finally:
            partitioned.heal()
        healed_at = time.time()
        deadline = time.monotonic() + 90
        lost: list[str] = []
        while time.monotonic() < deadline:
            lost = [line for log in c.logs.glob("worker*.log")
                    for line in log.read_text(errors="replace").splitlines()
                    if "lost its lease" in line]
            if len(lost) >= len(task_ids):
                break
            time.sleep(0.5)
        time.sleep(2.0)  # anything the stale worker would still do, it has done
        executions, _ = read_events(c)
        problems, duplicates, in_doubt = check_executions(c, executions)
        late_records = [line for line in _events(c) if line.split()[2] == "recorded"
                        and line.split()[1] in remote_pids and float(line.split()[0]) > cut_at]
        late_starts = [line for line in _events(c) if line.split()[2] == "start"
                       and line.split()[1] in remote_pids and float(line.split()[0]) > cut_at]
        print(f"\nledger partition: runs sent=2 finished={statuses.get('succeeded', 0)} "
              f"cut {healed_at - cut_at:.1f}s (lease {lease:.0f}s); bodies run again "
              f"in doubt={in_doubt}; stale holder: records after the cut="
              f"{len(late_records)}, bodies started after the cut={len(late_starts)}, "
              f"LeaseLost logged={len(lost)}; problems={len(problems)}")
        assert problems == [] and duplicates == 0, "\n".join(problems)
        assert late_records == [] and late_starts == []
        assert in_doubt >= 1
        per_run = {task_id: sum(task_id in line for line in lost) for task_id in task_ids}
        assert per_run == {task_id: 1 for task_id in task_ids}, (per_run, c.log_tail())


def _events(c: Cluster) -> list[str]:
    return c.event_log.read_text().splitlines() if c.event_log.exists() else []


# -- a failover (pg_auto_failover) -----------------------------------------------------------

MONITOR_PORT, NODE_PORTS = 6100, (6101, 6102)
PG_AUTOCTL = "pg_autoctl"


@dataclass
class Formation:
    """A pg_auto_failover monitor, a primary and a synchronous standby, each run by its own
    ``pg_autoctl run`` as the postgres user, all under one temporary folder."""

    root: Path
    bindir: str
    env: dict[str, str]
    runners: dict[str, subprocess.Popen[bytes]]

    @property
    def url(self) -> str:
        hosts = "&".join(f"host=127.0.0.1:{port}" for port in NODE_PORTS)
        return f"postgresql+psycopg://postgres@/postgres?{hosts}&target_session_attrs=read-write"

    def as_postgres(self, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["runuser", "-u", "postgres", "--", *command], env=self.env,
                              check=check, capture_output=True, text=True)

    def run(self, name: str) -> None:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115
        self.runners[name] = subprocess.Popen(
            ["runuser", "-u", "postgres", "--", PG_AUTOCTL, "run", "--pgdata",
             str(self.root / name)], env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def state(self) -> dict[str, str]:
        """Each node's reported state, by name, as the monitor knows it."""
        rows = self.as_postgres("psql", "-h", "127.0.0.1", "-p", str(MONITOR_PORT), "-d",
                                "pg_auto_failover", "-Atc",
                                "SELECT nodename, reportedstate FROM pgautofailover.node",
                                check=False).stdout.split()
        return dict(row.split("|", 1) for row in rows if "|" in row)

    def wait_for(self, wanted: dict[str, str], timeout: float) -> None:
        self.wait_until(lambda state: state == wanted, timeout)

    def wait_until(self, ready: Callable[[dict[str, str]], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready(self.state()):
                return
            time.sleep(0.5)
        raise AssertionError(f"the formation did not get there: it is {self.state()}")

    def crash(self, name: str) -> None:
        """The node's machine dies: its pg_autoctl is killed and its server stops at once."""
        runner = self.runners.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, 9)
        runner.wait(10)
        self.as_postgres(f"{self.bindir}/pg_ctl", "-D", str(self.root / name), "stop",
                         "-m", "immediate", check=False)

    def stop(self) -> None:
        for runner in self.runners.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(runner.pid, 9)
            runner.wait(10)
        for name in ("node1", "node2", "monitor"):
            if (self.root / name).exists():
                self.as_postgres(f"{self.bindir}/pg_ctl", "-D", str(self.root / name), "stop",
                                 "-m", "immediate", check=False)


@pytest.fixture
def formation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Formation]:
    """A monitor on 6100 and nodes on 6101 (primary) and 6102 (standby), health-checked
    every second so that a dead primary is failed over within seconds."""
    if os.geteuid() != 0 or shutil.which(PG_AUTOCTL) is None:
        reason = ("needs root and pg_auto_failover (apt-get install postgresql-15-auto-failover "
                  "pg-auto-failover-cli)")
        if REQUIRE_SERVICES:
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    bindir = f"/usr/lib/postgresql/{version}/bin"
    root = Path(tempfile.mkdtemp(prefix="duraflow-failover-"))
    shutil.chown(root, "postgres", "postgres")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}",
           "XDG_CONFIG_HOME": str(root / "config"), "XDG_DATA_HOME": str(root / "data"),
           "XDG_RUNTIME_DIR": str(root / "run"), "HOME": str(root)}
    f = Formation(root=root, bindir=bindir, env=env, runners={})
    monitor = f"postgres://autoctl_node@127.0.0.1:{MONITOR_PORT}/pg_auto_failover?sslmode=disable"
    try:
        f.as_postgres(PG_AUTOCTL, "create", "monitor", "--pgdata", str(root / "monitor"),
                      "--pgport", str(MONITOR_PORT), "--auth", "trust", "--no-ssl",
                      "--hostname", "127.0.0.1")
        with open(root / "monitor" / "postgresql.auto.conf", "a") as conf:
            conf.write("pgautofailover.health_check_period = 1000\n"
                       "pgautofailover.health_check_timeout = 1000\n"
                       "pgautofailover.health_check_max_retries = 1\n"
                       "pgautofailover.health_check_retry_delay = 500\n"
                       "pgautofailover.node_considered_unhealthy_timeout = 3000\n")
        f.run("monitor")
        for index, port in enumerate(NODE_PORTS, start=1):
            name = f"node{index}"
            deadline = time.monotonic() + 60
            while True:
                made = f.as_postgres(
                    PG_AUTOCTL, "create", "postgres", "--pgdata", str(root / name),
                    "--pgport", str(port), "--auth", "trust", "--no-ssl", "--hostname",
                    "127.0.0.1", "--name", name, "--monitor", monitor, check=False)
                if made.returncode == 0:
                    break
                assert time.monotonic() < deadline, made.stderr
                time.sleep(1)  # the monitor is still starting
            f.run(name)
            if index == 1:
                f.wait_until(lambda state: state.get("node1") in ("single", "primary"), 60)
        f.wait_for({"node1": "primary", "node2": "secondary"}, 120)
    except (subprocess.CalledProcessError, AssertionError, OSError) as exc:
        f.stop()
        shutil.rmtree(root, ignore_errors=True)
        detail = getattr(exc, "stderr", "") or str(exc)
        pytest.fail(f"the pg_auto_failover formation could not be built: {detail}",
                    pytrace=False)
    try:
        yield f
    finally:
        f.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.long
def test_a_failover_under_load_loses_no_recorded_step_and_needs_no_restart(
        formation: Formation, redis_url: str, tmp_path: Path) -> None:
    """pg_auto_failover's primary crashes under 40 runs of 10 steps; the monitor promotes
    the synchronous standby; the workers, on one multi-host URL, carry on without a
    restart: every run ends, no recorded step is lost, every body that ran again was
    flagged in doubt, the at-most-once step (s5) never ran twice (a run caught in it ends
    with StepInDoubt), no retry spent."""
    broker = Broker("redis", redis_url, redis_url)
    runs, steps = 40, 10
    with cluster(formation.url, broker, tmp_path, lease_seconds=LONG_LEASE) as c, \
            two_workers(c):
        from tests.test_chaos import client_app

        app = client_app(c, broker)
        task_ids = [str(uuid.uuid4()) for _ in range(runs)]
        for n, task_id in enumerate(task_ids):
            app.send_task("proj.outage_steps", args=(n,),
                          kwargs={"steps": steps, "seconds": 0.2, "at_most_once": 5},
                          task_id=task_id, queue=c.queue)
        time.sleep(4.0)
        crashed_at = time.time()
        formation.crash("node1")
        formation.wait_until(lambda state: state.get("node2") in ("wait_primary", "primary"),
                             90)
        promoted_after = time.time() - crashed_at
        statuses = wait_for_runs(c, runs, timeout=240, ended=("succeeded", "failed"))
        executions, deliveries = read_events(c)
        problems, duplicates, in_doubt = check_executions(c, executions)
        recorded = int(str(c.sql(f'SELECT count(*) FROM "{c.prefix}steps" s JOIN '
                                 f'"{c.prefix}runs" r USING (task_id) WHERE s.status = '
                                 "'completed' AND r.status = 'succeeded'")[0][0]))
        careful = max((len(runs_) for (_, name), runs_ in executions.items() if name == "s5"),
                      default=0)
        stopped = [str(row[0]) for row in c.sql(
            f'SELECT error FROM "{c.prefix}runs" WHERE status = \'failed\'')]
        retries = int(str(c.sql(f'SELECT count(*) FROM "{c.prefix}runs" '
                                "WHERE retries <> 0")[0][0]))
        seen = {(line.split()[3], line.split()[4]) for line in _events(c)
                if line.split()[2] == "recorded" and float(line.split()[0]) < crashed_at}
        print(f"\nledger failover: runs sent={runs} succeeded={statuses.get('succeeded', 0)} "
              f"stopped in doubt at the at-most-once step={len(stopped)} "
              f"(its body run at most {careful} time(s) per run) "
              f"promoted after {promoted_after:.1f}s; deliveries={len(deliveries)} "
              f"steps recorded={recorded} (seen recorded before the crash: {len(seen)}) "
              f"bodies run again in doubt={in_doubt} unflagged={duplicates} "
              f"retries spent={retries}; problems={len(problems)}")
        succeeded = statuses.get("succeeded", 0)
        assert succeeded + len(stopped) == runs, f"{statuses}\n{c.log_tail()}"
        assert all("StepInDoubt" in error and "s5" in error for error in stopped), stopped
        assert careful <= 1
        assert recorded == succeeded * steps
        assert problems == [] and duplicates == 0, "\n".join(problems[:20])
        assert retries == 0
        assert seen, "no step was recorded before the crash: the load had not started"

