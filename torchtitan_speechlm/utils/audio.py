"""Audio file loading for dataset preparation.

Codecs expect float32 audio at their own sample rate and channel count, while corpora come in
any rate and layout, as files, as parts of files (Kaldi segments) or as encoded bytes (HF
datasets). This module is the single place that turns any of those into that array, so every
caller gets the same resampling quality and the same error (naming the input and a short
reason code that ``failures.jsonl`` records) when an input is unusable.
"""

from __future__ import annotations

import io
import math
import os
import struct

import numpy as np

# Reason codes of BadAudioError, as recorded in failures.jsonl.
MISSING, UNREADABLE, EMPTY, NONFINITE, TRUNCATED, TOO_LONG = (
    "missing_audio",
    "unreadable_audio",
    "empty_audio",
    "nonfinite_audio",
    "truncated_audio",
    "audio_too_long",
)
# data chunk sizes a writer that could not seek back leaves as "unknown" (ffmpeg, sox on a pipe)
_UNKNOWN_SIZES = (0, 0xFFFFFFFF, 0x7FFFFFFF)


class BadAudioError(ValueError):
    """An audio input is missing, unreadable or empty; ``path``, ``reason`` and ``code`` say which."""

    def __init__(self, path: str, reason: str, code: str = UNREADABLE):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason
        self.code = code


class AudioTooLong(BadAudioError):
    """Audio longer than the caller's bound: ``seconds`` as its header says (``from_header``)
    or as far as it was decoded before the bound was passed (then "more than")."""

    def __init__(self, path: str, seconds: float, limit_s: float, from_header: bool):
        said = f"its header says {seconds:.1f} s" if from_header else f"more than {limit_s:g} s"
        super().__init__(path, f"{said} of audio, over the limit of {limit_s:g} s", TOO_LONG)
        self.seconds, self.limit_s, self.from_header = seconds, limit_s, from_header


