"""Flow control on a real (in-process) worker: concurrency per key, rate limits, dedupe.

Every test that uses a store runs on SQLite and on PostgreSQL; those about the slot,
window and dedupe decisions also through PgBouncer in transaction mode (marked
``pooled``: the decisions take a transaction-level advisory lock, which a pooler must
keep). A ledger outside the store records when each body ran, so the limits are
checked on what the bodies did, not on what the store says.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import select

from celery_duraflow import (
    Concurrency,
    ConfigurationError,
    Debounce,
    Dedupe,
    DurableTask,
    FlowKeyError,
    RateLimit,
    get_run,
    recover,
    step,
)
from celery_duraflow._clock import now as store_now
from celery_duraflow._config import config_for_app
from celery_duraflow._flow import FIRE_TASK_NAME
from celery_duraflow._store import store_for
from tests.conftest import Clock, run_worker, wait_for_status

RESULT_TIMEOUT = 60.0


class Ledger:
    """When each body started and ended, by key: kept in the test process, not the store."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.intervals: list[tuple[str, str, float, float]] = []
        self.starts: list[tuple[str, str, float]] = []

    def run(self, key: str, name: str, seconds: float) -> None:
        start = store_now().timestamp()
        with self.lock:
            self.starts.append((key, name, start))
        time.sleep(seconds)
        with self.lock:
            self.intervals.append((key, name, start, store_now().timestamp()))

    def most_at_once(self, key: str) -> int:
        events = sorted([(start, 1) for k, _, start, _ in self.intervals if k == key]
                        + [(end, -1) for k, _, _, end in self.intervals if k == key],
                        key=lambda event: (event[0], event[1]))
        most = current = 0
        for _, change in events:
            current += change
            most = max(most, current)
        return most


def _worker_app(make_app: Callable[..., Celery], **conf: Any) -> Celery:
    return make_app(eager=False, **{"duraflow_lease_seconds": 5.0, **conf})


@pytest.mark.pooled
def test_concurrency_limit_per_key_holds_on_a_threaded_worker(
        make_app: Callable[..., Celery]) -> None:
    """With 6 worker threads and Concurrency(2) per tenant, no tenant ever has 3 bodies at once."""
    app = _worker_app(make_app)
    ledger = Ledger()

    @app.task(base=DurableTask, duraflow_limits=[Concurrency(2, key="tenant")])
    def work(tenant: str, n: int) -> int:
        with step("call"):
            ledger.run(tenant, str(n), 0.25)
        return n

    with run_worker(app, pool="threads", concurrency=6):
        results = [work.delay(tenant, n) for n in range(8) for tenant in ("a", "b")]
        assert sorted(r.get(timeout=RESULT_TIMEOUT) for r in results) == sorted(
            list(range(8)) * 2)
    assert len(ledger.intervals) == 16
    assert ledger.most_at_once("a") == 2 and ledger.most_at_once("b") == 2
    for result in results:
        run = get_run(result.id, app=app)
        assert run is not None and run.status == "succeeded" and run.retries == 0
    store = store_for(config_for_app(app))
    with store.reading("test") as conn:
        assert list(conn.execute(select(store.tables.flow_slots))) == []
        assert list(conn.execute(select(store.tables.flow_waits))) == []


@pytest.mark.pooled
def test_runs_over_the_limit_wait_without_a_worker_and_start_in_order(
        make_app: Callable[..., Celery]) -> None:
    """Queued runs are `waiting` on their slot (no worker held) and get it oldest first, in a
    queue longer than a page of it (20 runs)."""
    app = _worker_app(make_app)
    ledger = Ledger()
    gate = threading.Event()

    @app.task(base=DurableTask, duraflow_limits=[Concurrency(1, key="account")])
    def work(account: str, n: int) -> int:
        with step("call"):
            if n == 0:
                assert gate.wait(30)
            ledger.run(account, str(n), 0.01)
        return n

    with run_worker(app, pool="threads", concurrency=2):
        first = work.delay("acme", 0)
        wait_for_status(app, first.id, "running")
        queued = []
        for n in range(1, 21):
            queued.append(work.delay("acme", n))
            run = wait_for_status(app, queued[-1].id, "waiting")
            assert run.wait_kind == "slot" and run.waiting_for == f"{work.name}/acme"
        # Twenty runs wait and the second worker thread is free: nothing is held.
        other = work.delay("other", 99)
        assert other.get(timeout=RESULT_TIMEOUT) == 99
        store = store_for(config_for_app(app))
        places = [store.queued(r.id)[0].position for r in queued]
        assert places == list(range(1, 21))
        gate.set()
        assert [r.get(timeout=RESULT_TIMEOUT) for r in queued] == list(range(1, 21))
    order = [name for key, name, _ in ledger.starts if key == "acme"]
    assert order == [str(n) for n in range(21)]


