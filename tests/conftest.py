"""Shared fixtures: real databases, real brokers, real workers.

Services come from the environment:

* ``DURAFLOW_TEST_DATABASE_URL``: PostgreSQL (default: the local ``test`` database);
* ``DURAFLOW_TEST_BROKER_URL``: Redis (default: database 9 on the local server);
* ``DURAFLOW_TEST_RABBITMQ_URL``: RabbitMQ (default: the local server's ``/`` vhost),
  for the delivery tests that run on both brokers (see :func:`broker`);
* ``DURAFLOW_TEST_PGBOUNCER_URL``: the same PostgreSQL database through PgBouncer in
  transaction pooling mode (default: port 6432, as ``.ci/pgbouncer.sh`` starts it), for
  the store tests of modules marked ``pooled`` (see :func:`database_url`).

A test that needs one of them is skipped with the reason when it is
unreachable, unless ``DURAFLOW_REQUIRE_SERVICES=1`` (as in CI), where that is a
failure.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from sqlalchemy import Engine, create_engine, text

from celery_duraflow import _clock
from celery_duraflow._schema import MIGRATIONS, build_tables
from celery_duraflow._store import Store, close_all_stores

pytest_plugins = ("celery.contrib.pytest",)

DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/9"
DEFAULT_RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"
DEFAULT_PGBOUNCER_URL = "postgresql+psycopg://postgres@127.0.0.1:6432/test"

REQUIRE_SERVICES = os.environ.get("DURAFLOW_REQUIRE_SERVICES") == "1"
# `make chaos` sets DURAFLOW_TEST_LONG=1 to run the tests marked `long` too.
RUN_LONG = os.environ.get("DURAFLOW_TEST_LONG") == "1"


def _unavailable(what: str, url: str, exc: BaseException) -> None:
    message = f"{what} at {url} is unreachable ({type(exc).__name__}: {exc})"
    if REQUIRE_SERVICES:
        pytest.fail(f"{message}, and DURAFLOW_REQUIRE_SERVICES=1", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def pg_url() -> str:
    """URL of a reachable PostgreSQL server."""
    url = os.environ.get("DURAFLOW_TEST_DATABASE_URL", DEFAULT_PG_URL)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        _unavailable("PostgreSQL", url, exc)
    finally:
        engine.dispose()
    return url


@pytest.fixture(scope="session")
def pgbouncer_url() -> str:
    """URL of the test database through a reachable PgBouncer (transaction pooling)."""
    url = os.environ.get("DURAFLOW_TEST_PGBOUNCER_URL", DEFAULT_PGBOUNCER_URL)
    # No prepared statement of psycopg's own: this engine only checks the pooler answers.
    engine = create_engine(url, connect_args={"prepare_threshold": None})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        _unavailable("PgBouncer (start it with .ci/pgbouncer.sh)", url, exc)
    finally:
        engine.dispose()
    return url


@pytest.fixture(scope="session")
def redis_url() -> str:
    """URL of a reachable Redis server."""
    import redis

    url = os.environ.get("DURAFLOW_TEST_BROKER_URL", DEFAULT_REDIS_URL)
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=2)
        client.ping()
        client.close()
    except Exception as exc:
        _unavailable("Redis", url, exc)
    return url


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    """URL of a reachable RabbitMQ server."""
    from kombu import Connection

    url = os.environ.get("DURAFLOW_TEST_RABBITMQ_URL", DEFAULT_RABBITMQ_URL)
    try:
        with Connection(url, connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:
        _unavailable("RabbitMQ", url, exc)
    return url


@dataclass(frozen=True)
class Broker:
    """A broker the delivery tests run on, and the result backend that goes with it."""

    name: str
    url: str
    # Results are not about delivery: both brokers keep them in Redis (Celery 5 has no
    # amqp result backend, and rpc:// answers only the client that sent the task).
    result_backend: str

    def delete_queue(self, queue: str) -> None:
        """Delete ``queue`` (RabbitMQ: queue.delete; Redis: the list and its bindings)."""
        from kombu import Connection

        from tests.workers import delete_queue

        with Connection(self.url, connect_timeout=5) as conn:
            delete_queue(conn, queue)


BROKERS = ("redis", "rabbitmq")


@pytest.fixture(params=BROKERS)
def broker(request: pytest.FixtureRequest) -> Broker:
    """Each delivery test that uses it runs once on Redis and once on RabbitMQ."""
    redis: str = request.getfixturevalue("redis_url")
    if request.param == "redis":
        return Broker("redis", redis, redis)
    return Broker("rabbitmq", request.getfixturevalue("rabbitmq_url"), redis)


def drop_tables(url: str, prefix: str) -> None:
    engine = create_engine(url)
    try:
        tables = build_tables(prefix)
        with engine.begin() as conn:
            tables.metadata.drop_all(conn)
    finally:
        engine.dispose()


def schema_at(store: Store, version: int) -> Engine:
    """Build the store's schema as a release at ``version`` left it; the engine that did."""
    engine = store._transactional()
    tables = store.tables
    with engine.begin() as conn:
        tables.schema_version.create(conn)
        for number, description, apply in MIGRATIONS[:version]:
            apply(conn, tables)
            conn.execute(tables.schema_version.insert().values(
                version=number, description=description, applied_at=datetime.now(UTC)))
    return engine


