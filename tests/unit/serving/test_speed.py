"""OpenAI's ``speed`` as a time-stretch (serving/speed.py), measured on the output: the duration
scales by 1/speed, a tone keeps its frequency (where resampling would move it by ``speed``),
events land at their scaled times, the level holds to the ends, 1.0 is the input itself, and
speeds outside OpenAI's 0.25 to 4.0 are refused."""

import numpy as np
import pytest

from torchtitan_speechlm.serving.speed import change_speed

RATE = 24000


def tone(freq: float, seconds: float, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def dominant_hz(y: np.ndarray, rate: int = RATE) -> float:
    """The peak of the spectrum, refined by a parabola through its neighbours."""
    s = np.log(np.abs(np.fft.rfft(y * np.hanning(y.size))) + 1e-12)
    k = int(np.argmax(s[1:-1])) + 1
    shift = 0.5 * (s[k - 1] - s[k + 1]) / (s[k - 1] - 2 * s[k] + s[k + 1])
    return (k + shift) * rate / y.size


def rms(y: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(y))))


@pytest.mark.parametrize("speed", [0.5, 1.5, 2.0])
@pytest.mark.parametrize("freq", [150.0, 440.0])
def test_duration_scales_and_pitch_stays(speed, freq):
    x = tone(freq, 1.5)
    y = change_speed(x, RATE, speed)
    assert abs(y.size / RATE - 1.5 / speed) <= 0.02 * 1.5 / speed
    assert abs(dominant_hz(y) - freq) <= 0.03 * freq
    # no gaps, no pile-ups: the level of the input in every tenth of the output
    tenths = [rms(p) for p in np.array_split(y, 10)]
    assert min(tenths) > 0.8 * rms(x) and max(tenths) < 1.2 * rms(x)


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
def test_events_land_at_their_scaled_times(speed):
    """A 300 Hz tone that turns to 900 Hz at 0.6 s turns at 0.6/speed s in the output."""
    x = np.concatenate([tone(300, 0.6), tone(900, 0.6)])
    y = change_speed(x, RATE, speed)
    win = int(0.02 * RATE)  # 20 ms frames at 10 ms steps
    high = [dominant_hz(y[i : i + win]) > 600 for i in range(0, y.size - win, win // 2)]
    turn = high.index(True) * (win // 2) / RATE
    assert all(high[high.index(True) :])
    # a frame may be read up to 10 ms (the search range) from its place: 10 ms / speed here
    assert abs(turn - 0.6 / speed) <= 0.02 + 0.01 / speed


def test_speech_rates_and_short_inputs():
    for rate in (16000, 22050):
        y = change_speed(tone(200, 1.0, rate), rate, 1.25)
        assert y.size == round(rate / 1.25) and abs(dominant_hz(y, rate) - 200) <= 6
    assert change_speed(np.zeros(5, np.float32), RATE, 2.0).size in (2, 3)
    assert change_speed(np.zeros(0, np.float32), RATE, 2.0).size == 0


def test_speed_one_is_the_input_and_out_of_range_is_refused():
    x = tone(440, 0.1)
    assert change_speed(x, RATE, 1.0) is x
    for bad in (0.2, 4.5, 0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="between 0.25 and 4.0"):
            change_speed(x, RATE, bad)
