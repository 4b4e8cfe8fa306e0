"""The store's schema version 15: fan-out joins.

A child run started by ``children()`` records the step key of its parent's join,
with indexes of the joins' open children and of the parents waiting on a join.
Applies the library's own migration on the store's alias.
"""

from django.db import migrations, models

from celery_duraflow.contrib.django._migrate import schema_operation


class Migration(migrations.Migration):
    # As in 0001: the library's migrations take their own lock and transactions.
    atomic = False

    dependencies = [
        ('duraflow', '0004_schema_v14'),
    ]

    operations = [
        schema_operation(15),
        # The runs table's new column, in the unmanaged model's state (no SQL of its own).
        migrations.AddField(model_name="run", name="join_key",
                            field=models.CharField(max_length=1024, null=True)),
    ]
