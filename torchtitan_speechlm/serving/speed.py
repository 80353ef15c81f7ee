"""OpenAI's ``speed`` (0.25 to 4.0) as a time-stretch of the generated speech: the duration
scales by ``1 / speed`` and the pitch stays.

Resampling would shift the pitch with the tempo (a chipmunk voice), so the audio is cut into
short overlapping frames that are laid down at a steady output hop but read at ``speed`` times
that hop (overlap-add). Frames read at those exact places would interfere where their periods
do not line up, so each one is moved, within ``SEARCH_S`` of its place, to where it best
continues the frame before it (the correlation peak): WSOLA, waveform-similarity overlap-add.
It keeps a voiced sound's period intact, which is what a listener hears as its pitch, and runs
on numpy alone (no librosa, which serving does not require).
"""

from __future__ import annotations

import numpy as np

SPEEDS = (0.25, 4.0)  # OpenAI's accepted range
FRAME_S = 0.03  # frame length: a few pitch periods of speech
SEARCH_S = 0.01  # how far a frame may move to line up with the one before it


def change_speed(samples: np.ndarray, rate: int, speed: float) -> np.ndarray:
    """``samples`` (mono) played ``speed`` times as fast at the same pitch; 1.0: ``samples``."""
    if not SPEEDS[0] <= speed <= SPEEDS[1]:
        raise ValueError(f"speed must be between {SPEEDS[0]} and {SPEEDS[1]}, not {speed}")
    x = np.asarray(samples, np.float32).reshape(-1)
    if speed == 1.0 or x.size == 0:
        return samples
    hop = max(1, round(FRAME_S * rate / 2))  # output hop: frames overlap by half
    frame, tol = 2 * hop, round(SEARCH_S * rate)
    n_out = max(1, round(x.size / speed))
    n_frames = n_out // hop + 2
    # Periodic Hann windows at half overlap sum to one: overlap-add keeps the level.
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(frame) / frame)).astype(np.float32)
    # Frame k is centred at output k * hop and near input k * hop * speed; the zeros in front
    # let the first frames start before sample 0, those behind let the last ones run out.
    lead = hop + tol
    xp = np.zeros(lead + max(x.size, round(n_frames * hop * speed) + tol + frame + 1), np.float32)
    xp[lead : lead + x.size] = x
    out = np.zeros((n_frames + 1) * hop, np.float32)
    start = lead - hop  # the input start of frame 0 (no frame before it to line up with)
    for k in range(n_frames):
        if k:
            nominal = lead + round(k * hop * speed) - hop
            follow = xp[start + hop : start + hop + frame]  # what the last frame ran into
            region = xp[nominal - tol : nominal + tol + frame]
            start = nominal - tol + int(np.argmax(np.correlate(region, follow, "valid")))
        out[k * hop : k * hop + frame] += window * xp[start : start + frame]
    return out[hop : hop + n_out]
