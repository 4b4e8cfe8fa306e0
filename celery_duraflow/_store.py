"""The statements of runs, steps, waits and signals that workers issue.

One :class:`Store` per (database URL, table prefix, engine options) and
process. The store layer is this module, :mod:`._db` (the engine and its
connections), :mod:`._records` (what a row is) and :mod:`._admin` (the
statements an operator issues); nothing outside it writes SQL.

Single-row writes on PostgreSQL run in autocommit, so each one costs one round
trip and one commit; there is no BEGIN/COMMIT pair around them.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    and_,
    bindparam,
    case,
    exists,
    func,
    literal,
    literal_column,
    null,
    or_,
    select,
    true,
    union_all,
    update,
)

from ._config import Config
from ._db import DUPLICATE_KEY, LIKE_ESCAPE, Prepared, like_literal
from ._flow_store import FlowStatements
from ._joins_store import JoinStatements
from ._lease import machine_id
from ._records import (
    BODY_BREAK,
    BODY_CONTINUE,
    BODY_FATAL,
    BODY_RETURN,
    CANCELLED,
    COMPENSATED,
    FAILED,
    FINISHED,
    IGNORED,
    NOT_RERUN,
    REJECTED,
    REPLACED,
    RUN_STATUSES,
    RUNNING,
    SLEEPING,
    STEP_COMPLETED,
    STEP_FAILED,
    STEP_RUNNING,
    STEP_WAITING,
    SUCCEEDED,
    WAITING,
    BodyExit,
    Delivery,
    RunRecord,
    RunStatus,
    SignalRecord,
    StepRecord,
    StepStatus,
    WaitKind,
    as_utc,
    reader,
    utc_now,
)
from ._schedules_store import ScheduleStatements
from ._waits_store import WaitStatements

#: The longest the sweep waits, in leases, before it sends again a run whose message was
#: sent and not taken (see :meth:`Store.mark_recovering`).
UNTAKEN_RESEND_LEASES = 10

logger = logging.getLogger("celery_duraflow.store")

# The store's API, and the record types and vocabulary it speaks (from _records).
__all__ = [
    "BODY_BREAK",
    "BODY_CONTINUE",
    "BODY_FATAL",
    "BODY_RETURN",
    "CANCELLED",
    "COMPENSATED",
    "FAILED",
    "FINISHED",
    "IGNORED",
    "NOT_RERUN",
    "REJECTED",
    "REPLACED",
    "RUNNING",
    "RUN_STATUSES",
    "SLEEPING",
    "STEP_COMPLETED",
    "STEP_FAILED",
    "STEP_RUNNING",
    "STEP_WAITING",
    "SUCCEEDED",
    "WAITING",
    "BodyExit",
    "Delivery",
    "RunRecord",
    "RunStatus",
    "SignalRecord",
    "StepRecord",
    "StepStatus",
    "Store",
    "WaitKind",
    "all_stores",
    "close_all_stores",
    "discard_store",
    "store_for",
]


class Store(WaitStatements, JoinStatements, FlowStatements, ScheduleStatements):
    """The statements an attempt, a wait and the sweep issue, for one configuration.

    The engine, connections, schema and error mapping are :class:`Database`'s.
    """

    # -- runs ----------------------------------------------------------------------------

    def begin_attempt(self, task_id: str,
                      delivery: Delivery) -> tuple[RunRecord, dict[str, StepRecord] | None]:
        """Record an attempt and take the run's lease, and load its steps, in one go.

        The run's row is always returned; the caller compares ``lease_owner``
        with its own identity to learn whether it got the lease. A run that
        already succeeded, a pruned run's tombstone, a run leased to a live
        owner, and a run recorded with other arguments or under another task
        name are returned unchanged, and its steps are ``None``. When the lease
        was taken the run's recorded steps come with it: on PostgreSQL in the
        same statement (a data-modifying CTE joined to the steps), on SQLite in
        the same transaction.

        On PostgreSQL a first delivery (``delivery.first``) starts with a plain
        insert of the run's row that does nothing where the row exists: a new
        run, by far the most common start, costs one insert, the least a start
        can cost. Only where the row was there all the same (a duplicate
        message, a redelivery the broker did not flag) does the general
        statement follow, one round trip later; the library marks the messages
        it sends for recorded runs, which are not first deliveries.
        """
        params = self._attempt_params(task_id, delivery)
        if (self.modifying_ctes and delivery.first and self.write_prepared(
                self._attempt_statements["first"], params, "starting an attempt",
                task_id).rowcount):
            return self._new_run(task_id, delivery, params), {}
        return self._begin(task_id, delivery, params)

    def begin_holding(self, task_id: str, delivery: Delivery, *, scope: str, key: str,
                      limit: int) -> tuple[RunRecord, dict[str, StepRecord] | None, bool]:
        """:meth:`begin_attempt` for a task with one concurrency limit, and whether the
        attempt holds a slot of ``scope``/``key`` already.

        On PostgreSQL a first delivery's insert of the run's row takes a free
        slot in the same statement, where one is free and nobody waits for the
        key: a limit that does not bind costs a limited run no write, no round
        trip and no commit of its own. Otherwise (no slot free, runs queued, a
        row already there, SQLite) nothing is taken here, and the slot is asked
        for as usual (:meth:`acquire_slot`) before the body runs.
        """
        if not (self.modifying_ctes and delivery.first):
            return *self.begin_attempt(task_id, delivery), False
        params = self._attempt_params(task_id, delivery)
        params.update(p_scope=scope, p_key=key, p_top=limit - 1,
                      p_start=self.slot_start(task_id, limit))
        started, slot = self.write_prepared(self._attempt_statements["first_slot"], params,
                                            "starting an attempt", task_id).rows[0]
        if started is not None and int(started):
            return self._new_run(task_id, delivery, params), {}, slot is not None
        return *self._begin(task_id, delivery, params), False

    def _attempt_params(self, task_id: str, delivery: Delivery) -> dict[str, Any]:
        now = utc_now()
        return {"p_task_id": task_id, "p_task_name": delivery.task_name,
                "p_lease_owner": delivery.owner, "p_updated_at": now,
                "p_lease_expires_at": now + timedelta(seconds=self.config.lease_seconds),
                "p_args": delivery.args, "p_args_fingerprint": delivery.args_fingerprint,
                "p_exchange": delivery.exchange, "p_routing_key": delivery.routing_key,
                "p_code_fingerprint": delivery.code_fingerprint,
                "p_retries": delivery.retries, "p_priority": delivery.priority}

    def _begin(self, task_id: str, delivery: Delivery, params: dict[str, Any]
               ) -> tuple[RunRecord, dict[str, StepRecord] | None]:
        """The general start of an attempt: see :meth:`begin_attempt`."""
        statements = self._attempt_statements
        if self.modifying_ctes:
            names, rows, _ = self.write_prepared(statements["begin"], params,
                                                 "starting an attempt", task_id)
        else:
            with self._write("starting an attempt", task_id) as conn:
                names, rows, _ = self.execute(conn, statements["begin"], params)
                if rows and rows[0][names.index("lease_owner")] == delivery.owner:
                    loaded = self.execute(conn, statements["steps"], {"p_task_id": task_id})
                    return (reader(RunRecord, names)(rows[0]),
                            self._steps_by_key(loaded.names, loaded.rows))
        if not rows:
            # Another delivery inserted the row after this statement's snapshot was
            # taken, so its upsert saw the row but its read of the current row did not.
            current = self.get_run(task_id, pruned=True)
            assert current is not None  # the upsert conflicted with it
            return current, None
        run = reader(RunRecord, names, aware=self.driver_statements)(rows[0])
        if run.lease_owner != delivery.owner:
            return run, None
        key = names.index("step_step_key")
        return run, self._steps_by_key(names, [row for row in rows if row[key] is not None],
                                       prefix="step_", aware=True)

    @staticmethod
    def _new_run(task_id: str, delivery: Delivery, params: dict[str, Any]) -> RunRecord:
        """The row the first delivery's insert wrote, as the insert wrote it.

        It has no steps: a step is only ever written under its run's lease (the
        record's insert checks the run's row in the same statement), and a run's
        row is only deleted together with its steps, in one transaction.
        """
        now = params["p_updated_at"]
        return RunRecord(
            task_id=task_id, task_name=delivery.task_name, status=RUNNING, attempts=1,
            result=None, serializer=None, error=None, created_at=now, updated_at=now,
            finished_at=None, lease_owner=delivery.owner,
            lease_expires_at=params["p_lease_expires_at"], args=delivery.args,
            args_fingerprint=delivery.args_fingerprint, exchange=delivery.exchange,
            routing_key=delivery.routing_key, retries=delivery.retries,
            code_fingerprint=delivery.code_fingerprint, priority=delivery.priority)

    @staticmethod
    def _steps_by_key(names: Sequence[str], rows: Sequence[Sequence[Any]],
                      prefix: str = "", aware: bool = False) -> dict[str, StepRecord]:
        read = reader(StepRecord, names, prefix, {"key": "step_key"}, aware)
        return {record.key: record for record in map(read, rows)}

    def _shared(self, name: str, build: Callable[[], Any]) -> Any:
        """Statements built once per table prefix and dialect, for every store of them:
        a process (a test suite) with many stores of one prefix builds them once."""
        key = (name, self.config.table_prefix, self.dialect, self.engine.dialect.driver)
        found = _SHARED_STATEMENTS.get(key)
        if found is None:
            found = _SHARED_STATEMENTS.setdefault(key, build())
        return found

    @functools.cached_property
    def _attempt_statements(self) -> dict[str, Prepared]:
        built: dict[str, Prepared] = self._shared("attempt", self._build_attempt_statements)
        return built

    def _build_attempt_statements(self) -> dict[str, Prepared]:
        """The start and finish of an attempt, built once with bound parameters.

        The start is an upsert of the run's row that takes the lease only where
        the run may be taken (``acquire``, written once, in the upsert's WHERE).
        Where it may not, the upsert changes nothing but still locks the row, and
        on PostgreSQL the same statement reads the row as it is now (a locking
        read, which sees the newest committed version) and joins the steps of a
        run it took.
        """
        runs, steps = self.tables.runs, self.tables.steps

        def param(name: str) -> Any:
            return bindparam(f"p_{name}", type_=runs.c[name].type)

        now = param("updated_at")
        insert_ = self._insert(runs).values(
            task_id=param("task_id"), task_name=param("task_name"), status=RUNNING,
            attempts=1, created_at=now, updated_at=now, lease_owner=param("lease_owner"),
            lease_expires_at=param("lease_expires_at"), args=param("args"),
            args_fingerprint=param("args_fingerprint"), exchange=param("exchange"),
            routing_key=param("routing_key"), code_fingerprint=param("code_fingerprint"),
            retries=param("retries"), recoveries=0, interrupted=False,
            priority=param("priority"))
        new = insert_.excluded
        acquire = and_(
            *[runs.c.status != status for status in NOT_RERUN],
            # A pruned run's tombstone is never run again: its steps are gone.
            runs.c.pruned_at.is_(None),
            runs.c.task_name == new.task_name,
            or_(new.args_fingerprint.is_(None), runs.c.args_fingerprint.is_(None),
                runs.c.args_fingerprint == new.args_fingerprint),
            or_(runs.c.lease_owner.is_(None), runs.c.lease_expires_at < new.updated_at,
                runs.c.lease_owner == new.lease_owner),
        )
        taken = self._lease_taken(lambda name: new[name])
        if self.modifying_ctes:
            upsert = insert_.on_conflict_do_update(
                index_elements=[runs.c.task_id], set_=taken, where=acquire)
        else:
            # SQLite: every column keeps its value unless the run may be taken, so the
            # upsert always returns the row, taken or not, in one statement (the long
            # text costs nothing here: compiled and parsed once, then cached).
            upsert = insert_.on_conflict_do_update(
                index_elements=[runs.c.task_id],
                set_={name: case((acquire, value), else_=runs.c[name])
                      for name, value in taken.items()})
        ordered = select(steps).where(steps.c.task_id == param("task_id")).order_by(
            *self._step_order)
        statements = {"finish": self.prepare(self._run_end(), raw=True),
                      "succeed": self.prepare(self._run_end(relaxed=True), raw=True)}
        if not self.modifying_ctes:
            statements.update(begin=self.prepare(upsert.returning(*runs.c)),
                              steps=self.prepare(ordered))
            return statements
        # Each part names its columns once, as briefly as it can, so that the statement
        # stays within the length psycopg keeps converted; and never as a table's *,
        # which a migration adding a column would widen under a prepared statement.
        names = [column.name for column in runs.c]
        attempt = upsert.returning(*map(literal_column, names)).cte("attempt")
        row = runs.alias("r")
        every: Any = literal_column("*")
        # Only where the upsert took nothing: the row it locked, as committed now.
        locked = (select(*[literal_column(f"r.{name}") for name in names])
                  .select_from(row)
                  .where(row.c.task_id == param("task_id"),
                                       ~select(literal_column("1")).select_from(attempt)
                                       .exists())
                  .with_for_update(read=True, key_share=True).cte("locked"))
        run = union_all(select(every).select_from(attempt),
                        select(every).select_from(locked)).subquery("run")
        step_row = steps.alias("s")
        begin = (
            select(literal_column("run.*"),
                   *[c.label(f"step_{c.name}") for c in step_row.c])
            # The steps are found by the task id itself, not through the run's row: a plan
            # made once for the prepared statement (while the steps table was still empty,
            # say) then looks them up in the table's key, however large it grows, instead
            # of scanning it.
            .select_from(run.join(step_row, and_(
                step_row.c.task_id == param("task_id"),
                literal_column("run.lease_owner") == param("lease_owner")), isouter=True))
            .order_by(step_row.c.started_at, step_row.c.position, step_row.c.step_key)
        )
        statements["begin"] = self.prepare(begin)
        # A first delivery's start: the run's row, inserted where there is none, and
        # nothing else (see begin_attempt). Its answer is a row count, so it runs on the
        # held connection's leanest path, like a step's record.
        statements["first"] = self.prepare(
            insert_.on_conflict_do_nothing(index_elements=[runs.c.task_id]), raw=True)
        # The same, with a concurrency slot taken for the new run (begin_holding).
        started = (insert_.on_conflict_do_nothing(index_elements=[runs.c.task_id])
                   .returning(literal_column("1").label("one")).cte("started"))
        slot = self.slot_with_start(started)
        statements["first_slot"] = self.prepare(select(
            select(func.count()).select_from(started).scalar_subquery().label("started"),
            select(slot.c.slot).scalar_subquery().label("slot")), raw=True)
        return statements

    def _lease_taken(self, new: Callable[[str], Any]) -> dict[str, Any]:
        """What taking a run's lease writes to its row, in the upsert that starts an
        attempt and in a take-over alike; ``new(column)`` is the value the attempt brings
        for that column."""
        runs = self.tables.runs
        return {
            "status": new("status"),
            "attempts": runs.c.attempts + literal_column("1"),
            # A run being unwound keeps the error that made it fail until it ends.
            "error": case((runs.c.unwinding.is_(None), null()), else_=runs.c.error),
            "finished_at": null(),
            "updated_at": new("updated_at"),
            "lease_owner": new("lease_owner"),
            "lease_expires_at": new("lease_expires_at"),
            "args": func.coalesce(runs.c.args, new("args")),
            "args_fingerprint": func.coalesce(runs.c.args_fingerprint, new("args_fingerprint")),
            "exchange": new("exchange"),
            "routing_key": new("routing_key"),
            "priority": new("priority"),
            # The code the run started under (a child run recorded by its parent has none).
            "code_fingerprint": func.coalesce(runs.c.code_fingerprint, new("code_fingerprint")),
            "retries": new("retries"),
            # A run that slept or waited is running again.
            "wait_kind": null(),
            "waiting_for": null(),
            "wake_at": null(),
            # Taking the run from another owner that never let go of it means that
            # owner died (or froze) mid-attempt.
            "interrupted": or_(runs.c.interrupted,
                               and_(runs.c.lease_owner.is_not(None),
                                    runs.c.lease_owner != new("lease_owner"))),
        }

    def take_over(self, task_id: str, dead_owner: str, delivery: Delivery) -> RunRecord | None:
        """Take the lease from an owner known to be dead; None if it changed meanwhile."""
        runs = self.tables.runs
        now = utc_now()
        brought = {"status": RUNNING, "updated_at": now, "lease_owner": delivery.owner,
                   "lease_expires_at": now + timedelta(seconds=self.config.lease_seconds),
                   "args": delivery.args, "args_fingerprint": delivery.args_fingerprint,
                   "exchange": delivery.exchange, "routing_key": delivery.routing_key,
                   "code_fingerprint": delivery.code_fingerprint, "retries": delivery.retries,
                   "priority": delivery.priority}
        stmt = (
            update(runs)
            .where(runs.c.task_id == task_id, runs.c.lease_owner == dead_owner,
                   runs.c.status.not_in(NOT_RERUN), runs.c.pruned_at.is_(None))
            .values(task_name=delivery.task_name, **self._lease_taken(
                lambda name: literal(brought[name], runs.c[name].type)))
            .returning(*runs.c)
        )
        with self._write("taking over the run of a dead worker", task_id) as conn:
            row = conn.execute(stmt).first()
        return RunRecord.from_row(row) if row is not None else None

    def _run_end(self, *, relaxed: bool = False) -> Any:
        """The update that records a run's end and drops its lease, where ``p_owner`` holds it
        (its parameters as :meth:`_end_params` names them).

        ``relaxed``: committed without waiting for the WAL flush, for a success (see
        :meth:`finish_run`).
        """
        runs = self.tables.runs

        def param(name: str) -> Any:
            return bindparam(f"p_{name}", type_=runs.c[name].type)

        now = param("updated_at")
        return (
            update(runs)
            .where(runs.c.task_id == param("task_id"),
                   runs.c.lease_owner == bindparam("p_owner", type_=runs.c.lease_owner.type),
                   runs.c.status != SUCCEEDED,
                   *([self._asynchronous_commit()] if relaxed else []))
            .values(status=param("status"), result=param("result"),
                    serializer=param("serializer"), error=param("error"), updated_at=now,
                    finished_at=now, lease_owner=None, lease_expires_at=None,
                    interrupted=False, unwinding=None)
        )

    @staticmethod
    def _end_params(task_id: str, owner: str, status: RunStatus, result: str | None,
                    serializer: str | None, error: str | None) -> dict[str, Any]:
        return {"p_task_id": task_id, "p_owner": owner, "p_status": status,
                "p_result": result, "p_serializer": serializer, "p_error": error,
                "p_updated_at": utc_now()}

    def finish_run(self, task_id: str, owner: str, status: RunStatus, *, result: str | None = None,
                   serializer: str | None = None, error: str | None = None) -> bool:
        """Record the end of a run and drop its lease; False if this owner lost the lease.

        A success commits without waiting for the WAL flush. A database crash may
        lose it (nothing else: any later durable commit flushes it too, so whatever
        was recorded after reading it keeps it); the run then looks running under
        a lease nobody renews, and once that lease ends it is taken over and
        replayed: every step is recorded (each step's record is durable), so no
        step body runs again, and the replay records the end once more. A failure
        waits for the flush: replaying it would run the failing code again.
        """
        params = self._end_params(task_id, owner, status, result, serializer, error)
        statement = self._attempt_statements["succeed" if status == SUCCEEDED else "finish"]
        return self.write_prepared(statement, params,
                                   f"recording the run as {status}", task_id).rowcount > 0

    def finish_freeing(self, task_id: str, owner: str, *, result: str | None,
                       serializer: str | None) -> tuple[bool, set[tuple[str, str]]]:
        """Record a run's success and free the concurrency slots its attempt took.

        On PostgreSQL one statement does both (see :meth:`FlowStatements.freeing`),
        so a limited run's end costs no more round trips or commits than an
        unlimited one's. Returns whether this owner still held the lease, and
        the keys that have runs queued for them (to be settled next).
        """
        if self.dialect != "postgresql":
            finished = self.finish_run(task_id, owner, SUCCEEDED, result=result,
                                       serializer=serializer)
            return finished, self._release_locally(task_id, owner)
        params = self._end_params(task_id, owner, SUCCEEDED, result, serializer, None)
        rows = self.write_prepared(self._finish_freeing, params,
                                   f"recording the run as {SUCCEEDED}", task_id).rows
        # Text on libpq's path, typed on psycopg's (through a pooler): int() reads both.
        finished = any(scope is None and int(count) for count, scope, _ in rows)
        return finished, {(scope, key) for _, scope, key in rows if scope is not None}

    @functools.cached_property
    def _finish_freeing(self) -> Prepared:
        return self.prepare(self.freeing(self._run_end(relaxed=True)), raw=True)

    def update_arguments(self, task_id: str, owner: str, args: str | None,
                         fingerprint: str | None) -> bool:
        """Record the arguments a retry of this run was asked to bring (``retry(args=...)``).

        Written under the lease of the attempt that asks for the retry, before the
        retry is sent, so the next delivery's arguments match the record and every
        delivery the run did not ask for (the old message, redelivered) still does
        not. False if this owner lost the lease.
        """
        runs, steps = self.tables.runs, self.tables.steps
        stmt = (
            update(runs)
            .where(runs.c.task_id == task_id, runs.c.lease_owner == owner)
            .values(args=args, args_fingerprint=fingerprint, updated_at=utc_now())
        )
        # With other arguments the next attempt is not a replay of the steps recorded so
        # far: they keep their outputs (a step the code reaches again under its key is
        # still answered from the record) but not their places in the order, which the
        # replay check compares only among steps recorded under the same arguments.
        unordered = (
            update(steps)
            .where(steps.c.task_id == task_id, steps.c.position.is_not(None))
            .values(position=None)
        )
        self.ensure_schema(task_id)
        with self._unavailable("recording the arguments of the retry", task_id), \
                self._transactional().begin() as conn:
            if not conn.execute(stmt).rowcount:
                return False
            conn.execute(unordered)
            return True

    def mark_replaced(self, celery_id: str, run_key: str, owner: str,
                      replaced_by: str) -> None:
        """Note, before a replacement is sent, where the replacement of ``celery_id`` runs.

        Celery gives a replacement the replaced task's id. The row of that id
        points to the replacement's run key from then on (only the first time:
        later replacements follow from their nesting), so a delivery of the
        replacement never takes the replaced run's steps.
        """
        runs = self.tables.runs
        mine = (runs.c.lease_owner == owner) if run_key == celery_id else true()
        stmt = (
            update(runs)
            .where(runs.c.task_id == celery_id, runs.c.replaced_by.is_(None), mine)
            .values(replaced_by=replaced_by, updated_at=utc_now())
        )
        with self._write("recording that the task was replaced", run_key) as conn:
            conn.execute(stmt)

    def end_lost_attempt(self, task_id: str, *, pid: int | None, status: RunStatus,
                         error: str) -> bool:
        """End, as Celery ended it, a run whose attempt the worker killed (a hard time
        limit) or lost (``WorkerLostError`` that Celery does not redeliver).

        Called by the worker's main process, which does not know the attempt's
        owner: the update only applies while the run is still ``running`` and
        leased by a process with that pid on this machine, so a later attempt
        elsewhere is never overruled. False if nothing matched.
        """
        runs = self.tables.runs
        held = runs.c.lease_owner.is_not(None)
        if pid is not None:
            held = runs.c.lease_owner.like(f"%|{like_literal(machine_id())}|{int(pid)}|%",
                                           escape=LIKE_ESCAPE)
        now = utc_now()
        stmt = (
            update(runs)
            .where(runs.c.task_id == task_id, runs.c.status == RUNNING, held,
                   runs.c.pruned_at.is_(None))
            .values(status=status, error=error[:4000], updated_at=now, finished_at=now,
                    lease_owner=None, lease_expires_at=None, interrupted=False)
        )
        with self._write(f"recording the run as {status}", task_id) as conn:
            return bool(conn.execute(stmt).rowcount)

    def begin_unwinding(self, task_id: str, owner: str, reason: str,
                        error: str | None) -> bool:
        """Record, before the first compensation runs, that this run is being unwound.

        An attempt that dies while compensating leaves this mark; the next
        attempt replays only up to the first unfinished step and goes on with
        the compensations (those already recorded are not run again).
        """
        runs = self.tables.runs
        stmt = (
            update(runs)
            .where(runs.c.task_id == task_id, runs.c.lease_owner == owner)
            .values(unwinding=reason, error=error, updated_at=utc_now())
        )
        with self._write("recording that the run is being unwound", task_id) as conn:
            return bool(conn.execute(stmt).rowcount)

    def release_lease(self, task_id: str, owner: str, *,
                      recover_after: float | None, interrupted: bool = False) -> bool:
        """Drop the lease of an attempt that ends without ending the run.

        With ``recover_after`` the run becomes recoverable by the sweep that
        many seconds from now if no delivery has picked it up by then (a
        retry's countdown plus a lease, say); with None it never does.
        ``interrupted`` leaves the run marked as taken from an owner that did
        not finish: the next attempt's first unfinished step is in doubt.
        """
        runs = self.tables.runs
        now = utc_now()
        expires = None if recover_after is None else now + timedelta(seconds=recover_after)
        stmt = (
            update(runs)
            .where(runs.c.task_id == task_id, runs.c.lease_owner == owner)
            .values(lease_owner=None, lease_expires_at=expires, updated_at=now,
                    interrupted=interrupted)
        )
        with self._write("releasing the run's lease", task_id) as conn:
            return bool(conn.execute(stmt).rowcount)

    def renew_leases(self, leases: list[tuple[str, str]]) -> dict[tuple[str, str], str | None]:
        """Extend the given (task id, owner) leases; return those still held, each with
        why its run is being unwound (``cancel``), if it is."""
        if not leases:
            return {}
        runs = self.tables.runs
        expires = utc_now() + timedelta(seconds=self.config.lease_seconds)
        stmt = (
            update(runs)
            .where(or_(*[and_(runs.c.task_id == task_id, runs.c.lease_owner == owner)
                         for task_id, owner in leases]))
            .values(lease_expires_at=expires)
            .returning(runs.c.task_id, runs.c.lease_owner, runs.c.unwinding)
        )
        with self._write("renewing run leases") as conn:
            return {(row[0], row[1]): row[2] for row in conn.execute(stmt)}

    def recoverable_runs(self, limit: int, *, arrivals: bool = True,
                         parents: bool = True) -> list[RunRecord]:
        """Runs that need a delivery and will not get one by themselves.

        Running runs whose lease expired (their owner died, or their retry
        never came, or a wake-up's message was lost); sleeping and waiting runs
        whose time is up; with ``parents``, waiting runs whose child ended
        without waking them (whoever ended it died before waking the parent);
        and, with ``arrivals``, every waiting run whose signal is stored. Oldest
        expiry first; never a pruned run's tombstone.

        The due runs are read through the lease index, at most ``limit`` per
        status, whatever the size of the table. ``parents`` reads every run that
        waits for a child, through their partial index: its cost grows with
        them, so a sweep asks for it now and then (see :mod:`._recovery`). A
        child's end that races with its parent's suspension needs no look (see
        :meth:`suspend`), nor does a stored signal: storing it wakes its run in
        the same transaction (:meth:`put_signal`). ``arrivals`` looks at every
        waiting run, for signals an older version stored without waking their
        run; a sweep asks for it on its first pass in a process only.
        """
        runs = self.tables.runs
        signals = self.tables.signals
        child = runs.alias("child")
        now = utc_now()
        # Due runs: one range of (status, lease_expires_at) per status, each stopping
        # after `limit` rows, so a pass reads only runs that are due. Due at the expiry
        # itself, as sleep() is: a test clock stopped at a wake-up time finds it due.
        due = [select(runs).where(runs.c.pruned_at.is_(None), runs.c.status == status,
                                  runs.c.lease_expires_at <= now)
               .order_by(runs.c.lease_expires_at).limit(limit).subquery()
               for status in (RUNNING, SLEEPING, WAITING)]
        # Parents whose child ended without waking them: through the partial index of the
        # runs waiting for a child (the query names its predicate's values).
        waiting_parents = (
            select(runs)
            .where(runs.c.status == WAITING, runs.c.wait_kind == "child",
                   runs.c.pruned_at.is_(None),
                   exists().where(child.c.task_id == runs.c.waiting_for,
                                  child.c.status.in_(FINISHED)))
            .order_by(runs.c.lease_expires_at).limit(limit).subquery()
        )
        # Waiting runs whose signal is stored: every waiting run is looked at.
        signalled = (
            select(runs)
            .where(runs.c.pruned_at.is_(None), runs.c.status == WAITING,
                   runs.c.wait_kind == "signal",
                   exists().where(signals.c.task_id == runs.c.task_id,
                                  signals.c.name == runs.c.waiting_for))
            .order_by(runs.c.lease_expires_at).limit(limit).subquery()
        )
        branches = [*due, *([waiting_parents, self.parents_of_ended_joins(limit)]
                            if parents else []),
                    *([signalled] if arrivals else [])]
        merged = union_all(*(select(branch) for branch in branches)).subquery("found")
        # A run both due and arrived comes once (UNION ALL keeps both copies).
        stmt = (select(merged).distinct()
                .order_by(merged.c.lease_expires_at, merged.c.task_id).limit(limit))
        with self._read("looking for runs to wake or recover") as conn:
            return [RunRecord.from_row(row) for row in conn.execute(stmt)]

    def next_due(self, until: datetime) -> datetime | None:
        """The earliest lease or wait expiry, no later than ``until``, of a run the sweep
        would find due once it passes (a sleeping, waiting or running run); None if none.

        For a test clock that moves time forward (``celery_duraflow.testing``): it
        stops at each such moment in turn, so runs wake in the order they are due.
        """
        runs = self.tables.runs
        stmt = (select(func.min(runs.c.lease_expires_at))
                .where(runs.c.pruned_at.is_(None),
                       runs.c.status.in_((RUNNING, SLEEPING, WAITING)),
                       runs.c.lease_expires_at <= until))
        with self._read("looking for the next run due") as conn:
            moment = conn.execute(stmt).scalar()
        return as_utc(moment) if isinstance(moment, datetime) else None

    def drop_tables(self) -> None:
        """Drop every table of this store's prefix, and close its connections.

        Only for a store made for one test (``celery_duraflow.testing``), on
        tables of a prefix of its own; nothing in the library drops tables.
        """
        self.close()
        with self._unavailable("dropping the tables of a test store"):
            self.tables.metadata.drop_all(self._transactional())
        self.close()

    def mark_recovering(self, run: RunRecord, grace: float) -> bool:
        """Claim the right to send a run found by the sweep; False if another sweeper (or a
        delivery, or a signal) got to it first."""
        return self.claim_to_send(run, grace) is not None

    def claim_to_send(self, run: RunRecord, grace: float) -> RunRecord | None:
        """:meth:`mark_recovering`, returning the row as claimed (None if not claimed).

        Send what this returns, not ``run``: a write that left the lease's expiry as it
        was (a debounced send capped by ``max_delay`` moves the run's arguments but not
        its fire time) may have changed the row since ``run`` was read.
        """
        runs = self.tables.runs
        now = utc_now()
        unchanged = (runs.c.lease_expires_at.is_(None) if run.lease_expires_at is None
                     else runs.c.lease_expires_at == run.lease_expires_at)
        # Only an attempt that took the run and then vanished counts as a lost attempt.
        # A run with no owner was sent (woken, handed a slot, re-sent) and its message
        # has not been taken yet: behind a backlog, or lost by the broker. Sending it
        # again is right, but no attempt of it died, so no recovery is spent.
        lost = run.status == RUNNING and run.lease_owner is not None
        wait = grace
        if run.status == RUNNING and not lost:
            # Each send of a message nobody has taken waits twice as long as the one
            # before it for the message to be taken, up to UNTAKEN_RESEND_LEASES leases: a
            # long backlog, or a queue no worker reads, gets a few copies, not one a lease.
            since = (now - (as_utc(run.updated_at) or now)).total_seconds()
            wait = max(grace, min(2 * since, UNTAKEN_RESEND_LEASES * grace))
        stmt = (
            update(runs)
            .where(runs.c.task_id == run.task_id, runs.c.status == run.status, unchanged)
            # No owner, so the re-sent delivery can take the run at once; an expiry, so
            # that no other sweep sends it again before that delivery had its chance.
            .values(status=RUNNING, lease_owner=None,
                    lease_expires_at=now + timedelta(seconds=wait),
                    recoveries=runs.c.recoveries + (1 if lost else 0), updated_at=now,
                    interrupted=or_(runs.c.interrupted, runs.c.lease_owner.is_not(None)),
                    wait_kind=None, waiting_for=None, wake_at=None)
            .returning(*runs.c)
        )
        with self._write("marking a run to be sent again", run.task_id) as conn:
            row = conn.execute(stmt).first()
        return RunRecord.from_row(row) if row is not None else None

    def fail_unsendable(self, run: RunRecord, reason: str) -> bool:
        """End, as failed with ``reason``, a run found by the sweep that cannot be sent.

        Fenced like :meth:`mark_recovering`: only if the row is still exactly
        as the sweep read it (same status, attempts and lease), so a delivery
        or another sweeper that got to the run first is never overruled.
        False if it changed.
        """
        runs = self.tables.runs
        now = utc_now()
        same_lease = (runs.c.lease_expires_at.is_(None) if run.lease_expires_at is None
                      else runs.c.lease_expires_at == run.lease_expires_at)
        same_owner = (runs.c.lease_owner.is_(None) if run.lease_owner is None
                      else runs.c.lease_owner == run.lease_owner)
        stmt = (
            update(runs)
            .where(runs.c.task_id == run.task_id, runs.c.status == run.status,
                   runs.c.attempts == run.attempts, same_lease, same_owner,
                   runs.c.pruned_at.is_(None))
            .values(status=FAILED, error=reason[:4000], updated_at=now, finished_at=now,
                    lease_owner=None, lease_expires_at=None, interrupted=False,
                    wait_kind=None, waiting_for=None, wake_at=None, unwinding=None)
        )
        with self._write("recording that the run cannot be sent", run.task_id) as conn:
            return bool(conn.execute(stmt).rowcount)

    def get_run(self, task_id: str, *, pruned: bool = False) -> RunRecord | None:
        """The run's row; None if there is none, or only the tombstone prune left
        (unless ``pruned``: then the tombstone too)."""
        runs = self.tables.runs
        query = select(runs).where(runs.c.task_id == task_id)
        if not pruned:
            query = query.where(runs.c.pruned_at.is_(None))
        with self._read("reading a run", task_id) as conn:
            row = conn.execute(query).first()
        return RunRecord.from_row(row) if row is not None else None

    # -- steps ---------------------------------------------------------------------------

    def _asynchronous_commit(self) -> Any:
        """A condition (always true) that turns off synchronous commit for its statement.

        Used for writes whose loss in a *database* crash costs time and nothing
        else (a run's success, a slot freed apart from the run's end): the
        write still commits and is visible at once; only the wait for the WAL
        flush is skipped, which is most of a commit's cost. Never for a step's
        claim: that must survive a crash, or an at-most-once step's body would
        run again. ``set_config(..., true)`` lasts until the end of the
        statement's own transaction, so the session keeps its setting.
        """
        if not self.asynchronous_commit:
            return true()
        return select(
            func.set_config("synchronous_commit", "off", true())
        ).scalar_subquery().is_not(None)

    def load_steps(self, task_id: str) -> dict[str, StepRecord]:
        """Every recorded step of a run, by key, in one query."""
        steps = self.tables.steps
        stmt = select(steps).where(steps.c.task_id == task_id).order_by(*self._step_order)
        with self._read("loading the recorded steps", task_id) as conn:
            rows = conn.execute(stmt).all()
        return {record.key: record for record in map(StepRecord.from_row, rows)}

    def get_step(self, task_id: str, step_key: str) -> StepRecord | None:
        steps = self.tables.steps
        stmt = select(steps).where(steps.c.task_id == task_id, steps.c.step_key == step_key)
        with self._read("reading a step", task_id, step_key) as conn:
            row = conn.execute(stmt).first()
        return StepRecord.from_row(row) if row is not None else None

    @property
    def _step_order(self) -> tuple[Any, ...]:
        steps = self.tables.steps
        # started_at is a step's first start; position breaks ties between steps started
        # within one clock tick (rows from before version 5 have none).
        return (steps.c.started_at, steps.c.position, steps.c.step_key)

    @functools.cached_property
    def _step_statements(self) -> dict[str, Any]:
        built: dict[str, Any] = self._shared("steps", self._build_step_statements)
        return built

    def _build_step_statements(self) -> dict[str, Any]:
        """The per-step statements, built once with bound parameters.

        Building their expression trees anew for every step would cost more
        Python time than the database spends on them.
        """
        steps = self.tables.steps
        runs = self.tables.runs
        fence = exists().where(runs.c.task_id == bindparam("p_task_id"),
                               runs.c.lease_owner == bindparam("p_owner"))

        def from_params(columns: list[str], condition: Any) -> Any:
            # INSERT ... SELECT <bound values> WHERE <condition>: the insert only happens
            # while the condition (the lease) holds. A first attempt's count is always 1.
            values = [literal(1, steps.c.attempts.type) if name == "attempts"
                      else bindparam(f"p_{name}", type_=steps.c[name].type)
                      for name in columns]
            return self._insert(steps).from_select(columns, select(*values).where(condition))

        statements: dict[str, Any] = {
            "claim_new": (
                # Durable before the body runs (the commit waits for the WAL flush): a claim
                # lost in a crash would make the step look never started, and the body of
                # a step that must not run twice would run again, not in doubt.
                from_params(["task_id", "step_key", "status", "attempts", "started_at",
                             "position"], fence)
                .on_conflict_do_nothing(index_elements=[steps.c.task_id, steps.c.step_key])
                .returning(*steps.c)
            ),
            "claim_again": (
                update(steps)
                .where(steps.c.task_id == bindparam("p_task_id"),
                       steps.c.step_key == bindparam("p_step_key"),
                       steps.c.status == bindparam("p_prior_status"),
                       steps.c.attempts == bindparam("p_prior_attempts"), fence)
                .values(status=STEP_RUNNING, attempts=bindparam("p_attempts"),
                        completed_at=None, error=None, position=bindparam("p_position"))
                .returning(*steps.c)
            ),
        }
        # An atomic step's fence, inside its transaction just before its record: the run's
        # row is locked until the commit, and its lease pushed forward, so a take-over
        # waiting on the lock finds the lease held and the step recorded (see fence_atomic).
        statements["fence"] = (
            update(runs)
            .where(runs.c.task_id == bindparam("p_task_id"),
                   runs.c.lease_owner == bindparam("p_owner"))
            .values(lease_expires_at=bindparam("p_lease_expires_at",
                                               type_=runs.c.lease_expires_at.type))
        )
        ended = ["task_id", "step_key", "status", "attempts", "output", "serializer",
                 "started_at", "completed_at", "position", "input_fingerprint",
                 "code_fingerprint", "body_exit", "returned"]
        # A step with no row yet (every step of a first attempt) is one plain insert; the
        # upsert is only needed where a failed or claimed row exists. On PostgreSQL it has
        # no ON CONFLICT clause: a row that appeared meanwhile is a duplicate-key error
        # (record_step's False), and the common case writes no speculative-insertion
        # record to the WAL. Elsewhere a conflict inserts nothing and RETURNING tells.
        insert_new = from_params(ended, fence)
        statements["record_new"] = (
            insert_new if self.insert_rowcount else insert_new.on_conflict_do_nothing(
                index_elements=[steps.c.task_id, steps.c.step_key]).returning(steps.c.task_id))
        relaxed = and_(fence, self._asynchronous_commit())
        for name, condition in (("record", fence), ("record_relaxed", relaxed)):
            insert_ = from_params([*ended, "error"], condition)
            excluded = insert_.excluded
            statements[name] = insert_.on_conflict_do_update(
                index_elements=[steps.c.task_id, steps.c.step_key],
                set_={
                    "status": excluded.status,
                    "attempts": steps.c.attempts + bindparam("p_increment"),
                    "output": excluded.output,
                    "serializer": excluded.serializer,
                    "error": excluded.error,
                    # started_at keeps the first start: steps are listed in that order.
                    "completed_at": excluded.completed_at,
                    "position": excluded.position,
                    "input_fingerprint": excluded.input_fingerprint,
                    "code_fingerprint": excluded.code_fingerprint,
                    "body_exit": excluded.body_exit,
                    "returned": excluded.returned,
                },
                # A completed step is final: nothing overwrites it.
                where=steps.c.status != STEP_COMPLETED,
            ).returning(steps.c.task_id)
        return statements

    @functools.cached_property
    def _prepared_records(self) -> dict[str, Prepared]:
        built: dict[str, Prepared] = self._shared("records", self._build_prepared_records)
        return built

    def _build_prepared_records(self) -> dict[str, Prepared]:
        """The step-end statements, prepared once (see :meth:`Database.prepare`)."""
        return {name: self.prepare(self._step_statements[name], raw=True)
                for name in ("record_new", "record", "record_relaxed")}

    def claim_step(self, task_id: str, step_key: str, owner: str,
                   prior: StepRecord | None, *, position: int | None = None) -> StepRecord | None:
        """Record that a step's body is about to run, if this owner holds the run.

        Only steps that must be able to tell afterwards that they were
        interrupted (``on_in_doubt="raise"``) pay for this. With no earlier row
        it is the essay's ``INSERT ... ON CONFLICT DO NOTHING RETURNING``; a
        failed row is re-claimed only if it is still exactly as this attempt saw
        it. ``None`` means the row changed meanwhile or the lease is gone.
        """
        statements = self._step_statements
        params: dict[str, Any] = {"p_task_id": task_id, "p_owner": owner, "p_step_key": step_key,
                                  "p_position": position}
        if prior is None:
            stmt = statements["claim_new"]
            params.update(p_status=STEP_RUNNING, p_started_at=utc_now())
        else:
            stmt = statements["claim_again"]
            params.update(p_prior_status=prior.status,
                          p_prior_attempts=prior.attempts, p_attempts=prior.attempts + 1)
        with self._write("claiming the step", task_id, step_key) as conn:
            row = conn.execute(stmt, params).first()
        return StepRecord.from_row(row) if row is not None else None

    def fence_atomic(self, task_id: str, step_key: str, owner: str) -> bool:
        """Inside an atomic step's transaction: lock the run's row if ``owner`` still holds
        its lease, and extend the lease; False if it is gone.

        Nothing can take the run over between this and the commit: a take-over
        (or the sweep) waits for the row lock, then finds the lease extended and
        leaves the run alone; its next look sees the step's record.
        """
        params = {"p_task_id": task_id, "p_owner": owner,
                  "p_lease_expires_at": utc_now() + timedelta(seconds=self.config.lease_seconds)}
        with self._write("fencing the atomic step", task_id, step_key) as conn:
            return bool(conn.execute(self._step_statements["fence"], params).rowcount)

    def record_step(self, task_id: str, step_key: str, owner: str, *, status: StepStatus,
                    started_at: datetime, output: str | None = None,
                    serializer: str | None = None, error: str | None = None,
                    claimed: bool = False, new: bool = False,
                    position: int | None = None, input_fingerprint: str | None = None,
                    code_fingerprint: str | None = None, body_exit: str | None = None,
                    returned: str | None = None) -> bool:
        """Write how a step ended, in one statement, if this owner still holds the run.

        An upsert on ``(task_id, step_key)``: it creates the row, or updates a
        failed (or claimed) one, but never a completed one. False means the
        lease is gone or the step was completed by someone else. A completion (or a wait)
        commits durably; a failure is written with asynchronous commit, since
        losing it in a database crash only means the step runs again (but a fatal
        one, which must stop the body from running again, commits durably). ``new``
        says the attempt saw no row for the step: a completion is then a plain
        insert (on PostgreSQL without ON CONFLICT: a row that appeared meanwhile
        is a duplicate key, answered False), the cheapest durable write.
        """
        completed = status == STEP_COMPLETED
        durable = completed or status == STEP_WAITING or body_exit == BODY_FATAL
        params = {"p_task_id": task_id, "p_owner": owner, "p_step_key": step_key,
                  "p_status": status, "p_output": output, "p_serializer": serializer,
                  "p_error": error, "p_started_at": started_at,
                  "p_completed_at": utc_now() if completed else None, "p_position": position,
                  "p_input_fingerprint": input_fingerprint,
                  "p_code_fingerprint": code_fingerprint,
                  "p_body_exit": body_exit, "p_returned": returned,
                  # A claimed row already counted this attempt.
                  "p_increment": 0 if claimed else 1}
        # A new completion (or wait) is the plain insert; a fatal failure keeps its error.
        name = ("record_new" if new and not claimed and error is None else "record") if (
            durable) else "record_relaxed"
        try:
            done = self.write_prepared(self._prepared_records[name], params,
                                       _RECORDING.get(status, "recording the step failure"),
                                       task_id, step_key)
        except DUPLICATE_KEY:
            return False  # the row appeared since the attempt read the steps
        if self.insert_rowcount:  # PostgreSQL: the rows it wrote (RETURNING or not)
            return done.rowcount > 0
        return bool(done.rows)


# What a step record is doing, for the error when the store cannot be reached.
_RECORDING = {STEP_COMPLETED: "recording the step output", STEP_WAITING: "recording the wait"}

# Statements by (name, table prefix, dialect, driver): see Store._shared.
_SHARED_STATEMENTS: dict[tuple[str, str, str, str], Any] = {}
_stores: dict[tuple[Any, ...], Store] = {}
_stores_lock = threading.Lock()
_by_config: dict[int, tuple[Config, Store]] = {}


def store_for(config: Config) -> Store:
    """The process-wide :class:`Store` for a configuration."""
    known = _by_config.get(id(config))
    if known is not None and known[0] is config:
        return known[1]
    key = (
        config.database_url.render_as_string(hide_password=False),
        config.table_prefix,
        config.auto_migrate,
        config.lease_seconds,
        tuple(sorted((k, repr(v)) for k, v in config.engine_options.items())),
    )
    store = _stores.get(key)
    if store is None:
        with _stores_lock:
            store = _stores.setdefault(key, Store(config))
    # Each app parses its configuration once and keeps it: remember the answer for that
    # object (the config with it, so that a recycled id never matches another).
    _by_config[id(config)] = (config, store)
    return store


def discard_store(store: Store) -> None:
    """Close ``store`` and forget it, leaving every other store as it is (test fixtures)."""
    with _stores_lock:
        for key in [key for key, known in _stores.items() if known is store]:
            del _stores[key]
        for config_id in [config_id for config_id, (_, known) in _by_config.items()
                          if known is store]:
            del _by_config[config_id]
    store.close()


def all_stores() -> list[Store]:
    with _stores_lock:
        return list(_stores.values())


def close_all_stores() -> None:
    """Close every store's connections and forget them (tests, shutdown)."""
    with _stores_lock:
        stores = list(_stores.values())
        _stores.clear()
        _by_config.clear()
    for store in stores:
        store.close()
