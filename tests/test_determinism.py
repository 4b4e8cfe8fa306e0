"""Code that changes under a run in progress: divergence, input and code fingerprints, patched().

Each test runs a first attempt under one version of a task, which stops
(fails) part-way, then delivers the same task id to a new version of the task
(same name, new code), as a deploy between two attempts would.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_duraflow import (
    DurableTask,
    NonDeterministicReplay,
    StepCodeChanged,
    StepInputChanged,
    get_run,
    patched,
    step,
)

NAME = "proj.trip"


class Stop(Exception):
    """Ends the first attempt part-way, leaving its steps recorded."""


def _first_attempt(app: Celery, fn: Callable[..., Any]) -> str:
    task = app.task(base=DurableTask, name=NAME)(fn)
    task_id = str(uuid.uuid4())
    result = task.apply(task_id=task_id)
    assert isinstance(result.result, Stop), result.result
    return task_id


def _replay(app: Celery, fn: Callable[..., Any], task_id: str, **options: Any) -> Any:
    task = app.task(base=DurableTask, name=NAME, **options)(fn)
    return task.apply(task_id=task_id)


def _duraflow_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("celery_duraflow") and r.levelno >= logging.WARNING]


def test_reordered_steps_fail_the_run_with_a_readable_error(
        make_app: Callable[..., Celery]) -> None:
    """Steps reordered by a deploy fail the run with an error saying where; nothing runs again."""
    calls: Counter[str] = Counter()

    def v1() -> None:
        with step("search"):
            calls["search"] += 1
        with step("pick"):
            calls["pick"] += 1
        raise Stop()

    def v2() -> None:
        with step("pick"):
            calls["pick"] += 1
        with step("search"):
            calls["search"] += 1

    task_id = _first_attempt(make_app(), v1)
    result = _replay(make_app(), v2, task_id)
    error = result.result
    assert isinstance(error, NonDeterministicReplay)
    assert (error.task_id, error.position, error.recorded_key, error.reached_key) == (
        task_id, 1, "search", "pick")
    assert str(error).startswith(
        f"task {task_id} ({NAME}) does not replay the way it ran: at position 1 among the "
        "run's top-level steps the run recorded step 'search', but the code now reaches step "
        "'pick' there.")
    assert "patched()" in str(error) and "duraflow_on_divergence = 'warn'" in str(error)
    assert calls == {"search": 1, "pick": 1}  # nothing ran again, nothing ran out of place
    run = get_run(task_id, app=make_app())
    assert run is not None and run.status == "failed" and "NonDeterministicReplay" in str(
        run.error)


def test_inserted_step_is_a_divergence(make_app: Callable[..., Celery]) -> None:
    """A step inserted before recorded ones is a divergence, reported at its position."""
    def v1() -> None:
        with step("search"):
            pass
        with step("book"):
            pass
        raise Stop()

    def v2() -> None:
        with step("search"):
            pass
        with step("check-price"):
            pass
        with step("book"):
            pass

    task_id = _first_attempt(make_app(), v1)
    error = _replay(make_app(), v2, task_id).result
    assert isinstance(error, NonDeterministicReplay)
    assert (error.position, error.recorded_key, error.reached_key) == (2, "book", "check-price")


def test_removed_step_is_a_divergence(make_app: Callable[..., Celery]) -> None:
    """A step removed from between recorded ones is a divergence, reported at its position."""
    def v1() -> None:
        for name in ("search", "pick", "book"):
            with step(name):
                pass
        raise Stop()

    def v2() -> None:
        for name in ("search", "book"):
            with step(name):
                pass

    task_id = _first_attempt(make_app(), v1)
    error = _replay(make_app(), v2, task_id).result
    assert isinstance(error, NonDeterministicReplay)
    assert (error.position, error.recorded_key, error.reached_key) == (2, "pick", "book")


@pytest.mark.parametrize(("before", "after", "position", "recorded", "reached"), [
    (3, 2, 3, "page#3", "done"),   # the loop got shorter
    (2, 3, 3, "done", "page#3"),   # the loop got longer
])
def test_loop_whose_length_changed_is_a_divergence(
        make_app: Callable[..., Celery], before: int, after: int, position: int,
        recorded: str, reached: str) -> None:
    """A loop that now runs more or fewer times than recorded is a divergence."""
    def version(pages: int, stop: bool) -> Callable[[], None]:
        def task() -> None:
            for _ in range(pages):
                with step("page"):
                    pass
            with step("done"):
                pass
            if stop:
                raise Stop()
        return task

    task_id = _first_attempt(make_app(), version(before, stop=True))
    error = _replay(make_app(), version(after, stop=False), task_id).result
    assert isinstance(error, NonDeterministicReplay)
    assert (error.position, error.recorded_key, error.reached_key) == (
        position, recorded, reached)


def test_divergence_is_not_retried_even_under_autoretry(make_app: Callable[..., Celery]) -> None:
    """A divergence fails the run at once: autoretry does not run the diverged code again."""
    attempts: Counter[str] = Counter()

    def v1() -> None:
        with step("a"):
            pass
        raise Stop()

    def v2() -> None:
        attempts["v2"] += 1
        with step("b"):
            pass

    task_id = _first_attempt(make_app(), v1)
    result = _replay(make_app(), v2, task_id, autoretry_for=(Exception,), max_retries=5)
    assert isinstance(result.result, NonDeterministicReplay)
    assert attempts["v2"] == 1


def test_warn_policy_logs_and_goes_on(make_app: Callable[..., Celery],
                                      caplog: pytest.LogCaptureFixture) -> None:
    """With duraflow_on_divergence = 'warn', a divergence is logged once and the run goes on."""
    def v1() -> None:
        with step("a"):
            pass
        raise Stop()

    def v2() -> str:
        with step("b") as s:
            s.result = "b ran"
        return str(s.result)

    task_id = _first_attempt(make_app(), v1)
    caplog.clear()  # the first attempt's own failure is logged too
    with caplog.at_level(logging.WARNING, logger="celery_duraflow"):
        result = _replay(make_app(duraflow_on_divergence="warn"), v2, task_id)
    assert result.get() == "b ran"
    [warning] = _duraflow_warnings(caplog)
    assert "recorded step 'a'" in warning and "the run goes on" in warning


def test_changed_input_is_refused(make_app: Callable[..., Celery],
                                  caplog: pytest.LogCaptureFixture) -> None:
    """A step replayed with another input is refused; the same input in another key order is not."""
    quotes: list[int] = []

    def version(amount: int, stop: bool) -> Callable[[], int]:
        def task() -> int:
            with step("quote", input={"amount": amount, "currency": "EUR"}) as s:
                quotes.append(amount)
                s.result = amount * 2
            if stop:
                raise Stop()
            return int(s.result)
        return task

    task_id = _first_attempt(make_app(), version(10, stop=True))
    error = _replay(make_app(), version(20, stop=False), task_id).result
    assert isinstance(error, StepInputChanged)
    assert error.step_key == "quote" and "another input" in str(error)
    assert quotes == [10]
    # The same input in another key order is the same input.
    def same(stop: bool) -> Callable[[], int]:
        def task() -> int:
            with step("quote", input={"currency": "EUR", "amount": 10}) as s:
                quotes.append(10)
                s.result = 20
            return int(s.result)
        return task

    assert _replay(make_app(), same(False), task_id).get() == 20
    assert quotes == [10]
    run = get_run(task_id, app=make_app())
    assert run is not None and run.step("quote").input_fingerprint is not None


def test_changed_step_body_warns_by_default_and_can_refuse(
        make_app: Callable[..., Celery], caplog: pytest.LogCaptureFixture) -> None:
    """A changed step body warns and keeps the stored output; on_code_change = 'fail' refuses it."""
    def v1() -> int:
        with step("price") as s:
            s.result = 100
        raise Stop()

    def v2() -> int:
        with step("price") as s:
            s.result = 100 * 2  # the body changed
        return int(s.result)

    task_id = _first_attempt(make_app(), v1)
    with caplog.at_level(logging.WARNING, logger="celery_duraflow"):
        refused = _replay(make_app(duraflow_on_code_change="fail"), v2, task_id).result
    assert isinstance(refused, StepCodeChanged) and refused.step_key == "price"
    assert "duraflow_on_code_change = 'warn'" in str(refused)

    task_id = _first_attempt(make_app(), v1)
    with caplog.at_level(logging.WARNING, logger="celery_duraflow"):
        caplog.clear()
        assert _replay(make_app(), v2, task_id).get() == 100  # the stored output stands
    [warning] = _duraflow_warnings(caplog)
    assert "step 'price'" in warning and "other code" in warning
    run = get_run(task_id, app=make_app())
    assert run is not None and run.code_fingerprint is not None
    assert run.step("price").code_fingerprint is not None


def test_changed_function_of_a_functional_step_warns(
        make_app: Callable[..., Celery], caplog: pytest.LogCaptureFixture) -> None:
    """A changed function behind step(...).run() warns, and the stored output stands."""
    def old_rate() -> float:
        return 1.0

    def new_rate() -> float:
        return 1.25

    def version(fn: Callable[[], float], stop: bool) -> Callable[[], float]:
        def task() -> float:
            rate = step("rate").run(fn)
            if stop:
                raise Stop()
            return rate
        return task

    task_id = _first_attempt(make_app(), version(old_rate, stop=True))
    caplog.clear()  # the first attempt's own failure is logged too
    with caplog.at_level(logging.WARNING, logger="celery_duraflow"):
        assert _replay(make_app(), version(new_rate, stop=False), task_id).get() == 1.0
    [warning] = _duraflow_warnings(caplog)
    assert "step 'rate'" in warning


def test_unchanged_code_replays_without_any_warning(
        make_app: Callable[..., Celery], caplog: pytest.LogCaptureFixture) -> None:
    """Retries of unchanged code (loops, nesting, run(), patched()) replay without a warning."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.task(base=DurableTask, bind=True, max_retries=2, name=NAME)
    def trip(self: DurableTask, pages: int) -> int:
        total = 0
        for n in range(pages):
            with step("page", input={"n": n}) as s:
                s.result = n
            total += s.result
        with step("outer") as outer:
            with step("inner") as s:
                s.result = 1
            outer.result = s.result
        rate = step("rate").run(lambda: 2)
        if patched("bonus"):
            total += 10
        with step("flaky"):
            calls["flaky"] += 1
            if calls["flaky"] < 3:
                raise self.retry(countdown=0)
        return total * rate + outer.result

    with caplog.at_level(logging.DEBUG, logger="celery_duraflow"):
        assert trip.apply(args=(3,)).get() == (3 + 10) * 2 + 1
    assert calls["flaky"] == 3
    assert _duraflow_warnings(caplog) == []


