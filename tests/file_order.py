"""Test files handed to the xdist workers longest first, so that no worker is left with a long
file while the others are idle at the end of a run.

pytest-xdist's ``--dist loadfile`` hands out whole files in the order it is given (with
``--no-loadscope-reorder``; its default order is by number of tests, which put the 2-test,
3-minute docs walk last in `make faults`). Here each file's order comes from its measured time,
``tests/file_costs.json`` (seconds per file, setup and teardown included, from a whole `make test`
and `make faults` run on a 2-core machine), so the workers get the longest files first and end
together (the "longest processing time first" rule). A file not yet measured counts as
``UNMEASURED_S``. Only the order of files changes: a file's own tests keep their order.

Refresh the costs after adding or changing a slow file: ``make test-costs`` empties the table,
then runs both suites with ``--file-costs-out``; a file with tests in both suites gets the sum.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

COSTS = Path(__file__).with_name("file_costs.json")
UNMEASURED_S = 10.0  # a new file: about the median of the measured slow ones


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_costs(path: Path = COSTS) -> dict[str, float]:
    """Seconds per test file; {} where the file is missing or unreadable (the order then stays
    pytest's own: nothing fails because of a stale or absent cost table)."""
    try:
        costs = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in costs.items()} if isinstance(costs, dict) else {}


def longest_first(items: list[pytest.Item], costs: dict[str, float]) -> list[pytest.Item]:
    """``items`` grouped by file, the files by cost (descending, ties in collection order), each
    file's tests in their collected order."""
    files: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        files[file_of(item.nodeid)].append(item)
    order = sorted(files, key=lambda f: -costs.get(f, UNMEASURED_S))  # sorted() is stable
    return [item for f in order for item in files[f]]


class CostRecorder:
    """Sums each file's reported setup, call and teardown times (the xdist controller receives
    every worker's reports) and adds them to what ``path`` holds (``make test-costs`` empties it
    first, so a file with tests in both suites gets both suites' seconds)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        if not self.seconds:
            return
        merged = load_costs(self.path)
        for f, seconds in self.seconds.items():
            merged[f] = round(merged.get(f, 0.0) + seconds, 1)
        self.path.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
