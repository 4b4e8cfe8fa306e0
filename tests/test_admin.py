"""The operator commands: `celery -A proj duraflow runs|show|cancel|retry|prune|migrate`.

Each command is run through Celery's own top-level click command, given the
test's app object with ``-A`` (Celery accepts an app object there as well as a
module path), on SQLite and on PostgreSQL. Runs come from real task executions
or from the store's own methods; only timestamps are moved back in time with
an UPDATE, to make runs old.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from celery.bin.celery import celery as celery_command
from click.testing import CliRunner, Result
from sqlalchemy import create_engine, func, select, text, update

from celery_duraflow import DurableTask, get_run, patched, step, wait_for_signal
from celery_duraflow._admin import (
    list_runs,
    parse_duration,
    prune_candidates_query,
    summary_query,
    tombstones_query,
)
from celery_duraflow._config import config_for_app, load_config
from celery_duraflow._schema import LATEST_VERSION
from celery_duraflow._store import Delivery, Store, close_all_stores, store_for
from tests.conftest import drop_tables, run_worker, wait_for_status

OWNER = "cli-test-host|x|1|abc"


def duraflow(app: Celery, *args: str, columns: int = 400) -> Result:
    """Run ``celery -A <app> duraflow ARGS...``; a wide terminal unless ``columns`` says."""
    return CliRunner().invoke(celery_command, ["-A", app, "duraflow", *args],  # type: ignore[list-item]
                              env={"COLUMNS": str(columns)})


def ok(result: Result) -> list[str]:
    """The output lines of a command that must have exited 0."""
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout.splitlines()


def ok_text(result: Result) -> str:
    """The output of a command that must have exited 0."""
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def header_of(lines: list[str]) -> dict[str, str]:
    """The ``label  value`` lines at the top of `show`, as a dict."""
    width = len("attempts")
    return {line[:width].strip(): line[width + 2:] for line in lines[:lines.index("")]}


def failed(result: Result, code: int = 1) -> str:
    """The one-line error of a command that must have exited with ``code``."""
    assert result.exit_code == code, (result.output, result.exception)
    if code == 1:
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        return lines[0]
    return result.stderr


def store_of(app: Celery) -> Store:
    return store_for(config_for_app(app))


def set_times(app: Celery, task_ids: list[str], **columns: datetime) -> None:
    runs = store_of(app).tables.runs
    with store_of(app).engine.begin() as conn:
        conn.execute(update(runs).where(runs.c.task_id.in_(task_ids)).values(**columns))


def count_rows(app: Celery, table: str, task_id: str) -> int:
    store = store_of(app)
    t = getattr(store.tables, table)
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(t)
                                .where(t.c.task_id == task_id)).scalar_one())


def ids_listed(lines: list[str], candidates: list[str]) -> list[str]:
    """The candidate task ids in the order the table rows name them."""
    found = []
    for line in lines:
        first = line.split(" ", 1)[0]
        if first in candidates:
            found.append(first)
    return found


# -- durations -----------------------------------------------------------------------------


def test_durations() -> None:
    """Durations such as 30s, 15m, 2h, 1w and 1h30m parse; any other text is not a duration."""
    assert parse_duration("30s") == timedelta(seconds=30)
    assert parse_duration("15m") == timedelta(minutes=15)
    assert parse_duration("2h") == timedelta(hours=2)
    assert parse_duration(" 30D ") == timedelta(days=30)
    assert parse_duration("1w") == timedelta(weeks=1)
    assert parse_duration("1h30m") == timedelta(minutes=90)
    for bad in ("", "30", "h", "1.5h", "2 h", "-1d", "3y", "1h 30m"):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration(bad)


# -- runs ----------------------------------------------------------------------------------


@pytest.fixture
def listed(make_app: Callable[..., Celery]) -> Iterator[dict[str, Any]]:
    """Four runs: an old and a new succeeded trip, a failed one and one waiting for a signal."""
    app = make_app(eager=False)

    @app.task(base=DurableTask, name="shop.trip")
    def trip() -> str:
        with step("search") as s:
            s.result = ["LHR-101"]
        with step("book") as s:
            s.result = "booked"
        return "done"

    @app.task(base=DurableTask, name="shop.flaky")
    def flaky() -> None:
        with step("search") as s:
            s.result = 1
        raise ValueError("card declined")

    @app.task(base=DurableTask, name="shop.approve")
    def approve() -> Any:
        with step("quote") as s:
            s.result = 10
        return wait_for_signal("approval")

    old = trip.apply().id
    set_times(app, [old], created_at=datetime.now(UTC) - timedelta(days=3))
    new = trip.apply().id
    bad = flaky.apply().id
    waiting = approve.apply().id
    assert get_run(waiting, app=app).status == "waiting"  # type: ignore[union-attr]
    yield {"app": app, "old": old, "new": new, "failed": bad, "waiting": waiting,
           "all": [old, new, bad, waiting]}


def test_runs_lists_newest_first_with_steps_waits_and_counts(listed: dict[str, Any]) -> None:
    """`runs` lists newest first, with each run's status, steps done and wait, then the counts."""
    app, everyone = listed["app"], listed["all"]
    lines = ok(duraflow(app, "runs"))
    assert lines[0].split()[:3] == ["TASK", "ID", "TASK"]
    assert ids_listed(lines, everyone) == [listed["waiting"], listed["failed"], listed["new"],
                                           listed["old"]]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert rows[listed["waiting"]].split()[1:5] == ["shop.approve", "waiting", "1", "1/2"]
    assert rows[listed["waiting"]].endswith("signal 'approval'")
    assert rows[listed["failed"]].split()[1:5] == ["shop.flaky", "failed", "1", "1/1"]
    assert rows[listed["new"]].split()[1:5] == ["shop.trip", "succeeded", "1", "2/2"]
    assert lines[-1] == "4 run(s) match: waiting 1, succeeded 2, failed 1 (all shown)"


