"""Tests for the data path: audio loading, codecs, tokenizer, manifest, prepare, prepared format."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import soundfile as sf

from tests.data_fixtures import SR, build_assets, needs_espeak, sine
from tests.tiny_codecs import build_codec
from torchtitan_speechlm.codecs import CodecError, load_codec
from torchtitan_speechlm.commands.prepare import main
from torchtitan_speechlm.data.format import (
    AUDIO_CODES,
    TEXT_TOKENS,
    CorruptDatasetError,
    check_compatible,
)
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.demo import assets as demo_assets
from torchtitan_speechlm.prepare.items import ManifestError
from torchtitan_speechlm.prepare.pipeline import BadItemError, prepare_dataset
from torchtitan_speechlm.prepare.sources.jsonl import read_jsonl_manifest
from torchtitan_speechlm.utils.audio import BadAudioError, decode_audio_bytes, load_audio
from torchtitan_speechlm.utils.text_tokenizer import load_text_tokenizer, tokenizer_fingerprint


def dominant_freq(wav: np.ndarray, sr: int) -> float:
    spec = np.abs(np.fft.rfft(wav * np.hanning(len(wav))))
    return float(np.fft.rfftfreq(len(wav), 1 / sr)[spec.argmax()])


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Tiny tokenizer + encodec codec + a 6-item manifest of 22.05 kHz tone wavs."""
    return build_assets(tmp_path_factory.mktemp("assets"))


# --- audio ---------------------------------------------------------------------------------


def test_load_audio_resample_keeps_frequency_and_length(tmp_path):
    path = tmp_path / "s.wav"
    sf.write(path, sine(1000.0, 1.0, 44100), 44100, subtype="FLOAT")
    wav = load_audio(str(path), 16000)
    assert wav.dtype == np.float32 and wav.shape == (16000,)
    assert abs(dominant_freq(wav, 16000) - 1000.0) <= 2.0
    assert abs(np.sqrt(np.mean(wav[1000:-1000] ** 2)) - 0.5 / np.sqrt(2)) < 0.01


def test_load_audio_downsampling_removes_content_above_nyquist(tmp_path):
    path = tmp_path / "hi.wav"
    sf.write(path, sine(7000.0, 0.5, 22050), 22050, subtype="FLOAT")
    wav = load_audio(str(path), 8000)  # 7 kHz is above the 4 kHz Nyquist: must not alias to 1 kHz
    assert np.sqrt(np.mean(wav[500:-500] ** 2)) < 0.02


def test_load_audio_stereo_is_averaged(tmp_path):
    left, right = sine(300.0, 0.25, SR), sine(500.0, 0.25, SR, amp=0.2)
    path = tmp_path / "st.wav"
    sf.write(path, np.stack([left, right], axis=1), SR, subtype="FLOAT")
    np.testing.assert_allclose(load_audio(str(path), SR), (left + right) / 2, atol=1e-6)
    assert load_audio(str(path), SR, channels=2).shape == (2, len(left))


def test_load_audio_errors_name_the_file(tmp_path):
    with pytest.raises(BadAudioError, match="missing.wav: file not found"):
        load_audio(str(tmp_path / "missing.wav"), SR)
    (tmp_path / "junk.wav").write_bytes(b"not a wav file at all")
    with pytest.raises(BadAudioError, match="junk.wav: unreadable"):
        load_audio(str(tmp_path / "junk.wav"), SR)
    sf.write(tmp_path / "empty.wav", np.zeros(0, dtype=np.float32), SR)
    with pytest.raises(BadAudioError, match="empty.wav: zero-length"):
        load_audio(str(tmp_path / "empty.wav"), SR)


def test_load_audio_segment_and_bytes(tmp_path):
    wav = sine(440.0, 2.0, 22050)
    sf.write(tmp_path / "x.flac", wav, 22050)
    seg = load_audio(str(tmp_path / "x.flac"), SR, start=0.5, end=1.25)
    assert seg.shape == (12000,)  # 0.75 s at 16 kHz, only that part read
    assert load_audio(str(tmp_path / "x.flac"), SR, start=1.5, end=-1).shape == (8000,)
    with pytest.raises(BadAudioError, match="zero-length") as e:
        load_audio(str(tmp_path / "x.flac"), SR, start=3.0, end=4.0)
    assert e.value.code == "empty_audio"
    data = (tmp_path / "x.flac").read_bytes()
    np.testing.assert_allclose(
        decode_audio_bytes(data, SR, "mem"), load_audio(str(tmp_path / "x.flac"), SR)
    )
    with pytest.raises(BadAudioError, match="mem: unreadable") as e:
        decode_audio_bytes(b"junk", SR, "mem")
    assert e.value.code == "unreadable_audio"


