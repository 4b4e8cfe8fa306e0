"""The store: schema, migrations under concurrency, SQL per step, forks, outages."""

from __future__ import annotations

import multiprocessing
import os
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine, event, func, inspect, select
from sqlalchemy.exc import IntegrityError

from celery_duraflow import DurableTask, StoreUnavailable, get_run, step
from celery_duraflow._config import config_for_app, load_config
from celery_duraflow._lease import new_owner
from celery_duraflow._schema import LATEST_VERSION, build_tables
from celery_duraflow._store import Delivery, Store, store_for
from tests.conftest import app_factory, drop_tables

# The store's own tests: on PostgreSQL also through PgBouncer (transaction pooling).
pytestmark = pytest.mark.pooled


@contextmanager
def count_statements(store: Store) -> Iterator[list[str]]:
    """Every SQL statement the store's engine sends, as it is sent."""
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # SQLite's explicit BEGIN IMMEDIATE is transaction control, not a statement of ours.
        if not statement.startswith("BEGIN"):
            statements.append(statement)

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        event.remove(store.engine, "before_cursor_execute", record)


@contextmanager
def count_round_trips(store: Store) -> Iterator[list[int]]:
    """Statements sent to the database, as seen on the wire (PostgreSQL) or by SQLAlchemy.

    On PostgreSQL every pooled connection's libpq protocol trace is read and
    each Execute message counted: the statements the store runs through
    SQLAlchemy and those it runs on the psycopg connection directly alike. Each
    is one round trip, except that psycopg prepares a statement it has run
    five times with one extra round trip, once per connection. SQLite has no
    wire; there each statement SQLAlchemy sends is counted.
    """
    total = [0]
    if store.dialect != "postgresql":
        with count_statements(store) as statements:
            yield total
        total[0] = len(statements)
        return

    import tempfile

    import psycopg

    traces: dict[int, Any] = {}

    def on_checkin(dbapi_conn: Any, _record: Any) -> None:
        stream, _ = traces.pop(id(dbapi_conn), (None, None))
        if stream is None:
            return
        dbapi_conn.pgconn.untrace()
        stream.seek(0)
        lines = stream.read().decode(errors="replace").splitlines()
        total[0] += sum(1 for line in lines if line.startswith("F") and "\tExecute\t" in line)
        stream.close()

    def trace(dbapi_conn: Any) -> None:
        stream = tempfile.TemporaryFile()  # noqa: SIM115 - closed at checkin, below
        traces[id(dbapi_conn)] = (stream, dbapi_conn)
        dbapi_conn.pgconn.trace(stream.fileno())
        dbapi_conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)

    # The connection the main thread keeps between attempts is already checked out.
    kept = store._held.conn if getattr(store._held, "pid", None) == os.getpid() else None
    if kept is not None:
        trace(kept.connection.driver_connection)

    def on_checkout(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        trace(dbapi_conn)

    event.listen(store.engine, "checkout", on_checkout)
    event.listen(store.engine, "checkin", on_checkin)
    try:
        yield total
    finally:
        event.remove(store.engine, "checkout", on_checkout)
        event.remove(store.engine, "checkin", on_checkin)
        # Still checked out (kept by this thread): count what it sent all the same.
        for _, dbapi_conn in list(traces.values()):
            on_checkin(dbapi_conn, None)


def _store(app: Celery) -> Store:
    return store_for(config_for_app(app))


def test_unique_constraint_is_the_last_line_of_defence(
        make_app: Callable[..., Celery]) -> None:
    """The database itself refuses a second row for one (task id, step key)."""
    app = make_app()
    store = _store(app)
    store.ensure_schema()
    key = inspect(store.engine).get_pk_constraint(store.tables.steps.name)
    assert key["constrained_columns"] == ["task_id", "step_key"]
    owner = new_owner()
    run, _ = store.begin_attempt("t1", Delivery(task_name="task", owner=owner))
    assert run.lease_owner == owner
    assert store.claim_step("t1", "s", owner, None) is not None
    assert store.claim_step("t1", "s", owner, None) is None  # ON CONFLICT DO NOTHING
    with pytest.raises(IntegrityError), store.engine.begin() as conn:
        conn.execute(store.tables.steps.insert().values(
            task_id="t1", step_key="s", status="running", attempts=1,
            started_at=func.now()))


def test_sql_per_attempt(make_app: Callable[..., Celery]) -> None:
    """Fresh steps cost a claim and a completion; replayed steps cost no SQL at all."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, bind=True, max_retries=1)
    def task(self: DurableTask, n: int) -> None:
        for i in range(n):
            with step("s") as s:
                s.result = i
        with step("last"):
            calls["last"] += 1
            if calls["last"] == 1:
                raise self.retry(countdown=0)

    store = _store(app)
    store.ensure_schema()
    with count_round_trips(store) as round_trips:
        assert task.apply(args=(20,)).successful()
    # Attempt 1: begin + one statement per step's end (20 completions, 1 failure) + the
    # lease release on Retry; attempt 2: begin + the completion + finish, and nothing for
    # the 20 replayed steps. Loading the recorded steps is part of "begin" on PostgreSQL
    # (one round trip), a separate SELECT on SQLite.
    loads = 0 if store.dialect == "postgresql" else 2
    assert round_trips[0] == (1 + 20 + 1 + 1) + (1 + 1 + 1) + loads


@pytest.mark.postgres
def test_an_attempt_holds_one_connection(pg_url: str, table_prefix: str) -> None:
    """All statements of an attempt share one pooled connection; a worker thread gives it
    back at the end, the main thread (a prefork or solo worker's) keeps it for the next."""
    app = app_factory(pg_url, table_prefix)()

    @app.task(base=DurableTask)
    def task(n: int) -> int:
        total = 0
        for i in range(n):
            with step("s") as s:
                s.result = i
            total += s.result
        return total

    store = _store(app)
    try:
        store.ensure_schema()
        checkouts: list[int] = []
        event.listen(store.engine, "checkout",
                     lambda dbapi_conn, *_: checkouts.append(id(dbapi_conn)))

        results: list[int] = []
        for n in (10, 3):
            thread = threading.Thread(target=lambda n=n: results.append(task.apply(
                args=(n,)).get()))
            thread.start()
            thread.join()
            assert store.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        assert results == [45, 3]
        assert len(checkouts) == 2

        assert task.apply(args=(10,)).get() == 45
        assert task.apply(args=(3,)).get() == 3
        assert len(checkouts) == 3
        assert store.engine.pool.checkedout() == 1  # type: ignore[attr-defined]
    finally:
        store.close()
        drop_tables(pg_url, table_prefix)
    assert store.engine.pool.checkedout() == 0  # type: ignore[attr-defined]


@pytest.mark.postgres
def test_a_forked_child_never_closes_the_connection_its_parent_keeps(
        pg_url: str, table_prefix: str) -> None:
    """A child forked after an attempt opens its own connection, and the parent's kept one
    still works afterwards (the child neither used nor closed it)."""
    app = app_factory(pg_url, table_prefix)()

    @app.task(base=DurableTask)
    def task(n: int) -> int:
        with step("s") as s:
            s.result = n
        return int(s.result)

    store = _store(app)
    try:
        assert task.apply(args=(1,)).get() == 1
        kept = store._held.conn
        assert kept is not None
        parent_pid = kept.connection.driver_connection.info.backend_pid
        pid = os.fork()
        if pid == 0:  # the child: a run of its own, then exit as a worker child would
            code = 1
            try:
                with store.held_connection():
                    code = 0 if (task.apply(args=(2,)).get() == 2 and store._held.conn
                                 .connection.driver_connection.info.backend_pid
                                 != parent_pid) else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert task.apply(args=(3,)).get() == 3
        assert store._held.conn is kept
        assert kept.connection.driver_connection.info.backend_pid == parent_pid
    finally:
        store.close()
        drop_tables(pg_url, table_prefix)


def test_succeeded_redelivery_is_one_statement(make_app: Callable[..., Celery]) -> None:
    """A retry or flagged redelivery of a run that already succeeded costs one statement and
    runs nothing; the same message sent twice costs one more (on PostgreSQL, the first
    delivery's insert), which writes nothing."""
    app = make_app()
    bodies = Counter[str]()

    @app.task(base=DurableTask)
    def task() -> int:
        for i in range(10):
            with step("s") as s:
                bodies["s"] += 1
                s.result = i
        return 7

    task_id = str(uuid.uuid4())
    assert task.apply(task_id=task_id).get() == 7
    store = _store(app)
    before = store.get_run(task_id)
    with count_round_trips(store) as round_trips:
        assert task.apply(task_id=task_id, retries=1).get() == 7
    assert round_trips[0] == 1
    with count_round_trips(store) as round_trips:
        assert task.apply(task_id=task_id).get() == 7
    assert round_trips[0] == (2 if store.dialect == "postgresql" else 1)
    assert store.get_run(task_id) == before
    assert bodies["s"] == 10


@pytest.mark.postgres
def test_a_first_delivery_starts_with_one_insert_whose_record_is_the_stored_row(
        pg_url: str, table_prefix: str) -> None:
    """A first delivery's start is one statement, and the run it returns equals the row
    stored (leased to it, attempt 1, no steps)."""
    store = _store(app_factory(pg_url, table_prefix)())
    owner = new_owner()
    delivery = Delivery(task_name="proj.t", owner=owner, args='[[1], {}]',
                        args_fingerprint="f" * 16, exchange="ex", routing_key="rk",
                        code_fingerprint="c" * 16, first=True)
    try:
        store.ensure_schema()
        with store.held_connection(), count_round_trips(store) as round_trips:
            run, steps = store.begin_attempt("first", delivery)
        assert round_trips[0] == 1
        assert steps == {}
        assert run.lease_owner == owner and run.attempts == 1 and run.status == "running"
        assert store.get_run("first") == run
    finally:
        store.close()
        drop_tables(pg_url, table_prefix)


@pytest.mark.postgres
def test_a_first_delivery_of_a_recorded_run_takes_it_with_its_steps(
        pg_url: str, table_prefix: str) -> None:
    """A delivery shaped like a first one whose run is already recorded (a child run, a
    duplicate, an unflagged redelivery) takes the run with its recorded steps, one round
    trip after the insert that found the row; a live owner's run is left to its owner."""
    store = _store(app_factory(pg_url, table_prefix)())
    first, second, third = new_owner(), new_owner(), new_owner()
    runs = store.tables.runs
    now = datetime.now(UTC)
    try:
        store.ensure_schema()
        run, _ = store.begin_attempt("again", Delivery(task_name="proj.t", owner=first,
                                                       first=True))
        assert run.lease_owner == first
        assert store.record_step("again", "s", first, status="completed", started_at=now,
                                 output="1", serializer="json", new=True, position=1)
        # Still leased to its first owner: the next delivery gets nothing.
        run, steps = store.begin_attempt("again", Delivery(task_name="proj.t", owner=second,
                                                           first=True))
        assert run.lease_owner == first and steps is None
        with store.engine.begin() as conn:  # the first owner's lease runs out
            conn.execute(runs.update().where(runs.c.task_id == "again")
                         .values(lease_expires_at=now - timedelta(seconds=1)))
        with store.held_connection(), count_round_trips(store) as round_trips:
            run, steps = store.begin_attempt("again", Delivery(task_name="proj.t", owner=third,
                                                               first=True))
        assert round_trips[0] == 2
        assert run.lease_owner == third and run.attempts == 2 and run.interrupted
        assert steps is not None and [(k, r.output) for k, r in steps.items()] == [("s", "1")]
    finally:
        store.close()
        drop_tables(pg_url, table_prefix)


def _migrate_in_process(url: str, prefix: str, barrier: Any) -> list[int]:
    store = Store(load_config({"duraflow_database_url": url, "duraflow_table_prefix": prefix},
                              environ={}))
    barrier.wait()
    try:
        return store.migrate()
    finally:
        store.close()


def _migrate_worker(url: str, prefix: str, barrier: Any, out: Any) -> None:
    out.put(_migrate_in_process(url, prefix, barrier))


@pytest.mark.postgres
def test_concurrent_first_use_migrates_once_across_processes(pg_url: str) -> None:
    """Eight processes starting at once apply each migration exactly once."""
    prefix = f"m{uuid.uuid4().hex[:8]}_"
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(8)
    out = ctx.Queue()
    procs = [ctx.Process(target=_migrate_worker, args=(pg_url, prefix, barrier, out))
             for _ in range(8)]
    try:
        for p in procs:
            p.start()
        results = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        # Every version applied exactly once, all by whichever process got the lock.
        assert sorted(v for r in results for v in r) == list(range(1, LATEST_VERSION + 1))
        assert sorted(len(r) for r in results) == [0] * 7 + [LATEST_VERSION]
        engine = create_engine(pg_url)
        tables = build_tables(prefix)
        with engine.connect() as conn:
            versions = conn.execute(select(tables.schema_version.c.version)).scalars().all()
        engine.dispose()
        assert versions == list(range(1, LATEST_VERSION + 1))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        drop_tables(pg_url, prefix)


def test_concurrent_first_use_migrates_once_across_threads(sqlite_url: str) -> None:
    """Threads racing to create the SQLite schema apply it once, without errors."""
    prefix = "threads_"
    barrier = threading.Barrier(6)
    results: list[list[int]] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            results.append(_migrate_in_process(sqlite_url, prefix, barrier))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    # Each version applied exactly once (threads may take turns between versions).
    assert sorted(v for r in results for v in r) == list(range(1, LATEST_VERSION + 1))


def _child_reads_run(url: str, prefix: str, task_id: str, out: Any) -> None:
    from celery_duraflow._store import all_stores

    # The store was inherited through fork: the child must open its own connections.
    (store,) = [s for s in all_stores() if s.config.table_prefix == prefix]
    run = store.get_run(task_id)
    out.put(run.status if run else None)


def test_engine_is_not_shared_across_fork(make_app: Callable[..., Celery],
                                          database_url: str, table_prefix: str) -> None:
    """A forked child gets its own connections; the parent's keep working."""
    app = make_app()

    @app.task(base=DurableTask)
    def task() -> None:
        with step("s"):
            pass

    result = task.apply()
    store = _store(app)
    parent_engine = store.engine
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=_child_reads_run,
                       args=(database_url, table_prefix, result.id, out))
    proc.start()
    assert out.get(timeout=30) == "succeeded"
    proc.join(timeout=30)
    assert proc.exitcode == 0
    assert store.engine is parent_engine
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded"


def test_unreachable_database_raises_store_unavailable(table_prefix: str) -> None:
    """No database, no body: StoreUnavailable names the task and nothing runs."""
    app = app_factory("postgresql+psycopg://nobody@127.0.0.1:1/nothing", table_prefix)(
        duraflow_engine_options={"connect_args": {"connect_timeout": 2}})
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask)
    def task() -> None:
        with step("charge"):
            calls["charge"] += 1

    result = task.apply()
    err = result.result
    assert isinstance(err, StoreUnavailable)
    assert isinstance(err, ConnectionError)
    assert err.task_id == result.id
    assert f"Nothing of task {result.id} ran" in str(err)
    assert calls["charge"] == 0


