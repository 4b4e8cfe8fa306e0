"""Values the store cannot hold: deep nesting, sets, NaN, objects (issue 12, findings 5, 6).

Error messages about such values must be built without recursing without
bound, must say where in the value the refused part sits, and arguments the
configured serializer refuses must stop the run before anything is recorded.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_duraflow import DurableTask, get_run, step
from celery_duraflow._config import config_for_app
from celery_duraflow._context import describe
from celery_duraflow._serialization import encode_arguments, find_unstorable, get_serializer
from celery_duraflow._store import store_for
from celery_duraflow.errors import RunArgumentsMismatch, RunArgumentsNotSerializable
from tests.conftest import run_worker

DEEP = 5000


@dataclasses.dataclass
class Flight:
    """A user object: only pickle can store it (module level, so pickle can find it)."""

    number: str = "LH123"


class Opaque:
    """An object neither JSON nor a dotted-path lookup knows."""


def deep_list(depth: int, bottom: Any = None) -> Any:
    value: Any = [] if bottom is None else [bottom]
    for _ in range(depth - 1):
        value = [value]
    return value


def deep_dict(depth: int, bottom: Any) -> Any:
    value: Any = {"leaf": bottom}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


# describe()

def test_describe_deep_list_is_short() -> None:
    """describe() of a list nested 5000 deep returns a short line instead of RecursionError."""
    text = describe(deep_list(DEEP))
    assert text.startswith("list [")
    assert len(text) <= 200
    assert "\n" not in text


def test_describe_deep_dict_with_set_is_short() -> None:
    """describe() of a dict nested 5000 deep with a set at the bottom returns a short line."""
    text = describe(deep_dict(DEEP, {1, 2}))
    assert text.startswith("dict {")
    assert len(text) <= 200


def test_describe_keeps_its_shape_and_limit() -> None:
    """describe() still gives 'TypeName repr' on one line, cut at the limit."""
    assert describe({1, 2}) == "set {1, 2}"
    assert describe("x" * 1000, limit=50).endswith("...")
    assert len(describe("x" * 1000, limit=50)) == 50
    assert describe(Opaque()).startswith("Opaque <")


def test_describe_survives_a_broken_repr() -> None:
    """describe() never raises, even when the value's own __repr__ does."""

    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no repr for you")

    assert describe(Broken()).startswith("Broken")
    assert describe(10 ** 5000).startswith("int ")


# find_unstorable()

JSON = get_serializer("json")


def test_find_unstorable_in_nested_dict_list_tuple() -> None:
    """find_unstorable names the path through dicts, lists and tuples and the refused type."""
    value = {"flights": [1, 2, 3, Flight()]}
    assert find_unstorable(value, JSON) == ('result["flights"][3]', "Flight")
    value2 = {"a": ({"b": [0, {7: {1, 2}}]},)}
    assert find_unstorable(value2, JSON) == ('result["a"][0]["b"][1][7]', "set")
    assert find_unstorable([Opaque()], JSON, root="args[1]") == ("args[1][0]", "Opaque")


def test_find_unstorable_nan() -> None:
    """A NaN under JSON is found, and the type says it is a NaN."""
    assert find_unstorable({"price": math.nan}, JSON) == ('result["price"]', "float (nan)")
    assert find_unstorable([math.inf], JSON) == ("result[0]", "float (inf)")


def test_find_unstorable_set_and_object_at_the_top() -> None:
    """A refused value at the root is reported as the root itself."""
    assert find_unstorable({1, 2}, JSON) == ("result", "set")
    assert find_unstorable(Opaque(), JSON, root="kwargs[\"when\"]") == ('kwargs["when"]',
                                                                          "Opaque")


def test_find_unstorable_dict_key() -> None:
    """A dict key JSON refuses (a tuple) is named as a key."""
    assert find_unstorable({"m": {(1, 2): "x"}}, JSON) == ('result["m"][(1, 2)]',
                                                            "tuple (as a dict key)")


def test_find_unstorable_storable_value_is_none() -> None:
    """A value the serializer can store has no refused part: None."""
    assert find_unstorable({"a": [1, 2, {"b": None}]}, JSON) is None


def test_find_unstorable_deep_set_at_bottom() -> None:
    """A 5000-deep value with a set at the bottom is answered as too deep, no RecursionError."""
    found = find_unstorable(deep_dict(DEEP, {1}), JSON)
    assert found is not None
    path, kind = found
    assert kind.startswith("dict") and "deep" in kind
    assert path.startswith('result["a"]["a"]')
    assert len(path) < 300
    found_list = find_unstorable(deep_list(DEEP, {1}), JSON)
    assert found_list is not None
    assert "deep" in found_list[1]


