"""What a Concurrency limit costs a durable task: throughput through a real worker, and
the statements it adds to an attempt.

Through a broker (Redis, then RabbitMQ; Redis is the result backend of both), one
``celery worker --pool prefork --concurrency 4`` (:data:`PROCESSES`) runs tasks of the
same work, :func:`flow_work` (a few trivial steps, or the same steps with one of them
sleeping 10 ms), declared four ways (:data:`VARIANTS`), taking turns in every round (the
order rotates each round):

* ``none``: a DurableTask with no limit, sent with the same arguments as ``keyed``;
* ``keyed``: ``Concurrency(2, key="tenant")``, the runs spread round robin over 64
  tenants: 4 processes can never fill a key's 2 slots, so the limit does not bind, and
  the attempts take 64 different advisory locks;
* ``one key``: ``Concurrency(8)`` with no key: one key for every run, a limit above the
  4 processes (does not bind either), every attempt behind the same advisory lock;
* ``binding``: ``Concurrency(2, key="tenant")`` with every run on the same tenant: at
  most 2 of the 4 processes run one at a time, the others' runs queue (suspended, woken
  and sent again when a slot frees); no target, it shows what queueing costs.

Throughput is tasks / wall time from the first send to the last result. Every result is
checked, every run's row must have succeeded, no slot row or queue entry may be left,
and the runs that queued (more than one attempt) are counted: none may queue where the
limit does not bind.

In this process (no broker): the durable task with no limit and with
``Concurrency(2, key="tenant")`` (a new key of 64 each time), applied in turn, give the
attempt's wall and CPU cost of the limit, the statements (as psycopg's ``Cursor.execute``
receives them, and SQLAlchemy's events) and round trips (libpq's trace) it adds, and,
from traced attempts, the server wait and client time of each Store call.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from celery import Celery

from celery_duraflow import Concurrency, DurableTask, step

from . import workload
from .common import (
    RoundTrips,
    Samples,
    interleaved,
    log,
    ms,
    psycopg_statements,
    ratio,
    table,
    trace_intervals,
    trace_statements,
)

#: Pool processes of the worker.
PROCESSES = 4
#: The limit per key of ``keyed`` and ``binding``, and how many keys ``keyed`` spreads over.
LIMIT = 2
KEYS = 64
#: The limit of ``one key``: above the worker's processes, so it never binds.
WIDE_LIMIT = 8

FREE_TASK_NAME = "bench.flow_free"
KEYED_TASK_NAME = "bench.flow_keyed"
WIDE_TASK_NAME = "bench.flow_wide"

#: The flow-control declaration of each task (:mod:`benchmarks.celery_app` registers them).
TASK_LIMITS: dict[str, list[Concurrency]] = {
    FREE_TASK_NAME: [],
    KEYED_TASK_NAME: [Concurrency(LIMIT, key="tenant")],
    WIDE_TASK_NAME: [Concurrency(WIDE_LIMIT)],
}

TENANTS = tuple(f"tenant-{i:02d}" for i in range(KEYS))
HOT_TENANT = ("tenant-hot",)


def flow_work(tenant: str, steps: int, sleep_ms: float) -> int:
    """``steps`` trivial steps, the first sleeping ``sleep_ms`` (``tenant`` is the key)."""
    total = 0
    for i in range(steps):
        with step("step") as s:
            if i == 0 and sleep_ms > 0:
                time.sleep(sleep_ms / 1000)
            s.result = workload.trivial(i)
        total += s.result
    return total


@dataclass(frozen=True)
class Variant:
    name: str
    title: str
    task: str
    tenants: tuple[str, ...]
    binds: bool


VARIANTS = (
    Variant("none", "DurableTask, no limit", FREE_TASK_NAME, TENANTS, False),
    Variant("keyed", f"Concurrency({LIMIT}, key='tenant'), {KEYS} keys round robin",
            KEYED_TASK_NAME, TENANTS, False),
    Variant("one key", f"Concurrency({WIDE_LIMIT}), no key: one key for every run",
            WIDE_TASK_NAME, TENANTS, False),
    Variant("binding", f"Concurrency({LIMIT}, key='tenant'), every run the same key",
            KEYED_TASK_NAME, HOT_TENANT, True),
)


@dataclass(frozen=True)
class Work:
    name: str
    title: str
    steps: int
    sleep_ms: float


WORKS = (
    Work("trivial", "3 trivial steps", 3, 0.0),
    Work("sleep", "3 steps, the first sleeping 10 ms", 3, 10.0),
)
#: The work the target is read on: the smallest, where the limit's cost shows the most.
TARGET_WORK = "trivial"
TARGET = 0.8


# -- through a worker -------------------------------------------------------------------------


def through_worker(label: str, broker_url: str, *, backend_url: str, database_url: str,
                   prefix: str, admin: psycopg.Connection[Any], tasks: int, rounds: int,
                   warmup: int) -> tuple[list[str], dict[str, Any]]:
    """Every work and variant through one worker on ``broker_url``; lines and data."""
    from .workers import celery_worker

    walls = {(w.name, v.name): Samples() for w in WORKS for v in VARIANTS}
    ids: dict[str, list[str]] = {v.name: [] for v in VARIANTS}
    log(f"flow: starting celery worker on {label} (prefork, concurrency {PROCESSES})")
    with celery_worker(broker_url=broker_url, backend_url=backend_url,
                       database_url=database_url, prefix=prefix, concurrency=PROCESSES,
                       label=f"flow-{label.lower()}") as worker:

        def batch(work: Work, variant: Variant, count: int) -> float:
            start = time.perf_counter()
            results = [worker.send(variant.task, variant.tenants[i % len(variant.tenants)],
                                   work.steps, work.sleep_ms) for i in range(count)]
            values = worker.wait_all(results, timeout=900)
            wall = time.perf_counter() - start
            expected = workload.expected_result(work.steps)
            wrong = [v for v in values if v != expected]
            if wrong:
                raise RuntimeError(f"{len(wrong)} {variant.name} tasks returned {wrong[:3]}")
            ids[variant.name].extend(r.id for r in results)
            for result in results:
                result.forget()
            return wall

        for work in WORKS:
            for variant in VARIANTS:
                batch(work, variant, warmup)
        for work in WORKS:
            for r in range(rounds):
                turn = r % len(VARIANTS)
                for variant in VARIANTS[turn:] + VARIANTS[:turn]:
                    log(f"flow {label}: {work.name}, round {r + 1}/{rounds}, {tasks} "
                        f"{variant.name} tasks")
                    walls[(work.name, variant.name)].add(batch(work, variant, tasks))
    checked = _check_rows(admin, prefix, ids)

    data: dict[str, Any] = {"tasks": tasks, "rounds": rounds, "processes": PROCESSES,
                            "checked": checked, "works": {}}
    lines = [f"### {label} ({_redact(broker_url)})", ""]
    for work in WORKS:
        base = tasks / walls[(work.name, "none")].median
        rows = []
        figures: dict[str, Any] = {}
        for variant in VARIANTS:
            wall = walls[(work.name, variant.name)]
            tput = tasks / wall.median
            best = tasks / wall.minimum
            rows.append([variant.title, len(wall), f"{wall.median:.2f}", f"{tput:.0f}",
                         f"{best:.0f}", ratio(tput / base)])
            figures[variant.name] = {"wall_s": wall.values, "tasks_per_s": tput,
                                     "best_tasks_per_s": best, "over_none": tput / base}
        data["works"][work.name] = figures
        lines += [f"{work.title}:", "",
                  table(["task", "rounds", "median wall s", "tasks/s (median)",
                         "tasks/s (best)", "throughput / no limit"], rows), ""]
    queued = ", ".join(f"{v.name} {checked['queued'][v.name]}" for v in VARIANTS)
    lines += [f"Checked: {checked['succeeded']} of {checked['sent']} runs succeeded; runs "
              f"that queued at least once (more than one attempt): {queued}; slot rows and "
              f"queue entries left: {checked['slots_left']} and {checked['waits_left']}.", ""]
    return lines, data


def _check_rows(admin: psycopg.Connection[Any], prefix: str,
                ids: dict[str, list[str]]) -> dict[str, Any]:
    runs = f'"{prefix}runs"'
    sent = sum(len(v) for v in ids.values())
    queued: dict[str, int] = {}
    succeeded = 0
    for name, task_ids in ids.items():
        row = admin.execute(
            f"SELECT count(*) FILTER (WHERE status = 'succeeded'), "
            f"count(*) FILTER (WHERE attempts > 1) FROM {runs} WHERE task_id = ANY(%s)",
            (task_ids,)).fetchone()
        assert row is not None
        succeeded += int(row[0])
        queued[name] = int(row[1])
    slots = admin.execute(f'SELECT count(*) FROM "{prefix}flow_slots"').fetchone()
    waits = admin.execute(f'SELECT count(*) FROM "{prefix}flow_waits"').fetchone()
    checked = {"sent": sent, "succeeded": succeeded, "queued": queued,
               "slots_left": int(slots[0]) if slots else -1,
               "waits_left": int(waits[0]) if waits else -1}
    problems = []
    if succeeded != sent:
        problems.append(f"{succeeded} of {sent} runs succeeded")
    for variant in VARIANTS:
        if not variant.binds and queued[variant.name]:
            problems.append(f"{queued[variant.name]} {variant.name} runs queued where the "
                            "limit should not bind")
    if checked["slots_left"] or checked["waits_left"]:
        problems.append(f"{checked['slots_left']} slot rows and {checked['waits_left']} queue "
                        "entries were left")
    if problems:
        raise RuntimeError("flow: " + "; ".join(problems))
    return checked


def _redact(url: str) -> str:
    from kombu.utils.url import maybe_sanitize_url

    return str(maybe_sanitize_url(url))


# -- in this process ----------------------------------------------------------------------------


class InProcess:
    """The free and the keyed task on an in-process app (no broker), on the run's tables."""

    def __init__(self, database_url: str, prefix: str) -> None:
        from celery_duraflow._config import config_for_app
        from celery_duraflow._store import store_for

        self.app = Celery(f"flow-bench-{uuid.uuid4().hex[:6]}", broker="memory://",
                          backend="cache+memory://", set_as_current=False)
        self.app.conf.update(duraflow_database_url=database_url, duraflow_table_prefix=prefix,
                             task_eager_propagates=False)
        self.tasks = {
            name: self.app.task(base=DurableTask, name=name, shared=False,
                                duraflow_limits=limits)(flow_work)
            for name, limits in TASK_LIMITS.items() if name != WIDE_TASK_NAME
        }
        self.store = store_for(config_for_app(self.app))
        self.store.migrate()
        self.engine = self.store.engine
        self._turn = 0

    def run(self, name: str, steps: int) -> None:
        tenant = TENANTS[self._turn % KEYS]
        self._turn += 1
        result = self.tasks[name].apply(args=(tenant, steps, 0.0),
                                        task_id=f"bench-{uuid.uuid4()}")
        if not result.successful() or result.result != workload.expected_result(steps):
            raise RuntimeError(f"{name} failed: {result.traceback}")


