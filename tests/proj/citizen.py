"""Tasks that use the rest of Celery's task API: retry with new arguments, replace,
result objects as return values, retry(throw=False), time limits, Ignore and Reject.

Every side effect is a row in the project's charge ledger (``charge_card``), labelled
with what did it, so a test can count exactly how often each body ran.
"""

from __future__ import annotations

import hashlib
from typing import Any

from celery import group
from celery.exceptions import Ignore, Reject

from celery_duraflow import DurableTask, step

from . import ledger
from .app import app


def _charge(task_id: str, label: str, key: str) -> int:
    charge = ledger.charge_card(task_id, label, {"code": label, "price_cents": 100}, key)
    return int(charge["charge_id"])


@app.task(base=DurableTask, bind=True, name="proj.paginate")
def paginate(self: DurableTask, cursor: int, pages: int) -> list[int]:
    """Charge once per page, moving the cursor on with retry(args=...) (documented Celery).

    The step's key names the cursor: a step keyed "page" alone would be answered from
    the first page's record on every retry.
    """
    with step(f"page-{cursor}") as s:
        s.result = _charge(self.request.id, f"page-{cursor}", s.idempotency_key)
    if cursor + 1 < pages:
        raise self.retry(args=(cursor + 1, pages), countdown=0)
    return list(range(pages))


@app.task(base=DurableTask, bind=True, name="proj.replacement")
def replacement(self: DurableTask, label: str) -> dict[str, Any]:
    """A durable replacement with the same step key as the task it replaces."""
    with step("charge") as s:
        s.result = _charge(self.request.id, f"{label}-replacement", s.idempotency_key)
    return {"replacement_charge": s.result}


@app.task(name="proj.plain_echo")
def plain_echo(value: Any) -> Any:
    """A plain Celery task."""
    return value


@app.task(base=DurableTask, bind=True, name="proj.replaced")
def replaced(self: DurableTask, label: str, by: str) -> Any:
    """Charge, then hand the rest of the work to another task (Task.replace)."""
    with step("charge") as s:
        s.result = _charge(self.request.id, f"{label}-replaced", s.idempotency_key)
    if by == "durable":
        return self.replace(replacement.s(label))
    if by == "plain":
        return self.replace(plain_echo.s({"plain": label}))
    return self.replace(group(plain_echo.s(1), replacement.s(label)))


@app.task(name="proj.after")
def after(value: Any) -> Any:
    """The link after a replaced task in a chain."""
    return {"after": value}


@app.task(base=DurableTask, bind=True, name="proj.fan_out")
def fan_out(self: DurableTask, label: str) -> Any:
    """Return what group().apply_async() returns (a GroupResult), as Celery code does."""
    with step("charge") as s:
        s.result = _charge(self.request.id, label, s.idempotency_key)
    return group(plain_echo.s(1), plain_echo.s(2)).apply_async()


class Receipt:
    """An object no serializer knows."""


@app.task(base=DurableTask, bind=True, name="proj.fire_and_forget", ignore_result=True)
def fire_and_forget(self: DurableTask, label: str) -> Receipt:
    """A task whose result nobody keeps returns an object no serializer knows."""
    with step("charge") as s:
        s.result = _charge(self.request.id, label, s.idempotency_key)
    return Receipt()


@app.task(base=DurableTask, bind=True, name="proj.retry_without_throw")
def retry_without_throw(self: DurableTask, label: str) -> str:
    """retry(throw=False), then return: Celery runs the retry all the same."""
    with step("charge") as s:
        s.result = _charge(self.request.id, label, s.idempotency_key)
    _charge(self.request.id, f"{label}-body", f"body-{self.request.retries}")
    if not self.request.retries:
        self.retry(countdown=1, throw=False)
        return "asked for a retry"
    return "retried"


@app.task(base=DurableTask, bind=True, name="proj.stuck", time_limit=2)
def stuck(self: DurableTask, label: str) -> str:
    """Charge, then hang in a C call until the hard time limit kills the attempt.

    The key derivation holds the interpreter in C for minutes, so the SIGTERM that
    billiard sends first cannot raise in Python before the SIGKILL that follows it.
    """
    _charge(self.request.id, f"{label}-body", "body")
    with step("charge") as s:
        s.result = _charge(self.request.id, label, s.idempotency_key)
    hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 10**9)
    return "never"


@app.task(base=DurableTask, bind=True, name="proj.ignores")
def ignores(self: DurableTask, label: str) -> str:
    """Charge, then tell Celery to ignore the task (Ignore)."""
    with step("charge") as s:
        s.result = _charge(self.request.id, label, s.idempotency_key)
    raise Ignore()


@app.task(base=DurableTask, bind=True, name="proj.rejects")
def rejects(self: DurableTask, label: str) -> str:
    """Charge, then reject the message without requeueing it."""
    with step("charge") as s:
        s.result = _charge(self.request.id, label, s.idempotency_key)
    raise Reject("not for us", requeue=False)
