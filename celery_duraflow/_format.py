"""Showing recorded values and durations to people (the CLI and the web view)."""

from __future__ import annotations

import base64
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID


def span(elapsed: timedelta | None) -> str:
    """A duration for people: ``85ms``, ``4.2s``, ``3m05s``, ``2h10m``, ``3d4h``; ``-`` for none."""
    if elapsed is None:
        return "-"
    seconds = elapsed.total_seconds()
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86_400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86_400}d{whole % 86_400 // 3600}h"


def json_default(value: Any) -> Any:
    """What ``json.dumps`` writes for the values kombu's JSON stores and JSON has no type for."""
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    if isinstance(value, Decimal | UUID):
        return str(value)
    return repr(value)
