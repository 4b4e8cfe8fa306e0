"""The transaction of an atomic step: the body's writes and the step's record commit together.

``step(name, atomic=True)`` runs its body inside one transaction on the store's
database and writes the step's record in that same transaction, just before it
commits. A crash or an exception anywhere before the commit leaves neither the
body's writes nor the record, so the next attempt runs the body again on a clean
slate; after the commit both are there, and a replay skips the body. There is no
window between the side effect and its record, which is what makes such a step
exactly once rather than at least once.

Where the transaction lives:

* PostgreSQL: on the attempt's held connection (``Database.held_connection``),
  whose driver stays in autocommit mode, with ``BEGIN`` sent by hand.
* SQLite: on a connection of its own, in ``BEGIN IMMEDIATE``.

While the body runs, the store's statements in this thread (a nested step's
record, the step's own record, its fence) are routed to that connection, through
the driver's ordinary execution path: the libpq-level path of plain step records
prepares statements, and a statement prepared in a transaction that rolls back
is gone with it.
* A Django project whose store is one of its database aliases: inside Django's
  ``transaction.atomic()`` on that alias, on Django's own connection (see
  ``celery_duraflow.contrib.django``), so ORM writes in the body join it.

A step nested in an atomic step joins its transaction (a savepoint when it is
atomic itself): its record commits, or not, with the outer step.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeAlias

from sqlalchemy import MetaData, event
from sqlalchemy.engine import Connection as Connection  # the type of StepContext.connection
from sqlalchemy.engine import Engine as Engine  # the type of the test store's engine

from .errors import AtomicStepError

if TYPE_CHECKING:
    from ._db import Database

# The atomic steps whose bodies are running in this context, innermost last.
_OPEN: ContextVar[tuple[AtomicTransaction, ...]] = ContextVar("duraflow_atomic", default=())
# Set in a connection's info while an atomic body runs on it: the transaction, whose
# commit or rollback only the step may do.
_GUARD = "duraflow_atomic_body"
_savepoints = itertools.count(1)


def innermost() -> AtomicTransaction | None:
    """The transaction of the innermost atomic step running in this context, if any."""
    open_ = _OPEN.get()
    return open_[-1] if open_ else None


def routed(database: Database) -> Connection | None:
    """The connection the store's statements must use now, if an atomic step of this
    store has one that the store's usual path would not reach (SQLite, Django)."""
    open_ = _OPEN.get()
    if not open_:
        return None
    tx = open_[-1]
    return tx.connection if tx.database is database and tx.routed else None


class AtomicTransaction:
    """The open transaction of one atomic step (or its savepoint, when nested).

    ``connection`` is the SQLAlchemy connection the body may use. ``finish``
    commits (or releases the savepoint), ``abort`` rolls back; exactly one of
    them is called, by the step, when its body ends.
    """

    def __init__(self, database: Database, connection: Connection, *, task_id: str,
                 step_key: str, routed: bool, outer: AtomicTransaction | None,
                 commit: Callable[[], None], rollback: Callable[[], None],
                 still_open: Callable[[], str | None], close: Callable[[], None]) -> None:
        self.database = database
        self.connection = connection
        self.task_id = task_id
        self.step_key = step_key
        self.routed = routed
        self.outer = outer
        self._commit = commit
        self._rollback = rollback
        self._still_open = still_open
        self._close = close
        self._token: Any = None
        self.ended = False

    # -- lifetime -------------------------------------------------------------------------

    def enter(self) -> None:
        """Make this the innermost atomic transaction of the context; guard it."""
        self._token = _OPEN.set((*_OPEN.get(), self))
        self.connection.info[_GUARD] = self

    def _leave(self) -> None:
        if self._token is not None:
            _OPEN.reset(self._token)
            self._token = None
        info = self.connection.info
        if info.get(_GUARD) is self:
            if self.outer is not None and self.outer.connection is self.connection:
                info[_GUARD] = self.outer
            else:
                info.pop(_GUARD, None)

    def check(self) -> None:
        """Raise AtomicStepError if the body ended the transaction or left it failed."""
        problem = self._still_open()
        if problem is not None:
            raise AtomicStepError(
                f"the body of atomic step {self.step_key!r} in task {self.task_id} {problem}. "
                "An atomic step's transaction belongs to the step: it commits the body's "
                "writes together with the step's record when the body ends. Remove the "
                "commit or rollback from the body (raise an exception to roll back), or "
                "make the step non-atomic.",
                task_id=self.task_id, step_key=self.step_key)

    def finish(self) -> None:
        """Commit (or release the savepoint); the step's record was written inside."""
        if self.ended:
            return
        self.ended = True
        self._leave()
        try:
            self._commit()
        except BaseException:
            # The connection that failed to commit may be gone: the rollback is a courtesy.
            with contextlib.suppress(Exception):
                self._rollback()
            raise
        finally:
            self._close()

    def abort(self) -> None:
        """Roll back the body's writes (and the record, if it was written)."""
        if self.ended:
            return
        self.ended = True
        self._leave()
        try:
            self._rollback()
        finally:
            self._close()


