"""Generation requests run in batches: what ``torchtitan generate`` (one request or a batch file)
hands the model (``torchtitan serve`` batches its own uploads: serving/speech.py).

Each request is read on its own first (``read``: the text checked against the tokenizer, the
audio loaded, resampled and downmixed), so a bad request fails alone with its message. The good
ones are grouped by task, ordered by length (rows of one batch then pad little and end close
together) and decoded ``batch_size`` at a time through the task's batched call
(generation/tasks.py); a batch that fails is rerun row by row, so one row's failure costs only
that row. Results come back in the requests' order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.decode import DecodeConfig
from torchtitan_speechlm.generation.loading import Loaded
from torchtitan_speechlm.utils.audio import load_audio

TEXT_OUT = ("asr", "answer")  # tasks whose result is text; the others give audio codes


@dataclass
class Request:
    task: str
    text: str | None = None
    audio: str | None = None  # an audio file: any rate, any channels
    seed: int | None = None  # None: the decoding config's
    prompt: str | None = None  # tts: a speaker prompt (a file, read like audio)


@dataclass
class Outcome:
    text: str | None = None  # asr, answer
    codes: np.ndarray | None = None  # tts, continuation: [frames, N]
    ended: bool | None = None  # audio: the model ended it (not max_frames)
    error: str | None = None  # set when the request failed; the rest is then None


def read(loaded: Loaded, req: Request):
    """A request's decoder input, checked; raises ValueError (BadAudioError included) naming
    what is wrong."""
    if req.task not in tasks.TASKS:
        raise ValueError(f"unknown task {req.task!r}; choose one of {', '.join(tasks.TASKS)}")
    if req.task == "tts":
        if not req.text:
            raise ValueError("task tts needs a text")
        tasks.text_ids(loaded, req.text)  # the tokenizer's checks
        if _prompted(req):
            tasks.check_prompted(loaded)  # before reading the file: the reason comes first
            wave = load_audio(req.prompt, loaded.codec.sample_rate)
            return (req.text, tasks.speaker_prompt(loaded, wave, f"prompt {req.prompt}"))
        return req.text
    if _prompted(req):
        raise ValueError(f"a speaker prompt is for task tts, not {req.task}")
    if not req.audio:
        raise ValueError(f"task {req.task} needs an audio file")
    if req.task == "continuation":
        return loaded.codec.encode([load_audio(req.audio, loaded.codec.sample_rate)])[0]
    wave = load_audio(req.audio, tasks.input_rate(loaded))
    if req.task == "answer":
        if req.text:
            tasks.text_ids(loaded, req.text)
        return (wave, req.text or None)
    return wave


def _prompted(req: Request) -> bool:
    return bool(req.prompt)


def _group(req: Request) -> str:
    """The batched call a request goes to: its task, a speaker-prompted tts its own."""
    return "tts_prompt" if req.task == "tts" and _prompted(req) else req.task


def _length(task: str, value) -> int:
    if task == "tts":
        return len(value)
    if task == "tts_prompt":
        return len(value[0]) + len(value[1])
    return len(value[0] if task == "answer" else value)


def _decode(
    loaded: Loaded, task: str, inputs: list, cfg: DecodeConfig, seeds: list[int], on_frames
) -> list[Outcome]:
    """One batched decoder call of ``task``."""
    if task in ("tts", "tts_prompt"):
        texts, prompts = (inputs, None) if task == "tts" else map(list, zip(*inputs, strict=True))
        codes, ended = tasks.tts_with_ends(loaded, texts, cfg, seeds, on_frames, prompts)
        return [Outcome(codes=c, ended=e) for c, e in zip(codes, ended, strict=True)]
    if task == "continuation":
        return [Outcome(codes=c) for c in tasks.continuation(loaded, inputs, cfg, seeds, on_frames)]
    if task == "asr":
        return [Outcome(text=t) for t in tasks.transcribe_waves(loaded, inputs, cfg, seeds)]
    return [Outcome(text=t) for t in tasks.answers(loaded, inputs, cfg, seeds)]


def run_requests(
    loaded: Loaded,
    requests: list[Request],
    cfg: DecodeConfig,
    batch_size: int = 8,
    on_frames: Callable[[int, np.ndarray], None] | None = None,
    on_batch: Callable[[str, int], None] | None = None,
) -> list[Outcome]:
    """Every request's outcome, in order (see the module docstring). ``on_frames(i, codes)``:
    request i's complete codec frames so far, as they are generated (audio tasks; streaming).
    ``on_batch(task, rows)``: called before each batched call (progress, batch statistics)."""
    out: list[Outcome | None] = [None] * len(requests)
    groups: dict[str, list[tuple[int, object]]] = {}
    for i, req in enumerate(requests):
        try:
            groups.setdefault(_group(req), []).append((i, read(loaded, req)))
        except (ValueError, OSError) as e:
            out[i] = Outcome(error=_one_line(e))
    for task, rows in groups.items():
        for part in batches_by_length([_length(task, v) for _, v in rows], batch_size):
            chunk = [rows[k] for k in part]
            if on_batch is not None:
                on_batch(task, len(chunk))
            for (i, _), outcome in zip(
                chunk, _run_chunk(loaded, task, chunk, requests, cfg, on_frames), strict=True
            ):
                out[i] = outcome
    return out  # type: ignore[return-value]


def batches_by_length(lengths: list[int], size: int) -> list[list[int]]:
    """Indices into ``lengths`` in batches of at most ``size``, shortest first: rows of one
    batch pad little and end close together. Ties keep their order (stable)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    size = max(1, size)
    return [order[s : s + size] for s in range(0, len(order), size)]


def _run_chunk(loaded, task, chunk, requests, cfg, on_frames) -> list[Outcome]:
    """A batch's outcomes; rerun row by row when the batched call fails."""

    def call(part):
        ids = [i for i, _ in part]
        seeds = [cfg.seed if requests[i].seed is None else int(requests[i].seed) for i in ids]
        row_frames = None if on_frames is None else (lambda r, c: on_frames(ids[r], c))
        return _decode(loaded, task, [v for _, v in part], cfg, seeds, row_frames)

    try:
        return call(chunk)
    except (ValueError, RuntimeError, OSError) as e:
        if len(chunk) == 1:
            return [Outcome(error=_one_line(e))]
    outcomes = []
    for row in chunk:
        try:
            outcomes += call([row])
        except (ValueError, RuntimeError, OSError) as e:
            outcomes.append(Outcome(error=_one_line(e)))
    return outcomes


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
