"""DurableTask under the rest of Celery's task API, on a real prefork ``celery worker``.

Each finding of "a good Celery citizen" has its test here: retry with new arguments,
Task.replace (durable and plain replacements, in a chain), result objects and
ignore_result, retry(throw=False), a hard time limit, Ignore and Reject, the cap on
recoveries, and eager chains. The rule they pin: Celery's outcome is the run's outcome,
and no side effect happens twice because of the task class.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chain
from celery.result import AsyncResult
from sqlalchemy import text

from celery_duraflow import DurableTask, get_run, retry_run, step
from celery_duraflow._config import config_for_app
from celery_duraflow._recovery import sweep
from celery_duraflow._store import Delivery, store_for
from celery_duraflow.errors import RunStateError
from tests.conftest import run_worker, wait_for_status
from tests.workers import (
    client_app,
    end_project,
    fetch_all,
    log_tail,
    proj_env,
    start_worker_process,
)

RESULT_TIMEOUT = 30.0
LEASE_SECONDS = 2.0


@dataclass
class Worker:
    """One prefork worker on tests.proj for the whole module, with its own tables."""

    process: subprocess.Popen[bytes]
    log_path: Path
    queue: str
    client: Celery
    database_url: str
    prefix: str

    def send(self, name: str, *args: Any, task_id: str | None = None) -> AsyncResult:
        return self.client.signature(name, args=args).apply_async(
            queue=self.queue, task_id=task_id or str(uuid.uuid4()))

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def charges(self, task_id: str) -> dict[str, int]:
        """How many ledger rows each label has under ``task_id``."""
        rows = fetch_all(self.database_url, f'SELECT user_id, count(*) FROM "{self.prefix}charges" '
                         "WHERE task_id = :task_id GROUP BY user_id", {"task_id": task_id})
        return {label: count for label, count in rows}

    def run(self, task_id: str, status: str, timeout: float = RESULT_TIMEOUT) -> Any:
        deadline = time.monotonic() + timeout
        run = None
        while time.monotonic() < deadline:
            run = get_run(task_id, app=self.client)
            if run is not None and run.status == status:
                return run
            time.sleep(0.05)
        raise AssertionError(f"run {task_id} is {run.status if run else 'unknown'}, not "
                             f"{status}\nworker log:\n{log_tail(self.log_path, 80)}")


@pytest.fixture(scope="module")
def worker(pg_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[Worker]:
    prefix = f"c{uuid.uuid4().hex[:10]}_"
    queue = f"duraflow-citizen-{uuid.uuid4().hex[:12]}"
    log_path = tmp_path_factory.mktemp("citizen") / "worker.log"
    client = client_app(pg_url, redis_url, prefix)
    client.conf.update(duraflow_lease_seconds=LEASE_SECONDS, task_default_queue=queue)
    process = None
    try:
        process = start_worker_process(
            queue, log_path, proj_env(pg_url, redis_url, prefix,
                                      PROJ_LEASE_SECONDS=str(LEASE_SECONDS),
                                      PROJ_DEFAULT_QUEUE=queue))
        yield Worker(process=process, log_path=log_path, queue=queue, client=client,
                     database_url=pg_url, prefix=prefix)
    finally:
        end_project(client, pg_url, prefix, [process] if process is not None else [], [queue])


pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.subprocess]


def test_retry_with_new_arguments_continues_the_run(worker: Worker) -> None:
    """self.retry(args=...) moves the run on to the new arguments; each page is charged once."""
    result = worker.send("proj.paginate", 0, 3)
    assert result.get(timeout=RESULT_TIMEOUT) == [0, 1, 2]
    worker.run(result.id, "succeeded")
    assert worker.charges(result.id) == {"page-0": 1, "page-1": 1, "page-2": 1}
    record = store_for(config_for_app(worker.client)).get_run(result.id)
    assert record is not None and json.loads(record.args or "") == {"args": [2, 3],
                                                                     "kwargs": {}}


def test_stale_delivery_with_the_old_arguments_is_still_refused(worker: Worker) -> None:
    """After retry(args=...), a delivery with the arguments the run left behind is refused."""
    result = worker.send("proj.paginate", 0, 2)
    assert result.get(timeout=RESULT_TIMEOUT) == [0, 1]
    worker.send("proj.paginate", 0, 2, task_id=result.id)
    # Celery's backend keeps the first SUCCESS of an id, so the refusal shows in the log.
    refused = f"Task proj.paginate[{result.id}] raised unexpected: RunArgumentsMismatch"
    deadline = time.monotonic() + RESULT_TIMEOUT
    while time.monotonic() < deadline and refused not in worker.log_text():
        time.sleep(0.1)
    assert refused in worker.log_text()
    assert worker.charges(result.id) == {"page-0": 1, "page-1": 1}


def test_durable_replacement_is_a_run_of_its_own(worker: Worker) -> None:
    """Task.replace with a durable task: both charge once, the replaced run ends replaced."""
    result = worker.send("proj.replaced", "trip", "durable")
    value = result.get(timeout=RESULT_TIMEOUT)
    charges = worker.charges(result.id)
    assert charges == {"trip-replaced": 1, "trip-replacement": 1}
    assert value == {"replacement_charge": value["replacement_charge"]}
    run = worker.run(result.id, "replaced")
    assert run.error is None and run.replaced_by == f"{result.id}~r1"
    assert worker.run(f"{result.id}~r1", "succeeded").task_name == "proj.replacement"
    with pytest.raises(RunStateError, match="replaced"):
        retry_run(result.id, app=worker.client)


def test_redelivery_of_a_replaced_task_runs_nothing(worker: Worker) -> None:
    """A late delivery of a task that was replaced is ignored: nothing is charged again."""
    result = worker.send("proj.replaced", "again", "durable")
    result.get(timeout=RESULT_TIMEOUT)
    late = worker.send("proj.replaced", "again", "durable", task_id=result.id)
    deadline = time.monotonic() + 5
    ignored = f"task {result.id} (proj.replaced) was replaced by another task"
    while time.monotonic() < deadline and ignored not in worker.log_text():
        time.sleep(0.1)
    assert ignored in worker.log_text()
    assert late.id == result.id
    assert worker.charges(result.id) == {"again-replaced": 1, "again-replacement": 1}
    assert worker.run(result.id, "replaced").status == "replaced"


def test_plain_replacement_ends_the_durable_run(worker: Worker) -> None:
    """Task.replace with a plain task: Celery returns its result, the run ends replaced."""
    result = worker.send("proj.replaced", "plain", "plain")
    assert result.get(timeout=RESULT_TIMEOUT) == {"plain": "plain"}
    worker.run(result.id, "replaced")
    assert worker.charges(result.id) == {"plain-replaced": 1}


def test_replacement_inside_a_chain(worker: Worker) -> None:
    """A replaced link of a chain hands its replacement's result to the next link."""
    signature = chain(worker.client.signature("proj.replaced", args=("chain", "durable")),
                      worker.client.signature("proj.after"))
    result = signature.apply_async(queue=worker.queue)
    value = result.get(timeout=RESULT_TIMEOUT)
    replaced_id = result.parent.id
    assert set(value) == {"after"}
    assert worker.charges(replaced_id) == {"chain-replaced": 1, "chain-replacement": 1}
    worker.run(replaced_id, "replaced")


