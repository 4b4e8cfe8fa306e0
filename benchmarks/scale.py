"""Large tables: the hot path and the operator side on a million runs, against empty tables.

One set of tables is measured twice in the same run: first empty (only the runs the
measurements themselves create), then after a bulk fill of ``runs`` runs of 10 steps each
(server-side ``INSERT ... SELECT generate_series``, then ``VACUUM ANALYZE``). The fill
looks like a store some months into production:

* creation times spread evenly over the last 60 days, five task names;
* 94% succeeded, 4% failed, 1% waiting (a third for a child run that is still running,
  the rest for a signal; half with no timeout, half with a timeout in the future), 0.5%
  sleeping (waking in the future), 0.5% running (leases in the future): nothing is due
  for the sweep;
* 10 completed steps per run, and a ``patched("new-pricing")`` marker in every run of
  the last 7 days; an ``approval`` signal for one run in ten.

Each operation is timed as the library performs it (the same functions the CLI and the
web view call), median of repeated calls; the ratio big / empty is the figure that
matters. Then a real prune of the runs last updated more than 58 days ago (about 1/30 of
them), in batches: time per batch (the longest a run row stays locked), and the WAL it
wrote (``pg_current_wal_lsn()`` before and after).
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg

from celery_duraflow import _admin, get_run
from celery_duraflow.web import _data

from .common import DuraflowBench, Samples, log, ms, ratio, table

TASK_NAMES = ("proj.tasks.book_trip", "proj.tasks.send_invoice", "proj.tasks.sync_user",
              "proj.tasks.resize_image", "proj.tasks.charge_card")
MARKER = "new-pricing"
STEPS_PER_RUN = 10
# An operation is "met" when its big-table figure is at most this many times its empty one.
LIMIT = 2.0
# Operations a sweep does now and then rather than on every pass: reported, not in the verdict.
PERIODIC = ("sweep's look at waiting parents (first pass, then every minute)",
            "sweep's first pass in a process (every waiting run)")


def _load() -> str:
    """The machine's load averages, as /proc/loadavg has them."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def fill(conn: psycopg.Connection[Any], prefix: str, runs: int, *,
         signal_every: int = 10) -> float:
    """Bulk-fill ``runs`` runs and their steps into the prefix's tables; seconds taken.

    One run in ``signal_every`` gets an ``approval`` signal.
    """
    started = time.perf_counter()
    r, s = f'"{prefix}runs"', f'"{prefix}steps"'
    names = "ARRAY[" + ", ".join(f"'{n}'" for n in TASK_NAMES) + "]"
    # i = 1..N, oldest first: created 60 days ago for i = 0, now for i = N.
    created = f"now() - interval '60 days' * (1 - i::float8 / {runs})"
    status = ("CASE WHEN i % 1000 < 940 THEN 'succeeded' WHEN i % 1000 < 980 THEN 'failed' "
              "WHEN i % 1000 < 990 THEN 'waiting' WHEN i % 1000 < 995 THEN 'sleeping' "
              "ELSE 'running' END")
    ended = "i % 1000 < 980"
    log(f"scale: filling {runs:,} runs")
    conn.execute(f"""
        INSERT INTO {r} (task_id, task_name, status, attempts, result, serializer, error,
                         created_at, updated_at, finished_at, lease_owner, lease_expires_at,
                         args, args_fingerprint, retries, recoveries, interrupted, wait_kind,
                         waiting_for, wake_at)
        SELECT 'fill-' || i, ({names})[1 + i % 5], st, 1,
               CASE WHEN st = 'succeeded' THEN '{{"ok": true}}' END, 'json',
               CASE WHEN st = 'failed' THEN 'builtins.ValueError: no seats left' END,
               c, c + interval '5 seconds', CASE WHEN {ended} THEN c + interval '5 seconds' END,
               CASE WHEN st = 'running' THEN 'worker-' || (i % 7) END,
               CASE WHEN st IN ('running', 'sleeping') THEN now() + interval '1 hour'
                    WHEN st = 'waiting' AND i % 2 = 0 THEN now() + interval '2 days' END,
               '[[' || i || '], {{}}]', md5(i::text), 0, 0, false,
               CASE WHEN st = 'waiting' AND i % 3 = 0 THEN 'child'
                    WHEN st = 'waiting' THEN 'signal' WHEN st = 'sleeping' THEN 'sleep' END,
               CASE WHEN st = 'waiting' AND i % 3 = 0 THEN 'fill-' || (i - i % 1000 + 995)
                    WHEN st = 'waiting' THEN 'approval' WHEN st = 'sleeping' THEN 'nap' END,
               CASE WHEN st = 'sleeping' THEN now() + interval '1 hour'
                    WHEN st = 'waiting' AND i % 2 = 0 THEN now() + interval '2 days' END
        FROM (SELECT i, {created} AS c, {status} AS st
              FROM generate_series(1, {runs}) AS i) AS g""")
    log(f"scale: filling {runs * STEPS_PER_RUN:,} steps and the patch markers")
    # The steps' only index is its primary key: built once after the rows, by a sort.
    pkey = f'"{prefix}steps_task_step_key"'
    conn.execute(f"ALTER TABLE {s} DROP CONSTRAINT {pkey}")
    conn.execute(f"""
        INSERT INTO {s} (task_id, step_key, status, attempts, output, serializer, started_at,
                         completed_at, position)
        SELECT 'fill-' || i, 'step-' || k, 'completed', 1, '"ok"', 'json',
               {created} + k * interval '10 milliseconds',
               {created} + k * interval '10 milliseconds' + interval '5 milliseconds', k
        FROM generate_series(1, {runs}) AS i, generate_series(1, {STEPS_PER_RUN}) AS k""")
    # Runs of the last 7 days recorded the patch, as the first thing they did.
    conn.execute(f"""
        INSERT INTO {s} (task_id, step_key, status, attempts, output, serializer, started_at,
                         completed_at)
        SELECT 'fill-' || i, 'patched:{MARKER}', 'completed', 1, 'true', 'json',
               {created}, {created}
        FROM generate_series({runs - runs * 7 // 60}, {runs}) AS i""")
    conn.execute(f"ALTER TABLE {s} ADD CONSTRAINT {pkey} PRIMARY KEY (task_id, step_key)")
    # Some runs were approved by a signal on their way.
    conn.execute(f"""
        INSERT INTO "{prefix}signals" (task_id, name, payload, serializer, sent_at)
        SELECT 'fill-' || i, 'approval', 'true', 'json', {created}
        FROM generate_series(1, {runs}) AS i WHERE i % {signal_every} = 0""")
    log("scale: VACUUM ANALYZE")
    conn.execute(f"VACUUM ANALYZE {r}")
    conn.execute(f"VACUUM ANALYZE {s}")
    conn.execute(f'VACUUM ANALYZE "{prefix}signals"')
    return time.perf_counter() - started


