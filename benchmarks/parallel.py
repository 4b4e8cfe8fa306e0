"""Concurrent steps inside one run: ten 50 ms I/O steps against one.

A DurableTask applied in this process runs, taking turns over the rounds:

* ``one``: a single step whose body sleeps 50 ms (``asyncio.sleep``);
* ``aparallel``: ``aparallel()`` of ten such steps;
* ``gather``: ``asyncio.gather`` of ten such steps, each created before any runs;
* ``parallel``: ``parallel()`` of ten branches that each sleep 50 ms (``time.sleep``) in
  a thread of their own.

Each run is a fresh run (every step body runs and every record is written). The
figure is the median time of a run over the median time of ``one``: ten steps that
overlap should take little more than one, and the target is under 2x.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from functools import partial
from typing import Any

from celery_duraflow import DurableTask, aparallel, parallel, step

from .common import DuraflowBench, ms, ratio, table

#: The body of each step: an I/O wait of this long.
IO_SECONDS = 0.05
BRANCHES = 10
TARGET = 2.0


async def _io(n: int) -> int:
    await asyncio.sleep(IO_SECONDS)
    return n


def _io_blocking(n: int) -> int:
    time.sleep(IO_SECONDS)
    return n


def _register(df: DuraflowBench) -> dict[str, Any]:
    app = df.app

    async def one() -> list[int]:
        return [await step("io").arun(_io, 0)]

    async def gathered() -> list[int]:
        return list(await asyncio.gather(*(step("io").arun(_io, n) for n in range(BRANCHES))))

    async def branches() -> list[int]:
        return await aparallel("io", [partial(_io, n) for n in range(BRANCHES)])

    def threads() -> list[int]:
        return parallel("io", [partial(_io_blocking, n) for n in range(BRANCHES)])

    tasks: dict[str, Any] = {}
    for name, body in (("one", one), ("aparallel", branches), ("gather", gathered)):
        def run(body: Any = body) -> list[int]:
            return list(asyncio.run(body()))

        tasks[name] = app.task(base=DurableTask, name=f"bench.parallel.{name}",
                               shared=False)(run)
    tasks["parallel"] = app.task(base=DurableTask, name="bench.parallel.threads",
                                 shared=False)(threads)
    return tasks


def concurrent_steps(df: DuraflowBench, rounds: int) -> tuple[list[str], dict[str, Any]]:
    """Lines for the report, and the data: seconds per run of each kind, and the ratios."""
    tasks = _register(df)
    samples: dict[str, list[float]] = {name: [] for name in tasks}
    for round_ in range(rounds + 1):
        names = list(tasks)
        names = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in names:
            started = time.perf_counter()
            result = tasks[name].apply(task_id=f"bench-par-{uuid.uuid4()}")
            took = time.perf_counter() - started
            if not result.successful():
                raise RuntimeError(f"{name}: {result.result!r}")
            if round_:  # the first round warms up
                samples[name].append(took)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    base = medians["one"]
    ratios = {name: medians[name] / base for name in medians}
    rows = [[name, ms(medians[name]), ratio(ratios[name])] for name in medians]
    lines = [table(["run", "median ms", "x one step"], rows)]
    return lines, {"seconds": medians, "ratios": ratios, "rounds": rounds,
                   "worst": max(ratios[name] for name in ("aparallel", "gather", "parallel"))}
