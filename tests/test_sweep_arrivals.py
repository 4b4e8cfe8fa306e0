"""A signal or a child's end that reaches a waiting run is never left without a wake-up,
and the sweep finds it without reading every waiting run on every pass.

Storing a signal wakes the run waiting for it in the same transaction: the run is then
running with no owner and a short expiry, so if the sender dies before sending it, the
sweep's pass over due runs (through the lease index) sends it. A suspension and a
signal that race both lock the run's row first, so one always sees the other; a
suspension for a child locks the child's row, which the child's end writes, so the end
is seen by the suspension or its waker finds the run waiting. A parent whose child's
waker died before waking it is found by the look at waiting parents, which a sweep
takes on its first pass in a process and then now and then; the full look at every
waiting run is left to the first pass, for what an older version stored. On SQLite
and PostgreSQL, the races on PostgreSQL.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine, event, insert, select, text

from celery_duraflow import _recovery
from celery_duraflow._config import config_for_app
from celery_duraflow._records import utc_now
from celery_duraflow._store import Delivery, Store, store_for

OWNER = "sweep-test-host|x|1|abc"
LEASE = 1.0


def _store(make_app: Callable[..., Celery]) -> Store:
    return store_for(config_for_app(make_app(duraflow_lease_seconds=LEASE)))


def _waiting_for(store: Store, kind: str, waiting_for: str) -> str:
    """A run that took its first attempt and now waits for ``waiting_for``."""
    task_id = str(uuid.uuid4())
    store.begin_attempt(task_id, Delivery(task_name="shop.trip", owner=OWNER))
    assert store.suspend(task_id, OWNER, status="waiting", kind=kind,  # type: ignore[arg-type]
                         waiting_for=waiting_for, wake_at=None, sweep_at=None)
    return task_id


def _due(store: Store) -> list[str]:
    """The runs a plain pass of the sweep (no look at waiting runs or parents) finds."""
    return [run.task_id for run in store.recoverable_runs(10, arrivals=False, parents=False)]


def test_storing_a_signal_wakes_its_waiting_run_in_the_same_write(
        make_app: Callable[..., Celery]) -> None:
    """A sender that dies right after storing the signal leaves the run to a plain pass."""
    store = _store(make_app)
    task_id = _waiting_for(store, "signal", "go")
    stored, woken = store.put_signal(task_id, "go", "true", "json", grace=LEASE)
    assert stored and woken is not None and woken.task_id == task_id
    run = store.get_run(task_id)
    assert run is not None and run.status == "running" and run.lease_owner is None
    time.sleep(LEASE + 0.1)  # the message the sender never sent: due once the expiry passes
    assert _due(store) == [task_id]
    # The same signal again wakes nothing more, and stores nothing.
    assert store.put_signal(task_id, "go", "false", "json", grace=LEASE) == (False, None)


def test_a_signal_for_another_name_or_an_ended_run_wakes_nothing(
        make_app: Callable[..., Celery]) -> None:
    """Only the run waiting for that very signal is woken; the signal is stored all the same."""
    store = _store(make_app)
    task_id = _waiting_for(store, "signal", "go")
    assert store.put_signal(task_id, "other", "1", "json", grace=LEASE) == (True, None)
    run = store.get_run(task_id)
    assert run is not None and run.status == "waiting"
    ended = str(uuid.uuid4())
    store.begin_attempt(ended, Delivery(task_name="shop.trip", owner=OWNER))
    assert store.finish_run(ended, OWNER, "succeeded", result="1", serializer="json")
    assert store.put_signal(ended, "go", "1", "json", grace=LEASE) == (True, None)
    run = store.get_run(ended)
    assert run is not None and run.status == "succeeded"


def _left_waiting(store: Store) -> str:
    """A parent waiting for a child that ended while its waker died: nobody woke it."""
    parent = str(uuid.uuid4())
    child = f"{parent}/child"
    store.begin_attempt(parent, Delivery(task_name="shop.trip", owner=OWNER))
    assert store.create_child_run(child, task_name="shop.leg", parent_id=parent, args="[]",
                                  exchange=None, routing_key=None)
    assert store.suspend(parent, OWNER, status="waiting", kind="child", waiting_for=child,
                         wake_at=None, sweep_at=None)
    child_owner = OWNER + "-child"
    store.begin_attempt(child, Delivery(task_name="shop.leg", owner=child_owner))
    assert store.finish_run(child, child_owner, "succeeded", result="1", serializer="json")
    return parent


def test_a_child_end_that_never_woke_its_parent_is_found_by_the_look_at_parents(
        make_app: Callable[..., Celery]) -> None:
    """A child that ended while its waker died leaves its parent to the look at waiting
    parents (a plain pass reads only the due runs, and does not find it)."""
    store = _store(make_app)
    parent = _left_waiting(store)
    assert _due(store) == []
    found = store.recoverable_runs(10, arrivals=False, parents=True)
    assert [run.task_id for run in found] == [parent]


def test_a_sweep_looks_at_waiting_parents_first_and_then_every_interval(
        make_app: Callable[..., Celery], monkeypatch: pytest.MonkeyPatch) -> None:
    """A store's first sweep in a process looks at the waiting parents, the next ones do not
    until PARENTS_EVERY seconds have passed, and then one does again."""
    store = _store(make_app)
    clock = [1000.0]
    monkeypatch.setattr(_recovery.time, "monotonic", lambda: clock[0])
    _recovery._parents_looked.pop(store, None)
    assert _recovery._parents_due(store)
    clock[0] += _recovery.PARENTS_EVERY - 1
    assert not _recovery._parents_due(store)
    clock[0] += 1
    assert _recovery._parents_due(store)
    assert not _recovery._parents_due(store)


def test_a_sweep_wakes_the_parent_its_childs_waker_left(
        make_app: Callable[..., Celery], monkeypatch: pytest.MonkeyPatch) -> None:
    """Through sweep(): a parent whose child's waker died is sent on the first pass, and on a
    later one once the interval has passed, never left waiting for good."""
    app = make_app(duraflow_lease_seconds=LEASE)
    store = store_for(config_for_app(app))
    sent: list[str] = []
    monkeypatch.setattr(_recovery, "send_run", lambda app, run: sent.append(run.task_id))
    monkeypatch.setattr(_recovery, "_unsendable", lambda run, config, registered: None)
    _recovery.sweep(app)  # the first pass in this process, with nothing left behind
    parent = _left_waiting(store)
    assert _recovery.sweep(app).sent == []  # within the interval: not looked for yet
    looked = _recovery._parents_looked[store]
    _recovery._parents_looked[store] = looked - _recovery.PARENTS_EVERY
    assert _recovery.sweep(app).sent == [parent]
    assert sent == [parent]


def test_the_first_pass_in_a_process_finds_what_an_older_version_left_waiting(
        make_app: Callable[..., Celery]) -> None:
    """A signal stored without waking its run (as before this version) is found by the full
    look that a sweep's first pass in a process takes, not by a plain pass."""
    store = _store(make_app)
    task_id = _waiting_for(store, "signal", "go")
    signals = store.tables.signals
    with store.engine.begin() as conn:
        conn.execute(insert(signals).values(task_id=task_id, name="go", payload="true",
                                            serializer="json", sent_at=utc_now()))
    assert _due(store) == []
    assert [run.task_id for run in store.recoverable_runs(10, arrivals=True)] == [task_id]


