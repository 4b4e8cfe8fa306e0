"""Skipping `with step(...)` bodies by rewriting: every shape of code users write."""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import pytest
from celery import Celery

from celery_duraflow import DurableTask, StepNotPrepared, durable, get_run, step
from celery_duraflow._rewrite import prepare


class Flaky(Exception):
    """Raised by test bodies to make Celery retry the task."""


def fail_first(counter: Counter[str], key: str, times: int = 1) -> None:
    counter[key] += 1
    if counter[key] <= times:
        raise Flaky(f"{key} fails on call {counter[key]}")


@durable
def _countdown(n: int) -> int:
    """A recursive helper: it reaches itself through the module's globals."""
    if n == 0:
        return 0
    with step(f"level{n}") as s:
        s.result = _countdown(n - 1) + 1
    return int(s.result)


def test_recursive_helper_is_prepared(sqlite_app: Celery) -> None:
    """A @durable function that calls itself by name is prepared, steps nested per call."""
    @sqlite_app.task(base=DurableTask)
    def task() -> Any:
        return _countdown(3)

    result = task.apply()
    assert result.get() == 3
    run = get_run(result.id, app=sqlite_app)
    assert run is not None
    assert [s.key for s in run.steps] == ["level3", "level3/level2", "level3/level2/level1"]


def test_one_line_body_is_skipped_on_retry(sqlite_app: Celery) -> None:
    """A body written on the `with` line itself does not run again."""
    calls: Counter[str] = Counter()

    @sqlite_app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3)
    def task() -> Any:
        with step("charge") as s: calls["charge"] += 1; s.result = "charged"  # noqa: E701, E702
        with step("notify") as s:
            fail_first(calls, "notify")
        return s.result

    result = task.apply()
    assert result.successful(), result.traceback
    assert calls == {"charge": 1, "notify": 2}


def test_body_starting_with_try_is_skipped(sqlite_app: Celery) -> None:
    """A body that begins with `try:` is skipped whole, handlers included."""
    calls: Counter[str] = Counter()

    @sqlite_app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3)
    def task() -> Any:
        with step("charge") as s:
            try:
                calls["charge"] += 1
                s.result = 10
            except KeyError:
                calls["handler"] += 1
            finally:
                calls["finally"] += 1
        charged = s.result
        with step("notify"):
            fail_first(calls, "notify")
        return charged

    result = task.apply()
    assert result.get() == 10
    assert calls == {"charge": 1, "finally": 1, "notify": 2}


def test_nested_steps_and_plain_context_managers(sqlite_app: Celery) -> None:
    """Nested steps get parent-scoped keys; non-step `with` blocks run normally."""
    calls: Counter[str] = Counter()

    class Resource:
        def __enter__(self) -> Resource:
            calls["resource"] += 1
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    @sqlite_app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3)
    def task() -> Any:
        with step("trip") as trip:
            with step("flight") as s:
                calls["flight"] += 1
                s.result = "F1"
            with Resource():
                calls["inside-resource"] += 1
            with step("hotel") as s:
                calls["hotel"] += 1
                fail_first(calls, "hotel-fail")
                s.result = "H1"
            trip.result = ["F1", s.result]
        with Resource():
            calls["after"] += 1
        return trip.result

    result = task.apply()
    assert result.get() == ["F1", "H1"]
    # The parent failed with its first child done: on retry the child is cached.
    assert calls["flight"] == 1
    assert calls["hotel"] == 2
    assert calls["inside-resource"] == 2
    assert calls["after"] == 1
    run = get_run(result.id, app=sqlite_app)
    assert run is not None
    assert [s.key for s in run.steps] == ["trip", "trip/flight", "trip/hotel"]


def test_cached_parent_skips_its_children_and_keys_stay_stable(sqlite_app: Celery) -> None:
    """A completed parent skips its whole subtree; later keys do not shift."""
    calls: Counter[str] = Counter()

    @sqlite_app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3)
    def task() -> Any:
        with step("outer") as s:
            with step("fetch") as inner:
                calls["inner-fetch"] += 1
                inner.result = "inner"
            s.result = inner.result
        with step("fetch") as s:
            calls["top-fetch"] += 1
            s.result = "top"
        top = s.result
        with step("notify"):
            fail_first(calls, "notify")
        return top

    result = task.apply()
    assert result.get() == "top"
    assert calls["inner-fetch"] == 1
    assert calls["top-fetch"] == 1
    run = get_run(result.id, app=sqlite_app)
    assert run is not None
    assert run.step("outer/fetch").result == "inner"
    assert run.step("fetch").result == "top"


