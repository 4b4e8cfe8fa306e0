"""Entry point of ``python -m benchmarks``."""

from .harness import main

raise SystemExit(main())
