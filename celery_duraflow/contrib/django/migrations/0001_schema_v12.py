"""The store's schema up to version 12: the tables of runs, steps and signals.

Applies the library's own numbered migrations on the store's alias (and does
nothing on the others). A database the library already migrated is left as
it is.
"""

from django.db import migrations

from celery_duraflow.contrib.django._migrate import schema_operation


class Migration(migrations.Migration):
    # The library's migrations take their own lock and transactions, on the store's own
    # connections; a transaction of Django's around them would only hold a second
    # connection open.
    atomic = False

    initial = True

    dependencies: list[tuple[str, str]] = []

    operations = [
        schema_operation(12),
    ]
