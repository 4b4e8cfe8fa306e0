"""The Django example (examples/django), run the way its README says: one command.

``python -m examples.django`` runs in a subprocess of its own, with its own
settings module (``shopsite.settings``; this session's DJANGO_SETTINGS_MODULE is
not passed on), from an empty directory. The tests read what it prints and
what it left in the database: one order row, one charge, and the atomic
``save-order`` step replayed from the store on the retry rather than run again.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from celery_duraflow import RunView, get_run
from celery_duraflow._store import close_all_stores

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 150.0
RUN_LINE = re.compile(r"^run (\S+): (\w+) after (\d+) attempts", re.MULTILINE)
STEP_LINE = re.compile(r"^\s+step (\S+)\s+(atomic|plain)\s+(\w+)\s+body ran (\d+)x$",
                       re.MULTILINE)
CHECKOUT_LINE = re.compile(r"^checkout (\S+) saved", re.MULTILINE)
# Every migration the package ships, in order: a fresh database gets all of them.
DURAFLOW_MIGRATIONS = [
    f"duraflow.{path.stem}" for path in sorted(
        (REPO_ROOT / "celery_duraflow" / "contrib" / "django" / "migrations").glob("0*.py"))]
EXPECTED_STEPS = [("save-order", "atomic", "completed", 1),
                  ("charge-card", "plain", "completed", 2),
                  ("mark-paid", "atomic", "completed", 1)]


def _env(**extra: str) -> dict[str, str]:
    """PATH, the repository on PYTHONPATH, and ``extra``: no DJANGO_SETTINGS_MODULE."""
    env = {"PATH": os.environ.get("PATH", os.defpath), "PYTHONPATH": str(REPO_ROOT)}
    if "COVERAGE_PROCESS_START" in os.environ:
        env["COVERAGE_PROCESS_START"] = os.environ["COVERAGE_PROCESS_START"]
    env.update(extra)
    return env


def _run_example(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "examples.django", *args]
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the example turns SIGTERM into a clean stop of its worker
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"the example did not finish in {TIMEOUT:.0f}s\nstdout:\n{out}\n"
                    f"stderr:\n{err}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def _check_output(result: subprocess.CompletedProcess[str], *,
                  fresh: bool = True) -> tuple[str, str]:
    """What every successful run prints; returns (task id, checkout reference).

    ``fresh``: the database was empty, so migrate created the shop's and the store's tables.
    """
    assert result.returncode == 0, _explain(result)
    out = result.stdout
    if fresh:
        expected = ", ".join([*DURAFLOW_MIGRATIONS, "orders.0001_initial"])
        assert re.search(r"^migrate: applied \d+ migrations, among them "
                         + re.escape(expected) + "$", out, re.MULTILINE), _explain(result)
    else:
        assert "migrate: nothing to apply" in out, _explain(result)
    assert "place_order was sent with delay_on_commit()" in out, _explain(result)
    match = RUN_LINE.search(out)
    assert match is not None, _explain(result)
    task_id, status, attempts = match.groups()
    assert (status, attempts) == ("succeeded", "2"), _explain(result)
    steps = [(key, kind, status, int(runs)) for key, kind, status, runs in STEP_LINE.findall(out)]
    assert steps == EXPECTED_STEPS, _explain(result)
    assert "  attempt 2 replayed from the store: save-order\n" in out, _explain(result)
    assert re.search(r"^orders: 1 row for checkout \S+ \(order \d+ paid, charge ch_\d+\)$",
                     out, re.MULTILINE), _explain(result)
    assert "charges: 1 (the payment API got 2 requests," in out, _explain(result)
    assert "\nOK: " in out and "UNEXPECTED" not in out, _explain(result)
    assert "Traceback" not in result.stderr, _explain(result)
    checkout = CHECKOUT_LINE.search(out)
    assert checkout is not None, _explain(result)
    return task_id, checkout.group(1)


def _check_database(url: str, task_id: str, reference: str) -> None:
    """The database itself: one order row (written by this run), one charge, two requests."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            orders = conn.execute(text(
                "SELECT o.id, o.status, o.task_id, o.charge_id FROM orders_order o "
                "JOIN orders_checkout c ON c.id = o.checkout_id WHERE c.reference = :ref"),
                {"ref": reference}).all()
            assert len(orders) == 1, orders
            order_id, status, order_task_id, charge_id = orders[0]
            assert (status, order_task_id) == ("paid", task_id)
            charges = conn.execute(text(
                "SELECT id, requests FROM orders_charge WHERE order_id = :order"),
                {"order": order_id}).all()
            assert [(f"ch_{pk}", requests) for pk, requests in charges] == [(charge_id, 2)]
    finally:
        engine.dispose()


