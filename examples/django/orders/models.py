"""The shop's tables, and the payment provider's (simulated here, in the same database)."""

from django.db import models


class Checkout(models.Model):
    """What the customer asked for; saved by the `place_order` command, in the same
    transaction that queues the task."""

    reference = models.CharField(max_length=64, unique=True)
    customer = models.CharField(max_length=100)
    item = models.CharField(max_length=200)
    amount_cents = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.reference


class Order(models.Model):
    """The order, written by the task's atomic step: once per checkout (the one-to-one
    link would refuse a second one)."""

    STATUS_CHOICES = (("new", "new"), ("paid", "paid"))

    checkout = models.OneToOneField(Checkout, on_delete=models.PROTECT, related_name="order")
    amount_cents = models.PositiveIntegerField()
    status = models.CharField(max_length=10, choices=STATUS_CHOICES, default="new")
    charge_id = models.CharField(max_length=64, blank=True)
    # The Celery task id of the durable run that wrote it (the admin lists runs by it).
    task_id = models.CharField(max_length=155)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"order {self.pk} ({self.status})"


class Charge(models.Model):
    """A card charge, as the simulated payment provider records it: one per idempotency
    key, however often a request with that key arrives (``requests`` counts them)."""

    idempotency_key = models.CharField(max_length=200, unique=True)
    order_id = models.BigIntegerField()
    amount_cents = models.PositiveIntegerField()
    requests = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"ch_{self.pk}"
