"""A small Django shop whose order task is durable: ``python -m examples.django``.

The Django project itself lives in this folder the way ``django-admin startproject``
lays one out (``manage.py``, the ``shopsite`` project package, the ``orders`` app),
so it is imported with this folder on ``sys.path``, as ``shopsite`` and ``orders``.
``run.py`` is the one command that migrates it, places an order and reports.
"""
