"""On a table big enough for the planner to care, no statement of ours reads a whole table.

A statement that is fast on the few rows of a test can read every run or every step
of a production store: a count with no bound, a ``LIKE '%/name'`` over the step keys,
an ``IN`` list the planner answers with a scan. These tests fill 100,000 runs and a
million steps (as the scale benchmark does, in bulk), capture the SQL that the
library's own functions send (the attempt and its steps, a replay, the sweep, the
listings and their counts, prune's dry run and batches, the patch lookup) and check
that ``EXPLAIN`` of each has no sequential scan of the runs, steps or signals tables.
The SQL comes from the code, so a regression in it fails here.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from benchmarks.common import DuraflowBench, drop_prefixed_tables, libpq_url
from benchmarks.scale import MARKER, TASK_NAMES, fill
from celery_duraflow import _admin, get_run
from celery_duraflow._db import Database, _as_text
from celery_duraflow.web import _data

pytestmark = pytest.mark.postgres

RUNS = 100_000

Captured = list[tuple[str, Any]]


@pytest.fixture(scope="module")
def big(pg_url: str) -> Iterator[DuraflowBench]:
    """A store of 100,000 runs and a million steps (filled once for this module)."""
    prefix = f"plans_{uuid.uuid4().hex[:8]}_"
    df = DuraflowBench.create(pg_url, prefix)
    try:
        with psycopg.connect(libpq_url(pg_url), autocommit=True) as conn:
            # A signal for every run: a signals table as big as the runs one.
            fill(conn, prefix, RUNS, signal_every=1)
        yield df
    finally:
        df.close()
        df.engine.dispose()
        drop_prefixed_tables(libpq_url(pg_url), prefix)


def _capture(action: Callable[[], object]) -> Captured:
    """The statements (and parameters) that ``action`` hands to psycopg in this thread.

    At the driver, not at SQLAlchemy: the attempt's statements are prepared once and
    sent to the psycopg connection directly.
    """
    seen: Captured = []
    me = threading.get_ident()
    original = psycopg.Cursor.execute

    def execute(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        if threading.get_ident() == me:
            raw = query if isinstance(query, bytes | str) else query.as_bytes(self)
            seen.append((raw.decode() if isinstance(raw, bytes) else raw, params))
        return original(self, query, params, **kwargs)

    raw_original = Database._write_raw

    def write_raw(self: Database, prepared: Any, params: dict[str, Any]) -> Any:
        # Statements prepared on libpq directly, with $n placeholders: explained through
        # PREPARE and EXECUTE with the same values.
        if threading.get_ident() == me:
            values = {**(prepared.defaults or {}), **params}
            sql = prepared.raw_sql
            seen.append((sql.decode() if isinstance(sql, bytes) else sql,
                         [_as_text(values[name]) for name in prepared.raw_names]))
        return raw_original(self, prepared, params)

    psycopg.Cursor.execute = execute  # type: ignore[method-assign]
    Database._write_raw = write_raw  # type: ignore[method-assign]
    try:
        action()
    finally:
        psycopg.Cursor.execute = original  # type: ignore[method-assign]
        Database._write_raw = raw_original  # type: ignore[method-assign]
    return seen


def _scans(plan: dict[str, Any]) -> Iterator[tuple[str, str]]:
    yield plan["Node Type"], plan.get("Relation Name", "")
    for child in plan.get("Plans", ()):
        yield from _scans(child)


def _check(df: DuraflowBench, statements: Captured) -> int:
    """Fail on a sequential scan of our tables in any of ``statements``; how many checked."""
    tables = {f"{df.prefix}{name}" for name in ("runs", "steps", "signals")}
    checked = 0
    with psycopg.connect(df.conninfo, autocommit=True) as conn:
        for statement, parameters in statements:
            words = statement.lstrip().split(None, 1)
            if not words or words[0].upper() not in ("SELECT", "INSERT", "UPDATE", "DELETE",
                                                      "WITH"):
                continue
            if "$1" in statement and isinstance(parameters, list):
                name = f"plan_check_{checked}"
                conn.execute(f"PREPARE {name} AS {statement}")  # type: ignore[call-overload]
                # As literals (the prepared statement knows their types).
                values = [v.decode() if isinstance(v, bytes) else v for v in parameters]
                literal = psycopg.ClientCursor(conn).mogrify
                marks = ", ".join(literal("%s", (v,)) for v in values)
                statement, parameters = f"EXECUTE {name}({marks})", None
            row = conn.execute(f"EXPLAIN (FORMAT JSON) {statement}",  # type: ignore[call-overload]
                               parameters).fetchone()
            explained = row[0] if row is not None else "[]"
            plan = (json.loads(explained) if isinstance(explained, str) else explained)[0]
            scanned = [relation for node, relation in _scans(plan["Plan"])
                       if node == "Seq Scan" and relation in tables]
            if scanned:
                shown = conn.execute(f"EXPLAIN {statement}",  # type: ignore[call-overload]
                                     parameters).fetchall()
                text = "\n".join(line for line, in shown)
                raise AssertionError(f"sequential scan of {scanned} in:\n{statement}\n{text}")
            checked += 1
    return checked


def test_an_attempt_its_steps_and_a_replay_use_keys_only(big: DuraflowBench) -> None:
    """A fresh 10-step run, its replay, and get_run read and write by key, never by scan."""
    task_id = f"plans-{uuid.uuid4()}"
    statements = _capture(lambda: big.run(10, task_id))
    big.reset_to_running(task_id)
    statements += _capture(lambda: big.run(10, task_id))
    statements += _capture(lambda: get_run(task_id, app=big.app))
    # Start, the history, ten step records, the finish; the replay's start and history.
    assert _check(big, statements) >= 14


def test_the_sweep_reads_only_due_runs(big: DuraflowBench) -> None:
    """The recovery sweep and the next-due lookup go through the lease index."""
    store = big.store
    from celery_duraflow._records import utc_now

    statements = _capture(lambda: store.recoverable_runs(100))
    statements += _capture(lambda: store.next_due(utc_now() + timedelta(days=3)))
    assert _check(big, statements) == 2


def test_listings_and_their_bounded_counts_use_indexes(big: DuraflowBench) -> None:
    """Every listing of `runs` and of the web view, and their footer counts, use an index."""
    store = big.store
    week = timedelta(days=7)

    def listings() -> None:
        for filters in ({}, {"statuses": ["failed"]}, {"statuses": ["failed", "waiting"]},
                        {"task_name": TASK_NAMES[0]}, {"older_than": week},
                        {"newer_than": week}, {"task_name": TASK_NAMES[1],
                                               "statuses": ["succeeded"]}):
            _admin.summarize_runs(store, limit=50, **filters)
            _admin.count_by_status_bounded(store, **filters)
        _data.load_runs_page(store, status=None, task_name=None, cursor=None, limit=50)
        _data.load_runs_page(store, status="waiting", task_name=TASK_NAMES[2], cursor=None,
                             limit=50)

    assert _check(big, _capture(listings)) == 18


def test_prune_dry_run_and_batches_use_indexes(big: DuraflowBench) -> None:
    """Prune's bounded dry run, its candidate choice and its deletes use indexes."""
    store = big.store
    statements = _capture(lambda: (
        _admin.count_prunable(store, older_than=timedelta(days=29), cap=_admin.COUNT_CAP),
        _admin.count_tombstones(store, cap=_admin.COUNT_CAP)))
    # The oldest few hundred runs: a real prune, in small batches.
    batches: list[_admin.PruneBatch] = []
    statements += _capture(lambda: _admin.prune(
        store, older_than=timedelta(days=59, hours=20), batch_size=50,
        tombstones_older_than=timedelta(0), progress=batches.append))
    assert len(batches) >= 2
    assert _check(big, statements) >= 10


