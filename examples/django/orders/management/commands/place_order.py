"""``python manage.py place_order``: save a checkout and queue its durable order task."""

import uuid
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from ...checkout import start_checkout


class Command(BaseCommand):
    help = "Save a checkout and queue the durable place_order task once it is committed."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--reference", default=None,
                            help="the checkout's unique reference (default: a new one)")
        parser.add_argument("--customer", default="ada@example.com")
        parser.add_argument("--item", default="mechanical keyboard")
        parser.add_argument("--amount-cents", type=int, default=12_900)

    def handle(self, *args: Any, **options: Any) -> None:
        reference = options["reference"] or f"co-{uuid.uuid4().hex[:12]}"
        checkout = start_checkout(reference=reference, customer=options["customer"],
                                  item=options["item"], amount_cents=options["amount_cents"])
        self.stdout.write(
            f"checkout {checkout.reference} saved (id {checkout.pk}); place_order was sent "
            "with delay_on_commit() when its transaction committed")
