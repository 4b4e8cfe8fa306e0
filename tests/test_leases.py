"""One owner per run: leases, takeovers, duplicates, argument checks, in-doubt steps."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import select, update

from celery_duraflow import (
    DurableTask,
    RunArgumentsMismatch,
    StepInDoubt,
    get_run,
    recover,
    recovery_beat_entry,
    step,
)
from celery_duraflow._config import config_for_app
from celery_duraflow._lease import keeper, machine_id, new_owner, owner_is_gone
from celery_duraflow._serialization import encode_arguments, get_serializer
from celery_duraflow._store import Delivery, Store, store_for
from tests.conftest import run_worker

# The store's own tests: on PostgreSQL also through PgBouncer (transaction pooling).
pytestmark = pytest.mark.pooled


def _store(app: Celery) -> Store:
    return store_for(config_for_app(app))


def _set_run(app: Celery, task_id: str, **values: Any) -> None:
    store = _store(app)
    runs = store.tables.runs
    with store.engine.begin() as conn:
        conn.execute(update(runs).where(runs.c.task_id == task_id).values(**values))


def _interrupted_run(app: Celery, task: Any, args: tuple[Any, ...], *, owner: str,
                     lease_expires_at: datetime, steps: dict[str, str]) -> str:
    """A run as a worker that died mid-run leaves it: running, leased, steps recorded."""
    store = _store(app)
    task_id = str(uuid.uuid4())
    blob, fingerprint = encode_arguments(args, {}, get_serializer("json"))
    store.begin_attempt(task_id, Delivery(task_name=task.name, owner=owner, args=blob,
                                          args_fingerprint=fingerprint))
    for key, status in steps.items():
        if status == "completed":
            assert store.record_step(task_id, key, owner, status="completed",
                                     started_at=datetime.now(UTC), output='"stored"',
                                     serializer="json")
        else:  # started and never ended, as a claimed step of a dead worker
            assert store.claim_step(task_id, key, owner, None)
    _set_run(app, task_id, lease_expires_at=lease_expires_at)
    return task_id


def _dead_owner() -> str:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    parts = new_owner().split("|")
    parts[2] = str(proc.pid)
    return "|".join(parts)


def test_owner_identity() -> None:
    """Owners on this machine are judged alive or gone by their pid; others never gone."""
    assert not owner_is_gone(new_owner())  # this very process
    if machine_id():
        assert owner_is_gone(_dead_owner())
    assert not owner_is_gone("elsewhere|other-machine|1|abc")
    assert not owner_is_gone("garbage")
    assert not owner_is_gone(None)


def _three_step_task(app: Celery, calls: Counter[str]) -> Any:
    @app.task(base=DurableTask, name="three-steps")
    def task(n: int) -> str:
        for name in ("search", "book", "notify"):
            with step(name) as s:
                calls[name] += 1
                s.result = f"{name}-{n}"
        return str(s.result)

    return task


def test_dead_owner_on_this_machine_is_taken_over_at_once(
        make_app: Callable[..., Celery]) -> None:
    """A redelivery after the owner process died resumes now, not after the lease."""
    if not machine_id():
        pytest.skip("needs /proc to tell whether a process exists")
    app = make_app()
    calls: Counter[str] = Counter()
    task = _three_step_task(app, calls)
    task_id = _interrupted_run(
        app, task, (1,), owner=_dead_owner(),
        lease_expires_at=datetime.now(UTC) + timedelta(hours=1),
        steps={"search": "completed", "book": "running"})
    result = task.apply(args=(1,), task_id=task_id)
    assert result.get() == "notify-1"
    assert calls == {"book": 1, "notify": 1}  # search was cached; book ran again (in doubt)
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "succeeded"
    assert run.step("book").attempts == 2


def test_live_owner_keeps_its_run(make_app: Callable[..., Celery]) -> None:
    """A duplicate delivery while a live owner holds the lease runs nothing and changes nothing."""
    app = make_app()
    calls: Counter[str] = Counter()
    task = _three_step_task(app, calls)
    task_id = _interrupted_run(
        app, task, (1,), owner="another-host|another-machine|4242|abc",
        lease_expires_at=datetime.now(UTC) + timedelta(minutes=5),
        steps={"search": "completed"})

    result = task.apply(args=(1,), task_id=task_id)
    assert result.state == "IGNORED"
    assert calls == {}
    run = get_run(task_id, app=app)
    assert run is not None
    assert (run.status, run.attempts) == ("running", 1)


def test_expired_lease_is_taken_over(make_app: Callable[..., Celery]) -> None:
    """Once the lease has expired, any delivery may take the run over and finish it."""
    app = make_app()
    calls: Counter[str] = Counter()
    task = _three_step_task(app, calls)
    task_id = _interrupted_run(
        app, task, (1,), owner="another-host|another-machine|4242|abc",
        lease_expires_at=datetime.now(UTC) - timedelta(seconds=1),
        steps={"search": "completed", "book": "completed"})

    assert task.apply(args=(1,), task_id=task_id).get() == "notify-1"
    assert calls == {"notify": 1}


def test_heartbeat_keeps_a_long_step_leased(make_app: Callable[..., Celery]) -> None:
    """A step longer than the lease keeps it renewed; a duplicate meanwhile is turned away."""
    app = make_app(duraflow_lease_seconds=1)
    calls: Counter[str] = Counter()
    started = threading.Event()

    @app.task(base=DurableTask)
    def slow() -> str:
        with step("long") as s:
            calls["long"] += 1
            started.set()
            time.sleep(2.5)
            s.result = "done"
        return str(s.result)

    # A 30 s lease held elsewhere in this process sets the renewal thread on a slow beat;
    # the 1 s lease must still be renewed in time.
    long_lease_store = _store(make_app(duraflow_lease_seconds=30))
    keeper().hold(long_lease_store, "placeholder", "nobody")
    time.sleep(0.3)
    task_id = str(uuid.uuid4())
    outcome: list[Any] = []
    first = threading.Thread(target=lambda: outcome.append(slow.apply(task_id=task_id)))
    try:
        first.start()
        assert started.wait(10)
        time.sleep(1.6)  # past the first lease: only renewals keep it
        duplicate = slow.apply(task_id=task_id)
        first.join(30)
    finally:
        keeper().release(long_lease_store, "placeholder", "nobody")
    assert duplicate.state == "IGNORED"
    assert outcome[0].get() == "done"
    assert calls["long"] == 1


def test_same_id_other_arguments_is_refused(make_app: Callable[..., Celery]) -> None:
    """A task id re-sent with other arguments does not reuse the recorded steps."""
    app = make_app()
    calls: Counter[str] = Counter()
    task = _three_step_task(app, calls)
    task_id = str(uuid.uuid4())
    assert task.apply(args=(1,), task_id=task_id).get() == "notify-1"

    other = task.apply(args=(2,), task_id=task_id)
    assert isinstance(other.result, RunArgumentsMismatch)
    assert task_id in str(other.result)
    assert other.result.task_id == task_id
    # The same arguments (a list now, as a broker would deliver them) are fine.
    assert task.apply(args=[1], task_id=task_id).get() == "notify-1"
    assert calls == {"search": 1, "book": 1, "notify": 1}

    @app.task(base=DurableTask, name="another-task")
    def another(n: int) -> None:
        pass

    assert isinstance(another.apply(args=(1,), task_id=task_id).result, RunArgumentsMismatch)


def test_in_doubt_step_can_ask_for_a_human(make_app: Callable[..., Celery]) -> None:
    """on_in_doubt='raise' refuses to re-run an interrupted step and says what to check."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, name="careful")
    def careful(n: int) -> None:
        with step("wire-money", on_in_doubt="raise"):
            calls["wire"] += 1

    task_id = _interrupted_run(
        app, careful, (1,), owner="another-host|another-machine|4242|abc",
        lease_expires_at=datetime.now(UTC) - timedelta(seconds=1),
        steps={"wire-money": "running"})
    result = careful.apply(args=(1,), task_id=task_id)
    assert isinstance(result.result, StepInDoubt)
    assert result.result.step_key == "wire-money"
    assert "idempotency key" in str(result.result)
    assert calls == {}
    run = get_run(task_id, app=app)
    assert run is not None
    assert run.step("wire-money").status == "running"  # left for the human


