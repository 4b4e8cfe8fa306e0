"""The store's database taken from a Django database alias.

The core reads ``duraflow_database`` through these functions, so this module
imports nothing of Django at import time: Django is imported when an alias is
actually resolved, which only happens in a Django project.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

from ..._db import URL
from ...errors import ConfigurationError

#: The name of the Django app, as it is written in ``INSTALLED_APPS``.
APP_NAME = "celery_duraflow.contrib.django"
#: What Celery's Django guide passes to ``app.config_from_object``.
_SETTINGS_SOURCES = ("django.conf:settings", "django.conf.settings")

# Engines whose vendor is known without importing their backend (and its driver).
_KNOWN_ENGINES = {
    "django.db.backends.postgresql": "postgresql",
    "django.db.backends.postgresql_psycopg2": "postgresql",
    "django.contrib.gis.db.backends.postgis": "postgresql",
    "django.db.backends.sqlite3": "sqlite",
    "django.contrib.gis.db.backends.spatialite": "sqlite",
}
# OPTIONS of a PostgreSQL alias that configure Django's own connections, not the
# connection libpq opens: the store makes its own choices there (it autocommits, and
# prepares the statements of its hot path on the server).
_DJANGO_ONLY_OPTIONS = frozenset({
    "isolation_level", "server_side_binding", "pool", "prepare_threshold", "cursor_factory",
    "context",
})


class AliasStore(NamedTuple):
    """Where an alias's store is: its URL and the driver arguments the URL cannot carry."""

    url: URL
    connect_args: Mapping[str, Any]


def _settings() -> Any:
    """Django's settings, or None when Django is not installed or not configured."""
    try:
        from django.conf import settings
    except ImportError:
        return None
    return settings if settings.configured else None


def is_django_project_app(app: Any) -> bool:
    """True for a Celery app that reads its configuration from Django's settings (as
    Celery's guide for Django shows) in a project that installs this Django app.

    For such an app the store is a Django database alias even when no
    ``duraflow_database`` is set: the ``default`` one.
    """
    source = getattr(app, "_config_source", None)
    if source is None or "django" not in sys.modules:
        return False
    if isinstance(source, str):
        if source not in _SETTINGS_SOURCES:
            return False
    elif not type(source).__module__.startswith("django.conf"):
        return False
    settings = _settings()
    if settings is None:
        return False
    from django.apps import apps

    if apps.ready:
        return bool(apps.is_installed(APP_NAME))
    return any(str(entry) == APP_NAME or str(entry).startswith(APP_NAME + ".apps.")
               for entry in getattr(settings, "INSTALLED_APPS", ()))


def _alias_settings(alias: str, key: str) -> dict[str, Any]:
    settings = _settings()
    if settings is None:
        reason = ("Django is not installed" if _missing_django() else
                  "Django's settings are not configured (set DJANGO_SETTINGS_MODULE)")
        raise ConfigurationError(
            f"{key} = {alias!r} names a Django database alias, but {reason}. Outside a "
            "Django project, set duraflow_database_url instead.")
    databases = getattr(settings, "DATABASES", None) or {}
    if alias not in databases:
        known = ", ".join(repr(name) for name in databases) or "none"
        raise ConfigurationError(
            f"{key} = {alias!r}: there is no database alias {alias!r} in Django's DATABASES "
            f"setting (its aliases: {known}). Name one of them, or add it.")
    return dict(databases[alias])


def _missing_django() -> bool:
    try:
        import django  # noqa: F401
    except ImportError:
        return True
    return False


def _vendor(alias: str, spec: Mapping[str, Any], key: str) -> str:
    engine = str(spec.get("ENGINE") or "")
    vendor = _KNOWN_ENGINES.get(engine)
    if vendor is None and engine:
        try:
            from django.db import connections

            vendor = str(connections[alias].vendor)
        except Exception as exc:
            first_line = (str(exc).strip().splitlines() or [""])[0]
            vendor = f"unknown, its backend failed to load: {type(exc).__name__}: {first_line}"
    if vendor not in ("postgresql", "sqlite"):
        raise ConfigurationError(
            f"{key} = {alias!r}: the Django database alias {alias!r} uses the ENGINE "
            f"{engine!r} (vendor {vendor}), and celery-duraflow stores its runs in PostgreSQL "
            "or SQLite only. Name an alias on PostgreSQL or SQLite, or set "
            "duraflow_database_url.")
    return vendor