@dataclass
class Counted:
    """What one attempt sent, counted every way the harness can."""

    executed: int  # psycopg Cursor.execute calls and raw libpq writes of this thread
    alchemy: int  # SQLAlchemy before_cursor_execute events
    wire: int | None  # ReadyForQuery messages: round trips
    begins: int  # BEGIN sent on the wire: transactions
    texts: list[str]


def count_attempt(bench: InProcess, name: str, steps: int) -> Counted:
    """The statements and round trips of one attempt of ``name``, in this thread."""
    counter = RoundTrips(bench.engine, keep=True)
    me = threading.get_ident()
    with psycopg_statements() as executed, counter.counting():
        bench.run(name, steps)
    alchemy, wire = counter.of(me)
    sent = [s for text in counter.traces[me] for s in trace_statements(text)]
    begins = sum(1 for s in sent if s.text.lstrip().upper().startswith("BEGIN"))
    # The run's table prefix left out of the texts: they read as the schema names them.
    prefix = bench.store.config.table_prefix
    return Counted(len(executed), alchemy, wire, begins,
                   [" ".join(e.text.split()).replace(prefix, "") for e in executed])


def store_split(bench: InProcess, name: str, steps: int,
                attempts: int) -> dict[str, dict[str, float]]:
    """Per Store call of one attempt of ``name``: calls, wall, CPU, server wait, round trips
    (means over ``attempts`` traced attempts)."""
    from .profile import StoreTimers, _owner

    timers = StoreTimers().install()
    me = threading.get_ident()
    split: dict[str, dict[str, float]] = {}
    try:
        timers.keep_intervals = True
        for _ in range(attempts):
            timers.reset()
            counter = RoundTrips(bench.engine, timed=True, keep=True)
            with counter.counting():
                bench.run(name, steps)
            for call, (count, wall, cpu) in timers.calls.items():
                entry = split.setdefault(call, dict.fromkeys(
                    ("calls", "wall_s", "cpu_s", "wait_s", "round_trips"), 0.0))
                entry["calls"] += count
                entry["wall_s"] += wall
                entry["cpu_s"] += cpu
            for text in counter.traces[me]:
                for first, last in trace_intervals(text):
                    owner = _owner(timers.intervals, first)
                    entry = split.setdefault(owner, dict.fromkeys(
                        ("calls", "wall_s", "cpu_s", "wait_s", "round_trips"), 0.0))
                    entry["wait_s"] += last - first
                    entry["round_trips"] += 1
    finally:
        timers.remove()
    return {call: {k: v / attempts for k, v in entry.items()} for call, entry in split.items()}


