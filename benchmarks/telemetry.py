"""What OpenTelemetry costs a run: the same N-step task with telemetry off and on.

Three modes of :mod:`celery_duraflow.contrib.opentelemetry`, switched between the
batches of runs (outside the timings):

* off: ``uninstrument()``, no receiver connected: the library's signals are not sent;
* API only: instrumented, the providers those of the API without an SDK (what an
  application that installed the ``otel`` extra but configured nothing gets):
  non-recording spans, instruments that record nothing;
* SDK: instrumented with the SDK's providers: every span ends in a
  ``SimpleSpanProcessor`` to an ``InMemorySpanExporter`` (emptied between runs,
  outside the timings), the metrics aggregated by a ``MeterProvider`` whose
  ``InMemoryMetricReader`` is read once at the end.

Each mode runs the durable task of N trivial steps on PostgreSQL, fresh (a new
task id: every step is written) and replayed (the run set back to ``running`` with
its steps completed: every step is answered from the store, the cheapest path a
step has), the modes taking turns in the same rounds. Reported as medians per run,
the cost per step against ``off``, and the ratio to ``off``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_duraflow.contrib import opentelemetry as otel

from .common import DuraflowBench, Samples, log, ms, ratio, table

MODES = ("off", "API only", "SDK")


class TelemetryModes:
    """Switches the instrumentation between the three modes, and puts it back after."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.was_on = otel.is_instrumented()
        self.spans = 0

    def switch(self, mode: str) -> None:
        if mode == "off":
            otel.uninstrument()
        elif mode == "API only":
            otel.instrument(tracer_provider=trace.NoOpTracerProvider(),
                            meter_provider=metrics.NoOpMeterProvider())
        else:
            otel.instrument(tracer_provider=self.tracer_provider,
                            meter_provider=self.meter_provider)

    def drain(self) -> None:
        """Drop the finished spans (outside the timings), counting them."""
        self.spans += len(self.exporter.get_finished_spans())
        self.exporter.clear()

    def close(self) -> None:
        if self.was_on:
            otel.instrument()
        else:
            otel.uninstrument()
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def _steps_run(reader: InMemoryMetricReader) -> int:
    """The duraflow.steps.run counter's total, as the SDK aggregated it."""
    data = reader.get_metrics_data()
    total = 0
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == "duraflow.steps.run":
                    total += sum(int(point.value) for point in metric.data.data_points
                                 if isinstance(point, NumberDataPoint))
    return total


def bench_telemetry(database_url: str, prefix: str, *, steps: int, rounds: int, runs: int,
                    warmup: int) -> tuple[list[str], dict[str, Any]]:
    """The three modes, fresh and replayed, on PostgreSQL (``database_url``)."""
    df = DuraflowBench.create(database_url, f"{prefix}o_")
    modes = TelemetryModes()
    fresh = {mode: Samples() for mode in MODES}
    replay = {mode: Samples() for mode in MODES}
    done: list[str] = []

    def fresh_run() -> float:
        start = time.perf_counter()
        done.append(df.run(steps))
        return time.perf_counter() - start

    def replayed_run() -> float:
        task_id = done[len(replay["off"]) % len(done)]
        df.reset_to_running(task_id)
        start = time.perf_counter()
        df.run(steps, task_id)
        return time.perf_counter() - start

    kinds: list[tuple[dict[str, Samples], Callable[[], float]]] = [(fresh, fresh_run),
                                                                   (replay, replayed_run)]
    try:
        for mode in MODES:  # warm up every path
            modes.switch(mode)
            for _ in range(warmup):
                fresh_run()
                replayed_run()
                modes.drain()
        for number in range(rounds):
            log(f"telemetry: round {number + 1} of {rounds}")
            order = MODES[number % len(MODES):] + MODES[:number % len(MODES)]
            for samples, fn in kinds:
                for mode in order:
                    modes.switch(mode)
                    for _ in range(runs):
                        samples[mode].add(fn())
                        modes.drain()
        recorded = _steps_run(modes.reader)
    finally:
        modes.close()
        df.close()

    def row(kind: str, samples: dict[str, Samples]) -> list[list[str]]:
        off = samples["off"].median
        rows = []
        for mode in MODES:
            median = samples[mode].median
            per_step = (median - off) / steps
            rows.append([kind, mode, ms(median), f"{per_step * 1e6:+.1f}",
                         ratio(median / off if off > 0 else None, 3)])
        return rows

    lines = [
        f"The durable task of {steps} trivial steps on PostgreSQL, applied in this process: "
        "`off` (not instrumented: no receiver, no signal sent), `API only` (instrumented, "
        "OpenTelemetry's API without an SDK: what installing the extra and configuring "
        "nothing costs) and `SDK` (the SDK's providers, spans to an in-memory exporter "
        "through SimpleSpanProcessor, metrics aggregated). Fresh runs write every step; "
        "replayed runs answer every step from the store. "
        f"{rounds} rounds of {runs} runs of each mode and kind, the modes taking turns; "
        "medians.", "",
        table(["run", "telemetry", "ms per run", "us per step vs off", "run / off"],
              [*row("fresh", fresh), *row("replayed", replay)]), "",
        f"The SDK received {modes.spans} spans (an attempt and {steps} steps per run) and "
        f"counted {recorded} step bodies run.",
    ]

    def summary(samples: dict[str, Samples]) -> dict[str, Any]:
        off = samples["off"].median
        return {mode: {"median_s": samples[mode].median,
                       "per_step_over_off_s": (samples[mode].median - off) / steps,
                       "ratio_to_off": samples[mode].median / off if off > 0 else None,
                       "runs": len(samples[mode])} for mode in MODES}

    data = {"steps": steps, "fresh": summary(fresh), "replayed": summary(replay),
            "spans": modes.spans, "steps_counted": recorded}
    return lines, data
