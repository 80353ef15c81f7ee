"""The one place where a response's encoding is chosen from the request's format fields.

Speech: ``response_format`` is any of serving/audio_formats.py's ``SPEECH_FORMATS`` (what this
install's libraries write: wav, pcm, flac, mp3, opus, and aac with PyAV), whole; streamed
(``stream_format`` "audio": the bytes as generated; "sse": OpenAI's server-sent events, each
``speech.audio.delta`` a base64 piece of those bytes, then ``speech.audio.done`` with the
usage) only in ``STREAM_FORMATS`` (wav, pcm), the formats whose bytes can be written as the
samples come. ``speed`` (0.25-4.0, serving/speed.py) stretches whole answers; a streamed one
is refused with another speed (a time-stretch needs what comes after each piece).

Transcripts: ``response_format`` json, text, verbose_json, srt, vtt (serving/
transcript_formats.py). The routes (serving/app.py) call the ``*_request`` functions to check a
request (an ``ApiError`` 400 naming the field) and the objects they return to answer it.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchtitan_speechlm.serving import audio_formats, transcript_formats
from torchtitan_speechlm.serving.errors import ApiError
from torchtitan_speechlm.serving.speed import change_speed

SPEECH_DEFAULT, TRANSCRIPT_DEFAULT = "wav", "json"
STREAM_FORMATS = ("audio", "sse")
SPEED_RANGE = (0.25, 4.0)


def _unsupported(name: object, known, param: str = "response_format", why: str = "") -> ApiError:
    return ApiError(
        400,
        f"{param} {name!r} is not supported{why}; supported: {', '.join(known)}",
        param,
        f"unsupported_{param}",
    )


@dataclass(frozen=True)
class Speech:
    """How one speech request is answered: its audio format, speed and streaming."""

    fmt: str
    speed: float = 1.0
    stream: str | None = None  # None (whole), "audio" or "sse"

    @property
    def content_type(self) -> str:
        return "text/event-stream" if self.stream == "sse" else audio_formats.content_type(self.fmt)

    def whole(self, samples: np.ndarray, rate: int) -> bytes:
        return audio_formats.encode_audio(change_speed(samples, rate, self.speed), rate, self.fmt)

    def pieces(self, rate: int, usage: Callable[[], dict]) -> PieceWriter:
        """The writer of a streamed answer's bytes (``usage()``: the SSE done event's)."""
        return PieceWriter(self, audio_formats.AudioStream(self.fmt, rate), usage)


class PieceWriter:
    """A streamed speech answer: ``feed(samples)`` / ``close()`` give the bytes to send."""

    def __init__(self, speech: Speech, audio: audio_formats.AudioStream, usage):
        self.sse, self.audio, self.usage = speech.stream == "sse", audio, usage

    def _wrap(self, data: bytes) -> bytes:
        if not self.sse or not data:
            return data
        event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
        return f"data: {json.dumps(event)}\n\n".encode()

    def feed(self, samples: np.ndarray) -> bytes:
        return self._wrap(self.audio.feed(samples))

    def close(self) -> bytes:
        out = self._wrap(self.audio.close())
        if self.sse:
            done = {"type": "speech.audio.done", "usage": self.usage()}
            out += f"data: {json.dumps(done)}\n\n".encode()
        return out


def speech_request(response_format, speed, stream_format, stream: bool) -> Speech:
    """A speech request's answer from its fields (``stream``: ``"stream": true`` or
    ``?stream=1``, which stream as "audio"); a 400 naming the field otherwise."""
    fmt = response_format or SPEECH_DEFAULT
    if not isinstance(fmt, str) or fmt not in audio_formats.SPEECH_FORMATS:
        why = " (this install has no PyAV: pip install av)" if fmt == "aac" else ""
        raise _unsupported(fmt, audio_formats.SPEECH_FORMATS, why=why)
    if stream_format is not None and stream_format not in STREAM_FORMATS:
        raise _unsupported(stream_format, STREAM_FORMATS, "stream_format")
    mode = stream_format or ("audio" if stream else None)
    if speed is None:
        speed = 1.0
    if (
        isinstance(speed, bool)
        or not isinstance(speed, int | float)
        or not (math.isfinite(speed) and SPEED_RANGE[0] <= speed <= SPEED_RANGE[1])
    ):
        raise ApiError(400, f"speed {speed!r} must be a number from {SPEED_RANGE[0]} to "
                            f"{SPEED_RANGE[1]}", "speed", "invalid_speed")  # fmt: skip
    if mode is not None:
        if fmt not in audio_formats.STREAM_FORMATS:
            raise _unsupported(fmt, audio_formats.STREAM_FORMATS,
                               why=f" when streamed ({mode}): it is written whole")  # fmt: skip
        if speed != 1.0:
            raise ApiError(400, f"speed {speed} with streaming: a time-stretch needs the audio "
                                "after each piece; stream at speed 1, or ask for the whole "
                                "answer", "speed", "invalid_speed")  # fmt: skip
    return Speech(fmt, float(speed), mode)


@dataclass(frozen=True)
class Transcript:
    """How one transcription is answered."""

    fmt: str
    language: str | None = None

    @property
    def content_type(self) -> str:
        return transcript_formats.CONTENT_TYPES[self.fmt]

    def encode(self, text: str, duration_s: float) -> bytes:
        body, _ = transcript_formats.render_transcript(text, duration_s, self.fmt, self.language)
        return body


def transcript_request(response_format, language) -> Transcript:
    """A transcription's answer from its form fields; a 400 naming the field otherwise."""
    fmt = response_format or TRANSCRIPT_DEFAULT
    if not isinstance(fmt, str) or fmt not in transcript_formats.TRANSCRIPTION_FORMATS:
        raise _unsupported(fmt, transcript_formats.TRANSCRIPTION_FORMATS)
    if language is not None and not isinstance(language, str):
        raise ApiError(400, "language must be a text (ISO-639-1, e.g. 'en')", "language")
    return Transcript(fmt, language or None)
