"""The exception tree: one root, picklable, naming the task and step."""

from __future__ import annotations

import pickle

import pytest

import celery_duraflow
from celery_duraflow import errors

ALL_ERRORS = [getattr(errors, name) for name in errors.__all__]


@pytest.mark.parametrize("cls", ALL_ERRORS)
def test_every_error_derives_from_root(cls: type[Exception]) -> None:
    """Catching DuraflowError catches every error the library raises."""
    assert issubclass(cls, celery_duraflow.DuraflowError)


@pytest.mark.parametrize("cls", ALL_ERRORS)
def test_errors_survive_pickle(cls: type[errors.DuraflowError]) -> None:
    """Celery can carry our errors across processes with their task id and step key."""
    original = cls("something went wrong", task_id="t-1", step_key="book#2")
    copy = pickle.loads(pickle.dumps(original))
    assert type(copy) is cls
    assert str(copy) == "something went wrong"
    assert (copy.task_id, copy.step_key) == ("t-1", "book#2")


def test_tree_in_docstring_lists_every_error() -> None:
    """The module docstring draws every exception class."""
    assert errors.__doc__ is not None
    for cls in ALL_ERRORS:
        assert cls.__name__ in errors.__doc__