def test_a_run_woken_from_a_slot_queue_keeps_its_priority(
        make_app: Callable[..., Celery]) -> None:
    """A run sent with priority=7 that queued for a slot is sent again with priority 7."""
    app = _worker_app(make_app)
    gate = threading.Event()
    seen: dict[int, list[object]] = {}

    @app.task(base=DurableTask, bind=True, duraflow_limits=[Concurrency(1, key="account")])
    def work(self: Any, account: str, n: int) -> int:
        seen.setdefault(n, []).append((self.request.delivery_info or {}).get("priority"))
        with step("call"):
            if n == 0:
                assert gate.wait(30)
        return n

    with run_worker(app, pool="threads", concurrency=2):
        first = work.delay("acme", 0)
        wait_for_status(app, first.id, "running")
        queued = work.apply_async(("acme", 1), priority=7)
        wait_for_status(app, queued.id, "waiting")
        gate.set()
        assert queued.get(timeout=RESULT_TIMEOUT) == 1
    # The attempt that queued never reached the body; the woken one did, sent with 7.
    assert seen[1] == [7], seen
    run = store_for(config_for_app(app)).get_run(queued.id)
    assert run is not None and run.priority == 7


def test_a_failed_or_retried_attempt_frees_its_slot_at_once(
        make_app: Callable[..., Celery]) -> None:
    """A run that fails for good, and an attempt that asks for a retry, hand their slot on."""
    app = _worker_app(make_app)
    calls: list[str] = []

    @app.task(base=DurableTask, bind=True, max_retries=1, default_retry_delay=0,
              duraflow_limits=[Concurrency(1)])
    def work(self: Any, what: str) -> str:
        with step("call"):
            calls.append(f"{what}:{self.request.retries}")
        if what == "fail":
            raise ValueError("no")
        if what == "retry" and self.request.retries == 0:
            raise self.retry()
        return what

    with run_worker(app, pool="threads", concurrency=3):
        failing = work.delay("fail")
        retried = work.delay("retry")
        plain = work.delay("plain")
        assert plain.get(timeout=RESULT_TIMEOUT) == "plain"
        assert retried.get(timeout=RESULT_TIMEOUT) == "retry"
        with pytest.raises(ValueError):
            failing.get(timeout=RESULT_TIMEOUT)
    assert sorted(calls) == ["fail:0", "plain:0", "retry:0"]
    run = get_run(retried.id, app=app)
    assert run is not None and run.status == "succeeded" and run.retries == 1


def test_a_dead_holders_slot_is_free_once_its_lease_expires(
        make_app: Callable[..., Celery]) -> None:
    """A slot whose attempt died is handed to the queue by the sweep once the lease expires."""
    app = _worker_app(make_app)
    ledger = Ledger()

    @app.task(base=DurableTask, duraflow_limits=[Concurrency(1, key="k")])
    def work(k: str, n: int) -> int:
        with step("call"):
            ledger.run(k, str(n), 0.01)
        return n

    store = store_for(config_for_app(app))
    # An attempt that took the slot and died: its run's lease ends, nothing frees the slot.
    from celery_duraflow._store import Delivery
    dead = store.begin_attempt("dead-holder", Delivery(
        task_name=work.name, owner="gone-worker", args=None, args_fingerprint=None,
        exchange=None, routing_key=None, retries=0, code_fingerprint=None, first=True))[0]
    assert dead.lease_owner == "gone-worker"
    answer = store.acquire_slot("dead-holder", "gone-worker", scope=work.name, key="x",
                                limit=1, grace=1.0, sweep_after=None)
    assert answer.state == "granted"
    with run_worker(app, pool="threads", concurrency=2):
        waiting = work.delay("x", 1)
        wait_for_status(app, waiting.id, "waiting")
        # The dead attempt's lease (5 s, long enough for a slow start of the worker to find
        # the slot held) runs out now.
        runs = store.tables.runs
        with store.engine.begin() as conn:
            conn.execute(runs.update().where(runs.c.task_id == "dead-holder").values(
                lease_expires_at=store_now() - timedelta(seconds=1)))
        recover(app)
        assert waiting.get(timeout=RESULT_TIMEOUT) == 1


