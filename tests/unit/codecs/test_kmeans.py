"""The offline k-means codec: fit on espeak speech, round-trip quality, codebook use,
determinism, and `torchtitan prepare --fit-kmeans-codec`."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.data_fixtures import needs_espeak
from torchtitan_speechlm.codecs import load_codec
from torchtitan_speechlm.codecs.kmeans import fit_kmeans_codec, log_mel_distance
from torchtitan_speechlm.commands.prepare import main
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.demo import assets as demo_assets
from torchtitan_speechlm.prepare.sources.jsonl import read_jsonl_manifest
from torchtitan_speechlm.utils.audio import load_audio

pytestmark = pytest.mark.skipif(not needs_espeak, reason="espeak-ng binary not installed")


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    """36 espeak utterances (~100 s): 30 to fit on, 6 held out."""
    root = tmp_path_factory.mktemp("km")
    manifest = demo_assets.synthesize_corpus(
        str(root / "corpus"), demo_assets.load_sentences(), n=36
    )
    wavs = [load_audio(it.audio, 16000) for it in read_jsonl_manifest(manifest)]
    t0 = time.monotonic()
    codec_dir = fit_kmeans_codec(
        wavs[:30], str(root / "km"), num_codebooks=4, codebook_size=64, seed=0
    )
    fit_s = time.monotonic() - t0
    return {"root": root, "manifest": manifest, "wavs": wavs, "dir": codec_dir, "fit_s": fit_s}


def test_fit_is_fast_and_loads_as_a_codec(speech):
    assert speech["fit_s"] < 30, f"fit took {speech['fit_s']:.1f}s on ~90 s of audio"
    cfg = json.load(open(os.path.join(speech["dir"], "config.json")))
    assert cfg["model_type"] == "speechlm_kmeans"
    codec = load_codec(speech["dir"])
    assert (codec.name, codec.sample_rate, codec.frame_rate) == ("kmeans", 16000, 50.0)
    assert (codec.num_streams, codec.codebook_size, len(codec.config_hash)) == (4, 64, 16)
    codes = codec.encode([speech["wavs"][30], np.zeros(321, np.float32)])
    assert codes[0].shape == (int(np.ceil(len(speech["wavs"][30]) / 320)), 4)
    assert codes[1].shape == (2, 4) and codes[0].dtype == np.int64
    assert codec.decode(codes[0]).shape == (codes[0].shape[0] * 320,)


def test_round_trip_is_close_in_log_mel(speech):
    """Encode -> decode (Griffin-Lim) keeps the log-mel spectrogram within a few dB, far below
    what noise of the same loudness or another utterance gives."""
    codec = load_codec(speech["dir"])
    rng = np.random.default_rng(0)
    for w in speech["wavs"][30:33]:  # held out: not seen by the fit
        y = codec.decode(codec.encode([w])[0])
        d = log_mel_distance(w, y)
        noise = (rng.standard_normal(len(w)) * np.sqrt(np.mean(w**2))).astype(np.float32)
        d_noise = log_mel_distance(w, noise)
        other = np.resize(speech["wavs"][0], len(w))
        assert d < 6.0 and d < 0.3 * d_noise and d < 0.5 * log_mel_distance(w, other), (d, d_noise)


def test_codes_use_the_codebooks(speech):
    codec = load_codec(speech["dir"])
    codes = np.concatenate(codec.encode(speech["wavs"][:30]))
    used = [len(np.unique(codes[:, k])) / 64 for k in range(4)]
    assert min(used) > 0.9, used  # every centroid was fitted on these frames
    held = np.concatenate(codec.encode(speech["wavs"][30:]))
    assert min(len(np.unique(held[:, k])) / 64 for k in range(4)) > 0.5


def test_same_seed_same_centroids(speech, tmp_path):
    wavs = speech["wavs"][:30]
    a = fit_kmeans_codec(wavs, str(tmp_path / "a"), 4, 64, seed=0)
    b = fit_kmeans_codec(wavs, str(tmp_path / "c"), 4, 64, seed=1)
    ref = load_file(os.path.join(speech["dir"], "model.safetensors"))
    np.testing.assert_array_equal(load_file(os.path.join(a, "model.safetensors"))["books"],
                                  ref["books"])  # fmt: skip
    assert load_codec(a).config_hash == load_codec(speech["dir"]).config_hash
    assert load_codec(b).config_hash != load_codec(a).config_hash
    assert not np.array_equal(load_file(os.path.join(b, "model.safetensors"))["books"],
                              ref["books"])  # fmt: skip


FIT_AND_ENCODE = """
import hashlib, json, sys, numpy as np
from torchtitan_speechlm.codecs import load_codec
from torchtitan_speechlm.codecs.kmeans import fit_kmeans_codec
from torchtitan_speechlm.utils.audio import load_audio
wavs = [load_audio(p, 16000) for p in json.loads(sys.argv[1])]
codec = load_codec(fit_kmeans_codec(wavs[:12], sys.argv[2], 4, 64, seed=0, iters=8))
codes = np.concatenate(codec.encode(wavs[12:]))
print(json.dumps([codec.config_hash, hashlib.sha256(codes.tobytes()).hexdigest()]))
"""


def test_a_fit_gives_the_same_codec_on_another_cpu_code_path(speech, tmp_path):
    """The same fit under MKL's AVX2 kernels with one thread and under its default (AVX-512 on
    this machine) with two: the same codebooks (the codec's config_hash: its weights and
    config), and the same codes of held-out audio. A float32 fit (the one before) gave other
    codebooks here under AVX2."""
    import subprocess
    import sys

    paths = [str(p) for p in sorted((speech["root"] / "corpus" / "wavs").glob("*.wav"))[:18]]
    out = []
    for i, env in enumerate(({"MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "1"},
                             {"OMP_NUM_THREADS": "2"})):  # fmt: skip
        r = subprocess.run(
            [sys.executable, "-c", FIT_AND_ENCODE, json.dumps(paths), str(tmp_path / f"f{i}")],
            capture_output=True, text=True, timeout=300, env=dict(os.environ, **env),
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert out[0] == out[1]


def test_a_codec_fitted_before_loads_and_encodes_as_it_was_made(speech, tmp_path):
    """A folder of the float32 fit (``centroids``, no ``fit`` key) keeps its own path."""
    import shutil

    from safetensors.numpy import save_file

    from torchtitan_speechlm.codecs.residual_kmeans import GRID

    old = tmp_path / "old"
    shutil.copytree(speech["dir"], old)
    w = load_file(os.path.join(old, "model.safetensors"))
    save_file({"centroids": (w["books"] * GRID).astype(np.float32),
               "mel_mean": w["mel_mean"].astype(np.float32),
               "mel_std": w["mel_std"].astype(np.float32)},
              os.path.join(old, "model.safetensors"))  # fmt: skip
    cfg = json.load(open(old / "config.json"))
    del cfg["fit"]
    json.dump(cfg, open(old / "config.json", "w"))
    codec = load_codec(str(old))
    assert not codec.exact
    codes = codec.encode(speech["wavs"][30:32])
    new = load_codec(speech["dir"]).encode(speech["wavs"][30:32])
    agree = np.mean(np.concatenate(codes) == np.concatenate(new))
    assert agree > 0.9, agree  # the same codebooks, float32 features: nearly the same codes


def test_prepare_fits_kmeans_codec_then_reuses_it(speech, tmp_path, capsys):
    tok = demo_assets.build_tokenizer(str(tmp_path / "tok"), demo_assets.load_sentences())
    km, out = tmp_path / "km", tmp_path / "out"
    args = ["--manifest", speech["manifest"], "--fit-kmeans-codec", str(km), "--codebooks", "3",
            "--codebook-size", "32", "--kmeans-seconds", "40", "--tokenizer", tok, "--out-dir",
            str(out), "--shard-size", "10", "--num-streams", "2"]  # fmt: skip
    assert main(args) == 0
    assert "fitted k-means codec" in capsys.readouterr().err
    ds = PreparedDataset(str(out))
    meta = ds.metadata["codec"]
    assert (meta["name"], meta["num_streams"], meta["total_streams"], meta["codebook_size"]) == (
        "kmeans", 2, 3, 32)  # fmt: skip
    assert len(ds) == 36 and ds[0].audio_codes.shape[1] == 2
    mtime = os.stat(km / "model.safetensors").st_mtime_ns
    assert main(args) == 0  # rerun: codec reused, every shard reused
    assert os.stat(km / "model.safetensors").st_mtime_ns == mtime
    assert "4 reused" in capsys.readouterr().out
    assert main(args + ["--kaldi", str(tmp_path)]) == 1
    assert "give exactly one source" in capsys.readouterr().err
    assert main(args + ["--codec", str(km)]) == 1
    assert "exactly one of --codec DIR, --fit-kmeans-codec DIR" in capsys.readouterr().err


def test_a_lower_frame_rate_gives_fewer_frames_and_still_round_trips(speech, tmp_path):
    """``frame_rate=25``: a 640-sample hop (half the frames of 50/s), an FFT twice the hop,
    and a round trip that stays far closer to the input than another utterance is."""
    out = fit_kmeans_codec(
        speech["wavs"][:30], str(tmp_path / "km25"), num_codebooks=4, codebook_size=64,
        frame_rate=25,
    )  # fmt: skip
    codec = load_codec(out)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert (codec.frame_rate, cfg["hop_length"], cfg["n_fft"]) == (25.0, 640, 1280)
    w, other = speech["wavs"][30], speech["wavs"][31]
    codes = codec.encode([w])[0]
    assert codes.shape == (int(np.ceil(len(w) / 640)), 4)
    back = codec.decode(codes)[: len(w)]
    n = min(len(w), len(other))
    assert log_mel_distance(w, back) < 0.5 * log_mel_distance(w[:n], other[:n])
    with pytest.raises(ValueError, match="frame rate 30"):
        fit_kmeans_codec(speech["wavs"][:30], str(tmp_path / "bad"), frame_rate=30)


def test_prepare_refits_nothing_but_refuses_another_frame_rate(speech, tmp_path):
    """`--kmeans-frame-rate` reaches the fit, and a codec folder fitted at another rate is
    not silently reused."""
    out, codec = str(tmp_path / "p"), str(tmp_path / "codec")
    tok = demo_assets.build_tokenizer(str(tmp_path / "tok"), demo_assets.load_sentences())
    args = ["--manifest", speech["manifest"], "--fit-kmeans-codec", codec, "--tokenizer", tok,
            "--codebook-size", "64", "--kmeans-seconds", "60", "--no-progress"]  # fmt: skip
    assert main([*args, "--out-dir", out, "--kmeans-frame-rate", "25"]) == 0
    assert load_codec(codec).frame_rate == 25.0
    assert main([*args, "--out-dir", out + "2"]) == 1  # 50/s asked, a 25/s codec there
