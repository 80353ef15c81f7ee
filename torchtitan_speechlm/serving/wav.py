"""16-bit PCM wav bytes: a whole file, or a header and sample chunks for a streamed response.

A streamed wav does not know its length when its header is sent: the RIFF and data sizes are
then 0xFFFFFFFF, as streaming TTS servers write them (readers take the data to the end of the
stream; libsndfile and Python's ``wave`` both do).
"""

from __future__ import annotations

import struct

import numpy as np

UNKNOWN = 0xFFFFFFFF  # the RIFF/data size of a streamed wav


def pcm16(samples: np.ndarray) -> bytes:
    """Float samples in [-1, 1] (clipped) as little-endian 16-bit PCM bytes."""
    x = np.clip(np.round(np.asarray(samples, np.float32) * 32767.0), -32768, 32767)
    return x.astype("<i2").tobytes()


def wav_header(sample_rate: int, num_samples: int | None, channels: int = 1) -> bytes:
    """The 44-byte header of a 16-bit PCM wav; ``num_samples=None``: a stream of unknown length."""
    block = 2 * channels
    data = UNKNOWN if num_samples is None else num_samples * block
    riff = UNKNOWN if num_samples is None else 36 + data
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, 16)
        + b"data"
        + struct.pack("<I", data)
    )


def wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    """A whole mono wav file."""
    samples = np.asarray(samples).reshape(-1)
    return wav_header(sample_rate, len(samples)) + pcm16(samples)