def _is_in_memory(name: str) -> bool:
    return name in ("", ":memory:") or "mode=memory" in name


def resolve(alias: Any, *, key: str = "duraflow_database") -> AliasStore:
    """The store's URL (and driver arguments) for the Django database alias ``alias``,
    from ``settings.DATABASES`` as it is now (under a test runner: the test database)."""
    if not isinstance(alias, str) or not alias.strip():
        raise ConfigurationError(
            f"{key} must be the name of a Django database alias (such as 'default'), "
            f"got {alias!r}.")
    alias = alias.strip()
    spec = _alias_settings(alias, key)
    vendor = _vendor(alias, spec, key)
    name = "" if spec.get("NAME") is None else str(spec.get("NAME"))
    if vendor == "sqlite":
        if _is_in_memory(name):
            raise ConfigurationError(
                f"{key} = {alias!r}: the Django database alias {alias!r} is an in-memory "
                "SQLite database, which the store's own connections cannot share. Give it a "
                "file NAME (and, for tests, a file TEST NAME).")
        return AliasStore(URL.create("sqlite", database=name), {})
    options = dict(spec.get("OPTIONS") or {})
    if options.get("assume_role"):
        raise ConfigurationError(
            f"{key} = {alias!r}: the Django database alias {alias!r} sets "
            "OPTIONS['assume_role'], and the store's connections do not switch roles. Set "
            "duraflow_database_url to a login whose tables the store may use.")
    options.pop("assume_role", None)
    query: dict[str, str] = {}
    connect_args: dict[str, Any] = {}
    for option, value in options.items():
        if option in _DJANGO_ONLY_OPTIONS or value is None:
            continue
        if isinstance(value, bool):
            query[option] = "1" if value else "0"
        elif isinstance(value, str | int | float):
            query[option] = str(value)
        else:
            connect_args[option] = value
    host = str(spec.get("HOST") or "") or None
    if host is not None and host.startswith("/"):
        # A Unix socket folder: libpq takes it as the host parameter.
        query.setdefault("host", host)
        host = None
    port = str(spec.get("PORT") or "").strip()
    try:
        port_number = int(port) if port else None
    except ValueError:
        raise ConfigurationError(
            f"{key} = {alias!r}: the Django database alias {alias!r} has PORT {port!r}, "
            "which is not a number.") from None
    url = URL.create(
        "postgresql+psycopg",
        username=str(spec.get("USER") or "") or None,
        password=str(spec.get("PASSWORD") or "") or None,
        host=host,
        port=port_number,
        database=name or None,
        query=query,
    )
    return AliasStore(url, connect_args)


class AliasWatch:
    """Notices that what an alias's store URL was built from has changed: a test runner
    renames the database in the alias's settings once it has created the test database.

    The check runs at the start of every attempt, so it reads the alias's own settings
    dictionary, held here, and nothing else: Django (and pytest-django) change the
    NAME in that dictionary, in place.
    """

    __slots__ = ("spec", "values")

    def __init__(self, alias: str) -> None:
        settings = _settings()
        databases = getattr(settings, "DATABASES", None) if settings is not None else None
        spec = databases.get(alias) if isinstance(databases, dict) else None
        self.spec: dict[str, Any] = spec if isinstance(spec, dict) else {}
        self.values = self._values()

    def _values(self) -> tuple[Any, ...]:
        get = self.spec.get
        return (get("NAME"), get("ENGINE"), get("HOST"), get("PORT"), get("USER"),
                get("PASSWORD"))

    def changed(self) -> bool:
        """True when the alias's settings are no longer those the URL was built from."""
        return self._values() != self.values
