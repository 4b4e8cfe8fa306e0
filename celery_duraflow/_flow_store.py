"""The statements of flow control: concurrency slots, their queues, rate windows, dedupe.

Every decision about one limit's key is taken in one transaction that first
queues behind every other decision about that key: on PostgreSQL with a
transaction-level advisory lock on the (scope, key) pair (which a transaction
pooler keeps, since it lasts no longer than the transaction), on SQLite with the
write lock ``BEGIN IMMEDIATE`` takes. Inside it the rows are read, the limit is
checked and the slot or window row is written, so two workers can never both
take the last slot.

A slot row holds its slot only while it is *live* (see :func:`_live`): its run
still holds the lease the slot was taken under, or, for a slot handed to a
waiting run that is on its way, until that run takes it, ends or suspends. A run that ends,
retries, suspends or dies therefore stops holding its slots in the very
statement that ends its lease, whatever happens after; the explicit release
only wakes the next run in the queue sooner.
"""

from __future__ import annotations

import functools
import hashlib
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import (
    DateTime,
    Integer,
    and_,
    bindparam,
    delete,
    exists,
    func,
    insert,
    literal,
    literal_column,
    null,
    or_,
    select,
    text,
    union_all,
    update,
)
from sqlalchemy.engine import Connection

from ._db import Database, Prepared
from ._records import FINISHED, RUNNING, SLEEPING, WAITING, RunRecord, as_utc, utc_now

#: How much longer than its window a rate row waits before it is used again, in seconds.
#: A use is stamped when the store grants it; the body starts a few milliseconds later,
#: after a delay that varies. The margin keeps the window true for the bodies' starts too.
RATE_MARGIN = 0.05
#: How many entries of a key's queue a decision reads at a time, from its head.
QUEUE_PAGE = 16
SLOT_WAIT: Literal["slot"] = "slot"
RATE_WAIT: Literal["rate"] = "rate"
DEBOUNCE_WAIT: Literal["debounce"] = "debounce"


def slot_label(scope: str, key: str) -> str:
    """What a run queued for a slot waits for, as its row says: ``scope/key``."""
    return f"{scope}/{key}"


@dataclass(frozen=True)
class SlotAnswer:
    """The outcome of asking for a concurrency slot.

    ``state`` is ``granted`` (the attempt holds the slot), ``waiting`` (the run
    is queued and suspended: its lease is released), or ``lost`` (the attempt
    no longer holds the run's lease). ``position`` is the run's place in the
    key's queue (1 is next), ``woken`` the runs this transaction handed a slot
    to, which the caller sends once it returns.
    """

    state: Literal["granted", "waiting", "lost"]
    position: int
    live: int
    woken: list[RunRecord]
    #: For a slot taken after queueing: how long the run waited for it, in seconds.
    waited: float = 0.0


@dataclass(frozen=True)
class QueuePlace:
    """Where a run waiting for a concurrency slot stands: for ``show``, the web view, the
    admin and :func:`~celery_duraflow.get_run`.

    ``position`` 1 is next; ``holding`` is how many slots of the key are held
    now, ``limit`` the limit the run queued under.
    """

    scope: str
    key: str
    task_id: str
    position: int
    limit: int
    holding: int
    queued_at: datetime


class _LeaseGone(Exception):
    """The attempt lost the run's lease while queueing: its transaction is rolled back."""

    def __init__(self, position: int) -> None:
        super().__init__(position)
        self.position = position


