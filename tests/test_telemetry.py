"""OpenTelemetry: the spans, events and metrics of runs, read with the SDK's in-memory exporters.

Each test gives the instrumentation a tracer provider and a meter provider of its
own (``instrument(tracer_provider=..., meter_provider=...)``), so nothing is set
on OpenTelemetry's global providers, and puts back how the process was
instrumented before it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from sqlalchemy import update

from celery_duraflow import (
    Concurrency,
    DurableTask,
    StoreUnavailable,
    add_schedule,
    fire_schedules,
    recover,
    schedule_run_id,
    send_signal,
    sleep,
    step,
    wait_for_signal,
)
from celery_duraflow._config import config_for_app
from celery_duraflow._serialization import encode_arguments, get_serializer
from celery_duraflow._store import Delivery, store_for
from celery_duraflow.contrib import opentelemetry as otel
from tests.conftest import Clock, app_factory, run_worker, wait_for_status

REPO_ROOT = Path(__file__).resolve().parent.parent
# An owner on another machine: never judged gone by its pid, only by its expired lease.
ELSEWHERE = "another-host|another-machine|4242|abc"


class Telemetry:
    """The spans and metrics one test's providers received."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def spans(self, prefix: str = "duraflow") -> list[ReadableSpan]:
        return [span for span in self.exporter.get_finished_spans()
                if span.name.startswith(prefix)]

    def span(self, name: str) -> ReadableSpan:
        found = [span for span in self.spans("") if span.name == name]
        assert len(found) == 1, [span.name for span in self.spans("")]
        return found[0]

    def points(self, metric: str) -> list[tuple[dict[str, Any], Any]]:
        """(attributes, data point) of every point of ``metric``."""
        data = self.reader.get_metrics_data()
        found: list[tuple[dict[str, Any], Any]] = []
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for item in scope.metrics:
                    if item.name == metric:
                        found += [(dict(point.attributes or {}), point)
                                  for point in item.data.data_points]
        return found

    def counts(self, metric: str, *keys: str) -> dict[tuple[Any, ...], int]:
        """A counter's values by the given attributes."""
        return {tuple(attributes.get(key) for key in keys): point.value
                for attributes, point in self.points(metric)}


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    """This test's own providers, given to the instrumentation; the process's state put back."""
    was_on, refused = otel.is_instrumented(), otel._refused
    seen = Telemetry()
    otel.instrument(tracer_provider=seen.tracer_provider, meter_provider=seen.meter_provider)
    try:
        yield seen
    finally:
        if was_on:
            otel.instrument()
        else:
            otel.uninstrument()
        otel._refused = refused
        seen.tracer_provider.shutdown()
        seen.meter_provider.shutdown()


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def _parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def _events(span: ReadableSpan, name: str) -> list[dict[str, Any]]:
    return [dict(event.attributes or {}) for event in span.events if event.name == name]


def _queue() -> str:
    """A queue of this test's own: the in-memory broker is shared by the whole process."""
    return f"telemetry-{uuid.uuid4().hex[:12]}"


