"""Test your durable tasks with pytest: a store of each test's own, and a clock to move.

The pytest plugin (``celery_duraflow.testing.plugin``, registered on install)
offers the fixtures ``duraflow_app``, ``duraflow_store``, ``duraflow_clock``,
``duraflow_eager`` and ``duraflow_database_url``; nothing happens to a test
that uses none of them. The same tools work without pytest::

    with isolated_store(app, directory=tmp) as store, controlled_clock(store) as clock:
        run = store.start(book_trip, 1, "LIS")
        clock.advance(days=1)

See the how-to "Test your own durable tasks" in the documentation.
"""

from ._clock_fixture import DuraflowClock, controlled_clock
from ._history import assert_replays
from ._store_fixture import DuraflowStore, isolated_store

__all__ = ["DuraflowClock", "DuraflowStore", "assert_replays", "controlled_clock",
           "isolated_store"]
