"""A speech request's speaker prompt (docs/serving.md *Speaker prompts*), read by the request
thread from OpenAI's JSON body: ``voice`` names one of ``--voices`` (codes encoded at start-up,
serving/voices.py); ``prompt_audio`` (base64 audio, through the openai client's ``extra_body``)
is one voice for one request, decoded here and encoded by the model worker.

OpenAI clients always send a ``voice`` ("alloy" ...), so without ``--voices`` it is ignored and
the speech is unprompted, as before voices existed; with ``--voices`` an unknown name is the
client's mistake, answered with the names it may use. ``prompt_audio``, when given, is the
prompt and ``voice`` is then ignored (the client had to send one).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from torchtitan_speechlm.utils.audio import AudioTooLong, BadAudioError, decode_audio_bytes


@dataclass(frozen=True)
class Voice:
    """One ``--voices`` file, read and encoded once at start-up."""

    name: str  # the file's name without its extension: what ``voice`` selects
    path: str
    seconds: float  # of the file as read
    prompt_seconds: float  # of it the model hears (cut to the model's prompt_seconds)
    codes: np.ndarray  # [F, N], as ``tasks.speaker_prompt`` gives them

    def entry(self) -> dict:
        """Its row of ``GET /v1/voices``."""
        return {"id": self.name, "object": "voice", "file": self.path.rsplit("/", 1)[-1],
                "seconds": round(self.seconds, 3),
                "prompt_seconds": round(self.prompt_seconds, 3)}  # fmt: skip


class PromptError(ValueError):
    """The request's ``voice`` or ``prompt_audio`` cannot be used: a 400 naming ``param``."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass(frozen=True)
class Prompt:
    """What a request asks to be spoken with: a voice's codes, an upload's waveform, or
    neither (unprompted)."""

    codes: np.ndarray | None = None
    wave: np.ndarray | None = None


def request_prompt(
    req: dict,
    voices: Mapping[str, Voice],
    refusal: str | None,
    rate: int,
    max_seconds: float | None = None,
) -> Prompt:
    """The speaker prompt of a speech request's JSON body; raises PromptError. ``refusal``:
    why the model takes no prompt (None: it does); ``rate``: the codec's, uploads are
    resampled to it (and downmixed) as ``generate --prompt`` reads its file; ``max_seconds``:
    the longest upload decoded (``AudioTooLong`` beyond)."""
    audio = req.get("prompt_audio")
    if audio is not None:
        if refusal is not None:
            raise PromptError(refusal, "prompt_audio", "prompt_refused")
        return Prompt(wave=decode_prompt_audio(audio, rate, max_seconds))
    voice = req.get("voice")
    if not voices or voice is None:
        return Prompt()
    if isinstance(voice, dict):  # OpenAI's custom-voice form, {"id": ...}
        voice = voice.get("id")
    if not isinstance(voice, str):
        raise PromptError("'voice' must be a string: one of GET /v1/voices", "voice")
    if voice not in voices:
        raise PromptError(
            f"voice {voice!r} is not one of this server's voices: {', '.join(sorted(voices))}",
            "voice",
            "voice_not_found",
        )
    return Prompt(codes=voices[voice].codes)


def decode_prompt_audio(value: object, rate: int, max_seconds: float | None = None) -> np.ndarray:
    """``prompt_audio`` (base64 of an audio file, optionally a ``data:...;base64,`` URL; line
    breaks allowed, as ``base64`` writes them) as float32 mono samples at ``rate``."""
    if not isinstance(value, str):
        raise PromptError(
            "'prompt_audio' must be a string: an audio file in base64", "prompt_audio"
        )
    text = value.strip()
    if text.startswith("data:") and "," in text:
        text = text.split(",", 1)[1]
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise PromptError(
            f"'prompt_audio' is not valid base64: {e}", "prompt_audio", "invalid_base64"
        ) from None
    try:
        return decode_audio_bytes(data, rate, "prompt_audio", max_seconds=max_seconds)
    except AudioTooLong:
        raise
    except BadAudioError as e:
        reason = re.sub(r"<_io\.BytesIO object at \w+>", "the upload", e.reason)
        raise PromptError(
            f"'prompt_audio' is not audio this server can read: {reason}",
            "prompt_audio",
            "invalid_audio",
        ) from None