def test_runs_filters(listed: dict[str, Any]) -> None:
    """`runs` filters by status, task and age, and --limit shows the newest of the matches."""
    app, everyone = listed["app"], listed["all"]

    def listing(*options: str) -> list[str]:
        return ids_listed(ok(duraflow(app, "runs", *options)), everyone)

    assert listing("--status", "failed") == [listed["failed"]]
    both = [listed["waiting"], listed["new"], listed["old"]]
    assert listing("--status", "succeeded,waiting") == both
    assert listing("--status", "waiting", "--status", "succeeded") == both
    assert listing("--task", "shop.trip") == [listed["new"], listed["old"]]
    assert listing("--task", "shop.trip", "--status", "failed") == []
    assert listing("--older-than", "1d") == [listed["old"]]
    assert listing("--newer-than", "1d") == [listed["waiting"], listed["failed"], listed["new"]]
    assert listing("--newer-than", "4d", "--older-than", "2d") == [listed["old"]]
    limited = ok(duraflow(app, "runs", "--limit", "2"))
    assert ids_listed(limited, everyone) == [listed["waiting"], listed["failed"]]
    assert limited[-1].startswith("4 run(s) match: ")
    assert limited[-1].endswith("(newest 2 shown; --limit shows more)")
    assert ok(duraflow(app, "runs", "--status", "succeeded"))[-1] == (
        "2 run(s) match: succeeded 2 (all shown)")

    assert ok(duraflow(app, "runs", "--status", "cancelled")) == ["no runs match these filters"]
    assert ok(duraflow(app, "runs", "--task", "nope")) == ["no runs match these filters"]
    assert "'bogus' is not one of" in failed(duraflow(app, "runs", "--status", "bogus"), 2)
    assert "not a duration" in failed(duraflow(app, "runs", "--older-than", "5"), 2)
    failed(duraflow(app, "runs", "--limit", "0"), 2)

    # The library function behind it, with several statuses and a task name at once.
    store = store_of(app)
    records = list_runs(store, statuses=["succeeded", "failed"], task_name="shop.trip", limit=1)
    assert [r.task_id for r in records] == [listed["new"]]


