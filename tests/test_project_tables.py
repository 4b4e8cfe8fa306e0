"""The worker-process tests clean up every table their project (tests/proj) creates."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import PROJECT_TABLES

PROJ = Path(__file__).resolve().parent / "proj"


def test_every_table_of_the_project_is_dropped_after_a_test() -> None:
    """Each table tests/proj names under its prefix is in the list drop_project_tables drops."""
    named = {name for path in PROJ.glob("*.py")
             for name in re.findall(r'f"\{(?:TABLE_PREFIX|prefix)\}(\w+)"', path.read_text())}
    assert named, "no table found: the pattern no longer matches how tests/proj names them"
    assert named <= set(PROJECT_TABLES), sorted(named - set(PROJECT_TABLES))
