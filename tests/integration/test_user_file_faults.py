"""User files with faults met by ``torchtitan train`` and ``torchtitan generate`` (issue 39,
findings 5 and 8), as real bytes in real files: a checkpoint ``.metadata`` with one byte
flipped, a ``generate --batch`` file with a Latin-1 line, a wav cut short given to generate,
and a TOML config that is not UTF-8 or not TOML. Each is one line naming the file and the line
(or the byte offset) and the fix, never a traceback."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import soundfile as sf

from tests.helpers import make_tiny_run_assets, run_train, write_tiny_config
from torchtitan_speechlm.commands.generate import generate_main
from torchtitan_speechlm.components.resume import ResumeError, read_checkpoint_metadata
from torchtitan_speechlm.config.toml_check import load_toml_file

FAST = ("--validation.enable", "false")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny run, 2 steps, a checkpoint at each (a few seconds)."""
    root = tmp_path_factory.mktemp("faulty_files")
    assets = make_tiny_run_assets(root / "assets", n_items=8)
    dump = root / "run"
    cfg = write_tiny_config(root / "run.toml", assets, dump)
    r = run_train(cfg, "--training.steps", "2", "--checkpoint.interval", "1", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    return {"root": root, "assets": assets, "dump": dump, "cfg": cfg}


def _cut_wav(path, seconds: float = 2.0) -> str:
    """A real wav whose second half is gone (its header still counts every frame)."""
    sr = 16000
    sf.write(path, [0.1 * ((i % 80) / 40 - 1) for i in range(int(seconds * sr))], sr)
    os.truncate(path, os.path.getsize(path) // 2)
    return str(path)


def test_a_flipped_byte_in_checkpoint_metadata_names_the_file(run, tmp_path):
    """Before: ``config error: 'utf-8' codec can't decode byte 0x9d in position 19: invalid
    start byte`` (DCP unpickling .metadata in the resume decision), no file."""
    dump = tmp_path / "run"
    shutil.copytree(run["dump"], dump)
    step2 = dump / "checkpoint" / "step-2"
    meta = step2 / ".metadata"
    data = bytearray(meta.read_bytes())
    data[data.find(b"tok_embeddings") + 3] = 0x9D  # inside a pickled name: not UTF-8 any more
    meta.write_bytes(bytes(data))
    with pytest.raises(ResumeError) as e:
        read_checkpoint_metadata(str(step2))
    assert str(e.value).startswith(f"{meta} is corrupt near byte ")
    assert str(e.value).endswith(
        "(UnicodeDecodeError: 'utf-8' codec can't decode byte 0x9d in position 19: invalid "
        f"start byte): the checkpoint cannot be read. Delete {step2} to resume from step-1, or "
        "use another job.dump_folder"
    )
    r = run_train(run["cfg"], "--job.dump_folder", str(dump), "--training.steps", "3", *FAST)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    named = [x for x in (r.stdout + r.stderr).splitlines() if str(step2) in x]
    if r.returncode == 2:  # refused, naming the file and the fix
        assert any(f"config error: {meta} is corrupt near byte" in x for x in named), r.stderr
    else:  # the checkpoint manifest sees the damage first: a warning (rank log) and step-1 loads
        assert r.returncode == 0 and any("damaged" in x for x in named), r.stderr[-3000:]
    assert all(str(step2) in x for x in r.stderr.splitlines() if "can't decode" in x)


def test_generate_names_a_latin1_batch_line_and_a_truncated_wav(run, tmp_path, capsys):
    step = str(run["dump"] / "checkpoint" / "step-2")
    cut = _cut_wav(tmp_path / "cut.wav")
    # one request alone: one line, exit 2
    assert generate_main(["--model", step, "--task", "asr", "--audio", cut]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    held = sf.info(cut).frames  # what libsndfile reads, silently, without the check
    assert err == (
        f"torchtitan generate: error: {cut}: truncated: its header says 32000 frames (2.00 s) "
        f"but the file holds {held} ({held / 16000:.2f} s); copy or download it again"
    )
    # a batch file: the Latin-1 line and the truncated wav fail alone, each named
    batch = tmp_path / "requests.jsonl"
    batch.write_bytes(
        json.dumps({"id": "cut", "task": "asr", "audio": cut}).encode() + b"\n"
        + '{"id": "fr", "task": "tts", "text": "caf\u00e9"}\n'.encode("latin-1")
    )  # fmt: skip
    out = tmp_path / "out"
    assert generate_main(["--model", step, "--batch", str(batch), "--out-dir", str(out)]) == 1
    rows = {r["id"]: r for r in map(json.loads, open(out / "results.jsonl"))}
    assert "truncated: its header says 32000 frames" in rows["cut"]["error"]
    assert rows["line2"]["error"].startswith(f"{batch}:2: byte 0xe9 at column ")
    assert "save it as UTF-8" in rows["line2"]["error"]


def _bad_tomls(run, tmp_path) -> dict:
    text = open(run["cfg"]).read()
    latin = tmp_path / "latin.toml"
    latin.write_bytes(text.replace("[speechlm]\n", "[speechlm]\n# caf\u00e9\n").encode("latin-1"))
    syntax = tmp_path / "syntax.toml"
    syntax.write_text(text.replace("steps = 6", "steps = = 6"))
    line = text.splitlines().index("steps = 6") + 1
    return {"latin": (latin, text.splitlines().index("[speechlm]") + 2), "syntax": (syntax, line)}


def test_toml_errors_name_the_file_and_line(run, tmp_path):
    from torchtitan_speechlm.config import ConfigError

    bad = _bad_tomls(run, tmp_path)
    (latin, line) = bad["latin"]
    with pytest.raises(ConfigError) as e:
        load_toml_file(str(latin))
    assert str(e.value).startswith(f"{latin}:{line}: byte 0xe9 at column 6 (byte offset ")
    assert "save it as UTF-8" in str(e.value)
    (syntax, line) = bad["syntax"]
    with pytest.raises(ConfigError) as e:
        load_toml_file(str(syntax))
    assert str(e.value) == (
        f"{syntax}:{line}: not valid TOML: Invalid value (column 9): `steps = = 6`; fix that "
        "line (TOML: key = value, strings in quotes, [section] headers)"
    )


def test_toml_errors_through_torchtitan_train(run, tmp_path):
    for path, line in _bad_tomls(run, tmp_path).values():
        r = run_train(str(path))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert f"torchtitan train: config error: {path}:{line}: " in r.stderr
