"""Rank 0's record of the step a signal stopped it at (trainer/lifecycle.py ``stop_on_signals``),
which the launcher's one line reads. The signal reaches the handler twice (Python's handler in
the main thread and the wakeup-fd thread); only the first writes. The race that, most likely, once emptied the record (the SIGTERM fault test read
"before its first step" with step-4 saved) cannot be forced here; this checks the record is whole and is the only file written."""

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import sys
from torchtitan_speechlm.trainer import lifecycle
lifecycle.track_run(sys.argv[1], None, lambda: 7)
lifecycle.stop_on_signals()
print("ready", flush=True)
n = 0
while True:  # busy in Python: the main thread's handler runs as soon as the thread's does
    n += 1
"""


def test_sigterm_leaves_rank_0s_step_whole_for_the_launcher(tmp_path):
    from torchtitan_speechlm.trainer.lifecycle import STOPPED, stopped_step

    env = dict(os.environ, RANK="0", WORLD_SIZE="2")
    for i in range(2):
        dump = tmp_path / str(i)
        dump.mkdir()
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(dump)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 128 + signal.SIGTERM
        assert stopped_step(str(dump)) == 7, (dump / STOPPED).read_text()
        assert sorted(p.name for p in dump.iterdir()) == [STOPPED]  # one file, written once
