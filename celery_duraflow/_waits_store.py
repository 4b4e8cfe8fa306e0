"""The statements of waits: suspending a run, waking it, signals and child runs.

A wait is a step row in status ``waiting``; the run row says what it waits for
(``wait_kind``, ``waiting_for``, ``wake_at``). Suspending checks, in the statement
that suspends, for a signal or a child's end that arrived meanwhile. A signal wait
locks the run's row first, and storing a signal locks the same row and wakes the run
waiting for it in the same transaction: a signal that lands while the run suspends
either is seen by the suspension or finds the run waiting, and a sender that dies
after storing it leaves a run the sweep finds due (running, no owner, a short
expiry). A child wait locks the child's row (shared) first, which a child's end
writes, so the end either is seen by the suspension or commits after it and its
waker finds the parent waiting; a parent whose waker died in between is found by
the sweep's periodic look at waiting parents.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import exists, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from ._db import Database
from ._records import (
    FINISHED,
    RUNNING,
    STEP_FAILED,
    STEP_WAITING,
    WAITING,
    RunRecord,
    RunStatus,
    SignalRecord,
    WaitKind,
    from_columns,
    utc_now,
)


class WaitStatements(Database):
    """Suspend and wake runs; store and read signals; record child runs."""

    if TYPE_CHECKING:  # the join statements, which a Store has too (see _joins_store)
        def join_is_open(self, parent_id: Any, join_key: Any) -> ColumnElement[bool]: ...

        def lock_open_children(self, conn: Connection, parent_id: str,
                               join_key: str) -> None: ...

    def suspend(self, task_id: str, owner: str, *, status: RunStatus, kind: WaitKind,
                waiting_for: str, wake_at: datetime | None, sweep_at: datetime | None) -> bool:
        """End this attempt without ending the run: it sleeps or waits, holding no lease.

        The sweep sends the run again at ``sweep_at`` (None: never by time).
        A signal wait is not suspended if its signal is already stored, nor a
        child wait if the child already finished, nor a wait on a join if none of
        its children is open (checked in the statement that suspends). For a
        signal wait the run's row is locked first, as :meth:`put_signal` locks
        it, so a signal stored at the same moment either
        is seen here or finds the run waiting and wakes it. For a child wait the
        child's row is locked (shared) first, and a child's end writes that row:
        an end that lands at that moment either is seen here or commits after the
        suspension, and the waker that follows it finds the run waiting. (A waker
        that dies between the child's end and the wake leaves the parent to the
        sweep's look at waiting parents, :meth:`recoverable_runs`.) False means
        the run was not suspended (that, or this owner lost the lease).
        """
        runs = self.tables.runs
        signals = self.tables.signals
        child = runs.alias("child")
        condition = [runs.c.task_id == task_id, runs.c.lease_owner == owner]
        if kind == "signal":
            condition.append(~exists().where(signals.c.task_id == task_id,
                                             signals.c.name == waiting_for))
        elif kind == "child":
            condition.append(~exists().where(child.c.task_id == waiting_for,
                                             child.c.status.in_(FINISHED)))
        elif kind == "children":
            condition.append(self.join_is_open(task_id, waiting_for))
        action = f"recording that the run is {status}"

        def suspended(conn: Connection) -> bool:
            return bool(conn.execute(
                update(runs)
                .where(*condition)
                .values(status=status, wait_kind=kind, waiting_for=waiting_for,
                        wake_at=wake_at, lease_owner=None, lease_expires_at=sweep_at,
                        updated_at=utc_now(), interrupted=False)).rowcount)

        if kind not in ("signal", "child", "children"):
            with self._write(action, task_id) as conn:
                return suspended(conn)
        with self.transaction(action, task_id) as conn:
            if kind == "children":
                # As for one child, each open child of the join (see _joins_store).
                self.lock_open_children(conn, task_id, waiting_for)
            elif kind == "signal":
                # The row first: a signal being stored now holds it until it commits, and
                # the check, a statement of its own, then sees that signal (put_signal).
                self._lock_run(conn, task_id)
            else:
                # The child's row, shared: an end being written now holds it until it
                # commits, and the check then sees that end; an end written after this
                # waits for the suspension to commit, so its waker finds the run waiting.
                self._lock_run(conn, waiting_for, share=True)
            return suspended(conn)

    def _lock_run(self, conn: Connection, task_id: str, *, share: bool = False) -> None:
        """Lock a run's row until the transaction ends (SQLite's write lock does already):
        for update, or ``share``d (other locks that share it still go on, writes wait)."""
        if self.dialect == "postgresql":
            runs = self.tables.runs
            conn.execute(select(runs.c.task_id).where(runs.c.task_id == task_id)
                         .with_for_update(read=share))

    def wake(self, task_id: str, *, kind: WaitKind, waiting_for: str,
             grace: float) -> RunRecord | None:
        """Make a run that waits for exactly this runnable again; None if it does not.

        The caller then sends the run. Until the delivery takes it, the run is
        running with no owner and a short expiry, so if the message is lost
        the sweep sends it again.
        """
        with self._write("waking the run", task_id) as conn:
            return self._wake(conn, task_id, kind, waiting_for, grace)

    def _wake(self, conn: Connection, task_id: str, kind: WaitKind, waiting_for: str,
              grace: float) -> RunRecord | None:
        runs = self.tables.runs
        now = utc_now()
        row = conn.execute(
            update(runs)
            .where(runs.c.task_id == task_id, runs.c.status == WAITING,
                   runs.c.wait_kind == kind, runs.c.waiting_for == waiting_for)
            .values(status=RUNNING, lease_owner=None,
                    lease_expires_at=now + timedelta(seconds=grace), updated_at=now,
                    wait_kind=None, waiting_for=None, wake_at=None)
            .returning(*runs.c)).first()
        return RunRecord.from_row(row) if row is not None else None

    def put_signal(self, task_id: str, name: str, payload: str | None, serializer: str | None,
                   *, grace: float) -> tuple[bool, RunRecord | None]:
        """Store a signal unless one of that name is stored already, and wake the run if it
        waits for it, in one transaction: whether this one was stored, and the run woken
        (for the caller to send), if any.

        The woken run is running with no owner and an expiry ``grace`` seconds
        away, as :meth:`wake` leaves it: if the caller dies before sending it, the
        sweep sends it once that expiry passes. The run's row is locked first, as
        :meth:`suspend` locks it, so a suspension at the same moment either sees
        the signal or is seen here.
        """
        signals = self.tables.signals
        stmt = (
            self._insert(signals)
            .values(task_id=task_id, name=name, payload=payload, serializer=serializer,
                    sent_at=utc_now())
            .on_conflict_do_nothing(index_elements=[signals.c.task_id, signals.c.name])
            .returning(signals.c.task_id)
        )
        with self.transaction("storing a signal", task_id, name) as conn:
            self._lock_run(conn, task_id)
            stored = conn.execute(stmt).first() is not None
            return stored, self._wake(conn, task_id, "signal", name, grace)

    def get_signal(self, task_id: str, name: str) -> SignalRecord | None:
        signals = self.tables.signals
        stmt = select(signals).where(signals.c.task_id == task_id, signals.c.name == name)
        with self._read("reading a signal", task_id, name) as conn:
            row = conn.execute(stmt).first()
        return from_columns(SignalRecord, row._mapping) if row is not None else None

    def list_signals(self, task_id: str) -> list[SignalRecord]:
        """Every signal stored for the run, oldest first."""
        signals = self.tables.signals
        stmt = (select(signals).where(signals.c.task_id == task_id)
                .order_by(signals.c.sent_at, signals.c.name))
        with self._read("reading the run's signals", task_id) as conn:
            return [from_columns(SignalRecord, row._mapping) for row in conn.execute(stmt)]

    def create_child_run(self, child_id: str, *, task_name: str, parent_id: str,
                         args: str | None, exchange: str | None,
                         routing_key: str | None, priority: int | None = None) -> bool:
        """Record a child run before its message is sent; False if it exists already.

        The row is running, with no owner and an expiry one lease away: if the
        message never arrives (the parent died before sending it, or the
        broker lost it), the sweep sends the child from what is stored here.
        """
        runs = self.tables.runs
        now = utc_now()
        stmt = (
            self._insert(runs)
            .values(task_id=child_id, task_name=task_name, status=RUNNING, attempts=0,
                    created_at=now, updated_at=now, args=args, exchange=exchange,
                    routing_key=routing_key, priority=priority, retries=0, recoveries=0,
                    interrupted=False, parent_id=parent_id,
                    lease_expires_at=now + timedelta(seconds=self.config.lease_seconds))
            .on_conflict_do_nothing(index_elements=[runs.c.task_id])
            .returning(runs.c.task_id)
        )
        with self._write("recording a child run", parent_id) as conn:
            return conn.execute(stmt).first() is not None

    def close_waits(self, task_id: str, owner: str, why: str) -> int:
        """Mark the waits a run left unended as failed (it ended without them)."""
        steps, runs = self.tables.steps, self.tables.runs
        stmt = (
            update(steps)
            .where(steps.c.task_id == task_id, steps.c.status == STEP_WAITING,
                   exists().where(runs.c.task_id == task_id, runs.c.lease_owner == owner))
            .values(status=STEP_FAILED, error=why, completed_at=utc_now())
        )
        with self._write("closing the run's waits", task_id) as conn:
            return int(conn.execute(stmt).rowcount or 0)
