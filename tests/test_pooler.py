"""The store behind PgBouncer in transaction pooling mode.

PgBouncer (started by ``.ci/pgbouncer.sh``) hands consecutive transactions of one
client to different server connections (``server_round_robin``), so whatever
relies on session state between transactions fails here: a statement psycopg
prepared on one server connection, a session advisory lock taken on one and
freed on another. The store's own test modules also run through it (the
``pooled`` marker); these tests pin the pooler setting and the migration lock.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
from celery import Celery
from sqlalchemy import create_engine, text

from celery_duraflow import ConfigurationError, DurableTask, step
from celery_duraflow._config import Config, load_config
from celery_duraflow._db import parse_database_url
from celery_duraflow._schema import LATEST_VERSION, _lock_key, build_tables, migrate
from celery_duraflow._store import Store, close_all_stores, store_for
from tests.conftest import app_factory, drop_tables

pytestmark = pytest.mark.postgres


@pytest.fixture
def prefix(pg_url: str) -> Iterator[str]:
    """A table prefix of this test's own, dropped afterwards (on the direct connection)."""
    name = f"p{uuid.uuid4().hex[:10]}_"
    yield name
    close_all_stores()
    drop_tables(pg_url, name)


def _advisory_locks(pg_url: str, prefix: str) -> int:
    """How many server sessions hold the migration lock of ``prefix`` now."""
    key = _lock_key(prefix)
    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND ((classid::bigint << 32) | objid::bigint) = :k"),
                {"k": key & 0xFFFFFFFFFFFFFFFF}).scalar_one())
    finally:
        engine.dispose()


def _store(url: str, prefix: str, pooler: str | None = None) -> Store:
    conf: dict[str, str] = {"duraflow_database_url": url, "duraflow_table_prefix": prefix}
    if pooler is not None:
        conf["duraflow_pooler"] = pooler
    return store_for(load_config(conf))


def test_a_pooler_in_between_is_found_at_the_first_connection(
        pg_url: str, pgbouncer_url: str, prefix: str) -> None:
    """With duraflow_pooler unset, a store through PgBouncer turns prepared statements off; a
    direct one keeps them."""
    pooled = _store(pgbouncer_url, prefix)
    direct = _store(pg_url, prefix + "d")
    for store in (pooled, direct):
        store.ensure_schema()
    assert pooled.transaction_pooled is True
    assert direct.transaction_pooled is False
    drop_tables(pg_url, prefix + "d")


def test_many_attempts_through_the_pooler_never_meet_a_prepared_statement(
        pgbouncer_url: str, pg_url: str, prefix: str) -> None:
    """Thirty runs of a three-step task through PgBouncer, then a replay of each, succeed: no
    statement is prepared on one server connection and looked for on another."""
    app = app_factory(pgbouncer_url, prefix)()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, bind=True)
    def book(self: DurableTask, n: int) -> int:
        total = 0
        for name in ("search", "book", "mail"):
            with step(name) as s:
                calls[name] += 1
                s.result = n
            total += s.result
        return total

    ids = [f"pooled-{prefix}-{n}" for n in range(30)]
    for n, task_id in enumerate(ids):
        assert book.apply(args=(n,), task_id=task_id).get() == 3 * n
    for n, task_id in enumerate(ids):  # a redelivery of each finds its result
        assert book.apply(args=(n,), task_id=task_id).get() == 3 * n
    assert calls == Counter(search=30, book=30, mail=30)


def test_pooler_setting_transaction_prepares_nothing_on_the_server(
        pg_url: str, prefix: str) -> None:
    """duraflow_pooler = 'transaction' on a direct connection leaves no prepared statement in
    the server session after many steps."""
    app: Celery = app_factory(pg_url, prefix)(duraflow_pooler="transaction")

    @app.task(base=DurableTask)
    def one() -> int:
        with step("only") as s:
            s.result = 1
        return int(s.result)

    for n in range(12):
        assert one.apply(task_id=f"tx-{prefix}-{n}").get() == 1
    store = _store(pg_url, prefix, "transaction")
    assert store.transaction_pooled is True
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM pg_prepared_statements")).scalar() == 0


def test_unknown_pooler_setting_is_refused() -> None:
    """A duraflow_pooler value the store does not know is a ConfigurationError naming the
    values it knows."""
    with pytest.raises(ConfigurationError, match="duraflow_pooler must be one of"):
        load_config({"duraflow_database_url": "sqlite://", "duraflow_pooler": "pgbouncer"})


def test_migration_through_the_pooler_leaves_no_lock_behind(
        pg_url: str, pgbouncer_url: str, prefix: str) -> None:
    """A migration through PgBouncer leaves its advisory lock held by no server session, so
    the next migrating worker is not blocked for good."""
    config = Config(database_url=parse_database_url(pgbouncer_url), table_prefix=prefix,
                    pooler="transaction")
    engine = create_engine(config.database_url, isolation_level="AUTOCOMMIT",
                           connect_args={"prepare_threshold": None})
    try:
        assert migrate(engine, build_tables(prefix), prefix) != []
        assert _advisory_locks(pg_url, prefix) == 0
        assert migrate(engine, build_tables(prefix), prefix) == []
        assert _advisory_locks(pg_url, prefix) == 0
    finally:
        engine.dispose()


def test_workers_migrating_at_once_through_the_pooler_apply_each_version_once(
        pg_url: str, pgbouncer_url: str, prefix: str) -> None:
    """Six callers migrating one new prefix at once through PgBouncer: one creates the schema,
    every version is recorded once, and no lock is left held."""
    tables = build_tables(prefix)
    results: list[list[int]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def worker() -> None:
        engine = create_engine(pgbouncer_url, isolation_level="AUTOCOMMIT",
                               connect_args={"prepare_threshold": None})
        try:
            start.wait()
            results.append(migrate(engine, tables, prefix))
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert sorted(len(r) for r in results) == [0] * 5 + [LATEST_VERSION]
    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            versions = conn.execute(text(
                f'SELECT version, count(*) FROM "{tables.schema_version.name}" GROUP BY version'
            )).all()
    finally:
        engine.dispose()
    assert sorted(versions) == [(v, 1) for v in range(1, LATEST_VERSION + 1)]
    assert _advisory_locks(pg_url, prefix) == 0
