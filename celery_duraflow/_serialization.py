"""Turning step outputs into text for the store, and back.

JSON is the default, through kombu's encoder, so ``datetime``, ``date``,
``time``, ``Decimal``, ``UUID`` and ``bytes`` survive the round trip. Pickle is
only used when ``duraflow_serializer = "pickle"`` asks for it, because loading
a pickle runs code chosen by whoever could write to the table. Any other value
is a dotted path to an object with ``dumps(obj) -> str`` and ``loads(str)``.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib
import pickle
from typing import Any, Protocol

from kombu.utils import json as kombu_json

from .errors import ConfigurationError


class Serializer(Protocol):
    """What a custom ``duraflow_serializer`` object must provide."""

    def dumps(self, obj: Any) -> str: ...

    def loads(self, data: str) -> Any: ...


class JSONSerializer:
    """kombu's JSON with its type markers; refuses what JSON cannot hold."""

    def dumps(self, obj: Any) -> str:
        # allow_nan=False: NaN and infinity are not JSON and other readers choke on them.
        return str(kombu_json.dumps(obj, allow_nan=False, separators=(",", ":")))  # type: ignore[no-untyped-call]

    def loads(self, data: str) -> Any:
        return kombu_json.loads(data)  # type: ignore[no-untyped-call]


class PickleSerializer:
    """Pickle, base64-armoured so that it fits the same text column."""

    def dumps(self, obj: Any) -> str:
        return base64.b64encode(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")

    def loads(self, data: str) -> Any:
        return pickle.loads(base64.b64decode(data))  # only when configured: see module docstring


_BUILTIN: dict[str, type[JSONSerializer] | type[PickleSerializer]] = {
    "json": JSONSerializer,
    "pickle": PickleSerializer,
}


@functools.cache
def get_serializer(name: str) -> Serializer:
    """Resolve ``duraflow_serializer`` to an object with ``dumps``/``loads``."""
    builtin = _BUILTIN.get(name)
    if builtin is not None:
        return builtin()
    module_name, _, attr = name.rpartition(".")
    if not module_name:
        raise ConfigurationError(
            f"duraflow_serializer = {name!r} is unknown: use 'json' (the default), 'pickle', "
            "or a dotted path such as 'myproject.serializers.MySerializer'."
        )
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(
            f"duraflow_serializer = {name!r} could not be imported ({exc}). Check the dotted path."
        ) from None
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as exc:
            raise ConfigurationError(
                f"duraflow_serializer = {name!r} is a class that cannot be built without "
                f"arguments ({exc}). Point it at an instance or a class with a no-argument "
                "constructor."
            ) from None
    if not (callable(getattr(obj, "dumps", None)) and callable(getattr(obj, "loads", None))):
        raise ConfigurationError(
            f"duraflow_serializer = {name!r} has no dumps()/loads(): a serializer must provide "
            "dumps(obj) -> str and loads(str) -> obj."
        )
    serializer: Serializer = obj
    return serializer


def decode(data: str | None, stored_with: str | None, configured: str, *, task_id: str,
           step_key: str | None) -> Any:
    """Load a stored value, with the serializer it was written with.

    A pickled value is only loaded when pickle is the configured serializer,
    so a row written by someone else cannot make a JSON deployment unpickle.
    """
    from .errors import DuraflowError

    if data is None:
        return None
    name = stored_with or configured
    if name == "pickle" and configured != "pickle":
        raise ConfigurationError(
            f"step {step_key!r} of task {task_id} was stored with pickle, but "
            f"duraflow_serializer is {configured!r}. Set duraflow_serializer = 'pickle' to read "
            "it, or retry the run from that step so that it is stored again.",
            task_id=task_id,
            step_key=step_key,
        )
    try:
        return get_serializer(name).loads(data)
    except DuraflowError:
        raise
    except Exception as exc:
        raise ConfigurationError(
            f"the stored output of step {step_key!r} of task {task_id} could not be read with "
            f"the {name!r} serializer ({exc}). Check duraflow_serializer.",
            task_id=task_id,
            step_key=step_key,
        ) from exc


def encode_arguments(args: Any, kwargs: Any,
                     serializer: Serializer) -> tuple[str | None, str | None]:
    """A task's arguments as stored text, and their fingerprint.

    The fingerprint is a SHA-256 of canonical JSON (sorted keys, tuples and
    lists alike), so the same arguments match whether they came through a
    broker or an eager call. Arguments JSON cannot hold are fingerprinted
    through the configured serializer; if that fails too there is none.
    """
    payload = {"args": list(args), "kwargs": dict(kwargs)}
    try:
        blob: str | None = serializer.dumps(payload)
    except Exception:
        blob = None
    canonical: str | None
    try:
        canonical = str(kombu_json.dumps(payload, sort_keys=True,  # type: ignore[no-untyped-call]
                                         separators=(",", ":")))
    except Exception:
        canonical = blob
    if canonical is None:
        return blob, None
    return blob, hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def fingerprint(value: Any, serializer: Serializer) -> str:
    """A stable hash of a value: SHA-256 of its canonical JSON (sorted keys).

    Values JSON cannot hold are hashed through the configured serializer; a
    value neither can write gets the hash of its ``repr``.
    """
    try:
        canonical = str(kombu_json.dumps(value, sort_keys=True,  # type: ignore[no-untyped-call]
                                         separators=(",", ":")))
    except Exception:
        try:
            canonical = serializer.dumps(value)
        except Exception:
            canonical = repr(value)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
