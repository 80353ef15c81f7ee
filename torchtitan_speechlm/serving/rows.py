"""What a request thread hands the model worker (serving/batcher.py payloads): a speech row is
a ``SpeechRow``; a transcription row an ``AsrRow``, the upload's float32 mono waveform already
at ``generation.tasks.input_rate`` (decoded, resampled, downmixed by the request thread)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SpeechRow:
    """One speech request. Its speaker prompt, if any, is either a voice's codes (encoded once
    at start-up, serving/voices.py) or an upload's waveform at the codec's rate, which the
    worker encodes: the codec, like the model, is used on the worker thread only."""

    text: str
    stream: bool = False  # the response streams: emit the samples as they are generated
    prompt: np.ndarray | None = field(default=None, compare=False)  # codes [F, N] (a voice)
    prompt_wave: np.ndarray | None = field(default=None, compare=False)  # prompt_audio


@dataclass(frozen=True)
class AsrRow:
    """One transcription request: its waveform, and its sampling temperature (None: the
    server's); rows of one temperature are transcribed in one call."""

    wave: np.ndarray = field(compare=False)
    temperature: float | None = None
