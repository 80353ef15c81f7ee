"""decode_batch and stream_decoder: every item of a batch decodes as it does alone; a stream
gives exactly ``frames * samples_per_frame`` samples, starts within a few frames and stays close
to the whole-clip decode; the k-means Griffin-Lim settings are decode-time only (config_hash
unchanged). For the k-means codec (fitted on espeak speech at 50 and 25 frames/s), the tiny
transformers codecs and a codec of the user's that has neither call."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from tests.data_fixtures import needs_espeak
from tests.tiny_codecs import build_codec
from torchtitan_speechlm.codecs import config_hash, load_codec, register_codec
from torchtitan_speechlm.codecs.kmeans import (
    GRIFFIN_LIM_ITERS,
    fit_kmeans_codec,
    log_mel_distance,
)
from torchtitan_speechlm.demo import assets as demo_assets
from torchtitan_speechlm.prepare.sources.jsonl import read_jsonl_manifest
from torchtitan_speechlm.utils.audio import load_audio

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
LENGTHS = (1, 2, 5, 17, 40, 73)  # frames: shorter than a window, around it, longer
CHUNKS = (1, 3, 7)
espeak = pytest.mark.skipif(not needs_espeak, reason="espeak-ng binary not installed")


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    """24 espeak utterances: 20 to fit k-means codecs on (50 and 25 frames/s), 4 held out."""
    if not needs_espeak:
        pytest.skip("espeak-ng binary not installed")
    root = tmp_path_factory.mktemp("stream")
    manifest = demo_assets.synthesize_corpus(
        str(root / "corpus"), demo_assets.load_sentences(), n=24
    )
    wavs = [load_audio(it.audio, 16000) for it in read_jsonl_manifest(manifest)]
    dirs = {
        rate: fit_kmeans_codec(wavs[:20], str(root / f"km{rate}"), 4, 64, frame_rate=rate)
        for rate in (50, 25)
    }
    return {"wavs": wavs[20:], "dirs": dirs}


def _stream(codec, codes: np.ndarray, chunk: int, **kw) -> tuple[list[np.ndarray], object]:
    dec = codec.stream_decoder(**kw)
    outs = [dec.push(codes[i : i + chunk]) for i in range(0, len(codes), chunk)]
    return [*outs, dec.flush()], dec


def _random_codes(codec, lengths, seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, codec.codebook_size, (n, codec.num_streams)) for n in lengths]


# ---- k-means ------------------------------------------------------------------------------------
@espeak
@pytest.mark.parametrize("rate", [50, 25])
@pytest.mark.parametrize("momentum", [0.99, 0.0])
def test_kmeans_batch_items_equal_their_decode_alone(speech, rate, momentum):
    codec = load_codec(speech["dirs"][rate])
    codec.griffin_lim_momentum = momentum
    codes = [*_random_codes(codec, LENGTHS), *codec.encode(speech["wavs"][:2])]
    codes.insert(2, np.zeros((0, 4), np.int64))
    alone = [codec.decode(c) for c in codes]
    for bins in (None, codec.batch_bins):  # one padded batch, and the CPU's cache-sized groups
        codec.batch_bins = bins
        batch = codec.decode_batch(codes)
        assert len(batch) == len(codes)
        for c, a, b in zip(codes, alone, batch, strict=True):
            assert a.shape == b.shape == (len(c) * codec.samples_per_frame,)
            assert a.dtype == b.dtype == np.float32
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-4)
    assert codec.decode_batch([]) == []
    with pytest.raises(ValueError, match="expected codes"):
        codec.decode_batch([np.zeros((3, 2), np.int64)])


@espeak
def test_griffin_lim_settings_are_decode_time_and_keep_the_config_hash(speech):
    path = speech["dirs"][50]
    codec = load_codec(path)
    config = json.load(open(os.path.join(path, "config.json")))
    assert codec.config_hash == config_hash(config, path)
    assert config["griffin_lim_iters"] == 48  # written by the fit as before: same identity
    assert (codec.griffin_lim_iters, codec.griffin_lim_momentum) == (GRIFFIN_LIM_ITERS, 0.99)
    codes = codec.encode(speech["wavs"][:1])[0]
    before, default = codec.config_hash, codec.decode(codes)
    outs = {}
    for iters, momentum in ((4, 0.99), (32, 0.99), (32, 0.0)):
        codec.griffin_lim_iters, codec.griffin_lim_momentum = iters, momentum
        outs[iters, momentum] = codec.decode(codes)
        assert codec.config_hash == before
    assert load_codec(path).config_hash == before
    assert json.load(open(os.path.join(path, "config.json"))) == config
    assert not np.allclose(outs[4, 0.99], outs[32, 0.99])  # the settings are used
    assert not np.allclose(outs[32, 0.0], outs[32, 0.99])
    w = speech["wavs"][0]
    # more iterations: closer to the input; the default is as close as 32 (within 0.2 dB)
    d4, d32 = (log_mel_distance(w, outs[k][: len(w)]) for k in ((4, 0.99), (32, 0.99)))
    assert d32 < d4 and log_mel_distance(w, default[: len(w)]) < d32 + 0.2


def test_the_default_iterations_are_the_benchmarks_choice():
    """GRIFFIN_LIM_ITERS is what benchmarks/bench_codec_decode.py chose (docs/generation.md)."""
    with open(os.path.join(ROOT, "benchmarks", "results", "codec_decode_cpu.json")) as f:
        result = json.load(f)
    assert result["chosen_iters"] == GRIFFIN_LIM_ITERS


@espeak
@pytest.mark.parametrize("rate", [50, 25])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_kmeans_stream_length_and_how_early_it_speaks(speech, rate, chunk):
    codec = load_codec(speech["dirs"][rate])
    codes = codec.encode(speech["wavs"][:1])[0]
    hop, half = codec.samples_per_frame, codec.cfg.n_fft // 2
    outs, dec = _stream(codec, codes, chunk)
    assert sum(len(o) for o in outs) == len(codes) * hop
    assert all(o.dtype == np.float32 for o in outs)
    # held back: the lookahead frames and half a window, 3.6 frames at 50/s, 2 at 25/s
    assert dec.holdback == half and dec.latency_samples == dec.lookahead_frames * hop + half
    assert dec.latency_samples <= 4 * hop
    pushed = returned = 0
    for o in outs[:-1]:
        pushed, returned = min(len(codes), pushed + chunk), returned + len(o)
        assert pushed * hop - returned == min(pushed * hop, dec.latency_samples)
    first_frames = dec.lookahead_frames + half // hop + 1  # frames before the first sample
    assert first_frames <= 4
    assert next(i for i, o in enumerate(outs) if len(o)) == math.ceil(first_frames / chunk) - 1


@espeak
@pytest.mark.parametrize("rate", [50, 25])
def test_kmeans_stream_is_as_close_to_the_input_as_the_batch_decode(speech, rate):
    """A stream estimates its phases causally, so its samples are not the whole-clip decode's,
    but its spectrum is: its log-mel distance to the input is within 0.3 dB of the batch
    decode's, and to the batch decode itself a small fraction of what another utterance or
    noise is."""
    codec = load_codec(speech["dirs"][rate])
    rng = np.random.default_rng(0)
    for w in speech["wavs"][:2]:
        codes = codec.encode([w])[0]
        batch = codec.decode(codes)
        noise = (rng.standard_normal(len(batch)) * batch.std()).astype(np.float32)
        for chunk in CHUNKS:
            stream = np.concatenate(_stream(codec, codes, chunk)[0])
            assert log_mel_distance(w, stream) <= log_mel_distance(w, batch) + 0.3
            assert log_mel_distance(batch, stream) < 0.2 * log_mel_distance(batch, noise)


@espeak
def test_kmeans_stream_edge_cases(speech):
    codec = load_codec(speech["dirs"][50])
    dec = codec.stream_decoder()
    assert len(dec.push(np.zeros((0, 4), np.int64))) == 0 and len(dec.flush()) == 0
    dec = codec.stream_decoder()
    assert len(dec.push(np.ones((1, 4), np.int64))) == 0  # inside the lookahead
    assert len(dec.flush()) == 320
    with pytest.raises(RuntimeError, match="push after flush"):
        dec.push(np.ones((1, 4), np.int64))
    with pytest.raises(ValueError, match="expected codes"):
        codec.stream_decoder().push(np.ones((2, 3), np.int64))
    with pytest.raises(ValueError, match="lookahead_frames"):
        codec.stream_decoder(lookahead_frames=-1)
    # one push of everything, then flush: the same length, the same quality as in pieces
    codes = codec.encode(speech["wavs"][:1])[0]
    whole = np.concatenate(_stream(codec, codes, len(codes))[0])
    assert len(whole) == len(codes) * 320


# ---- transformers codecs ------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["encodec", "mimi", "dac"])
def neural(request, tmp_path_factory):
    return load_codec(build_codec(str(tmp_path_factory.mktemp(request.param)), request.param))


def test_transformers_batch_items_equal_their_decode_alone(neural):
    codes = _random_codes(neural, (*LENGTHS, 16, 17), seed=1)  # around pad_exact_from too
    codes.insert(1, np.zeros((0, neural.num_streams), np.int64))
    alone = [neural.decode(c) if len(c) else np.zeros(0, np.float32) for c in codes]
    batch = neural.decode_batch(codes)
    peak = max(float(np.abs(a).max()) for a in alone if len(a))
    for c, a, b in zip(codes, alone, batch, strict=True):
        assert b.shape == (len(c) * neural.samples_per_frame,) and b.dtype == np.float32
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * peak)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_transformers_stream_length_start_and_closeness(neural, chunk):
    """Chunked decode with overlap: exact length; the first samples come after the first push
    (causal codecs) or once the lookahead frames are in (DAC); close to the whole-clip decode
    (the left context and the lookahead cover the tiny decoders' receptive field)."""
    (codes,) = _random_codes(neural, (60,), seed=2)
    spf = neural.samples_per_frame
    outs, dec = _stream(neural, codes, chunk)
    got = np.concatenate(outs)
    assert len(got) == 60 * spf
    first = next(i for i, o in enumerate(outs) if len(o))
    assert first * chunk < dec.lookahead_frames + 1
    assert dec.lookahead_frames == (4 if neural.name == "dac" else 0)
    full = neural.decode(codes)
    rms = float(np.sqrt(np.mean((got - full) ** 2) / np.mean(full**2)))
    assert rms < 2e-3, rms


# ---- a codec with neither call: load_codec's defaults ---------------------------------------------
class FrameCodec:
    """1 codebook of 8: each 160-sample frame decodes to a constant (no batch, no stream)."""

    name, class_name = "frames", "FrameCodec"
    sample_rate, samples_per_frame, codebook_size, frame_rate = 16000, 160, 8, 100.0

    def __init__(self, path, config, device="cpu"):
        self.path, self.config_hash = path, config_hash(config, path)
        self.num_streams = self.total_streams = 1

    def keep_streams(self, n):
        self.num_streams = n

    def encode(self, wavs):
        return [np.zeros((math.ceil(len(w) / 160), 1), np.int64) for w in wavs]

    def decode(self, codes):
        return np.repeat(np.asarray(codes)[:, 0] / 8.0, 160).astype(np.float32)


def test_a_codec_without_batch_or_stream_gets_the_defaults(tmp_path):
    register_codec("frame_codec_test", FrameCodec)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "frame_codec_test"}))
    codec = load_codec(str(tmp_path))
    codes = [np.arange(n)[:, None] % 8 for n in (3, 10)]
    for a, b in zip(codec.decode_batch(codes), codes, strict=True):
        np.testing.assert_array_equal(a, codec.decode(b))
    for chunk in CHUNKS:
        (c,) = [np.arange(25)[:, None] % 8]
        outs, dec = _stream(codec, c, chunk)
        np.testing.assert_allclose(np.concatenate(outs), codec.decode(c), atol=1e-6)
        assert dec.lookahead_frames == math.ceil(0.1 * 100)
