"""Generated speech in OpenAI's ``response_format`` s: wav, pcm, flac, mp3, opus and aac.

Each format is written by a library this install has rather than by code of ours: wav and pcm by
serving/wav.py, flac, mp3 and opus by libsndfile (``soundfile``), aac by FFmpeg through PyAV,
an optional package (``av``). ``SPEECH_FORMATS`` lists what this install can write; any other
format is refused with a ``FormatError`` that lists them.

Sample rates. wav and flac keep the codec's rate (their header says it). ``pcm`` has no header
and OpenAI's clients play it at 24 kHz, so it is resampled to ``PCM_RATE`` (24000): a 16 kHz
codec's pcm would otherwise play 1.5 times too fast. mp3, opus and aac take only certain rates;
a codec rate they do not take is resampled to the next one up (opus: 8/12/16/24/48 kHz).
Resampling is scipy's polyphase filter (``resample_poly``); a stream is resampled piece by
piece with the same filter, so its bytes are those of the whole file.

Streaming (``stream_format="audio"``): ``STREAM_FORMATS`` (wav, pcm) are written as the samples
come, by ``AudioStream`` or ``stream_audio``; a streamed wav's header has the unknown-length
sizes of serving/wav.py. The compressed formats are written whole (``encode_audio``).
"""

from __future__ import annotations

import importlib.util
import io
from collections.abc import Iterable, Iterator
from math import gcd

import numpy as np
import soundfile as sf
from scipy.signal import resample_poly

from torchtitan_speechlm.serving.wav import pcm16, wav_bytes, wav_header

PCM_RATE = 24000  # OpenAI's pcm: 24 kHz mono 16-bit little-endian
OPENAI_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
STREAM_FORMATS = ("wav", "pcm")
CONTENT_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",  # Opus in Ogg (RFC 7845)
    "aac": "audio/aac",  # ADTS frames
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
# The rates each compressed format's encoder takes (Hz).
RATES = {
    "mp3": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),
    "opus": (8000, 12000, 16000, 24000, 48000),
    "aac": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000),
}


def _encodable() -> tuple[str, ...]:
    """The OpenAI formats this install's libsndfile and packages can write."""
    ok = {"wav", "pcm"}
    if "FLAC" in sf.available_formats():
        ok.add("flac")
    if "MP3" in sf.available_formats() and "MPEG_LAYER_III" in sf.available_subtypes("MP3"):
        ok.add("mp3")
    if "OGG" in sf.available_formats() and "OPUS" in sf.available_subtypes("OGG"):
        ok.add("opus")
    if importlib.util.find_spec("av") is not None:
        ok.add("aac")
    return tuple(f for f in OPENAI_FORMATS if f in ok)


SPEECH_FORMATS = _encodable()


class FormatError(ValueError):
    """A response format this install cannot write; the message lists those it can."""

    def __init__(self, fmt: str, supported: tuple[str, ...] = SPEECH_FORMATS, why: str = ""):
        reason = f" ({why})" if why else ""
        super().__init__(
            f"response_format {fmt!r} is not supported{reason}; supported: {', '.join(supported)}"
        )
        self.fmt, self.supported = fmt, supported


def _check(fmt: str, supported: tuple[str, ...] = SPEECH_FORMATS) -> None:
    if fmt in supported:
        return
    if supported is STREAM_FORMATS and fmt in OPENAI_FORMATS:
        why = "written whole, not streamed"
    else:
        why = "it needs PyAV: pip install av" if fmt == "aac" else ""
    raise FormatError(fmt, supported, why)


def content_type(fmt: str) -> str:
    """The Content-Type of a response in ``fmt``."""
    _check(fmt)
    return CONTENT_TYPES[fmt]


def output_rate(fmt: str, sample_rate: int) -> int:
    """The rate ``fmt`` is written at for speech generated at ``sample_rate``."""
    if fmt == "pcm":
        return PCM_RATE
    rates = RATES.get(fmt)
    if rates is None or sample_rate in rates:
        return sample_rate
    return min((r for r in rates if r > sample_rate), default=rates[-1])


