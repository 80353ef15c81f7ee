"""OpenAI's speech response formats (serving/audio_formats.py), checked by decoding what is
written with independent readers (libsndfile through soundfile; FFmpeg through PyAV for aac):
each file starts with its format's magic bytes, decodes to the input's length (within the
codec's padding) and waveform (exact to 16 bits when lossless, correlated when lossy), pcm is
OpenAI's 24 kHz, streams decode to the whole file's audio, and formats this install cannot
write are refused with a message that lists those it can."""

import io

import numpy as np
import pytest
import soundfile as sf

from torchtitan_speechlm.serving.audio_formats import (
    OPENAI_FORMATS,
    PCM_RATE,
    SPEECH_FORMATS,
    STREAM_FORMATS,
    AudioStream,
    FormatError,
    content_type,
    encode_audio,
    stream_audio,
)

LOSSY = ("mp3", "opus", "aac")


def signal(rate: int, seconds: float = 1.0) -> np.ndarray:
    """A rising chirp under a slow envelope: one lag lines it up with a decoded copy."""
    t = np.arange(int(rate * seconds)) / rate
    chirp = np.sin(2 * np.pi * (200 * t + 600 * t**2))
    return (0.5 * chirp * (0.6 + 0.4 * np.sin(2 * np.pi * 1.5 * t))).astype(np.float32)


def as16(x: np.ndarray) -> np.ndarray:
    return np.round(np.clip(x, -1, 1) * 32767).astype(np.int16)


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    if fmt == "aac":
        av = pytest.importorskip("av")
        with av.open(io.BytesIO(data)) as f:
            rate = f.streams.audio[0].codec_context.sample_rate
            y = np.concatenate([fr.to_ndarray().reshape(-1) for fr in f.decode(audio=0)])
        return y.astype(np.float32), rate
    y, rate = sf.read(io.BytesIO(data), dtype="float32")
    return y, rate


def shifted(x: np.ndarray, y: np.ndarray, lag: int) -> tuple[np.ndarray, np.ndarray]:
    """The overlap of ``x[i]`` and ``y[i + lag]``."""
    lo, hi = max(0, -lag), min(x.size, y.size - lag)
    return x[lo:hi], y[lo + lag : hi + lag]


def aligned(x: np.ndarray, y: np.ndarray, max_lag: int) -> tuple[np.ndarray, np.ndarray]:
    """``x`` and the part of ``y`` that lines up with it best (decoders may keep priming, or
    shift by a sample resampling the priming length)."""
    lag = max(range(-8, max_lag + 1), key=lambda lag: float(np.dot(*shifted(x, y, lag))))
    return shifted(x, y, lag)


@pytest.mark.parametrize("fmt", SPEECH_FORMATS)
@pytest.mark.parametrize("rate", [16000, 24000])
def test_each_format_decodes_back_to_the_input(fmt, rate):
    x = signal(rate)
    data = encode_audio(x, rate, fmt)
    if fmt in ("wav", "flac") or (fmt == "pcm" and rate == PCM_RATE):  # lossless, 16 bits
        y16 = (
            np.frombuffer(data, "<i2")
            if fmt == "pcm"
            else sf.read(io.BytesIO(data), dtype="int16")[0]
        )
        np.testing.assert_array_equal(y16, as16(x))
        return
    if fmt == "pcm":
        y, out_rate = np.frombuffer(data, "<i2") / 32768, PCM_RATE
        assert y.size == x.size * PCM_RATE // rate
        # OpenAI's 24 kHz, compared at the input's rate by an independent (linear) resampling
        y = np.interp(np.arange(x.size) / rate, np.arange(y.size) / out_rate, y)
    else:
        y, out_rate = decode(data, fmt)
        assert y.ndim == 1 and out_rate == rate
    # decoders drop mp3's and opus's priming (LAME's gapless header, Opus pre-skip); FFmpeg
    # gives aac's 1024 priming samples and pads the last 1024-sample frame
    pad = {"mp3": 1152, "opus": 960, "aac": 2048, "pcm": 0}[fmt]
    assert x.size <= y.size <= x.size + pad
    a, b = aligned(x, y, max_lag=pad + 8)
    assert a.size > 0.95 * x.size
    corr = np.corrcoef(a, b)[0, 1]
    assert corr > (0.99 if fmt == "pcm" else 0.97), (fmt, corr)


@pytest.mark.skipif("opus" not in SPEECH_FORMATS, reason="this libsndfile writes no opus")
def test_opus_is_resampled_to_a_rate_it_takes_keeping_time_and_pitch():
    rate, t = 22050, np.arange(22050) / 22050
    y, out_rate = decode(encode_audio(np.sin(2 * np.pi * 440 * t) / 2, rate, "opus"), "opus")
    assert out_rate == 24000 and abs(y.size - 24000) <= 960
    spectrum = np.abs(np.fft.rfft(y * np.hanning(y.size)))
    assert abs(np.argmax(spectrum) * out_rate / y.size - 440) < 3


