"""Entry point of ``python -m examples.django`` (and ``make django-demo``)."""

from .run import main

raise SystemExit(main())
