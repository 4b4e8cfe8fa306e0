"""Fixtures shared by the Django app's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_duraflow._store import close_all_stores


@pytest.fixture(autouse=True)
def _close_store_connections() -> Iterator[None]:
    """Close the stores' connections after each test: pytest-django drops the test
    databases at the end of the session, which PostgreSQL refuses while one is open."""
    yield
    close_all_stores()