def test_claiming_step_is_not_in_doubt_when_it_never_started(
        make_app: Callable[..., Celery]) -> None:
    """A run whose owner died before a claiming step began runs that step without asking."""
    app = make_app()
    calls: Counter[str] = Counter()
    doubts: list[bool] = []

    @app.task(base=DurableTask, name="careful-two")
    def careful(n: int) -> None:
        with step("prepare") as s:
            calls["prepare"] += 1
            doubts.append(s.in_doubt)
        with step("wire-money", on_in_doubt="raise") as s:
            calls["wire"] += 1
            doubts.append(s.in_doubt)

    # The owner died after "prepare" completed, before "wire-money" claimed anything.
    task_id = _interrupted_run(
        app, careful, (1,), owner="another-host|another-machine|4242|abc",
        lease_expires_at=datetime.now(UTC) - timedelta(seconds=1),
        steps={"prepare": "completed"})
    result = careful.apply(args=(1,), task_id=task_id)
    assert result.successful(), result.traceback
    assert calls == {"wire": 1}
    assert doubts == [False]


def test_default_step_after_a_death_is_reported_in_doubt(
        make_app: Callable[..., Celery]) -> None:
    """The first unfinished step of a run taken from a dead owner says it may have run."""
    app = make_app()
    doubts: list[tuple[str, bool]] = []

    @app.task(base=DurableTask, name="two-steps")
    def two(n: int) -> None:
        for name in ("book", "notify"):
            with step(name) as s:
                doubts.append((name, s.in_doubt))

    task_id = _interrupted_run(
        app, two, (1,), owner="another-host|another-machine|4242|abc",
        lease_expires_at=datetime.now(UTC) - timedelta(seconds=1), steps={})
    assert two.apply(args=(1,), task_id=task_id).successful()
    # book may have run (the owner died somewhere in the run); once book is recorded,
    # notify cannot have been reached by the dead owner.
    assert doubts == [("book", True), ("notify", False)]