def in_process(database_url: str, prefix: str, *, steps: int, rounds: int, runs: int,
               warmup: int, traced: int) -> tuple[list[str], dict[str, Any]]:
    """The limit's cost per attempt in this process: time, statements, Store calls."""
    bench = InProcess(database_url, prefix)
    names = {"none": FREE_TASK_NAME, "keyed": KEYED_TASK_NAME}
    variants: dict[str, Callable[[], object]] = {
        k: functools.partial(bench.run, n, steps) for k, n in names.items()}
    log(f"flow: in this process, {rounds} rounds of {runs} attempts of each")
    cpu: dict[str, Samples] = {}
    samples = interleaved(variants, dict.fromkeys(variants, runs), rounds, warmup, cpu=cpu)
    counts = {k: count_attempt(bench, n, steps) for k, n in names.items()}
    splits = {k: store_split(bench, n, steps, traced) for k, n in names.items()}

    free, keyed = samples["none"], samples["keyed"]
    extra = keyed.median - free.median
    extra_cpu = cpu["keyed"].median - cpu["none"].median
    c_free, c_keyed = counts["none"], counts["keyed"]
    added = _added(c_free.texts, c_keyed.texts)
    rows = [
        ["no limit", len(free), ms(free.median), ms(cpu["none"].median), c_free.executed,
         c_free.alchemy, _opt(c_free.wire), c_free.begins],
        [f"Concurrency({LIMIT}, key='tenant')", len(keyed), ms(keyed.median),
         ms(cpu["keyed"].median), c_keyed.executed, c_keyed.alchemy, _opt(c_keyed.wire),
         c_keyed.begins],
        ["added by the limit", "-", ms(extra), ms(extra_cpu), c_keyed.executed - c_free.executed,
         c_keyed.alchemy - c_free.alchemy,
         _opt(None if c_keyed.wire is None or c_free.wire is None
              else c_keyed.wire - c_free.wire),
         c_keyed.begins - c_free.begins],
    ]
    calls = sorted(set(splits["none"]) | set(splits["keyed"]),
                   key=lambda c: -splits["keyed"].get(c, {}).get("wall_s", 0.0))
    split_rows = []
    for call in calls:
        row: list[object] = [call]
        for k in ("none", "keyed"):
            entry = splits[k].get(call)
            if entry is None:
                row += ["-", "-", "-", "-"]
            else:
                wall = entry["wall_s"] if call != "outside Store calls" else None
                row += [f"{entry['calls']:.0f}" if wall is not None else "-",
                        ms(wall), ms(entry["wait_s"]), f"{entry['round_trips']:.1f}"]
        split_rows.append(row)
    lines = [
        f"The durable task of {steps} trivial steps applied in this process, with no limit "
        f"and with Concurrency({LIMIT}, key='tenant') (a new key of {KEYS} each attempt, so "
        f"never queued), {rounds} rounds of {runs} attempts of each taking turns; medians. "
        "Statements: psycopg's Cursor.execute calls and the store's raw libpq writes of "
        "one attempt (SQLAlchemy's before_cursor_execute events beside them); round trips: "
        "ReadyForQuery messages of libpq's trace; transactions: BEGINs on the wire.",
        "",
        table(["attempt", "runs", "wall median ms", "CPU median ms", "statements",
               "SQLAlchemy statements", "round trips", "transactions"], rows),
        "",
        f"Where the time goes, per attempt ({traced} traced attempts of each, means): each "
        "Store call's wall time, and its wait on PostgreSQL (libpq trace timestamps, from a "
        "round trip's first message to its ReadyForQuery) and round trips.",
        "",
        table(["Store call", "calls (none)", "wall ms (none)", "server wait ms (none)",
               "round trips (none)", "calls (limit)", "wall ms (limit)",
               "server wait ms (limit)", "round trips (limit)"], split_rows),
        "",
        f"The {len(added)} statements of a limited attempt that an unlimited one does not "
        "run as they are (added, or a statement of its own in place of the unlimited "
        "one's), in order:",
        "",
        table(["#", "statement"], [[i + 1, _clip(text, 110)] for i, text in enumerate(added)]),
    ]
    data = {
        "steps": steps, "runs": len(free),
        "none": {"median_s": free.median, "cpu_s": cpu["none"].median,
                 "statements": c_free.executed, "alchemy": c_free.alchemy,
                 "round_trips": c_free.wire, "transactions": c_free.begins},
        "keyed": {"median_s": keyed.median, "cpu_s": cpu["keyed"].median,
                  "statements": c_keyed.executed, "alchemy": c_keyed.alchemy,
                  "round_trips": c_keyed.wire, "transactions": c_keyed.begins},
        "added": {"wall_s": extra, "cpu_s": extra_cpu,
                  "statements": c_keyed.executed - c_free.executed,
                  "round_trips": (None if c_keyed.wire is None or c_free.wire is None
                                  else c_keyed.wire - c_free.wire),
                  "transactions": c_keyed.begins - c_free.begins, "texts": added},
        "store_calls": splits,
    }
    return lines, data


def _added(base: Sequence[str], more: Sequence[str]) -> list[str]:
    """The statements of ``more`` that ``base`` has not (a multiset difference, in order)."""
    left: dict[str, int] = {}
    for text in base:
        left[text] = left.get(text, 0) + 1
    added = []
    for text in more:
        if left.get(text, 0):
            left[text] -= 1
        else:
            added.append(text)
    return added


def _opt(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _clip(text: str, width: int) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= width else text[:width - 3] + "..."