def _interrupted(app: Celery, task: Any, *, steps: dict[str, str] | None = None,
                 args: tuple[Any, ...] = ()) -> str:
    """A run as a worker that died mid-run leaves it: running, its lease expired."""
    store = store_for(config_for_app(app))
    task_id = str(uuid.uuid4())
    blob, fingerprint = encode_arguments(args, {}, get_serializer("json"))
    store.begin_attempt(task_id, Delivery(task_name=task.name, owner=ELSEWHERE, args=blob,
                                          args_fingerprint=fingerprint))
    for key, status in (steps or {}).items():
        if status == "completed":
            assert store.record_step(task_id, key, ELSEWHERE, status="completed",
                                     started_at=datetime.now(UTC), output='"stored"',
                                     serializer="json")
        else:
            assert store.claim_step(task_id, key, ELSEWHERE, None)
    runs = store.tables.runs
    with store.engine.begin() as conn:
        conn.execute(update(runs).where(runs.c.task_id == task_id).values(
            lease_expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    return task_id


def test_attempt_and_step_spans(make_app: Callable[..., Celery],
                                telemetry: Telemetry) -> None:
    """An attempt is a span; its steps (nested ones too) are its children, with their attributes."""
    app = make_app()
    tracer = telemetry.tracer_provider.get_tracer("the-user")

    def pay() -> int:
        with tracer.start_as_current_span("payment-api"):
            return 100

    @app.task(base=DurableTask, name="trip")
    def trip(user: int) -> str:
        with step("search") as s:
            s.result = "flight"
        with step("book") as s:
            with step("charge") as inner:
                inner.result = pay()
            s.result = f"{user}-{inner.result}"
        return str(s.result)

    result = trip.apply(args=(7,))
    assert result.get() == "7-100"
    attempt = telemetry.span("duraflow attempt trip")
    assert _attrs(attempt) == {"duraflow.task_id": result.id, "duraflow.task_name": "trip",
                               "duraflow.attempt": 1, "duraflow.status": "succeeded"}
    assert attempt.status.status_code == StatusCode.UNSET
    search, book, charge = (telemetry.span(f"duraflow step {name}")
                            for name in ("search", "book", "book/charge"))
    assert _attrs(search) == {
        "duraflow.task_id": result.id, "duraflow.task_name": "trip",
        "duraflow.step_key": "search", "duraflow.step_name": "search", "duraflow.attempt": 1,
        "duraflow.cached": False, "duraflow.in_doubt": False, "duraflow.outcome": "completed"}
    assert _parent(search) == _parent(book) == attempt.context.span_id
    assert _parent(charge) == book.context.span_id
    assert _attrs(charge)["duraflow.step_key"] == "book/charge"
    # The body's own spans are children of its step's span.
    assert _parent(telemetry.span("payment-api")) == charge.context.span_id
    assert {span.context.trace_id for span in telemetry.spans("")} == {
        attempt.context.trace_id}


def test_failed_step_retry_and_replayed_step(make_app: Callable[..., Celery],
                                             telemetry: Telemetry) -> None:
    """A failed step's span holds its error; on the retry the completed step is a cached span."""
    app = make_app()
    calls: list[int] = []

    @app.task(base=DurableTask, name="flaky", bind=True, max_retries=1, default_retry_delay=0)
    def flaky(self: DurableTask) -> str:
        with step("search") as s:
            s.result = "found"
        with step("book") as s:
            calls.append(1)
            if len(calls) == 1:
                raise self.retry(exc=ConnectionError("airline down"))
            s.result = "booked"
        return str(s.result)

    assert flaky.apply().get() == "booked"
    searches = sorted(telemetry.spans("duraflow step search"),
                      key=lambda span: _attrs(span)["duraflow.cached"])
    assert [_attrs(span)["duraflow.cached"] for span in searches] == [False, True]
    assert _attrs(searches[1])["duraflow.attempt"] == 1  # the attempt that completed it
    books = sorted(telemetry.spans("duraflow step book"),
                   key=lambda span: _attrs(span)["duraflow.attempt"])
    failed, booked = books
    assert failed.status.status_code == StatusCode.ERROR
    assert _attrs(failed)["error.type"] == "Retry"
    assert [event.name for event in failed.events] == ["exception"]
    assert _attrs(booked)["duraflow.attempt"] == 2
    assert _attrs(booked)["duraflow.outcome"] == "completed"
    attempts = sorted(telemetry.spans("duraflow attempt"),
                      key=lambda span: _attrs(span)["duraflow.attempt"])
    assert [_attrs(span)["duraflow.status"] for span in attempts] == ["retrying", "succeeded"]
    assert telemetry.counts("duraflow.steps.run", "duraflow.step_name", "duraflow.outcome") == {
        ("search", "completed"): 1, ("book", "failed"): 1, ("book", "completed"): 1}
    assert telemetry.counts("duraflow.steps.replayed", "duraflow.step_name") == {("search",): 1}


def test_in_doubt_step(make_app: Callable[..., Celery], telemetry: Telemetry) -> None:
    """The first unfinished step of a run taken from a dead owner is a span marked in doubt."""
    app = make_app()

    @app.task(base=DurableTask, name="wire")
    def wire() -> None:
        with step("prepare"):
            pass
        with step("wire-money"):
            pass
        with step("notify"):
            pass

    task_id = _interrupted(app, wire, steps={"prepare": "completed"})
    assert wire.apply(task_id=task_id).successful()
    doubts = {_attrs(span)["duraflow.step_key"]: (_attrs(span)["duraflow.cached"],
                                                  _attrs(span)["duraflow.in_doubt"])
              for span in telemetry.spans("duraflow step")}
    assert doubts == {"prepare": (True, False), "wire-money": (False, True),
                      "notify": (False, False)}


def test_wait_and_signal_events(sqlite_app: Celery, telemetry: Telemetry) -> None:
    """A wait is an event of the attempt that suspends; a signal one of the span that sends it."""
    app = sqlite_app
    tracer = telemetry.tracer_provider.get_tracer("the-user")

    @app.task(base=DurableTask, name="approve")
    def approve() -> str:
        answer = wait_for_signal("approval")
        with step("apply") as s:
            s.result = f"approved by {answer['by']}"
        sleep("cool-down", 3600)
        return str(s.result)

    result = approve.apply()
    first = telemetry.span("duraflow attempt approve")
    assert _attrs(first)["duraflow.status"] == "waiting"
    assert _events(first, "duraflow.wait") == [{
        "duraflow.task_id": result.id, "duraflow.step_key": "approval",
        "duraflow.wait.kind": "signal", "duraflow.status": "waiting"}]
    telemetry.exporter.clear()

    with tracer.start_as_current_span("approval-form"):
        # The signal wakes the run; eager, it runs here, under the sender's span.
        assert send_signal(result.id, "approval", {"by": "ann"}, app=app)
    form = telemetry.span("approval-form")
    assert _events(form, "duraflow.signal") == [{
        "duraflow.task_id": result.id, "duraflow.signal.name": "approval",
        "duraflow.signal.stored": True}]
    second = telemetry.span("duraflow attempt approve")
    assert _parent(second) == form.context.span_id
    assert _attrs(second)["duraflow.status"] == "sleeping"
    assert _events(second, "duraflow.wait.ended") == [{
        "duraflow.task_id": result.id, "duraflow.step_key": "approval",
        "duraflow.wait.kind": "signal", "duraflow.wait.timed_out": False}]
    [nap] = _events(second, "duraflow.wait")
    assert nap["duraflow.wait.kind"] == "sleep" and nap["duraflow.status"] == "sleeping"
    wake_at = datetime.fromisoformat(nap["duraflow.wait.wake_at"])
    assert timedelta(minutes=59) < wake_at - datetime.now(UTC) <= timedelta(hours=1)
    assert telemetry.counts("duraflow.runs.finished", "duraflow.status") == {}


def test_compensation_events_and_run_status(sqlite_app: Celery, telemetry: Telemetry) -> None:
    """A run that fails for good has compensation events, an error span and a status count."""
    app = sqlite_app
    undone: list[str] = []

    def cancel_booking(booking: str) -> None:
        if not undone:
            undone.append("failed once")
            raise TimeoutError("airline slow")
        undone.append(booking)

    @app.task(base=DurableTask, name="trip-undo")
    def trip() -> None:
        with step("book", compensate=cancel_booking) as s:
            s.result = "PNR1"
        with step("charge"):
            raise ValueError("card declined")

    result = trip.apply()
    assert isinstance(result.result, ValueError)
    assert undone == ["failed once", "PNR1"]
    attempt = telemetry.span("duraflow attempt trip-undo")
    assert attempt.status.status_code == StatusCode.ERROR
    assert _attrs(attempt)["duraflow.status"] == "compensated"
    assert _attrs(attempt)["error.type"] == "ValueError"
    assert _events(attempt, "duraflow.compensation") == [
        {"duraflow.task_id": result.id, "duraflow.step_key": "book", "duraflow.attempt": 1,
         "duraflow.outcome": "failed", "error.type": "TimeoutError"},
        {"duraflow.task_id": result.id, "duraflow.step_key": "book", "duraflow.attempt": 2,
         "duraflow.outcome": "completed"}]
    assert _events(attempt, "duraflow.unwound") == [{
        "duraflow.task_id": result.id, "duraflow.reason": "failure",
        "duraflow.status": "compensated"}]
    assert telemetry.counts("duraflow.compensations", "duraflow.outcome") == {
        ("failed",): 1, ("completed",): 1}
    assert telemetry.counts("duraflow.runs.finished", "duraflow.task_name",
                            "duraflow.status") == {("trip-undo", "compensated"): 1}


def test_metrics_of_steps_and_runs(sqlite_app: Celery, telemetry: Telemetry) -> None:
    """Steps run and replayed, their durations (seconds) and runs by final status are counted."""
    app = sqlite_app

    @app.task(base=DurableTask, name="count")
    def count(fail: bool) -> int:
        total = 0
        for page in range(3):
            with step("page") as s:
                s.result = page
            total += s.result
        if fail:
            raise LookupError("no such account")
        return total

    assert count.apply(args=(False,)).get() == 3
    assert count.apply(args=(False,)).get() == 3
    assert isinstance(count.apply(args=(True,)).result, LookupError)
    assert telemetry.counts("duraflow.runs.finished", "duraflow.status") == {
        ("succeeded",): 2, ("failed",): 1}
    assert telemetry.counts("duraflow.steps.run", "duraflow.task_name", "duraflow.step_name",
                            "duraflow.outcome") == {("count", "page", "completed"): 9}
    [(attributes, histogram)] = telemetry.points("duraflow.step.duration")
    assert attributes == {"duraflow.task_name": "count", "duraflow.step_name": "page",
                          "duraflow.outcome": "completed"}
    assert histogram.count == 9
    assert 0 < histogram.sum < 5  # seconds
    assert histogram.explicit_bounds[0] == 0.005


def test_sweep_recovery_metric(sqlite_url: str, table_prefix: str,
                               telemetry: Telemetry) -> None:
    """A run the sweep sends again counts as a recovery, with the status it was found in."""
    app = app_factory(sqlite_url, table_prefix)(eager=False, task_default_queue=_queue())

    @app.task(base=DurableTask, name="lost")
    def lost() -> None:
        pass

    task_id = _interrupted(app, lost)
    tracer = telemetry.tracer_provider.get_tracer("the-user")
    with tracer.start_as_current_span("beat-sweep"):
        assert recover(app) == [task_id]
    assert telemetry.counts("duraflow.sweep.recoveries", "duraflow.task_name",
                            "duraflow.status") == {("lost", "running"): 1}
    assert _events(telemetry.span("beat-sweep"), "duraflow.recovered") == [{
        "duraflow.task_id": task_id, "duraflow.task_name": "lost", "duraflow.status": "running"}]


def test_store_outage_metric(table_prefix: str, telemetry: Telemetry) -> None:
    """A delivery that finds the store down (nothing listens at its port) counts an outage."""
    # Port 9 (discard) on this host: nothing listens, so every connection is refused.
    app = app_factory("postgresql+psycopg://postgres@127.0.0.1:9/test", table_prefix)(
        eager=False, task_default_queue=_queue())

    @app.task(base=DurableTask, name="outage")
    def outage() -> None:
        pass

    with run_worker(app):
        outage.delay()
        # Each delivery finds the store down and comes back later through the broker.
        deadline = datetime.now(UTC) + timedelta(seconds=20)
        while not telemetry.counts("duraflow.store.outages", "duraflow.giving_up"):
            assert datetime.now(UTC) < deadline, "no outage was counted"
            time.sleep(0.05)
    # (It may have come back and found the store down again before the worker stopped.)
    outages = telemetry.counts("duraflow.store.outages", "duraflow.task_name",
                               "duraflow.giving_up")
    assert list(outages) == [("outage", False)]
    assert outages[("outage", False)] >= 1
    # An eager call has no broker to come back through: it gives up at once.
    eager = app_factory("postgresql+psycopg://postgres@127.0.0.1:9/test", table_prefix)()

    @eager.task(base=DurableTask, name="outage")
    def eager_outage() -> None:
        pass

    assert isinstance(eager_outage.apply().result, StoreUnavailable)
    assert telemetry.counts("duraflow.store.outages", "duraflow.giving_up")[(True,)] == 1


def test_step_span_is_a_child_of_the_celery_task_span(sqlite_url: str, table_prefix: str,
                                                       telemetry: Telemetry) -> None:
    """In a real worker instrumented by Celery's instrumentation, the run's spans are under its."""
    app = app_factory(sqlite_url, table_prefix)(eager=False, task_default_queue=_queue())

    @app.task(base=DurableTask, name="traced")
    def traced() -> int:
        with step("only") as s:
            s.result = 1
        return int(s.result)

    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=telemetry.tracer_provider)
    try:
        with run_worker(app):
            result = traced.delay()
            assert result.get(timeout=30) == 1
            wait_for_status(app, result.id, "succeeded")
    finally:
        instrumentor.uninstrument()
    celery_span = telemetry.span("run/traced")
    attempt = telemetry.span("duraflow attempt traced")
    only = telemetry.span("duraflow step only")
    assert _parent(attempt) == celery_span.context.span_id
    assert _parent(only) == attempt.context.span_id
    assert only.context.trace_id == celery_span.context.trace_id
    assert _attrs(only)["duraflow.task_id"] == result.id


def _run_python(code: str, store: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(store)],
                          cwd=REPO_ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120, check=False)