def test_patched_keeps_old_runs_on_the_old_branch(make_app: Callable[..., Celery]) -> None:
    """patched() keeps runs begun before a deploy on the old branch; the patch can be retired."""
    ran: list[str] = []

    def v1() -> None:
        for name in ("search", "book"):
            with step(name):
                ran.append(f"v1 {name}")
        raise Stop()

    def v2(stop: bool = False) -> Callable[[], list[str]]:
        def task() -> list[str]:
            with step("search"):
                ran.append("v2 search")
            if patched("price-check"):
                with step("check-price"):
                    ran.append("v2 check-price")
                branch = "new"
            else:
                branch = "old"
            with step("book"):
                ran.append("v2 book")
            with step("notify"):
                ran.append(f"v2 notify ({branch})")
            if stop:
                raise Stop()
            return [branch]
        return task

    old = _first_attempt(make_app(), v1)
    assert _replay(make_app(), v2(), old).get() == ["old"]
    assert ran == ["v1 search", "v1 book", "v2 notify (old)"]
    old_run = get_run(old, app=make_app())
    assert old_run is not None and old_run.status == "succeeded"
    assert [s.key for s in old_run.steps] == ["search", "book", "notify"]

    ran.clear()
    new = _first_attempt(make_app(), v2(stop=True))  # a run that starts after the deploy
    assert _replay(make_app(), v2(), new).get() == ["new"]  # and stays on the new branch
    assert ran == ["v2 search", "v2 check-price", "v2 book", "v2 notify (new)"]

    # Retiring the patch: the new branch without patched(), for runs that recorded it.
    def v3() -> str:
        for name in ("search", "check-price", "book", "notify"):
            with step(name):
                ran.append(f"v3 {name}")
        return "done"

    ran.clear()
    mid = _first_attempt(make_app(), v2(stop=True))
    ran.clear()
    assert _replay(make_app(), v3, mid).get() == "done"
    assert ran == []  # every step answered from the store, no divergence


def test_code_fingerprints_ignore_layout_and_comments() -> None:
    """Code fingerprints ignore layout and comments but change with the code; builtins have none."""
    import ast

    from celery_duraflow._fingerprint import code_fingerprint, fingerprint_nodes

    def fp(source: str) -> str:
        return fingerprint_nodes(ast.parse(source).body)

    plain = fp("def f(x):\n    return x + 1\n")
    assert fp("\n\n# moved down, with comments\ndef f(x):\n\n    return x + 1  # same\n") == plain
    assert fp("def f(x):\n    return x + 2\n") != plain
    assert fp("def g(x):\n    return x + 1\n") != plain

    def first(x: int) -> int:
        return x + 1

    def third(x: int) -> int:
        return x + 2

    assert code_fingerprint(first) is not None
    assert code_fingerprint(first) != code_fingerprint(third)
    assert code_fingerprint(len) is None
