"""Atomic steps in a Django project: the step's transaction is ``transaction.atomic()``.

When the store is one of the project's database aliases, an atomic step's body
runs inside ``django.db.transaction.atomic(using=alias)``, so the ORM's writes
on that alias, the store's statements for the step and the step's record are
one transaction on Django's own connection. Nested atomic steps are nested
``atomic()`` blocks (savepoints), as Django makes them.

``s.connection`` is a SQLAlchemy ``Connection`` over that same Django connection,
lent for the body: commits, rollbacks and closing stay with Django.

While the body runs, a write through any *other* alias is refused: it could not
commit with the step's record, and the step would no longer be what it promises.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from ..._atomic import AtomicTransaction, guard_engine, innermost
from ...errors import AtomicStepError

if TYPE_CHECKING:
    from ..._db import Database

# Statements that write, by their first word: refused on other aliases inside a body.
_WRITES = frozenset({"INSERT", "UPDATE", "DELETE", "MERGE", "REPLACE", "UPSERT", "CREATE",
                     "DROP", "ALTER", "TRUNCATE", "COPY", "GRANT", "REVOKE"})
# The Django connection being lent to SQLAlchemy right now (see _engine's creator).
_lending: ContextVar[Any] = ContextVar("duraflow_django_lending")
_engines: dict[tuple[int, str], Engine] = {}
_engines_lock = threading.Lock()


class _Lent:
    """Django's DB-API connection as SQLAlchemy sees it during an atomic step.

    Everything is the real connection's, except what belongs to Django: ending
    the transaction and closing the connection are no-ops here, and nothing is
    installed on it (SQLAlchemy's notice handler and SQL functions).
    """

    __slots__ = ("_raw",)

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass

    def close(self) -> None:
        pass

    def add_notice_handler(self, _handler: Any) -> None:
        pass

    def create_function(self, *_args: Any, **_kwargs: Any) -> None:
        pass


def _engine(database: Database, alias: str) -> Engine:
    """A SQLAlchemy engine whose connections are Django's connection for ``alias``."""
    key = (id(database), alias)
    engine = _engines.get(key)
    if engine is None:
        with _engines_lock:
            engine = _engines.get(key)
            if engine is None:
                options: dict[str, Any] = {}
                if database.dialect == "postgresql":
                    # Looking hstore up wants psycopg's own Connection class; the store
                    # has no hstore column.
                    options["use_native_hstore"] = False
                engine = create_engine(database.config.database_url,
                                       creator=lambda: _Lent(_lending.get()),
                                       poolclass=NullPool, hide_parameters=True, **options)
                guard_engine(engine)
                _engines[key] = engine
    return engine


def _refuse_writes_elsewhere(stack: ExitStack, alias: str, task_id: str,
                             step_key: str) -> None:
    def refuse(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        words = str(sql).lstrip().split(None, 1)
        if words and words[0].upper() in _WRITES:
            raise AtomicStepError(
                f"the body of atomic step {step_key!r} in task {task_id} wrote to the Django "
                f"database {context['connection'].alias!r}, but the step's transaction is on "
                f"{alias!r}, the store's: that write could not commit together with the "
                "step's record. Write to the store's database in an atomic step, or move "
                "this write to a step that is not atomic.",
                task_id=task_id, step_key=step_key)
        return execute(sql, params, many, context)

    for other in connections:
        if other != alias:
            stack.enter_context(connections[other].execute_wrapper(refuse))


def begin_django(database: Database, alias: str, task_id: str,
                 step_key: str) -> AtomicTransaction:
    """Open an atomic step's transaction as ``transaction.atomic(using=alias)``."""
    outer = innermost()
    block = transaction.atomic(using=alias)
    block.__enter__()
    stack = ExitStack()
    try:
        wrapper = connections[alias]
        wrapper.ensure_connection()
        token = _lending.set(wrapper.connection)
        try:
            conn: Connection = _engine(database, alias).connect()
        finally:
            _lending.reset(token)
        stack.callback(conn.close)
        _refuse_writes_elsewhere(stack, alias, task_id, step_key)
    except BaseException as exc:
        stack.close()
        block.__exit__(type(exc), exc, exc.__traceback__)
        raise
    raw = wrapper.connection

    def still_open() -> str | None:
        if transaction.get_rollback(using=alias):
            return "marked the transaction for rollback (transaction.set_rollback())"
        if not wrapper.in_atomic_block or wrapper.connection is not raw:
            return "left the transaction, or closed its connection"
        info = getattr(raw, "info", None)
        status = getattr(info, "transaction_status", None)
        if status is not None and int(status) == 3:  # psycopg: INERROR
            return ("ran a statement that failed, and the transaction can only be rolled "
                    "back (an error inside the body was caught and not raised again)")
        return None

    def commit() -> None:
        stack.close()
        block.__exit__(None, None, None)

    def rollback() -> None:
        stack.close()
        aborted = _Aborted()
        block.__exit__(_Aborted, aborted, None)

    tx = AtomicTransaction(
        database, conn, task_id=task_id, step_key=step_key, routed=True, outer=outer,
        commit=commit, rollback=rollback, still_open=still_open, close=lambda: None)
    tx.enter()
    return tx


class _Aborted(Exception):
    """Handed to ``atomic().__exit__`` to make Django roll the step's transaction back."""
