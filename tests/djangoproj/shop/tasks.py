"""Durable tasks of the shop, found by the project's Celery app (``autodiscover_tasks``)."""

from __future__ import annotations

from celery import shared_task

from celery_duraflow import DurableTask, step

from .models import Order


@shared_task(base=DurableTask, name="shop.confirm_order")
def confirm_order(number: str) -> int:
    """Add 1 to an order's amount, once per run; the order must be committed already."""
    with step("load-order") as s:
        s.result = Order.objects.get(number=number).amount
    amount: int = s.result
    with step("confirm") as s:
        s.result = Order.objects.filter(number=number).update(amount=amount + 1)
    return amount + 1


@shared_task(base=DurableTask, name="shop.ping")
def ping(token: str) -> str:
    """A run with one step; the tests send it after others to know those were handled."""
    with step("pong") as s:
        s.result = token
    result: str = s.result
    return result
