"""Where the Django app finds its settings."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from ..._config import DEFAULT_TABLE_PREFIX, Config, load_config


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


def _duraflow_settings() -> dict[str, Any]:
    """Every ``DURAFLOW_*`` and ``CELERY_DURAFLOW_*`` Django setting, by name."""
    return {name: getattr(settings, name) for name in dir(settings)
            if name.startswith(("DURAFLOW_", "CELERY_DURAFLOW_"))}


def store_config() -> Config:
    """The store's configuration as this Django project's settings describe it.

    What the project's Celery app reads too, when it takes its configuration
    from Django's settings (``app.config_from_object("django.conf:settings",
    namespace="CELERY")``): ``DURAFLOW_DATABASE`` (a ``DATABASES`` alias,
    ``default`` unless set), or ``DURAFLOW_DATABASE_URL``, which wins; the other
    ``DURAFLOW_*`` settings; then the ``DURAFLOW_*`` environment variables.
    ``django_alias`` is None when the store is not on one of the project's aliases.
    """
    return load_config(_duraflow_settings(), django_project=True)
