"""The measured work: a run of N trivial steps, the same shape for every system compared.

``durable_steps(0)`` is the *empty durable task*: the same task, the same code path, no step.
Subtracting its time from ``durable_steps(n)`` leaves what the n steps cost.

:data:`BODIES_RUN` counts the step bodies that really ran in this process, so that a
benchmark can check that a replay ran none of them.
"""

from __future__ import annotations

import time

from celery_duraflow import step

# One counter in a list, so that step bodies can bump it without a `global` statement.
BODIES_RUN = [0]
# Seconds from the first line of the last durable_steps() body to its last line: the
# steps alone, without what happens before and after the task body (for replays).
LAST_BODY = [0.0]


def trivial(i: int) -> int:
    """The body of every step: no I/O, just enough to be counted."""
    BODIES_RUN[0] += 1
    return i


def durable_steps(n: int) -> int:
    """A durable run of ``n`` trivial steps (register it with ``base=DurableTask``)."""
    start = time.perf_counter()
    total = 0
    for i in range(n):
        with step("step") as s:
            s.result = trivial(i)
        total += s.result
    LAST_BODY[0] = time.perf_counter() - start
    return total


def plain_steps(n: int) -> int:
    """The same work as :func:`durable_steps` with no durability at all."""
    total = 0
    for i in range(n):
        total += trivial(i)
    return total


def expected_result(n: int) -> int:
    """What both tasks return for ``n`` steps."""
    return n * (n - 1) // 2