# --- codecs --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["encodec", "mimi", "dac"])
def test_codec_encode_decode_shapes(tmp_path, kind):
    codec = load_codec(build_codec(str(tmp_path / kind), kind, seed=0))
    assert (codec.name, codec.sample_rate, codec.frame_rate) == (kind, 16000, 50.0)
    assert (codec.num_streams, codec.codebook_size, len(codec.config_hash)) == (4, 64, 16)
    rng = np.random.default_rng(1)
    wavs = [0.3 * rng.standard_normal(n).astype(np.float32) for n in (16000, 7000, 321)]
    codes = codec.encode(wavs)
    assert [c.shape for c in codes] == [(50, 4), (22, 4), (2, 4)]
    assert all(c.dtype == np.int64 and c.min() >= 0 and c.max() < 64 for c in codes)
    assert len(np.unique(codes[0][:, 0])) > 4, "random-init codebooks should give varied codes"
    audio = codec.decode(codes[1])
    assert audio.dtype == np.float32 and audio.shape == (22 * 320,)
    if kind != "dac":  # causal codecs: codes do not depend on batch padding (up to float ties)
        alone = codec.encode([wavs[1]])[0]
        assert (alone != codes[1]).any(axis=1).mean() <= 0.1


@pytest.mark.parametrize("kind", ["encodec", "mimi", "dac"])
def test_codec_num_streams_keeps_first_codebooks(tmp_path, kind):
    path = build_codec(str(tmp_path / kind), kind, seed=0)
    full, two = load_codec(path), load_codec(path, num_streams=2)
    assert (two.num_streams, two.total_streams, full.total_streams) == (2, 4, 4)
    wav = [sine(300.0, 0.4, SR) + sine(1200.0, 0.4, SR, amp=0.2)]
    np.testing.assert_array_equal(two.encode(wav)[0], full.encode(wav)[0][:, :2])
    assert two.decode(two.encode(wav)[0]).shape == (20 * 320,)
    with pytest.raises(CodecError, match="num_streams must be in 1..4"):
        load_codec(path, num_streams=5)


def test_codec_is_deterministic_per_seed(tmp_path):
    a = load_codec(build_codec(str(tmp_path / "a"), seed=3))
    b = load_codec(build_codec(str(tmp_path / "b"), seed=3))
    wav = [sine(440.0, 0.5, SR)]
    np.testing.assert_array_equal(a.encode(wav)[0], b.encode(wav)[0])


def test_load_codec_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_codec(str(tmp_path / "nowhere"))
    demo_assets.build_backbone(str(tmp_path / "lm"), "llama", vocab_size=64)
    with pytest.raises(
        CodecError,
        match="unsupported codec model_type 'llama'.*encodec, mimi, dac, speechlm_kmeans",
    ):
        load_codec(str(tmp_path / "lm"))


# --- tokenizer -----------------------------------------------------------------------------


def test_tokenizer_round_trip(assets):
    tok = load_text_tokenizer(assets["tok"])
    text = "The quick brown fox, naive cafe!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    fp = tokenizer_fingerprint(tok)
    assert fp["vocab_size"] == len(tok) >= 259 and len(fp["hash"]) == 16
    assert fp == tokenizer_fingerprint(load_text_tokenizer(assets["tok"]))
    with pytest.raises(FileNotFoundError, match="no_such_tok"):
        load_text_tokenizer(os.path.join(assets["root"], "no_such_tok"))


# --- manifest ------------------------------------------------------------------------------


def test_manifest_resolves_relative_paths(assets):
    items = read_jsonl_manifest(assets["manifest"])
    assert [it.id for it in items] == [r["id"] for r in assets["rows"]]
    assert items[0].audio == os.path.join(os.path.dirname(assets["manifest"]), "wavs", "a0.wav")
    assert items[2].line == 3


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", r":2: invalid JSON"),
        ('{"id": "b"}', r":2: needs 'audio', 'text' or 'turns'"),
        ('{"id": "b", "turns": [{"role": "user"}]}', r":2: turn 0: needs exactly one of"),
        ('{"id": "b", "turns": [{"role": "bot", "text": "x"}]}', r":2: turn 0: role 'bot'"),
        (
            '{"id": "a", "audio": "y.wav", "text": "hi"}',
            r":2: duplicate id 'a' \(first on line 1\)",
        ),
        ('{"id": 7, "audio": "y.wav", "text": "hi"}', r":2: 'id' must be a string"),
    ],
)
def test_manifest_errors_name_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "m.jsonl"
    path.write_text('{"id": "a", "audio": "x.wav", "text": "hello"}\n' + bad_line + "\n")
    with pytest.raises(ManifestError, match=r"m\.jsonl" + message):
        read_jsonl_manifest(str(path))


