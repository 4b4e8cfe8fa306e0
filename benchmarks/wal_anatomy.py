"""Where the WAL of a durable task goes: bytes per task, and which records write them.

Run it with ``python -m benchmarks.wal_anatomy [--tasks 200] [--steps 10]`` as a user that
can read the server's ``pg_wal`` directory (``pg_waldump`` reads the segments directly).

Two batches are measured, each after a CHECKPOINT so that both pay for their full-page
images the same way:

* ``durable``: ``--tasks`` durable runs of ``--steps`` steps (``workload.durable_steps``),
  applied eagerly in this process on tables with a prefix of this run's own;
* ``by hand``: the same twelve commits written directly with psycopg in autocommit, on
  two tables that have nothing but their primary keys: insert the run row, insert one
  row per step, update the run row at the end. The values are what the library itself
  writes for the run's essentials (task id, task name, status, arguments, result, times;
  step key, status, output, times) and nothing else.

The server is shared, so the LSN delta of a batch also holds whatever other sessions
wrote meanwhile. The script therefore decodes the batch's WAL with ``pg_waldump`` and keeps
only the records that touch this run's relations (by relfilenode), plus the commit records
of the transactions that wrote them: those bytes are the batch's own. The raw LSN delta is
printed next to them as a check. Records are then broken down by resource manager and
record type (with the part that is full-page images), and by relation, so that an index
that takes an entry on every update stands out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from sqlalchemy import create_engine

from celery_duraflow._schema import LATEST_VERSION, MIGRATIONS, build_tables

from .common import DuraflowBench, default_database_url, drop_prefixed_tables, libpq_url, log

PG_WALDUMP = os.environ.get("PG_WALDUMP", "/usr/lib/postgresql/15/bin/pg_waldump")

# rmgr: Heap  len (rec/tot):  79/  79, tx:  752, lsn: 0/0171A1E8, prev 0/..., desc: INSERT ...
_RECORD = re.compile(
    r"^rmgr: (?P<rmgr>\S+)\s+len \(rec/tot\):\s*(?P<rec>\d+)/\s*(?P<tot>\d+), "
    r"tx:\s*(?P<tx>\d+), lsn: \S+, prev \S+, desc: (?P<desc>.*)$")
_BLOCK = re.compile(r"blkref #\d+: rel \d+/\d+/(?P<rel>\d+)(?: fork \w+)? blk \d+(?P<fpw> FPW)?")


@dataclass
class Tally:
    """Records, their bytes without block images, and the bytes of their block images."""

    count: int = 0
    record: int = 0
    fpi: int = 0

    def add(self, record: int, fpi: int) -> None:
        self.count += 1
        self.record += record
        self.fpi += fpi

    @property
    def total(self) -> int:
        return self.record + self.fpi


@dataclass
class Anatomy:
    """One batch's own WAL, decoded."""

    tasks: int
    lsn_delta: int
    by_type: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    by_relation: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    full_page_images: int = 0

    @property
    def own_bytes(self) -> int:
        return sum(t.total for t in self.by_type.values())

    def per_task(self, value: float) -> float:
        return value / self.tasks


def record_type(rmgr: str, desc: str) -> str:
    word = desc.split(" ", 1)[0].rstrip(":;,")
    return f"{rmgr}/{word}"


