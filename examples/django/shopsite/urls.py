"""The shop's URLs: the Django admin, where orders, charges and durable runs are listed."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
