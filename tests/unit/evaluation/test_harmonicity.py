"""``evaluation/harmonicity.py`` against the theory it measures: for a periodic signal plus
white noise, the window-corrected autocorrelation peak at the period is the periodic part's
share of the power, P_s / (P_s + P_n) (Boersma 1993), whatever the pitch and the rate."""

from __future__ import annotations

import numpy as np
import pytest

from torchtitan_speechlm.evaluation.harmonicity import harmonicity


def voiced(f0: float, rate: int, seconds: float = 1.0) -> np.ndarray:
    """Harmonics of ``f0`` up to 4 kHz with 1/k amplitudes, unit power."""
    t = np.arange(int(seconds * rate)) / rate
    wav = sum(np.sin(2 * np.pi * f0 * k * t + k) / k for k in range(1, int(4000 / f0)))
    return wav / np.sqrt(np.mean(wav**2))


@pytest.mark.parametrize("f0,rate", [(110.0, 16000), (220.0, 22050), (95.0, 24000)])
def test_the_peak_is_the_periodic_share_of_the_power(f0, rate):
    """Within 0.06 down to equal powers; below, the maximum over lags picks up the noise's own
    peaks (a bias upward, about +0.06 at a quarter periodic): the order still holds."""
    rng = np.random.default_rng(int(f0))
    figures = []
    for noise_power in (0.0, 0.25, 1.0, 4.0):
        wav = voiced(f0, rate) + np.sqrt(noise_power) * rng.standard_normal(rate)
        figures.append(harmonicity(wav, rate))
        share = 1 / (1 + noise_power)
        assert figures[-1] == pytest.approx(share, abs=0.06 if share >= 0.5 else 0.1)
    assert figures == sorted(figures, reverse=True)


def test_noise_scores_low_stereo_is_mixed_and_silence_or_a_short_clip_is_none():
    rng = np.random.default_rng(0)
    assert harmonicity(rng.standard_normal(16000), 16000) < 0.25
    wav = voiced(120.0, 16000)
    assert harmonicity(np.stack([wav, wav], axis=1), 16000) == pytest.approx(
        harmonicity(wav, 16000)
    )
    assert harmonicity(np.zeros(16000), 16000) is None
    assert harmonicity(wav[:100], 16000) is None


def test_quiet_frames_do_not_count():
    """Silence around the voice (a clip's pauses) leaves the figure as the voice's alone."""
    wav = voiced(150.0, 16000, 0.5)
    padded = np.concatenate([np.zeros(8000), wav, 1e-4 * np.ones(8000)])
    assert harmonicity(padded, 16000) == pytest.approx(harmonicity(wav, 16000), abs=0.02)
