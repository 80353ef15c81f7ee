"""Sources of `torchtitan prepare` (Kaldi dirs, HF datasets on disk, JSONL text-only, audio-only
and dialogue lines), resampling of odd inputs, and --num-streams."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import soundfile as sf

from tests.data_fixtures import SR, build_assets, sine, tone, write_manifest
from torchtitan_speechlm.codecs import load_codec
from torchtitan_speechlm.commands.prepare import main
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.prepare.items import ManifestError
from torchtitan_speechlm.prepare.pipeline import prepare_dataset
from torchtitan_speechlm.prepare.sources.kaldi import read_kaldi_dir
from torchtitan_speechlm.utils.audio import load_audio
from torchtitan_speechlm.utils.text_tokenizer import load_text_tokenizer


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    a = build_assets(tmp_path_factory.mktemp("src"))
    a["codec_obj"] = load_codec(a["codec"])
    a["tok_obj"] = load_text_tokenizer(a["tok"])
    return a


def ids(assets, text: str) -> list[int]:
    return assets["tok_obj"](text, add_special_tokens=False)["input_ids"]


def encode(assets, wav: np.ndarray) -> np.ndarray:
    return assets["codec_obj"].encode([wav])[0]


def failures(out) -> list[dict]:
    return [json.loads(x) for x in open(os.path.join(out, "failures.jsonl"))]


# --- Kaldi ------------------------------------------------------------------------------------


def make_kaldi(root, with_segments: bool = True):
    os.makedirs(root / "data", exist_ok=True)
    for r in range(2):  # two 3 s recordings at 8 kHz (resampled to 16 kHz)
        sf.write(root / f"rec{r}.wav", tone(r, 3.0, 8000), 8000)
    (root / "data" / "wav.scp").write_text(f"rec0 {root}/rec0.wav\nrec1 ../rec1.wav\n")
    if with_segments:
        (root / "data" / "segments").write_text(
            "u1 rec0 0.0 1.0\nu2 rec0 1.5 2.75\nu3 rec1 0.25 -1\nu4 rec1 1.0 2.0\n"
        )
        (root / "data" / "text").write_text(
            "u1 hello there\nu2 the cat sat\nu3 on the mat\nu9 a transcript without audio\n"
        )
    else:
        (root / "data" / "text").write_text("rec0 first recording\nrec1 second recording\n")
    return root / "data"


def test_kaldi_segments_prepare(assets, tmp_path):
    data = make_kaldi(tmp_path)
    out = tmp_path / "out"
    s = prepare_dataset(None, assets["codec"], assets["tok"], str(out), kaldi=str(data),
                        progress=False, batch_size=1)  # fmt: skip
    ds = PreparedDataset(str(out))
    assert ds.ids == ["u1", "u2", "u3"] and ds.metadata["source"]["type"] == "kaldi"
    spans = {"u1": ("rec0", 0.0, 1.0), "u2": ("rec0", 1.5, 2.75), "u3": ("rec1", 0.25, -1)}
    for i, (utt, text) in enumerate([("u1", "hello there"), ("u2", "the cat sat"),
                                     ("u3", "on the mat")]):  # fmt: skip
        rec, start, end = spans[utt]
        wav = load_audio(str(tmp_path / f"{rec}.wav"), SR, start=start, end=end)
        item = ds[i]
        assert item.text == text and item.text_tokens.tolist() == ids(assets, text)
        assert item.seconds == pytest.approx((end if end > 0 else 3.0) - start, abs=1e-3)
        np.testing.assert_array_equal(item.audio_codes, encode(assets, wav))
    got = {(f["id"], f["reason"]) for f in failures(out)}
    assert got == {("u4", "empty_text"), ("u9", "missing_audio")}
    assert s["skipped_by_reason"] == {"empty_text": 1, "missing_audio": 1}
    assert any(f["source"].endswith("data/text:4") for f in failures(out))


def test_kaldi_without_segments_and_refused_pipes(assets, tmp_path):
    data = make_kaldi(tmp_path, with_segments=False)
    items = read_kaldi_dir(str(data))
    assert [(it.id, it.text) for it in items] == [("rec0", "first recording"),
                                                   ("rec1", "second recording")]  # fmt: skip
    assert items[1].audio == str(tmp_path / "rec1.wav")  # relative: not in cwd, so the data dir
    (data / "wav.scp").write_text("rec0 sox rec0.sph -t wav - |\n")
    with pytest.raises(ManifestError, match=r"wav\.scp:1: 'sox .*\|' is a piped command"):
        read_kaldi_dir(str(data))
    (data / "wav.scp").write_text("rec0 /x/feats.ark:1234\n")
    with pytest.raises(ManifestError, match="ark/stdin reference"):
        read_kaldi_dir(str(data))


def test_cli_reports_piped_wav_scp(assets, tmp_path, capsys):
    data = make_kaldi(tmp_path, with_segments=False)
    (data / "wav.scp").write_text("rec0 flac -dc rec0.flac |\n")
    rc = main(["--kaldi", str(data), "--codec", assets["codec"], "--tokenizer", assets["tok"],
               "--out-dir", str(tmp_path / "o"), "--no-progress"])  # fmt: skip
    assert rc == 1 and "piped command" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# --- HF datasets --------------------------------------------------------------------------------


def wav_bytes(wav: np.ndarray, sr: int, fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, wav, sr, format=fmt)
    return buf.getvalue()


def test_hf_dataset_saved_to_disk(assets, tmp_path):
    from datasets import Audio, Dataset, DatasetDict

    waves = [tone(0, 0.8, 22050), np.stack([tone(1, 0.5, 44100)] * 2, 1), tone(2, 0.6, 16000)]
    sr = [22050, 44100, 16000]
    cells = [{"bytes": wav_bytes(waves[0], sr[0]), "path": None},
             {"bytes": wav_bytes(waves[1], sr[1], "FLAC"), "path": None},
             {"bytes": None, "path": str(tmp_path / "c.wav")}]  # fmt: skip
    sf.write(tmp_path / "c.wav", waves[2], sr[2])
    texts = ["first clip", "second clip", "third clip"]
    ds = Dataset.from_dict({"speech": cells, "sentence": texts, "id": ["x", "y", "z"]})
    ds = ds.cast_column("speech", Audio())  # stored as {bytes, path}; no torchcodec needed
    DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "hf"))
    out = tmp_path / "out"
    rc = main(["--hf-dataset", str(tmp_path / "hf"), "--split", "train", "--audio-column",
               "speech", "--text-column", "sentence", "--codec", assets["codec"], "--tokenizer",
               assets["tok"], "--out-dir", str(out), "--codec-batch-size", "1", "--no-progress"])  # fmt: skip
    assert rc == 0
    prepared = PreparedDataset(str(out))
    assert prepared.ids == ["x", "y", "z"]
    for i in range(3):
        w = waves[i].mean(1) if waves[i].ndim == 2 else waves[i]
        ref = load_audio(str(tmp_path / "c.wav"), SR) if i == 2 else None
        if ref is None:
            from torchtitan_speechlm.utils.audio import decode_audio_bytes

            ref = decode_audio_bytes(cells[i]["bytes"], SR, "x")
        assert len(ref) == pytest.approx(len(w) * SR / sr[i], abs=1)
        np.testing.assert_array_equal(prepared[i].audio_codes, encode(assets, ref))
        assert prepared[i].text == texts[i]
    with pytest.raises(ManifestError, match="choose a split with --split"):
        prepare_dataset(None, assets["codec"], assets["tok"], str(tmp_path / "o2"),
                        hf_dataset=str(tmp_path / "hf"), audio_column="speech", progress=False)  # fmt: skip


# --- resampling, text-only, audio-only, dialogue ------------------------------------------------


def test_44k_stereo_file_is_resampled_and_downmixed(assets, tmp_path):
    left, right = sine(440.0, 1.1, 44100), sine(1000.0, 1.1, 44100, amp=0.3)
    sf.write(tmp_path / "st.wav", np.stack([left, right], 1), 44100, subtype="FLOAT")
    m = write_manifest(tmp_path / "m.jsonl", [{"id": "s", "audio": "st.wav", "text": "stereo"}])
    prepare_dataset(m, assets["codec"], assets["tok"], str(tmp_path / "o"), progress=False)
    item = PreparedDataset(str(tmp_path / "o"))[0]
    from scipy.signal import resample_poly

    mono16k = resample_poly((left + right) / 2, 160, 441).astype(np.float32)
    assert item.seconds == pytest.approx(1.1, abs=1e-4) and item.audio_codes.shape == (55, 4)
    np.testing.assert_array_equal(item.audio_codes, encode(assets, mono16k))


def test_text_only_audio_only_and_dialogue_round_trip(assets, tmp_path):
    corpus = os.path.dirname(assets["manifest"])
    wav = lambda i: os.path.join(corpus, "wavs", f"a{i}.wav")  # noqa: E731
    rows = [
        {"id": "sp", "audio": wav(0), "text": "speech item"},
        {"id": "tx", "text": "just some text"},
        {"id": "au", "audio": wav(1)},
        {"id": "au2", "audio": wav(2), "text": "  "},
        {"id": "dl", "turns": [
            {"role": "system", "text": "you are helpful"},
            {"role": "user", "audio": wav(3)},
            {"role": "assistant", "text": "sure"},
            {"role": "assistant", "audio": wav(4)},
        ]},
        {"id": "dl_bad", "turns": [{"role": "user", "audio": "missing.wav"},
                                   {"role": "assistant", "text": "never written"}]},
    ]  # fmt: skip
    m = write_manifest(tmp_path / "m.jsonl", rows)
    out = tmp_path / "o"
    s = prepare_dataset(m, assets["codec"], assets["tok"], str(out), progress=False,
                        allow_audio_only=True, batch_size=1, shard_size=4)  # fmt: skip
    ds = PreparedDataset(str(out))
    assert ds.ids == ["sp", "tx", "au", "au2", "dl"]
    assert list(ds.kinds) == ["speech", "text", "audio", "audio", "dialogue"]
    assert s["kinds"] == {"audio": 2, "dialogue": 1, "speech": 1, "text": 1}
    codes = {i: encode(assets, load_audio(wav(i), SR)) for i in range(5)}
    tx = ds[1]
    assert tx.text_tokens.tolist() == ids(assets, "just some text")
    assert tx.audio_codes.shape == (0, 4) and tx.seconds == 0 and ds.audio_lengths[1] == 0
    au = ds[2]
    assert au.text == "" and au.text_tokens.size == 0 and ds.text_lengths[2] == 0
    np.testing.assert_array_equal(au.audio_codes, codes[1])
    dl = ds[4]
    assert dl.text_tokens.size == 0 and dl.audio_codes.shape == (0, 4)
    assert [(t.role, t.modality) for t in dl.turns] == [
        ("system", "text"),
        ("user", "audio"),
        ("assistant", "text"),
        ("assistant", "audio"),
    ]
    assert dl.turns[0].tokens.tolist() == ids(assets, "you are helpful")
    assert dl.turns[0].text == "you are helpful" and dl.turns[2].tokens.tolist() == ids(
        assets, "sure"
    )
    np.testing.assert_array_equal(dl.turns[1].tokens, codes[3])
    np.testing.assert_array_equal(dl.turns[3].tokens, codes[4])
    assert all(t.tokens.dtype == np.int64 for t in dl.turns)
    assert ds.text_lengths[4] == len(ids(assets, "you are helpful")) + len(ids(assets, "sure"))
    assert ds.audio_lengths[4] == len(codes[3]) + len(codes[4])
    assert dl.seconds == pytest.approx(2.0 + 0.9, abs=1e-3)
    assert ds[0].turns is None
    assert ds.num_turns.tolist() == [0, 0, 0, 0, 4] and ds.num_audio_turns.tolist() == [
        0,
        0,
        0,
        0,
        2,
    ]
    assert [(f["id"], f["reason"]) for f in failures(out)] == [("dl_bad", "missing_audio")]
    # Without --allow-audio-only, the audio-only lines are skipped as empty text.
    prepare_dataset(m, assets["codec"], assets["tok"], str(tmp_path / "o2"), progress=False)
    assert PreparedDataset(str(tmp_path / "o2")).ids == ["sp", "tx", "dl"]
    assert sorted(f["id"] for f in failures(tmp_path / "o2") if f["reason"] == "empty_text") == [
        "au", "au2"]  # fmt: skip


def test_num_streams_keeps_first_codebooks(assets, tmp_path):
    full, two = tmp_path / "full", tmp_path / "two"
    prepare_dataset(assets["manifest"], assets["codec"], assets["tok"], str(full), progress=False)
    rc = main(["--manifest", assets["manifest"], "--codec", assets["codec"], "--tokenizer",
               assets["tok"], "--out-dir", str(two), "--num-streams", "2", "--no-progress"])  # fmt: skip
    assert rc == 0
    a, b = PreparedDataset(str(full)), PreparedDataset(str(two))
    assert b.metadata["codec"]["num_streams"] == 2 and b.metadata["codec"]["total_streams"] == 4
    for i in range(len(a)):
        np.testing.assert_array_equal(b[i].audio_codes, a[i].audio_codes[:, :2])