def test_find_unstorable_moderately_deep_set() -> None:
    """A set 300 levels down is found and its long path is shortened."""
    found = find_unstorable(deep_list(300, {1}), JSON)
    assert found is not None
    path, kind = found
    assert kind == "set"
    assert path.startswith("result[0][0]") and path.endswith("[0]")
    assert "levels" in path and len(path) < 200


def test_find_unstorable_cycle() -> None:
    """A list that contains itself is named, not walked forever."""
    looped: list[Any] = [1]
    looped.append(looped)
    found = find_unstorable({"x": looped}, JSON)
    assert found is not None
    assert found[0] == 'result["x"][1]'
    assert "itself" in found[1]


def test_find_unstorable_never_raises() -> None:
    """A serializer that breaks in odd ways makes find_unstorable say None, not raise."""

    class Hostile:
        def dumps(self, obj: Any) -> str:
            raise RuntimeError("always")

        def loads(self, data: str) -> Any:
            raise RuntimeError("always")

    class Shifty(dict):  # type: ignore[type-arg]
        def items(self) -> Any:
            raise RuntimeError("no items")

    assert find_unstorable([1, 2], Hostile()) == ("result[0]", "int")
    assert find_unstorable(Shifty(a=1), JSON) is None


# encode_arguments()

def test_encode_arguments_always_fingerprints() -> None:
    """Arguments the serializer stores always get a fingerprint, JSON or not."""
    blob, fingerprint = encode_arguments((1, "x"), {"when": None}, JSON)
    assert blob and fingerprint
    pickled = get_serializer("pickle")
    blob, fingerprint = encode_arguments((Flight(),), {}, pickled)
    assert blob and fingerprint
    assert fingerprint != encode_arguments((Flight("BA9"),), {}, pickled)[1]
    assert fingerprint == encode_arguments([Flight()], {}, pickled)[1]


@pytest.mark.parametrize(("args", "kwargs", "where", "what"), [
    ((1, {2, 3}), {}, "args[1]", "set"),
    ((), {"when": {"price": math.nan}}, 'kwargs["when"]["price"]', "float (nan)"),
    ((Opaque(),), {}, "args[0]", "Opaque"),
])
def test_encode_arguments_refuses(args: Any, kwargs: Any, where: str, what: str) -> None:
    """encode_arguments refuses what the serializer cannot store, naming task, argument, why."""
    with pytest.raises(RunArgumentsNotSerializable) as info:
        encode_arguments(args, kwargs, JSON, task_id="tid-1", task_name="travel.book",
                         serializer_name="json")
    message = str(info.value)
    assert "tid-1" in message and "travel.book" in message
    assert where in message and what in message
    assert "duraflow_serializer" in message
    assert info.value.task_id == "tid-1"


def test_encode_arguments_nan_is_refused_not_fingerprinted() -> None:
    """A NaN never slips through to the fingerprint: the JSON serializer refuses it."""
    with pytest.raises(RunArgumentsNotSerializable, match="args\\[0\\]"):
        encode_arguments((math.nan,), {}, JSON)


# Tasks

def _counting_task(app: Celery, calls: Counter[str]) -> Any:
    @app.task(base=DurableTask, name="unstorable.book")
    def book(flight: Any, when: Any = None) -> str:
        calls["body"] += 1
        with step("book") as s:
            calls["book"] += 1
            s.result = "booked"
        return str(s.result)

    return book


@pytest.mark.parametrize(("args", "kwargs", "where"), [
    (({1, 2},), {}, "args[0]"),
    ((math.nan,), {}, "args[0]"),
    (("LH123",), {"when": {1}}, 'kwargs["when"]'),
])
def test_task_with_unstorable_argument_is_refused(make_app: Callable[..., Celery], args: Any,
                                                  kwargs: Any, where: str) -> None:
    """A run whose arguments JSON cannot store is refused before any step, leaving no row."""
    app = make_app()
    calls: Counter[str] = Counter()
    task = _counting_task(app, calls)
    task_id = str(uuid.uuid4())
    result = task.apply(args=args, kwargs=kwargs, task_id=task_id)
    assert isinstance(result.result, RunArgumentsNotSerializable)
    message = str(result.result)
    assert task_id in message and "unstorable.book" in message and where in message
    assert calls["body"] == 0 and calls["book"] == 0
    assert get_run(task_id, app=app) is None


