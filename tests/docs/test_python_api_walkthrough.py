"""docs/python-api.md's walkthrough of ESPnet's `bin/train.py` (with only the trainer import
changed) runs as written: each command of its shell block, in order, in a fresh folder where
`tests/` and `.venv/` are the repository's (as they are in a clone), with `.venv` activated as
the quickstart says (`python` is the venv's). The data stage, 4 steps on
1 process, 4 on 2 processes (torch's launcher), and the rerun with `max_step` raised to 8, which
continues from the step-4 checkpoint."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.command_parsing import ROOT
from tests.docs.test_doc_commands import FENCE
from tests.helpers import aborted_in_torch_teardown

pytestmark = [pytest.mark.slow, pytest.mark.long]
HEADING = "## ESPnet's `bin/train.py`, with only the trainer import changed"


def walkthrough() -> list[str]:
    """The commands of the section's shell block (continuation lines joined)."""
    text = (ROOT / "docs" / "python-api.md").read_text()
    section = text[text.index(HEADING) :]
    block = next(m for m in FENCE.finditer(section) if m.group(2) == "bash").group(3)
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def torch_teardown_abort(stderr: str, folder, command: str) -> bool:
    """A 2-process command that failed only in torch's teardown after its run completed (its
    step-4 checkpoint whole): ``tests.helpers.aborted_in_torch_teardown``."""
    if "--nproc-per-node 2" not in command:
        return False
    done = folder / "espnet_demo" / "exp2" / "checkpoint" / "step-4"
    return aborted_in_torch_teardown(stderr, done)


def test_the_walkthrough_runs_as_written(tmp_path):
    commands = walkthrough()
    assert len(commands) == 5 and "tests.espnet_side.train_main" in commands[2]
    for name in ("tests", ".venv"):
        os.symlink(ROOT / name, tmp_path / name)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for command in commands:
        shell = f"source .venv/bin/activate && {command}"
        r = subprocess.run(["bash", "-c", shell], cwd=tmp_path, capture_output=True, text=True,
                           timeout=600, env=env)  # fmt: skip
        if r.returncode != 0 and torch_teardown_abort(r.stderr, tmp_path, command):
            continue  # torch's gloo teardown abort after a completed run (see the helper)
        assert r.returncode == 0, f"`{command}`\n{(r.stdout + r.stderr)[-3000:]}"
    exp = tmp_path / "espnet_demo" / "exp"
    assert sorted(os.listdir(exp / "checkpoint")) == ["step-2", "step-4", "step-6", "step-8"]
    rows = [json.loads(line) for line in open(exp / "metrics.jsonl")]
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert steps == list(range(1, 9))  # the rerun went on from step 4, nothing again
    assert "step-4" in os.listdir(tmp_path / "espnet_demo" / "exp2" / "checkpoint")