def test_replacement_with_a_group(worker: Worker) -> None:
    """Task.replace with a group (Celery adds its own celery.accumulate) runs every member."""
    result = worker.send("proj.replaced", "group", "group")
    value = result.get(timeout=RESULT_TIMEOUT)
    assert value[0] == 1 and set(value[1]) == {"replacement_charge"}
    worker.run(result.id, "replaced")


def test_result_object_is_stored_as_celery_stores_it(worker: Worker) -> None:
    """A task returning a GroupResult succeeds; the run stores its as_tuple(), as Celery does."""
    result = worker.send("proj.fan_out", "fan")
    value = result.get(timeout=RESULT_TIMEOUT)
    run = worker.run(result.id, "succeeded")
    assert run.result == value
    again = worker.send("proj.fan_out", "fan", task_id=result.id)
    assert again.get(timeout=RESULT_TIMEOUT) == value
    assert worker.charges(result.id) == {"fan": 1}


def test_ignored_result_need_not_be_storable(worker: Worker) -> None:
    """With ignore_result=True, an unstorable return value ends the run succeeded, no result."""
    result = worker.send("proj.fire_and_forget", "forget")
    run = worker.run(result.id, "succeeded")
    assert run.result is None and run.error is None
    assert worker.charges(result.id) == {"forget": 1}