@pytest.mark.parametrize("limits, problem", [
    ("not a list", "must be a list"),
    ([object()], "neither a Concurrency"),
    ([Concurrency(1, key="nope")], "names no parameter"),
])
def test_a_limit_that_cannot_be_applied_is_refused_when_the_task_is_defined(
        sqlite_app: Celery, limits: Any, problem: str) -> None:
    """duraflow_limits with a wrong type or an unknown parameter fails when the task is built."""
    app = sqlite_app
    with pytest.raises(ConfigurationError, match=problem):
        @app.task(base=DurableTask, duraflow_limits=limits)
        def work(tenant: str) -> None:
            pass

        # Celery builds a task's class when it is first used (or the app is finalized).
        assert work.name


@pytest.mark.parametrize("make, problem", [
    (lambda: Concurrency(0), "at least 1"),
    (lambda: Concurrency(True), "at least 1"),  # type: ignore[arg-type]
    (lambda: RateLimit(5, per=float("inf")), "finite"),
    (lambda: RateLimit(5, per=float("nan")), "finite"),
    (lambda: RateLimit(5, per=0), "above 0"),
    (lambda: RateLimit(-1, per=1), "at least 1"),
    (lambda: Dedupe(key="a", window=timedelta(seconds=-1)), "above 0"),
    (lambda: Dedupe(key=None, window=1), "needs a key"),
    (lambda: Concurrency(1, key=3), "neither a parameter"),  # type: ignore[arg-type]
    (lambda: Concurrency(1, scope="a/b"), "no '/'"),
])
def test_bad_limits_are_refused_when_declared(make: Callable[[], Any], problem: str) -> None:
    """A limit below 1, a window that is not finite and positive, a bad key or scope: refused."""
    with pytest.raises(ConfigurationError, match=problem):
        make()


@pytest.mark.parametrize("key, problem", [
    (lambda tenant: 1 / 0, "raised ZeroDivisionError"),
    (lambda tenant: 42, "not a string"),
    (lambda tenant: "x" * 300, "longer than"),
    (lambda tenant: "a\ud800", "lone surrogate"),
    ("tenant", "must be a string or an integer"),
])
def test_a_key_that_cannot_be_computed_fails_the_run_before_its_body(
        make_app: Callable[..., Celery], key: Any, problem: str) -> None:
    """A key function that raises or returns a non-string fails the run; no body ran."""
    app = make_app()
    calls: list[int] = []

    @app.task(base=DurableTask, duraflow_limits=[Concurrency(1, key=key)])
    def work(tenant: Any) -> None:
        calls.append(1)

    result = work.apply(args=([1.5] if key == "tenant" else ["t"]))
    assert isinstance(result.result, FlowKeyError)
    assert problem in str(result.result) and result.id in str(result.result)
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed" and "FlowKeyError" in str(run.error)
    assert calls == []


@pytest.mark.pooled
def test_a_rate_limit_is_never_exceeded_in_any_window(make_app: Callable[..., Celery]) -> None:
    """RateLimit(3, per=1 s) across 3 worker threads: no 1 s window holds 4 body starts."""
    app = _worker_app(make_app)
    ledger = Ledger()

    @app.task(base=DurableTask, duraflow_limits=[RateLimit(3, per=1.0, scope="api")])
    def call(n: int) -> int:
        with step("call"):
            ledger.run("api", str(n), 0.0)
        return n

    with run_worker(app, pool="threads", concurrency=3):
        results = [call.delay(n) for n in range(10)]
        assert sorted(r.get(timeout=RESULT_TIMEOUT) for r in results) == list(range(10))
    starts = sorted(start for _, _, start in ledger.starts)
    assert len(starts) == 10
    for i, start in enumerate(starts):
        assert sum(1 for other in starts[i:] if other < start + 1.0) <= 3, starts
    # Ten calls at three a second need at least three whole windows.
    assert starts[-1] - starts[0] >= 3.0
    for result in results:
        run = get_run(result.id, app=app)
        assert run is not None and run.retries == 0


