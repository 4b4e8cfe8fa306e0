"""A table the test tasks write to from inside steps."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    """One order; ``number`` is unique, so a second write of the same order fails."""

    number = models.CharField(max_length=100, unique=True)
    amount = models.IntegerField(default=0)

    class Meta:
        app_label = "shop"
