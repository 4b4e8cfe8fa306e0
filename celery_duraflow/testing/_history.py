"""Replaying exported runs in tests: will this code carry on the runs recorded in production?

A history file (``celery -A proj duraflow export TASK_ID > run.json``) holds a run's
recorded steps. Checking it needs no database: the task's current code is replayed
against the file, recorded bodies are skipped, and the check stops where a live
attempt would carry on.
"""

from __future__ import annotations

import os
from typing import Any

from .._replay import ReplayResult, check_history


def assert_replays(history: str | os.PathLike[str], *, app: Any = None) -> ReplayResult:
    """Check an exported run against ``app``'s current code; AssertionError unless compatible.

    Returns the :class:`~celery_duraflow.ReplayResult` of a compatible run (its
    ``stopped_at`` says where a live attempt would carry on).
    """
    result = check_history(os.fspath(history), app=app)
    if not result.compatible:
        where = (f" at position {result.position}: the run recorded {result.recorded_key!r} "
                 f"there, the code now reaches {result.reached_key!r}"
                 if result.verdict == "divergent" else "")
        raise AssertionError(
            f"the current code does not replay run {result.task_id} ({result.task_name}) from "
            f"{os.fspath(history)}: {result.verdict}{where}. {result.message}")
    return result