def test_runs_json(listed: dict[str, Any]) -> None:
    """`runs --json` gives the listing as data, with aware times and never arguments or results."""
    app = listed["app"]
    data = json.loads(ok_text(duraflow(app, "runs", "--json")))
    assert [item["task_id"] for item in data] == [listed["waiting"], listed["failed"],
                                                  listed["new"], listed["old"]]
    waiting = data[0]
    assert (waiting["status"], waiting["wait_kind"], waiting["waiting_for"]) == (
        "waiting", "signal", "approval")
    assert (waiting["steps_completed"], waiting["steps_total"]) == (1, 2)
    assert "card declined" in data[1]["error"]
    for item in data:
        created = datetime.fromisoformat(item["created_at"])
        assert created.tzinfo is not None
        assert "args" not in item and "result" not in item
    assert datetime.fromisoformat(data[2]["finished_at"]) >= datetime.fromisoformat(
        data[2]["created_at"])
    only = json.loads(ok_text(duraflow(app, "runs", "--json", "--status", "failed",
                                       "--limit", "1")))
    assert [item["task_id"] for item in only] == [listed["failed"]]
    assert json.loads(ok_text(duraflow(app, "runs", "--json", "--task", "nope"))) == []


def test_runs_table_fits_a_narrow_terminal(listed: dict[str, Any]) -> None:
    """Narrower terminals cut the task name and the wait, then leave columns out."""
    wide = ok(duraflow(listed["app"], "runs"))
    for columns in (120, 100, 80):
        lines = ok(duraflow(listed["app"], "runs", columns=columns))
        assert all(len(line) <= columns for line in lines[:-1]), (columns, lines)
        # Task ids are never cut: they are what the other commands take.
        assert ids_listed(lines, listed["all"]) == ids_listed(wide, listed["all"])
        assert lines[0].split()[:4] == ["TASK", "ID", "TASK", "STATUS"]
        assert lines[-1] == wide[-1]


# -- show ----------------------------------------------------------------------------------


def test_show_prints_the_header_and_the_timeline(make_app: Callable[..., Celery]) -> None:
    """`show` prints a run's header and every step in order, outputs cut short; --json has all."""
    app = make_app(eager=False)
    undone: Counter[str] = Counter()

    def refund(charge: dict[str, Any]) -> str:
        undone[charge["id"]] += 1
        return f"refunded {charge['id']}"

    @app.task(base=DurableTask, name="shop.order")
    def order(user: str) -> None:
        with step("search") as s:
            s.result = {"user": user, "note": "x" * 200}
        if patched("fast-path"):
            with step("charge", compensate=refund) as s:
                s.result = {"id": "ch_1", "cents": 2500}
        with step("ship"):
            raise LookupError("no courier")

    task_id = order.apply(args=("ann",)).id
    assert get_run(task_id, app=app).status == "compensated"  # type: ignore[union-attr]
    assert undone == {"ch_1": 1}

    lines = ok(duraflow(app, "show", task_id))
    header = header_of(lines)
    assert header["task id"] == task_id
    assert header["task"] == "shop.order"
    assert header["status"] == "compensated"
    assert header["attempts"].startswith("1")
    assert "LookupError: no courier" in header["error"]
    assert header["parent"] == "-"
    assert header["code"] != "-"
    timeline = lines[lines.index("") + 2:]
    assert timeline[0].split() == ["KEY", "STATUS", "TRIES", "DURATION", "STARTED",
                                   "COMPLETED", "OUTPUT"]
    rows = {line.split()[0]: line for line in timeline[1:]}
    assert list(rows) == ["search", "patched:fast-path", "charge", "ship", "compensate:charge"]
    assert rows["search"].split()[1:3] == ["completed", "1"]
    search_output = rows["search"].split("  ")[-1].strip()
    assert search_output.startswith('{"user": "ann", "note": "xxx') and search_output.endswith(
        "...")
    assert len(search_output) <= 60
    assert rows["ship"].split()[1:4] == ["failed", "1", "-"]
    assert "error: " in rows["ship"] and "no courier" in rows["ship"]
    assert rows["compensate:charge"].split()[1] == "completed"
    assert '"refunded ch_1"' in rows["compensate:charge"]

    data = json.loads(ok_text(duraflow(app, "show", task_id, "--json")))
    assert data["task_id"] == task_id and data["status"] == "compensated"
    assert [s["key"] for s in data["steps"]] == list(rows)
    steps = {s["key"]: s for s in data["steps"]}
    assert steps["search"]["result"] == {"user": "ann", "note": "x" * 200}
    assert steps["charge"]["result"] == {"id": "ch_1", "cents": 2500}
    assert steps["ship"]["result"] is None and "no courier" in steps["ship"]["error"]
    assert steps["search"]["duration_seconds"] >= 0
    assert steps["ship"]["duration_seconds"] is None
    assert datetime.fromisoformat(steps["search"]["started_at"]).tzinfo is not None
    assert data["retries"] == 0 and data["unwinding"] is None


