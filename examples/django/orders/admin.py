from django.contrib import admin

from .models import Charge, Checkout, Order


@admin.register(Checkout)
class CheckoutAdmin(admin.ModelAdmin):
    list_display = ("reference", "customer", "item", "amount_cents", "created_at")


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ("id", "checkout", "amount_cents", "status", "charge_id", "task_id")


@admin.register(Charge)
class ChargeAdmin(admin.ModelAdmin):
    list_display = ("id", "order_id", "amount_cents", "requests", "idempotency_key")
