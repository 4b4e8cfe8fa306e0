"""Tables and numbered schema migrations.

All tables share the configurable prefix (``duraflow_`` by default). The
migrations below are append-only: a release never edits an applied step, it
adds the next number. Each one runs in its own transaction and is recorded in
``<prefix>schema``; :func:`migrate` serializes concurrent callers with a
transaction-level PostgreSQL advisory lock (SQLite: ``BEGIN IMMEDIATE``), so a fleet of workers
starting at once applies each step exactly once.

An empty database skips the migrations: :func:`migrate` creates the current tables
of :func:`build_tables` in one transaction and records every version as
applied. So the current model must always describe exactly what the migrations
build; tests/test_schema_fresh.py compares the two.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ColumnElement,
    DateTime,
    Engine,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
    and_,
    false,
    func,
    literal_column,
    select,
    text,
)
from sqlalchemy.engine import Connection
from sqlalchemy.schema import CreateColumn

from ._flow_schema import flow_tables
from ._schedule_schema import schedules_table

# Long enough for Celery's UUIDs and for the ids users choose themselves.
TASK_ID_LENGTH = 255
STEP_KEY_LENGTH = 1024


@dataclass(frozen=True)
class Tables:
    """The SQLAlchemy Core tables for one table prefix."""

    metadata: MetaData
    schema_version: Table
    runs: Table
    steps: Table
    signals: Table
    flow_slots: Table
    flow_waits: Table
    flow_rates: Table
    flow_dedupe: Table
    schedules: Table

    def owned(self) -> tuple[Table, ...]:
        """Every table of the prefix but the schema version's, in creation order."""
        return (self.runs, self.steps, self.signals, self.flow_slots, self.flow_waits,
                self.flow_rates, self.flow_dedupe, self.schedules)