def test_magic_bytes_and_content_types():
    x, magic = signal(24000, 0.3), {}
    for fmt in SPEECH_FORMATS:
        magic[fmt] = encode_audio(x, 24000, fmt)[:64]
    assert magic["wav"][:4] == b"RIFF" and magic["wav"][8:12] == b"WAVE"
    if "flac" in magic:
        assert magic["flac"][:4] == b"fLaC"
    if "opus" in magic:  # the first Ogg page holds the Opus identification header
        assert magic["opus"][:4] == b"OggS" and magic["opus"][28:36] == b"OpusHead"
    if "mp3" in magic:  # an ID3 tag, or an MPEG audio frame sync with layer III
        m = magic["mp3"]
        assert m[:3] == b"ID3" or (m[0] == 0xFF and m[1] & 0xE0 == 0xE0 and m[1] & 0x06 == 0x02)
    if "aac" in magic:  # ADTS: sync word, MPEG-4, no CRC
        assert magic["aac"][:2] == b"\xff\xf1"
    expected = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac",
                "mp3": "audio/mpeg", "aac": "audio/aac"}  # fmt: skip
    for fmt in SPEECH_FORMATS:
        assert content_type(fmt) == expected.get(fmt, "audio/ogg; codecs=opus")


def test_this_install_writes_the_formats_its_libraries_have():
    assert {"wav", "pcm"} <= set(SPEECH_FORMATS) <= set(OPENAI_FORMATS)
    assert ("opus" in SPEECH_FORMATS) == ("OPUS" in sf.available_subtypes("OGG"))
    assert ("mp3" in SPEECH_FORMATS) == ("MP3" in sf.available_formats())


@pytest.mark.parametrize(
    "fmt", ["ogg", "m4a", "WAV", ""] + [f for f in OPENAI_FORMATS if f not in SPEECH_FORMATS]
)
def test_formats_it_cannot_write_are_refused_with_the_list(fmt):
    for call in (lambda: encode_audio(signal(16000, 0.1), 16000, fmt), lambda: content_type(fmt)):
        with pytest.raises(FormatError) as e:
            call()
        assert isinstance(e.value, ValueError)
        assert all(f in str(e.value) for f in SPEECH_FORMATS) and repr(fmt) in str(e.value)
    if fmt == "aac":
        assert "pip install av" in str(e.value)


def test_mono_float_input_is_clipped_not_wrapped():
    x = np.array([0.0, 1.5, -1.5, 0.5], np.float32)
    y, _ = sf.read(io.BytesIO(encode_audio(x, 16000, "wav")), dtype="int16")
    assert y.tolist() == [0, 32767, -32767, 16384]


def chunks(x: np.ndarray, seed: int = 0):
    rng, i = np.random.default_rng(seed), 0
    while i < x.size:
        n = int(rng.integers(0, 2500))  # empty pieces too
        yield x[i : i + n]
        i += n


@pytest.mark.parametrize("rate", [16000, 22050, 24000])
def test_a_pcm_stream_is_the_whole_file_byte_for_byte(rate):
    x = signal(rate, 0.7)
    streamed = b"".join(stream_audio(chunks(x), rate, "pcm"))
    assert streamed == encode_audio(x, rate, "pcm")
    assert len(streamed) == 2 * -(-x.size * PCM_RATE // rate)


def test_a_wav_stream_has_its_header_first_and_decodes_to_the_samples():
    x = signal(16000, 0.5)
    pieces = list(stream_audio(chunks(x, 1), 16000, "wav"))
    assert pieces[0][:4] == b"RIFF" and pieces[0][4:8] == b"\xff\xff\xff\xff"
    y, rate = sf.read(io.BytesIO(b"".join(pieces)), dtype="int16")
    assert rate == 16000
    np.testing.assert_array_equal(y, as16(x))


def test_an_empty_wav_stream_is_a_header_and_an_encoder_gives_bytes_as_fed():
    (only,) = stream_audio([], 24000, "wav")
    assert len(only) == 44 and only[:4] == b"RIFF" and only[40:] == b"\xff\xff\xff\xff"
    enc = AudioStream("wav", 24000)
    first = enc.feed(np.full(100, 0.25, np.float32))
    assert len(first) == 44 + 200 and enc.feed(np.zeros(10)) == bytes(20) and enc.close() == b""


@pytest.mark.parametrize("fmt", [f for f in SPEECH_FORMATS if f not in STREAM_FORMATS] + ["ogg"])
def test_formats_not_streamed_are_refused_with_the_streamed_list(fmt):
    with pytest.raises(FormatError, match="supported: wav, pcm"):
        AudioStream(fmt, 24000)
