"""tests/file_order.py: the order xdist hands out test files (longest first, a file's tests in
their own order) and the cost table `make test-costs` writes."""

import json
from types import SimpleNamespace

from tests import file_order


def items(*nodeids: str) -> list:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_files_go_longest_first_and_keep_their_tests_in_order():
    got = file_order.longest_first(
        items("a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "new.py::t1", "b.py::t2"),
        {"a.py": 3.0, "b.py": 50.0, "c.py": 1.0},
    )
    assert [i.nodeid for i in got] == [
        "b.py::t1",
        "b.py::t2",
        "new.py::t1",
        "a.py::t1",
        "a.py::t2",
        "c.py::t1",
    ]  # fmt: skip  (new.py: unmeasured, counted as UNMEASURED_S = 10 s)
    unmeasured = file_order.longest_first(items("y.py::t", "x.py::t"), {})
    assert [i.nodeid for i in unmeasured] == ["y.py::t", "x.py::t"]  # ties: collection order


def test_the_recorder_sums_each_files_phases_and_adds_them_to_the_table(tmp_path):
    table = tmp_path / "costs.json"
    table.write_text(json.dumps({"old.py": 7.0, "a.py": 99.0}))
    rec = file_order.CostRecorder(table)
    for nodeid, seconds in (
        ("a.py::t1", 1.25),
        ("a.py::t1", 2.0),
        ("a.py::t2", 0.5),
        ("b.py::t", 4),
    ):
        rec.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds))
    rec.pytest_sessionfinish()
    # a.py held 99 s from the other suite: a file with tests in both gets both suites' seconds
    assert json.loads(table.read_text()) == {"a.py": 102.8, "b.py": 4.0, "old.py": 7.0}
    assert file_order.load_costs(table) == {"a.py": 102.8, "b.py": 4.0, "old.py": 7.0}


def test_a_missing_or_broken_table_leaves_pytests_order(tmp_path):
    assert file_order.load_costs(tmp_path / "absent.json") == {}
    (tmp_path / "bad.json").write_text("{not json")
    assert file_order.load_costs(tmp_path / "bad.json") == {}
    (tmp_path / "list.json").write_text("[1, 2]")
    assert file_order.load_costs(tmp_path / "list.json") == {}
