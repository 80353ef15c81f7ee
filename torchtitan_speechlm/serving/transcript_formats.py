"""A transcription in OpenAI's ``response_format`` s: json, text, verbose_json, srt and vtt.

Our ASR gives one text per upload and no timing inside it, so by default the transcript is one
segment from 0 to the audio's duration: every time written is one we know. ``sentences=True``
splits the text at sentence punctuation (. ! ? and their CJK forms) and gives each sentence a
share of the duration proportional to its characters: an estimate, for subtitles that should
not hold a whole minute on screen at once.

verbose_json has OpenAI's shape. A value we do not have is null where OpenAI's field may be
null; the segment fields that the ``openai`` client's ``TranscriptionSegment`` requires as
numbers are the caller's when it has them (``avg_logprob``, ``no_speech_prob``, ``tokens``,
``temperature``), else ``avg_logprob`` and ``no_speech_prob`` are 0.0 and ``tokens`` empty, the
values that OpenAI's documented thresholds (avg_logprob < -1, no_speech_prob > 1) read as "keep
this segment". ``temperature`` 0.0 is our ASR's greedy decoding; ``compression_ratio`` is
computed from the text as Whisper does (its UTF-8 length over its zlib-compressed length).
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence

TRANSCRIPTION_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
CONTENT_TYPES = {
    "json": "application/json",
    "text": "text/plain; charset=utf-8",
    "srt": "application/x-subrip; charset=utf-8",
    "verbose_json": "application/json",
    "vtt": "text/vtt; charset=utf-8",
}
_SENTENCE_END = re.compile(r"(?<=[.!?。！？])\s+|(?<=[。！？])")


class TranscriptFormatError(ValueError):
    """A response format we do not write; the message lists those we do."""

    def __init__(self, fmt: str):
        super().__init__(
            f"response_format {fmt!r} is not supported; supported: "
            f"{', '.join(TRANSCRIPTION_FORMATS)}"
        )


def segments_of(
    text: str, duration_s: float, sentences: bool = False
) -> list[tuple[float, float, str]]:
    """``(start_s, end_s, text)`` of each segment: one for the whole text, or one a sentence
    with times in proportion to character counts; the last ends at ``duration_s``."""
    text = " ".join(text.split())  # a cue must not hold a blank line
    if not text:
        return []
    parts = [p for p in _SENTENCE_END.split(text) if p.strip()] if sentences else [text]
    total, done, out = sum(len(p) for p in parts), 0, []
    for p in parts:
        start = duration_s * done / total
        done += len(p)
        out.append((start, duration_s * done / total, p.strip()))
    return out


def _compression_ratio(text: str) -> float:
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0


def _clock(seconds: float, sep: str) -> str:
    """HH:MM:SS<sep>mmm, rounded to the millisecond."""
    ms = max(0, round(seconds * 1000))
    return f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


def _srt(segs: list[tuple[float, float, str]]) -> str:
    cues = [
        f"{i}\n{_clock(a, ',')} --> {_clock(b, ',')}\n{t.replace('-->', '->')}\n"
        for i, (a, b, t) in enumerate(segs, 1)
    ]
    return "\n".join(cues)


def _vtt(segs: list[tuple[float, float, str]]) -> str:
    def escape(t: str) -> str:  # cue text is markup: & and < start entities and tags
        return t.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

    cues = [f"{_clock(a, '.')} --> {_clock(b, '.')}\n{escape(t)}\n" for a, b, t in segs]
    return "\n".join(["WEBVTT\n", *cues])


def render_transcript(
    text: str,
    duration_s: float,
    fmt: str,
    language: str | None,
    *,
    sentences: bool = False,
    avg_logprob: float | None = None,
    no_speech_prob: float | None = None,
    tokens: Sequence[int] | None = None,
    temperature: float = 0.0,
) -> tuple[bytes, str]:
    """The response body and its Content-Type. ``language``: the request's or the model's
    (verbose_json's required ``language`` is ``"unknown"`` without one)."""
    if fmt not in TRANSCRIPTION_FORMATS:
        raise TranscriptFormatError(fmt)
    segs = segments_of(text, duration_s, sentences)
    if fmt == "json":
        body = json.dumps({"text": text}, ensure_ascii=False)
    elif fmt == "text":
        body = text + "\n"
    elif fmt == "srt":
        body = _srt(segs)
    elif fmt == "vtt":
        body = _vtt(segs)
    else:
        one = len(segs) == 1  # the caller's values describe the whole text
        body = json.dumps(
            {
                "task": "transcribe",
                "language": language or "unknown",
                "duration": duration_s,
                "text": text,
                "segments": [
                    {
                        "id": i,
                        "seek": 0,
                        "start": a,
                        "end": b,
                        "text": t,
                        "tokens": list(tokens or []) if one else [],
                        "temperature": temperature,
                        "avg_logprob": avg_logprob or 0.0,
                        "compression_ratio": _compression_ratio(t),
                        "no_speech_prob": no_speech_prob or 0.0,
                    }
                    for i, (a, b, t) in enumerate(segs)
                ],
                "words": None,  # no word timing
                "usage": None,  # nothing is billed
            },
            ensure_ascii=False,
        )
    return body.encode(), CONTENT_TYPES[fmt]