def test_patch_lookup_uses_the_marker_index(big: DuraflowBench) -> None:
    """`patch NAME` finds its marker by name, not by matching every step key."""
    store = big.store
    statements = _capture(lambda: _admin.patch_progress(store, f"patched:{MARKER}",
                                                        cap=_admin.COUNT_CAP))
    statements += _capture(lambda: _admin.patch_progress(store, f"patched:{MARKER}",
                                                         TASK_NAMES[0], cap=_admin.COUNT_CAP))
    assert _check(big, statements) == 6


def test_a_fan_out_join_reads_its_children_by_index(big: DuraflowBench) -> None:
    """Recording a join's children, the suspension on the join, a child's end waking the
    parent, the join's read and progress, and the sweep's look at parents of ended joins
    use indexes (the index of open joins, of a run's children, of waiting parents)."""
    from celery_duraflow._fanout import join_child_id
    from celery_duraflow._joins_store import NewChild
    from celery_duraflow._store import Delivery

    store = big.store
    owner = "plans-host|x|1|abc"
    parent = f"plans-{uuid.uuid4()}"
    store.begin_attempt(parent, Delivery(task_name=TASK_NAMES[0], owner=owner))
    ids = [join_child_id(parent, "fan", n) for n in range(20)]
    statements = _capture(lambda: store.create_join_children(
        parent, "fan", [NewChild(task_id=i, task_name=TASK_NAMES[1], args="[]") for i in ids]))
    statements += _capture(lambda: store.suspend(
        parent, owner, status="waiting", kind="children", waiting_for="fan", wake_at=None,
        sweep_at=None))
    statements += _capture(lambda: store.wake_join(parent, "fan", grace=30.0))
    statements += _capture(lambda: store.join_children(parent, "fan"))
    statements += _capture(lambda: store.join_progress(parent))
    statements += _capture(lambda: store.recoverable_runs(100, arrivals=False, parents=True))
    # Only the statements that read or write the runs table are checked; BEGIN and COMMIT
    # are not sent as statements of their own here.
    assert _check(big, statements) >= 7
