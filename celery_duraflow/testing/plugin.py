"""The pytest plugin: fixtures for testing durable tasks, and nothing else.

Registered through the ``pytest11`` entry point, so installing the package is
enough (``-p no:duraflow`` turns it off). It adds one command-line option and
one ini key, and its fixtures; it has no autouse fixture and no hook that
touches tests that do not ask for a fixture of it.

* ``duraflow_app``: the Celery app under test. Override it in ``conftest.py``
  to return your app. By default it is the ``celery_app`` fixture when the
  test uses that one (``celery.contrib.pytest``), else Celery's current app.
* ``duraflow_database_url``: where test stores live. None (the default): a
  new SQLite file per test. Otherwise ``--duraflow-database-url``, the ini
  key ``duraflow_database_url`` or the environment variable
  ``DURAFLOW_TEST_DATABASE_URL``, in that order of precedence; each test gets
  tables under a prefix of its own there, dropped after it.
* ``duraflow_eager``: True (the default) makes the app eager for the test.
* ``duraflow_tables``: the test's own tables, which atomic steps write: None
  (the default), or SQLAlchemy ``MetaData``, a function given a ``Connection``,
  or a list of these. Override it to have ``duraflow_store`` create them in the
  test's database after its own tables (and drop MetaData tables with them).
* ``duraflow_store``: the test's own empty store (:class:`DuraflowStore`).
* ``duraflow_clock``: the library's clock for the test (:class:`DuraflowClock`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from celery import current_app

from .._atomic import UserTables
from ._clock_fixture import DuraflowClock, controlled_clock
from ._store_fixture import DuraflowStore, isolated_store

#: The environment variable naming the database for test stores (a CI job sets it).
DATABASE_URL_VARIABLE = "DURAFLOW_TEST_DATABASE_URL"


def pytest_addoption(parser: pytest.Parser) -> None:
    help_text = ("database for the test stores of the duraflow_store fixture (PostgreSQL, "
                 "say): each test gets tables under a new prefix there, dropped after it. "
                 f"Default: ${DATABASE_URL_VARIABLE}, else a new SQLite file per test.")
    group = parser.getgroup("duraflow", "celery-duraflow test stores")
    group.addoption("--duraflow-database-url", dest="duraflow_database_url", default=None,
                    metavar="URL", help=help_text)
    parser.addini("duraflow_database_url", help=help_text, default="")


@pytest.fixture(scope="session")
def duraflow_database_url(pytestconfig: pytest.Config) -> str | None:
    """The database test stores go to, or None for a new SQLite file per test."""
    for value in (pytestconfig.getoption("duraflow_database_url"),
                  pytestconfig.getini("duraflow_database_url"),
                  os.environ.get(DATABASE_URL_VARIABLE)):
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


@pytest.fixture
def duraflow_app(request: pytest.FixtureRequest) -> Any:
    """The Celery app under test: override this fixture to return your own app.

    Default: the ``celery_app`` fixture if the test uses it, else Celery's
    current app (the last one created or set current).
    """
    if "celery_app" in request.fixturenames:
        return request.getfixturevalue("celery_app")
    return current_app._get_current_object()


@pytest.fixture
def duraflow_eager() -> bool:
    """Whether ``duraflow_store`` makes the app eager; override it (or parametrize it) to
    False to leave tasks to a worker."""
    return True


@pytest.fixture
def duraflow_tables() -> UserTables:
    """The test's own tables, which its atomic steps write: override this fixture to
    return SQLAlchemy ``MetaData``, a function taking a ``Connection``, or a list of
    these; ``duraflow_store`` creates them in the test's database. None by default."""
    return None


@pytest.fixture
def duraflow_store(duraflow_app: Any, duraflow_database_url: str | None, duraflow_eager: bool,
                   duraflow_tables: UserTables,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[DuraflowStore]:
    """An empty store of this test's own, used by ``duraflow_app`` for the test, with the
    test's own tables (``duraflow_tables``) created beside it."""
    directory = tmp_path_factory.mktemp("duraflow") if duraflow_database_url is None else None
    with isolated_store(duraflow_app, database_url=duraflow_database_url, directory=directory,
                        eager=duraflow_eager, tables=duraflow_tables) as store:
        yield store


@pytest.fixture
def duraflow_clock(duraflow_store: DuraflowStore) -> Iterator[DuraflowClock]:
    """The library's clock for this test: still until advanced, then sweeping what fell due."""
    with controlled_clock(duraflow_store) as clock:
        yield clock