def test_retry_without_throw_runs_the_retry(worker: Worker) -> None:
    """retry(throw=False) then return: the retry runs its body; the charge is not repeated."""
    result = worker.send("proj.retry_without_throw", "nothrow")
    run = worker.run(result.id, "succeeded")
    assert run.result == "retried"
    assert worker.charges(result.id) == {"nothrow": 1, "nothrow-body": 2}


def test_hard_time_limit_fails_the_run_and_the_sweep_leaves_it(worker: Worker) -> None:
    """A hard time limit fails the run in the store, and no sweep runs its body again."""
    result = worker.send("proj.stuck", "limit")
    run = worker.run(result.id, "failed", timeout=20)
    assert "TimeLimitExceeded" in (run.error or "")
    time.sleep(LEASE_SECONDS * 2)
    assert result.id not in sweep(worker.client).sent
    time.sleep(LEASE_SECONDS * 2)
    assert worker.charges(result.id) == {"limit-body": 1, "limit": 1}
    assert result.state == "FAILURE"


@pytest.mark.parametrize(("name", "status"), [("proj.ignores", "ignored"),
                                              ("proj.rejects", "rejected")])
def test_ignore_and_reject_end_the_run(worker: Worker, name: str, status: str) -> None:
    """A run ended by Ignore or Reject(requeue=False) gets that status; the sweep leaves it."""
    result = worker.send(name, status)
    worker.run(result.id, status)
    time.sleep(LEASE_SECONDS * 1.5)
    assert result.id not in sweep(worker.client).sent
    assert worker.charges(result.id) == {status: 1}


ARGS = '{"args": [], "kwargs": {}}'


def _lost_run(make_app: Any, redis_url: str, max_recoveries: int) -> tuple[Celery, Any, str]:
    """An app whose queue no worker reads, and a run of its task ``citizen.lost`` taken by
    an attempt that died (its owner is on no live host): (app, store, task id)."""
    app = make_app(eager=False, broker=redis_url, duraflow_max_recoveries=max_recoveries,
                   duraflow_lease_seconds=1, task_default_queue=f"nobody-{uuid.uuid4().hex}")

    @app.task(base=DurableTask, name="citizen.lost")
    def lost() -> None:
        with step("work"):
            pass

    store = store_for(config_for_app(app))
    task_id = str(uuid.uuid4())
    store.ensure_schema()
    store.begin_attempt(task_id, Delivery(task_name="citizen.lost", owner="elsewhere|x|1|y",
                                          args=ARGS))
    return app, store, task_id


def test_recoveries_are_capped(make_app: Any, redis_url: str) -> None:
    """A run whose attempts keep getting lost is failed after duraflow_max_recoveries sends."""
    app, store, task_id = _lost_run(make_app, redis_url, 2)
    sent = 0
    for n in range(6):
        time.sleep(1.1)
        done = sweep(app)
        sent += done.sent.count(task_id)
        if task_id in done.failed:
            break
        # The message the sweep sent is taken by an attempt that dies in turn (nobody reads
        # the queue here, so the test stands in for that worker).
        store.begin_attempt(task_id, Delivery(task_name="citizen.lost",
                                              owner=f"elsewhere|x|{n + 2}|y", args=ARGS))
    assert sent == 2
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "failed"
    assert "duraflow_max_recoveries" in (run.error or "")


def test_a_run_whose_message_is_not_taken_is_sent_again_but_never_failed(
        make_app: Any, redis_url: str) -> None:
    """A sent run that no worker takes (a backlog, a queue nobody reads) spends no recovery:
    the sweep sends it again, less and less often, and never marks it failed."""
    app, _, task_id = _lost_run(make_app, redis_url, 1)
    sends: list[float] = []
    deadline = time.monotonic() + 9.0
    while time.monotonic() < deadline:
        done = sweep(app)
        assert task_id not in done.failed
        if task_id in done.sent:
            sends.append(time.monotonic())
        time.sleep(0.1)
    run = get_run(task_id, app=app)
    assert run is not None and run.status == "running" and run.lease_owner is None
    # The one lost attempt (the dead owner) is the only recovery counted.
    assert run.recoveries == 1
    # Sent again after 1 s (the lost attempt), then 1, 2 and 4 s apart: not once a lease.
    assert 3 <= len(sends) <= 5, sends
    gaps = [later - earlier for earlier, later in itertools.pairwise(sends)]
    assert gaps == sorted(gaps) and gaps[-1] > 2 * gaps[0], gaps