def test_recovery_sweep_resends_lost_runs(make_app: Callable[..., Celery]) -> None:
    """A run whose owner vanished is sent again by the sweep, once, and finishes."""
    app = make_app(eager=False)
    calls: Counter[str] = Counter()
    task = _three_step_task(app, calls)
    task_id = _interrupted_run(
        app, task, (7,), owner="another-host|another-machine|4242|abc",
        lease_expires_at=datetime.now(UTC) - timedelta(seconds=1),
        steps={"search": "completed", "book": "completed"})

    assert recover(app) == [task_id]
    assert recover(app) == []  # marked: a second sweeper does not send it again
    with run_worker(app, pool="solo"):
        assert app.AsyncResult(task_id).get(timeout=30) == "notify-7"
    assert calls == {"notify": 1}
    store = _store(app)
    with store.engine.connect() as conn:
        recoveries = conn.execute(select(store.tables.runs.c.recoveries)).scalar()
    assert recoveries == 1


def test_retry_countdown_makes_the_run_recoverable_later(
        make_app: Callable[..., Celery]) -> None:
    """A run waiting for Celery's retry is not swept before its countdown and a lease."""
    app = make_app(task_eager_propagates=True, duraflow_lease_seconds=30)

    @app.task(base=DurableTask, bind=True, max_retries=3)
    def task(self: DurableTask) -> None:
        with step("x"):
            raise self.retry(countdown=600)

    task_id = str(uuid.uuid4())
    with pytest.raises(Exception, match="Retry"):
        task.apply(task_id=task_id)
    store = _store(app)
    run = store.get_run(task_id)
    assert run is not None and run.lease_owner is None and run.lease_expires_at is not None
    remaining = (run.lease_expires_at - datetime.now(UTC)).total_seconds()
    assert 600 + 9 * 30 < remaining <= 600 + 10 * 30
    assert recover(app) == []


def test_recovery_beat_entry() -> None:
    """The beat entry names the built-in recovery task, which every app knows."""
    entry = recovery_beat_entry(15)
    assert entry["task"] == "celery_duraflow.recover"
    assert entry["schedule"] == 15
    app = Celery("beat-check", set_as_current=False)
    app.finalize()
    assert "celery_duraflow.recover" in app.tasks


