"""A stand-in for a payment provider's API: local, deterministic, and idempotent.

Like a real provider, it keeps one charge per idempotency key: a request that
repeats a key gets the charge made the first time, and the card is not charged
again. To show why that matters, the first request for a key always charges
the card and then loses the reply (``PaymentTimeout``): the caller cannot tell
whether it was charged, and must try again with the same key.
"""

from django.db import transaction
from django.db.models import F

from .models import Charge


class PaymentTimeout(Exception):
    """No reply from the payment provider; the charge may or may not have been made."""


def charge_card(*, order_id: int, amount_cents: int, idempotency_key: str) -> dict[str, object]:
    """Charge ``amount_cents`` for ``order_id``, once per ``idempotency_key``."""
    with transaction.atomic():
        charge, created = Charge.objects.get_or_create(
            idempotency_key=idempotency_key,
            defaults={"order_id": order_id, "amount_cents": amount_cents})
        Charge.objects.filter(pk=charge.pk).update(requests=F("requests") + 1)
    if created:
        raise PaymentTimeout(f"no reply from the payment provider for order {order_id} "
                             "(the card was charged, the reply was lost)")
    return {"charge_id": f"ch_{charge.pk}", "amount_cents": charge.amount_cents}
