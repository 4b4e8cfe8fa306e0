"""The Django migrations of the store's schema: each applies the library's own.

The library numbers its schema versions and records them in its own table
(``<prefix>schema``, see ``celery_duraflow._schema``). ``manage.py migrate``
brings the schema up through that same history, under the same lock, so a
database migrated by Django, by a worker's ``duraflow_auto_migrate`` or by
``celery duraflow migrate`` is one and the same. Each schema version the
library adds gets one Django migration, ``NNNN_schema_v<version>``.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

from ..._db import Database
from ..._schema import LATEST_VERSION
from ...errors import ConfigurationError
from . import conf


def _forwards(version: int) -> Any:
    def apply_schema(apps: Any, schema_editor: Any) -> None:
        alias = schema_editor.connection.alias
        config = conf.store_config()
        if config.django_alias != alias:
            # Django runs every migration on every alias it migrates: the store's
            # tables belong on the store's alias only.
            return
        if version > LATEST_VERSION:  # pragma: no cover - a migration from a newer release
            raise ConfigurationError(
                f"the Django migration for celery-duraflow schema version {version} runs with "
                f"a release that knows versions up to {LATEST_VERSION}: upgrade "
                "celery-duraflow.")
        database = Database(config)
        try:
            # The library's migrations bring the schema to the newest version this release
            # knows (at least ``version``), each once, under the prefix's migration lock.
            database.migrate()
        finally:
            database.close()

    apply_schema.__qualname__ = apply_schema.__name__ = f"apply_schema_v{version}"
    return apply_schema


def schema_operation(version: int) -> Any:
    """The operation of the Django migration for the library's schema ``version``.

    It is a no-op on every alias but the store's, and unapplying it leaves the
    tables and their rows alone (the library has no down migrations; drop the
    tables yourself to remove them).
    """
    operation = migrations.RunPython(_forwards(version), migrations.RunPython.noop,
                                     hints={"duraflow_schema_version": version})
    return operation


def schema_version_of(operation: Any) -> int | None:
    """The schema version a migration's operation applies (None for other operations)."""
    hints = getattr(operation, "hints", None) or {}
    version = hints.get("duraflow_schema_version")
    return int(version) if version is not None else None