def index_definitions(engine: Engine, table: str) -> dict[str, str]:
    """Each index of ``table`` with the SQL the database keeps for it."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            rows = conn.execute(text("SELECT indexname, indexdef FROM pg_indexes "
                                     "WHERE tablename = :t"), {"t": table})
        else:
            rows = conn.execute(text("SELECT name, coalesce(sql, '') FROM sqlite_master "
                                     "WHERE type = 'index' AND tbl_name = :t"), {"t": table})
        return {str(name): str(sql) for name, sql in rows}


# The tables tests/proj (the project run by real `celery worker` processes) creates.
# tests/test_project_tables.py checks that it names every one.
PROJECT_TABLES = ("charges", "notify_outages", "chaos_charges", "chaos_ledger",
                  "chaos_mail_failures", "wait_events", "agent_events")


def drop_project_tables(url: str, prefix: str) -> None:
    """Drop tests/proj's own tables and the duraflow tables under ``prefix``."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            for table in PROJECT_TABLES:
                conn.execute(text(f'DROP TABLE IF EXISTS "{prefix}{table}"'))
    finally:
        engine.dispose()
    drop_tables(url, prefix)


@pytest.fixture
def table_prefix() -> str:
    """A table prefix of this test's own, so tests never see each other's rows."""
    return f"t{uuid.uuid4().hex[:10]}_"


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'duraflow.sqlite3'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres),
                        pytest.param("pgbouncer", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, table_prefix: str,
                 tmp_path: Path) -> Iterator[str]:
    """Each test that uses it runs once on SQLite and once on PostgreSQL; in a module
    marked ``pooled`` (the store's own tests) a third time through PgBouncer."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'duraflow.sqlite3'}"
        close_all_stores()
        return
    direct: str = request.getfixturevalue("pg_url")
    url: str = (request.getfixturevalue("pgbouncer_url") if request.param == "pgbouncer"
                else direct)
    yield url
    close_all_stores()
    drop_tables(direct, table_prefix)


# First, before `-m` selects: `make chaos` (-m "chaos or long") must see the long marker
# given here to the RabbitMQ variants of the tests marked one_broker.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the PgBouncer variant of ``database_url`` to the modules marked ``pooled``;
    skip the tests marked ``long``, and the RabbitMQ variant of those marked
    ``one_broker``, unless DURAFLOW_TEST_LONG=1 (``make chaos``)."""
    long_skip = pytest.mark.skip(
        reason="long scenario: runs in `make chaos` (DURAFLOW_TEST_LONG=1)")
    kept, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        # A delivery scenario that needs no second broker in every run: its RabbitMQ
        # variant is a long one (the Redis one runs with the suite).
        on_rabbitmq = (callspec is not None and callspec.params.get("broker") == "rabbitmq"
                       and item.get_closest_marker("one_broker") is not None)
        if on_rabbitmq:
            item.add_marker(pytest.mark.long)
        if not RUN_LONG and item.get_closest_marker("long") is not None:
            item.add_marker(long_skip)
        through_pooler = (callspec is not None
                          and callspec.params.get("database_url") == "pgbouncer")
        if through_pooler and item.get_closest_marker("pooled") is None:
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def app_factory(database_url: str, table_prefix: str) -> Callable[..., Celery]:
    """``factory(eager=True, broker="memory://", **conf)`` builds a configured app."""

    def factory(*, eager: bool = True, broker: str = "memory://", **conf: Any) -> Celery:
        app = Celery(f"test-{uuid.uuid4().hex[:6]}", broker=broker, set_as_current=False)
        app.conf.update(
            result_backend="cache+memory://" if broker == "memory://" else broker,
            task_always_eager=eager,
            task_eager_propagates=False,
            duraflow_database_url=database_url,
            duraflow_table_prefix=table_prefix,
            broker_connection_retry_on_startup=True,
            # The in-memory transport polls; the default second per poll slows every retry.
            broker_transport_options={"polling_interval": 0.05},
            worker_hijack_root_logger=False,
        )
        app.conf.update(conf)
        # Celery shares every @app.task with all apps created later; tests define many
        # tasks under the same names in separate apps, so keep each app's tasks its own.
        app.task = functools.partial(app.task, shared=False)  # type: ignore[method-assign]
        return app

    return factory


