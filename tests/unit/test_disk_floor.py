"""tests/conftest.py refuses to start on a nearly full temporary folder: one line naming the
folder, the free space and the fix, before any fixture fails half-way with ENOSPC."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_floor_above_the_free_space_stops_the_session_before_any_test():
    free = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    env = dict(os.environ, TORCHTITAN_TEST_MIN_FREE_GIB=str(int(free) + 1000))
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/unit/test_package_layout.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 3, out
    assert f"GiB free in {tempfile.gettempdir()}, under the {int(free) + 1000} GiB" in out
    assert "TMPDIR" in out and "passed" not in out  # no test ran