def test_retry_delivered_before_its_predecessor_let_go_still_runs(
        make_app: Callable[..., Celery]) -> None:
    """A retry that arrives while the attempt that sent it still holds the lease runs once
    that attempt lets go, instead of being dropped as a duplicate."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, name="handover.book")
    def book(n: int) -> int:
        with step("book") as s:
            calls["book"] += 1
            s.result = n
        return int(s.result)

    store = store_for(config_for_app(app))
    task_id = str(uuid.uuid4())
    blob, fingerprint = encode_arguments((7,), {}, get_serializer("json"))
    predecessor = new_owner()  # an attempt of this (live) process, still ending
    store.begin_attempt(task_id, Delivery(task_name="handover.book", owner=predecessor,
                                          args=blob, args_fingerprint=fingerprint,
                                          retries=0))
    releaser = threading.Timer(0.3, store.release_lease, args=(task_id, predecessor),
                               kwargs={"recover_after": 300.0})
    releaser.start()
    try:
        result = book.apply(args=(7,), task_id=task_id, retries=1)
    finally:
        releaser.join()
    assert result.get() == 7
    assert calls == {"book": 1}


def _resend_after_outage(app: Celery, task: Any, task_id: str, owner: str) -> Any:
    """Deliver ``task_id`` through a worker as the library re-sends it after a store outage:
    with the outage header naming ``owner`` as the attempt that could not let go."""
    from celery.signals import task_postrun

    from celery_duraflow._task import OUTAGE_HEADER

    ended = threading.Event()

    def on_postrun(task_id: str | None = None, **_: Any) -> None:
        if task_id == sent:
            ended.set()

    sent = task_id
    task_postrun.connect(on_postrun, weak=False)
    try:
        with run_worker(app, pool="solo"):
            result = task.apply_async(
                args=(1,), task_id=task_id,
                headers={OUTAGE_HEADER: {"since": time.time(), "resends": 1, "retries": 0,
                                         "owner": owner}})
            assert ended.wait(20), "the worker never ended the delivery"
    finally:
        task_postrun.disconnect(on_postrun)
    return result


def test_the_attempt_the_store_failed_under_takes_its_own_run_back_at_once(
        make_app: Callable[..., Celery]) -> None:
    """After an outage, the re-send of the attempt that still holds the lease resumes the
    run now, not a lease later, and the step it was in is in doubt."""
    app = make_app(eager=False)
    calls: Counter[str] = Counter()
    task = _three_step_task(app, calls)
    owner = "another-host|another-machine|4242|abc"  # alive as far as this machine knows
    task_id = _interrupted_run(
        app, task, (1,), owner=owner, lease_expires_at=datetime.now(UTC) + timedelta(hours=1),
        steps={"search": "completed", "book": "running"})
    _resend_after_outage(app, task, task_id, owner)
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "succeeded"
    assert calls == {"book": 1, "notify": 1}  # search was kept; book ran again
    assert run.step("book").attempts == 2


def test_an_outage_resend_naming_another_owner_is_fenced(
        make_app: Callable[..., Celery], caplog: pytest.LogCaptureFixture) -> None:
    """An outage re-send whose header names an attempt that does not hold the lease (one
    taken over since, or any other) runs nothing, leaves the live holder its run, and says
    once that the old attempt lost its lease."""
    app = make_app(eager=False)
    calls: Counter[str] = Counter()
    task = _three_step_task(app, calls)
    holder = "another-host|another-machine|4242|abc"
    task_id = _interrupted_run(
        app, task, (1,), owner=holder, lease_expires_at=datetime.now(UTC) + timedelta(hours=1),
        steps={"search": "completed", "book": "running"})
    with caplog.at_level(logging.WARNING, logger="celery_duraflow"):
        _resend_after_outage(app, task, task_id, "stale-host|other-machine|99|old")
    lost = [r.getMessage() for r in caplog.records if "lost its lease" in r.getMessage()]
    assert len(lost) == 1 and "stale-host|other-machine|99|old" in lost[0]
    run = get_run(task_id, app=app)
    assert run is not None
    assert (run.status, run.attempts) == ("running", 1)
    assert calls == {}
    store = _store(app)
    with store.engine.connect() as conn:
        runs = store.tables.runs
        assert conn.execute(select(runs.c.lease_owner).where(
            runs.c.task_id == task_id)).scalar_one() == holder
