"""The durable order task, found by ``app.autodiscover_tasks()``."""

from celery import shared_task

from celery_duraflow import DurableTask, step

from .models import Checkout, Order
from .payments import PaymentTimeout, charge_card


@shared_task(base=DurableTask, bind=True, name="orders.place_order",
             autoretry_for=(PaymentTimeout,), retry_backoff=True, retry_jitter=False,
             max_retries=3)
def place_order(self, checkout_id: int) -> dict[str, object]:
    """Write the order, charge the card, mark the order paid: each at most once.

    When the payment provider times out, Celery retries the task from the top;
    the steps already completed are replayed from the store instead of running.
    """
    replayed = []  # the steps this attempt took from the store, for the demo's report

    # Atomic: the order row and this step's record commit in one transaction on the
    # `default` database. The order is written once, even if the worker dies here.
    with step("save-order", atomic=True) as s:
        checkout = Checkout.objects.get(pk=checkout_id)
        order = Order.objects.create(checkout=checkout, amount_cents=checkout.amount_cents,
                                     task_id=self.request.id)
        s.result = {"order_id": order.pk, "amount_cents": order.amount_cents}
    if s.cached:
        replayed.append(s.key)
    saved = s.result

    # Not atomic: the payment API is another system. Its idempotency key is the same on
    # every attempt of this step, so the provider charges the card once.
    with step("charge-card") as s:
        s.result = charge_card(order_id=saved["order_id"], amount_cents=saved["amount_cents"],
                               idempotency_key=s.idempotency_key)
    if s.cached:
        replayed.append(s.key)
    charge = s.result

    with step("mark-paid", atomic=True) as s:
        Order.objects.filter(pk=saved["order_id"]).update(status="paid",
                                                         charge_id=charge["charge_id"])
        s.result = True
    if s.cached:
        replayed.append(s.key)

    return {"order_id": saved["order_id"], "charge_id": charge["charge_id"],
            "replayed": replayed}
