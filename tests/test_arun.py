"""`await step(name).arun(async_fn, ...)`: the awaitable step, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_duraflow import (
    DurableTask,
    NotInDurableTask,
    StepInputChanged,
    StepOutputNotSerializable,
    UnsupportedCode,
    get_run,
    step,
)


class Flaky(Exception):
    """Raised by test bodies to make Celery retry the task."""


def test_arun_replays_completed_steps_on_retry(make_app: Callable[..., Celery]) -> None:
    """A retry of a task running an event loop awaits no completed step's body again."""
    app = make_app()
    calls: Counter[str] = Counter()
    keys: list[str] = []

    async def search(origin: str) -> list[str]:
        calls["search"] += 1
        await asyncio.sleep(0)
        return [f"{origin}-LH1", f"{origin}-BA9"]

    async def book(flight: str, *, key: str) -> dict[str, str]:
        calls["book"] += 1
        keys.append(key)
        return {"flight": flight, "key": key}

    async def notify() -> str:
        calls["notify"] += 1
        if calls["notify"] < 3:
            raise Flaky("mail server down")
        return "sent"

    async def agent(origin: str) -> Any:
        flights = await step("search").arun(search, origin)
        s = step("book")
        booking = await s.arun(book, flights[1], key=s.idempotency_key)
        await step("notify").arun(notify)
        return booking

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=5)
    def trip(origin: str) -> Any:
        return asyncio.run(agent(origin))

    result = trip.apply(args=("FRA",))
    assert result.successful(), result.traceback
    assert calls == {"search": 1, "book": 1, "notify": 3}
    assert result.get() == {"flight": "FRA-BA9", "key": keys[0]}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded" and run.attempts == 3
    assert [(s.key, s.status, s.attempts) for s in run.steps] == [
        ("search", "completed", 1), ("book", "completed", 1), ("notify", "completed", 3)]


def test_arun_nests_steps_and_keeps_the_idempotency_key(
        make_app: Callable[..., Celery]) -> None:
    """Steps inside an awaited body nest under it; its key is the same on every attempt."""
    app = make_app()
    calls: Counter[str] = Counter()
    seen: list[tuple[str, bool, int]] = []

    async def outer() -> int:
        s = step("inner")
        value = await s.arun(inner)
        calls["outer"] += 1
        if calls["outer"] == 1:
            raise Flaky("once")
        return value

    async def inner() -> int:
        calls["inner"] += 1
        return 7

    async def body() -> int:
        s = step("outer")
        try:
            return await s.arun(outer)
        finally:
            seen.append((s.idempotency_key, s.cached, s.attempt))

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=2)
    def task() -> int:
        return asyncio.run(body())

    result = task.apply()
    assert result.successful(), result.traceback
    assert result.get() == 7
    assert calls == {"outer": 2, "inner": 1}
    assert seen[0][0] == seen[1][0] and [a for _, _, a in seen] == [1, 2]
    run = get_run(result.id, app=app)
    assert run is not None
    assert [(s.key, s.status) for s in run.steps] == [
        ("outer", "completed"), ("outer/inner", "completed")]


def test_arun_outside_a_run_is_refused() -> None:
    """An awaitable step reached outside a durable task is refused before its body runs."""
    called: list[int] = []

    async def body() -> None:
        called.append(1)

    async def main() -> None:
        await step("alone").arun(body)

    with pytest.raises(NotInDurableTask, match="'alone'"):
        asyncio.run(main())
    assert called == []


def test_arun_refuses_a_plain_function(make_app: Callable[..., Celery]) -> None:
    """A plain function given to .arun() is refused before it is called, and the run fails."""
    app = make_app()
    called: list[int] = []

    def plain() -> int:
        called.append(1)
        return 1

    async def main() -> None:
        await step("plain").arun(plain)  # type: ignore[arg-type]

    @app.task(base=DurableTask, autoretry_for=(Exception,), retry_backoff=False, max_retries=3)
    def task() -> None:
        asyncio.run(main())

    result = task.apply()
    assert result.failed()
    assert isinstance(result.result, UnsupportedCode)
    assert "'plain'" in str(result.result) and ".run()" in str(result.result)
    assert called == []
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed" and run.attempts == 1


def test_arun_accepts_partials_and_async_callables(make_app: Callable[..., Celery]) -> None:
    """functools.partial of a coroutine function and objects with async __call__ are steps."""
    app = make_app()

    async def add(a: int, b: int) -> int:
        return a + b

    class Doubler:
        async def __call__(self, x: int) -> int:
            return 2 * x

    async def main() -> list[int]:
        return [await step("partial").arun(functools.partial(add, 1), 2),
                await step("callable").arun(Doubler(), 5)]

    @app.task(base=DurableTask)
    def task() -> list[int]:
        return asyncio.run(main())

    result = task.apply()
    assert result.successful(), result.traceback
    assert result.get() == [3, 10]