def test_a_sweep_takes_the_full_look_on_its_first_pass_only(
        make_app: Callable[..., Celery]) -> None:
    """A store's first sweep in a process looks at every waiting run; later ones do not."""
    store = _store(make_app)
    assert _recovery._arrivals_due(store)
    assert not _recovery._arrivals_due(store)
    assert not _recovery._arrivals_due(store)


@pytest.mark.postgres
@pytest.mark.pooled
@pytest.mark.parametrize("database_url", ["postgres", "pgbouncer"], indirect=True)
@pytest.mark.parametrize("first", ["suspension", "signal", "during"])
def test_a_signal_racing_the_suspension_always_wakes_the_run(
        make_app: Callable[..., Celery], database_url: str, pg_url: str, first: str) -> None:
    """The worst orders, forced with a lock held on the run's row (and, for ``during``, the
    suspension held between its write and its commit): the suspension reads before the
    signal is stored and commits after the sender looked; the run is still woken."""
    store = _store(make_app)
    task_id = str(uuid.uuid4())
    store.begin_attempt(task_id, Delivery(task_name="shop.trip", owner=OWNER))
    runs = store.tables.runs.name
    holder = create_engine(pg_url).connect()
    outcomes: dict[str, Any] = {}

    def hold_the_suspension(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if (first == "during" and threading.current_thread() is suspending
                and statement.startswith(f"UPDATE {runs}") and "wait_kind" in statement):
            time.sleep(0.6)  # written, not committed: the signal is sent meanwhile

    event.listen(store.engine, "after_cursor_execute", hold_the_suspension)
    try:
        holder.execute(text(f'SELECT 1 FROM "{runs}" WHERE task_id = :t FOR UPDATE'),
                       {"t": task_id})

        def suspend() -> None:
            outcomes["suspended"] = store.suspend(
                task_id, OWNER, status="waiting", kind="signal", waiting_for="go",
                wake_at=None, sweep_at=None)

        def signal() -> None:
            outcomes["signal"] = store.put_signal(task_id, "go", "true", "json", grace=LEASE)

        suspending = threading.Thread(target=suspend)
        signalling = threading.Thread(target=signal)
        # Each waits for the row in turn, in this order, and goes on in it once it is free.
        if first == "during":
            holder.rollback()
            suspending.start()
            time.sleep(0.3)
            signalling.start()
        else:
            for thread in ((suspending, signalling) if first == "suspension"
                           else (signalling, suspending)):
                thread.start()
                time.sleep(0.3)
            holder.rollback()
        suspending.join(10)
        signalling.join(10)
    finally:
        event.remove(store.engine, "after_cursor_execute", hold_the_suspension)
        holder.close()
    stored, woken = outcomes["signal"]
    assert stored
    run = store.get_run(task_id)
    assert run is not None
    # Either the suspension saw the signal and did not happen, or the signal woke the run.
    if outcomes["suspended"]:
        assert woken is not None and run.status == "running"
    else:
        assert woken is None and run.status == "running" and run.lease_owner == OWNER
    with store.engine.connect() as conn:
        assert conn.execute(select(store.tables.signals.c.name)).scalars().all() == ["go"]


@pytest.mark.postgres
@pytest.mark.pooled
@pytest.mark.parametrize("database_url", ["postgres", "pgbouncer"], indirect=True)
@pytest.mark.parametrize("first", ["suspension", "child"])
def test_a_child_end_racing_the_suspension_always_wakes_the_parent(
        make_app: Callable[..., Celery], database_url: str, pg_url: str, first: str) -> None:
    """The worst orders, forced with a lock: the parent's suspension checks the child before
    the child's end commits and writes after its waker looked (``suspension``), or the
    child's end is written while the parent suspends (``child``); the parent is never left
    waiting for a child that ended, with nobody to wake it but a sweep's full look."""
    store = _store(make_app)
    parent = str(uuid.uuid4())
    child = f"{parent}/child"
    child_owner = OWNER + "-child"
    store.begin_attempt(parent, Delivery(task_name="shop.trip", owner=OWNER))
    assert store.create_child_run(child, task_name="shop.leg", parent_id=parent, args="[]",
                                  exchange=None, routing_key=None)
    store.begin_attempt(child, Delivery(task_name="shop.leg", owner=child_owner))

    def suspend() -> bool:
        return store.suspend(parent, OWNER, status="waiting", kind="child",
                             waiting_for=child, wake_at=None, sweep_at=None)

    def end_child() -> Any:
        # What a child's attempt does at its end: record it, then wake the parent.
        assert store.finish_run(child, child_owner, "succeeded", result="1", serializer="json")
        return store.wake(parent, kind="child", waiting_for=child, grace=LEASE)

    race_the_suspension(store, pg_url, first, parent=parent, last_child=child,
                        suspend=suspend, end=end_child,
                        wake=lambda: store.wake(parent, kind="child", waiting_for=child,
                                                grace=LEASE))


def race_the_suspension(store: Store, pg_url: str, first: str, *, parent: str,
                        last_child: str, suspend: Callable[[], bool], end: Callable[[], Any],
                        wake: Callable[[], Any], owner: str = OWNER) -> None:
    """Force one of the worst orders of a parent's suspension and its (last) child's end,
    with a lock held by another connection, and check that the parent is never left
    waiting for a child that ended.

    ``suspension``: the parent's row is held, so the suspension has checked the child (not
    ended) and waits to write while the child ends and its waker (``end``) looks at the
    parent. ``child``: the child's end is written, not committed, while the parent
    suspends; then committed, and ``wake`` is what its waker does. ``owner`` holds the
    parent's lease.
    """
    runs = store.tables.runs.name
    holder = create_engine(pg_url).connect()
    outcomes: dict[str, Any] = {}
    suspending = threading.Thread(target=lambda: outcomes.update(suspended=suspend()))
    ending = threading.Thread(target=lambda: outcomes.update(woken=end()))
    try:
        if first == "suspension":
            holder.execute(text(f'SELECT 1 FROM "{runs}" WHERE task_id = :t FOR UPDATE'),
                           {"t": parent})
            suspending.start()
            time.sleep(0.3)
            ending.start()
            time.sleep(0.5)
            holder.rollback()
        else:
            holder.execute(text(f'UPDATE "{runs}" SET status = \'succeeded\', '
                                f'lease_owner = NULL WHERE task_id = :t'), {"t": last_child})
            suspending.start()
            time.sleep(0.5)
            holder.commit()
            outcomes["woken"] = wake()
        for thread in (suspending, ending):
            if thread.is_alive():
                thread.join(10)
    finally:
        holder.close()
    run = store.get_run(parent)
    assert run is not None
    # Either the suspension saw the child's end and did not happen, or the end woke it.
    if outcomes["suspended"]:
        assert outcomes["woken"] is not None and run.status == "running", run.status
    else:
        assert outcomes["woken"] is None and run.status == "running"
        assert run.lease_owner == owner