def test_show_a_waiting_run_and_an_unknown_one(listed: dict[str, Any]) -> None:
    """`show` says what a waiting run waits for; an unknown task id is a one-line error."""
    app = listed["app"]
    lines = ok(duraflow(app, "show", listed["waiting"]))
    assert header_of(lines)["status"] == "waiting: waits for signal 'approval' (no timeout)"
    rows = [line.split()[:2] for line in lines[lines.index("") + 3:]]
    assert rows == [["quote", "completed"], ["approval", "waiting"]]

    unknown = str(uuid.uuid4())
    assert failed(duraflow(app, "show", unknown)) == (
        f"error: no run with task id {unknown} is recorded")
    failed(duraflow(app, "show", unknown, "--json"))


# -- cancel --------------------------------------------------------------------------------


def test_cancel_a_waiting_run(make_app: Callable[..., Celery]) -> None:
    """The worker ends a cancelled waiting run `cancelled`, after undoing its step."""
    app = make_app(eager=False)
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, name="shop.approve")
    def approve() -> Any:
        with step("quote", compensate=lambda quote: calls.update(["undo"])) as s:
            calls["quote"] += 1
            s.result = 10
        decision = wait_for_signal("approval")
        calls["after"] += 1
        return decision

    with run_worker(app):
        task_id = approve.delay().id
        wait_for_status(app, task_id, "waiting")
        lines = ok(duraflow(app, "cancel", task_id))
        assert lines == [f"cancellation requested for {task_id}: it stops before its next "
                         "step, its completed steps are compensated and it ends cancelled"]
        run = wait_for_status(app, task_id, "cancelled")
    assert calls == {"quote": 1, "undo": 1}
    assert [s.key for s in run.steps][-1] == "compensate:quote"

    again = ok(duraflow(app, "cancel", task_id))
    assert again == [f"run {task_id} already ended (cancelled); nothing was cancelled"]


def test_cancel_an_ended_run_and_an_unknown_one(listed: dict[str, Any]) -> None:
    """`cancel` leaves an ended run as it is and says so; an unknown task id is an error."""
    app = listed["app"]
    assert ok(duraflow(app, "cancel", listed["new"])) == [
        f"run {listed['new']} already ended (succeeded); nothing was cancelled"]
    assert get_run(listed["new"], app=app).status == "succeeded"  # type: ignore[union-attr]
    unknown = str(uuid.uuid4())
    assert failed(duraflow(app, "cancel", unknown)).startswith(
        f"error: no run with task id {unknown} is recorded")