def test_steps_in_a_loop_are_numbered(sqlite_app: Celery) -> None:
    """The same name reached again gets #2, #3 ... and each replays its own output."""
    calls: Counter[str] = Counter()

    @sqlite_app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3)
    def task(n: int) -> Any:
        outputs = []
        for i in range(n):
            with step("page") as s:
                calls[f"page-{i}"] += 1
                s.result = i * 10
            outputs.append(s.result)
        with step("done"):
            fail_first(calls, "done")
        return outputs

    result = task.apply(args=(3,))
    assert result.get() == [0, 10, 20]
    assert all(calls[f"page-{i}"] == 1 for i in range(3))
    run = get_run(result.id, app=sqlite_app)
    assert run is not None
    assert [s.key for s in run.steps] == ["page", "page#2", "page#3", "done"]


def test_closures_see_the_enclosing_variables(sqlite_app: Celery) -> None:
    """Variables captured from an enclosing function keep working after the rewrite."""
    calls: Counter[str] = Counter()
    factor = 7

    def make_task(offset: int) -> Any:
        @sqlite_app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3,
                         name=f"closure-{offset}")
        def task(x: int) -> Any:
            with step("compute") as s:
                calls["compute"] += 1
                s.result = x * factor + offset
            with step("notify"):
                fail_first(calls, "notify")
            return s.result

        return task

    result = make_task(1).apply(args=(2,))
    assert result.get() == 15
    assert calls == {"compute": 1, "notify": 2}


def test_bound_and_unbound_tasks(sqlite_app: Celery) -> None:
    """bind=True tasks get self; both forms skip completed steps."""
    calls: Counter[str] = Counter()

    @sqlite_app.task(base=DurableTask, bind=True, max_retries=3)
    def bound(self: DurableTask) -> Any:
        with step("a") as s:
            calls["bound-a"] += 1
            s.result = self.request.id
        with step("b"):
            calls["bound-b"] += 1
            if calls["bound-b"] == 1:
                raise self.retry(countdown=0)
        return s.result

    @sqlite_app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3)
    def unbound() -> Any:
        with step("a") as s:
            calls["unbound-a"] += 1
            s.result = "x"
        with step("b"):
            fail_first(calls, "unbound-b")
        return s.result

    r1 = bound.apply()
    assert r1.get() == r1.id
    assert calls["bound-a"] == 1 and calls["bound-b"] == 2
    assert unbound.apply().get() == "x"
    assert calls["unbound-a"] == 1 and calls["unbound-b"] == 2


def test_class_based_task_with_super_and_private_names(sqlite_app: Celery) -> None:
    """A DurableTask subclass's run() is prepared, keeping super() and name mangling."""
    calls: Counter[str] = Counter()

    class Base(DurableTask):
        def describe(self) -> str:
            return "base"

    class Booking(Base):
        name = "booking-class-task"
        autoretry_for = (Flaky,)
        max_retries = 3
        __secret = "mangled"

        def describe(self) -> str:
            return "booking+" + super().describe()

        def run(self, who: str) -> Any:
            with step("book") as s:
                calls["book"] += 1
                s.result = f"{who}:{self.__secret}:{super().describe()}"
            with step("notify"):
                fail_first(calls, "notify")
            return s.result

    task = sqlite_app.register_task(Booking())
    result = task.apply(args=("ann",))
    assert result.get() == "ann:mangled:base"
    assert calls == {"book": 1, "notify": 2}


def test_durable_helper_is_skipped(sqlite_app: Celery) -> None:
    """Steps in a @durable helper are skipped like steps in the task itself."""
    calls: Counter[str] = Counter()

    @durable
    def charge(amount: int) -> int:
        with step("charge") as s:
            calls["charge"] += 1
            s.result = amount
        return int(s.result)

    @sqlite_app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3)
    def task() -> Any:
        total = charge(5) + charge(6)
        with step("notify"):
            fail_first(calls, "notify")
        return total

    assert task.apply().get() == 11
    assert calls == {"charge": 2, "notify": 2}


def test_unprepared_helper_fails_closed_on_first_attempt(sqlite_app: Celery) -> None:
    """`with step` in a helper without @durable raises StepNotPrepared before its body runs."""
    calls: Counter[str] = Counter()

    def helper() -> None:
        with step("charge"):
            calls["charge"] += 1

    @sqlite_app.task(base=DurableTask)
    def task() -> None:
        helper()

    result = task.apply()
    assert isinstance(result.result, StepNotPrepared)
    assert "@durable" in str(result.result)
    assert result.result.task_id == result.id
    assert result.result.step_key == "charge"
    assert calls["charge"] == 0
    run = get_run(result.id, app=sqlite_app)
    assert run is not None
    assert run.status == "failed"
    assert run.steps == ()


