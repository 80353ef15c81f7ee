"""Interleave patterns: how an audio segment of F frames x N codebooks becomes model frames.

- ``parallel``: frame t carries codebook n of audio frame t in stream n (F model frames).
- ``delay``: stream n is shifted right by n frames (F + N - 1 model frames, the holes filled with
  the stream's pad). Codebook n of an audio frame is then predicted after codebooks 0..n-1 of the
  same frame were seen (MusicGen / Parler / Moshi style).

Patterns apply to one audio segment at a time, so delay padding never crosses a segment (or, in
packed rows, a sample) boundary.
"""

from __future__ import annotations

import numpy as np

PATTERNS = ("parallel", "delay")


def check_pattern(name: str) -> str:
    if name not in PATTERNS:
        raise ValueError(f"unknown interleave pattern {name!r}; choose one of {PATTERNS}")
    return name


def extra_frames(pattern: str, num_streams: int) -> int:
    """How many more model frames than audio frames a segment takes."""
    return num_streams - 1 if pattern == "delay" else 0


def interleave(codes: np.ndarray, pads: np.ndarray, pattern: str) -> np.ndarray:
    """codes [F, N] (vocabulary ids) -> model frames [F', N]; pads [N] are the streams' pads."""
    check_pattern(pattern)
    if pattern == "parallel":
        return codes.copy()
    n_frames, n_streams = codes.shape
    out = np.broadcast_to(pads, (n_frames + n_streams - 1, n_streams)).copy()
    for k in range(n_streams):
        out[k : k + n_frames, k] = codes[:, k]
    return out


def deinterleave(frames: np.ndarray, pattern: str) -> np.ndarray:
    """Inverse of :func:`interleave`: model frames [F', N] -> codes [F, N]."""
    check_pattern(pattern)
    if pattern == "parallel":
        return frames.copy()
    n_streams = frames.shape[1]
    n_frames = frames.shape[0] - (n_streams - 1)
    if n_frames <= 0:
        return frames[:0].copy()
    return np.stack([frames[k : k + n_frames, k] for k in range(n_streams)], axis=1)