# -- retry ---------------------------------------------------------------------------------


def test_retry_sends_a_failed_run_again_and_from_a_step(make_app: Callable[..., Celery]) -> None:
    """`retry` sends a failed run again, skipping its completed steps, or reruns from a step."""
    app = make_app(eager=False)
    calls: Counter[str] = Counter()
    mailer = {"up": False}

    @app.task(base=DurableTask, name="shop.book")
    def book(user: str) -> str:
        with step("search") as s:
            calls["search"] += 1
            s.result = "LHR-101"
        with step("charge") as s:
            calls["charge"] += 1
            s.result = f"charged {user}"
        with step("notify") as s:
            calls["notify"] += 1
            if not mailer["up"]:
                raise ConnectionError("mailer down")
            s.result = "sent"
        return f"{user}: {s.result}"

    task_id = book.apply(args=("ann",)).id
    assert get_run(task_id, app=app).status == "failed"  # type: ignore[union-attr]
    assert calls == {"search": 1, "charge": 1, "notify": 1}

    mailer["up"] = True
    with run_worker(app):
        assert ok(duraflow(app, "retry", task_id)) == [
            f"run {task_id} (shop.book) sent again; its completed steps will not run again"]
        run = wait_for_status(app, task_id, "succeeded")
        assert calls == {"search": 1, "charge": 1, "notify": 2}
        assert run.result == "ann: sent"

        assert ok(duraflow(app, "retry", task_id, "--from-step", "charge")) == [
            f"run {task_id} (shop.book) sent again from step 'charge': that step and every "
            "later one run again"]
        wait_for_status(app, task_id, "succeeded")
        assert calls == {"search": 1, "charge": 2, "notify": 3}

    assert "has no step 'nope'" in failed(duraflow(app, "retry", task_id, "--from-step", "nope"))
    unknown = str(uuid.uuid4())
    assert failed(duraflow(app, "retry", unknown)).startswith(
        f"error: no run with task id {unknown} is recorded")


def test_retry_refuses_a_run_that_has_not_ended(make_app: Callable[..., Celery]) -> None:
    """`retry` refuses a run that is still running, and leaves it running."""
    app = make_app(eager=False)
    store = store_of(app)
    task_id = str(uuid.uuid4())
    store.begin_attempt(task_id, Delivery(task_name="shop.book", owner=OWNER))
    error = failed(duraflow(app, "retry", task_id))
    assert f"run {task_id} is running, so it cannot be retried" in error
    assert store.get_run(task_id).status == "running"  # type: ignore[union-attr]


# -- prune ---------------------------------------------------------------------------------


def _make_run(store: Store, status: str, *, steps: int = 1, task_id: str | None = None,
              signal: bool = False) -> str:
    """A run with ``steps`` completed steps, ended (or left) in ``status``."""
    task_id = task_id or str(uuid.uuid4())
    store.begin_attempt(task_id, Delivery(task_name="shop.trip", owner=OWNER))
    for n in range(steps):
        assert store.record_step(task_id, f"step-{n}", OWNER, status="completed", output="1",
                                 serializer="json", started_at=datetime.now(UTC), new=True,
                                 position=n + 1)
    if signal:
        assert store.put_signal(task_id, "approval", "true", "json", grace=5.0)[0]
    if status in ("waiting", "sleeping"):
        assert store.suspend(task_id, OWNER, status=status, kind="signal",
                             waiting_for="never", wake_at=None, sweep_at=None)
    elif status != "running":
        assert store.finish_run(task_id, OWNER, status)
    return task_id


