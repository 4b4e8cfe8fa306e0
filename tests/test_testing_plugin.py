"""The pytest plugin (celery_duraflow.testing): a user's test files, run in a pytest of their own.

Each test writes the files a user of the library would write (a test module,
sometimes a conftest or an ini file) into a fresh directory and runs pytest on
them with ``pytester``, in a subprocess: the plugin is found through its
``pytest11`` entry point, as in a user's project. The stores, the broker and
the databases are real.
"""

from __future__ import annotations

import gc
import json
import textwrap
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery.signals import task_prerun
from sqlalchemy import create_engine, text

from celery_duraflow import _clock
from celery_duraflow._store import all_stores
from celery_duraflow.signals import step_replayed, step_started

pytest_plugins = ["pytester"]

#: Options of every inner session. This repository's own pytest configuration switches
#: pytest-celery off (the inner sessions use celery.contrib.pytest, as it does), and
#: pytest-django would read the DJANGO_SETTINGS_MODULE that the outer session set.
SESSION_OPTIONS = ("-p", "no:celery", "-p", "no:django", "-p", "no:cacheprovider")


def run_session(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """Run pytest on the files written into ``pytester.path``, in a subprocess."""
    return pytester.runpytest_subprocess(*SESSION_OPTIONS, *args, timeout=240)


@pytest.fixture(autouse=True)
def user_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inner sessions do not inherit the Django project this repository's tests set up
    (Celery's Django fix-up would import its settings)."""
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)


@pytest.fixture
def sqlite_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """No database named for test stores: each test gets a new SQLite file."""
    monkeypatch.delenv("DURAFLOW_TEST_DATABASE_URL", raising=False)


# The app of the user's test files: an app of their own, made the duraflow_app, with its
# tasks kept to it (shared=False), and a store setting the fixtures must not use.
USER_APP = '''
import functools
from datetime import timedelta

import pytest
from celery import Celery

from celery_duraflow import (DurableTask, SignalTimeout, child, sleep, step,
                             wait_for_signal)

app = Celery("shop", broker="memory://", set_as_current=False)
app.conf.update(result_backend="cache+memory://",
                duraflow_database_url="sqlite:///yesterdays-runs.sqlite3")
app.task = functools.partial(app.task, shared=False)


@pytest.fixture
def duraflow_app():
    return app
'''


def test_plugin_is_registered_through_its_entry_point_and_inert(
        pytester: pytest.Pytester, sqlite_default: None) -> None:
    """The plugin loads from its pytest11 entry point and changes nothing for tests that use none
    of its fixtures; by default duraflow_app is Celery's current app."""
    pytester.makepyfile(test_a_plain='''
        from celery import current_app

        from celery_duraflow import _clock
        from celery_duraflow._store import all_stores


        def test_untouched(request):
            plugin = request.config.pluginmanager.get_plugin("duraflow")
            assert plugin is not None and plugin.__name__ == "celery_duraflow.testing.plugin"
            assert _clock._source is None
            assert all_stores() == []
            assert current_app.conf.task_always_eager is False
    ''', test_b_default_app='''
        from celery import Celery

        from celery_duraflow import DurableTask, step

        app = Celery("proj", broker="memory://")  # the current app from here on


        @app.task(base=DurableTask)
        def hello():
            with step("greet") as s:
                s.result = "hello"
            return s.result


        def test_default_app(duraflow_store):
            assert duraflow_store.app is app and duraflow_store.eager
            assert duraflow_store.start(hello).result == "hello"


        def test_default_app_restored():
            assert app.conf.task_always_eager is False
            assert app.conf.get("duraflow_database_url") is None
    ''')
    run_session(pytester).assert_outcomes(passed=3)
    listing = run_session(pytester, "--fixtures").stdout.str()
    for name in ("duraflow_app", "duraflow_database_url", "duraflow_eager", "duraflow_store",
                 "duraflow_clock"):
        assert f"{name} " in listing, name
    assert "--duraflow-database-url" in run_session(pytester, "--help").stdout.str()
    assert not (pytester.path / "duraflow.sqlite3").exists()


def test_each_test_gets_an_empty_store_and_the_app_is_put_back(
        pytester: pytest.Pytester, sqlite_default: None) -> None:
    """A fixed task id used by two tests (and two sessions) never finds an earlier test's run,
    and the app's settings and parsed configuration are restored after each test."""
    pytester.makepyfile(test_isolation=USER_APP + '''

from celery_duraflow._config import config_for_app

PARSED = config_for_app(app)  # parsed and cached on the app before any test


@app.task(base=DurableTask)
def record(label):
    with step("record") as s:
        s.result = label
    return s.result


def test_first(duraflow_store):
    assert duraflow_store.runs() == []
    run = duraflow_store.start(record, "first", task_id="order-1")
    assert run.status == "succeeded" and run.result == "first"


def test_second(duraflow_store):
    assert duraflow_store.get_run("order-1") is None
    assert duraflow_store.runs() == []
    run = duraflow_store.start(record, "second", task_id="order-1")
    assert run.result == "second"
    assert duraflow_store.steps_run(run) == ["record"]
    assert "yesterdays-runs" not in duraflow_store.database_url


def test_settings_put_back():
    assert app.conf.duraflow_database_url == "sqlite:///yesterdays-runs.sqlite3"
    assert "task_always_eager" not in app.conf.changes
    assert "duraflow_table_prefix" not in app.conf.changes
    assert app.conf.task_always_eager is False
    assert app._duraflow_config is PARSED
''')
    run_session(pytester).assert_outcomes(passed=3)
    run_session(pytester).assert_outcomes(passed=3)  # the next session starts empty too
    assert not (pytester.path / "yesterdays-runs.sqlite3").exists()
    assert not (pytester.path / "duraflow.sqlite3").exists()


@pytest.fixture
def own_queue(redis_url: str) -> Iterator[tuple[str, redis.Redis]]:
    """A queue (and exchange) name of this test's own on the real Redis broker."""
    name = f"plugin-{uuid.uuid4().hex[:10]}"
    client = redis.Redis.from_url(redis_url)
    yield name, client
    for key in client.keys(f"*{name}*"):
        client.delete(key)
    client.close()


@pytest.mark.redis
def test_eager_store_runs_signals_children_wakeups_and_cancel_here_with_no_broker_message(
        pytester: pytest.Pytester, sqlite_default: None, redis_url: str,
        own_queue: tuple[str, redis.Redis]) -> None:
    """With duraflow_store, signals, child runs, clock wake-ups, cancel() and retry_run() run in
    the test's process, and nothing reaches the app's real Redis broker."""
    queue, client = own_queue
    pytester.makepyfile(test_no_broker=textwrap.dedent(f'''
        import functools
        from datetime import timedelta

        import pytest
        from celery import Celery

        from celery_duraflow import (DurableTask, cancel, child, retry_run, send_signal,
                                     sleep, step, wait_for_signal)

        app = Celery("orders", broker={redis_url!r}, set_as_current=False)
        app.conf.update(result_backend="cache+memory://", task_default_queue={queue!r},
                        task_default_exchange={queue!r}, task_default_routing_key={queue!r})
        app.task = functools.partial(app.task, shared=False)
        undone = []
        failing = ["yes"]


        @pytest.fixture
        def duraflow_app():
            return app


        @app.task(base=DurableTask)
        def ship(order):
            with step("label") as s:
                s.result = f"label {{order}}"
            return s.result


        @app.task(base=DurableTask)
        def approve(order):
            with step("reserve", compensate=lambda r: undone.append(r)) as s:
                s.result = f"reserved {{order}}"
            answer = wait_for_signal("approval", timeout=timedelta(days=1))
            label = child("ship", ship.s(order))
            return f"{{answer}}: {{label}}"


        @app.task(base=DurableTask)
        def nap(order):
            sleep("cool-off", timedelta(hours=1))
            with step("after") as s:
                s.result = order
            return s.result


        @app.task(base=DurableTask)
        def flaky(order):
            with step("once") as s:
                if failing:
                    failing.pop()
                    raise RuntimeError("down")
                s.result = order
            return s.result


        def test_signal_and_child(duraflow_store):
            run = duraflow_store.start(approve, 1)
            assert run.status == "waiting"
            assert send_signal(run.task_id, "approval", "ok", app=app) is True
            run = duraflow_store.run_view(run)
            assert run.status == "succeeded" and run.result == "ok: label 1"
            assert len(duraflow_store.runs()) == 2  # the child's run too


        def test_cancel_runs_compensation(duraflow_store):
            run = duraflow_store.start(approve, 2)
            assert cancel(run.task_id, app=app) is True
            assert duraflow_store.run_view(run).status == "cancelled"
            assert undone == ["reserved 2"]


        def test_wake_up_and_retry(duraflow_store, duraflow_clock):
            run = duraflow_store.start(nap, 3)
            assert duraflow_clock.advance(hours=1) == [run.task_id]
            assert duraflow_store.run_view(run).result == 3
            failed = duraflow_store.start(flaky, 4)
            assert failed.status == "failed"
            retry_run(failed.task_id, app=app)
            assert duraflow_store.run_view(failed).status == "succeeded"


        def test_publish_reaches_the_broker_outside_the_fixtures():
            # The same app, not eager: a message does reach the queue the outer test reads.
            assert app.conf.task_always_eager is False
            app.send_task("orders.control", args=[1])
    '''))
    run_session(pytester).assert_outcomes(passed=4)
    # Only the control message of the last test; nothing from the three durable tests.
    messages = client.lrange(queue, 0, -1)
    assert [json.loads(message)["headers"]["task"] for message in messages] == [
        "orders.control"]
    # Besides that queue, only the bindings the control message's publish declared.
    assert all(key == queue or key.startswith("_kombu.binding")
               for key in (key.decode() for key in client.keys(f"*{queue}*")))


def test_clock_fires_day_long_sleep_and_signal_timeout_after_advance(
        pytester: pytest.Pytester, sqlite_default: None) -> None:
    """duraflow_clock.advance() wakes a one-day sleep and times out a one-day wait_for_signal at
    the moment they fall due, in order, with stored timestamps on the test clock."""
    pytester.makepyfile(test_clock=USER_APP + '''

from datetime import datetime, timezone

from celery_duraflow import _clock


@app.task(base=DurableTask)
def remind(user):
    sleep("a-day", timedelta(days=1))
    with step("send") as s:
        s.result = f"reminded {user}"
    return s.result


@app.task(base=DurableTask)
def approval(order):
    try:
        return wait_for_signal("approved", timeout=timedelta(days=1))
    except SignalTimeout:
        with step("escalate") as s:
            s.result = f"escalated {order}"
        return s.result


@app.task(base=DurableTask)
def two_naps():
    sleep("first", 3600)
    sleep("second", 3600)
    with step("up") as s:
        s.result = "up"
    return s.result


def test_day_long_sleep(duraflow_store, duraflow_clock):
    start = duraflow_clock.now()
    run = duraflow_store.start(remind, "ada")
    assert run.status == "sleeping" and run.created_at == start
    assert run.wake_at == start + timedelta(days=1)
    assert duraflow_clock.advance(hours=23, minutes=59) == []
    assert duraflow_store.run_view(run).status == "sleeping"
    assert duraflow_clock.advance(timedelta(minutes=1)) == [run.task_id]
    run = duraflow_store.run_view(run)
    assert run.status == "succeeded" and run.result == "reminded ada"
    assert run.finished_at == start + timedelta(days=1) == duraflow_clock.now()
    duraflow_store.assert_step_ran_once(run, "send")


def test_signal_timeout(duraflow_store, duraflow_clock):
    run = duraflow_store.start(approval, 7)
    assert run.status == "waiting"
    assert duraflow_clock.advance(seconds=86_400) == [run.task_id]
    run = duraflow_store.run_view(run)
    assert run.status == "succeeded" and run.result == "escalated 7"
    assert duraflow_store.steps_run(run) == ["escalate"]


def test_signal_before_timeout(duraflow_store, duraflow_clock):
    run = duraflow_store.start(approval, 8)
    duraflow_clock.advance(hours=12)
    run = duraflow_store.send_signal(run, "approved", "yes")
    assert run.status == "succeeded" and run.result == "yes"
    assert run.finished_at == duraflow_clock.now()
    assert duraflow_clock.advance(days=2) == []


def test_sleeps_in_a_row(duraflow_store, duraflow_clock):
    start = duraflow_clock.now()
    run = duraflow_store.start(two_naps)
    assert duraflow_clock.advance(hours=3) == [run.task_id, run.task_id]
    run = duraflow_store.run_view(run)
    assert run.status == "succeeded"
    assert run.finished_at == start + timedelta(hours=2)
    assert duraflow_clock.now() == start + timedelta(hours=3)


def test_only_forward(duraflow_store, duraflow_clock):
    with pytest.raises(ValueError, match="only moves forward"):
        duraflow_clock.advance(hours=-1)
    later = (duraflow_clock.now() + timedelta(days=3)).replace(tzinfo=None)  # naive: UTC
    assert duraflow_clock.advance_to(later) == []
    assert duraflow_clock.now() == later.replace(tzinfo=timezone.utc)


def test_system_clock_back():
    assert _clock._source is None
    assert abs(_clock.now() - datetime.now(timezone.utc)) < timedelta(minutes=1)
''')
    run_session(pytester).assert_outcomes(passed=6)


def _tables_named(url: str, prefix: str) -> list[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT table_name FROM information_schema.tables WHERE table_name LIKE :p"),
                {"p": prefix.replace("_", r"\_") + "%"})
            return [row[0] for row in rows]
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_postgres_store_gets_a_fresh_prefix_and_its_tables_are_dropped(
        pytester: pytest.Pytester, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pointed at PostgreSQL (option, ini key or environment variable, in that precedence), each
    test gets tables under a new prefix, and they are dropped after the test."""
    pytester.makepyfile(test_pg=USER_APP + f'''

from pathlib import Path

from sqlalchemy import create_engine, text


@app.task(base=DurableTask)
def record(label):
    with step("record") as s:
        s.result = label
    return s.result


def tables(prefix):
    engine = create_engine({pg_url!r})
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT table_name FROM information_schema.tables "
                                 "WHERE table_name LIKE :p"), {{"p": prefix + "%"}})
        names = sorted(row[0] for row in rows)
    engine.dispose()
    return names


@pytest.mark.parametrize("label", ["one", "two"])
def test_store_on_postgres(duraflow_store, label):
    assert duraflow_store.database_url.startswith("postgresql")
    prefix = duraflow_store.table_prefix
    with Path("prefixes.txt").open("a") as out:
        out.write(prefix + "\\n")
    assert duraflow_store.runs() == []
    run = duraflow_store.start(record, label, task_id="fixed-id")
    assert run.result == label
    assert prefix + "runs" in tables(prefix)
''')
    unreachable = "postgresql+psycopg://nobody@127.0.0.1:9/nothing"
    monkeypatch.setenv("DURAFLOW_TEST_DATABASE_URL", unreachable)
    run_session(pytester, f"--duraflow-database-url={pg_url}").assert_outcomes(passed=2)
    (pytester.path / "pytest.ini").write_text(f"[pytest]\nduraflow_database_url = {pg_url}\n")
    run_session(pytester).assert_outcomes(passed=2)
    (pytester.path / "pytest.ini").unlink()
    monkeypatch.setenv("DURAFLOW_TEST_DATABASE_URL", pg_url)
    run_session(pytester).assert_outcomes(passed=2)
    prefixes = (pytester.path / "prefixes.txt").read_text().split()
    assert len(prefixes) == 6 and len(set(prefixes)) == 6
    for prefix in prefixes:
        assert _tables_named(pg_url, prefix) == [], prefix
    assert not (pytester.path / "duraflow.sqlite3").exists()


def test_works_beside_celery_contrib_pytest(pytester: pytest.Pytester,
                                           sqlite_default: None) -> None:
    """A test file using celery.contrib.pytest's celery_app and celery_worker works with the
    duraflow fixtures, eager or through the in-process worker, and celery_app stays as it was."""
    pytester.makeconftest('''
        import pytest

        pytest_plugins = ("celery.contrib.pytest",)


        @pytest.fixture(scope="session")
        def celery_config():
            return {"broker_url": "memory://", "result_backend": "cache+memory://",
                    "broker_transport_options": {"polling_interval": 0.05}}
    ''')
    pytester.makepyfile(test_contrib='''
        import pytest
        from celery import shared_task

        from celery_duraflow import DurableTask, step, wait_for_signal


        @shared_task
        def add(x, y):
            return x + y


        @shared_task(base=DurableTask)
        def approve(order):
            answer = wait_for_signal("ok")
            with step("ship") as s:
                s.result = f"{answer} {order}"
            return s.result


        def test_worker_alone(celery_app, celery_worker):
            assert add.delay(2, 3).get(timeout=10) == 5


        # depends_on_current_app: the shared tasks resolve to celery_app, as Celery documents.
        def test_eager_on_celery_app(celery_app, depends_on_current_app, duraflow_store,
                                     duraflow_clock):
            assert duraflow_store.app is celery_app and celery_app.conf.task_always_eager
            run = duraflow_store.start(approve, 1)
            assert run.status == "waiting"
            run = duraflow_store.send_signal(run, "ok", "shipped")
            assert run.status == "succeeded" and run.result == "shipped 1"


        @pytest.mark.parametrize("duraflow_eager", [False])
        def test_through_the_worker(celery_app, depends_on_current_app, celery_worker,
                                    duraflow_store):
            assert duraflow_store.app is celery_app and not celery_app.conf.task_always_eager
            result = approve.delay(2)
            run = duraflow_store.wait_for_status(result, "waiting")
            duraflow_store.send_signal(run, "ok", "sent")
            run = duraflow_store.wait_for_status(result, "succeeded")
            assert run.result == "sent 2"
            duraflow_store.assert_step_ran_once(run, "ship")
            assert duraflow_store.steps_replayed(run) == []


        def test_celery_app_as_configured(celery_app):
            assert celery_app.conf.task_always_eager is False
            assert celery_app.conf.get("duraflow_database_url") is None
    ''')
    run_session(pytester).assert_outcomes(passed=4)


def _receivers() -> dict[str, int]:
    """Live receivers of each signal the fixtures touch. A receiver held by a weak
    reference whose object was collected is left in the list until the signal is next
    sent: counting it would make the figure depend on when the collector ran."""
    gc.collect()

    def live(signal: Any) -> int:
        return sum(1 for _key, receiver in signal.receivers
                   if not (isinstance(receiver, weakref.ReferenceType) and receiver() is None))

    return {"step_started": live(step_started), "step_replayed": live(step_replayed),
            "task_prerun": live(task_prerun)}


def test_fixtures_leave_the_process_as_they_found_it(pytester: pytest.Pytester,
                                                     sqlite_default: None) -> None:
    """After tests using the fixtures, in this very process: the system clock again, no store
    left open, no signal receiver left connected."""
    pytester.makepyfile(test_inprocess=USER_APP + '''

@app.task(base=DurableTask)
def nap():
    sleep("nap", 60)
    with step("up") as s:
        s.result = "up"
    return s.result


def test_nap(duraflow_store, duraflow_clock):
    run = duraflow_store.start(nap)
    duraflow_clock.advance(minutes=1)
    duraflow_store.assert_step_ran_once(run, "up")
''')
    clock_before = _clock._source
    stores_before = {id(store) for store in all_stores()}
    receivers_before = _receivers()
    result: Any = pytester.runpytest_inprocess(*SESSION_OPTIONS)
    result.assert_outcomes(passed=1)
    assert _clock._source is clock_before
    assert {id(store) for store in all_stores()} == stores_before
    assert _receivers() == receivers_before


def test_exported_history_replays_in_a_users_test(pytester: pytest.Pytester,
                                                   sqlite_default: None) -> None:
    """duraflow_store.assert_replays(file) passes for code that carries the exported run on and
    fails, naming the divergence, for code that inserted a step before its wait."""
    from celery import Celery

    from celery_duraflow import DurableTask, export_history, step, wait_for_signal
    from celery_duraflow.testing import isolated_store

    app = Celery("shop-prod", broker="memory://", set_as_current=False)
    app.conf.update(result_backend="cache+memory://")

    @app.task(base=DurableTask, name="shop.order", shared=False)
    def order(number: str) -> Any:
        with step("reserve") as s:
            s.result = number
        return wait_for_signal("approval")

    with isolated_store(app, directory=pytester.path) as store:
        run = store.start(order, "o-7")
        assert run.status == "waiting"
        (pytester.path / "order-o-7.json").write_text(export_history(run.task_id, app=app))
    pytester.makepyfile(test_replays=USER_APP + '''

import pytest

from celery_duraflow import step, wait_for_signal


def make(extra_step):
    app.tasks.pop("shop.order", None)  # Celery keeps the first task of a name otherwise

    @app.task(base=DurableTask, name="shop.order")
    def order(number):
        if extra_step:
            with step("fraud-check") as s:
                s.result = "ok"
        with step("reserve") as s:
            s.result = number
        return wait_for_signal("approval")


def test_same_code(duraflow_store):
    make(extra_step=False)
    result = duraflow_store.assert_replays("order-o-7.json")
    assert result.stopped_at == "approval"


def test_inserted_step(duraflow_store):
    make(extra_step=True)
    with pytest.raises(AssertionError, match="recorded 'reserve' there, the code now reaches "
                                             "'fraud-check'"):
        duraflow_store.assert_replays("order-o-7.json")
''')
    run_session(pytester).assert_outcomes(passed=2)


# A user's conftest giving the tests their own tables (what atomic steps write), and the
# tests that use them: the rows an atomic step wrote are there once, and a test after it
# starts with the tables empty again.
USER_TABLES = USER_APP + '''
import sqlalchemy as sa

metadata = sa.MetaData()
orders = sa.Table(f"orders_{{TAG}}", metadata, sa.Column("id", sa.Integer, primary_key=True),
                  sa.Column("cart", sa.String(40), nullable=False))
SEEDED = []


def seed(conn):
    SEEDED.append(conn.execute(sa.select(sa.func.count()).select_from(orders)).scalar())


@pytest.fixture
def duraflow_tables():
    return [metadata, seed]


@app.task(base=DurableTask, autoretry_for=(ConnectionError,), max_retries=2)
def place_order(cart, fail_times):
    with step("save-order", atomic=True) as s:
        s.result = s.connection.execute(orders.insert().values(cart=cart)).inserted_primary_key[0]
    with step("notify") as s:
        if fail_times > place_order.request.retries:
            raise ConnectionError("mailer down")
        s.result = "sent"
    return s.result


def count(duraflow_store):
    with duraflow_store.engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(orders)).scalar()


@pytest.mark.parametrize("cart", ["c1", "c2"])
def test_atomic_step_writes_its_row_once(duraflow_store, cart):
    run = duraflow_store.start(place_order, cart, 2)
    assert run.status == "succeeded"
    assert SEEDED[-1] == 0                   # the function saw the new, empty table
    assert count(duraflow_store) == 1        # the retries replayed the atomic step
    duraflow_store.assert_step_ran_once(run, "save-order")
'''


def test_duraflow_tables_creates_the_tables_atomic_steps_write(
        pytester: pytest.Pytester, sqlite_default: None) -> None:
    """Overriding duraflow_tables creates a test's own tables beside each fresh SQLite store."""
    pytester.makepyfile(test_orders=USER_TABLES.replace("{{TAG}}", "lite"))
    run_session(pytester).assert_outcomes(passed=2)


@pytest.mark.postgres
def test_duraflow_tables_are_created_and_dropped_on_postgres(
        pytester: pytest.Pytester, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On PostgreSQL the duraflow_tables MetaData tables are created per test and then dropped."""
    tag = uuid.uuid4().hex[:8]
    pytester.makepyfile(test_orders=USER_TABLES.replace("{{TAG}}", tag))
    monkeypatch.setenv("DURAFLOW_TEST_DATABASE_URL", pg_url)
    run_session(pytester).assert_outcomes(passed=2)
    assert _tables_named(pg_url, f"orders_{tag}") == []


def test_duraflow_tables_refuses_what_it_cannot_create(
        pytester: pytest.Pytester, sqlite_default: None) -> None:
    """A duraflow_tables that is neither MetaData nor a function fails the test, saying so."""
    pytester.makepyfile(test_bad=USER_APP + '''

@pytest.fixture
def duraflow_tables():
    return ["CREATE TABLE orders (id INTEGER)"]


def test_uses_the_store(duraflow_store):
    pass
''')
    result = run_session(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*must be SQLAlchemy MetaData, a function taking a "
                                 "Connection*"])