def test_gathered_steps_created_first_run_together_and_replay_in_any_order(
        make_app: Callable[..., Celery]) -> None:
    """Steps created in order and awaited together by asyncio.gather run at the same time;
    one that fails is run again on the retry while its sibling, which ended first in the
    first attempt, is answered from the store: keys and places do not depend on which
    ended first, so the replay finds no divergence."""
    app = make_app()
    calls: Counter[str] = Counter()
    running: list[str] = []
    overlapped: list[bool] = []

    async def work(name: str, seconds: float) -> str:
        calls[name] += 1
        running.append(name)
        overlapped.append(len(running) > 1)
        await asyncio.sleep(seconds)
        running.remove(name)
        if name == "a" and calls[name] == 1:
            raise Flaky("a fails once, after b has ended")
        return name

    async def main() -> list[str]:
        first = await asyncio.gather(step("a").arun(work, "a", 0.05),
                                     step("b").arun(work, "b", 0.01),
                                     step("c").arun(work, "c", 0.02))
        return [*first, await step("after").arun(work, "after", 0)]

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def task() -> list[str]:
        return asyncio.run(main())

    result = task.apply()
    assert result.successful(), result.traceback
    assert result.get() == ["a", "b", "c", "after"]
    assert calls == {"a": 2, "b": 1, "c": 1, "after": 1}
    assert any(overlapped)
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "succeeded"
    assert [(s.key, s.position) for s in sorted(run.steps, key=lambda s: s.position or 0)] == [
        ("a", 1), ("b", 2), ("c", 3), ("after", 4)]


def test_steps_created_inside_gathered_branches_are_refused(
        make_app: Callable[..., Celery]) -> None:
    """Branches that each create their step after an await get keys in the order of timing:
    the step created while another branch's step runs fails the run for good, naming it."""
    app = make_app()
    calls: Counter[str] = Counter()

    async def slow(name: str) -> str:
        calls[name] += 1
        await asyncio.sleep(0.05)
        return name

    async def branch(name: str, delay: float) -> str:
        await asyncio.sleep(delay)
        return await step("fetch").arun(slow, name)

    async def main() -> list[str]:
        return list(await asyncio.gather(branch("a", 0), branch("b", 0.01)))

    @app.task(base=DurableTask, autoretry_for=(Exception,), retry_backoff=False, max_retries=3)
    def task() -> list[str]:
        return asyncio.run(main())

    result = task.apply()
    assert result.failed()
    assert isinstance(result.result, UnsupportedCode)
    assert "'fetch'" in str(result.result) and "aparallel()" in str(result.result)
    assert calls == {"a": 1}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed" and run.attempts == 1


def test_step_in_a_thread_the_body_awaits_nests(make_app: Callable[..., Celery]) -> None:
    """A plain function the awaited body runs in a thread (asyncio.to_thread) may take steps."""
    app = make_app()

    def blocking() -> int:
        return step("in-thread").run(lambda: threading.current_thread().name != "x")

    async def body() -> int:
        return int(await asyncio.to_thread(blocking))

    async def main() -> int:
        return await step("outer").arun(body)

    @app.task(base=DurableTask)
    def task() -> int:
        return asyncio.run(main())

    result = task.apply()
    assert result.successful(), result.traceback
    run = get_run(result.id, app=app)
    assert run is not None
    assert [s.key for s in run.steps] == ["outer", "outer/in-thread"]


def test_arun_unstorable_result_fails_for_good(make_app: Callable[..., Celery]) -> None:
    """An awaited result the serializer cannot store fails the run for good, body run once."""
    app = make_app()
    calls: Counter[str] = Counter()

    async def lock() -> Any:
        calls["lock"] += 1
        return threading.Lock()

    async def main() -> None:
        await step("lock").arun(lock)

    @app.task(base=DurableTask, autoretry_for=(Exception,), retry_backoff=False, max_retries=3)
    def task() -> None:
        asyncio.run(main())

    result = task.apply()
    assert result.failed()
    assert isinstance(result.result, StepOutputNotSerializable)
    assert "'lock'" in str(result.result)
    assert calls == {"lock": 1}
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed"


def test_arun_input_change_is_a_divergence(make_app: Callable[..., Celery]) -> None:
    """An awaited step given another input on a retry raises StepInputChanged with its key."""
    app = make_app()
    calls: Counter[str] = Counter()

    async def ask(prompt: str) -> str:
        calls["ask"] += 1
        return prompt.upper()

    async def main(prompt: str) -> str:
        answer = await step("ask", input=prompt).arun(ask, prompt)
        calls["after"] += 1
        if calls["after"] == 1:
            raise Flaky("once")
        return answer

    @app.task(base=DurableTask, autoretry_for=(Flaky,), retry_backoff=False, max_retries=3)
    def task() -> str:
        prompt = "book a flight" if calls["ask"] == 0 else "book two flights"
        return asyncio.run(main(prompt))

    result = task.apply()
    assert result.failed()
    assert isinstance(result.result, StepInputChanged)
    assert result.result.step_key == "ask"
    assert calls == {"ask": 1, "after": 1}