def test_prune_deletes_old_ended_runs_only(make_app: Callable[..., Celery]) -> None:
    """`prune` deletes old ended runs and their steps; unended runs and awaited children stay."""
    app = make_app(eager=False)
    store = store_of(app)
    old_ok = [_make_run(store, "succeeded", steps=2, signal=True) for _ in range(3)]
    old_failed = _make_run(store, "failed", steps=1)
    old_cancelled = _make_run(store, "cancelled", steps=1)
    old_unfinished = [_make_run(store, status, steps=2)
                      for status in ("running", "sleeping", "waiting")]
    recent_ok = _make_run(store, "succeeded", steps=1)
    # A child that ended long ago, whose parent still waits: the parent may read it.
    parent = _make_run(store, "waiting", steps=1)
    child = str(uuid.uuid4())
    assert store.create_child_run(child, task_name="shop.trip", parent_id=parent, args=None,
                                  exchange=None, routing_key=None)
    _make_run(store, "succeeded", steps=1, task_id=child)
    old = [*old_ok, old_failed, old_cancelled, *old_unfinished, parent, child]
    set_times(app, old, updated_at=datetime.now(UTC) - timedelta(days=40))

    dry = ok(duraflow(app, "prune", "--older-than", "30d", "--dry-run"))
    assert dry[0].startswith("would prune 5 run(s) (8 steps)")
    assert all(store.get_run(task_id) is not None for task_id in old)

    assert ok(duraflow(app, "prune", "--older-than", "30d", "--status", "failed"))[0].startswith(
        "pruned 1 run(s) (1 steps): failed runs last updated more than 30d ago")
    assert store.get_run(old_failed) is None
    assert store.get_run(old_cancelled) is not None

    assert ok(duraflow(app, "prune", "--older-than", "50d"))[0].startswith("pruned 0 run(s)")
    lines = ok(duraflow(app, "prune", "--older-than", "30d", "--batch-size", "2"))
    assert lines[0].startswith("pruned 4 run(s) (7 steps)")
    for task_id in [*old_ok, old_failed, old_cancelled]:
        assert store.get_run(task_id) is None
        assert count_rows(app, "steps", task_id) == 0
        assert count_rows(app, "signals", task_id) == 0
    for task_id in old_unfinished:
        assert store.get_run(task_id) is not None
        assert count_rows(app, "steps", task_id) == 2
    for task_id in (recent_ok, parent, child):
        assert store.get_run(task_id) is not None
        assert count_rows(app, "steps", task_id) == 1
    assert ok(duraflow(app, "prune", "--older-than", "30d"))[0].startswith(
        "pruned 0 run(s) (0 steps)")

    # Once the parent has ended, its child may go too.
    assert store.begin_attempt(parent, Delivery(task_name="shop.trip", owner=OWNER))
    assert store.finish_run(parent, OWNER, "succeeded")
    set_times(app, [parent], updated_at=datetime.now(UTC) - timedelta(days=40))
    assert ok(duraflow(app, "prune", "--older-than", "30d"))[0].startswith(
        "pruned 2 run(s) (2 steps)")
    assert store.get_run(child) is None and store.get_run(recent_ok) is not None


def test_prune_refuses_unfinished_statuses_and_needs_an_age(
        make_app: Callable[..., Celery]) -> None:
    """`prune` refuses unended statuses, needs --older-than, and never deletes a running run."""
    app = make_app(eager=False)
    store = store_of(app)
    running = _make_run(store, "running")
    set_times(app, [running], updated_at=datetime.now(UTC) - timedelta(days=400))
    for status in ("running", "succeeded,waiting", "sleeping"):
        error = failed(duraflow(app, "prune", "--older-than", "1d", "--status", status), 2)
        assert "prune only deletes runs that have ended" in error
    assert "'bogus' is not one of" in failed(
        duraflow(app, "prune", "--older-than", "1d", "--status", "bogus"), 2)
    assert "--older-than" in failed(duraflow(app, "prune"), 2)
    failed(duraflow(app, "prune", "--older-than", "1d", "--batch-size", "0"), 2)
    assert ok(duraflow(app, "prune", "--older-than", "1d"))[0].startswith("pruned 0 run(s)")
    assert store.get_run(running) is not None


