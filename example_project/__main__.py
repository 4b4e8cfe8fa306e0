"""Entry point of ``python -m example_project`` (and ``make demo``)."""

from .demo import main

raise SystemExit(main())
