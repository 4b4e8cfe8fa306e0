"""The orders app's tables: checkouts, orders, and the simulated payment provider's charges."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
    ]

    operations = [
        migrations.CreateModel(
            name='Charge',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('idempotency_key', models.CharField(max_length=200, unique=True)),
                ('order_id', models.BigIntegerField()),
                ('amount_cents', models.PositiveIntegerField()),
                ('requests', models.PositiveIntegerField(default=0)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
            ],
        ),
        migrations.CreateModel(
            name='Checkout',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('reference', models.CharField(max_length=64, unique=True)),
                ('customer', models.CharField(max_length=100)),
                ('item', models.CharField(max_length=200)),
                ('amount_cents', models.PositiveIntegerField()),
                ('created_at', models.DateTimeField(auto_now_add=True)),
            ],
        ),
        migrations.CreateModel(
            name='Order',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('amount_cents', models.PositiveIntegerField()),
                ('status', models.CharField(choices=[('new', 'new'), ('paid', 'paid')], default='new', max_length=10)),
                ('charge_id', models.CharField(blank=True, max_length=64)),
                ('task_id', models.CharField(max_length=155)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('checkout', models.OneToOneField(on_delete=django.db.models.deletion.PROTECT, related_name='order', to='orders.checkout')),
            ],
        ),
    ]
