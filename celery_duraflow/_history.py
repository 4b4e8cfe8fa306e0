"""A run's history as a file: ``celery duraflow export TASK_ID > run.json``.

The format is JSON, versioned by the two keys every file starts with::

    {
      "format": "celery-duraflow/run-history",
      "version": 1,
      "exported_at": "2026-12-03T19:55:00+00:00",
      "run":     {...the run's row: task_id, task_name, status, attempts, args, result,
                  serializer, error, timestamps, retries, wait_kind, waiting_for,
                  wake_at, parent_id, code_fingerprint...},
      "wait":    {"kind": "signal", "waiting_for": "approval", "wake_at": null} | null,
      "steps":   [{...one step's row: key, status, attempts, output, serializer, error,
                   started_at, completed_at, position, input_fingerprint,
                   code_fingerprint, body_exit, returned}, ...],
      "signals": [{"name", "payload", "serializer", "sent_at"}, ...]
    }

Stored values (arguments, step outputs, results, signal payloads) are kept exactly as
the store holds them, as text in the serializer the row names, so a history replays
the same bytes a live attempt would decode; timestamps are ISO 8601 in UTC. Steps are
listed in the order they were first started; waits that were reached are steps too
(their outputs say what they waited for), and ``wait`` is what the run waits for now.

Reading a file checks its format and version first: a file of another format or a
version this release does not know is refused with a :class:`ConfigurationError`
that says which. Nothing in a file selects code: the task is looked up by name in
the app, and values are decoded only with the serializers the app accepts.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from . import _clock
from ._config import app_and_config
from ._records import RunRecord, SignalRecord, StepRecord, as_utc
from ._store import Store, store_for
from .errors import ConfigurationError, RunNotFound

FORMAT = "celery-duraflow/run-history"
VERSION = 1
# Run fields a history leaves out: the lease belongs to a live attempt, and routing to
# the deployment the run came from.
_RUN_PRIVATE = ("lease_owner", "lease_expires_at", "exchange", "routing_key", "priority")


@dataclass(frozen=True)
class History:
    """A run with its steps and signals, from the store or from a history file."""

    run: RunRecord
    steps: dict[str, StepRecord]
    signals: list[SignalRecord]


def history_of(store: Store, task_id: str) -> History:
    """The run ``task_id`` as the store holds it; RunNotFound if there is none."""
    run = store.get_run(task_id)
    if run is None:
        raise RunNotFound(f"no run with task id {task_id} is recorded (or it was pruned); "
                          "check the id.", task_id=task_id)
    return History(run, store.load_steps(task_id), store.list_signals(task_id))


def export_history(task_id: str, *, app: Any = None) -> str:
    """The run ``task_id`` of ``app``'s store (Celery's current app by default) as the text
    of a history file; :class:`~celery_duraflow.RunNotFound` if there is no such run."""
    _app, config = app_and_config(app)
    return dumps(history_of(store_for(config), task_id))


def _plain(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def to_document(history: History) -> dict[str, Any]:
    """The JSON-ready document of a history (see the module's docstring)."""
    run = {k: _plain(v) for k, v in dataclasses.asdict(history.run).items()
           if k not in _RUN_PRIVATE}
    wait = None
    if history.run.wait_kind is not None:
        wait = {"kind": history.run.wait_kind, "waiting_for": history.run.waiting_for,
                "wake_at": _plain(history.run.wake_at)}
    steps = sorted(history.steps.values(),
                   key=lambda s: (s.started_at, s.position or 0, s.key))
    return {
        "format": FORMAT,
        "version": VERSION,
        "exported_at": _clock.now().isoformat(),
        "run": run,
        "wait": wait,
        "steps": [{k: _plain(v) for k, v in dataclasses.asdict(step).items()
                   if k != "task_id"} for step in steps],
        "signals": [{k: _plain(v) for k, v in dataclasses.asdict(signal).items()
                     if k != "task_id"} for signal in history.signals],
    }


def dumps(history: History) -> str:
    """The history as the text of a history file."""
    return json.dumps(to_document(history), indent=2, ensure_ascii=False) + "\n"


def _time(value: Any, where: str) -> datetime | None:
    if value is None:
        return None
    try:
        return as_utc(datetime.fromisoformat(str(value)))
    except ValueError:
        raise ConfigurationError(f"{where} is not an ISO 8601 time: {value!r}") from None


def _record(cls: type[Any], data: Any, where: str, **fixed: Any) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigurationError(f"{where} must be an object, got {type(data).__name__}")
    values: dict[str, Any] = dict(fixed)
    for item in dataclasses.fields(cls):
        if item.name in values:
            continue
        if item.name in data:
            value = data[item.name]
            if item.name.endswith("_at"):
                value = _time(value, f"{where}.{item.name}")
            values[item.name] = value
        elif item.default is dataclasses.MISSING:
            raise ConfigurationError(f"{where} has no {item.name!r}")
    return cls(**values)


def from_document(document: Any, source: str = "the history") -> History:
    """A history from a parsed file; ConfigurationError if it is not one this release reads."""
    if not isinstance(document, Mapping) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, Mapping) else None
        raise ConfigurationError(
            f"{source} is not a celery-duraflow run history (its format is {found!r}, "
            f"expected {FORMAT!r}); write one with `celery -A proj duraflow export TASK_ID`.")
    version = document.get("version")
    if version != VERSION:
        raise ConfigurationError(
            f"{source} is a run history of format version {version!r}; this release of "
            f"celery-duraflow reads version {VERSION}. Export the run again with this "
            "release, or check it with the release that wrote it.")
    run = _record(RunRecord, document.get("run"), f"{source}: run")
    steps_data = document.get("steps") or []
    signals_data = document.get("signals") or []
    if not isinstance(steps_data, list) or not isinstance(signals_data, list):
        raise ConfigurationError(f"{source}: 'steps' and 'signals' must be lists")
    steps: dict[str, StepRecord] = {}
    for n, data in enumerate(steps_data):
        step = _record(StepRecord, data, f"{source}: steps[{n}]", task_id=run.task_id)
        steps[step.key] = step
    signals = [_record(SignalRecord, data, f"{source}: signals[{n}]", task_id=run.task_id)
               for n, data in enumerate(signals_data)]
    return History(run, steps, signals)


def load(path: str | Path) -> History:
    """Read a history file; ConfigurationError naming the file if it cannot be used."""
    source = str(path)
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigurationError(f"cannot read the run history {source}: {exc}") from None
    except ValueError as exc:
        raise ConfigurationError(f"{source} is not JSON: {exc}") from None
    return from_document(document, source)
