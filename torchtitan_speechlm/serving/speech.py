"""What the model worker runs (serving/batcher.py): one batched model call per batch, through
generation/tasks.py, on the worker thread only.

- ``tts``: payloads are ``SpeechRow``s (serving/rows.py); one ``tasks.tts_with_ends`` call for
  the batch, its rows with or without a speaker prompt (a voice's codes, an upload encoded
  here), of any lengths: the decoder batches prompts of different lengths. A streamed row's
  samples are emitted while it is generated: the decoder hands its complete codec frames
  (``on_frames``) to an ``AudioStream`` over the codec's stream decoder (generation/streaming.py),
  whose blocks go to the row's job as they come. The other rows are decoded whole
  (``tasks.decode_audio``) and emitted as one piece, the exact audio ``torchtitan generate``
  writes. Each row's result is its sample count. Under the batcher the batch is continuous:
  queued rows join it between decode steps (``emit.take``; ``tasks.tts_joining``) and each row
  is decoded and answered (``emit.finish``) the step it completes.
- ``asr``: payloads are ``AsrRow``s, float32 mono waveforms at ``tasks.input_rate(loaded)``;
  one ``tasks.transcribe_waves`` call per temperature asked (``asr_wave`` through a continuous
  audio encoder, else one ``codec.encode`` of the rows and ``asr``); results are the
  transcripts.

Both ask the batch's ``emit.stopped(row)`` (serving/batcher.py ``Emit``) between decode steps:
a row whose request was cancelled (its client left) leaves the batch there, is not decoded to
audio, and its result (0 samples, an empty text) is not used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.decode import DecodeConfig, Joining
from torchtitan_speechlm.generation.loading import Loaded
from torchtitan_speechlm.generation.streaming import AudioStream
from torchtitan_speechlm.serving.batcher import Runner
from torchtitan_speechlm.serving.rows import AsrRow, SpeechRow


def speak(
    loaded: Loaded,
    rows: list[SpeechRow],
    cfg: DecodeConfig,
    emit: Callable[[int, np.ndarray], None],
) -> list[int]:
    """Speak every row in one batched call; ``emit(row, float32 samples)`` in order within a row
    (streamed rows while decoding, the others once complete); returns each row's sample count
    (0 for a row ``emit.stopped`` ended). With the batcher's ``Emit`` (and best-of-N off), the
    batch is continuous: queued rows join it between decode steps (``emit.take``) and each row
    is answered (``emit.finish``) at the step it completes."""
    rows, stopped = list(rows), _stop_check(emit)
    continuous = cfg.best_of == 1 and hasattr(emit, "take")
    streams: dict[int, AudioStream] = {}
    samples = [0] * len(rows)
    row_of = list(range(len(rows)))  # the decoder's row -> the batch's (a joiner may fail first)

    def open_stream(i: int) -> None:
        if rows[i].stream:
            streams[i] = AudioStream(loaded.codec, lambda block, i=i: emit(i, block))

    def on_frames(d: int, codes: np.ndarray) -> None:
        if row_of[d] in streams:
            streams[row_of[d]].frames(codes)

    def on_done(d: int, codes: np.ndarray, ended: bool) -> None:
        i = row_of[d]
        stream = streams.pop(i, None)
        if not stopped(i):
            samples[i] = _deliver(loaded, codes, stream, lambda wave: emit(i, wave))
        emit.finish(i, samples[i])
        rows[i] = None  # an uploaded prompt's waveform is not kept while the batch goes on

    def join(live: int) -> list[Joining]:
        joining = []
        for row in emit.take():
            rows.append(row)
            samples.append(0)
            i = len(rows) - 1
            try:  # a bad prompt fails its own request, not the batch
                joining.append(tasks.tts_joining(loaded, row.text, cfg, prompt_codes(loaded, row)))
            except Exception as e:  # noqa: BLE001
                emit.fail(i, e)
                continue
            open_stream(i)
            row_of.append(i)
        return joining

    for i in range(len(rows)):
        open_stream(i)
    prompts = [prompt_codes(loaded, r) for r in rows]
    codes, _ = tasks.tts_with_ends(
        loaded,
        [r.text for r in rows],
        cfg,
        on_frames=on_frames if streams or continuous else None,
        prompts_codes=prompts if any(p is not None for p in prompts) else None,
        stop=None if stopped is None else (lambda d: stopped(row_of[d])),
        join=join if continuous else None,
        on_done=on_done if continuous else None,
    )
    if continuous:
        return samples
    gone = {i for i in range(len(rows)) if stopped is not None and stopped(i)}
    for i, stream in streams.items():
        if i not in gone:
            samples[i] = stream.finish(codes[i])
    whole = [i for i in range(len(rows)) if i not in streams and i not in gone]
    for i, wave in zip(whole, tasks.decode_audio(loaded, [codes[i] for i in whole]), strict=True):
        wave = np.asarray(wave, dtype=np.float32).reshape(-1)
        samples[i] = len(wave)
        emit(i, wave)
    return samples


def _deliver(loaded: Loaded, codes: np.ndarray, stream: AudioStream | None, emit) -> int:
    """A complete row's audio: its stream's last blocks, or the whole clip decoded and emitted
    as one piece; its sample count."""
    if stream is not None:
        return stream.finish(codes)
    wave = np.asarray(tasks.decode_audio(loaded, [codes])[0], dtype=np.float32).reshape(-1)
    emit(wave)
    return len(wave)


def prompt_codes(loaded: Loaded, row: SpeechRow) -> np.ndarray | None:
    """A row's speaker prompt as codes: a voice's as loaded, an upload's encoded here (on the
    worker) and cut to the model's ``prompt_seconds`` as ``generate --prompt`` cuts it."""
    if row.prompt is not None:
        return row.prompt
    if row.prompt_wave is not None:
        return tasks.speaker_prompt(loaded, row.prompt_wave, "prompt_audio", what="prompt_audio")
    return None


def _stop_check(emit) -> Callable[[int], bool] | None:
    """The batch's ``emit.stopped`` (a plain callable ``emit`` has none: nothing is cut)."""
    return getattr(emit, "stopped", None)


def transcribe(loaded: Loaded, rows: list[AsrRow], cfg: DecodeConfig,
               stopped: Callable[[int], bool] | None = None) -> list[str]:  # fmt: skip
    """Every row's transcript: one ``tasks.transcribe_waves`` call per temperature asked (the
    server's for rows that ask none); ``stopped(row)``: ``emit.stopped``."""
    out: list[str] = [""] * len(rows)
    temps = [cfg.text.temperature if r.temperature is None else r.temperature for r in rows]
    for t in dict.fromkeys(temps):
        idx = [i for i, ti in enumerate(temps) if ti == t]
        run = replace(cfg, text=replace(cfg.text, temperature=t))
        stop = None if stopped is None else (lambda k, idx=idx: stopped(idx[k]))
        texts = tasks.transcribe_waves(loaded, [rows[i].wave for i in idx], run, stop=stop)
        for i, text in zip(idx, texts, strict=True):
            out[i] = text
    return out


def runners(loaded: Loaded, cfg: DecodeConfig) -> dict[str, Runner]:
    """The batcher's runners of the two tasks."""

    def tts(rows: list, emit) -> list[int]:
        return speak(loaded, list(rows), cfg, emit)

    def asr(rows: list, emit) -> list[str]:
        return transcribe(loaded, list(rows), cfg, _stop_check(emit))

    return {"tts": tts, "asr": asr}