# --- prepare + prepared format -------------------------------------------------------------


def test_prepare_matches_direct_encoding(assets, tmp_path):
    out = tmp_path / "prepared"
    summary = prepare_dataset(
        assets["manifest"], assets["codec"], assets["tok"], str(out), batch_size=1, progress=False
    )
    assert summary["num_items"] == 6 and sorted(os.listdir(tmp_path)) == ["prepared"]
    ds = PreparedDataset(str(out))
    codec, tok = load_codec(assets["codec"]), load_text_tokenizer(assets["tok"])
    items = read_jsonl_manifest(assets["manifest"])
    assert len(ds) == 6 and ds.metadata["codec"]["config_hash"] == codec.config_hash
    assert ds.metadata["tokenizer"] == tokenizer_fingerprint(tok)
    shard = out / "shards" / "00000"
    assert np.load(shard / AUDIO_CODES).dtype == np.int16
    assert np.load(shard / TEXT_TOKENS).dtype == np.int32
    assert list(ds.kinds) == ["speech"] * 6
    for i, item in enumerate(items):
        wav = load_audio(item.audio, codec.sample_rate)
        got = ds[i]
        assert got.id == item.id and got.text == item.text and got.turns is None
        np.testing.assert_array_equal(got.audio_codes, codec.encode([wav])[0])  # batch of 1
        assert got.text_tokens.tolist() == tok(item.text, add_special_tokens=False)["input_ids"]
        assert got.seconds == pytest.approx(len(wav) / SR)
        assert ds.text_lengths[i] == len(got.text_tokens)
        assert ds.audio_lengths[i] == len(got.audio_codes)
    assert ds.metadata["total_frames"] == sum(ds[i].audio_codes.shape[0] for i in range(len(ds)))
    check_compatible(ds.metadata, ds.metadata)
    other = json.loads(json.dumps(ds.metadata))
    other["codec"]["num_streams"] = 8
    with pytest.raises(ValueError, match="codec.num_streams"):
        check_compatible(ds.metadata, other)


def test_batched_prepare_matches_unbatched(assets, tmp_path):
    """Length-sorted batches pad little, and Encodec is causal: codes barely depend on batching."""
    one, many = tmp_path / "one", tmp_path / "many"
    prepare_dataset(assets["manifest"], assets["codec"], assets["tok"], str(one), batch_size=1,
                    progress=False)  # fmt: skip
    prepare_dataset(assets["manifest"], assets["codec"], assets["tok"], str(many), batch_size=4,
                    progress=False)  # fmt: skip
    a, b = PreparedDataset(str(one)), PreparedDataset(str(many))
    for i in range(len(a)):
        assert a[i].audio_codes.shape == b[i].audio_codes.shape
        assert (a[i].audio_codes != b[i].audio_codes).any(axis=1).mean() <= 0.1


def _abs_rows(assets) -> list[dict]:
    base = os.path.dirname(assets["manifest"])
    return [dict(r, audio=os.path.join(base, r["audio"])) for r in assets["rows"]]


def test_strict_missing_audio_leaves_nothing(assets, tmp_path):
    rows = _abs_rows(assets)
    rows[3]["audio"] = str(tmp_path / "gone.wav")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    with pytest.raises(
        BadItemError, match=r"m\.jsonl:4: item 'a3' \(audio .*gone\.wav\): audio file not found"
    ):
        prepare_dataset(str(manifest), assets["codec"], assets["tok"], str(out), progress=False,
                        strict=True)  # fmt: skip
    assert sorted(os.listdir(tmp_path)) == ["m.jsonl"]


