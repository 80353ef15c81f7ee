"""User files with faults, as real bytes on a real filesystem, through ``torchtitan prepare``'s
own entry point (issue 39, findings 5 and 8):

- a Latin-1 byte in a JSONL manifest or in a Kaldi ``text`` / ``wav.scp`` / ``segments`` /
  ``utt2spk`` file: one line naming the file, the line, the column and byte offset, and the fix
  (before: ``error: 'utf-8' codec can't decode byte 0xe9 in position 391``, no file, no line);
- a wav cut short (its header counts more frames than the file holds): skipped and counted as
  ``truncated_audio`` (before: kept, half its audio under its whole transcript); a Kaldi
  segment inside the part that is there is kept.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import soundfile as sf

from tests.data_fixtures import build_assets, tone, write_manifest
from torchtitan_speechlm.commands.prepare import main
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.utils.audio import BadAudioError, load_audio, wav_header_frames

SR = 16000


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_assets(tmp_path_factory.mktemp("faults"))


def _prepare(assets, out, *source: str) -> int:
    return main([*source, "--codec", assets["codec"], "--tokenizer", assets["tok"],
                 "--out-dir", str(out), "--no-progress"])  # fmt: skip


def _latin1_line(text: str) -> bytes:
    return text.encode("latin-1")  # "é" -> 0xe9, not UTF-8


def test_a_latin1_byte_in_a_jsonl_manifest_names_file_line_and_fix(assets, tmp_path, capsys):
    base = os.path.dirname(assets["manifest"])
    rows = [dict(r, audio=os.path.join(base, r["audio"])) for r in assets["rows"][:3]]
    manifest = tmp_path / "m.jsonl"
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    lines[2] = lines[2].replace(rows[2]["text"], "le caf\u00e9 est chaud")
    manifest.write_bytes(b"".join(_latin1_line(x) + b"\n" for x in lines))
    column = _latin1_line(lines[2]).index(b"\xe9") + 1
    offset = len(_latin1_line(lines[0])) + len(_latin1_line(lines[1])) + 2 + column - 1

    assert _prepare(assets, tmp_path / "out", "--manifest", str(manifest)) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(
        f"error: {manifest}:3: byte 0xe9 at column {column} (byte offset {offset}) is not "
        "UTF-8 (near `"
    ), err
    assert 'caf\\xe9 est chaud"}`' in err  # the bytes around it, the bad one escaped
    assert err.endswith(
        f": save it as UTF-8 (from Latin-1: iconv -f latin1 -t utf-8 {manifest} > {manifest}.utf8)"
    )
    assert not (tmp_path / "out" / "metadata.json").exists()


@pytest.mark.parametrize("name", ["text", "wav.scp", "segments", "utt2spk"])
def test_a_latin1_byte_in_a_kaldi_file_names_file_and_line(assets, tmp_path, capsys, name):
    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    wav = str(tmp_path / "r0.wav")
    sf.write(wav, tone(0, 1.0, SR), SR)
    files = {
        "wav.scp": [f"r0 {wav}"],
        "segments": ["u0 r0 0.0 0.4", "u1 r0 0.4 0.9"],
        "text": ["u0 the cat", "u1 the dog"],
        "utt2spk": ["u0 s0", "u1 s0"],
    }
    files[name][-1] += " caf\u00e9"  # a Latin-1 byte on the file's last line
    for f, lines in files.items():
        (kaldi / f).write_bytes(b"".join(_latin1_line(x) + b"\n" for x in lines))
    line = len(files[name])

    assert _prepare(assets, tmp_path / "out", "--kaldi", str(kaldi)) == 1
    err = capsys.readouterr().err
    assert f"{kaldi / name}:{line}: byte 0xe9 at column" in err, err
    assert "is not UTF-8" in err and "save it as UTF-8" in err and "position" not in err


def _truncated_wav(path: str, seconds: float, keep: float) -> None:
    """A real 16-bit wav of ``seconds``, cut to the first ``keep`` of its bytes (as a copy or
    a download that stopped): its header still counts every frame."""
    sf.write(path, tone(3, seconds, SR), SR, subtype="PCM_16")
    os.truncate(path, int(os.path.getsize(path) * keep))


def test_a_truncated_wav_is_skipped_and_counted(assets, tmp_path, capsys):
    base = os.path.dirname(assets["manifest"])
    rows = [dict(r, audio=os.path.join(base, r["audio"])) for r in assets["rows"][:3]]
    cut = str(tmp_path / "cut.wav")
    _truncated_wav(cut, 2.0, 0.5)
    assert wav_header_frames(cut) == 2 * SR
    assert sf.info(cut).frames < SR + 100  # libsndfile reads what is there, silently
    rows.insert(1, {"id": "cut", "audio": cut, "text": "a whole transcript of two seconds"})
    manifest = write_manifest(tmp_path / "m.jsonl", rows)
    out = tmp_path / "out"

    assert _prepare(assets, out, "--manifest", manifest) == 0
    assert "1 skipped" in capsys.readouterr().out
    assert PreparedDataset(str(out)).ids == [r["id"] for r in rows if r["id"] != "cut"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_by_reason"] == {"truncated_audio": 1}
    (fail,) = [json.loads(x) for x in open(out / "failures.jsonl")]
    assert (fail["id"], fail["reason"], fail["source"]) == (
        "cut",
        "truncated_audio",
        f"{manifest}:2",
    )
    assert "header says 32000 frames (2.00 s) but the file holds" in fail["detail"]


def test_kaldi_segments_of_a_truncated_recording(assets, tmp_path):
    """A segment inside the part of the recording that is there is whole: kept. One that
    reaches past the cut (or to the end: ``-1``) is skipped as truncated_audio."""
    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    rec = str(tmp_path / "rec.wav")
    _truncated_wav(rec, 4.0, 0.5)  # about 2 s left of 4
    (kaldi / "wav.scp").write_text(f"rec {rec}\n")
    (kaldi / "segments").write_text("early rec 0.2 1.5\nlate rec 1.6 3.5\ntail rec 3.0 -1\n")
    (kaldi / "text").write_text("early the cat\nlate the dog\ntail the end\n")
    out = tmp_path / "out"
    assert _prepare(assets, out, "--kaldi", str(kaldi)) == 0
    assert PreparedDataset(str(out)).ids == ["early"]
    fails = {json.loads(x)["id"]: json.loads(x)["reason"] for x in open(out / "failures.jsonl")}
    assert fails == {"late": "truncated_audio", "tail": "truncated_audio"}


def test_intact_and_streamed_wavs_are_not_truncated(tmp_path):
    """A complete wav, float and 24-bit ones, and a wav whose data size a streaming writer left
    unknown (0xFFFFFFFF) read as before."""
    for subtype in ("PCM_16", "PCM_24", "FLOAT"):
        path = str(tmp_path / f"{subtype}.wav")
        sf.write(path, tone(1, 0.5, SR), SR, subtype=subtype)
        assert wav_header_frames(path) == SR // 2
        assert load_audio(path, SR).shape == (SR // 2,)
    streamed = bytearray(open(tmp_path / "PCM_16.wav", "rb").read())
    at = streamed.index(b"data") + 4
    streamed[at : at + 4] = b"\xff\xff\xff\xff"
    (tmp_path / "streamed.wav").write_bytes(bytes(streamed))
    assert wav_header_frames(str(tmp_path / "streamed.wav")) is None
    flac = str(tmp_path / "x.flac")
    sf.write(flac, tone(1, 0.5, SR), SR)
    assert wav_header_frames(flac) is None
    with pytest.raises(BadAudioError) as e:  # a truncated flac: libsndfile's own error, as before
        os.truncate(flac, os.path.getsize(flac) // 2)
        load_audio(flac, SR)
    assert e.value.code in ("unreadable_audio", "truncated_audio")
    assert np.isfinite(load_audio(str(tmp_path / "FLOAT.wav"), SR)).all()
