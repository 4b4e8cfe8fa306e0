"""Configuration, read once per app from ``app.conf`` and the environment."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ._db import URL, parse_database_url
from .contrib.django import _alias as django_alias
from .errors import ConfigurationError

DEFAULT_DATABASE_URL = "sqlite:///duraflow.sqlite3"
DEFAULT_TABLE_PREFIX = "duraflow_"
DEFAULT_SERIALIZER = "json"
DEFAULT_LEASE_SECONDS = 30.0
DEFAULT_ETA_THRESHOLD = 60.0
# How long a store that cannot be reached is waited out (re-sending the task with
# backoff) before the task fails with StoreUnavailable.
DEFAULT_STORE_OUTAGE_TIMEOUT = 300.0
# How many times the sweep may send a run again after its owner was lost (a worker that
# died, a retry message that never came) before it fails the run instead.
DEFAULT_MAX_RECOVERIES = 5

_PREFIX_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,39}$")

# The attribute under which the parsed config is cached on the Celery app.
_CACHE_ATTR = "_duraflow_config"
# Next to it, for a store on a Django alias: what notices that the alias changed.
_ALIAS_WATCH_ATTR = "_duraflow_alias_watch"

# Every setting there is (``duraflow_<key>`` in app.conf, ``CELERY_DURAFLOW_<KEY>`` with the
# CELERY namespace, ``DURAFLOW_<KEY>`` in the environment). A key not in this list is a
# typo, and a typo must not quietly fall back to a default (the SQLite file, say).
KNOWN_KEYS = (
    "accept_serializers", "auto_migrate", "database", "database_url", "engine_options",
    "eta_threshold", "lease_seconds", "max_recoveries", "on_code_change", "on_divergence",
    "pooler", "serializer", "store_outage_timeout", "table_prefix",
)
# What stands between the workers and PostgreSQL (``duraflow_pooler``): "auto" finds out
# at each new connection (a pooler gives its clients backend process ids of its own);
# "none" (or "session", a session pooler: one server connection per client connection)
# keeps server-side prepared statements; "transaction" (PgBouncer's transaction pooling,
# where consecutive transactions of one client may run on different server connections)
# turns them off. Statement pooling cannot work: migrations and atomic steps need
# transactions of several statements.
POOLERS = ("auto", "none", "session", "transaction")
# Settings of the Django app (celery_duraflow.contrib.django) alone, read from Django's
# settings as ``DURAFLOW_<KEY>`` or ``CELERY_DURAFLOW_<KEY>``: ``celery_app`` names the
# Celery app of the admin's actions. A Django project's Celery app, configured from those
# settings, sees them too and accepts them; any other Celery app and the environment
# refuse them, since nothing there reads them.
DJANGO_KEYS = ("celery_app",)
# Environment variables read besides the settings: the web view's token, and the model of
# the example project's agent demo (``python -m example_project --pydantic-ai``). Then the
# prefixes left to test suites and benchmarks (this project's own use them).
_OTHER_ENVIRONMENT = ("DURAFLOW_WEB_TOKEN", "DURAFLOW_DEMO_MODEL")
_RESERVED_ENVIRONMENT = ("DURAFLOW_TEST_", "DURAFLOW_BENCH_", "DURAFLOW_REQUIRE_")
# Settings that only make sense as Python objects, not as environment strings.
_NOT_FROM_ENVIRONMENT = ("engine_options",)


@dataclass(frozen=True)
class Config:
    """The ``duraflow_*`` settings of one Celery app, validated."""

    database_url: URL
    table_prefix: str = DEFAULT_TABLE_PREFIX
    serializer: str = DEFAULT_SERIALIZER
    engine_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    auto_migrate: bool = True
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    eta_threshold: float = DEFAULT_ETA_THRESHOLD
    # What a replay does when the code no longer matches the record: "fail" or "warn".
    on_divergence: str = "fail"
    on_code_change: str = "warn"
    store_outage_timeout: float = DEFAULT_STORE_OUTAGE_TIMEOUT
    # Serializer names a stored row may carry besides ``serializer``: rows written with
    # them are read; a row naming anything else is unreadable. Nothing is imported
    # because a row names it.
    accept_serializers: tuple[str, ...] = ()
    max_recoveries: int = DEFAULT_MAX_RECOVERIES
    # The Django database alias the store's URL was built from (``duraflow_database``,
    # or ``default`` for a Django project's app); None when the URL was given as one.
    django_alias: str | None = None
    pooler: str = "auto"


def _pooler(value: Any) -> str:
    if value is None:
        return "auto"
    if isinstance(value, str) and value.strip().lower() in POOLERS:
        return value.strip().lower()
    raise ConfigurationError(
        f"duraflow_pooler must be one of {', '.join(repr(p) for p in POOLERS)}, got {value!r}: "
        "'transaction' when PostgreSQL is reached through PgBouncer in transaction "
        "pooling mode, 'none' for a direct connection or a session pooler, "
        "'auto' to let the store find out.")


def _as_count(value: Any, key: str, default: int) -> int:
    """A whole number of at least 0, from a setting or an environment string."""
    if value is None:
        return default
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ConfigurationError(f"{key} must be a whole number of at least 0, got {value!r}.")


def _policy(value: Any, key: str, default: str) -> str:
    if value is None:
        return default
    if isinstance(value, str) and value.strip().lower() in ("fail", "warn"):
        return value.strip().lower()
    raise ConfigurationError(f"{key} must be 'fail' or 'warn', got {value!r}.")


def _setting(conf: Any, key: str, env: Mapping[str, str] | None = None) -> Any:
    """Read ``duraflow_<key>`` from app.conf (also under the CELERY_ namespace), then
    ``DURAFLOW_<KEY>`` from the environment."""
    for name in (f"duraflow_{key}", f"DURAFLOW_{key.upper()}", f"CELERY_DURAFLOW_{key.upper()}"):
        try:
            value = conf.get(name)
        except Exception:  # pragma: no cover - exotic conf objects
            value = getattr(conf, name, None)
        if value is not None:
            return value
    if env is not None and key not in _NOT_FROM_ENVIRONMENT:
        return env.get(f"DURAFLOW_{key.upper()}")
    return None


def _suggest(key: str, written: str) -> str:
    """' Did you mean ...?', the closest known key spelled like ``written`` (its prefix)."""
    close = difflib.get_close_matches(key, KNOWN_KEYS, n=1, cutoff=0.6)
    if not close:
        return ""
    prefix = written[: len(written) - len(key)]
    suggestion = prefix + (close[0].upper() if written.isupper() else close[0])
    return f" Did you mean {suggestion}?"


def check_keys(conf: Any, env: Mapping[str, str], *, django_project: bool = False) -> None:
    """Refuse ``duraflow_*`` settings and ``DURAFLOW_*`` variables that do not exist.

    A misspelled ``duraflow_databse_url`` would otherwise leave every worker
    quietly on its own SQLite file. The Django app's own settings
    (:data:`DJANGO_KEYS`) are accepted in a Django project's configuration
    (``django_project``) and refused everywhere else, where nothing reads them.
    """
    try:
        names = [str(name) for name in conf]
    except Exception:  # pragma: no cover - exotic conf objects
        names = []
    for name in names:
        lowered = name.lower()
        for prefix in ("celery_duraflow_", "duraflow_"):
            if lowered.startswith(prefix):
                key = lowered.removeprefix(prefix)
                if key in DJANGO_KEYS and not django_project:
                    raise ConfigurationError(
                        f"{name} is a setting of the Django app ({django_alias.APP_NAME}), "
                        "read from Django's settings as "
                        f"DURAFLOW_{key.upper()}; this Celery app is not configured from "
                        "the settings of a Django project that installs that app, so nothing "
                        "would read it. Move it to settings.py, or remove it.")
                if key not in KNOWN_KEYS and key not in DJANGO_KEYS:
                    raise ConfigurationError(
                        f"{name} is not a celery-duraflow setting.{_suggest(key, name)} The "
                        f"settings are duraflow_{', duraflow_'.join(KNOWN_KEYS)}.")
                break
    for name in env:
        if not name.startswith("DURAFLOW_") or name in _OTHER_ENVIRONMENT or name.startswith(
                _RESERVED_ENVIRONMENT):
            continue
        key = name.removeprefix("DURAFLOW_").lower()
        if key in DJANGO_KEYS:
            raise ConfigurationError(
                f"the environment variable {name} is not read: DURAFLOW_{key.upper()} is a "
                f"setting of the Django app ({django_alias.APP_NAME}), read from Django's "
                "settings only. Set it in settings.py.")
        if key in _NOT_FROM_ENVIRONMENT:
            raise ConfigurationError(
                f"the environment variable {name} cannot set duraflow_{key}: set it in the "
                "Celery configuration (app.conf), as a dict.")
        if key not in KNOWN_KEYS:
            known = [f"DURAFLOW_{k.upper()}" for k in KNOWN_KEYS if k not in _NOT_FROM_ENVIRONMENT]
            raise ConfigurationError(
                f"the environment variable {name} is not a celery-duraflow setting."
                f"{_suggest(key, name)} The variables are {', '.join(known)} and "
                f"{', '.join(_OTHER_ENVIRONMENT)}.")


def _as_float(value: Any, key: str, default: float, *, minimum: float) -> float:
    if value is None:
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{key} must be a number of seconds, got {value!r}.") from None
    if not number >= minimum:
        raise ConfigurationError(f"{key} must be at least {minimum}, got {value!r}.")
    return number


def _as_bool(value: Any, key: str, default: bool) -> bool:
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"{key} must be True or False, got {value!r}.")


def _store_database(conf: Any, env: Mapping[str, str], django_project: bool
                    ) -> tuple[URL, str | None, Mapping[str, Any]]:
    """The store's URL, the Django alias it came from, and driver arguments from the alias.

    ``duraflow_database_url`` wins over ``duraflow_database`` (an alias) where both are
    set; the app's configuration wins over the environment; a Django project's app
    (``django_project``) with neither falls back to the ``default`` alias, anything
    else to the embedded SQLite file.
    """
    for source in (conf, None):
        if source is None:
            raw_url = env.get("DURAFLOW_DATABASE_URL")
            alias = env.get("DURAFLOW_DATABASE")
        else:
            raw_url = _setting(source, "database_url")
            alias = _setting(source, "database")
        if raw_url is not None:
            return parse_database_url(raw_url), None, {}
        if alias is not None:
            break
    else:
        if not django_project:
            return parse_database_url(DEFAULT_DATABASE_URL), None, {}
        alias = "default"
    store = django_alias.resolve(alias)
    return store.url, str(alias).strip(), store.connect_args


def load_config(conf: Any, environ: Mapping[str, str] | None = None, *,
                django_project: bool = False) -> Config:
    """Build a :class:`Config` from a Celery ``app.conf`` (or any mapping).

    Each setting is read from app.conf, then from ``DURAFLOW_<KEY>`` in the
    environment, then its default. Unknown keys are refused (:func:`check_keys`).
    ``django_project``: the app is a Django project's (see
    :func:`celery_duraflow.contrib.django._alias.is_django_project_app`), so with no
    database set the store is Django's ``default`` alias, whose schema
    ``manage.py migrate`` keeps (``duraflow_auto_migrate`` is then off unless set).
    """
    env = os.environ if environ is None else environ
    check_keys(conf, env, django_project=django_project)

    url, alias, alias_connect_args = _store_database(conf, env, django_project)

    prefix = _setting(conf, "table_prefix", env)
    if prefix is None:
        prefix = DEFAULT_TABLE_PREFIX
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ConfigurationError(
            f"duraflow_table_prefix = {prefix!r} is not allowed: use 1 to 40 letters, digits and "
            "underscores, starting with a letter or underscore (for example 'duraflow_')."
        )

    serializer = _setting(conf, "serializer", env) or DEFAULT_SERIALIZER
    if not isinstance(serializer, str):
        raise ConfigurationError(
            f"duraflow_serializer must be 'json', 'pickle' or a dotted path, got {serializer!r}."
        )

    options = _setting(conf, "engine_options", env) or {}
    if not isinstance(options, Mapping):
        raise ConfigurationError(
            f"duraflow_engine_options must be a dict of create_engine() arguments, got {options!r}."
        )
    if alias_connect_args:
        # Driver arguments of the alias's OPTIONS that a URL cannot carry; the ones
        # given in duraflow_engine_options win.
        options = {**options, "connect_args": {**alias_connect_args,
                                               **dict(options.get("connect_args") or {})}}

    accept = _setting(conf, "accept_serializers", env)
    if accept is None:
        accept = ()
    elif isinstance(accept, str):
        accept = tuple(name.strip() for name in accept.split(",") if name.strip())
    if not isinstance(accept, list | tuple | set | frozenset) or not all(
            isinstance(name, str) and name for name in accept):
        raise ConfigurationError(
            "duraflow_accept_serializers must be a list of serializer names (such as "
            f"['json', 'pickle']), got {accept!r}.")

    return Config(
        database_url=url,
        table_prefix=prefix,
        serializer=serializer,
        engine_options=MappingProxyType(dict(options)),
        # On a Django alias the schema is manage.py migrate's to create and upgrade.
        auto_migrate=_as_bool(_setting(conf, "auto_migrate", env), "duraflow_auto_migrate",
                              alias is None),
        lease_seconds=_as_float(_setting(conf, "lease_seconds", env), "duraflow_lease_seconds",
                                DEFAULT_LEASE_SECONDS, minimum=1.0),
        eta_threshold=_as_float(_setting(conf, "eta_threshold", env), "duraflow_eta_threshold",
                                DEFAULT_ETA_THRESHOLD, minimum=0.0),
        on_divergence=_policy(_setting(conf, "on_divergence", env), "duraflow_on_divergence",
                              "fail"),
        on_code_change=_policy(_setting(conf, "on_code_change", env), "duraflow_on_code_change",
                               "warn"),
        store_outage_timeout=_as_float(
            _setting(conf, "store_outage_timeout", env), "duraflow_store_outage_timeout",
            DEFAULT_STORE_OUTAGE_TIMEOUT, minimum=0.0),
        accept_serializers=tuple(sorted(set(accept))),
        max_recoveries=_as_count(_setting(conf, "max_recoveries", env),
                                 "duraflow_max_recoveries", DEFAULT_MAX_RECOVERIES),
        django_alias=alias,
        pooler=_pooler(_setting(conf, "pooler", env)),
    )


def config_for_app(app: Any) -> Config:
    """The app's :class:`Config`, parsed on first use and cached on the app.

    A store on a Django alias is built again when the alias's settings changed
    since (a test runner gives the alias its test database's name once it has
    created it), so that it always reaches the database Django uses.
    """
    cached: Config | None = getattr(app, _CACHE_ATTR, None)
    if cached is not None and (cached.django_alias is None
                               or not getattr(app, _ALIAS_WATCH_ATTR).changed()):
        return cached
    cached = load_config(app.conf, django_project=django_alias.is_django_project_app(app))
    if cached.django_alias is not None:
        setattr(app, _ALIAS_WATCH_ATTR, django_alias.AliasWatch(cached.django_alias))
    setattr(app, _CACHE_ATTR, cached)
    return cached


def app_and_config(app: Any) -> tuple[Any, Config]:
    """The given Celery app (Celery's current app when None) and its :class:`Config`."""
    if app is None:
        from celery import current_app

        app = current_app
    return app, config_for_app(app)
