"""Where the Django app finds its settings."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from ..._config import DEFAULT_TABLE_PREFIX


def _setting(name: str) -> Any:
    """``DURAFLOW_<NAME>``, or ``CELERY_DURAFLOW_<NAME>`` (Celery's ``CELERY`` namespace)."""
    for key in (f"DURAFLOW_{name}", f"CELERY_DURAFLOW_{name}"):
        value = getattr(settings, key, None)
        if value is not None:
            return value
    return None


def store_alias() -> str:
    """The Django database alias the store lives in (``DURAFLOW_DATABASE``, default
    ``"default"``)."""
    alias = _setting("DATABASE")
    return str(alias) if alias is not None else "default"


def table_prefix() -> str:
    """The table prefix of the store (``DURAFLOW_TABLE_PREFIX``)."""
    prefix = _setting("TABLE_PREFIX")
    return str(prefix) if prefix is not None else DEFAULT_TABLE_PREFIX
