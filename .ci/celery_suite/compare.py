"""Compare two JUnit XML reports of Celery's own tests: plain task class vs DurableTask.

Usage: python compare.py PLAIN.xml DURABLE.xml ALLOWED.txt [TITLE]

Prints the counts per test file for both runs and exits 1 if a test that passed with
the plain class fails (or errors, or is missing) with DurableTask and is not on the
allow-list. An allow-list entry that no longer fails is reported too (and fails the run),
so the list only ever names tests that really need it. Tests that fail with the plain
class are listed as a warning (the baseline is not green, so they compare nothing) but
do not fail the run. Exits 2 if a report is missing or unreadable.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

# When one node id appears more than once in a report (subtests, reruns), the worst wins.
_RANK = {"skipped": 0, "passed": 1, "failed": 2}


def node_id(case: ET.Element) -> str:
    """The pytest node id of a JUnit testcase.

    classname t.unit.tasks.test_tasks.test_task_retries and name test_x give
    t/unit/tasks/test_tasks.py::test_task_retries::test_x.
    """
    parts = case.get("classname", "").split(".")
    index = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
    path = "/".join(parts[:index + 1]) + ".py"
    return "::".join([path, *parts[index + 1:], case.get("name", "")])


def outcomes(report: str) -> tuple[dict[str, str], dict[str, str]]:
    """Map each test's node id to passed, failed or skipped; and failed ones to a message."""
    found: dict[str, str] = {}
    messages: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        node = node_id(case)
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            outcome = "failed"
            text = (problem.get("message") or problem.text or "").strip()
            messages.setdefault(node, " ".join(text.split())[:160])
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        if _RANK[outcome] >= _RANK[found.get(node, "skipped")]:
            found[node] = outcome
    return found, messages


def allowed(listing: str) -> set[str]:
    """The allow-list: one node id per line; '#' starts a comment (the reason)."""
    entries = set()
    for line in Path(listing).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            entries.add(line)
    return entries


def main(plain_xml: str, durable_xml: str, listing: str, title: str = "") -> int:
    try:
        plain, plain_messages = outcomes(plain_xml)
        durable, durable_messages = outcomes(durable_xml)
    except (OSError, ET.ParseError) as exc:
        print(f"{title or 'compare'}: cannot read a report: {exc}")
        return 2
    allow = allowed(listing)
    counts: dict[str, Counter[str]] = {}
    for name, runs in (("plain", plain), ("durable", durable)):
        for node, outcome in runs.items():
            counts.setdefault(node.split("::")[0], Counter())[f"{name} {outcome}"] += 1
    if title:
        print(f"--- {title}")
    print(f"{'file':45} {'plain pass/fail/skip':>22} {'durable pass/fail/skip':>24}")
    for path in sorted(counts):
        c = counts[path]
        plain_cell = f"{c['plain passed']}/{c['plain failed']}/{c['plain skipped']}"
        durable_cell = f"{c['durable passed']}/{c['durable failed']}/{c['durable skipped']}"
        print(f"{path:45} {plain_cell:>22} {durable_cell:>24}")
    cell = "{passed}/{failed}/{skipped}"
    print(f"{'total':45} {cell.format_map(Counter(plain.values())):>22} "
          f"{cell.format_map(Counter(durable.values())):>24}")

    baseline = sorted(node for node, outcome in plain.items() if outcome == "failed")
    regressions = sorted(node for node, outcome in plain.items()
                         if outcome == "passed" and durable.get(node) != "passed"
                         and node not in allow)
    allowed_failing = sorted(node for node in allow if durable.get(node) == "failed")
    stale = sorted(node for node in allow if durable.get(node) != "failed")
    for node in baseline:
        print(f"  WARNING: fails with the plain class too (compares nothing): {node}: "
              f"{plain_messages.get(node, '')}")
    print(f"allow-listed and failing with DurableTask: {len(allowed_failing)}")
    for node in allowed_failing:
        print(f"  allowed: {node}")
    for node in stale:
        print(f"  STALE allow-list entry (does not fail with DurableTask): {node}")
    for node in regressions:
        outcome = durable.get(node, "missing")
        detail = durable_messages.get(node, "")
        print(f"  REGRESSION: {node} ({outcome} with DurableTask){': ' + detail if detail else ''}")
    print(f"regressions outside the allow-list: {len(regressions)}"
          f"{', stale allow-list entries: ' + str(len(stale)) if stale else ''}")
    return 1 if regressions or stale else 0


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:5]))
