"""Serializers: kombu JSON by default, pickle only on request, custom by dotted path."""

from __future__ import annotations

import datetime as dt
import decimal
import math
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_duraflow import ConfigurationError, DurableTask, get_run, step
from celery_duraflow._serialization import decode, get_serializer


class Point:
    """A user type that only pickle can store."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and other.x == self.x


class UpperJSON:
    """A custom serializer found through a dotted path."""

    def dumps(self, obj: Any) -> str:
        import json

        return json.dumps(obj).upper()

    def loads(self, data: str) -> Any:
        import json

        return json.loads(data.lower())


@pytest.mark.parametrize("value", [
    {"a": [1, 2.5, None, True]},
    dt.datetime(2026, 12, 2, 10, 0, tzinfo=dt.UTC),
    dt.date(2026, 12, 2),
    dt.time(10, 30),
    decimal.Decimal("0.1"),
    uuid.uuid4(),
    b"\x00\x01\xff",
    "ünïcode",
])
def test_json_round_trips(value: Any) -> None:
    """kombu's JSON keeps the types Celery users pass around."""
    ser = get_serializer("json")
    assert ser.loads(ser.dumps(value)) == value


class Money:
    """A user type taught to kombu's JSON with ``register_type``."""

    def __init__(self, cents: int) -> None:
        self.cents = cents

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Money) and other.cents == self.cents


def test_json_writes_what_kombu_writes_and_keeps_types_registered_later() -> None:
    """The JSON serializer's text is kombu's own (compact, no NaN), and a type registered
    with kombu after the serializer was first used still round-trips."""
    from kombu.utils import json as kombu_json

    ser = get_serializer("json")
    value = {"b": [1, dt.date(2026, 12, 4)], "a": "ü"}
    assert ser.dumps(value) == kombu_json.dumps(value, allow_nan=False, separators=(",", ":"))
    kombu_json.register_type(Money, "test_money", lambda m: m.cents, Money)
    try:
        assert ser.loads(ser.dumps({"price": Money(250)})) == {"price": Money(250)}
        assert ser.loads(b'{"x":1}') == {"x": 1}  # bytes, as some drivers return text
    finally:
        kombu_json._encoders.pop(Money, None)
        kombu_json._decoders.pop("test_money", None)


@pytest.mark.parametrize("value", [{1, 2}, object(), math.nan, Point(1)])
def test_json_refuses(value: Any) -> None:
    """What JSON cannot hold faithfully is refused, not mangled."""
    with pytest.raises((TypeError, ValueError)):
        get_serializer("json").dumps(value)


def test_pickle_when_configured(make_app: Callable[..., Celery]) -> None:
    """duraflow_serializer='pickle' stores arbitrary objects."""
    app = make_app(duraflow_serializer="pickle")

    @app.task(base=DurableTask)
    def task() -> Any:
        with step("point") as s:
            s.result = Point(3)
        return s.result.x

    result = task.apply()
    assert result.get() == 3
    run = get_run(result.id, app=app)
    assert run is not None
    assert run.step("point").result == Point(3)


def test_pickled_rows_are_not_loaded_under_json() -> None:
    """A pickle row is never unpickled by a deployment configured for JSON."""
    data = get_serializer("pickle").dumps(Point(1))
    with pytest.raises(ConfigurationError, match="stored with pickle") as info:
        decode(data, "pickle", "json", task_id="t-1", step_key="k")
    assert info.value.task_id == "t-1"
    assert decode(data, "pickle", "pickle", task_id="t-1", step_key="k") == Point(1)


def test_dotted_path_serializer(make_app: Callable[..., Celery]) -> None:
    """A custom serializer is imported from a dotted path."""
    app = make_app(duraflow_serializer="tests.test_serialization.UpperJSON")

    @app.task(base=DurableTask)
    def task() -> Any:
        with step("s") as s:
            s.result = {"k": "v"}
        return s.result

    assert task.apply().get() == {"k": "v"}


@pytest.mark.parametrize("name", ["yaml-ish", "no.such.module.Thing", "json.nothing_here",
                                  "tests.test_serialization.Point"])
def test_bad_serializer_names(name: str) -> None:
    """Unknown or unusable serializers name the setting."""
    get_serializer.cache_clear()
    with pytest.raises(ConfigurationError, match="duraflow_serializer"):
        get_serializer(name)