# -- migrate -------------------------------------------------------------------------------


def test_migrate_applies_every_version_then_says_up_to_date(
        make_app: Callable[..., Celery]) -> None:
    """Without auto-migrate, commands ask for `migrate`, which applies every version once."""
    app = make_app(eager=False, duraflow_auto_migrate=False)
    # Without the migrations, a command that reads the store says what to do.
    assert "apply the migrations first" in failed(duraflow(app, "runs"))
    versions = ", ".join(str(v) for v in range(1, LATEST_VERSION + 1))
    prefix = config_for_app(app).table_prefix
    assert ok(duraflow(app, "migrate")) == [
        f"applied schema migration(s) {versions} to the {prefix}* tables; the schema is at "
        f"version {LATEST_VERSION}"]
    assert ok(duraflow(app, "migrate")) == [f"schema is up to date (version {LATEST_VERSION})"]
    assert ok(duraflow(app, "runs")) == ["no runs are recorded"]


# -- query plans on a big table ------------------------------------------------------------


@pytest.mark.postgres
def test_listing_and_prune_queries_use_the_indexes(pg_url: str, table_prefix: str) -> None:
    """On 200,000 runs, every listing and the prune batch read an index, never the whole table."""
    store = Store(load_config({"duraflow_database_url": pg_url,
                               "duraflow_table_prefix": table_prefix}, environ={}))
    runs, steps = store.tables.runs, store.tables.steps
    try:
        store.ensure_schema()
        engine = create_engine(pg_url)
        try:
            with engine.begin() as conn:
                conn.execute(text(f"""
                    INSERT INTO "{runs.name}" (task_id, task_name, status, attempts,
                        created_at, updated_at, retries, recoveries, interrupted)
                    SELECT 'run-' || i, 'task.' || (i % 20),
                        CASE WHEN i % 100 = 0 THEN 'failed' WHEN i % 100 = 1 THEN 'waiting'
                             WHEN i % 100 = 2 THEN 'running' WHEN i % 100 = 3 THEN 'cancelled'
                             WHEN i % 100 = 4 THEN 'compensated'
                             WHEN i % 100 = 5 THEN 'sleeping' ELSE 'succeeded' END,
                        1, now() - i * interval '1 minute',
                        now() - i * interval '1 minute' + interval '5 seconds', 0, 0, false
                    FROM generate_series(1, 200000) AS i"""))
                conn.execute(text(f"""
                    INSERT INTO "{steps.name}" (task_id, step_key, status, attempts,
                        started_at, completed_at)
                    SELECT 'run-' || i, 'step-' || n, 'completed', 1, now(), now()
                    FROM generate_series(1, 200000, 5) AS i, generate_series(1, 3) AS n"""))
                conn.execute(text(f'ANALYZE "{runs.name}"'))
                conn.execute(text(f'ANALYZE "{steps.name}"'))

            def plan(query: Any) -> str:
                compiled = query.compile(dialect=engine.dialect,
                                         compile_kwargs={"render_postcompile": True})
                with engine.connect() as conn:
                    rows = conn.exec_driver_sql("EXPLAIN " + compiled.string, compiled.params)
                    return "\n".join(row[0] for row in rows)

            def uses_an_index(query: Any) -> str:
                text_ = plan(query)
                assert f"Seq Scan on {runs.name}" not in text_, text_
                assert any("Index" in line and f" on {runs.name}" in line
                           for line in text_.splitlines()), text_
                assert f"Seq Scan on {steps.name}" not in text_, text_
                return text_

            listings: list[dict[str, Any]] = [
                {},
                {"statuses": ["failed"]},
                {"statuses": ["succeeded"]},
                {"statuses": ["failed", "waiting", "sleeping"]},
                {"task_name": "task.7"},
                {"task_name": "task.7", "statuses": ["failed", "running"]},
                {"older_than": timedelta(days=30)},
                {"newer_than": timedelta(days=2), "statuses": ["waiting"]},
            ]
            for filters in listings:
                uses_an_index(summary_query(store, limit=50, **filters))
            cutoff = datetime.now(UTC) - timedelta(days=30)
            for status in ("succeeded", "failed", "compensated", "cancelled"):
                candidates = uses_an_index(prune_candidates_query(
                    store, status=status, cutoff=cutoff, batch_size=1000))
                assert "LockRows" in candidates
                # The index of the runs not pruned yet: tombstones are never stepped over.
                assert f"{table_prefix}runs_live_status_updated" in candidates
            graves = uses_an_index(tombstones_query(store, cutoff=cutoff, batch_size=1000))
            assert f"{table_prefix}runs_pruned" in graves

            # And the listing is right on that table: the newest failed runs.
            newest = list_runs(store, statuses=["failed", "waiting"], limit=3)
            assert [r.task_id for r in newest] == ["run-1", "run-100", "run-101"]
        finally:
            engine.dispose()
    finally:
        store.close()
        close_all_stores()
        drop_tables(pg_url, table_prefix)