@pytest.fixture
def make_app(database_url: str, table_prefix: str) -> Callable[..., Celery]:
    """Build a Celery app on this test's database (SQLite, then PostgreSQL) and tables.

    ``make_app(eager=True)`` runs tasks in the caller (``task_always_eager``);
    ``eager=False`` leaves them to a worker (see :func:`run_worker`).
    """
    return app_factory(database_url, table_prefix)


@pytest.fixture
def sqlite_app(sqlite_url: str, table_prefix: str) -> Iterator[Celery]:
    """An eager app on a SQLite file, for tests about code rather than storage."""
    yield app_factory(sqlite_url, table_prefix)()
    close_all_stores()


@contextmanager
def run_worker(app: Celery, *, pool: str = "solo", concurrency: int = 1) -> Iterator[Any]:
    """A real Celery worker consuming from ``app``'s broker in this process."""
    with _prompt_shutdown(), start_worker(
            app, pool=pool, concurrency=concurrency, perform_ping_check=False,
            loglevel="WARNING", shutdown_timeout=10.0) as worker:
        yield worker


@contextmanager
def _prompt_shutdown() -> Iterator[None]:
    """Let an in-process worker on a polling transport (``memory://``) stop at once.

    Celery's blocking loop waits up to two seconds per turn for a message
    (``drain_events(timeout=2.0)``) and only then looks whether it was told to
    stop, so every stop of such a worker took two to four seconds of nothing.
    While it runs, a turn waits a tenth of a second at most: the same loop,
    checking its state more often. Messages are delivered as before.
    """
    from kombu import Connection

    drain = Connection.drain_events

    def drain_briefly(self: Connection, **kwargs: Any) -> Any:
        timeout = kwargs.get("timeout")
        if timeout is not None and self.transport.driver_type == "memory":
            kwargs["timeout"] = min(timeout, 0.1)
        return drain(self, **kwargs)

    Connection.drain_events = drain_briefly  # type: ignore[method-assign]
    try:
        yield
    finally:
        Connection.drain_events = drain  # type: ignore[method-assign]


# The private cluster the outage tests stop and start: never the shared server, whose
# other databases (and other test runs) would go down with it.
OUTAGE_CLUSTER = "duraflow_outage"
OUTAGE_PORT = 5439
# PgBouncer's name for that cluster's database (see .ci/pgbouncer.sh).
OUTAGE_POOLED_DATABASE = "duraflow_outage"