def decode(wal_dir: str, start: str, end: str, relations: dict[int, str],
           tasks: int, lsn_delta: int) -> Anatomy:
    """Keep the records of ``relations`` (relfilenode -> name) and their transactions' ends."""
    out = subprocess.run([PG_WALDUMP, "-p", wal_dir, "-s", start, "-e", end],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0 and not out.stdout:
        raise SystemExit(f"pg_waldump failed: {out.stderr.strip()}")
    anatomy = Anatomy(tasks=tasks, lsn_delta=lsn_delta)
    ours: set[int] = set()
    ends: list[tuple[int, str, int, int]] = []
    for line in out.stdout.splitlines():
        match = _RECORD.match(line)
        if match is None:
            continue
        rmgr, desc = match["rmgr"], match["desc"]
        rec, tot, tx = int(match["rec"]), int(match["tot"]), int(match["tx"])
        if rmgr == "Transaction":
            ends.append((tx, record_type(rmgr, desc), rec, tot - rec))
            continue
        blocks = list(_BLOCK.finditer(desc))
        names = [relations.get(int(b["rel"])) for b in blocks]
        if not blocks or names[0] is None:
            continue
        if tx:
            ours.add(tx)
        anatomy.by_type[record_type(rmgr, desc)].add(rec, tot - rec)
        anatomy.by_relation[names[0]].add(rec, tot - rec)
        anatomy.full_page_images += sum(1 for b in blocks if b["fpw"])
    for tx, kind, rec, fpi in ends:
        if tx in ours:
            anatomy.by_type[kind].add(rec, fpi)
            anatomy.by_relation["(commit records)"].add(rec, fpi)
    return anatomy


class HandWritten:
    """The twelve commits of a run written directly, on tables with only primary keys."""

    def __init__(self, conninfo: str, prefix: str) -> None:
        self.runs, self.steps = f"{prefix}hand_runs", f"{prefix}hand_steps"
        self.conn = psycopg.connect(conninfo, autocommit=True)
        self.conn.execute(
            f'CREATE TABLE "{self.runs}" (task_id varchar(255) PRIMARY KEY, '
            "task_name varchar(255) NOT NULL, status varchar(16) NOT NULL, args text, "
            "result text, created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL, "
            "finished_at timestamptz)")
        self.conn.execute(
            f'CREATE TABLE "{self.steps}" (task_id varchar(255) NOT NULL, '
            "step_key varchar(1024) NOT NULL, status varchar(16) NOT NULL, output text, "
            "started_at timestamptz NOT NULL, completed_at timestamptz, "
            "PRIMARY KEY (task_id, step_key))")

    def run(self, steps: int, args: str, outputs: list[str], result: str) -> None:
        task_id = f"bench-{uuid.uuid4()}"
        now = datetime.now(UTC)
        execute = self.conn.execute
        execute(f'INSERT INTO "{self.runs}" (task_id, task_name, status, args, created_at, '
                "updated_at) VALUES (%s, %s, 'running', %s, %s, %s)",
                (task_id, "bench.durable_steps", args, now, now))
        for i in range(steps):
            key = "step" if i == 0 else f"step#{i + 1}"
            execute(f'INSERT INTO "{self.steps}" (task_id, step_key, status, output, '
                    "started_at, completed_at) VALUES (%s, %s, 'completed', %s, %s, %s)",
                    (task_id, key, outputs[i], now, datetime.now(UTC)))
        execute(f'UPDATE "{self.runs}" SET status = \'succeeded\', result = %s, '
                "updated_at = %s, finished_at = %s WHERE task_id = %s",
                (result, datetime.now(UTC), datetime.now(UTC), task_id))

    def close(self) -> None:
        self.conn.close()


def at_version(database_url: str, prefix: str, version: int) -> None:
    """Create the prefix's tables as migrations 1 to ``version`` leave them, and keep them
    there: the schema table then says the latest version, so that the store (which only
    reads that table) neither migrates them further nor refuses them.

    Only meaningful for versions whose columns are the latest's (from 11 on), since the
    statements are the current ones.
    """
    if version < 11 or version > LATEST_VERSION:
        raise SystemExit(f"--schema-version must be between 11 and {LATEST_VERSION}")
    tables = build_tables(prefix)
    engine = create_engine(database_url)
    try:
        with engine.begin() as conn:
            tables.schema_version.create(conn)
            for _, _, apply in MIGRATIONS[:version]:
                apply(conn, tables)
            for number, description, _ in MIGRATIONS:
                conn.execute(tables.schema_version.insert().values(
                    version=number, description=description, applied_at=datetime.now(UTC)))
    finally:
        engine.dispose()


def relfilenodes(conn: psycopg.Connection[Any], prefix: str) -> dict[int, str]:
    """Every relation of the prefix's tables (heap, indexes, TOAST and its index)."""
    rows = conn.execute(
        "SELECT c.relfilenode, c.relname FROM pg_class c "
        "WHERE c.relname LIKE %s AND c.relfilenode <> 0 "
        "UNION ALL "
        "SELECT t.relfilenode, c.relname || ' (toast)' FROM pg_class c "
        "JOIN pg_class t ON t.oid = c.reltoastrelid WHERE c.relname LIKE %s "
        "UNION ALL "
        "SELECT i.relfilenode, c.relname || ' (toast index)' FROM pg_class c "
        "JOIN pg_index x ON x.indrelid = c.reltoastrelid "
        "JOIN pg_class i ON i.oid = x.indexrelid WHERE c.relname LIKE %s",
        (prefix.replace("_", r"\_") + "%",) * 3).fetchall()
    return {int(node): str(name).removeprefix(prefix) for node, name in rows}


def measure(admin: psycopg.Connection[Any], wal_dir: str, prefix: str, tasks: int,
            batch: Any) -> Anatomy:
    admin.execute("CHECKPOINT")
    start = str(admin.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0])  # type: ignore[index]
    for _ in range(tasks):
        batch()
    row = admin.execute("SELECT pg_current_wal_insert_lsn(), "
                        "pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", (start,)).fetchone()
    assert row is not None
    end, delta = str(row[0]), int(row[1])
    # pg_waldump reads the segment files: wait until the batch's records are flushed.
    for _ in range(100):
        flushed = admin.execute("SELECT pg_wal_lsn_diff(pg_current_wal_flush_lsn(), %s)",
                                (end,)).fetchone()
        if flushed is not None and int(flushed[0]) >= 0:
            break
        time.sleep(0.05)
    return decode(wal_dir, start, end, relfilenodes(admin, prefix), tasks, delta)