def test_migrations_build_the_current_model(make_app: Callable[..., Celery]) -> None:
    """Migrating from nothing yields exactly the tables, columns and indexes the code uses."""
    store = _store(make_app())
    store.ensure_schema()
    inspector = inspect(store.engine)
    for table in (*store.tables.owned(), store.tables.schema_version):
        columns = {c["name"] for c in inspector.get_columns(table.name)}
        assert columns == {c.name for c in table.columns}, table.name
        indexes = {i["name"] for i in inspector.get_indexes(table.name)}
        expected = {i.name for i in table.indexes}
        if store.engine.dialect.name != "postgresql":
            # The patch markers' index is PostgreSQL's only (schema version 13).
            expected.discard(f"{store.config.table_prefix}steps_patch_markers")
        assert indexes >= expected, table.name
    # (task_id, step_key) is the primary key: the one unique index of the steps table.
    assert inspector.get_pk_constraint(store.tables.steps.name)["constrained_columns"] == [
        "task_id", "step_key"]
    assert inspector.get_unique_constraints(store.tables.steps.name) == []
    assert inspector.get_foreign_keys(store.tables.steps.name) == []


def test_upgrade_to_the_step_primary_key_keeps_every_recorded_step(
        make_app: Callable[..., Celery]) -> None:
    """Version 5 re-keys the steps table; what versions 1 to 4 recorded is all still there."""
    from datetime import UTC, datetime

    from celery_duraflow._schema import MIGRATIONS, Tables, migrate

    app = make_app()
    store = _store(app)
    engine = store._transactional()
    tables: Tables = store.tables
    with engine.begin() as conn:
        tables.schema_version.create(conn)
        for version, description, apply in MIGRATIONS[:4]:
            apply(conn, tables)
            conn.execute(tables.schema_version.insert().values(
                version=version, description=description, applied_at=datetime.now(UTC)))
        now = datetime.now(UTC)
        conn.execute(tables.runs.insert().values(
            task_id="old-run", task_name="proj.old", status="running", attempts=2,
            created_at=now, updated_at=now))
        for n, status in enumerate(["completed", "completed", "failed"]):
            conn.exec_driver_sql(
                f"INSERT INTO {tables.steps.name} (task_id, step_key, status, attempts, output, "
                "serializer, started_at) VALUES (%s, %s, %s, 1, %s, 'json', %s)"
                if store.dialect == "postgresql" else
                f"INSERT INTO {tables.steps.name} (task_id, step_key, status, attempts, output, "
                "serializer, started_at) VALUES (?, ?, ?, 1, ?, 'json', ?)",
                ("old-run", f"s{n}", status, str(n) if status == "completed" else None,
                 now.replace(microsecond=n)))

    assert migrate(engine, tables, store.config.table_prefix) == list(
        range(5, LATEST_VERSION + 1))
    steps = store.load_steps("old-run")
    assert [(k, r.status, r.output, r.position) for k, r in steps.items()] == [
        ("s0", "completed", "0", None), ("s1", "completed", "1", None),
        ("s2", "failed", None, None)]
    # The upgraded table is the current one: the key holds, and new steps get a position.
    with pytest.raises(IntegrityError), store.engine.begin() as conn:
        conn.execute(store.tables.steps.insert().values(
            task_id="old-run", step_key="s0", status="running", attempts=1,
            started_at=func.now()))
    owner = new_owner()
    store.begin_attempt("old-run", Delivery(task_name="proj.old", owner=owner))
    assert store.record_step("old-run", "s3", owner, status="completed", output="3",
                             serializer="json", started_at=datetime.now(UTC), new=True,
                             position=4)
    assert store.get_step("old-run", "s3").position == 4  # type: ignore[union-attr]