def _lock_key(prefix: str, scope: str, key: str) -> int:
    digest = hashlib.blake2b(f"celery-duraflow-flow:{prefix}:{scope}\x00{key}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _live(row: Any, now: datetime) -> bool:
    """Whether a slot row (joined with its run) holds its slot at ``now``.

    A slot handed to a queued run (no owner yet) is the run's for as long as the run is
    running: while its message waits behind others in the broker, however long, and while
    the sweep sends a lost one again. It stops holding when the run ends or suspends
    without having taken it; once taken, it is the taking attempt's, like any other.
    """
    if row.status is None or row.status in FINISHED:
        return False
    if row.owner is None:
        return bool(row.status == RUNNING)
    lease = as_utc(row.lease_expires_at)
    return (row.status == RUNNING and row.lease_owner == row.owner and lease is not None
            and lease > now)


class FlowStatements(Database):
    """Take and free concurrency slots, queue for them, use rate windows, dedupe sends."""

    def _flow_lock(self, conn: Connection, scope: str, key: str) -> None:
        if self.dialect == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"),
                         {"k": _lock_key(self.config.table_prefix, scope, key)})

    # -- concurrency ----------------------------------------------------------------------

    def _slot_rows(self, conn: Connection, scope: str, key: str) -> list[Any]:
        slots, runs = self.tables.flow_slots, self.tables.runs
        stmt = (select(slots.c.slot, slots.c.task_id, slots.c.owner,
                       slots.c.queued_at, runs.c.status, runs.c.lease_owner,
                       runs.c.lease_expires_at)
                .select_from(slots.outerjoin(runs, runs.c.task_id == slots.c.task_id))
                .where(slots.c.scope == scope, slots.c.key == key))
        return list(conn.execute(stmt))

    def _queue_page(self, conn: Connection, scope: str, key: str, after: Any) -> list[Any]:
        """Up to :data:`QUEUE_PAGE` entries of the key's queue in order, joined with the
        runs: from its head, or from the one after ``after`` (an entry read before)."""
        waits, runs = self.tables.flow_waits, self.tables.runs
        stmt = (select(waits.c.task_id, waits.c.queued_at, waits.c.limit, runs.c.status,
                       runs.c.wait_kind, runs.c.waiting_for)
                .select_from(waits.outerjoin(runs, runs.c.task_id == waits.c.task_id))
                .where(waits.c.scope == scope, waits.c.key == key)
                .order_by(waits.c.queued_at, waits.c.task_id))
        if after is not None:
            stmt = stmt.where(or_(waits.c.queued_at > after.queued_at,
                                  and_(waits.c.queued_at == after.queued_at,
                                       waits.c.task_id > after.task_id)))
        return list(conn.execute(stmt.limit(QUEUE_PAGE)))

    def _queued_count(self, conn: Connection, scope: str, key: str, *, waiting: bool = False,
                      besides: str | None = None, before: Any = None) -> int:
        """How many runs that have not ended are in the key's queue: only those waiting
        for it (``waiting``), except ``besides``, or only those ahead of entry ``before``.
        Counted in the database, never read row by row."""
        waits, runs = self.tables.flow_waits, self.tables.runs
        stmt = (select(func.count()).select_from(
                    waits.join(runs, runs.c.task_id == waits.c.task_id))
                .where(waits.c.scope == scope, waits.c.key == key,
                       runs.c.status.not_in(FINISHED)))
        if waiting:
            stmt = stmt.where(runs.c.status == WAITING)
        if besides is not None:
            stmt = stmt.where(waits.c.task_id != besides)
        if before is not None:
            stmt = stmt.where(or_(waits.c.queued_at < before.queued_at,
                                  and_(waits.c.queued_at == before.queued_at,
                                       waits.c.task_id < before.task_id)))
        return int(conn.execute(stmt).scalar() or 0)

    def _head(self, conn: Connection, scope: str, key: str) -> Iterator[Any]:
        """The key's queue in order, read a page (:data:`QUEUE_PAGE`) at a time as the
        caller goes: a decision that stops at the head of a long queue reads only that."""
        after = None
        while True:
            page = self._queue_page(conn, scope, key, after)
            yield from page
            if len(page) < QUEUE_PAGE:
                return
            after = page[-1]

    def _settle(self, conn: Connection, scope: str, key: str, now: datetime, grace: float,
                keep: str | None = None) -> tuple[set[int], bool, list[RunRecord]]:
        """Drop dead slot rows and stale queue entries; hand free slots to the queue.

        Slots go to the queued runs strictly oldest first, each while fewer slots
        are live than the limit it queued under. The queue is read from its head
        only as far as that goes: up to the first run that finds no slot (entries
        behind it are cleared when they reach the head). Returns the slot numbers
        in use, whether a waiting run (not ``keep``) is still queued, and the runs
        woken. ``keep`` is a run whose rows are left as they are, live or not (the
        caller's own).
        """
        slots, waits, runs = self.tables.flow_slots, self.tables.flow_waits, self.tables.runs
        used: set[int] = set()
        live = 0
        for row in self._slot_rows(conn, scope, key):
            if row.task_id == keep or _live(row, now):
                used.add(row.slot)
                live += 1
            else:
                conn.execute(delete(slots).where(slots.c.scope == scope, slots.c.key == key,
                                                 slots.c.slot == row.slot))
        label = slot_label(scope, key)
        woken: list[RunRecord] = []
        for entry in self._head(conn, scope, key):
            if entry.status is None or entry.status in FINISHED:
                conn.execute(delete(waits).where(waits.c.scope == scope, waits.c.key == key,
                                                 waits.c.task_id == entry.task_id))
                continue
            ready = (entry.status == WAITING and entry.wait_kind == SLOT_WAIT
                     and entry.waiting_for == label and entry.task_id != keep)
            if not ready:
                # On its way (sent again, being compensated), or the caller's own: it
                # asks again when it arrives, and does not hold up the runs behind it.
                continue
            number = None if live >= entry.limit else self._insert_slot(
                conn, scope, key, used, entry.limit,
                task_id=entry.task_id, owner=None, granted_at=now, queued_at=entry.queued_at)
            live = max(live, len(used))
            if number is None:
                # Strictly in order: no waiting run is served past the head of the queue.
                return used, True, woken
            row = conn.execute(
                update(runs)
                .where(runs.c.task_id == entry.task_id, runs.c.status == WAITING,
                       runs.c.wait_kind == SLOT_WAIT, runs.c.waiting_for == label)
                .values(status=RUNNING, lease_owner=None,
                        lease_expires_at=now + timedelta(seconds=grace), updated_at=now,
                        wait_kind=None, waiting_for=None, wake_at=None)
                .returning(*runs.c)).first()
            conn.execute(delete(waits).where(waits.c.scope == scope, waits.c.key == key,
                                             waits.c.task_id == entry.task_id))
            if row is None:
                conn.execute(delete(slots).where(slots.c.scope == scope, slots.c.key == key,
                                                 slots.c.slot == number))
                used.discard(number)
                live = len(used)
                continue
            woken.append(RunRecord.from_row(row))
        return used, False, woken

    def _insert_slot(self, conn: Connection, scope: str, key: str, used: set[int], limit: int,
                     **values: Any) -> int | None:
        """Insert a slot row under a free number below ``limit``; the number, or None if
        every number below ``limit`` is in use. ``used`` is updated with what is found
        taken: an attempt on the lock-free path (:meth:`_acquire_fast`) may take a
        number at any moment, so a number that conflicts is counted as held, not retried.
        """
        slots = self.tables.flow_slots
        while True:
            number = _free_number(used)
            if number >= limit:
                return None
            got = conn.execute(
                self._insert(slots)
                .values(scope=scope, key=key, slot=number, **values)
                .on_conflict_do_nothing(index_elements=[slots.c.scope, slots.c.key,
                                                        slots.c.slot])
                .returning(slots.c.slot)).first()
            used.add(number)
            if got is not None:
                return number

    def acquire_slot(self, task_id: str, owner: str, *, scope: str, key: str, limit: int,
                     grace: float, sweep_after: float | None) -> SlotAnswer:
        """Take a slot of ``scope``/``key`` for this attempt, or queue and suspend the run.

        A slot handed to this run while it waited is taken over by this
        attempt. Otherwise a slot is taken if fewer than ``limit`` are live and
        no run queued before this one still waits. If none can be taken, the
        run is queued (keeping its place if it already was) and suspended in
        the same transaction, so a slot freed at that moment is handed to it,
        not lost.
        """
        if self.dialect == "postgresql":
            taken = self._acquire_fast(task_id, owner, scope=scope, key=key, limit=limit)
            if taken is not None:
                return taken
        try:
            return self._acquire_slot(task_id, owner, scope=scope, key=key, limit=limit,
                                      grace=grace, sweep_after=sweep_after)
        except _LeaseGone as gone:
            return SlotAnswer("lost", gone.position, 0, [])

    @functools.cached_property
    def _flow_statements(self) -> dict[str, Prepared]:
        """The two statements of the usual case on PostgreSQL, prepared once per store:
        each runs on the attempt's held connection as one round trip, without
        SQLAlchemy's execution layers (see :meth:`Database.write_prepared`)."""
        slots, waits = self.tables.flow_slots, self.tables.flow_waits
        quote = self.engine.dialect.identifier_preparer.quote
        slots_name, waits_name = quote(slots.name), quote(waits.name)
        acquire = text(f"""
            WITH adopt AS (
                UPDATE {slots_name} SET owner = :owner
                WHERE scope = :scope AND key = :key AND task_id = :task_id
                RETURNING slot, queued_at),
            inserted AS (
                INSERT INTO {slots_name}
                    (scope, key, slot, task_id, owner, granted_at, queued_at)
                SELECT :scope, :key, n, :task_id, :owner, :now, NULL
                FROM generate_series(0, :top) AS n
                WHERE NOT EXISTS (SELECT 1 FROM adopt)
                  AND NOT EXISTS (SELECT 1 FROM {slots_name} s
                                  WHERE s.scope = :scope AND s.key = :key AND s.slot = n)
                  AND NOT EXISTS (SELECT 1 FROM {waits_name} w
                                  WHERE w.scope = :scope AND w.key = :key)
                ORDER BY (n + :start) % (:top + 1) LIMIT 1
                ON CONFLICT DO NOTHING
                RETURNING slot, queued_at)
            SELECT slot, EXTRACT(EPOCH FROM (:now - queued_at)) AS waited FROM adopt
            UNION ALL SELECT slot, NULL FROM inserted
        """).bindparams(bindparam("scope", type_=slots.c.scope.type),
                        bindparam("key", type_=slots.c.key.type),
                        bindparam("task_id", type_=slots.c.task_id.type),
                        bindparam("owner", type_=slots.c.owner.type),
                        bindparam("now", type_=DateTime(timezone=True)),
                        bindparam("top", type_=Integer()),
                        bindparam("start", type_=Integer()))
        # The rows go, and the keys that have runs queued come back, in one statement. A
        # run that queues at this moment is not seen (the statement's snapshot is older),
        # but it saw the slot taken and looks again itself once it waits (flow.enter).
        # Committed without waiting for the WAL flush: the rows stopped holding their
        # slots when the attempt's lease ended, so a database crash that loses the
        # delete loses nothing (the next decision about the key clears them).
        release = text(f"""
            WITH freed AS (
                DELETE FROM {slots_name} WHERE task_id = :task_id AND owner = :owner
                  AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL
                RETURNING scope, key)
            SELECT DISTINCT f.scope, f.key FROM freed f
            WHERE EXISTS (SELECT 1 FROM {waits_name} w
                          WHERE w.scope = f.scope AND w.key = f.key)
        """).bindparams(bindparam("task_id", type_=slots.c.task_id.type),
                        bindparam("owner", type_=slots.c.owner.type))
        return {"acquire": self.prepare(acquire, raw=True), "release": self.prepare(release)}

    def slot_with_start(self, started: Any) -> Any:
        """The slot insert of :meth:`_acquire_fast`, as a CTE that only inserts where the
        CTE ``started`` (a new run's insert) returned a row; its rows are the slot taken.

        A run that did not exist a moment ago has no slot handed to it and is in
        no queue, so taking over a handed slot does not arise: a free number is
        taken while nobody waits for the key, or nothing is, and the caller takes
        the usual path. Parameters ``p_scope``, ``p_key``, ``p_task_id``,
        ``p_lease_owner``, ``p_updated_at``, ``p_top`` and ``p_start`` (as
        :meth:`_acquire_fast` computes them).
        """
        slots, waits = self.tables.flow_slots, self.tables.flow_waits
        scope = bindparam("p_scope", type_=slots.c.scope.type)
        key = bindparam("p_key", type_=slots.c.key.type)
        top = bindparam("p_top", type_=Integer())
        number = func.generate_series(0, top).column_valued("n")
        held = slots.alias("held")
        pick = (select(scope, key, number,
                       bindparam("p_task_id", type_=slots.c.task_id.type),
                       bindparam("p_lease_owner", type_=slots.c.owner.type),
                       bindparam("p_updated_at", type_=DateTime(timezone=True)))
                .where(exists(select(literal_column("1")).select_from(started)),
                       ~exists().where(held.c.scope == scope, held.c.key == key,
                                       held.c.slot == number),
                       ~exists().where(waits.c.scope == scope, waits.c.key == key))
                .order_by((number + bindparam("p_start", type_=Integer())) % (top + 1))
                .limit(1))
        taken = (self._insert(slots)
                 .from_select(["scope", "key", "slot", "task_id", "owner", "granted_at"], pick)
                 .on_conflict_do_nothing(index_elements=[slots.c.scope, slots.c.key,
                                                         slots.c.slot]))
        return taken.returning(slots.c.slot).cte("slot_taken")

    @staticmethod
    def slot_start(task_id: str, limit: int) -> int:
        """Where an attempt starts looking for a free slot number: its own point, so that
        attempts racing for one key's slots seldom pick the same number (the loser of a
        pick takes the locked path)."""
        return zlib.crc32(task_id.encode("utf-8", "surrogatepass")) % limit

    def freeing(self, run_end: Any) -> Any:
        """``run_end`` (an UPDATE of the run's row, parameters ``p_task_id`` and ``p_owner``),
        with the deletion of the slot rows that owner took, as one statement.

        It answers with one row whose ``finished`` counts the runs ended, and one
        row per freed key that has runs queued for it. Both writes commit
        together: a limited run's success costs what an unlimited one's does,
        plus a delete by an index.
        """
        slots, waits = self.tables.flow_slots, self.tables.flow_waits
        ended = run_end.returning(literal_column("1").label("one")).cte("ended")
        freed = (delete(slots)
                 .where(slots.c.task_id == bindparam("p_task_id", type_=slots.c.task_id.type),
                        slots.c.owner == bindparam("p_owner", type_=slots.c.owner.type))
                 .returning(slots.c.scope, slots.c.key).cte("freed"))
        counted = select(select(func.count()).select_from(ended).scalar_subquery()
                         .label("finished"), null().label("scope"), null().label("key"))
        queued = (select(literal(0).label("finished"), freed.c.scope, freed.c.key)
                  .where(exists().where(waits.c.scope == freed.c.scope,
                                        waits.c.key == freed.c.key))
                  .distinct())
        return union_all(counted, queued)

    def _acquire_fast(self, task_id: str, owner: str, *, scope: str, key: str,
                      limit: int) -> SlotAnswer | None:
        """One statement for the usual case, on PostgreSQL: take over the slot handed to
        this run, or take a slot number that no row holds while nobody waits for the key.

        It never touches another run's row, so it needs no lock: two attempts that
        pick the same free number meet on the primary key, and the one that loses
        takes the locked path. None means the locked path must decide (no number
        free, rows to clear, or runs waiting).
        """
        now = utc_now()
        rows = self.write_prepared(
            self._flow_statements["acquire"],
            {"scope": scope, "key": key, "task_id": task_id, "owner": owner, "now": now,
             "top": limit - 1, "start": self.slot_start(task_id, limit)},
            "taking a concurrency slot", task_id).rows
        if not rows:
            return None
        waited = rows[0][1]  # text on libpq's path, a Decimal on psycopg's
        return SlotAnswer("granted", 0, 0, [],
                          max(0.0, float(waited)) if waited is not None else 0.0)

    def _acquire_slot(self, task_id: str, owner: str, *, scope: str, key: str, limit: int,
                      grace: float, sweep_after: float | None) -> SlotAnswer:
        slots, waits, runs = self.tables.flow_slots, self.tables.flow_waits, self.tables.runs
        with self.transaction("taking a concurrency slot", task_id) as conn:
            self._flow_lock(conn, scope, key)
            now = utc_now()
            used, blocked, woken = self._settle(conn, scope, key, now, grace, keep=task_id)
            mine = [row for row in self._slot_rows(conn, scope, key) if row.task_id == task_id]
            # The other runs waiting in the queue: there is one if the settling stopped at
            # a run it could not serve; counted only where it matters, once.
            others = None if blocked else self._queued_count(conn, scope, key, waiting=True,
                                                              besides=task_id)
            ahead = blocked or bool(others)
            live = len(used) - len(mine)
            taken = bool(mine)
            if mine:
                conn.execute(update(slots).where(
                    slots.c.scope == scope, slots.c.key == key,
                    slots.c.task_id == task_id).values(owner=owner))
            elif not ahead and live < limit:
                taken = self._insert_slot(conn, scope, key, used, limit, task_id=task_id,
                                          owner=owner, granted_at=now) is not None
                live = len(used) - 1 if taken else len(used)
            if taken:
                conn.execute(delete(waits).where(waits.c.scope == scope, waits.c.key == key,
                                                 waits.c.task_id == task_id))
                queued_at = as_utc(mine[0].queued_at) if mine else None
                waited = (now - queued_at).total_seconds() if queued_at is not None else 0.0
                return SlotAnswer("granted", 0, live + 1, woken, max(0.0, waited))
            queued = conn.execute(select(waits.c.task_id, waits.c.queued_at).where(
                waits.c.scope == scope, waits.c.key == key,
                waits.c.task_id == task_id)).first()
            if queued is None:
                if others is None:
                    others = self._queued_count(conn, scope, key, waiting=True,
                                                besides=task_id)
                position = others + 1
                conn.execute(insert(waits).values(scope=scope, key=key, task_id=task_id,
                                                  queued_at=now, limit=limit))
            else:
                conn.execute(update(waits).where(
                    waits.c.scope == scope, waits.c.key == key,
                    waits.c.task_id == task_id).values(limit=limit))
                position = self._queued_count(conn, scope, key, before=queued) + 1
            expires = None if sweep_after is None else now + timedelta(seconds=sweep_after)
            suspended = conn.execute(
                update(runs).where(runs.c.task_id == task_id, runs.c.lease_owner == owner)
                .values(status=WAITING, wait_kind=SLOT_WAIT,
                        waiting_for=slot_label(scope, key), wake_at=None, lease_owner=None,
                        lease_expires_at=expires, updated_at=now, interrupted=False)).rowcount
            if not suspended:
                raise _LeaseGone(position)  # rolls the queue entry back
            return SlotAnswer("waiting", position, live, woken)

    def release_slots(self, task_id: str, owner: str, *, grace: float) -> list[RunRecord]:
        """Free the slots the attempt ``owner`` of ``task_id`` took; hand them on.

        Its rows are deleted in one statement (they stopped holding anything when
        its lease ended); only a key that has runs queued for it is then settled,
        under its lock, and the runs handed a slot are returned for the caller to
        send. A run that queues in between either saw the slot free or is seen here
        (it looks again itself once suspended, in :func:`._flow.enter`).
        """
        if self.dialect == "postgresql":
            queued = {(row[0], row[1]) for row in self.write_prepared(
                self._flow_statements["release"], {"task_id": task_id, "owner": owner},
                "freeing the run's concurrency slots", task_id).rows}
        else:
            queued = self._release_locally(task_id, owner)
        return self.settle_keys(queued, grace=grace, task_id=task_id)

    def settle_keys(self, keys: set[tuple[str, str]], *, grace: float,
                    task_id: str) -> list[RunRecord]:
        """Settle each of ``keys`` (freed by ``task_id``'s attempt) in turn, in one order."""
        woken: list[RunRecord] = []
        for scope, key in sorted(keys):
            woken += self.settle_key(scope, key, grace=grace, task_id=task_id)
        return woken

    def _release_locally(self, task_id: str, owner: str) -> set[tuple[str, str]]:
        """SQLite: delete the attempt's slot rows; the keys that have runs queued."""
        slots, waits = self.tables.flow_slots, self.tables.flow_waits
        with self._write("freeing the run's concurrency slots", task_id) as conn:
            keys = {(row.scope, row.key) for row in conn.execute(
                delete(slots).where(slots.c.task_id == task_id, slots.c.owner == owner)
                .returning(slots.c.scope, slots.c.key))}
            return {(scope, key) for scope, key in keys if conn.execute(
                select(waits.c.scope).where(waits.c.scope == scope, waits.c.key == key)
                .limit(1)).first() is not None}

    def settle_key(self, scope: str, key: str, *, grace: float,
                   task_id: str | None = None) -> list[RunRecord]:
        """Hand the free slots of one key to the runs queued for it (under its lock)."""
        with self.transaction("handing on concurrency slots", task_id) as conn:
            self._flow_lock(conn, scope, key)
            return self._settle(conn, scope, key, utc_now(), grace)[2]

    def settle_queues(self, *, grace: float, limit: int) -> list[RunRecord]:
        """For the sweep: hand the slots that died with their holders to the queues.

        A holder killed with its slot stops holding it when its lease expires;
        nobody frees it explicitly, so each key with a queue is looked at here.
        """
        waits = self.tables.flow_waits
        with self._read("looking for concurrency queues") as conn:
            keys = [(row.scope, row.key) for row in conn.execute(
                select(waits.c.scope, waits.c.key).distinct()
                .order_by(waits.c.scope, waits.c.key).limit(limit))]
        woken: list[RunRecord] = []
        for scope, key in keys:
            woken += self.settle_key(scope, key, grace=grace)
        return woken

    def queued(self, task_id: str) -> list[QueuePlace]:
        """Where run ``task_id`` stands in the queues it is in (for ``show`` and the views)."""
        waits = self.tables.flow_waits
        answer: list[QueuePlace] = []
        with self._read("reading the run's place in its queues", task_id) as conn:
            entries = list(conn.execute(select(waits).where(waits.c.task_id == task_id)))
            now = utc_now()
            for entry in entries:
                holding = sum(1 for row in self._slot_rows(conn, entry.scope, entry.key)
                              if _live(row, now))
                answer.append(QueuePlace(
                    scope=entry.scope, key=entry.key, task_id=task_id,
                    position=self._queued_count(conn, entry.scope, entry.key,
                                                before=entry) + 1,
                    limit=entry.limit, holding=holding,
                    queued_at=as_utc(entry.queued_at) or now))
        return answer

    # -- rate limits -------------------------------------------------------------------------

    def take_rate(self, task_id: str, *, scope: str, key: str, limit: int,
                  per: float) -> datetime | None:
        """Use one of ``limit`` calls per ``per`` seconds of ``scope``/``key``.

        None when one was used; otherwise the moment the next one frees (the
        oldest use plus ``per`` and :data:`RATE_MARGIN`). Each of the key's
        ``limit`` rows is used at most once per ``per`` seconds of the store's
        clock, so no window of that length ever holds more than ``limit`` uses,
        across every host.
        """
        rates = self.tables.flow_rates
        with self.transaction("using a rate limit", task_id) as conn:
            self._flow_lock(conn, scope, key)
            now = utc_now()
            rows = list(conn.execute(select(rates.c.slot, rates.c.used_at).where(
                rates.c.scope == scope, rates.c.key == key, rates.c.slot < limit)))
            taken = {row.slot for row in rows}
            if len(taken) < limit:
                conn.execute(insert(rates).values(scope=scope, key=key,
                                                  slot=_free_number(taken), used_at=now,
                                                  task_id=task_id))
                return None
            oldest = min(rows, key=lambda row: as_utc(row.used_at) or now)
            free_at = (as_utc(oldest.used_at) or now) + timedelta(seconds=per + RATE_MARGIN)
            if free_at > now:
                return free_at
            conn.execute(update(rates).where(rates.c.scope == scope, rates.c.key == key,
                                             rates.c.slot == oldest.slot)
                         .values(used_at=now, task_id=task_id))
            return None

    # -- dedupe ------------------------------------------------------------------------------

    def claim_dedupe(self, *, scope: str, key: str, task_id: str, window: float,
                     run: dict[str, Any]) -> str:
        """The task id that owns dedupe key ``scope``/``key`` now: ``task_id`` if this call
        claimed it (its run row, ``run``, is written in the same transaction, so the
        sweep sends it should the caller die before sending), else the earlier one's."""
        dedupe, runs = self.tables.flow_dedupe, self.tables.runs
        with self.transaction("claiming a dedupe key", task_id) as conn:
            self._flow_lock(conn, scope, key)
            now = utc_now()
            row = conn.execute(select(dedupe.c.task_id, dedupe.c.expires_at).where(
                dedupe.c.scope == scope, dedupe.c.key == key)).first()
            expires = as_utc(row.expires_at) if row is not None else None
            if row is not None and expires is not None and expires > now:
                return str(row.task_id)
            if row is not None:
                conn.execute(delete(dedupe).where(dedupe.c.scope == scope,
                                                  dedupe.c.key == key))
            conn.execute(insert(dedupe).values(scope=scope, key=key, task_id=task_id,
                                               created_at=now,
                                               expires_at=now + timedelta(seconds=window)))
            exists_already = conn.execute(select(runs.c.task_id).where(
                runs.c.task_id == task_id)).first()
            if exists_already is None:
                conn.execute(insert(runs).values(
                    task_id=task_id, created_at=now, updated_at=now, status=RUNNING,
                    attempts=0, retries=0, recoveries=0, interrupted=False,
                    lease_expires_at=now + timedelta(seconds=self.config.lease_seconds),
                    **run))
            return task_id

    def debounce(self, *, scope: str, key: str, task_id: str, delay: float,
                 max_delay: float | None, trailing: bool,
                 run: dict[str, Any]) -> tuple[str, datetime | None]:
        """Claim or join the burst of sends of ``scope``/``key``; (its task id, fire time).

        Trailing: a burst's run is recorded sleeping until ``delay`` after its last
        send (no later than ``max_delay`` after its first), with the last send's
        arguments; each send moves it on, until the sweep (or the fire message)
        has sent it. Leading: the first send of a burst is sent at once (the fire
        time is None) and later ones within ``delay`` of the last join it.
        A send that finds its burst already fired starts the next one.
        """
        dedupe, runs = self.tables.flow_dedupe, self.tables.runs
        with self.transaction("debouncing a send", task_id) as conn:
            self._flow_lock(conn, scope, key)
            now = utc_now()
            row = conn.execute(select(dedupe.c.task_id, dedupe.c.created_at,
                                      dedupe.c.expires_at).where(
                dedupe.c.scope == scope, dedupe.c.key == key)).first()

            def moment(first: datetime) -> datetime:
                at = now + timedelta(seconds=delay)
                if max_delay is not None:
                    at = min(at, first + timedelta(seconds=max_delay))
                return at

            if row is not None and (as_utc(row.expires_at) or now) > now:
                owner, first = str(row.task_id), as_utc(row.created_at) or now
                fire = moment(first)
                if not trailing:
                    conn.execute(update(dedupe).where(dedupe.c.scope == scope,
                                                      dedupe.c.key == key)
                                 .values(expires_at=fire))
                    return owner, None
                moved = conn.execute(
                    update(runs).where(runs.c.task_id == owner, runs.c.status == SLEEPING,
                                       runs.c.wait_kind == DEBOUNCE_WAIT)
                    .values(args=run["args"], args_fingerprint=run["args_fingerprint"],
                            wake_at=fire, lease_expires_at=fire, updated_at=now)).rowcount
                if moved:
                    conn.execute(update(dedupe).where(dedupe.c.scope == scope,
                                                      dedupe.c.key == key)
                                 .values(expires_at=fire))
                    return owner, fire
            if row is not None:
                conn.execute(delete(dedupe).where(dedupe.c.scope == scope,
                                                  dedupe.c.key == key))
            fire = moment(now)
            conn.execute(insert(dedupe).values(scope=scope, key=key, task_id=task_id,
                                               created_at=now, expires_at=fire))
            if trailing:
                conn.execute(insert(runs).values(
                    task_id=task_id, created_at=now, updated_at=now, status=SLEEPING,
                    attempts=0, retries=0, recoveries=0, interrupted=False,
                    wait_kind=DEBOUNCE_WAIT, waiting_for=slot_label(scope, key),
                    wake_at=fire, lease_expires_at=fire, **run))
                return task_id, fire
            conn.execute(insert(runs).values(
                task_id=task_id, created_at=now, updated_at=now, status=RUNNING,
                attempts=0, retries=0, recoveries=0, interrupted=False,
                lease_expires_at=now + timedelta(seconds=self.config.lease_seconds), **run))
            return task_id, None

    def prune_flow(self, before: datetime) -> int:
        """Delete dedupe keys whose window ended before ``before``; how many went."""
        dedupe = self.tables.flow_dedupe
        with self._write("pruning dedupe keys") as conn:
            return int(conn.execute(delete(dedupe).where(dedupe.c.expires_at < before))
                       .rowcount or 0)


def _free_number(used: Sequence[int] | set[int]) -> int:
    """The smallest slot number not in ``used``."""
    taken = set(used)
    number = 0
    while number in taken:
        number += 1
    return number
