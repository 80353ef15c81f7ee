"""What the model worker runs (serving/batcher.py): one batched model call per batch, through
generation/tasks.py, on the worker thread only.

- ``tts``: payloads are texts; the rows' audio is emitted as float sample chunks at the codec's
  rate (``speak_chunks``), each row's result is its sample count.
- ``asr``: payloads are float mono waveforms already at ``upload_rate(loaded)`` (the request
  thread decodes, resamples and downmixes the upload); results are the transcripts.

``speak_chunks`` is the one function a streaming TTS generator replaces: today it makes the
whole batch's audio with one ``tasks.tts_with_ends`` call and then cuts each row's finished
waveform into chunks; a generator that yields ``(row, samples)`` while it decodes plugs in
unchanged (the HTTP route already writes each chunk as it is emitted).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.decode import DecodeConfig
from torchtitan_speechlm.generation.loading import Loaded
from torchtitan_speechlm.serving.batcher import Runner


def upload_rate(loaded: Loaded) -> int:
    """The rate an uploaded waveform is resampled to: the model's continuous audio encoder's
    when it has one (its input), else the data codec's (its codes are the input)."""
    encoder = loaded.model.args.audio
    return int(encoder.sample_rate if encoder is not None else loaded.codec.sample_rate)


def speak_chunks(
    loaded: Loaded, texts: list[str], cfg: DecodeConfig, chunk_samples: int
) -> Iterator[tuple[int, np.ndarray]]:
    """``(row, float32 samples)`` of each text's speech, in order within a row, at the codec's
    rate. Replace with a streaming generator to stream while decoding (see the module doc)."""
    codes, _ = tasks.tts_with_ends(loaded, texts, cfg)
    for row, c in enumerate(codes):
        wave = np.asarray(loaded.codec.decode(c), dtype=np.float32).reshape(-1)
        for start in range(0, len(wave), chunk_samples):
            yield row, wave[start : start + chunk_samples]


def transcribe_waves(loaded: Loaded, waves: list[np.ndarray], cfg: DecodeConfig) -> list[str]:
    """One batched ASR call: ``tasks.asr_wave`` through the model's audio encoder when it has
    one, else the codec's codes of every wave (one batched encode) through ``tasks.asr``."""
    if loaded.model.args.audio is not None:
        return tasks.asr_wave(loaded, waves, cfg)
    return tasks.asr(loaded, loaded.codec.encode(list(waves)), cfg)


def runners(loaded: Loaded, cfg: DecodeConfig, chunk_samples: int) -> dict[str, Runner]:
    """The batcher's runners of the two tasks."""

    def tts(texts: list, emit) -> list[int]:
        samples = [0] * len(texts)
        for row, chunk in speak_chunks(loaded, list(texts), cfg, chunk_samples):
            samples[row] += len(chunk)
            emit(row, chunk)
        return samples

    def asr(waves: list, emit) -> list[str]:
        return transcribe_waves(loaded, list(waves), cfg)

    return {"tts": tts, "asr": asr}
