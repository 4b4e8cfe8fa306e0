"""Parallel branches inside one run: ``parallel()`` (threads) and ``aparallel()`` (asyncio).

On SQLite and PostgreSQL: the branches run at the same time; each is a step of its own
(``name/0``, ``name/1``, ...) with the steps it takes nested in it; a failed branch
fails the parallel step once every branch has ended, and the retry runs only the
branches that did not complete, whatever order they ended in; a wait in a branch is
refused for good.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from celery import Celery

from celery_duraflow import (
    DurableTask,
    UnsupportedCode,
    aparallel,
    get_run,
    parallel,
    sleep,
    step,
)


class Flaky(Exception):
    """Raised by a branch to make Celery retry the task."""


def test_parallel_branches_run_together_and_a_retry_runs_only_the_failed_one(
        make_app: Callable[..., Celery]) -> None:
    """Three branches in threads overlap; the one that fails is the only one run again on the
    retry (its siblings, which ended first, answer from the store); each branch's own steps
    are nested in it; the result keeps the order the branches were given."""
    app = make_app()
    calls: Counter[str] = Counter()
    lock = threading.Lock()
    most = [0, 0]

    def quote(airline: str, seconds: float) -> dict[str, Any]:
        with lock:
            calls[airline] += 1
            most[0] += 1
            most[1] = max(most[1], most[0])
        time.sleep(seconds)
        with lock:
            most[0] -= 1
        if airline == "slow" and calls[airline] == 1:
            raise Flaky("the slow airline times out once")
        price = step("price").run(lambda: {"airline": airline, "price": len(airline) * 100})
        return dict(price)

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def trip() -> list[dict[str, Any]]:
        return parallel("quotes", [partial(quote, "slow", 0.15), partial(quote, "fast", 0.01),
                                   partial(quote, "mid", 0.05)])

    result = trip.apply()
    assert result.successful(), result.traceback
    assert result.get() == [{"airline": "slow", "price": 400}, {"airline": "fast", "price": 400},
                            {"airline": "mid", "price": 300}]
    assert calls == {"slow": 2, "fast": 1, "mid": 1}
    assert most[1] >= 2  # the branches ran at the same time
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded"
    assert sorted(s.key for s in run.steps) == [
        "quotes", "quotes/0", "quotes/0/price", "quotes/1", "quotes/1/price", "quotes/2",
        "quotes/2/price"]


def test_aparallel_branches_overlap_and_replay_in_any_order(
        make_app: Callable[..., Celery]) -> None:
    """Ten async branches of 50 ms each finish in well under ten times one; a retry after a
    later step failed answers the whole parallel step from the store, no branch re-run."""
    app = make_app()
    calls: Counter[int] = Counter()
    failures = Counter[str]()

    async def io(n: int) -> int:
        calls[n] += 1
        await asyncio.sleep(0.05)
        return await step("double").arun(_double, n)

    async def main() -> tuple[list[int], float]:
        started = time.perf_counter()
        got = await aparallel("io", [partial(io, n) for n in range(10)])
        took = time.perf_counter() - started
        with_after = await step("after").arun(_maybe_fail, failures)
        return [*got, with_after], took

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def task() -> list[int]:
        got, _ = asyncio.run(main())
        return got

    result = task.apply()
    assert result.successful(), result.traceback
    assert result.get() == [n * 2 for n in range(10)] + [1]
    assert calls == {n: 1 for n in range(10)}
    assert failures == {"after": 2}


async def _double(n: int) -> int:
    return n * 2


async def _maybe_fail(failures: Counter[str]) -> int:
    failures["after"] += 1
    if failures["after"] == 1:
        raise Flaky("the step after the branches fails once")
    return 1


def test_every_branch_ends_before_the_first_failure_is_raised(
        make_app: Callable[..., Celery]) -> None:
    """Branch 0 fails at once and branch 2 fails too: branch 1, slower, still completes,
    and the error raised is branch 0's (the first in the order given)."""
    app = make_app()
    ended: list[int] = []

    def work(n: int) -> int:
        if n == 0:
            raise ValueError("branch 0 broke")
        time.sleep(0.05)
        ended.append(n)
        if n == 2:
            raise KeyError("branch 2 broke")
        return n

    @app.task(base=DurableTask)
    def task() -> list[int]:
        return parallel("work", [partial(work, n) for n in range(3)])

    result = task.apply()
    assert result.failed()
    assert isinstance(result.result, ValueError) and "branch 0 broke" in str(result.result)
    assert sorted(ended) == [1, 2]
    run = get_run(result.id, app=app)
    assert run is not None
    statuses = {s.key: s.status for s in run.steps}
    assert statuses == {"work": "failed", "work/0": "failed", "work/1": "completed",
                        "work/2": "failed"}


def test_a_wait_in_a_branch_is_refused_for_good(make_app: Callable[..., Celery]) -> None:
    """A branch that sleeps would suspend the run while the others run: refused, and the
    run fails without a retry."""
    app = make_app()

    def napper() -> int:
        sleep("nap", 1)
        return 1

    @app.task(base=DurableTask, autoretry_for=(Exception,), retry_backoff=False, max_retries=3)
    def task() -> list[int]:
        return parallel("branches", [napper, lambda: 2])

    result = task.apply()
    assert result.failed()
    assert isinstance(result.result, UnsupportedCode)
    assert "parallel branch 'branches/0'" in str(result.result)
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed" and run.attempts == 1


def test_branches_must_be_functions(make_app: Callable[..., Celery]) -> None:
    """A branch that is not callable, or a plain function given to aparallel, is refused
    before any branch runs."""
    app = make_app()

    @app.task(base=DurableTask)
    def plain() -> Any:
        return parallel("p", [lambda: 1, 2])  # type: ignore[list-item]

    @app.task(base=DurableTask)
    def mixed() -> Any:
        async def one() -> int:
            return 1

        async def main() -> Any:
            return await aparallel("p", [one, lambda: 2])  # type: ignore[list-item]

        return asyncio.run(main())

    for task in (plain, mixed):
        result = task.apply()
        assert result.failed() and isinstance(result.result, TypeError)
        run = get_run(result.id, app=app)
        assert run is not None and not run.steps
