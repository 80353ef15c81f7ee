"""utils/import_hooks.py ``run_on_first_use`` (compat fix 18): a deferred module is imported
without running its code; a function imported from it by name runs the code at its first call
and returns what the real function returns; reading any other name runs it too; the code runs
once. On a package written here (its code records each run), so the test needs no process."""

from __future__ import annotations

import sys

import pytest

from torchtitan_speechlm.utils import import_hooks

SLOW = """
import json  # stands for the heavy import the deferral saves
RUNS.append(__name__)


def build(x, *, scale=1):
    return {"built": x * scale, "module": __name__}


class Table:
    rows = 3
"""


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package ``defer_pkg`` whose ``slow`` module appends to ``builtins.RUNS`` when it runs."""
    import builtins

    root = tmp_path / "defer_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "slow.py").write_text(SLOW)
    (root / "user.py").write_text("from defer_pkg.slow import build\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(builtins, "RUNS", [], raising=False)
    yield builtins.RUNS
    for name in [m for m in sys.modules if m == "defer_pkg" or m.startswith("defer_pkg.")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, import_hooks._DeferModule)]


def test_a_function_imported_by_name_runs_the_module_at_its_first_call(package):
    assert import_hooks.run_on_first_use("defer_pkg.slow", ("build",))
    import defer_pkg.user as user

    assert package == []  # imported by name, not run
    assert user.build.__name__ == "build"
    assert user.build(4, scale=2) == {"built": 8, "module": "defer_pkg.slow"}
    assert package == ["defer_pkg.slow"]
    slow = sys.modules["defer_pkg.slow"]
    assert slow.build is not user.build  # the module now holds the real function
    assert slow.build(1) == {"built": 1, "module": "defer_pkg.slow"}
    assert user.build(2) == {"built": 2, "module": "defer_pkg.slow"}
    assert package == ["defer_pkg.slow"]  # once
    assert "__getattr__" not in vars(slow) and slow.__spec__.loader is slow.__loader__
    assert type(slow.__loader__).__name__ == "SourceFileLoader"


def test_any_other_name_read_runs_it_and_a_dunder_probe_does_not(package):
    import_hooks.run_on_first_use("defer_pkg.slow", ("build",))
    import defer_pkg.slow as slow

    assert not hasattr(slow, "__wrapped__") and package == []
    assert slow.Table.rows == 3 and isinstance(slow.Table(), slow.Table)
    assert package == ["defer_pkg.slow"]
    with pytest.raises(AttributeError):
        slow.no_such_name  # noqa: B018


def test_a_module_already_imported_is_left_as_it_is(package):
    import defer_pkg.slow  # noqa: F401

    assert package == ["defer_pkg.slow"]
    assert not import_hooks.run_on_first_use("defer_pkg.slow", ("build",))
    assert not any(isinstance(f, import_hooks._DeferModule) for f in sys.meta_path)
