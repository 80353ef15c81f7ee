"""`torchtitan prepare --import my_module` finds a module of the current directory, as
`python -m` would: through the real console script (whose sys.path[0] is its bin/ folder, not
the current directory), with no PYTHONPATH, and in the worker processes too."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf

from tests.data_fixtures import tone
from torchtitan_speechlm.data.reader import PreparedDataset

pytestmark = [pytest.mark.slow, pytest.mark.long]  # make faults (make test budget: 26 s)
HERE = Path(__file__).resolve().parents[1]  # tests/
CONSOLE = os.path.join(os.path.dirname(sys.executable), "torchtitan")


def test_console_script_imports_a_module_of_the_current_directory(tmp_path):
    from torchtitan_speechlm.demo.assets import build_tokenizer, load_sentences

    assert os.path.isfile(CONSOLE), CONSOLE
    # a user's extension module (a codec and a `--tsv` source), beside their data
    shutil.copy(HERE / "toy_extension.py", tmp_path / "mymod.py")
    sentences = load_sentences()
    build_tokenizer(str(tmp_path / "tok"), sentences)
    os.makedirs(tmp_path / "wavs")
    lines = []
    for i in range(8):
        sf.write(tmp_path / "wavs" / f"t{i}.wav", tone(i, 0.2 + 0.05 * i, 16000), 16000)
        lines.append(f"t{i}\twavs/t{i}.wav\t{sentences[i]}")
    (tmp_path / "corpus.tsv").write_text("\n".join(lines) + "\n")
    subprocess.run(
        [sys.executable, "-c", "import mymod; mymod.save_tone_codec('codec')"],
        cwd=tmp_path,
        check=True,
        timeout=120,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [CONSOLE, "prepare", "--import", "mymod", "--tsv", "corpus.tsv", "--codec", "codec",
         "--tokenizer", "tok", "--out-dir", "prepared", "--workers", "2", "--shard-size", "4",
         "--no-progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ds = PreparedDataset(str(tmp_path / "prepared"))
    assert ds.metadata["codec"]["name"] == "toy_tone" and ds.metadata["source"] == {"type": "tsv"}
    assert len(ds) == 8 and len(ds.metadata["shards"]) == 2  # two shards: both workers ran

    # a module that is nowhere to be found still says so
    r = subprocess.run(
        [CONSOLE, "prepare", "--import", "no_such_module_here", "--tokenizer", "tok", "--out-dir", "x"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0 and "No module named 'no_such_module_here'" in r.stderr
