"""What a request thread hands the model worker (serving/batcher.py payloads): a speech row is
a ``SpeechRow``; a transcription row is the upload's float32 mono waveform, already at
``generation.tasks.input_rate`` (decoded, resampled, downmixed by the request thread)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeechRow:
    text: str
    stream: bool = False  # the response streams: emit the samples as they are generated