@pytest.mark.parametrize("frozen", [False, True])
def test_eager_chain_links_are_runs_of_their_own(make_app: Any, frozen: bool) -> None:
    """An eager chain of durable links runs every link, as with a plain task class."""
    app = make_app(eager=True)
    calls: list[int] = []

    @app.task(base=DurableTask, name="citizen.tick")
    def tick(value: int = 0) -> int:
        with step("tick") as s:
            calls.append(value)
            s.result = len(calls)
        return int(s.result)

    @app.task(base=DurableTask, name="citizen.add")
    def add(total: int, more: int) -> int:
        return total + more

    ticks = chain(tick.si(), tick.si(), tick.si())
    adds = chain(tick.si(5), add.s(10), add.s(100))
    if frozen:
        ticks.freeze()
        adds.freeze()
    assert ticks.apply().get() == 3
    assert calls == [0, 0, 0]
    assert adds.apply().get() == 4 + 10 + 100


def test_celery_builtin_tasks_stay_plain_under_an_app_wide_durable_class(
        database_url: str, table_prefix: str) -> None:
    """With task_cls=DurableTask app-wide, a group replacement's celery.accumulate runs plain."""
    app = Celery(f"citizen-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False,
                 task_cls=DurableTask)
    app.conf.update(result_backend="cache+memory://", duraflow_database_url=database_url,
                    duraflow_table_prefix=table_prefix,
                    broker_transport_options={"polling_interval": 0.05},
                    worker_hijack_root_logger=False)

    @app.task(bind=True, name="citizen.grouped", shared=False)
    def grouped(self: Any, n: int) -> Any:
        from celery import group

        with step("before"):
            pass
        return self.replace(group(echo.s(i) for i in range(n)))

    @app.task(name="citizen.echo", shared=False)
    def echo(value: int) -> int:
        return value

    assert isinstance(app.tasks["celery.accumulate"], DurableTask)
    with run_worker(app):
        result = grouped.delay(3)
        assert result.get(timeout=RESULT_TIMEOUT) == [0, 1, 2]
        assert wait_for_status(app, result.id, "replaced").status == "replaced"
    store = store_for(config_for_app(app))
    with store.engine.connect() as conn:
        names = {row[0] for row in conn.execute(text(
            f'SELECT task_name FROM "{store.tables.runs.name}"'))}
    assert names == {"citizen.grouped", "citizen.echo"}


def test_eager_replacement_keeps_the_two_runs_apart(make_app: Any) -> None:
    """An eager Task.replace runs the replacement under a run key of its own, once."""
    app = make_app(eager=True)
    effects: list[str] = []

    @app.task(base=DurableTask, name="citizen.second")
    def second(label: str) -> str:
        with step("charge") as s:
            effects.append(f"second-{label}")
            s.result = f"second charged {label}"
        return str(s.result)

    @app.task(base=DurableTask, bind=True, name="citizen.first")
    def first(self: DurableTask, label: str) -> Any:
        with step("charge") as s:
            effects.append(f"first-{label}")
            s.result = "first charged"
        return self.replace(second.s(label))

    task_id = str(uuid.uuid4())
    assert first.apply(args=("x",), task_id=task_id).get() == "second charged x"
    assert effects == ["first-x", "second-x"]
    run = get_run(task_id, app=app)
    assert run is not None and run.replaced_by == f"{task_id}~r1"
    replacement_run = get_run(f"{task_id}~r1", app=app)
    assert replacement_run is not None and replacement_run.status == "succeeded"
    assert first.apply(args=("x",), task_id=task_id).get() == "second charged x"
    assert effects == ["first-x", "second-x"]
