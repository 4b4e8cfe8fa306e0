"""Starting an order: what a view or a command of the shop calls."""

from django.db import transaction

from .models import Checkout
from .tasks import place_order


def start_checkout(*, reference: str, customer: str, item: str, amount_cents: int) -> Checkout:
    """Save the checkout and queue ``place_order`` for it once the save has committed.

    ``delay_on_commit()`` sends the task only when the transaction commits, so a
    worker never looks for a checkout that is not there yet, and nothing is sent
    when the transaction rolls back.
    """
    with transaction.atomic():
        checkout = Checkout.objects.create(reference=reference, customer=customer, item=item,
                                           amount_cents=amount_cents)
        place_order.delay_on_commit(checkout.pk)
    return checkout
