"""Print the node ids of the integration subset, one a line, for Celery's source tree.

Usage: python select_integration.py CELERY_SOURCE_DIR

The subset is all of ``t/integration/test_tasks.py`` and the tests of
``t/integration/test_canvas.py`` that use a task calling ``self.replace(...)`` (the tasks
are found in ``t/integration/tasks.py``), because replacing a task is where DurableTask
does most beyond Celery. Read from the source rather than listed by hand, so the subset
follows the installed Celery version. Tests that cannot pass here even with the plain
task class are taken out with ``deselect_integration.txt`` (given to pytest as
``--deselect``), not here.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def replacing_tasks(tasks_py: Path) -> set[str]:
    """Names of the functions in tasks.py whose body calls ``self.replace(...)``."""
    names = set()
    for fn in ast.walk(ast.parse(tasks_py.read_text())):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "replace" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "self"):
                names.add(fn.name)
    return names


def _names_used(node: ast.AST) -> set[str]:
    used = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            used.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            used.add(sub.attr)
    return used


def tests_using(test_py: Path, names: set[str]) -> list[str]:
    """Test functions and methods (decorators included) that mention one of ``names``."""
    found = []
    for top in ast.parse(test_py.read_text()).body:
        if isinstance(top, ast.ClassDef) and top.name.startswith("test"):
            for fn in top.body:
                if (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test")
                        and _names_used(fn) & names):
                    found.append(f"{top.name}::{fn.name}")
        elif (isinstance(top, ast.FunctionDef) and top.name.startswith("test")
              and _names_used(top) & names):
            found.append(top.name)
    return found


def main(source: str) -> int:
    root = Path(source)
    names = replacing_tasks(root / "t/integration/tasks.py")
    if not names:
        print("no task in t/integration/tasks.py calls self.replace", file=sys.stderr)
        return 1
    canvas = tests_using(root / "t/integration/test_canvas.py", names)
    if not canvas:
        print("no test in t/integration/test_canvas.py uses a replacing task", file=sys.stderr)
        return 1
    print(f"replacing tasks: {', '.join(sorted(names))}; {len(canvas)} canvas tests use them",
          file=sys.stderr)
    print("t/integration/test_tasks.py")
    for node in canvas:
        print(f"t/integration/test_canvas.py::{node}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
