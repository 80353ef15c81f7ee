"""One numbering for the workarounds and their upstream forms: utils/compat.py's fix N, the
patches/000N-* file(s), patches/README.md's row N and the upstream tests (tests/upstream/)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from tests.upstream.test_each_fix import FIXES
from torchtitan_speechlm.utils import compat

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "patches"


def compat_entries() -> dict[int, str]:
    """Fix number -> its paragraph in compat's docstring."""
    doc = compat.__doc__
    starts = list(re.finditer(r"^(\d+)\. ", doc, flags=re.M))
    ends = [m.start() for m in starts[1:]] + [len(doc)]
    return {int(m.group(1)): doc[m.start() : end] for m, end in zip(starts, ends, strict=True)}


def readme_rows() -> dict[int, str]:
    rows = {}
    for line in (PATCHES / "README.md").read_text().splitlines():
        m = re.match(r"\| \[?(\d{4})", line)
        if m:
            rows[int(m.group(1))] = line
    return rows


def patch_files() -> dict[int, list[Path]]:
    files: dict[int, list[Path]] = {}
    for path in sorted(PATCHES.glob("0*")):
        files.setdefault(int(path.name[:4]), []).append(path)
    return files


def test_every_workaround_names_its_patch_and_every_patch_its_workaround():
    entries, files, rows = compat_entries(), patch_files(), readme_rows()
    assert sorted(entries) == list(range(1, len(entries) + 1)), "compat's fixes are numbered 1..N"
    assert sorted(files) == sorted(entries) == sorted(rows)
    for n, text in entries.items():
        named = re.findall(r"patches/(\d{4}-[\w.-]+)", text)
        assert named, f"compat fix {n} names no patches/ file"
        for name in named:
            assert name.startswith(f"{n:04d}-"), f"compat fix {n} names {name}"
            assert (PATCHES / name).is_file(), f"compat fix {n} names a missing file {name}"
        assert {p.name for p in files[n]} == set(named), (n, files[n], named)
    for n, row in rows.items():
        functions = re.findall(r"`compat\.(\w+)", row)
        assert functions, f"patches/README.md row {n:04d} names no compat workaround"
        for name in functions:
            assert hasattr(compat, name), f"row {n:04d} names compat.{name}, which does not exist"
        assert f"fix {n}" in row, f"row {n:04d} does not say which compat fix it replaces"
        for path in files[n]:
            assert path.name in row, f"row {n:04d} does not link {path.name}"


def test_the_main_forms_follow_the_same_numbers():
    """A rebased form (patches/main/) has the number and name of its v0.2.2 form."""
    ours = {p.name for p in PATCHES.glob("0*.diff")}
    for path in (PATCHES / "main").glob("*.diff"):
        assert path.name in ours, f"patches/main/{path.name} has no v0.2.2 form of that name"


def test_the_switch_turns_every_torchtitan_fix_off_and_each_has_an_upstream_test():
    """Fixes 1-8 and 10 (those with a torchtitan diff) read the switch, and each is exercised by a
    test of tests/upstream/test_each_fix.py; fix 9 (torch's) is not switched."""
    diffs = {n for n, paths in patch_files().items() if any(p.suffix == ".diff" for p in paths)}
    assert sorted({n for fixes in FIXES.values() for n in fixes}) == sorted(diffs)
    for n in diffs:
        for name in re.findall(r"`compat\.(\w+)", readme_rows()[n]):
            obj = getattr(compat, name)
            if inspect.isfunction(obj):
                assert "workarounds_on()" in inspect.getsource(obj), f"compat.{name} (fix {n})"
    assert "workarounds_on" not in inspect.getsource(compat.leave_without_teardown)
