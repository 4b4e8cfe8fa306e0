"""The tables of flow control (schema version 14): slots, their queues, rate windows, dedupe.

- ``<prefix>flow_slots``: one row per concurrency slot taken, numbered ``0 .. limit-1``
  under a limit's scope and key. The primary key makes a slot number impossible to
  take twice. A row does not by itself hold a slot: it is live only while the run it
  names holds the lease it was taken under (``owner``), or, for a slot handed to a
  waiting run that has not arrived yet (``owner`` NULL), until ``expires_at``.
- ``<prefix>flow_waits``: the runs queued for a slot, oldest first (``queued_at``,
  then ``task_id``), each with the limit it asked under.
- ``<prefix>flow_rates``: a limit of N calls per window is N rows per key; a row is
  used at most once per window (``used_at``, the store's clock), so no window of
  that length ever holds more than N uses.
- ``<prefix>flow_dedupe``: the run a dedupe key sent, until the key's window ends.
"""

from __future__ import annotations

from sqlalchemy import (
    Column,
    DateTime,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
)

# The length of a task id column, as in _schema (which imports this module).
TASK_ID_LENGTH = 255

# A limit's scope (by default the task's name) and the key computed from a run's
# arguments: short enough for a composite primary key on every database.
SCOPE_LENGTH = 255
FLOW_KEY_LENGTH = 255


def flow_tables(prefix: str, metadata: MetaData) -> tuple[Table, Table, Table, Table]:
    """Declare the four flow-control tables of ``prefix`` in ``metadata``."""
    slots = Table(
        f"{prefix}flow_slots",
        metadata,
        Column("scope", String(SCOPE_LENGTH), nullable=False),
        Column("key", String(FLOW_KEY_LENGTH), nullable=False),
        Column("slot", Integer, nullable=False, autoincrement=False),
        Column("task_id", String(TASK_ID_LENGTH), nullable=False),
        Column("owner", String(200), nullable=True),
        Column("granted_at", DateTime(timezone=True), nullable=False),
        # For a slot handed to a queued run: when that run was queued.
        Column("queued_at", DateTime(timezone=True), nullable=True),
        PrimaryKeyConstraint("scope", "key", "slot", name=f"{prefix}flow_slots_key"),
    )
    Index(f"{prefix}flow_slots_task", slots.c.task_id)
    waits = Table(
        f"{prefix}flow_waits",
        metadata,
        Column("scope", String(SCOPE_LENGTH), nullable=False),
        Column("key", String(FLOW_KEY_LENGTH), nullable=False),
        Column("task_id", String(TASK_ID_LENGTH), nullable=False),
        Column("queued_at", DateTime(timezone=True), nullable=False),
        Column("limit", Integer, nullable=False),
        PrimaryKeyConstraint("scope", "key", "task_id", name=f"{prefix}flow_waits_key"),
    )
    Index(f"{prefix}flow_waits_order", waits.c.scope, waits.c.key, waits.c.queued_at)
    Index(f"{prefix}flow_waits_task", waits.c.task_id)
    rates = Table(
        f"{prefix}flow_rates",
        metadata,
        Column("scope", String(SCOPE_LENGTH), nullable=False),
        Column("key", String(FLOW_KEY_LENGTH), nullable=False),
        Column("slot", Integer, nullable=False, autoincrement=False),
        Column("used_at", DateTime(timezone=True), nullable=False),
        Column("task_id", String(TASK_ID_LENGTH), nullable=True),
        PrimaryKeyConstraint("scope", "key", "slot", name=f"{prefix}flow_rates_key"),
    )
    dedupe = Table(
        f"{prefix}flow_dedupe",
        metadata,
        Column("scope", String(SCOPE_LENGTH), nullable=False),
        Column("key", String(FLOW_KEY_LENGTH), nullable=False),
        Column("task_id", String(TASK_ID_LENGTH), nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("expires_at", DateTime(timezone=True), nullable=False),
        PrimaryKeyConstraint("scope", "key", name=f"{prefix}flow_dedupe_key"),
    )
    return slots, waits, rates, dedupe
