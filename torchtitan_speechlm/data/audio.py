"""Audio file loading for dataset preparation.

Codecs expect float32 audio at their own sample rate and channel count, while corpora come in
any rate and layout. This module is the single place that turns a file into that array, so
every caller gets the same resampling quality and the same error (naming the file) when an
input is unusable.
"""

from __future__ import annotations

import math
import os

import numpy as np
import soundfile as sf
from scipy.signal import resample_poly


class BadAudioError(ValueError):
    """An audio file is missing, unreadable or empty; ``path`` and ``reason`` say which and why."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def resample(wav: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Resample along the last axis with a polyphase Kaiser-windowed FIR (scipy ``resample_poly``).

    Polyphase filtering is exact for rational ratios (e.g. 22050 -> 16000 = 320/441) and
    anti-aliases when downsampling, unlike linear interpolation.
    """
    if orig_sr == target_sr:
        return wav.astype(np.float32, copy=False)
    g = math.gcd(int(orig_sr), int(target_sr))
    out = resample_poly(wav, int(target_sr) // g, int(orig_sr) // g, axis=-1)
    return out.astype(np.float32, copy=False)


def load_audio(path: str, target_sr: int, channels: int = 1) -> np.ndarray:
    """Read ``path`` as float32 at ``target_sr``.

    ``channels=1`` returns a mono ``[samples]`` array (multi-channel files are averaged).
    ``channels>1`` returns ``[channels, samples]``; a mono file is duplicated, any other channel
    mismatch is an error. Raises :class:`BadAudioError` for missing, unreadable, empty or
    non-finite audio.
    """
    if not os.path.isfile(path):
        raise BadAudioError(path, "file not found")
    try:
        data, sr = sf.read(path, dtype="float32", always_2d=True)  # [samples, channels]
    except Exception as e:  # soundfile raises LibsndfileError/RuntimeError/TypeError variants
        raise BadAudioError(path, f"unreadable audio ({type(e).__name__}: {e})") from e
    if data.shape[0] == 0:
        raise BadAudioError(path, "zero-length audio")
    if not np.isfinite(data).all():
        raise BadAudioError(path, "audio contains NaN or Inf samples")
    wav = data.T  # [channels, samples]
    if channels == 1:
        wav = wav.mean(axis=0)
    elif wav.shape[0] == 1:
        wav = np.repeat(wav, channels, axis=0)
    elif wav.shape[0] != channels:
        raise BadAudioError(path, f"has {wav.shape[0]} channels, expected 1 or {channels}")
    wav = resample(wav, sr, target_sr)
    if wav.shape[-1] == 0:
        raise BadAudioError(path, "zero-length audio after resampling")
    return np.ascontiguousarray(wav, dtype=np.float32)