def resample(samples: np.ndarray, src: int, dst: int) -> np.ndarray:
    """Float32 mono ``samples`` from ``src`` Hz to ``dst`` Hz (scipy's polyphase filter)."""
    x = np.asarray(samples, np.float32).reshape(-1)
    if src == dst or x.size == 0:
        return x
    g = gcd(src, dst)
    return resample_poly(x, dst // g, src // g).astype(np.float32)


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """A whole file of float32 mono ``samples`` in [-1, 1] (clipped) at ``sample_rate``."""
    _check(fmt)
    rate = output_rate(fmt, sample_rate)
    x = np.clip(resample(samples, sample_rate, rate), -1.0, 1.0)
    if fmt == "wav":
        return wav_bytes(x, rate)
    if fmt == "pcm":
        return pcm16(x)
    if fmt == "aac":
        return _aac(x, rate)
    container, subtype = {
        "flac": ("FLAC", "PCM_16"),
        "mp3": ("MP3", "MPEG_LAYER_III"),
        "opus": ("OGG", "OPUS"),
    }[fmt]
    if fmt == "flac":  # the 16-bit values of wav and pcm (libsndfile would scale by 32768)
        x = np.frombuffer(pcm16(x), "<i2")
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=container, subtype=subtype)
    return buf.getvalue()


def _aac(x: np.ndarray, rate: int) -> bytes:
    """AAC-LC in ADTS frames (a stream any AAC decoder reads without a container), by FFmpeg."""
    import av  # optional (``SPEECH_FORMATS`` has aac only when it is installed)

    buf = io.BytesIO()
    with av.open(buf, "w", format="adts") as out:
        stream = out.add_stream("aac", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(x[None, :], format="flt", layout="mono")
        frame.sample_rate, frame.pts = rate, 0
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


class StreamResampler:
    """``resample`` piece by piece: the pieces' outputs, joined, are the whole signal's.

    Each output sample depends on the inputs within ``reach`` (in the upsampled grid) of it, so
    a piece's outputs are given out once their inputs have all come, and the inputs kept are
    those the next outputs still need, starting at a multiple of ``down`` so that the kept
    buffer's outputs fall on the whole signal's output grid.
    """

    def __init__(self, src: int, dst: int):
        g = gcd(src, dst)
        self.up, self.down = dst // g, src // g
        self.reach = 10 * max(self.up, self.down)  # resample_poly's half filter length
        self.buf = np.zeros(0, np.float32)
        self.base = 0  # the input index of buf[0]
        self.done = 0  # outputs given out

    def feed(self, samples: np.ndarray, final: bool = False) -> np.ndarray:
        """The outputs that ``samples`` complete (all that remain when ``final``)."""
        x = np.asarray(samples, np.float32).reshape(-1)
        if self.up == self.down:
            return x
        self.buf = np.concatenate([self.buf, x])
        end = self.base + self.buf.size
        if final:
            stop = -(-end * self.up // self.down)
        else:
            stop = ((end - 1) * self.up - self.reach) // self.down + 1
        if stop <= self.done or self.buf.size == 0:
            return np.zeros(0, np.float32)
        first = self.base * self.up // self.down
        y = resample_poly(self.buf, self.up, self.down)[self.done - first : stop - first]
        self.done = stop
        keep = max(0, (stop * self.down - self.reach) // self.up)
        keep -= keep % self.down
        if keep > self.base:
            self.buf, self.base = self.buf[keep - self.base :], keep
        return y.astype(np.float32)


class AudioStream:
    """A streamed response: ``feed`` each piece of samples as it is generated and send the
    bytes it returns, then send ``close()``'s. wav: the header comes with the first bytes."""

    def __init__(self, fmt: str, sample_rate: int):
        _check(fmt, STREAM_FORMATS)
        self.fmt, self.rate = fmt, output_rate(fmt, sample_rate)
        self.resampler = StreamResampler(sample_rate, self.rate)
        self.header = wav_header(self.rate, None) if fmt == "wav" else b""

    def _bytes(self, y: np.ndarray) -> bytes:
        head, self.header = self.header, b""
        return head + pcm16(y)

    def feed(self, samples: np.ndarray) -> bytes:
        return self._bytes(self.resampler.feed(samples))

    def close(self) -> bytes:
        return self._bytes(self.resampler.feed(np.zeros(0, np.float32), final=True))


def stream_audio(chunks: Iterable[np.ndarray], sample_rate: int, fmt: str) -> Iterator[bytes]:
    """The bytes of a streamed response, piece by piece (empty pieces skipped)."""
    enc = AudioStream(fmt, sample_rate)
    for chunk in chunks:
        if data := enc.feed(chunk):
            yield data
    if data := enc.close():
        yield data