def test_task_with_object_argument_under_pickle_task_serializer(
        make_app: Callable[..., Celery]) -> None:
    """An object passed under Celery's pickle task serializer is refused by JSON storage."""
    app = make_app(task_serializer="pickle", accept_content=["pickle", "json"])
    calls: Counter[str] = Counter()
    task = _counting_task(app, calls)
    task_id = str(uuid.uuid4())
    result = task.apply(args=(Flight(),), task_id=task_id)
    assert isinstance(result.result, RunArgumentsNotSerializable)
    assert task_id in str(result.result) and "args[0]" in str(result.result)
    assert "Flight" in str(result.result)
    assert calls["body"] == 0
    assert get_run(task_id, app=app) is None


def test_object_argument_stored_with_pickle_and_mismatch_detected(
        make_app: Callable[..., Celery]) -> None:
    """With duraflow_serializer='pickle' an object argument is stored and fingerprinted."""
    app = make_app(task_serializer="pickle", accept_content=["pickle", "json"],
                   duraflow_serializer="pickle")
    calls: Counter[str] = Counter()
    task = _counting_task(app, calls)
    task_id = str(uuid.uuid4())
    assert task.apply(args=(Flight(),), task_id=task_id).get() == "booked"

    run = store_for(config_for_app(app)).get_run(task_id)
    assert run is not None
    assert run.args is not None and run.args_fingerprint is not None

    other = task.apply(args=(Flight("BA9"),), task_id=task_id)
    assert isinstance(other.result, RunArgumentsMismatch)
    # The same arguments again get the recorded result; nothing runs twice.
    assert task.apply(args=(Flight(),), task_id=task_id).get() == "booked"
    assert calls == {"body": 1, "book": 1}


@pytest.mark.redis
def test_nan_sent_through_a_broker_is_refused_by_the_worker(
        make_app: Callable[..., Celery], redis_url: str) -> None:
    """Celery's JSON carries a NaN to the worker; the run is refused there, with no row."""
    app = make_app(eager=False, broker=redis_url,
                   task_default_queue=f"q-{uuid.uuid4().hex[:8]}")
    calls: Counter[str] = Counter()
    task = _counting_task(app, calls)
    with run_worker(app, pool="solo"):
        result = task.delay(math.nan)
        with pytest.raises(RunArgumentsNotSerializable) as info:
            result.get(timeout=30)
    assert result.id in str(info.value) and "args[0]" in str(info.value)
    assert calls["body"] == 0
    assert get_run(result.id, app=app) is None


def test_unstorable_output_fails_for_good_and_is_only_run_again_on_purpose(
        make_app: Callable[..., Celery]) -> None:
    """A refused output is never run again by a delivery; retry --from-step runs it again."""
    from celery_duraflow import StepOutputNotSerializable, retry_run
    from tests.conftest import wait_for_status

    app = make_app(eager=False)
    calls: Counter[str] = Counter()
    mode = {"bad": True}

    @app.task(base=DurableTask, autoretry_for=(Exception,), max_retries=2,
              default_retry_delay=0)
    def book() -> Any:
        with step("trip"), step("book") as s:
            calls["book"] += 1
            s.result = {"seats": {1, 2}} if mode["bad"] else {"seats": [1, 2]}
        return s.result

    first = book.apply()
    assert isinstance(first.result, StepOutputNotSerializable)
    assert 'result["seats"] is set' in str(first.result)
    assert calls["book"] == 1
    # The same task id delivered again (a redelivery, a re-send by hand): nothing runs.
    again = book.apply(task_id=first.id)
    assert isinstance(again.result, StepOutputNotSerializable), again.result
    assert "failed for good" in str(again.result) and "--from-step trip/book" in str(again.result)
    assert calls["book"] == 1
    run = get_run(first.id, app=app)
    assert run is not None and run.status == "failed"
    assert [(s.key, s.status, s.attempts) for s in run.steps] == [
        ("trip", "failed", 1), ("trip/book", "failed", 1)]

    mode["bad"] = False  # the operator fixed the code and checked the booking
    with run_worker(app):
        retry_run(first.id, from_step="trip/book", app=app)
        run = wait_for_status(app, first.id, "succeeded")
    assert run.result == {"seats": [1, 2]}
    assert calls["book"] == 2


def test_unstorable_task_result_says_where(make_app: Callable[..., Celery]) -> None:
    """A task result the serializer refuses is named by its place in the value."""
    from celery_duraflow import StepOutputNotSerializable

    app = make_app()

    @app.task(base=DurableTask)
    def report() -> Any:
        return {"rows": [1, {"seen": {2, 3}}]}

    result = report.apply()
    assert isinstance(result.result, StepOutputNotSerializable)
    assert 'result["rows"][1]["seen"] is set' in str(result.result)
    assert result.id in str(result.result)
    run = get_run(result.id, app=app)
    assert run is not None and run.status == "failed"