def test_connections_opening_a_new_sqlite_file_at_once_all_succeed(tmp_path: Path) -> None:
    """Threads opening a new SQLite store at once never fail to switch it to WAL mode."""
    for round_ in range(15):
        url = f"sqlite:///{tmp_path}/race{round_}.db"
        barrier = threading.Barrier(6)
        errors: list[BaseException] = []

        def connect(url: str = url, barrier: threading.Barrier = barrier,
                    errors: list[BaseException] = errors) -> None:
            store = Store(load_config({"duraflow_database_url": url}, environ={}))
            barrier.wait()
            try:
                with store.engine.connect() as conn:
                    assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)
            finally:
                store.close()

        threads = [threading.Thread(target=connect) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == []


@pytest.mark.postgres
def test_a_column_added_under_a_running_worker_leaves_its_prepared_statements_working(
        pg_url: str, table_prefix: str) -> None:
    """A migration that adds a column while a worker's statements are prepared on the server
    (a rolling upgrade) changes nothing for the attempts that follow."""
    app = app_factory(pg_url, table_prefix)()

    @app.task(base=DurableTask)
    def task(n: int) -> int:
        with step("s") as s:
            s.result = n
        return int(s.result)

    store = _store(app)
    try:
        for n in range(8):  # psycopg prepares a statement on its fifth execution
            assert task.apply(args=(n,)).get() == n
        admin = create_engine(pg_url)
        try:
            with admin.begin() as conn:
                for table in ("runs", "steps"):
                    conn.exec_driver_sql(
                        f'ALTER TABLE "{table_prefix}{table}" ADD COLUMN added_later text')
        finally:
            admin.dispose()
        run_id = str(uuid.uuid4())
        assert task.apply(args=(42,), task_id=run_id).get() == 42
        assert task.apply(args=(42,), task_id=run_id).get() == 42  # answered from the row
        run = get_run(run_id, app=app)
        assert run is not None and run.status == "succeeded"
    finally:
        store.close()
        drop_tables(pg_url, table_prefix)


def test_an_sqlite_store_commits_each_write_to_disk(tmp_path: Path) -> None:
    """The embedded store's connections commit with synchronous=FULL in WAL mode, so a
    recorded step survives a power cut as it does on PostgreSQL."""
    store = Store(load_config({"duraflow_database_url": f"sqlite:///{tmp_path}/full.db"},
                              environ={}))
    try:
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
    finally:
        store.close()


@pytest.mark.postgres
def test_the_start_of_an_attempt_finds_steps_by_key_in_a_plan_made_on_an_empty_table(
        pg_url: str, table_prefix: str) -> None:
    """The start's prepared statement, planned once while the steps table was empty, still
    looks a run's steps up in the table's key after the table has grown (never a scan of
    every run's steps, which would make each attempt slower than the last)."""
    app = app_factory(pg_url, table_prefix)(duraflow_engine_options={
        "connect_args": {"options": "-c plan_cache_mode=force_generic_plan"}})

    @app.task(base=DurableTask)
    def task(n: int) -> int:
        return n  # no step: the steps table stays empty while the start is planned

    store = _store(app)
    steps = f'"{table_prefix}steps"'
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        store.ensure_schema()
        with admin.connect() as conn:  # before the plan is made: an ALTER would renew it
            conn.exec_driver_sql(f"ALTER TABLE {steps} SET (autovacuum_enabled = false)")
        # psycopg prepares the start on its fifth execution. As retries, these take the
        # general start (a first delivery inserts its row with a statement of its own).
        for n in range(7):
            assert task.apply(args=(n,), retries=1).get() == n
        with admin.connect() as conn:
            conn.exec_driver_sql(
                f"INSERT INTO {steps} (task_id, step_key, status, attempts, started_at) "
                "SELECT 'other-' || (g / 10), 's' || g, 'completed', 1, now() "
                "FROM generate_series(1, 20000) AS g")
        kept = store._held.conn.connection.driver_connection
        name, count = kept.execute(
            "SELECT name, cardinality(parameter_types) FROM pg_prepared_statements "
            "WHERE statement LIKE 'WITH attempt%'").fetchone()
        plan = "\n".join(row[0] for row in kept.execute(
            f"EXPLAIN EXECUTE {name}({', '.join(['NULL'] * count)})"))
        assert f"Seq Scan on {table_prefix}steps" not in plan, plan
        assert f"{table_prefix}steps" in plan
    finally:
        admin.dispose()
        store.close()
        drop_tables(pg_url, table_prefix)


@pytest.mark.postgres
def test_a_start_racing_the_first_insert_of_its_run_returns_the_committed_row(
        pg_url: str, table_prefix: str) -> None:
    """A delivery whose start waits on another delivery's uncommitted first insert of the
    same run gets that run's row as committed (leased to the other owner), takes nothing,
    and no step is loaded for it."""
    app = app_factory(pg_url, table_prefix)()
    store = _store(app)
    runs = store.tables.runs
    try:
        store.ensure_schema()
        now = datetime.now(UTC)
        other = create_engine(pg_url)
        results: list[Any] = []
        try:
            with other.begin() as conn:
                conn.execute(runs.insert().values(
                    task_id="race", task_name="proj.t", status="running", attempts=1,
                    created_at=now, updated_at=now, lease_owner="other|m|1|x",
                    lease_expires_at=now + timedelta(minutes=5)))
                starter = threading.Thread(target=lambda: results.append(store.begin_attempt(
                    "race", Delivery(task_name="proj.t", owner="mine|m|2|y"))))
                starter.start()
                starter.join(timeout=0.5)
                assert starter.is_alive()  # waiting on the uncommitted row
            starter.join(timeout=30)
        finally:
            other.dispose()
        [(run, steps)] = results
        assert run.lease_owner == "other|m|1|x" and run.attempts == 1
        assert steps is None
    finally:
        store.close()
        drop_tables(pg_url, table_prefix)


@pytest.mark.postgres
def test_a_step_recorded_twice_on_the_held_connection_keeps_the_first_record(
        pg_url: str, table_prefix: str) -> None:
    """On the attempt's held connection, where a step's record is a statement prepared on
    the server, a second record of a step the attempt believed new writes nothing and
    answers False; the first record stays, and the connection goes on working."""
    store = _store(app_factory(pg_url, table_prefix)())
    owner = new_owner()
    now = datetime.now(UTC)
    try:
        with store.held_connection():
            run, _ = store.begin_attempt("dup", Delivery(task_name="proj.t", owner=owner))
            assert run.lease_owner == owner
            # The first record prepares the statement on the server, the second reuses it.
            assert store.record_step("dup", "s", owner, status="completed", started_at=now,
                                     output="1", serializer="json", new=True, position=1)
            assert not store.record_step("dup", "s", owner, status="completed", started_at=now,
                                         output="9", serializer="json", new=True, position=1)
            assert store.record_step("dup", "t", owner, status="completed", started_at=now,
                                     output="2", serializer="json", new=True, position=2)
            assert store.finish_run("dup", owner, "succeeded", result="3", serializer="json")
            assert not store.finish_run("dup", owner, "succeeded", result="4", serializer="json")
        steps = store.load_steps("dup")
        assert [(key, record.output) for key, record in steps.items()] == [("s", "1"), ("t", "2")]
        ended = store.get_run("dup")
        assert ended is not None and ended.status == "succeeded" and ended.result == "3"
    finally:
        store.close()
        drop_tables(pg_url, table_prefix)
