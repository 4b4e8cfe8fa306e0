"""The state of the attempt that is running in this thread (or task)."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._serialization import Serializer
    from ._step import StepContext
    from ._store import StepRecord, Store


@dataclass(eq=False)
class RunContext:
    """One attempt of one run: what the store recorded, and where the code is now."""

    task_id: str
    task_name: str
    owner: str
    store: Store
    serializer: Serializer
    serializer_name: str
    recorded: dict[str, StepRecord]
    # The run was taken over from an owner that died: its first unfinished step is in doubt.
    interrupted: bool = False
    # Whether this attempt has recorded the end of any step yet.
    recorded_any: bool = False
    # Occurrences of each step name, counted within its parent step ("" at the top).
    occurrences: dict[tuple[str, str], int] = field(default_factory=dict)
    # Steps entered and not yet exited, innermost last.
    stack: list[StepContext] = field(default_factory=list)
    # How many steps this attempt has reached so far, nested ones included.
    reached: int = 0

    def next_key(self, name: str) -> str:
        """The key of the next occurrence of ``name`` in the current parent step."""
        parent = self.stack[-1].key if self.stack else ""
        count = self.occurrences.get((parent, name), 0) + 1
        self.occurrences[(parent, name)] = count
        key = name if count == 1 else f"{name}#{count}"
        self.reached += 1
        return f"{parent}/{key}" if parent else key


# Reset in a ``finally`` by DurableTask.__call__: worker pools reuse threads.
current_run: ContextVar[RunContext | None] = ContextVar("celery_duraflow_run", default=None)


def get_current_run() -> RunContext | None:
    """The attempt running in this context, or ``None`` outside a durable task."""
    return current_run.get()


def describe(value: Any, limit: int = 200) -> str:
    """A short, single-line description of a value for error messages."""
    text = f"{type(value).__name__} {value!r}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
