"""Eager chains give each link its own task id, as a worker does.

Celery's eager ``chain.apply`` passes the chain's options, the chain's frozen task id
among them, to every link, so all links of an eager chain run under one id. For plain
tasks that only makes the intermediate results share an id; for durable tasks one id is
one run, so the second link would find the first one's record (and fail with
RunArgumentsMismatch, or return the first link's result). On a worker each link has an
id of its own and the chain's id belongs to its last task: the wrapper below makes the
eager path do the same, for chains with a durable link.
"""

from __future__ import annotations

import threading
from typing import Any

_installed = False
_lock = threading.Lock()


def _has_durable_link(chain: Any, durable: type) -> bool:
    for link in chain.tasks:
        try:
            task = link.type
        except Exception:  # a group, a chord, a signature of an unknown task
            continue
        if isinstance(task, durable):
            return True
    return False


def install_canvas_fixes(durable: type) -> None:
    """Wrap Celery's eager ``chain.apply`` once per process; ``durable`` is DurableTask."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        from celery.canvas import _chain

        original = _chain.apply

        def apply(self: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
            task_id = options.get("task_id") or self.options.get("task_id")
            if task_id is None or len(self.tasks) < 2 or not _has_durable_link(self, durable):
                return original(self, args, kwargs, **options)
            options = {key: value for key, value in options.items() if key != "task_id"}
            clone = self.clone()
            clone.options.pop("task_id", None)
            links = [link.clone() for link in clone.tasks]
            # The chain's id is its last task's, as when the chain is frozen for a worker;
            # the other links keep the ids they were frozen with, or get new ones.
            links[-1].set(task_id=task_id)
            clone.tasks = links
            return original(clone, args, kwargs, **options)

        apply.__wrapped__ = original  # type: ignore[attr-defined]
        apply.__doc__ = original.__doc__
        _chain.apply = apply
        _installed = True