def resample(wav: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Resample along the last axis with a polyphase Kaiser-windowed FIR (scipy ``resample_poly``).

    Polyphase filtering is exact for rational ratios (e.g. 22050 -> 16000 = 320/441) and
    anti-aliases when downsampling, unlike linear interpolation.
    """
    if orig_sr == target_sr:
        return wav.astype(np.float32, copy=False)
    g = math.gcd(int(orig_sr), int(target_sr))
    from scipy.signal import resample_poly  # here: training imports this module, never resamples

    out = resample_poly(wav, int(target_sr) // g, int(orig_sr) // g, axis=-1)
    return out.astype(np.float32, copy=False)


def to_codec_audio(
    data: np.ndarray, sr: int, target_sr: int, channels: int = 1, name: str = "<audio>"
) -> np.ndarray:
    """``[samples, channels]`` (or ``[samples]``) float audio at ``sr`` -> the codec's layout.

    Multi-channel input is averaged for ``channels=1``; ``channels>1`` returns
    ``[channels, samples]`` (mono is duplicated). Raises :class:`BadAudioError` for empty or
    non-finite audio.
    """
    data = np.asarray(data, dtype=np.float32)
    if data.ndim == 1:
        data = data[:, None]
    if data.shape[0] == 0:
        raise BadAudioError(name, "zero-length audio", EMPTY)
    if not np.isfinite(data).all():
        raise BadAudioError(name, "audio contains NaN or Inf samples", NONFINITE)
    wav = data.T  # [channels, samples]
    if channels == 1:
        wav = wav.mean(axis=0)
    elif wav.shape[0] == 1:
        wav = np.repeat(wav, channels, axis=0)
    elif wav.shape[0] != channels:
        raise BadAudioError(name, f"has {wav.shape[0]} channels, expected 1 or {channels}")
    wav = resample(wav, int(sr), target_sr)
    if wav.shape[-1] == 0:
        raise BadAudioError(name, "zero-length audio after resampling", EMPTY)
    return np.ascontiguousarray(wav, dtype=np.float32)


def wav_header_frames(source) -> int | None:
    """The frames a RIFF/WAVE file's header says its ``data`` chunk holds (its declared byte
    size / the block size of its ``fmt`` chunk); None for another format, an RF64 file or a
    size a writer left unknown. ``source``: a path or a seekable binary file object (its
    position is restored)."""
    own = isinstance(source, (str, os.PathLike))
    f = open(source, "rb") if own else source
    pos = None if own else f.tell()
    try:
        f.seek(0)
        head = f.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return None
        block = None
        while True:
            chunk = f.read(8)
            if len(chunk) < 8:
                return None
            cid, size = chunk[:4], struct.unpack("<I", chunk[4:])[0]
            if cid == b"fmt ":
                fmt = f.read(size + (size & 1))
                if len(fmt) < 14:
                    return None
                block = struct.unpack("<H", fmt[12:14])[0]
            elif cid == b"data":
                if not block or size in _UNKNOWN_SIZES:
                    return None
                return size // block
            else:
                f.seek(size + (size & 1), 1)
    except (OSError, struct.error):
        return None
    finally:
        if own:
            f.close()
        else:
            f.seek(pos)


def _read(source, name: str, start: float | None, end: float | None) -> tuple[np.ndarray, int]:
    try:
        import soundfile as sf  # here: training imports this module, never reads audio

        with sf.SoundFile(source) as f:
            sr = f.samplerate
            first = 0 if start is None else min(int(round(start * sr)), f.frames)
            last = f.frames if end is None or end < 0 else min(int(round(end * sr)), f.frames)
            want = None if end is None or end < 0 else int(round(end * sr))
            f.seek(first)
            data = f.read(max(last - first, 0), dtype="float32", always_2d=True)
            present = f.frames
    except Exception as e:  # soundfile raises LibsndfileError/RuntimeError/TypeError variants
        raise BadAudioError(name, f"unreadable audio ({type(e).__name__}: {e})") from e
    _check_complete(source, name, sr, present, want)
    return data, sr


def _check_complete(source, name: str, sr: int, present: int, want: int | None) -> None:
    """A wav cut short (its header counts more frames than the file holds: a copy or a
    download that stopped) is refused when the part asked for (the whole file, or a segment
    up to ``want`` frames) reaches past what is there: libsndfile reads what is left without a
    word, and the item would keep its whole transcript over part of its speech."""
    declared = wav_header_frames(source)
    if declared is None or declared <= present or (want is not None and want <= present):
        return
    raise BadAudioError(
        name,
        f"truncated: its header says {declared} frames ({declared / sr:.2f} s) but the file "
        f"holds {present} ({present / sr:.2f} s); copy or download it again",
        TRUNCATED,
    )


def load_audio(
    path: str,
    target_sr: int,
    channels: int = 1,
    start: float | None = None,
    end: float | None = None,
    channel: int | None = None,
) -> np.ndarray:
    """Read ``path`` (optionally only seconds ``[start, end)``; ``end < 0`` = to the end; only
    ``channel`` of a multi-channel file) as float32 at ``target_sr``; see :func:`to_codec_audio`
    for the layout.

    Only the requested segment is read from disk, so Kaldi segments of long recordings are cheap.
    Raises :class:`BadAudioError` for missing, unreadable, empty or non-finite audio.
    """
    if not os.path.isfile(path):
        raise BadAudioError(path, "file not found", MISSING)
    if os.path.getsize(path) == 0:  # libsndfile says "Format not recognised"
        raise BadAudioError(path, "the file is empty (0 bytes): no audio was written to it", EMPTY)
    name = path if start is None and end is None else f"{path}[{start}:{end}]"
    data, sr = _read(path, name, start, end)
    if channel is not None:
        if not 0 <= channel < data.shape[1]:
            raise BadAudioError(name, f"channel {channel} asked of a {data.shape[1]}-channel file")
        data = data[:, channel : channel + 1]
    return to_codec_audio(data, sr, target_sr, channels, name)


def decode_audio_bytes(
    data: bytes, target_sr: int, name: str, channels: int = 1, max_seconds: float | None = None
) -> np.ndarray:
    """Decode an encoded audio file held in memory (wav, flac, ogg, mp3 ...) like :func:`load_audio`.

    ``max_seconds`` bounds the work an untrusted upload can cause (a few MB of compressed
    silence decode to hours: tens of GB as float32): a header that says more is refused before
    anything is decoded, and a file without a length (or one whose header says less than it
    holds) is decoded block by block, refused at the block that passes the bound; blocks are
    downmixed as they come, so the memory is that of the bound, mono."""
    if not data:
        raise BadAudioError(name, "zero-length audio bytes", EMPTY)
    if max_seconds is None:
        wav, sr = _read(io.BytesIO(data), name, None, None)
    else:
        wav, sr = _read_bounded(data, name, max_seconds, channels == 1)
    return to_codec_audio(wav, sr, target_sr, channels, name)


_BLOCK_S = 1.0  # the bounded read's block
_LENGTH_UNKNOWN = 1 << 62  # libsndfile's frames of a stream without a length (SF_COUNT_MAX)


def _read_bounded(data: bytes, name: str, max_seconds: float, downmix: bool):
    """``_read`` of a whole file held in memory, at most ``max_seconds`` of it (AudioTooLong).
    The stream is closed on the way out: its buffer goes then, whatever still refers to it."""
    with io.BytesIO(data) as source:
        return _read_blocks(source, name, max_seconds, downmix)


def _read_blocks(source, name: str, max_seconds: float, downmix: bool):
    import soundfile as sf

    try:
        f = sf.SoundFile(source)
    except Exception as e:
        raise BadAudioError(name, f"unreadable audio ({type(e).__name__}: {e})") from None
    with f:
        sr, limit = f.samplerate, int(max_seconds * f.samplerate)
        if limit < f.frames < _LENGTH_UNKNOWN:
            raise AudioTooLong(name, f.frames / sr, max_seconds, from_header=True)
        block = max(1, int(_BLOCK_S * sr))
        blocks, n = [], 0
        while True:
            got = _read_block(f, block, name)
            n += len(got)
            if n > limit:
                raise AudioTooLong(name, n / sr, max_seconds, from_header=False)
            if len(got):
                blocks.append(got.mean(axis=1, keepdims=True) if downmix else got)
            if len(got) < block:
                break
        present = f.frames if f.frames < _LENGTH_UNKNOWN else n
    wav = np.concatenate(blocks) if blocks else np.zeros((0, 1), np.float32)
    _check_complete(source, name, sr, present, None)
    return wav, sr


def _read_block(f, frames: int, name: str) -> np.ndarray:
    """The next ``frames`` of ``f`` (fewer at its end). libsndfile's read of a stream without
    a length fails at its end after decoding what was left (soundfile's seek back): the frames
    it filled are the rows no longer NaN (a decoder never gives NaN)."""
    out = np.full((frames, f.channels), np.nan, np.float32)
    try:
        return f.read(frames, dtype="float32", always_2d=True, out=out)
    except Exception as e:
        filled = int(np.isfinite(out).all(axis=1).sum())
        if f.frames < _LENGTH_UNKNOWN:
            raise BadAudioError(name, f"unreadable audio ({type(e).__name__}: {e})") from e
        return out[:filled]