@dataclass(frozen=True)
class OutageServer:
    """A PostgreSQL cluster of the test session's own, which the outage tests may stop."""

    version: str
    url: str
    # The same database through PgBouncer (transaction pooling).
    pgbouncer_url: str
    # Which private cluster (pg_createcluster's name and port): the outage cluster unless
    # a test made one of its own.
    cluster: str = OUTAGE_CLUSTER
    port: int = OUTAGE_PORT

    def _ctl(self, action: str, *options: str, check: bool = True) -> None:
        import subprocess

        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", self.version,
                        self.cluster, action, *options], check=check, capture_output=True)

    def ready(self, timeout: float) -> bool:
        import subprocess
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if subprocess.run(["pg_isready", "-q", "-h", "127.0.0.1", "-p", str(self.port)],
                              check=False).returncode == 0:
                return True
            time.sleep(0.2)
        return False

    @contextmanager
    def stopped(self, mode: str = "fast") -> Iterator[None]:
        """Stop the cluster for the duration of the block; always start it again.

        ``mode="immediate"`` is a crash: the server exits without a checkpoint and
        without flushing the WAL it has not flushed yet, and recovers on start.
        """
        self._ctl("stop", "-m", mode)
        try:
            yield
        finally:
            self._ctl("start", check=False)
            if not self.ready(60):
                pytest.fail("PostgreSQL did not come back after the outage", pytrace=False)


@pytest.fixture(scope="session")
def outage_pg() -> Iterator[OutageServer]:
    """A private PostgreSQL cluster on port 5439 (``pg_createcluster``), created for the
    session and dropped after it, for the tests that stop PostgreSQL."""
    import shutil
    import subprocess

    if shutil.which("pg_createcluster") is None or not os.path.isdir("/etc/postgresql"):
        _unavailable("a private PostgreSQL cluster (pg_createcluster)", f"port {OUTAGE_PORT}",
                     RuntimeError("needs Debian's postgresql-common and a server"))
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    server = OutageServer(
        version=version,
        url=f"postgresql+psycopg://postgres@127.0.0.1:{OUTAGE_PORT}/postgres",
        pgbouncer_url=os.environ.get("DURAFLOW_TEST_PGBOUNCER_URL", DEFAULT_PGBOUNCER_URL
                                     ).rsplit("/", 1)[0] + f"/{OUTAGE_POOLED_DATABASE}")
    if not os.path.isdir(f"/etc/postgresql/{version}/{OUTAGE_CLUSTER}"):
        created = subprocess.run(
            ["pg_createcluster", version, OUTAGE_CLUSTER, "-p", str(OUTAGE_PORT),
             "--", "--auth=trust"], check=False, capture_output=True, text=True)
        if created.returncode != 0:
            _unavailable("a private PostgreSQL cluster (pg_createcluster)",
                         f"port {OUTAGE_PORT}", RuntimeError(created.stderr.strip()))
    server._ctl("start", check=False)
    if not server.ready(60):
        _unavailable("the private PostgreSQL cluster", server.url,
                     RuntimeError("it did not start"))
    try:
        yield server
    finally:
        subprocess.run(["pg_dropcluster", "--stop", version, OUTAGE_CLUSTER],
                       check=False, capture_output=True)


def wait_for_status(app: Celery, task_id: str, status: str, timeout: float = 15.0) -> Any:
    """Poll the store until run ``task_id`` has ``status``; return its view (get_run)."""
    import time

    from celery_duraflow import get_run

    deadline = time.monotonic() + timeout
    run = None
    while time.monotonic() < deadline:
        run = get_run(task_id, app=app)
        if run is not None and run.status == status:
            return run
        time.sleep(0.02)
    raise AssertionError(f"run {task_id} is {run.status if run else 'unknown'}, not {status}")


# -- the library's clock, set by a test --------------------------------------------------------

#: Where the ``clock`` fixture starts: a fixed moment, so that slot times are known.
CLOCK_START = datetime(2026, 6, 1, 12, 0, 0, tzinfo=UTC)


class Clock:
    """The library's clock during a test: still until the test moves it."""

    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def to(self, moment: datetime) -> None:
        self.now = moment

    def advance(self, **delta: float) -> None:
        self.now += timedelta(**delta)


@pytest.fixture
def clock() -> Iterator[Clock]:
    """The library's clock for the test, starting at CLOCK_START; put back after."""
    fake = Clock(CLOCK_START)
    previous = _clock.use(fake)
    yield fake
    _clock.use(previous)