@functools.lru_cache(maxsize=64)
def build_tables(prefix: str) -> Tables:
    """Declare the tables for ``prefix`` (already validated by the config), once per
    prefix: every store of a prefix shares them, and the statements built on them."""
    metadata = MetaData()
    schema_version = Table(
        f"{prefix}schema",
        metadata,
        Column("version", Integer, primary_key=True, autoincrement=False),
        Column("description", String(200), nullable=False),
        Column("applied_at", DateTime(timezone=True), nullable=False),
    )
    runs = Table(
        f"{prefix}runs",
        metadata,
        Column("task_id", String(TASK_ID_LENGTH), primary_key=True),
        Column("task_name", String(255), nullable=False),
        Column("status", String(16), nullable=False),
        Column("attempts", Integer, nullable=False, default=1),
        Column("result", Text, nullable=True),
        Column("serializer", String(100), nullable=True),
        Column("error", Text, nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("updated_at", DateTime(timezone=True), nullable=False),
        Column("finished_at", DateTime(timezone=True), nullable=True),
        *_v2_run_columns(),
        *_v3_run_columns(),
        *_v6_run_columns(),
        *_v7_run_columns(),
        *_v8_run_columns(),
        *_v10_run_columns(),
        *_v11_run_columns(),
        *_v14_run_columns(),
        *_v15_run_columns(),
        postgresql_with={"fillfactor": RUNS_FILLFACTOR},
    )
    steps = _v5_steps(prefix, metadata)
    for column in (*_v7_step_columns(), *_v9_step_columns()):
        steps.append_column(column)
    signals = _v6_signals(prefix, metadata)
    for name, columns in _v8_indexes(runs):
        if name not in _v13_replaced(prefix):  # version 13 redefined these two
            Index(name, *columns)
    # An Index on a table's columns belongs to that table. Version 12 redefined the
    # indexes of versions 2, 6 and 10 except the tombstones' one.
    _pruned_index(runs)
    _v12_indexes(runs)
    _v13_indexes(runs, steps)
    _v14_indexes(runs)
    _v15_indexes(runs)
    slots, waits, rates, dedupe = flow_tables(prefix, metadata)
    return Tables(metadata=metadata, schema_version=schema_version, runs=runs, steps=steps,
                  signals=signals, flow_slots=slots, flow_waits=waits, flow_rates=rates,
                  flow_dedupe=dedupe, schedules=schedules_table(prefix, metadata))


def _v2_run_columns() -> list[Column[object]]:
    return [
        # The lease: which attempt owns the run, and until when.
        Column("lease_owner", String(200), nullable=True),
        Column("lease_expires_at", DateTime(timezone=True), nullable=True),
        # What the recovery sweep needs to send the run again, and the arguments'
        # fingerprint that a delivery with other arguments is checked against.
        Column("args", Text, nullable=True),
        Column("args_fingerprint", String(64), nullable=True),
        Column("exchange", String(255), nullable=True),
        Column("routing_key", String(255), nullable=True),
        Column("retries", Integer, nullable=False, server_default="0"),
        Column("recoveries", Integer, nullable=False, server_default="0"),
    ]


def _v3_run_columns() -> list[Column[object]]:
    return [
        # True while the run is owned by an attempt that took it over from one that
        # ended without a word (killed, lost): that attempt's first unfinished step
        # may have run already, so it is reported in doubt.
        Column("interrupted", Boolean, nullable=False, server_default=false()),
    ]


def _v5_steps(prefix: str, metadata: MetaData, name: str | None = None) -> Table:
    return Table(
        name or f"{prefix}steps",
        metadata,
        # No foreign key to runs (dropped in version 4, on SQLite in 5): a step row is only written
        # under the run's lease, which the same statement checks, and a key check would
        # lock and rewrite the run row on every step.
        Column("task_id", String(TASK_ID_LENGTH), nullable=False),
        Column("step_key", String(STEP_KEY_LENGTH), nullable=False),
        Column("status", String(16), nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("output", Text, nullable=True),
        Column("serializer", String(100), nullable=True),
        Column("error", Text, nullable=True),
        Column("started_at", DateTime(timezone=True), nullable=False),
        Column("completed_at", DateTime(timezone=True), nullable=True),
        # Where the step was reached among its parent's steps (the top level, or the
        # steps nested in one step): 1 for the first. NULL for steps from before version 5.
        Column("position", Integer, nullable=True),
        # The last line of defence: one row per step of a run, whatever happens above.
        # Since version 5 it is the primary key, the table's only index (no surrogate id,
        # no sequence): each step row costs one index entry.
        PrimaryKeyConstraint("task_id", "step_key", name=f"{prefix}steps_task_step_key"),
    )


def _v6_run_columns() -> list[Column[object]]:
    return [
        # What a sleeping or waiting run waits for: the kind ('sleep', 'signal' or
        # 'child'), the sleep's step key, the signal's name or the child's task id, and
        # when it wakes (the sleep's end or the wait's timeout; NULL: no timeout). The
        # sweep itself goes by lease_expires_at, which may give a broker countdown time.
        Column("wait_kind", String(16), nullable=True),
        Column("waiting_for", String(STEP_KEY_LENGTH), nullable=True),
        Column("wake_at", DateTime(timezone=True), nullable=True),
        # A child run's parent: whose wait its end wakes.
        Column("parent_id", String(TASK_ID_LENGTH), nullable=True),
    ]


def _v6_signals(prefix: str, metadata: MetaData) -> Table:
    return Table(
        f"{prefix}signals",
        metadata,
        Column("task_id", String(TASK_ID_LENGTH), nullable=False),
        Column("name", String(STEP_KEY_LENGTH), nullable=False),
        Column("payload", Text, nullable=True),
        Column("serializer", String(100), nullable=True),
        Column("sent_at", DateTime(timezone=True), nullable=False),
        # The first signal of a name is the one kept: later ones conflict and are ignored.
        PrimaryKeyConstraint("task_id", "name", name=f"{prefix}signals_task_name"),
    )


def _v7_run_columns() -> list[Column[object]]:
    # The task function's code when the run started (see _rewrite.code_fingerprint).
    return [Column("code_fingerprint", String(64), nullable=True)]


def _v7_step_columns() -> list[Column[object]]:
    return [
        # A hash of the step's input= (when given), and of its code: the body of its
        # `with` block, or the function given to .run(). Replays compare them.
        Column("input_fingerprint", String(64), nullable=True),
        Column("code_fingerprint", String(64), nullable=True),
    ]


def _v8_run_columns() -> list[Column[object]]:
    # Why the run is being unwound: "cancel" (cancel() asked for it) or "failure" (it
    # failed for good and has compensations to run). NULL: it is not.
    return [Column("unwinding", String(16), nullable=True)]


def _v8_indexes(runs: Table) -> list[tuple[str, tuple[Column[object], ...]]]:
    """The listings' indexes: newest first, by status and by task name."""
    prefix = runs.name.removesuffix("runs")
    return [
        (f"{prefix}runs_created", (runs.c.created_at,)),
        (f"{prefix}runs_status_created", (runs.c.status, runs.c.created_at)),
        (f"{prefix}runs_task_created", (runs.c.task_name, runs.c.created_at)),
    ]


def _v9_step_columns() -> list[Column[object]]:
    return [
        # How the step's `with` body was left, so that a replay leaves it the same way:
        # NULL when it ran to its end (and on every row from before version 9), 'return'
        # (with the returned value in `returned`, written with the step's serializer),
        # 'break' or 'continue'. On a failed step, 'fatal' marks a failure that no retry
        # may run the body again for (an output that cannot be stored, say).
        Column("body_exit", String(16), nullable=True),
        Column("returned", Text, nullable=True),
    ]


def _v10_run_columns() -> list[Column[object]]:
    # When prune deleted the run's steps, signals, arguments, result and error: the row
    # left behind (task id, task name, final status, times) is the run's tombstone, which
    # keeps a late redelivery of the task id from running the run again from nothing.
    # NULL: the run has not been pruned.
    return [Column("pruned_at", DateTime(timezone=True), nullable=True)]


def _v11_run_columns() -> list[Column[object]]:
    # Set on the row of a Celery task id that Task.replace replaced: the run key of its
    # first durable replacement (``<task id>~r<nesting>``), since Celery gives the
    # replacement the same task id. NULL: never replaced.
    return [Column("replaced_by", String(TASK_ID_LENGTH), nullable=True)]


def _v10_indexes(runs: Table) -> list[Index]:
    """Prune's indexes, partial so that neither one grows with the other's rows.

    Prune takes the oldest live runs of a status, and ``(status, updated_at)`` of
    every run would make it step over all the tombstones (the oldest rows) each
    batch; it replaces version 1's index of those columns. Tombstones are deleted
    oldest first by ``pruned_at``.
    """
    prefix = runs.name.removesuffix("runs")
    live = runs.c.pruned_at.is_(None)
    return [
        Index(f"{prefix}runs_live_status_updated", runs.c.status, runs.c.updated_at,
              postgresql_where=live, sqlite_where=live),
        _pruned_index(runs),
    ]


def _pruned_index(runs: Table) -> Index:
    """The tombstones, oldest first: only pruned runs have an entry (version 10)."""
    pruned = runs.c.pruned_at.is_not(None)
    return Index(f"{runs.name.removesuffix('runs')}runs_pruned", runs.c.pruned_at,
                 postgresql_where=pruned, sqlite_where=pruned)


# The run statuses as version 12 knew them. Written out rather than imported, so that the
# migration creates the same predicates whatever statuses a later release adds; a new
# status that ends a run needs a migration that redefines the prune index.
V12_FINISHED = ("succeeded", "failed", "compensated", "cancelled", "ignored", "rejected",
                "replaced")

# The fill factor of the runs table from version 12 (PostgreSQL only). Every run row is
# updated at least once after its insert (when it ends); the room left on each page lets
# the new row version stay on the old one's page, which makes the update's WAL record
# smaller (only the changed middle of the row is logged) and, when no indexed column
# changed, lets the update be HOT (no index entry at all).
RUNS_FILLFACTOR = 80


def _v12_indexes(runs: Table) -> list[Index]:
    """The run indexes that a run's own writes need not touch, partial since version 12.

    A non-HOT update of a run row (and every update that ends a run is one: its
    status is indexed) adds an entry for the new row version to every index whose
    predicate the new version satisfies. Each of these indexes leaves out the rows
    its queries never look for:

    * the sweep's ``(status, lease_expires_at)``: only runs with a lease expiry. The
      sweep looks for expiries in the past, and every write that ends a run clears
      the expiry, so the end of a run adds nothing here. (A run waiting for a signal
      or a child with no timeout has no expiry: the sweep finds it by status, through
      ``(status, created_at)``.) The predicate names no value a query passes as a
      parameter, so a prepared statement's generic plan can use the index too;
    * ``(parent_id)``: only child runs; a top-level run never has an entry;
    * prune's ``(status, updated_at)`` of the runs not pruned yet: only runs that
      have ended, so a new run (running) adds nothing until it ends. Prune asks for
      one ended status at a time, which implies the predicate.
    """
    prefix = runs.name.removesuffix("runs")
    leased = runs.c.lease_expires_at.is_not(None)
    child = runs.c.parent_id.is_not(None)
    prunable = and_(runs.c.pruned_at.is_(None), runs.c.status.in_(V12_FINISHED))
    return [
        Index(f"{prefix}runs_status_lease", runs.c.status, runs.c.lease_expires_at,
              postgresql_where=leased, sqlite_where=leased),
        Index(f"{prefix}runs_parent", runs.c.parent_id,
              postgresql_where=child, sqlite_where=child),
        Index(f"{prefix}runs_live_status_updated", runs.c.status, runs.c.updated_at,
              postgresql_where=prunable, sqlite_where=prunable),
    ]


# What version 13 took a step key to be a patch marker by: the marker prefix of _patched,
# written out for the same reason as V12_FINISHED. A step name cannot hold '/' or '#'.
V13_MARKER_LIKE = "%patched:%"
V13_MARKER_PATTERN = r"^(.*/)?(patched:[^/#]*)(#[0-9]+)?$"


def marker_name(steps: Table) -> ColumnElement[str]:
    """The patch marker a step key records (``patched:NAME``), as version 13's index has it.

    Written with literal SQL constants, never bound parameters, so that the
    expression and the predicate of a query are the index's own even in a
    prepared statement's generic plan. PostgreSQL only (``regexp_replace``).
    """
    return func.regexp_replace(steps.c.step_key, literal_column(f"'{V13_MARKER_PATTERN}'"),
                               literal_column(r"'\2'"), type_=String)


def is_marker(steps: Table) -> ColumnElement[bool]:
    """True for a step key that may be a patch marker: the marker index's predicate."""
    return steps.c.step_key.like(literal_column(f"'{V13_MARKER_LIKE}'"))


def _v13_replaced(prefix: str) -> set[str]:
    return {f"{prefix}runs_status_created", f"{prefix}runs_task_created"}


def _v13_indexes(runs: Table, steps: Table) -> list[Index]:
    """The operator side's indexes from version 13, each leaving out what no query reads.

    * ``(status, created_at)`` of the live runs (not pruned): the listing by status,
      and the bounded count per status, which reads at most a capped number of
      entries of one status and needs no row (tombstones have no entry);
    * ``(task_name, status, created_at)`` of the live runs replaces version 8's
      ``(task_name, created_at)``: the listing by task name merges one range per
      status, newest first, and the bounded count of one task's runs per status
      reads one range per status. Task name and creation time never change; the
      status does, but every update that changes it is already a non-HOT update
      (other indexes hold it), so this index costs a run's writes what the one it
      replaces did;
    * on PostgreSQL, the patch markers of the steps by marker name (and start
      time, task id): ``patch NAME`` looks one marker up instead of matching every
      step key against ``%/NAME``. Partial: only marker rows have an entry, so an
      ordinary step's insert adds nothing to it. SQLite keeps the key match.
    """
    prefix = runs.name.removesuffix("runs")
    live = runs.c.pruned_at.is_(None)
    marker = is_marker(steps)
    return [
        Index(f"{prefix}runs_status_created", runs.c.status, runs.c.created_at,
              postgresql_where=live, sqlite_where=live),
        Index(f"{prefix}runs_task_status_created", runs.c.task_name, runs.c.status,
              runs.c.created_at, postgresql_where=live, sqlite_where=live),
        Index(f"{prefix}steps_patch_markers", marker_name(steps), steps.c.started_at,
              steps.c.task_id, postgresql_where=marker).ddl_if(dialect="postgresql"),
    ]


# Each migration declares the tables as they were at its version, so that it means
# the same thing forever, whatever the current model above has become.

def _v1_initial(conn: Connection, tables: Tables) -> None:
    prefix = tables.runs.name.removesuffix("runs")
    metadata = MetaData()
    runs = Table(
        f"{prefix}runs",
        metadata,
        Column("task_id", String(TASK_ID_LENGTH), primary_key=True),
        Column("task_name", String(255), nullable=False),
        Column("status", String(16), nullable=False),
        Column("attempts", Integer, nullable=False, default=1),
        Column("result", Text, nullable=True),
        Column("serializer", String(100), nullable=True),
        Column("error", Text, nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("updated_at", DateTime(timezone=True), nullable=False),
        Column("finished_at", DateTime(timezone=True), nullable=True),
    )
    Table(
        f"{prefix}steps",
        metadata,
        Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
               autoincrement=True),
        Column("task_id", String(TASK_ID_LENGTH),
               ForeignKey(f"{prefix}runs.task_id", ondelete="CASCADE"), nullable=False),
        Column("step_key", String(STEP_KEY_LENGTH), nullable=False),
        Column("status", String(16), nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("output", Text, nullable=True),
        Column("serializer", String(100), nullable=True),
        Column("error", Text, nullable=True),
        Column("started_at", DateTime(timezone=True), nullable=False),
        Column("completed_at", DateTime(timezone=True), nullable=True),
        UniqueConstraint("task_id", "step_key", name=f"{prefix}steps_task_step_key"),
    )
    Index(f"{prefix}runs_status_updated", runs.c.status, runs.c.updated_at)
    metadata.create_all(conn)


def _add_column(conn: Connection, table: str, column: Column[object]) -> None:
    ddl = CreateColumn(column).compile(dialect=conn.dialect)
    conn.execute(text(f"ALTER TABLE {conn.dialect.identifier_preparer.quote(table)} ADD {ddl}"))


def _v2_leases(conn: Connection, tables: Tables) -> None:
    for column in _v2_run_columns():
        _add_column(conn, tables.runs.name, column)
    prefix = tables.runs.name.removesuffix("runs")
    Index(f"{prefix}runs_status_lease", tables.runs.c.status,
          tables.runs.c.lease_expires_at).create(conn)


def _v3_interrupted(conn: Connection, tables: Tables) -> None:
    for column in _v3_run_columns():
        _add_column(conn, tables.runs.name, column)


def _v4_no_step_foreign_key(conn: Connection, tables: Tables) -> None:
    if conn.dialect.name != "postgresql":
        # SQLite cannot drop a constraint without rebuilding the table, and it is not
        # where speed matters; its foreign key stays.
        return
    steps = tables.steps.name
    quote = conn.dialect.identifier_preparer.quote
    for fk in conn.dialect.get_foreign_keys(conn, steps):
        name = fk.get("name")
        if name:
            conn.execute(text(f"ALTER TABLE {quote(steps)} DROP CONSTRAINT {quote(name)}"))


def _v5_step_primary_key(conn: Connection, tables: Tables) -> None:
    prefix = tables.runs.name.removesuffix("runs")
    steps = f"{prefix}steps"
    quote = conn.dialect.identifier_preparer.quote
    if conn.dialect.name == "postgresql":
        pkey = conn.dialect.get_pk_constraint(conn, steps)["name"] or f"{steps}_pkey"
        key = f"{prefix}steps_task_step_key"
        conn.execute(text(
            f"ALTER TABLE {quote(steps)} DROP CONSTRAINT {quote(pkey)}, "
            f"DROP CONSTRAINT {quote(key)}, DROP COLUMN id, ADD COLUMN position INTEGER, "
            f"ADD CONSTRAINT {quote(key)} PRIMARY KEY (task_id, step_key)"))
        return
    # SQLite cannot change a primary key in place: build the new table, copy, swap.
    new = _v5_steps(prefix, MetaData(), name=f"{prefix}steps_v5")
    new.create(conn)
    columns = ", ".join(c.name for c in new.columns if c.name != "position")
    conn.execute(text(f"INSERT INTO {quote(new.name)} ({columns}) "
                      f"SELECT {columns} FROM {quote(steps)}"))
    conn.execute(text(f"DROP TABLE {quote(steps)}"))
    conn.execute(text(f"ALTER TABLE {quote(new.name)} RENAME TO {quote(steps)}"))


def _v6_waits(conn: Connection, tables: Tables) -> None:
    prefix = tables.runs.name.removesuffix("runs")
    for column in _v6_run_columns():
        _add_column(conn, tables.runs.name, column)
    metadata = MetaData()
    _v6_signals(prefix, metadata).create(conn)
    runs = Table(tables.runs.name, metadata, Column("parent_id", String(TASK_ID_LENGTH)))
    Index(f"{prefix}runs_parent", runs.c.parent_id).create(conn)


def _v7_fingerprints(conn: Connection, tables: Tables) -> None:
    prefix = tables.runs.name.removesuffix("runs")
    for column in _v7_run_columns():
        _add_column(conn, f"{prefix}runs", column)
    for column in _v7_step_columns():
        _add_column(conn, f"{prefix}steps", column)


def _v8_operations(conn: Connection, tables: Tables) -> None:
    prefix = tables.runs.name.removesuffix("runs")
    for column in _v8_run_columns():
        _add_column(conn, f"{prefix}runs", column)
    runs = Table(f"{prefix}runs", MetaData(), Column("created_at", DateTime(timezone=True)),
                 Column("status", String(16)), Column("task_name", String(255)))
    for name, columns in _v8_indexes(runs):
        Index(name, *columns).create(conn)


def _v9_body_exits(conn: Connection, tables: Tables) -> None:
    prefix = tables.runs.name.removesuffix("runs")
    for column in _v9_step_columns():
        _add_column(conn, f"{prefix}steps", column)


def _v10_tombstones(conn: Connection, tables: Tables) -> None:
    prefix = tables.runs.name.removesuffix("runs")
    for column in _v10_run_columns():
        _add_column(conn, f"{prefix}runs", column)
    quote = conn.dialect.identifier_preparer.quote
    conn.execute(text(f"DROP INDEX {quote(prefix + 'runs_status_updated')}"))
    runs = Table(f"{prefix}runs", MetaData(), Column("status", String(16)),
                 Column("updated_at", DateTime(timezone=True)),
                 *_v10_run_columns())
    for index in _v10_indexes(runs):
        index.create(conn)


def _v11_replacements(conn: Connection, tables: Tables) -> None:
    prefix = tables.runs.name.removesuffix("runs")
    for column in _v11_run_columns():
        _add_column(conn, f"{prefix}runs", column)


def _v12_partial_run_indexes(conn: Connection, tables: Tables) -> None:
    prefix = tables.runs.name.removesuffix("runs")
    quote = conn.dialect.identifier_preparer.quote
    runs = Table(f"{prefix}runs", MetaData(), Column("status", String(16)),
                 Column("updated_at", DateTime(timezone=True)),
                 Column("lease_expires_at", DateTime(timezone=True)),
                 Column("parent_id", String(TASK_ID_LENGTH)), *_v10_run_columns())
    # Same names, narrower predicates: drop each index and build it again. Building
    # them takes a lock on the runs table for as long as it reads it once per index.
    for index in _v12_indexes(runs):
        conn.execute(text(f"DROP INDEX {quote(str(index.name))}"))
        index.create(conn)
    if conn.dialect.name == "postgresql":
        # Applies to the pages written from now on; existing pages keep their rows
        # until they are updated (a VACUUM FULL would rewrite them all, under a lock
        # no worker could wait for).
        conn.execute(text(f"ALTER TABLE {quote(prefix + 'runs')} "
                          f"SET (fillfactor = {RUNS_FILLFACTOR})"))


def _v13_operator_indexes(conn: Connection, tables: Tables) -> None:
    prefix = tables.runs.name.removesuffix("runs")
    quote = conn.dialect.identifier_preparer.quote
    metadata = MetaData()
    runs = Table(f"{prefix}runs", metadata, Column("status", String(16)),
                 Column("task_name", String(255)), Column("created_at", DateTime(timezone=True)),
                 *_v10_run_columns())
    steps = Table(f"{prefix}steps", metadata, Column("task_id", String(TASK_ID_LENGTH)),
                  Column("step_key", String(STEP_KEY_LENGTH)),
                  Column("started_at", DateTime(timezone=True)))
    # Like version 12's, each index is built while the runs (or steps) table is locked
    # against writes, for as long as one read of it takes.
    for name in sorted(_v13_replaced(prefix)):
        conn.execute(text(f"DROP INDEX {quote(name)}"))
    for index in _v13_indexes(runs, steps):
        index.create(conn)


def _v14_run_columns() -> list[Column[object]]:
    # The broker priority the run was sent with: a run the library sends again (woken
    # from a queue, a window or a sleep, recovered by the sweep) keeps it.
    return [Column("priority", SmallInteger, nullable=True)]


def _v14_indexes(runs: Table) -> list[Index]:
    """The runs that wait for a child, by the child they wait for (version 14).

    The sweep looks on every pass for a parent whose child ended without waking it
    (the waker died in between, or its wake raced with the parent's suspension):
    through this index that costs what the waiting parents cost, not what the
    runs table holds. The values are written out, as in version 12.
    """
    prefix = runs.name.removesuffix("runs")
    waiting_child = and_(runs.c.status == "waiting", runs.c.wait_kind == "child")
    return [Index(f"{prefix}runs_waiting_child", runs.c.waiting_for,
                  postgresql_where=waiting_child, sqlite_where=waiting_child)]


def _v14_flow_control(conn: Connection, tables: Tables) -> None:
    prefix = tables.runs.name.removesuffix("runs")
    for table in flow_tables(prefix, MetaData()):
        table.create(conn)
    for column in _v14_run_columns():
        _add_column(conn, tables.runs.name, column)
    for index in _v14_indexes(tables.runs):
        index.create(conn)


# The statuses of a run that has not ended, written out as V12_FINISHED is.
V15_UNFINISHED = ("running", "sleeping", "waiting")


def _v15_run_columns() -> list[Column[object]]:
    # A child started by children(): the step key of the parent's join it belongs to
    # (its parent is parent_id). NULL for every other run, a child() child included.
    return [Column("join_key", String(STEP_KEY_LENGTH), nullable=True)]


def _v15_indexes(runs: Table) -> list[Index]:
    """The children of a join that have not ended, and the parents waiting on a join.

    A child's end asks whether any sibling of its join is still open, and a parent
    suspending on a join asks the same: the first index holds only the open
    children of joins, so the answer is one probe however many children ended
    (an ended child's entry goes with its row version). The second is the sweep's
    periodic look at parents waiting on a join (as version 14's for one child).
    The values are written out, as in version 12.
    """
    prefix = runs.name.removesuffix("runs")
    open_child = and_(runs.c.join_key.is_not(None), runs.c.status.in_(V15_UNFINISHED))
    waiting_join = and_(runs.c.status == "waiting", runs.c.wait_kind == "children")
    return [Index(f"{prefix}runs_open_joins", runs.c.parent_id, runs.c.join_key,
                  postgresql_where=open_child, sqlite_where=open_child),
            Index(f"{prefix}runs_waiting_join", runs.c.waiting_for,
                  postgresql_where=waiting_join, sqlite_where=waiting_join)]


def _v15_joins(conn: Connection, tables: Tables) -> None:
    for column in _v15_run_columns():
        _add_column(conn, tables.runs.name, column)
    for index in _v15_indexes(tables.runs):
        index.create(conn)


def _v16_schedules(conn: Connection, tables: Tables) -> None:
    prefix = tables.runs.name.removesuffix("runs")
    schedules_table(prefix, MetaData()).create(conn)


# (version, description, apply). Append only.
MIGRATIONS: tuple[tuple[int, str, Callable[[Connection, Tables], None]], ...] = (
    (1, "runs and steps", _v1_initial),
    (2, "run leases, arguments and recovery", _v2_leases),
    (3, "runs remember an interrupted owner", _v3_interrupted),
    (4, "no foreign key from steps to runs", _v4_no_step_foreign_key),
    (5, "steps keyed by (task_id, step_key), with their position", _v5_step_primary_key),
    (6, "sleeps, signals and child runs", _v6_waits),
    (7, "code and input fingerprints", _v7_fingerprints),
    (8, "cancellation and compensation, listing indexes", _v8_operations),
    (9, "how a step's body was left (return, break, continue, fatal)", _v9_body_exits),
    (10, "pruned runs leave a tombstone; prune's partial indexes", _v10_tombstones),
    (11, "replaced runs point to their replacement", _v11_replacements),
    (12, "partial run indexes that a run's own writes do not touch; runs fill factor",
     _v12_partial_run_indexes),
    (13, "live-run listing indexes by status and by task and status; patch marker index",
     _v13_operator_indexes),
    (14, "flow control: concurrency slots and their queues, rate windows, dedupe keys; "
         "runs keep their priority; runs waiting for a child, by child",
     _v14_flow_control),
    (15, "fan-out: a child run's join, and the indexes of open joins and waiting parents",
     _v15_joins),
    (16, "durable schedules: cron and interval schedules, their policies and next slot",
     _v16_schedules),
)
LATEST_VERSION = MIGRATIONS[-1][0]


def _lock_key(prefix: str) -> int:
    # A stable signed 64-bit key per prefix for pg_advisory_lock.
    return zlib.crc32(f"celery-duraflow:{prefix}".encode()) - 2**31


def current_version(conn: Connection, tables: Tables) -> int:
    """The highest applied version, 0 when the schema table does not exist yet."""
    if not conn.dialect.has_table(conn, tables.schema_version.name):
        return 0
    version = conn.execute(select(func.max(tables.schema_version.c.version))).scalar()
    return int(version or 0)


def migrate(engine: Engine, tables: Tables, prefix: str) -> list[int]:
    """Bring the schema to :data:`LATEST_VERSION`; return the versions this call applied.

    An empty database gets the current tables at once, one already at the latest
    version is left alone, both in one transaction (:func:`_create_or_check`); one
    with an older schema takes the numbered migrations it lacks, one by one.
    """
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            # Real transactions, whatever the engine's default: the lock lasts as long
            # as the transaction it is taken in (see _lock).
            conn.execution_options(isolation_level="READ COMMITTED")
        done = _create_or_check(conn, tables)
        if done is not None:
            return done
        return _apply_migrations(conn, tables)


def _lock(conn: Connection, tables: Tables) -> None:
    """Queue, on PostgreSQL, behind every other migrating caller of the tables' prefix.

    The lock is the transaction's own (``pg_advisory_xact_lock``): it is taken
    as the first statement of each migrating transaction and let go by its
    commit or rollback, so the version a caller reads cannot change before
    that transaction has applied the next one. A session lock taken and freed
    in separate transactions would not survive a transaction pooler, which
    may run them on different server connections and leave the lock held for
    good on one of them. SQLite has no such lock: there each transaction
    begins with BEGIN IMMEDIATE, and takes its decisions again inside.
    """
    if conn.dialect.name == "postgresql":
        # The key of earlier releases, which held it for the session: during an upgrade
        # old and new workers still queue behind each other.
        prefix = tables.schema_version.name.removesuffix("schema")
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _lock_key(prefix)})


def _create_or_check(conn: Connection, tables: Tables) -> list[int] | None:
    """Create an empty database's current schema in one transaction, or find it done.

    Applying twelve migrations to nothing costs twelve transactions, a table
    rebuild and a score of ALTERs (tens of milliseconds per new SQLite file) to
    reach what :func:`build_tables` describes directly. Every version is recorded
    as applied, with the migration's description, so later migrations continue
    from :data:`LATEST_VERSION` as if the schema had been migrated;
    tests/test_schema_fresh.py checks that both ways give the same tables,
    columns, keys and indexes.

    Returns the versions recorded; an empty list when the schema is already at
    (or past) the latest version; None when it is older, or when a table of ours
    exists with no version recorded (left to the migrations, which treat it as
    they always did). The version is read inside the transaction that creates:
    on SQLite BEGIN IMMEDIATE holds the write lock from its start, so of two
    processes creating one new file the second finds the first's tables here
    and creates nothing (on PostgreSQL the advisory lock already queues them).
    """
    with conn.begin():
        _lock(conn, tables)
        version = current_version(conn, tables)
        if version >= LATEST_VERSION:
            return []
        if version > 0 or any(conn.dialect.has_table(conn, table.name)
                              for table in (tables.runs, tables.steps, tables.signals)):
            return None
        # The version table may exist, empty; the others were just found missing.
        tables.schema_version.create(conn, checkfirst=True)
        for table in tables.owned():
            table.create(conn, checkfirst=False)
        applied_at = datetime.now(UTC)
        conn.execute(tables.schema_version.insert(), [
            {"version": number, "description": description, "applied_at": applied_at}
            for number, description, _apply in MIGRATIONS
        ])
    return [number for number, _description, _apply in MIGRATIONS]


def _apply_migrations(conn: Connection, tables: Tables) -> list[int]:
    """Apply each pending numbered migration in its own transaction; return those applied."""
    applied: list[int] = []
    for version, description, apply in MIGRATIONS:
        # On SQLite the store's engine begins with BEGIN IMMEDIATE, which takes the
        # write lock at once: two processes cannot both find a version missing.
        with conn.begin():
            _lock(conn, tables)
            tables.schema_version.create(conn, checkfirst=True)
            if current_version(conn, tables) >= version:
                continue
            apply(conn, tables)
            conn.execute(
                tables.schema_version.insert().values(
                    version=version,
                    description=description,
                    applied_at=datetime.now(UTC),
                )
            )
        applied.append(version)
    return applied
