"""The one place where a response's encoding is chosen from its ``response_format``.

Speech is ``wav`` (16-bit PCM, serving/wav.py), whole or streamed (a header of unknown length,
then sample chunks); transcripts are ``json`` (``{"text": ...}``) or ``text``. Another format is
one entry in ``SPEECH`` or ``TRANSCRIPT`` (an encoder of the whole answer, and for speech a
streamed form): the routes (serving/app.py) only call ``speech_format`` / ``transcript_format``
to check the request and the ``encode_*`` functions to answer it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchtitan_speechlm.serving.errors import ApiError
from torchtitan_speechlm.serving.wav import pcm16, wav_bytes, wav_header


@dataclass(frozen=True)
class SpeechFormat:
    content_type: str
    whole: Callable[[np.ndarray, int], bytes]  # (float samples, rate) -> the file
    stream_start: Callable[[int], bytes]  # rate -> the bytes before the first samples
    stream_piece: Callable[[np.ndarray], bytes]  # float samples -> their bytes


@dataclass(frozen=True)
class TranscriptFormat:
    content_type: str
    encode: Callable[[str], bytes]


SPEECH: dict[str, SpeechFormat] = {
    "wav": SpeechFormat("audio/wav", wav_bytes, lambda rate: wav_header(rate, None), pcm16),
}
TRANSCRIPT: dict[str, TranscriptFormat] = {
    "json": TranscriptFormat("application/json", lambda t: json.dumps({"text": t}).encode()),
    "text": TranscriptFormat("text/plain; charset=utf-8", lambda t: (t + "\n").encode()),
}
SPEECH_DEFAULT, TRANSCRIPT_DEFAULT = "wav", "json"


def _unsupported(name: object, known: dict) -> ApiError:
    return ApiError(
        400,
        f"response_format {name!r} is not supported; supported: {', '.join(known)}",
        "response_format",
        "unsupported_response_format",
    )


def speech_format(name: str | None) -> SpeechFormat:
    """The encoder of a speech request's ``response_format`` (None: wav); a 400 otherwise."""
    name = name or SPEECH_DEFAULT
    if name not in SPEECH:
        raise _unsupported(name, SPEECH)
    return SPEECH[name]


def transcript_format(name: object) -> TranscriptFormat:
    """The encoder of a transcription's ``response_format`` (None/empty: json); a 400 otherwise."""
    name = name or TRANSCRIPT_DEFAULT
    if not isinstance(name, str) or name not in TRANSCRIPT:
        raise _unsupported(name, TRANSCRIPT)
    return TRANSCRIPT[name]
