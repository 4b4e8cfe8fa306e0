"""OpenTelemetry spans and metrics of durable runs: the ``otel`` extra.

With ``opentelemetry-api`` installed this module is switched on by itself, when
the library is imported; ``OTEL_SDK_DISABLED=true``, or
``celery_duraflow`` in ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``, keeps it off.
It connects receivers to the library's signals (:mod:`celery_duraflow.signals`)
and turns them into

- a span per attempt (``duraflow attempt <task name>``), child of the current
  span: the Celery task span when ``opentelemetry-instrumentation-celery``
  instruments the worker;
- a span per step (``duraflow step <step name>``), child of the attempt's span
  (or of the step it is nested in), current while the body runs, so the spans
  the body makes (an HTTP call, a query) are its children; a step answered from
  the store gets a span too, with ``duraflow.cached`` true;
- events for waits, signals, compensations, sweep recoveries and store outages;
- the metrics ``duraflow.steps.run``, ``duraflow.steps.replayed``,
  ``duraflow.step.duration``, ``duraflow.runs.finished``,
  ``duraflow.compensations``, ``duraflow.sweep.recoveries`` and
  ``duraflow.store.outages``.

Only OpenTelemetry's API is used: the tracer and the meter come from the global
providers (or from those given to :func:`instrument`), which the application
configures with the SDK and its exporters. Without an SDK the API's providers
hand out non-recording spans and instruments that record nothing; the attempt
then makes no step spans at all.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import threading
import time
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any

from celery.exceptions import Ignore, Reject, Retry
from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import Counter, Histogram, MeterProvider
from opentelemetry.trace import Span, Status, StatusCode, Tracer, TracerProvider
from opentelemetry.util.types import AttributeValue

from ..signals import (
    attempt_finished,
    attempt_started,
    compensation_ran,
    limit_waited,
    run_finished,
    run_recovered,
    run_unwound,
    schedule_fired,
    schedule_skipped,
    signal_delivered,
    slot_taken,
    step_failed,
    step_replayed,
    step_started,
    step_succeeded,
    store_unavailable,
    wait_ended,
    wait_reached,
)

__all__ = ["instrument", "is_instrumented", "uninstrument"]

#: The instrumentation scope of the tracer and the meter.
SCOPE = "celery_duraflow"

# Attribute names: duraflow.* for what is the library's own; OpenTelemetry's semantic
# conventions where one exists (error.type; exception.* come with record_exception).
TASK_ID = "duraflow.task_id"
TASK_NAME = "duraflow.task_name"
STEP_KEY = "duraflow.step_key"
STEP_NAME = "duraflow.step_name"
CACHED = "duraflow.cached"
IN_DOUBT = "duraflow.in_doubt"
ATTEMPT = "duraflow.attempt"
STATUS = "duraflow.status"
OUTCOME = "duraflow.outcome"
WAIT_KIND = "duraflow.wait.kind"
WAKE_AT = "duraflow.wait.wake_at"
TIMED_OUT = "duraflow.wait.timed_out"
SIGNAL_NAME = "duraflow.signal.name"
SIGNAL_STORED = "duraflow.signal.stored"
REASON = "duraflow.reason"
GIVING_UP = "duraflow.giving_up"
LIMIT_SCOPE = "duraflow.limit.scope"
LIMIT_KEY = "duraflow.limit.key"
SCHEDULE = "duraflow.schedule"
SLOT = "duraflow.schedule.slot"
ERROR_TYPE = "error.type"

# Histogram buckets for step durations, in seconds (OpenTelemetry's advice for durations).
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 30.0, 60.0, 300.0)
# Celery's control-flow exceptions: how an attempt hands the run back to Celery, not errors.
_CONTROL_FLOW = (Ignore, Reject, Retry)
_OCCURRENCE = re.compile(r"#\d+")


def _version() -> str:
    # Not celery_duraflow.__version__: this module is loaded while the package imports.
    try:
        return importlib.metadata.version("celery-duraflow")
    except importlib.metadata.PackageNotFoundError:
        return ""


@functools.lru_cache(maxsize=4096)
def step_name(step_key: str) -> str:
    """A step key without its occurrence numbers (``fetch#3/parse`` -> ``fetch/parse``): a
    name of few values, fit for span names and metric attributes."""
    return _OCCURRENCE.sub("", step_key)


class _Instruments:
    """The tracer and the metric instruments receivers record with."""

    def __init__(self, tracer_provider: TracerProvider | None,
                 meter_provider: MeterProvider | None) -> None:
        version = _version()
        self.tracer: Tracer = trace.get_tracer(SCOPE, version, tracer_provider=tracer_provider)
        meter = metrics.get_meter(SCOPE, version, meter_provider=meter_provider)
        self.steps_run: Counter = meter.create_counter(
            "duraflow.steps.run", unit="{step}",
            description="Step bodies run, by task, step name and outcome (completed, failed)")
        self.steps_replayed: Counter = meter.create_counter(
            "duraflow.steps.replayed", unit="{step}",
            description="Completed steps answered from the store, their bodies skipped")
        try:
            self.step_duration: Histogram = meter.create_histogram(
                "duraflow.step.duration", unit="s",
                description="How long step bodies ran, in seconds",
                explicit_bucket_boundaries_advisory=list(_DURATION_BUCKETS))
        except TypeError:  # an API older than 1.23 takes no bucket advice
            self.step_duration = meter.create_histogram(
                "duraflow.step.duration", unit="s",
                description="How long step bodies ran, in seconds")
        self.runs_finished: Counter = meter.create_counter(
            "duraflow.runs.finished", unit="{run}",
            description="Runs that ended for good, by task and final status")
        self.compensations: Counter = meter.create_counter(
            "duraflow.compensations", unit="{compensation}",
            description="Compensations run, by task, step name and outcome")
        self.sweep_recoveries: Counter = meter.create_counter(
            "duraflow.sweep.recoveries", unit="{run}",
            description="Runs the recovery sweep sent again, by task and the run's status "
                        "(running: a lost attempt; sleeping, waiting: a wait woken)")
        self.limit_waits: Counter = meter.create_counter(
            "duraflow.flow.waits", unit="{wait}",
            description="Runs that waited, holding no worker, because they were over a "
                        "limit: by task, kind (slot: a Concurrency limit; rate: a "
                        "RateLimit) and the limit's scope")
        self.slot_wait: Histogram = meter.create_histogram(
            "duraflow.flow.slot_wait", unit="s",
            description="How long runs were queued for the concurrency slot they took, in "
                        "seconds (0 for a slot taken at once), by task and scope")
        self.schedule_fired: Counter = meter.create_counter(
            "duraflow.schedules.fired", unit="{run}",
            description="Slots of durable schedules fired as runs, by schedule and task")
        self.schedule_skipped: Counter = meter.create_counter(
            "duraflow.schedules.skipped", unit="{slot}",
            description="Slots of durable schedules not fired, by schedule and reason "
                        "(missed: dropped by the catch-up policy; overlap: by the overlap "
                        "policy)")
        self.store_outages: Counter = meter.create_counter(
            "duraflow.store.outages", unit="{delivery}",
            description="Deliveries that found the store unavailable and came back later "
                        "(or gave up)")


@dataclass(eq=False)
class _Step:
    key: str
    started: float
    span: Span | None = None
    token: Token[otel_context.Context] | None = None


@dataclass(eq=False)
class _Attempt:
    task_id: str
    task_name: str
    span: Span
    recording: bool
    token: Token[otel_context.Context] | None = None
    previous: Token[_Attempt | None] | None = None
    status: str | None = None
    steps: list[_Step] = field(default_factory=list)


_instruments: _Instruments | None = None
# Set by uninstrument(): the automatic switch-on leaves it off then.
_refused = False
_lock = threading.Lock()
# The attempt running in this context, as this module tracks it.
_current: ContextVar[_Attempt | None] = ContextVar("duraflow_otel_attempt", default=None)


def _task_name(sender: Any) -> str:
    name = getattr(sender, "name", None)
    return name if isinstance(name, str) else ""


def _event(name: str, attributes: dict[str, AttributeValue]) -> None:
    """Add an event to the current span, when it records."""
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(name, attributes)


def _detach(token: Token[otel_context.Context] | None) -> None:
    if token is not None:
        otel_context.detach(token)


def _close_steps(state: _Attempt, down_to: int, outcome: str) -> None:
    """End the spans of the steps above ``down_to`` on the stack (a wait suspended the run
    inside them, or a store outage kept their end from being recorded)."""
    while len(state.steps) > down_to:
        left = state.steps.pop()
        if left.span is not None:
            left.span.set_attribute(OUTCOME, outcome)
        _detach(left.token)
        if left.span is not None:
            left.span.end()


# -- receivers ------------------------------------------------------------------------------


def _on_attempt_started(sender: Any = None, task_id: str = "", attempt: int = 0,
                        **_: Any) -> None:
    instruments = _instruments
    if instruments is None:
        return
    name = _task_name(sender)
    span = instruments.tracer.start_span(
        f"duraflow attempt {name}",
        attributes={TASK_ID: task_id, TASK_NAME: name, ATTEMPT: attempt})
    state = _Attempt(task_id=task_id, task_name=name, span=span,
                     recording=span.is_recording())
    if state.recording:
        state.token = otel_context.attach(trace.set_span_in_context(span))
    state.previous = _current.set(state)


def _on_attempt_finished(sender: Any = None, task_id: str = "",
                         exception: BaseException | None = None, **_: Any) -> None:
    state = _current.get()
    if state is None or state.task_id != task_id:
        return
    _close_steps(state, 0, "unfinished")
    span = state.span
    if state.recording:
        status = state.status or ("retrying" if isinstance(exception, Retry) else "running")
        span.set_attribute(STATUS, status)
        if exception is not None and not isinstance(exception, _CONTROL_FLOW):
            span.record_exception(exception)
            span.set_attribute(ERROR_TYPE, type(exception).__qualname__)
            span.set_status(Status(StatusCode.ERROR, f"{type(exception).__qualname__}: "
                                                     f"{exception}"[:1000]))
        elif isinstance(exception, Retry) and isinstance(exception.exc, BaseException):
            span.record_exception(exception.exc)
    _detach(state.token)
    span.end()
    if state.previous is not None:
        _current.reset(state.previous)


def _on_step_started(sender: Any = None, task_id: str = "", step_key: str = "",
                     attempt: int = 0, in_doubt: bool = False, **_: Any) -> None:
    instruments, state = _instruments, _current.get()
    if instruments is None or state is None or state.task_id != task_id:
        return
    entry = _Step(step_key, time.perf_counter())
    if state.recording:
        name = step_name(step_key)
        entry.span = instruments.tracer.start_span(
            f"duraflow step {name}",
            attributes={TASK_ID: task_id, TASK_NAME: state.task_name, STEP_KEY: step_key,
                        STEP_NAME: name, ATTEMPT: attempt, CACHED: False,
                        IN_DOUBT: bool(in_doubt)})
        entry.token = otel_context.attach(trace.set_span_in_context(entry.span))
    state.steps.append(entry)


def _step_ended(task_id: str, step_key: str, exception: BaseException | None) -> None:
    instruments, state = _instruments, _current.get()
    if instruments is None or state is None or state.task_id != task_id:
        return
    at = next((i for i in range(len(state.steps) - 1, -1, -1)
               if state.steps[i].key == step_key), None)
    if at is None:
        return
    _close_steps(state, at + 1, "unfinished")
    entry = state.steps.pop()
    duration = time.perf_counter() - entry.started
    outcome = "completed" if exception is None else "failed"
    attributes: dict[str, AttributeValue] = {TASK_NAME: state.task_name,
                                             STEP_NAME: step_name(step_key), OUTCOME: outcome}
    if exception is not None:
        attributes[ERROR_TYPE] = type(exception).__qualname__
    instruments.steps_run.add(1, attributes)
    instruments.step_duration.record(duration, attributes)
    span = entry.span
    if span is not None:
        span.set_attribute(OUTCOME, outcome)
        if exception is not None:
            span.record_exception(exception)
            span.set_attribute(ERROR_TYPE, type(exception).__qualname__)
            span.set_status(Status(StatusCode.ERROR, f"{type(exception).__qualname__}: "
                                                     f"{exception}"[:1000]))
    _detach(entry.token)
    if span is not None:
        span.end()


def _on_step_succeeded(sender: Any = None, task_id: str = "", step_key: str = "",
                       **_: Any) -> None:
    _step_ended(task_id, step_key, None)


def _on_step_failed(sender: Any = None, task_id: str = "", step_key: str = "",
                    exception: BaseException | None = None, **_: Any) -> None:
    _step_ended(task_id, step_key, exception if exception is not None else Exception())


def _on_step_replayed(sender: Any = None, task_id: str = "", step_key: str = "",
                      attempt: int = 0, **_: Any) -> None:
    instruments, state = _instruments, _current.get()
    if instruments is None or state is None or state.task_id != task_id:
        return  # a replay check (celery duraflow replay) is no attempt
    name = step_name(step_key)
    instruments.steps_replayed.add(1, {TASK_NAME: state.task_name, STEP_NAME: name})
    if state.recording:
        instruments.tracer.start_span(
            f"duraflow step {name}",
            attributes={TASK_ID: task_id, TASK_NAME: state.task_name, STEP_KEY: step_key,
                        STEP_NAME: name, ATTEMPT: attempt, CACHED: True,
                        IN_DOUBT: False}).end()


def _on_run_finished(sender: Any = None, task_id: str = "", status: str = "",
                     **_: Any) -> None:
    instruments = _instruments
    if instruments is None:
        return
    instruments.runs_finished.add(1, {TASK_NAME: _task_name(sender), STATUS: status})
    state = _current.get()
    if state is not None and state.task_id == task_id:
        state.status = status


def _on_run_unwound(sender: Any = None, task_id: str = "", reason: str = "",
                    status: str = "", **_: Any) -> None:
    _event("duraflow.unwound", {TASK_ID: task_id, REASON: reason, STATUS: status})


def _on_wait_reached(sender: Any = None, task_id: str = "", step_key: str = "",
                     kind: str = "", status: str = "", wake_at: Any = None,
                     **_: Any) -> None:
    state = _current.get()
    if state is not None and state.task_id == task_id:
        state.status = status
    attributes: dict[str, AttributeValue] = {TASK_ID: task_id, STEP_KEY: step_key,
                                             WAIT_KIND: kind, STATUS: status}
    if wake_at is not None:
        attributes[WAKE_AT] = wake_at.isoformat()
    _event("duraflow.wait", attributes)


def _on_wait_ended(sender: Any = None, task_id: str = "", step_key: str = "",
                   kind: str = "", timed_out: bool = False, **_: Any) -> None:
    _event("duraflow.wait.ended", {TASK_ID: task_id, STEP_KEY: step_key, WAIT_KIND: kind,
                                   TIMED_OUT: bool(timed_out)})


def _on_signal_delivered(sender: Any = None, task_id: str = "", name: str = "",
                         stored: bool = False, **_: Any) -> None:
    _event("duraflow.signal", {TASK_ID: task_id, SIGNAL_NAME: name,
                               SIGNAL_STORED: bool(stored)})


def _on_compensation_ran(sender: Any = None, task_id: str = "", step_key: str = "",
                         attempt: int = 0, exception: BaseException | None = None,
                         **_: Any) -> None:
    instruments = _instruments
    if instruments is None:
        return
    outcome = "completed" if exception is None else "failed"
    metric: dict[str, AttributeValue] = {TASK_NAME: _task_name(sender),
                                         STEP_NAME: step_name(step_key), OUTCOME: outcome}
    event: dict[str, AttributeValue] = {TASK_ID: task_id, STEP_KEY: step_key,
                                        ATTEMPT: attempt, OUTCOME: outcome}
    if exception is not None:
        metric[ERROR_TYPE] = event[ERROR_TYPE] = type(exception).__qualname__
    instruments.compensations.add(1, metric)
    _event("duraflow.compensation", event)


def _on_run_recovered(sender: Any = None, task_id: str = "", task_name: str = "",
                      status: str = "", **_: Any) -> None:
    instruments = _instruments
    if instruments is None:
        return
    instruments.sweep_recoveries.add(1, {TASK_NAME: task_name, STATUS: status})
    _event("duraflow.recovered", {TASK_ID: task_id, TASK_NAME: task_name, STATUS: status})


def _on_store_unavailable(sender: Any = None, task_id: str = "",
                          exception: BaseException | None = None, giving_up: bool = False,
                          **_: Any) -> None:
    instruments = _instruments
    if instruments is None:
        return
    instruments.store_outages.add(1, {TASK_NAME: _task_name(sender),
                                      GIVING_UP: bool(giving_up)})
    _event("duraflow.store_unavailable", {
        TASK_ID: task_id or "", GIVING_UP: bool(giving_up),
        ERROR_TYPE: type(exception).__qualname__ if exception is not None else ""})


def _on_limit_waited(sender: Any = None, task_id: str = "", kind: str = "", scope: str = "",
                     key: str = "", position: int = 0, limit: int = 0, wake_at: Any = None,
                     **_: Any) -> None:
    instruments = _instruments
    if instruments is None:
        return
    instruments.limit_waits.add(1, {TASK_NAME: _task_name(sender), WAIT_KIND: kind,
                                    LIMIT_SCOPE: scope})
    attributes: dict[str, AttributeValue] = {TASK_ID: task_id, WAIT_KIND: kind,
                                             LIMIT_SCOPE: scope, LIMIT_KEY: key,
                                             "duraflow.limit": limit}
    if kind == "slot":
        attributes["duraflow.limit.position"] = position
    if wake_at is not None:
        attributes[WAKE_AT] = wake_at.isoformat()
    _event("duraflow.limit.wait", attributes)


def _on_slot_taken(sender: Any = None, task_id: str = "", scope: str = "", key: str = "",
                   waited: float = 0.0, **_: Any) -> None:
    instruments = _instruments
    if instruments is None:
        return
    instruments.slot_wait.record(float(waited), {TASK_NAME: _task_name(sender),
                                                 LIMIT_SCOPE: scope})


def _on_schedule_fired(sender: Any = None, schedule: str = "", slot: Any = None,
                       task_id: str = "", task_name: str = "", **_: Any) -> None:
    instruments = _instruments
    if instruments is None:
        return
    instruments.schedule_fired.add(1, {SCHEDULE: schedule, TASK_NAME: task_name})
    _event("duraflow.schedule.fired", {
        SCHEDULE: schedule, TASK_ID: task_id, TASK_NAME: task_name,
        SLOT: slot.isoformat() if slot is not None else ""})


def _on_schedule_skipped(sender: Any = None, schedule: str = "", count: int = 0,
                         reason: str = "", **_: Any) -> None:
    instruments = _instruments
    if instruments is None:
        return
    instruments.schedule_skipped.add(int(count), {SCHEDULE: schedule, REASON: reason})


_RECEIVERS = (
    (attempt_started, _on_attempt_started),
    (attempt_finished, _on_attempt_finished),
    (step_started, _on_step_started),
    (step_succeeded, _on_step_succeeded),
    (step_failed, _on_step_failed),
    (step_replayed, _on_step_replayed),
    (run_finished, _on_run_finished),
    (run_unwound, _on_run_unwound),
    (wait_reached, _on_wait_reached),
    (wait_ended, _on_wait_ended),
    (signal_delivered, _on_signal_delivered),
    (compensation_ran, _on_compensation_ran),
    (run_recovered, _on_run_recovered),
    (store_unavailable, _on_store_unavailable),
    (limit_waited, _on_limit_waited),
    (slot_taken, _on_slot_taken),
    (schedule_fired, _on_schedule_fired),
    (schedule_skipped, _on_schedule_skipped),
)


# -- switching it on and off ----------------------------------------------------------------


def instrument(*, tracer_provider: TracerProvider | None = None,
               meter_provider: MeterProvider | None = None) -> None:
    """Make spans and metrics of every durable run in this process.

    Done automatically when ``opentelemetry-api`` is installed; call it to use
    providers of your own instead of the global ones (``trace.set_tracer_provider``,
    ``metrics.set_meter_provider``), or to switch it back on after
    :func:`uninstrument`. Calling it again replaces the providers.
    """
    global _instruments, _refused
    with _lock:
        _refused = False
        _instruments = _Instruments(tracer_provider, meter_provider)
        for signal, receiver in _RECEIVERS:
            signal.connect(receiver, weak=False, dispatch_uid=f"duraflow-otel-{signal.name}")


def uninstrument() -> None:
    """Disconnect from the library's signals: no span, no metric, no cost left."""
    global _instruments, _refused
    with _lock:
        _refused = True
        _instruments = None
        for signal, receiver in _RECEIVERS:
            signal.disconnect(receiver, dispatch_uid=f"duraflow-otel-{signal.name}")


def is_instrumented() -> bool:
    """Whether runs in this process make spans and metrics."""
    return _instruments is not None


def auto_instrument() -> None:
    """The automatic switch-on (when the library is imported); leaves it off after
    :func:`uninstrument`, and does nothing when already on."""
    if _instruments is None and not _refused:
        instrument()