_RUN_A_TASK = """
    import sys
    {block}
    from celery import Celery
    from celery_duraflow import DurableTask, step
    from celery_duraflow.signals import attempt_started, step_started

    app = Celery("plain", set_as_current=False)
    app.conf.update(task_always_eager=True, duraflow_database_url="sqlite:///" + sys.argv[1])

    @app.task(base=DurableTask, shared=False)
    def plain():
        return 1

    assert plain.apply().get() == 1
    print(sorted(name for name in sys.modules if name.split(".")[0] == "opentelemetry"))
    print(len(attempt_started.receivers), len(step_started.receivers))
"""

# A finder that answers for OpenTelemetry as if it were not installed.
_NOT_INSTALLED = """
    import importlib.abc
    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "opentelemetry":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, NotInstalled())
"""


def test_flow_control_metrics_count_waits_and_time_in_the_queue(
        sqlite_url: str, table_prefix: str, telemetry: Telemetry) -> None:
    """A run queued for a slot counts a wait; taking the slot records how long it waited."""
    app = app_factory(sqlite_url, table_prefix)(eager=False, task_default_queue=_queue())

    @app.task(base=DurableTask, name="limited", duraflow_limits=[Concurrency(1, key="k")])
    def limited(k: str) -> None:
        pass

    store = store_for(config_for_app(app))
    store.begin_attempt("holder", Delivery(task_name="limited", owner=ELSEWHERE))
    assert store.acquire_slot("holder", ELSEWHERE, scope="limited", key="a", limit=1,
                              grace=5.0, sweep_after=None).state == "granted"
    limited.apply(args=("a",), task_id="queued")  # no worker: apply runs it here
    run = store.get_run("queued")
    assert run is not None and run.status == "waiting" and run.wait_kind == "slot"
    assert telemetry.counts("duraflow.flow.waits", "duraflow.task_name", "duraflow.wait.kind",
                            "duraflow.limit.scope") == {("limited", "slot", "limited"): 1}
    # The holder ends: its slot goes to the queued run, whose next attempt takes it.
    store.finish_run("holder", ELSEWHERE, "succeeded")
    assert [r.task_id for r in store.release_slots("holder", ELSEWHERE, grace=5.0)] == ["queued"]
    time.sleep(0.05)
    limited.apply(args=("a",), task_id="queued", headers={"duraflow_recorded": True})
    finished = store.get_run("queued")
    assert finished is not None and finished.status == "succeeded"
    [(attributes, histogram)] = telemetry.points("duraflow.flow.slot_wait")
    assert attributes == {"duraflow.task_name": "limited", "duraflow.limit.scope": "limited"}
    assert histogram.count == 1 and histogram.sum >= 0.05