def test_strict_unreadable_audio_mid_run_removes_output(assets, tmp_path):
    corpus = tmp_path / "c"
    shutil.copytree(os.path.dirname(assets["manifest"]), corpus)
    (corpus / "wavs" / "a5.wav").write_bytes(b"RIFF garbage")
    out = tmp_path / "out"
    with pytest.raises(BadItemError, match=r"manifest\.jsonl:6: item 'a5'.*unreadable"):
        prepare_dataset(str(corpus / "manifest.jsonl"), assets["codec"], assets["tok"], str(out),
                        batch_size=2, progress=False, strict=True)  # fmt: skip
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_prepare_refuses_to_overwrite_then_overwrites(assets, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    args = ["--manifest", assets["manifest"], "--codec", assets["codec"],
            "--tokenizer", assets["tok"], "--out-dir", str(out)]  # fmt: skip
    assert main(args + ["--no-progress"]) == 1
    assert "not empty" in capsys.readouterr().err and (out / "keep.txt").exists()
    assert main(args + ["--overwrite", "--codec-batch-size", "3"]) == 0
    captured = capsys.readouterr()
    assert "6 items written" in captured.out and "prepare: 6/6 items" in captured.err
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert sorted(os.listdir(out)) == ["failures.jsonl", "metadata.json", "plan.json", "shards",
                                       "summary.json"]  # fmt: skip
    assert len(PreparedDataset(str(out))) == 6 and not (out / "keep.txt").exists()
    assert "index" in os.listdir(out)  # the reader's mapped index (data/index_store.py)


def test_corrupt_prepared_dataset_is_reported(assets, tmp_path):
    out = tmp_path / "ds"
    prepare_dataset(assets["manifest"], assets["codec"], assets["tok"], str(out), progress=False,
                    shard_size=2)  # fmt: skip
    codes = out / "shards" / "00001" / AUDIO_CODES
    data = codes.read_bytes()
    codes.write_bytes(data[: len(data) - 64])
    with pytest.raises(CorruptDatasetError, match=r"shards/00001/audio_codes\.npy.*truncated"):
        PreparedDataset(str(out))
    np.save(codes, np.zeros((3, 4), dtype=np.int16))  # readable, but disagrees with the index
    with pytest.raises(CorruptDatasetError, match=r"shards/00001/audio_codes\.npy has \d+ bytes"):
        PreparedDataset(
            str(out)
        )  # the size recorded in metadata.json (tests/unit/trainer/test_fault_handling.py)
    with pytest.raises(CorruptDatasetError, match=r"shards/00001/audio_codes\.npy has 3 rows"):
        PreparedDataset(str(out), verify="none")  # the index check behind it
    shutil.rmtree(out / "shards" / "00002")
    meta = json.loads((out / "metadata.json").read_text())
    (out / "metadata.json").write_text(json.dumps(dict(meta, format_version=1)))
    with pytest.raises(CorruptDatasetError, match="format_version 1 is not supported"):
        PreparedDataset(str(out))
    (out / "metadata.json").write_text(json.dumps(meta))
    codes.write_bytes(data)  # shard 00001 intact again
    with pytest.raises(CorruptDatasetError, match=r"shard .*shards/00002 is missing"):
        PreparedDataset(str(out))
    with pytest.raises(CorruptDatasetError, match="not found"):
        PreparedDataset(str(tmp_path / "nope"))


@pytest.mark.skipif(not needs_espeak, reason="espeak-ng binary not installed")
def test_espeak_corpus_prepares(assets, tmp_path):
    sentences = demo_assets.load_sentences()
    manifest = demo_assets.synthesize_corpus(str(tmp_path / "speech"), sentences, n=8)
    mtime = os.path.getmtime(manifest)
    assert demo_assets.synthesize_corpus(str(tmp_path / "speech"), sentences, n=8) == manifest
    assert os.path.getmtime(manifest) == mtime  # idempotent: nothing redone
    items = read_jsonl_manifest(manifest)
    assert [it.text for it in items] == sentences[:8]
    info = sf.info(items[0].audio)
    assert info.samplerate == SR and 0.5 < info.duration < 10
    summary = prepare_dataset(
        manifest, assets["codec"], assets["tok"], str(tmp_path / "ds"), progress=False
    )
    assert summary["num_items"] == 8 and summary["total_frames"] > 8 * 25


def test_codec_hash_covers_the_weights(tmp_path):
    """Same config, other weights: other codes, so it must be another codec identity."""
    from torchtitan_speechlm.codecs import load_codec

    a = load_codec(build_codec(str(tmp_path / "a"), seed=0))
    b = load_codec(build_codec(str(tmp_path / "b"), seed=1))
    c = load_codec(build_codec(str(tmp_path / "c"), seed=0))
    assert a.config_hash != b.config_hash
    assert a.config_hash == c.config_hash