def test_listing_of_one_status_per_branch_is_merged_newest_first(
        make_app: Callable[..., Celery]) -> None:
    """Several statuses are listed through one branch per status; the merge keeps the order."""
    app = make_app(eager=False)
    store = store_of(app)
    made = [_make_run(store, status, steps=0)
            for status in ("succeeded", "failed", "succeeded", "cancelled", "failed")]
    base = datetime.now(UTC) - timedelta(hours=1)
    runs = store.tables.runs
    with store.engine.begin() as conn:
        for n, task_id in enumerate(made):
            conn.execute(update(runs).where(runs.c.task_id == task_id)
                         .values(created_at=base + timedelta(minutes=n)))
    listed = list_runs(store, statuses=["failed", "succeeded"], limit=3)
    assert [r.task_id for r in listed] == [made[4], made[2], made[1]]
    assert [r.task_id for r in list_runs(store, limit=2)] == [made[4], made[3]]



def test_patch_lists_the_oldest_runs_up_to_the_limit_and_says_when_there_are_more(
        make_app: Callable[..., Celery]) -> None:
    """`patch NAME --limit N` lists the N oldest unfinished runs without the marker and says
    there are more; with room for all of them it gives their exact number."""
    app = make_app()
    store = store_of(app)
    owner = "some-host|x|1|abc"
    old = [f"old-{n}-{uuid.uuid4().hex[:6]}" for n in range(3)]
    for task_id in old:
        store.begin_attempt(task_id, Delivery(task_name="proj.book_trip", owner=owner))
    set_times(app, old[:1], created_at=datetime.now(UTC) - timedelta(hours=3))
    set_times(app, old[1:2], created_at=datetime.now(UTC) - timedelta(hours=2))
    set_times(app, old[2:], created_at=datetime.now(UTC) - timedelta(hours=1))
    new = f"new-{uuid.uuid4().hex[:6]}"
    store.begin_attempt(new, Delivery(task_name="proj.book_trip", owner=owner))
    assert store.record_step(new, "patched:price-check", owner, status="completed",
                             output="true", serializer="json", started_at=datetime.now(UTC),
                             new=True)

    limited = duraflow(app, "patch", "price-check", "--limit", "2")
    assert limited.exit_code == 3, (limited.output, limited.exception)
    lines = limited.stdout.splitlines()
    assert lines[1] == ("more than 2 unfinished runs may still take the old branch; the "
                        "oldest 2 (--limit shows more):")
    assert [line.split()[0] for line in lines[2:]] == old[:2]

    every = duraflow(app, "patch", "price-check", "--limit", "3")
    assert every.exit_code == 3, (every.output, every.exception)
    lines = every.stdout.splitlines()
    assert lines[1] == "3 unfinished run(s) may still take the old branch:"
    assert [line.split()[0] for line in lines[2:]] == old