@pytest.mark.parametrize(("block", "env"), [
    pytest.param(_NOT_INSTALLED, {}, id="not-installed"),
    pytest.param("", {"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "redis, celery_duraflow"},
                 id="switched-off"),
    pytest.param("", {"OTEL_SDK_DISABLED": "true"}, id="sdk-disabled"),
])
def test_without_telemetry_nothing_of_opentelemetry_is_imported(
        block: str, env: dict[str, str], tmp_path: Path) -> None:
    """Without the extra, or switched off by OTEL_* variables, nothing of OpenTelemetry loads."""
    code = _RUN_A_TASK.replace("{block}", textwrap.indent(textwrap.dedent(block), "    ")
                               .strip())
    done = _run_python(code, tmp_path / "store.sqlite3", **env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "0 0"], done.stdout


def test_with_the_extra_telemetry_switches_itself_on(tmp_path: Path) -> None:
    """With the API installed and nothing configured, the receivers are connected on their own."""
    done = _run_python(_RUN_A_TASK.replace("{block}", ""), tmp_path / "store.sqlite3",
                       OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="",
                       OTEL_SDK_DISABLED="")
    assert done.returncode == 0, done.stderr
    modules, receivers = done.stdout.split("\n")[:2]
    assert "'opentelemetry.trace'" in modules
    assert receivers == "1 1"


def test_schedule_metrics(sqlite_url: str, table_prefix: str, telemetry: Telemetry,
                          clock: Clock) -> None:
    """A firing pass counts each fired slot by schedule and the slots it passed over by
    reason, and records an event per fired slot on the current span."""
    app = app_factory(sqlite_url, table_prefix)(eager=False, task_default_queue=_queue())

    @app.task(base=DurableTask, name="tick")
    def tick() -> None:
        pass

    start = clock.now
    add_schedule("hourly", "tick", every=3600, catchup="latest", app=app)
    clock.advance(hours=3, minutes=30)
    tracer = telemetry.tracer_provider.get_tracer("the-user")
    with tracer.start_as_current_span("beat-tick"):
        fired = fire_schedules(app).fired
    assert fired == [schedule_run_id("hourly", start + timedelta(hours=3))]
    assert telemetry.counts("duraflow.schedules.fired", "duraflow.schedule",
                            "duraflow.task_name") == {("hourly", "tick"): 1}
    assert telemetry.counts("duraflow.schedules.skipped", "duraflow.schedule",
                            "duraflow.reason") == {("hourly", "missed"): 2}
    assert _events(telemetry.span("beat-tick"), "duraflow.schedule.fired") == [{
        "duraflow.schedule": "hourly", "duraflow.task_id": fired[0],
        "duraflow.task_name": "tick",
        "duraflow.schedule.slot": (start + timedelta(hours=3)).isoformat()}]
