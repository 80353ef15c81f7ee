"""A transcription in OpenAI's response formats (serving/transcript_formats.py): verbose_json
validates against the openai package's own ``TranscriptionVerbose`` model, srt and vtt parse
with a small SubRip / WebVTT reader written here (cue numbers, HH:MM:SS,mmm / HH:MM:SS.mmm,
monotonic times that end at the duration, the text back), json and text are OpenAI's, and a
format we do not write is refused with the list."""

import json
import re

import pytest
from openai.types.audio import Transcription, TranscriptionVerbose

from torchtitan_speechlm.serving.transcript_formats import (
    TRANSCRIPTION_FORMATS,
    TranscriptFormatError,
    render_transcript,
)

TEXT = "Hello there. How are you today? Fine!  Thanks\n for asking."
SRT_TIME = r"(\d\d):(\d\d):(\d\d),(\d\d\d)"
VTT_TIME = r"(\d\d):(\d\d):(\d\d)\.(\d\d\d)"


def seconds(h: str, m: str, s: str, ms: str) -> float:
    return int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000


def parse_cues(body: str, time: str, numbered: bool) -> list[tuple[float, float, str]]:
    """Blank-line separated cues: [number line,] 'start --> end' line, text lines."""
    cue = re.compile((r"(\d+)\n" if numbered else "") + rf"{time} --> {time}\n((?:[^\n]+\n?)+)")
    blocks = [b for b in body.split("\n\n") if b.strip()]
    out = []
    for n, block in enumerate(blocks, 1):
        m = cue.fullmatch(block.strip("\n") + "\n")
        assert m, f"not a cue: {block!r}"
        g = m.groups()
        if numbered:
            assert int(g[0]) == n
            g = g[1:]
        out.append((seconds(*g[0:4]), seconds(*g[4:8]), g[8].strip()))
    return out


def check_times(cues: list[tuple[float, float, str]], duration: float) -> None:
    assert cues[0][0] == 0.0 and cues[-1][1] == pytest.approx(duration, abs=5e-4)
    for (a, b, _), (c, _, _) in zip(cues, cues[1:] + [(cues[-1][1], 0, "")], strict=True):
        assert a < b <= c + 1e-9


@pytest.mark.parametrize("sentences", [False, True])
def test_srt_parses_with_monotonic_times_ending_at_the_duration(sentences):
    body, ctype = render_transcript(TEXT, 3725.5, "srt", "en", sentences=sentences)
    assert ctype.startswith("application/x-subrip")
    cues = parse_cues(body.decode(), SRT_TIME, numbered=True)
    check_times(cues, 3725.5)  # past an hour: HH is 01
    assert " ".join(t for _, _, t in cues) == " ".join(TEXT.split())
    assert len(cues) == (4 if sentences else 1)
    assert body.decode().splitlines()[1] == (
        "00:00:00,000 --> 00:14:03,509" if sentences else "00:00:00,000 --> 01:02:05,500"
    )


@pytest.mark.parametrize("sentences", [False, True])
def test_vtt_parses_and_escapes_markup(sentences):
    text = "Tom & Jerry <b>run</b>. The end --> here!"
    body, ctype = render_transcript(text, 4.25, "vtt", None, sentences=sentences)
    assert ctype.startswith("text/vtt")
    head, _, rest = body.decode().partition("\n\n")
    assert head == "WEBVTT"
    cues = parse_cues(rest, VTT_TIME, numbered=False)
    check_times(cues, 4.25)
    joined = " ".join(t for _, _, t in cues)
    assert "<" not in joined and "-->" not in joined
    assert joined.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&") == text
    if sentences:  # times in proportion to characters: the first sentence's share
        first = "Tom & Jerry <b>run</b>."
        assert cues[0][1] == pytest.approx(4.25 * len(first) / (len(text) - 1), abs=1e-3)


@pytest.mark.parametrize("sentences", [False, True])
def test_verbose_json_is_openais_model(sentences):
    body, ctype = render_transcript(TEXT, 2.5, "verbose_json", "english", sentences=sentences)
    assert ctype == "application/json"
    raw = json.loads(body)
    v = TranscriptionVerbose.model_validate(raw)
    assert raw["task"] == "transcribe"
    assert (v.text, v.language, v.duration) == (TEXT, "english", 2.5)
    assert [s.id for s in v.segments] == list(range(len(v.segments)))
    assert v.segments[0].start == 0.0 and v.segments[-1].end == 2.5
    assert all(a.end == b.start for a, b in zip(v.segments, v.segments[1:], strict=False))
    assert all(s.temperature == 0.0 and s.seek == 0 for s in v.segments)
    assert all(s.compression_ratio > 0 for s in v.segments)
    assert raw["words"] is None and raw["usage"] is None  # values we do not have are null


def test_verbose_json_carries_the_asrs_values_when_it_has_them():
    body, _ = render_transcript(
        "hi", 0.7, "verbose_json", None, avg_logprob=-0.31, no_speech_prob=0.02, tokens=[5, 9]
    )
    v = TranscriptionVerbose.model_validate(json.loads(body))
    (s,) = v.segments
    assert (s.avg_logprob, s.no_speech_prob, s.tokens) == (-0.31, 0.02, [5, 9])
    assert v.language == "unknown"


def test_json_and_text_are_openais_and_unicode_stays():
    body, ctype = render_transcript("héllo 世界", 1.0, "json", "fr")
    assert (
        ctype == "application/json" and Transcription.model_validate_json(body).text == "héllo 世界"
    )
    body, ctype = render_transcript("héllo 世界", 1.0, "text", "fr")
    assert (body, ctype) == ("héllo 世界\n".encode(), "text/plain; charset=utf-8")


def test_an_empty_transcript_has_no_cues():
    assert render_transcript("  ", 1.0, "srt", None)[0] == b""
    assert render_transcript("", 1.0, "vtt", None)[0] == b"WEBVTT\n"
    raw = json.loads(render_transcript("", 1.0, "verbose_json", None)[0])
    assert TranscriptionVerbose.model_validate(raw).segments == []


@pytest.mark.parametrize("fmt", ["xml", "JSON", "", "diarized_json"])
def test_other_formats_are_refused_with_the_list(fmt):
    with pytest.raises(TranscriptFormatError) as e:
        render_transcript("x", 1.0, fmt, None)
    assert isinstance(e.value, ValueError) and repr(fmt) in str(e.value)
    assert all(f in str(e.value) for f in TRANSCRIPTION_FORMATS)