def _check_store(url: str, task_id: str) -> None:
    """The step store, in the same database: the atomic step ran once, and was replayed."""
    app = Celery("django-example-check", set_as_current=False)
    app.conf.update(duraflow_database_url=url, duraflow_auto_migrate=False)
    try:
        run: RunView | None = get_run(task_id, app=app)
    finally:
        close_all_stores()
    assert run is not None and run.status == "succeeded" and run.attempts == 2, run
    assert [(s.key, s.status, s.attempts) for s in run.steps] == [
        (key, status, runs) for key, _kind, status, runs in EXPECTED_STEPS]
    assert run.result["replayed"] == ["save-order"]
    assert run.step("save-order").result == {"order_id": run.result["order_id"],
                                             "amount_cents": 12_900}


# -- SQLite, a worker thread: no service needed ----------------------------------------------


def test_example_runs_with_no_settings_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """`python -m examples.django` with no settings: one order, one charge, save-order replayed."""
    result = _run_example(cwd=tmp_path, env=_env())
    _check_output(result)
    assert "broker: memory://; worker: a Celery worker thread in this process" in result.stdout
    assert "database: sqlite:///" in result.stdout
    assert list(tmp_path.iterdir()) == []  # its SQLite file lived in a temporary directory


def test_example_on_a_sqlite_file_leaves_one_order_and_one_charge(tmp_path: Path) -> None:
    """EXAMPLE_DATABASE_URL on a SQLite file: the file holds 1 order, 1 charge and the run."""
    url = f"sqlite:///{tmp_path / 'shop.sqlite3'}"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    result = _run_example(cwd=workdir, env=_env(EXAMPLE_DATABASE_URL=url))
    task_id, reference = _check_output(result)
    _check_database(url, task_id, reference)
    _check_store(url, task_id)

    # A second order on the same file: migrate has nothing left to do, and each order
    # still gets exactly one row and one charge.
    again = _run_example(cwd=workdir, env=_env(EXAMPLE_DATABASE_URL=url))
    second_id, second_ref = _check_output(again, fresh=False)
    assert second_ref != reference
    _check_database(url, second_id, second_ref)


# -- PostgreSQL, Redis and a real `celery worker` process -------------------------------------


@pytest.fixture
def example_services(pg_url: str, redis_url: str) -> Iterator[tuple[str, str, str]]:
    """A PostgreSQL database and a Redis queue of this test's own; dropped afterwards.

    Yields (database URL, broker URL, queue name).
    """
    name = f"dfex_{uuid.uuid4().hex[:12]}"
    server = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        with server.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        url = make_url(pg_url).set(database=name).render_as_string(hide_password=False)
        queue = f"{name}-queue"
        yield url, redis_url, queue
    finally:
        close_all_stores()
        try:
            with server.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        finally:
            server.dispose()
        import redis

        client = redis.Redis.from_url(redis_url)
        try:
            client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
        finally:
            client.close()


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.subprocess
def test_example_on_postgres_and_redis_with_a_worker_process(
        tmp_path: Path, example_services: tuple[str, str, str]) -> None:
    """--database-url/--broker-url: a prefork worker process, 1 order, 1 charge on PostgreSQL."""
    url, broker, queue = example_services
    result = _run_example("--database-url", url, "--broker-url", broker, "--queue", queue,
                          cwd=tmp_path, env=_env())
    task_id, reference = _check_output(result)
    assert (f"queue '{queue}'; worker: `celery -A shopsite worker` (prefork x2)"
            in result.stdout), _explain(result)
    assert f"database: {make_url(url).render_as_string(hide_password=True)}" in result.stdout
    assert "worker exited with code" not in result.stderr, _explain(result)
    _check_database(url, task_id, reference)
    _check_store(url, task_id)
    assert list(tmp_path.iterdir()) == []