def refuse_other_store(database: Database, task_id: str, step_key: str) -> None:
    """An atomic step nested in another store's atomic step cannot share its transaction."""
    outer = innermost()
    if outer is not None and outer.database is not database:
        raise AtomicStepError(
            f"atomic step {step_key!r} of task {task_id} is inside atomic step "
            f"{outer.step_key!r} of task {outer.task_id}, whose transaction is on another "
            "store's connection: the two could not commit together. Run the inner task "
            "outside the atomic step, or give both the same store.",
            task_id=task_id, step_key=step_key)


def begin_native(database: Database, task_id: str, step_key: str) -> AtomicTransaction:
    """Open the transaction of an atomic step on the store's own engine."""
    outer = innermost()
    if outer is not None:
        return _savepoint(database, outer, task_id, step_key)
    if database.dialect == "postgresql":
        return _begin_postgres(database, task_id, step_key)
    return _begin_sqlite(database, task_id, step_key)


def _savepoint(database: Database, outer: AtomicTransaction, task_id: str,
               step_key: str) -> AtomicTransaction:
    conn = outer.connection
    name = f"duraflow_atomic_{next(_savepoints)}"
    conn.exec_driver_sql(f"SAVEPOINT {name}")

    def commit() -> None:
        conn.exec_driver_sql(f"RELEASE SAVEPOINT {name}")

    def rollback() -> None:
        conn.exec_driver_sql(f"ROLLBACK TO SAVEPOINT {name}")
        conn.exec_driver_sql(f"RELEASE SAVEPOINT {name}")

    tx = AtomicTransaction(
        database, conn, task_id=task_id, step_key=step_key, routed=outer.routed,
        outer=outer, commit=commit,
        rollback=rollback, still_open=outer._still_open, close=lambda: None)
    tx.enter()
    return tx


def _begin_postgres(database: Database, task_id: str, step_key: str) -> AtomicTransaction:
    # The attempt's held connection, whose driver stays in autocommit mode: BEGIN is
    # sent by hand, psycopg's commit() and rollback() end the transaction (and keep
    # psycopg's own prepared statements in step with the server's).
    held = database._held_conn()
    conn = held if held is not None else database.engine.connect()
    driver: Any = conn.connection.driver_connection
    from psycopg import pq

    driver.execute("BEGIN")

    def still_open() -> str | None:
        status = driver.info.transaction_status
        if status == pq.TransactionStatus.INTRANS:
            return None
        if status == pq.TransactionStatus.INERROR:
            return ("ran a statement that failed, and the transaction can only be rolled "
                    "back (an error inside the body was caught and not raised again)")
        return "committed or rolled back the transaction itself"

    def close() -> None:
        if held is None:
            conn.close()

    tx = AtomicTransaction(
        database, conn, task_id=task_id, step_key=step_key, routed=True, outer=None,
        commit=driver.commit, rollback=driver.rollback, still_open=still_open, close=close)
    tx.enter()
    return tx


