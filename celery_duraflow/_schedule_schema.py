"""The table of durable schedules (schema version 16).

``<prefix>schedules`` holds one row per schedule, keyed by its name: what it
fires (a durable task's name, its recorded arguments and routing), when (a cron
expression in a time zone, or an interval from an anchor), its catch-up and
overlap policies, whether it is paused, and where it stands: the first slot not
handled yet (``next_fire_at``), the slot kept back by the ``buffer_one`` policy,
and the last slot fired and its run. A firing pass locks a due row, fires its
slots as runs whose ids derive from the name and the slot, and moves
``next_fire_at`` on, in one transaction.
"""

from __future__ import annotations

from sqlalchemy import (
    Boolean,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    false,
)

# As in _schema (which imports this module): a task id's length.
TASK_ID_LENGTH = 255
SCHEDULE_NAME_LENGTH = 200


def schedules_table(prefix: str, metadata: MetaData) -> Table:
    """Declare ``<prefix>schedules`` in ``metadata``."""
    table = Table(
        f"{prefix}schedules",
        metadata,
        Column("name", String(SCHEDULE_NAME_LENGTH), primary_key=True),
        Column("task_name", String(255), nullable=False),
        # 'code' for an entry of beat_schedule (kept in step with it by the scheduler),
        # 'api' for one added at run time.
        Column("origin", String(8), nullable=False),
        # Exactly one of cron (with its time zone) and every (seconds, from anchor_at).
        Column("cron", String(255), nullable=True),
        Column("timezone", String(64), nullable=False),
        Column("every", Float, nullable=True),
        Column("anchor_at", DateTime(timezone=True), nullable=True),
        # The arguments as a run records them, and where its messages go.
        Column("args", Text, nullable=True),
        Column("exchange", String(255), nullable=True),
        Column("routing_key", String(255), nullable=True),
        Column("priority", Integer, nullable=True),
        Column("catchup", String(16), nullable=False),
        Column("catchup_window", Float, nullable=True),
        Column("overlap", String(16), nullable=False),
        Column("paused", Boolean, nullable=False, server_default=false()),
        Column("note", Text, nullable=True),
        Column("next_fire_at", DateTime(timezone=True), nullable=False),
        Column("buffered_at", DateTime(timezone=True), nullable=True),
        Column("last_slot_at", DateTime(timezone=True), nullable=True),
        Column("last_run_id", String(TASK_ID_LENGTH), nullable=True),
        Column("fired", Integer, nullable=False, server_default="0"),
        Column("skipped", Integer, nullable=False, server_default="0"),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("updated_at", DateTime(timezone=True), nullable=False),
    )
    # A firing pass asks for the rows due first.
    Index(f"{prefix}schedules_due", table.c.next_fire_at)
    return table
