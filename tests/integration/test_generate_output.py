"""`torchtitan generate` from an exported folder prints no transformers warning about the
export's model type (issue 37): its config.json says ``"model_type": "speechlm"``, which
transformers' AutoTokenizer used to read as a plain config of another type and warn about
("You are using a model of type `speechlm` to instantiate a model of type ..."). The command
runs as its own process, as a user runs it, and its whole output is checked."""

import os
import subprocess
import sys

import pytest

from tests.helpers import tiny_export

pytestmark = [pytest.mark.slow, pytest.mark.long]  # in make faults (make test budget)


def test_generate_from_an_export_prints_no_model_type_warning(tmp_path):
    run = tiny_export(tmp_path / "m", steps=2)
    wav = tmp_path / "out.wav"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torchtitan_speechlm.cli", "generate", "--model", run["export"],
           "--task", "tts", "--text", "the quiet cat", "--max-frames", "8", "--out", str(wav)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert wav.is_file()
    assert "You are using a model of type" not in out, out
    assert "speechlm` to instantiate" not in out