@pytest.mark.pooled
def test_dedupe_under_concurrent_sends_gives_one_run(make_app: Callable[..., Celery]) -> None:
    """20 threads sending one dedupe key at once get one task id, and the body runs once."""
    app = _worker_app(make_app)
    calls: list[str] = []

    @app.task(base=DurableTask, duraflow_dedupe=Dedupe(key="order", window=60))
    def charge(order: str) -> str:
        with step("charge"):
            calls.append(order)
        return order

    ids: list[str] = []
    barrier = threading.Barrier(20)

    def send() -> None:
        barrier.wait()
        ids.append(charge.delay(order="o-1").id)

    threads = [threading.Thread(target=send) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(ids) == 20 and len(set(ids)) == 1
    with run_worker(app):
        assert charge.AsyncResult(ids[0]).get(timeout=RESULT_TIMEOUT) == "o-1"
        # Another key is another run.
        assert charge.delay(order="o-2").get(timeout=RESULT_TIMEOUT) == "o-2"
    assert sorted(calls) == ["o-1", "o-2"]
    store = store_for(config_for_app(app))
    with store.reading("test") as conn:
        runs = store.tables.runs
        assert len(list(conn.execute(select(runs.c.task_id)))) == 2


def test_a_deduped_send_whose_message_is_lost_is_sent_by_the_sweep(
        make_app: Callable[..., Celery]) -> None:
    """The dedupe key's run is recorded before its message: the sweep sends it if lost."""
    app = _worker_app(make_app, duraflow_lease_seconds=1.0)
    calls: list[str] = []

    @app.task(base=DurableTask, duraflow_dedupe=Dedupe(key="order", window=60))
    def charge(order: str) -> str:
        with step("charge"):
            calls.append(order)
        return order

    task_id = str(uuid.uuid4())
    store = store_for(config_for_app(app))
    # The sender died between claiming the key and publishing: only the claim is there.
    from celery_duraflow._serialization import encode_arguments, get_serializer
    blob, fingerprint = encode_arguments((), {"order": "o-9"}, get_serializer("json"),
                                         task_id=task_id, task_name=charge.name,
                                         serializer_name="json")
    assert store.claim_dedupe(scope=charge.name, key="o-9", task_id=task_id, window=60,
                              run={"task_name": charge.name, "args": blob,
                                   "args_fingerprint": fingerprint, "exchange": None,
                                   "routing_key": None}) == task_id
    assert charge.delay(order="o-9").id == task_id  # a later send finds the same run
    time.sleep(1.1)
    with run_worker(app):
        assert task_id in recover(app)
        assert charge.AsyncResult(task_id).get(timeout=RESULT_TIMEOUT) == "o-9"
    assert calls == ["o-9"]


def test_a_queued_run_shows_what_it_waits_for_on_every_surface(
        make_app: Callable[..., Celery]) -> None:
    """get_run, `show` and the web run page say which key a run waits for and its place."""
    from celery.bin.celery import celery as celery_command
    from click.testing import CliRunner

    from celery_duraflow._store import Delivery
    from tests.test_web import logged_in

    app = make_app(task_default_queue=f"flow-{uuid.uuid4().hex[:8]}")

    @app.task(base=DurableTask, duraflow_limits=[Concurrency(1, key="tenant")])
    def work(tenant: str) -> None:
        pass

    store = store_for(config_for_app(app))
    for task_id, owner in (("holder", "w-1"), ("queued", "w-2")):
        store.begin_attempt(task_id, Delivery(task_name=work.name, owner=owner, first=True))
    assert store.acquire_slot("holder", "w-1", scope=work.name, key="acme", limit=1,
                              grace=5.0, sweep_after=None).state == "granted"
    assert store.acquire_slot("queued", "w-2", scope=work.name, key="acme", limit=1,
                              grace=5.0, sweep_after=None).state == "waiting"
    run = get_run("queued", app=app)
    assert run is not None and run.status == "waiting" and run.wait_kind == "slot"
    assert [(p.scope, p.key, p.position, p.holding, p.limit) for p in run.queue] == [
        (work.name, "acme", 1, 1, 1)]
    note = f"place 1 in the queue of '{work.name}/acme', 1 of 1 slots taken"
    shown = CliRunner().invoke(celery_command,  # type: ignore[arg-type]
                               ["-A", app, "duraflow", "show", "queued"],
                               env={"COLUMNS": "400"})
    assert shown.exit_code == 0, shown.output
    assert f"waits for a concurrency slot of '{work.name}/acme'" in shown.stdout
    assert note in shown.stdout
    page = logged_in(app).get("/runs/queued")
    assert page.status_code == 200
    assert note.replace("'", "&#39;") in page.text or note in page.text


@pytest.mark.pooled
def test_a_trailing_debounce_runs_once_after_the_burst_with_the_last_arguments(
        make_app: Callable[..., Celery]) -> None:
    """Five sends 0.1 s apart with delay 1 s: one run, after the last send, with its arguments.
    (The delay leaves a loaded machine 0.9 s per send: at 0.5 s a slow send split the burst.)"""
    app = _worker_app(make_app)
    seen: list[tuple[int, float]] = []

    @app.task(base=DurableTask, duraflow_debounce=Debounce(key="doc", delay=1.0))
    def reindex(doc: str, version: int) -> int:
        with step("reindex"):
            seen.append((version, time.time()))
        return version

    with run_worker(app):
        ids = []
        for version in range(5):
            ids.append(reindex.delay("d-1", version).id)
            last_send = time.time()
            time.sleep(0.1)
        assert len(set(ids)) == 1
        run = get_run(ids[0], app=app)
        assert run is not None and run.status == "sleeping" and run.wait_kind == "debounce"
        assert reindex.AsyncResult(ids[0]).get(timeout=RESULT_TIMEOUT) == 4
        # The next send after the burst has fired is a new run.
        later = reindex.delay("d-1", 5)
        assert later.id != ids[0] and later.get(timeout=RESULT_TIMEOUT) == 5
    assert [version for version, _ in seen] == [4, 5]
    assert seen[0][1] >= last_send + 1.0 - 0.05


def test_a_trailing_debounce_fires_by_max_delay_under_a_steady_stream(
        make_app: Callable[..., Celery]) -> None:
    """Sends every 0.15 s for 2 s never pause 0.5 s, yet max_delay=1 s runs them in bursts."""
    app = _worker_app(make_app)
    seen: list[tuple[int, float]] = []

    @app.task(base=DurableTask,
              duraflow_debounce=Debounce(key="doc", delay=0.5, max_delay=1.0))
    def reindex(doc: str, version: int) -> int:
        with step("reindex"):
            seen.append((version, time.time()))
        return version

    with run_worker(app):
        started = time.time()
        ids = []
        for version in range(14):
            ids.append(reindex.delay("d-1", version).id)
            time.sleep(0.15)
        for task_id in dict.fromkeys(ids):
            reindex.AsyncResult(task_id).get(timeout=RESULT_TIMEOUT)
    assert len(set(ids)) >= 2
    assert seen[0][1] - started < 1.0 + 0.5  # capped, though the stream never paused
    assert seen[-1][0] == 13  # the last burst ran with the last send's arguments


def test_a_leading_debounce_runs_the_first_send_and_drops_the_rest_of_the_burst(
        make_app: Callable[..., Celery]) -> None:
    """mode='leading': the first send runs at once; sends within the delay join it."""
    app = _worker_app(make_app)
    seen: list[int] = []

    @app.task(base=DurableTask,
              duraflow_debounce=Debounce(key="user", delay=0.6, mode="leading"))
    def notify(user: str, n: int) -> int:
        with step("notify"):
            seen.append(n)
        return n

    with run_worker(app):
        first = notify.delay("u", 0)
        assert first.get(timeout=RESULT_TIMEOUT) == 0
        joined = [notify.delay("u", n).id for n in (1, 2)]
        assert joined == [first.id, first.id]
        time.sleep(0.7)
        assert notify.delay("u", 3).get(timeout=RESULT_TIMEOUT) == 3
    assert seen == [0, 3]


@pytest.mark.parametrize("options, problem", [
    ({"duraflow_debounce": Debounce(key="doc", delay=1),
      "duraflow_dedupe": Dedupe(key="doc", window=1)}, "keep one"),
    ({"duraflow_debounce": "soon"}, "must be a Debounce"),
])
def test_conflicting_send_options_are_refused_when_the_task_is_built(
        sqlite_app: Celery, options: dict[str, Any], problem: str) -> None:
    """Dedupe with Debounce, or a Debounce that is no Debounce, fails when the task is built."""
    app = sqlite_app
    with pytest.raises(ConfigurationError, match=problem):
        @app.task(base=DurableTask, **options)
        def work(doc: str) -> None:
            pass

        assert work.name


@pytest.mark.parametrize("make, problem", [
    (lambda: Debounce(key="d", delay=2, max_delay=1), "shorter than"),
    (lambda: Debounce(key="d", delay=1, mode="middle"), "'trailing' or 'leading'"),
    (lambda: Debounce(key=None, delay=1), "needs a key"),
])
def test_bad_debounces_are_refused_when_declared(make: Callable[[], Any], problem: str) -> None:
    """A max_delay under the delay, an unknown mode or no key: ConfigurationError."""
    with pytest.raises(ConfigurationError, match=problem):
        make()


@pytest.mark.pooled
def test_attempts_racing_for_one_keys_slots_never_exceed_the_limit(
        make_app: Callable[..., Celery]) -> None:
    """8 threads taking and freeing one key's 2 slots for 2 s, half of them as their runs
    start, the others after: never 3 holders, no error."""
    from celery_duraflow._flow_store import SlotAnswer
    from celery_duraflow._store import Delivery

    app = make_app()
    store = store_for(config_for_app(app))
    lock = threading.Lock()
    holding: set[str] = set()
    most = [0]
    taken = [0]
    errors: list[BaseException] = []
    deadline = time.monotonic() + 2.0

    def attempts(n: int) -> None:
        try:
            while time.monotonic() < deadline:
                task_id, owner = f"race-{n}-{uuid.uuid4().hex[:6]}", f"owner-{n}"
                delivery = Delivery(task_name="race", owner=owner, first=True)
                if n % 2:  # half the threads take the slot in the run's own insert
                    _, _, holding_now = store.begin_holding(task_id, delivery, scope="race",
                                                            key="hot", limit=2)
                else:
                    store.begin_attempt(task_id, delivery)
                    holding_now = False
                answer = (SlotAnswer("granted", 0, 0, []) if holding_now else
                          store.acquire_slot(task_id, owner, scope="race", key="hot", limit=2,
                                             grace=5.0, sweep_after=None))
                tries = 0
                while answer.state == "waiting" and time.monotonic() < deadline + 5:
                    # Delivered again (as when woken, or sent again by the sweep).
                    time.sleep(0.002)
                    tries += 1
                    owner = f"owner-{n}-{tries}"
                    store.begin_attempt(task_id, Delivery(task_name="race", owner=owner))
                    answer = store.acquire_slot(task_id, owner, scope="race", key="hot",
                                                limit=2, grace=5.0, sweep_after=None)
                if answer.state == "granted":
                    with lock:
                        holding.add(task_id)
                        most[0] = max(most[0], len(holding))
                        taken[0] += 1
                    time.sleep(0.002)
                    with lock:
                        holding.discard(task_id)
                store.finish_run(task_id, owner, "succeeded")
                store.release_slots(task_id, owner, grace=5.0)
        except BaseException as error:  # reported below, with the thread's failure
            errors.append(error)

    threads = [threading.Thread(target=attempts, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert most[0] <= 2 and taken[0] > 10


@pytest.mark.pooled
def test_a_new_run_never_takes_a_freed_slot_ahead_of_a_queued_run(
        make_app: Callable[..., Celery]) -> None:
    """A slot freed while a run is queued goes to that run, even to a new run that starts
    between the freeing and the hand-over and finds the slot's number free."""
    from celery_duraflow._store import Delivery

    app = make_app()
    store = store_for(config_for_app(app))

    def start(task_id: str) -> tuple[str, bool]:
        owner = f"owner-{task_id}"
        _, _, holding = store.begin_holding(
            task_id, Delivery(task_name="order", owner=owner, first=True),
            scope="order", key="k", limit=1)
        return owner, holding

    first, holds = start("first")
    assert holds or store.acquire_slot("first", first, scope="order", key="k", limit=1,
                                       grace=5.0, sweep_after=None).state == "granted"
    second, holds = start("second")
    assert not holds
    assert store.acquire_slot("second", second, scope="order", key="k", limit=1, grace=5.0,
                              sweep_after=None).state == "waiting"
    finished, queued = store.finish_freeing("first", first, result=None, serializer=None)
    assert finished and queued == {("order", "k")}
    # Between the freeing and the hand-over: slot 0 has no row, and "second" waits.
    third, holds = start("third")
    assert not holds
    assert store.acquire_slot("third", third, scope="order", key="k", limit=1, grace=5.0,
                              sweep_after=None).state == "waiting"
    store.settle_keys(queued, grace=5.0, task_id="first")
    statuses = {name: store.get_run(name).status  # type: ignore[union-attr]
                for name in ("second", "third")}
    assert statuses == {"second": "running", "third": "waiting"}
    assert [place.position for place in store.queued("third")] == [1]


@pytest.mark.postgres
@pytest.mark.pooled
@pytest.mark.parametrize("database_url", ["postgres", "pgbouncer"], indirect=True)
def test_a_run_that_succeeds_frees_its_slot_in_the_write_that_records_its_end(
        make_app: Callable[..., Celery]) -> None:
    """On PostgreSQL a new limited run whose limit does not bind costs the round trips of an
    unlimited one: its slot is taken by the insert that starts it and freed by the
    statement that records its end."""
    from tests.test_store import count_round_trips

    app = make_app()

    @app.task(base=DurableTask, duraflow_limits=[Concurrency(2, key="tenant")])
    def limited(tenant: str) -> int:
        with step("s") as s:
            s.result = 1
        return int(s.result)

    @app.task(base=DurableTask)
    def unlimited(tenant: str) -> int:
        with step("s") as s:
            s.result = 1
        return int(s.result)

    store = store_for(config_for_app(app))
    for task in (limited, unlimited):  # prepared and warm before counting
        for _ in range(6):
            assert task.apply(args=(f"warm-{uuid.uuid4().hex[:6]}",)).get() == 1
    counts = {}
    for task in (limited, unlimited):
        with count_round_trips(store) as round_trips:
            assert task.apply(args=("acme",)).get() == 1
        counts[task.name] = round_trips[0]
    assert counts[limited.name] == counts[unlimited.name], counts
    with store.engine.connect() as conn:
        assert conn.execute(select(store.tables.flow_slots)).all() == []



def test_a_fire_racing_a_capped_send_sends_the_arguments_it_claimed(
        make_app: Callable[..., Celery], clock: Clock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A send that joins a burst capped by max_delay (its fire time unchanged) between the
    fire's read of the run and its claim: the run is sent with that send's arguments, and
    its delivery runs instead of failing on arguments other than the recorded ones."""
    app = _worker_app(make_app)
    seen: list[int] = []

    @app.task(base=DurableTask,
              duraflow_debounce=Debounce(key="doc", delay=0.5, max_delay=1.0))
    def reindex(doc: str, version: int) -> int:
        with step("reindex"):
            seen.append(version)
        return version

    start = clock.now
    task_id = reindex.delay("d-1", 0).id
    for version in (1, 2):
        clock.advance(seconds=0.4)
        assert reindex.delay("d-1", version).id == task_id  # the second is capped at 1.0 s
    store = store_for(config_for_app(app))
    read = store.get_run

    def read_then_a_send_lands(run_id: str, **options: Any) -> Any:
        run = read(run_id, **options)
        clock.to(start + timedelta(seconds=0.99))
        assert reindex.delay("d-1", 3).id == task_id  # capped: same fire time, new arguments
        clock.to(start + timedelta(seconds=1.0))
        return run

    clock.to(start + timedelta(seconds=1.0))
    monkeypatch.setattr(store, "get_run", read_then_a_send_lands)
    assert app.tasks[FIRE_TASK_NAME].apply(args=(task_id,)).get() is True
    monkeypatch.undo()
    with run_worker(app):
        assert reindex.AsyncResult(task_id).get(timeout=RESULT_TIMEOUT) == 3
    assert seen == [3]
