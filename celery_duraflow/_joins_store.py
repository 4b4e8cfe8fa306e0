"""The statements of fan-out joins: a parent's children started at one step, and their end.

``children()`` starts N child runs at one step of a parent. Each child's row names
its parent (``parent_id``) and the parent's step (``join_key``); their ids are
derived from the two and the child's place, so a replay inserts nothing twice. The
parent waits (``wait_kind = 'children'``, ``waiting_for`` its step key) until no
child of the join is still open.

Who wakes the parent: the child whose end leaves no sibling open. Each child's
end commits before its waker asks, so of two children ending at once the later
question sees both ends, and one of them wakes the parent. A parent that suspends
locks its open children (shared) first, as a single child's wait does: an end that
lands then is either seen by the suspension or commits after it, when its waker
finds the parent waiting. A waker that dies in between leaves the parent to the
sweep's periodic look at waiting parents (:meth:`JoinStatements.parents_of_ended_joins`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, exists, func, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from ._db import Database
from ._records import RUNNING, WAITING, RunRecord, utc_now
from ._schema import V15_UNFINISHED

#: Children inserted per statement when a join starts (each row has a dozen values).
INSERT_CHUNK = 500


@dataclass(frozen=True)
class NewChild:
    """A child run to record before its message is sent."""

    task_id: str
    task_name: str
    args: str | None
    exchange: str | None = None
    routing_key: str | None = None
    priority: int | None = None


@dataclass(frozen=True)
class JoinChild:
    """What a join reads of one of its children."""

    task_id: str
    status: str
    attempts: int
    result: str | None
    serializer: str | None
    error: str | None


class JoinStatements(Database):
    """Start a join's children, suspend on the join, wake the parent at its end."""

    def join_is_open(self, parent_id: Any, join_key: Any) -> ColumnElement[bool]:
        """The condition that some child of the join is still open: one probe of the
        index of open joins (whose predicate it names, values written out)."""
        child = self.tables.runs.alias("sibling")
        return exists().where(child.c.parent_id == parent_id, child.c.join_key == join_key,
                              child.c.join_key.is_not(None),
                              child.c.status.in_(V15_UNFINISHED))

    def create_join_children(self, parent_id: str, join_key: str,
                             children: Sequence[NewChild]) -> list[str]:
        """Record a join's children before their messages are sent; the ids inserted now
        (a child recorded already, by an earlier attempt, is left as it is).

        Each row is running, with no owner and an expiry one lease away, as
        :meth:`create_child_run` leaves a single child: if its message is never
        sent (the parent died first) or is lost, the sweep sends it from its row.
        """
        runs = self.tables.runs
        inserted: list[str] = []
        for start in range(0, len(children), INSERT_CHUNK):
            now = utc_now()
            expires = now + timedelta(seconds=self.config.lease_seconds)
            rows = [{"task_id": c.task_id, "task_name": c.task_name, "status": RUNNING,
                     "attempts": 0, "created_at": now, "updated_at": now, "args": c.args,
                     "exchange": c.exchange, "routing_key": c.routing_key,
                     "priority": c.priority, "retries": 0, "recoveries": 0,
                     "interrupted": False, "parent_id": parent_id, "join_key": join_key,
                     "lease_expires_at": expires}
                    for c in children[start:start + INSERT_CHUNK]]
            stmt = (self._insert(runs).values(rows)
                    .on_conflict_do_nothing(index_elements=[runs.c.task_id])
                    .returning(runs.c.task_id))
            with self._write("recording the children of a join", parent_id, join_key) as conn:
                inserted.extend(str(task_id) for task_id in conn.execute(stmt).scalars())
        return inserted

    def join_children(self, parent_id: str, join_key: str) -> dict[str, JoinChild]:
        """Every child of the join, by task id: its status and, once ended, its outcome."""
        runs = self.tables.runs
        stmt = (select(runs.c.task_id, runs.c.status, runs.c.attempts, runs.c.result,
                       runs.c.serializer, runs.c.error)
                .where(runs.c.parent_id == parent_id, runs.c.parent_id.is_not(None),
                       runs.c.join_key == join_key))
        with self._read("reading the children of a join", parent_id, join_key) as conn:
            return {str(row.task_id): JoinChild(
                        task_id=str(row.task_id), status=row.status, attempts=int(row.attempts),
                        result=row.result, serializer=row.serializer, error=row.error)
                    for row in conn.execute(stmt)}

    def join_progress(self, parent_id: str) -> dict[str, dict[str, int]]:
        """The joins of a run: by step key, how many of its children are in each status."""
        runs = self.tables.runs
        stmt = (select(runs.c.join_key, runs.c.status, func.count())
                .where(runs.c.parent_id == parent_id, runs.c.parent_id.is_not(None),
                       runs.c.join_key.is_not(None))
                .group_by(runs.c.join_key, runs.c.status))
        progress: dict[str, dict[str, int]] = {}
        with self._read("counting the children of the run's joins", parent_id) as conn:
            for key, status, count in conn.execute(stmt):
                progress.setdefault(str(key), {})[str(status)] = int(count)
        return progress

    def lock_open_children(self, conn: Connection, parent_id: str, join_key: str) -> None:
        """Lock the join's open children (shared) until the transaction ends, for a
        suspension on the join (SQLite's write lock does already)."""
        if self.dialect == "postgresql":
            runs = self.tables.runs
            conn.execute(select(runs.c.task_id)
                         .where(runs.c.parent_id == parent_id, runs.c.join_key == join_key,
                                runs.c.join_key.is_not(None), runs.c.status.in_(V15_UNFINISHED))
                         .with_for_update(read=True))

    def wake_join(self, parent_id: str, join_key: str, *, grace: float) -> RunRecord | None:
        """Make the parent runnable again if it waits on this join and no child of the join
        is open any more; None if it does not (another child is open, or it is not
        waiting there). Like :meth:`wake`, the woken run is running with no owner and a
        short expiry until its delivery takes it.
        """
        runs = self.tables.runs
        now = utc_now()
        stmt = (update(runs)
                .where(runs.c.task_id == parent_id, runs.c.status == WAITING,
                       runs.c.wait_kind == "children", runs.c.waiting_for == join_key,
                       ~self.join_is_open(parent_id, join_key))
                .values(status=RUNNING, lease_owner=None,
                        lease_expires_at=now + timedelta(seconds=grace), updated_at=now,
                        wait_kind=None, waiting_for=None, wake_at=None)
                .returning(*runs.c))
        with self._write("waking the parent of a join", parent_id, join_key) as conn:
            row = conn.execute(stmt).first()
        return RunRecord.from_row(row) if row is not None else None

    def parents_of_ended_joins(self, limit: int) -> Any:
        """The sweep's look at parents waiting on a join none of whose children is open
        (their last child's waker died): a subquery of runs, through the index of the
        parents waiting on a join."""
        runs = self.tables.runs
        waiting = and_(runs.c.status == WAITING, runs.c.wait_kind == "children")
        return (select(runs)
                .where(waiting, runs.c.pruned_at.is_(None),
                       ~self.join_is_open(runs.c.task_id, runs.c.waiting_for))
                .order_by(runs.c.lease_expires_at).limit(limit).subquery())