def _median(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    samples = Samples()
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.add(time.perf_counter() - started)
    return samples.median


class Operations:
    """The measured operations on one store, in the state the tables are in now."""

    def __init__(self, df: DuraflowBench, repeats: int, runs_per_round: int) -> None:
        self.df = df
        self.store = df.store
        self.repeats = repeats
        self.runs = runs_per_round
        self.replayed = df.run(STEPS_PER_RUN)

    def hot_path(self) -> dict[str, float]:
        """Fresh step, empty run, 10-step replay and get_run, the first two taking turns."""
        df = self.df
        empty, ten = Samples(), Samples()
        for _ in range(2):
            df.run(0)
            df.run(STEPS_PER_RUN)
        for _ in range(self.runs):
            for samples, n in ((empty, 0), (ten, STEPS_PER_RUN)):
                started = time.perf_counter()
                df.run(n)
                samples.add(time.perf_counter() - started)

        def replay() -> float:
            df.reset_to_running(self.replayed)
            started = time.perf_counter()
            df.run(STEPS_PER_RUN, self.replayed)
            return time.perf_counter() - started

        replays = Samples()
        for _ in range(2):
            replay()
        for _ in range(self.repeats):
            replays.add(replay())
        return {
            "fresh step": (ten.median - empty.median) / STEPS_PER_RUN,
            "empty run": empty.median,
            "10-step replay": replays.median,
            "get_run": _median(lambda: get_run(self.replayed, app=df.app), self.repeats),
        }

    def operator_side(self) -> dict[str, float]:
        store, n = self.store, self.repeats
        task = TASK_NAMES[0]
        week = timedelta(days=7)

        def runs_command(**filters: Any) -> None:
            # What `celery duraflow runs` reads: the page with step counts, and the footer.
            _admin.summarize_runs(store, limit=50, **filters)
            _admin.count_by_status_bounded(store, **filters)

        def prune_dry_run() -> None:
            _admin.count_prunable(store, older_than=timedelta(days=29), cap=_admin.COUNT_CAP)
            _admin.count_tombstones(store, cap=_admin.COUNT_CAP)

        return {
            "listing page (web, 50 runs)": _median(lambda: _admin.list_runs(
                store, limit=51, brief=True), n),
            "listing footer counts by status": _median(
                lambda: _admin.count_by_status_bounded(store), n),
            "web runs page (page + footer)": _median(lambda: _data.load_runs_page(
                store, status=None, task_name=None, cursor=None, limit=50), n),
            f"runs --task {task}": _median(lambda: runs_command(task_name=task), n),
            "runs --older-than 7d": _median(lambda: runs_command(older_than=week), n),
            "prune --dry-run --older-than 29d": _median(prune_dry_run, n),
            # As `patch NAME` asks: its default --limit of 20 runs listed, and one more.
            f"patch {MARKER}": _median(lambda: _admin.patch_progress(
                store, f"patched:{MARKER}", limit=21, cap=_admin.COUNT_CAP), n),
            "recovery sweep pass (nothing due)": _median(
                lambda: store.recoverable_runs(100, arrivals=False, parents=False), n),
            # What a sweep adds on its first pass and then at most once a minute: every run
            # that waits for a child, for a child whose waker died before waking it.
            "sweep's look at waiting parents (first pass, then every minute)": _median(
                lambda: store.recoverable_runs(100, arrivals=False, parents=True), n),
            # What a sweep adds on its first pass in a process: every waiting run checked
            # for a signal an older version stored without waking it.
            "sweep's first pass in a process (every waiting run)": _median(
                lambda: store.recoverable_runs(100, arrivals=True), n),
        }

    def wal_per_run(self, conn: psycopg.Connection[Any], tasks: int) -> float:
        """WAL bytes per fresh 10-step run, over ``tasks`` runs after a CHECKPOINT."""
        conn.execute("CHECKPOINT")
        start = _lsn(conn)
        for _ in range(tasks):
            self.df.run(STEPS_PER_RUN)
        return _wal_since(conn, start) / tasks


def _lsn(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    if row is None:
        raise RuntimeError("pg_current_wal_lsn() returned nothing")
    return str(row[0])


def _wal_since(conn: psycopg.Connection[Any], start: str) -> float:
    row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)",
                       (start,)).fetchone()
    return float(row[0]) if row else 0.0