def test_entering_a_step_by_hand_is_refused(sqlite_app: Celery) -> None:
    """Calling __enter__ or ExitStack from prepared code still fails closed."""
    from contextlib import ExitStack

    @sqlite_app.task(base=DurableTask)
    def task() -> str:
        outcomes = []
        try:
            with ExitStack() as stack:
                stack.enter_context(step("a"))
        except StepNotPrepared:
            outcomes.append("exitstack refused")
        return ",".join(outcomes)

    assert task.apply().get() == "exitstack refused"


def test_functional_form_needs_no_preparation(sqlite_app: Celery) -> None:
    """step(name).run(fn) works in unprepared helpers and skips fn on replay."""
    calls: Counter[str] = Counter()

    def book(flight: str) -> str:
        calls["book"] += 1
        return f"booked {flight}"

    def helper() -> str:  # deliberately not @durable
        return step("book").run(book, "F1")

    @sqlite_app.task(base=DurableTask, autoretry_for=(Flaky,), max_retries=3)
    def task() -> Any:
        booking = helper()
        step("notify").run(fail_first, calls, "notify")
        return booking

    assert task.apply().get() == "booked F1"
    assert calls == {"book": 1, "notify": 2}


def test_traceback_points_at_the_users_line(sqlite_app: Celery) -> None:
    """An exception inside a rewritten body reports the line the user wrote."""

    @sqlite_app.task(base=DurableTask)
    def task() -> None:
        with step("explode"):
            raise ValueError("boom")  # the line the traceback must show

    result = task.apply()
    assert isinstance(result.result, ValueError)
    frames = traceback.extract_tb(result.result.__traceback__)
    user_frame = [f for f in frames if f.name == "task"][-1]
    assert user_frame.filename == __file__
    assert user_frame.line == 'raise ValueError("boom")  # the line the traceback must show'


def test_prepare_keeps_signature_defaults_and_identity() -> None:
    """prepare() keeps names, defaults and docstrings, and is idempotent."""

    def helper(a: int, b: int = 2, *, c: int = 3) -> int:
        """Docstring."""
        with step("x") as s:
            s.result = a + b + c
        return int(s.result)

    prepared = prepare(helper)
    assert prepared is not helper
    assert prepared.__name__ == "helper"
    assert prepared.__doc__ == "Docstring."
    assert prepared.__defaults__ == (2,)
    assert prepared.__kwdefaults__ == {"c": 3}
    assert prepare(prepared) is prepared


def test_functions_without_with_are_left_alone() -> None:
    """Nothing to rewrite means the original function object is returned."""

    def plain(x: int) -> int:
        return x + 1

    assert prepare(plain) is plain


def test_durable_rejects_non_functions() -> None:
    """@durable on something that is not a function is a TypeError, at decoration time."""
    with pytest.raises(TypeError, match="plain functions"):
        durable(print)  # type: ignore[type-var]


def _task_with_closure(app: Celery, name: str, bonus: int, ran: Counter[str]) -> Any:
    @app.task(base=DurableTask, name=name, bind=True, max_retries=1)
    def task(self: Any, n: int) -> int:
        with step("add") as s:
            ran[name] += 1
            s.result = n + bonus
        if not self.request.retries:
            raise self.retry(countdown=0)
        return int(s.result)

    return task


def test_a_function_defined_again_is_prepared_once_and_keeps_its_own_closure(
        make_app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same task code defined in two apps (a fixture, an app per test) is read and
    rewritten once, and each copy skips its step on a retry with its own closure's values."""
    from celery_duraflow import _rewrite

    compiled: list[str] = []

    def counting(source: Any, filename: str, *args: Any, **kwargs: Any) -> Any:
        compiled.append(filename)
        return compile(source, filename, *args, **kwargs)

    monkeypatch.setattr(_rewrite, "compile", counting, raising=False)
    ran: Counter[str] = Counter()
    first = _task_with_closure(make_app(), "rewrite.first", 10, ran)
    second = _task_with_closure(make_app(), "rewrite.second", 20, ran)
    assert first.apply(args=(1,)).get() == 11
    assert second.apply(args=(1,)).get() == 21
    assert ran == {"rewrite.first": 1, "rewrite.second": 1}  # each step body ran once
    assert compiled.count(__file__) <= 1  # the second definition reused the first's rewrite
