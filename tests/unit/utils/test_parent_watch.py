"""utils/parent_watch.py: a process ends once the process it watches has ended, through a pidfd
(Linux) and through the polling fallback; it ends at once when that process is already gone.
tests/integration/test_prepare_workers.py kills a real `torchtitan prepare` mid-run."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

WATCHER = """
import os, sys, time
if sys.argv[2] == "poll":
    del os.pidfd_open  # as where Linux gives no pidfd
from torchtitan_speechlm.utils import parent_watch
parent_watch.POLL_S = 0.05
parent_watch.exit_when_gone(int(sys.argv[1]), code=7)
print("watching", flush=True)
time.sleep(60)
"""


def watcher(pid: int, how: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", WATCHER, str(pid), how], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "watching\n"
    return proc


@pytest.mark.parametrize("how", ["pidfd", "poll"])
def test_the_watcher_ends_when_the_watched_process_ends(how):
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc = watcher(watched.pid, how)
        time.sleep(0.3)
        assert proc.poll() is None  # the watched process lives: so does the watcher
        watched.kill()
        watched.wait()
        assert proc.wait(timeout=10) == 7
    finally:
        watched.kill()


@pytest.mark.parametrize("how", ["pidfd", "poll"])
def test_a_watcher_of_an_ended_process_ends_at_once(how):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    proc = subprocess.Popen(
        [sys.executable, "-c", WATCHER, str(ended.pid), how], stdout=subprocess.PIPE, text=True
    )
    assert proc.wait(timeout=10) == 7