def real_prune(df: DuraflowBench, conn: psycopg.Connection[Any], *, days: float,
               batch_size: int) -> dict[str, Any]:
    """Prune the runs last updated more than ``days`` ago, in batches; what it cost."""
    batches: list[_admin.PruneBatch] = []
    conn.execute("CHECKPOINT")
    start = _lsn(conn)
    started = time.perf_counter()
    pruned, steps = _admin.prune(df.store, older_than=timedelta(days=days),
                                 batch_size=batch_size, tombstones_older_than=None,
                                 progress=batches.append)
    elapsed = time.perf_counter() - started
    wal = _wal_since(conn, start)
    seconds = [b.seconds for b in batches]
    return {"runs": pruned, "steps": steps, "batches": len(batches), "seconds": elapsed,
            "batch_median_s": statistics.median(seconds) if seconds else None,
            "batch_max_s": max(seconds) if seconds else None, "wal_bytes": wal}


def bench_scale(database_url: str, prefix: str, *, runs: int, repeats: int,
                runs_per_round: int, wal_tasks: int) -> tuple[list[str], dict[str, Any]]:
    """Measure on empty tables, fill ``runs`` runs, measure again; lines, data, verdict."""
    prefix = f"{prefix}scale_{uuid.uuid4().hex[:4]}_"
    df = DuraflowBench.create(database_url, prefix)
    admin = psycopg.connect(df.conninfo, autocommit=True)
    load_before = _load()
    try:
        log("scale: empty tables")
        ops = Operations(df, repeats, runs_per_round)
        empty = {**ops.hot_path(), **ops.operator_side()}
        wal_empty = ops.wal_per_run(admin, wal_tasks)
        fill_s = fill(admin, prefix, runs)
        log("scale: big tables")
        ops = Operations(df, repeats, runs_per_round)
        big = {**ops.hot_path(), **ops.operator_side()}
        wal_big = ops.wal_per_run(admin, wal_tasks)
        sizes = admin.execute(
            "SELECT pg_size_pretty(pg_total_relation_size(%s)), "
            "pg_size_pretty(pg_total_relation_size(%s))",
            (f"{prefix}runs", f"{prefix}steps")).fetchone()
        log("scale: a real prune, in batches")
        pruning = real_prune(df, admin, days=58, batch_size=1000)
    finally:
        admin.close()
        df.close()
        df.engine.dispose()
    load_after = _load()
    rows: list[list[object]] = []
    worst: tuple[float, str] | None = None
    data_rows: list[dict[str, Any]] = []
    for name, before in empty.items():
        after = big[name]
        factor = after / before if before > 0 else None
        met = factor is not None and factor <= LIMIT
        periodic = name in PERIODIC
        if (name != "fresh step" and not periodic and factor is not None
                and (worst is None or factor > worst[0])):
            worst = (factor, name)
        verdict = "met" if met else "NOT met"
        rows.append([name, ms(before), ms(after), ratio(factor),
                     f"({verdict}: not per pass)" if periodic else verdict])
        data_rows.append({"operation": name, "empty_s": before, "big_s": after,
                          "ratio": factor})
    wal_factor = wal_big / wal_empty if wal_empty else None
    rows.append(["WAL per fresh 10-step run (bytes)", f"{wal_empty:.0f}", f"{wal_big:.0f}",
                 ratio(wal_factor), "met" if wal_factor and wal_factor <= LIMIT else "NOT met"])
    # The fresh step's figure is a difference of two medians: its ratio is reported, and
    # counted with the others.
    fresh = next(r for r in data_rows if r["operation"] == "fresh step")
    if fresh["ratio"] is not None and (worst is None or fresh["ratio"] > worst[0]):
        worst = (fresh["ratio"], "fresh step")
    if wal_factor is not None and (worst is None or wal_factor > worst[0]):
        worst = (wal_factor, "WAL per fresh run")
    lines = [
        f"The same tables measured empty, then after a bulk fill of {runs:,} runs and "
        f"{runs * STEPS_PER_RUN:,} steps (plus a patch marker in each run of the last 7 "
        f"days; {fill_s / 60:.1f} minutes; runs {sizes[0] if sizes else '?'}, steps "
        f"{sizes[1] if sizes else '?'}); medians of {repeats} calls each ({runs_per_round} "
        "runs of each kind for the fresh step and the empty run, taking turns). Fresh step "
        "= (10-step run - empty run) / 10. A sweep pass reads the due runs. Now and then "
        "(its first pass in a process, then at most once a minute) it also reads every run "
        "that waits for a child, for a child whose waker died before waking it, and its "
        "first pass checks every waiting run for a signal an older version stored without "
        "waking it: those two are shown, and left out of the verdict. Footer counts stop at "
        f"{_admin.COUNT_CAP:,} per status. Load average before {load_before}, after "
        f"{load_after} (2 cores, shared).",
        "",
        table(["operation", "empty ms", f"{runs:,} runs ms", "big / empty",
               f"<= {LIMIT:.0f}x"], rows),
        "",
        f"Real prune of the runs last updated more than 58 days ago: {pruning['runs']:,} runs "
        f"and {pruning['steps']:,} steps in {pruning['batches']} batches of at most 1,000 "
        f"runs, {pruning['seconds']:.1f} s in all; per batch median "
        f"{ms(pruning['batch_median_s'], 1)} ms, longest {ms(pruning['batch_max_s'], 1)} ms "
        f"(the longest any run row stayed locked); WAL {pruning['wal_bytes'] / 2**20:.1f} MiB "
        f"({pruning['wal_bytes'] / max(pruning['runs'], 1):.0f} bytes per run).",
    ]
    data = {"runs": runs, "steps": runs * STEPS_PER_RUN, "fill_s": fill_s, "rows": data_rows,
            "wal_empty": wal_empty, "wal_big": wal_big, "prune": pruning,
            "load_before": load_before, "load_after": load_after,
            "worst": {"ratio": worst[0], "operation": worst[1]} if worst else None}
    return lines, data


def default_sizes(quick: bool) -> dict[str, int]:
    """The fill and repeat counts (``DURAFLOW_BENCH_SCALE_RUNS`` overrides the fill)."""
    if quick:
        return {"runs": 2000, "repeats": 3, "runs_per_round": 3, "wal_tasks": 3}
    runs = int(os.environ.get("DURAFLOW_BENCH_SCALE_RUNS", "1000000"))
    return {"runs": runs, "repeats": 30, "runs_per_round": 40, "wal_tasks": 50}