def report(name: str, anatomy: Anatomy) -> list[str]:
    per = anatomy.per_task
    lines = [f"## {name}: {anatomy.tasks} tasks",
             f"own WAL per task: {per(anatomy.own_bytes):7.0f} B "
             f"(full-page images {per(sum(t.fpi for t in anatomy.by_type.values())):.0f} B, "
             f"{anatomy.full_page_images} images in the batch); "
             f"raw LSN delta per task (other sessions included): {per(anatomy.lsn_delta):.0f} B",
             "",
             f"{'record type':28} {'per task':>8} {'B/task':>8} {'FPI B/task':>10} {'B/rec':>6}"]
    for kind, tally in sorted(anatomy.by_type.items(), key=lambda kv: -kv[1].total):
        lines.append(f"{kind:28} {per(tally.count):8.2f} {per(tally.total):8.0f} "
                     f"{per(tally.fpi):10.0f} {tally.record / tally.count:6.0f}")
    lines += ["", f"{'relation':34} {'recs/task':>9} {'B/task':>8} {'FPI B/task':>10}"]
    for rel, tally in sorted(anatomy.by_relation.items(), key=lambda kv: -kv[1].total):
        lines.append(f"{rel:34} {per(tally.count):9.2f} {per(tally.total):8.0f} "
                     f"{per(tally.fpi):10.0f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default=default_database_url())
    parser.add_argument("--tasks", type=int, default=200, help="tasks per measured batch")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=50,
                        help="tasks of each kind written before measuring (page set-up)")
    parser.add_argument("--wal-dir", default=None, help="the server's pg_wal directory")
    parser.add_argument("--prefix", default=None, help="table prefix (default: a new one)")
    parser.add_argument("--keep", action="store_true", help="leave the tables behind")
    parser.add_argument("--schema-version", type=int, default=None,
                        help="measure on the schema as this migration left it (default: the "
                             "latest), to compare two versions with the same statements")
    parser.add_argument("--json", action="store_true", help="also print the numbers as JSON")
    options = parser.parse_args(argv)

    conninfo = libpq_url(options.database_url)
    prefix = options.prefix or f"walanat_{uuid.uuid4().hex[:8]}_"
    admin = psycopg.connect(conninfo, autocommit=True)
    wal_dir = options.wal_dir or os.path.join(
        str(admin.execute("SHOW data_directory").fetchone()[0]), "pg_wal")  # type: ignore[index]
    if options.schema_version is not None:
        at_version(options.database_url, prefix, options.schema_version)
    bench = DuraflowBench.create(options.database_url, prefix)
    hand = HandWritten(conninfo, prefix)
    try:
        # The library's own values for the hand-written rows, read from one durable run.
        probe = bench.run(options.steps)
        run = admin.execute(f'SELECT args, result FROM "{prefix}runs" WHERE task_id = %s',
                            (probe,)).fetchone()
        outputs = [str(r[0]) for r in admin.execute(
            f'SELECT output FROM "{prefix}steps" WHERE task_id = %s ORDER BY started_at, '
            "position", (probe,)).fetchall()]
        assert run is not None and len(outputs) == options.steps
        args, result = str(run[0]), str(run[1])

        def durable() -> None:
            bench.run(options.steps)

        def by_hand() -> None:
            hand.run(options.steps, args, outputs, result)

        log(f"warming up ({options.warmup} tasks of each kind)")
        for _ in range(options.warmup):
            durable()
            by_hand()
        log(f"measuring {options.tasks} durable tasks")
        durable_wal = measure(admin, wal_dir, prefix, options.tasks, durable)
        log(f"measuring {options.tasks} hand-written tasks")
        hand_wal = measure(admin, wal_dir, prefix, options.tasks, by_hand)
        hot = admin.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = %s",
            (f"{prefix}runs",)).fetchone()
        lines = report(f"durable, {options.steps} steps", durable_wal)
        lines += ["", *report(f"by hand, {options.steps} steps", hand_wal)]
        d_per = durable_wal.per_task(durable_wal.own_bytes)
        h_per = hand_wal.per_task(hand_wal.own_bytes)
        lines += ["", f"durable {d_per:.0f} B/task, by hand {h_per:.0f} B/task: "
                      f"ratio {d_per / h_per:.2f}x",
                  f"runs updates (statistics, may lag): {hot[0] if hot else '?'}, "
                  f"HOT {hot[1] if hot else '?'}"]
        print("\n".join(lines))
        if options.json:
            print(json.dumps({
                "durable_bytes_per_task": d_per, "hand_bytes_per_task": h_per,
                "ratio": d_per / h_per,
                "durable": {k: vars(v) for k, v in durable_wal.by_type.items()},
                "hand": {k: vars(v) for k, v in hand_wal.by_type.items()},
            }, indent=1))
    finally:
        hand.close()
        bench.close()
        admin.close()
        if not options.keep:
            drop_prefixed_tables(conninfo, prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
