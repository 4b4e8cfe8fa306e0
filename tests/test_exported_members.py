"""The public API: what celery_duraflow exports."""

from __future__ import annotations

import celery_duraflow


def test_all_is_sorted_and_complete() -> None:
    """__all__ is sorted, and every name in it exists."""
    names = celery_duraflow.__all__
    assert names == sorted(names)
    for name in names:
        assert hasattr(celery_duraflow, name), name


def test_contract_names_are_exported() -> None:
    """The names of the public contract are importable from the package."""
    for name in ("DurableTask", "step", "StepContext", "durable", "get_run", "DuraflowError",
                 "StepOutputNotSerializable", "NotInDurableTask", "StepNotPrepared",
                 "StoreUnavailable"):
        assert name in celery_duraflow.__all__, name


def test_import_does_no_work() -> None:
    """Importing the package creates no engine and no store."""
    from celery_duraflow import _store

    assert isinstance(_store._stores, dict)