def _begin_sqlite(database: Database, task_id: str, step_key: str) -> AtomicTransaction:
    conn = database.engine.connect()
    try:
        trans = conn.begin()  # BEGIN IMMEDIATE: the database's write lock, taken now
    except BaseException:
        conn.close()
        raise
    driver: Any = conn.connection.driver_connection

    def still_open() -> str | None:
        if trans.is_active and driver.in_transaction:
            return None
        return "committed or rolled back the transaction itself"

    def rollback() -> None:
        if trans.is_active:
            trans.rollback()
        elif driver.in_transaction:
            driver.rollback()

    tx = AtomicTransaction(
        database, conn, task_id=task_id, step_key=step_key, routed=True, outer=None,
        commit=trans.commit, rollback=rollback, still_open=still_open, close=conn.close)
    tx.enter()
    return tx


def guard_engine(engine: Engine) -> None:
    """Refuse a commit or rollback of an atomic step's transaction by its own body.

    SQLAlchemy announces both before it sends them; while a body runs on the
    connection, the announcement raises instead (nothing is committed or rolled
    back), and the step rolls back when the body ends.
    """

    def refuse(what: str) -> Callable[[Connection], None]:
        def listener(conn: Connection) -> None:
            tx = conn.info.get(_GUARD)
            if isinstance(tx, AtomicTransaction) and not tx.ended:
                raise AtomicStepError(
                    f"the body of atomic step {tx.step_key!r} in task {tx.task_id} called "
                    f"{what}() on the step's connection. The step commits the body's writes "
                    "together with its record when the body ends; raise an exception to "
                    "roll them back.", task_id=tx.task_id, step_key=tx.step_key)
        return listener

    event.listen(engine, "commit", refuse("commit"))
    event.listen(engine, "rollback", refuse("rollback"))


# -- the tables of the user's own that a test's atomic steps write (celery_duraflow.testing)

#: What a test's own tables are given as (the ``duraflow_tables`` fixture, the ``tables``
#: argument of ``celery_duraflow.testing.isolated_store``): SQLAlchemy ``MetaData`` whose
#: tables are created after the store's own and dropped with them, a function given a
#: ``Connection`` in a transaction on the store's database (to run DDL or insert rows,
#: say), or a list of these, applied in order. None: no tables of the test's own.
UserTables: TypeAlias = MetaData | Callable[[Connection], object] | Iterable[
    MetaData | Callable[[Connection], object]] | None


def table_setups(tables: UserTables) -> list[MetaData | Callable[[Connection], object]]:
    """``tables`` as a list of MetaData and functions, refused if it is anything else."""
    if tables is None:
        return []
    items: Any = [tables] if isinstance(tables, MetaData) or callable(tables) else tables
    setups: list[Any] = list(items) if isinstance(items, Iterable) else [items]
    for item in setups:
        if not (isinstance(item, MetaData) or callable(item)):
            raise TypeError(
                "the test's own tables (the duraflow_tables fixture) must be SQLAlchemy "
                "MetaData, a function taking a Connection, a list of these, or None; got "
                f"{item!r}")
    return setups


def create_user_tables(engine: Engine, setups: list[MetaData | Callable[[Connection], object]]
                   ) -> None:
    with engine.begin() as conn:
        for setup in setups:
            if isinstance(setup, MetaData):
                setup.create_all(conn)
            else:
                setup(conn)


def drop_user_tables(engine: Engine, setups: list[MetaData | Callable[[Connection], object]]
                 ) -> None:
    with engine.begin() as conn:
        for setup in reversed(setups):
            if isinstance(setup, MetaData):
                setup.drop_all(conn)
