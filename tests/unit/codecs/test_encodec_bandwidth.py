"""Encodec's bandwidth follows ``--num-streams`` (issue 37): the smallest configured target
bandwidth giving at least K codebooks is asked for, and the first K codes are stored."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.data_fixtures import write_manifest
from tests.tiny_codecs import _calibrate
from torchtitan_speechlm.codecs import load_codec
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.demo import assets as demo_assets
from torchtitan_speechlm.prepare.pipeline import prepare_dataset


@pytest.fixture(scope="module")
def encodec_dir(tmp_path_factory):
    """A random-init Encodec (16 kHz, 50 frames/s, codebooks of 64 = 300 bit/s each) whose
    target bandwidths 0.6 / 1.2 / 2.4 kbps give 2 / 4 / 8 codebooks."""
    from transformers import EncodecConfig, EncodecModel

    cfg = EncodecConfig(
        sampling_rate=16000, target_bandwidths=[0.6, 1.2, 2.4], upsampling_ratios=[8, 5, 4, 2],
        hidden_size=32, num_filters=8, num_lstm_layers=1, codebook_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = EncodecModel(cfg).eval()
    _calibrate(model, "encodec")
    out = str(tmp_path_factory.mktemp("encodec"))
    model.save_pretrained(out)
    return out


def _wavs():
    rng = np.random.default_rng(0)
    t = np.arange(16000) / 16000
    return [
        (0.4 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(16000)).astype(np.float32),
        (0.2 * rng.standard_normal(9000)).astype(np.float32),
    ]


def _spy(codec) -> list:
    """Record the bandwidth of every encode call the codec makes."""
    asked, encode = [], codec.model.encode

    def spy(*a, **kw):
        asked.append(kw.get("bandwidth"))
        return encode(*a, **kw)

    codec.model.encode = spy
    return asked


@pytest.mark.parametrize(
    ("k", "bandwidth", "exact"), [(2, 0.6, True), (4, 1.2, True), (3, 1.2, False), (5, 2.4, False)]
)
def test_encodec_encodes_at_the_smallest_bandwidth_giving_k(encodec_dir, k, bandwidth, exact):
    full = load_codec(encodec_dir)
    assert full.total_streams == full.num_streams == 8 and full.bandwidth == 2.4
    asked_full = _spy(full)
    wavs = _wavs()
    ref = full.encode(wavs)
    assert asked_full == [2.4]  # without --num-streams: every codebook, the highest bandwidth

    codec = load_codec(encodec_dir, num_streams=k)
    assert (codec.num_streams, codec.total_streams, codec.bandwidth) == (k, 8, bandwidth)
    asked = _spy(codec)
    got = codec.encode(wavs)
    assert asked == [bandwidth]
    for g, r in zip(got, ref, strict=True):
        assert g.shape == (r.shape[0], k)
        np.testing.assert_array_equal(g, r[:, :k])  # residual codes: the first K are the same
    assert f"{bandwidth:g} kbps" in codec.bandwidth_note
    assert ("keeping the first" in codec.bandwidth_note) == (not exact)
    audio = codec.decode(got[0])  # decodes its K codebooks
    assert audio.shape == (got[0].shape[0] * codec.samples_per_frame,)


def test_prepare_stores_the_first_k_codes_and_says_the_bandwidth(encodec_dir, tmp_path, capsys):
    sentences = demo_assets.load_sentences()
    tok = demo_assets.build_tokenizer(str(tmp_path / "tok"), sentences, vocab_size=300)
    import soundfile as sf

    rows = []
    for i, w in enumerate(_wavs()):
        sf.write(tmp_path / f"a{i}.wav", w, 16000)
        rows.append({"id": f"a{i}", "audio": f"a{i}.wav", "text": sentences[i]})
    manifest = write_manifest(tmp_path / "m.jsonl", rows)
    prepare_dataset(manifest, encodec_dir, tok, str(tmp_path / "out"), progress=False,
                    num_streams=3)  # fmt: skip
    err = capsys.readouterr().err
    assert "prepare: encodec: encoding at 1.2 kbps (4 codebooks), keeping the first 3" in err
    ds = PreparedDataset(str(tmp_path / "out"))
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert (meta["codec"]["num_streams"], meta["codec"]["total_streams"]) == (3, 8)
    ref = load_codec(encodec_dir).encode(_wavs())
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds[i].audio_codes, ref[i][:, :3])
