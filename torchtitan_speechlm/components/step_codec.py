"""Audio tokenised in the training step: waveform segments of a micro-batch become codes in its
rows on the run's device, just before the forward (training and validation alike).

A data source that hands waveforms instead of codes (ESPnet's iterator: its preprocessor puts
zeros in the sequence and the raw audio beside it, and ESPnet's model encodes in the step) puts
three tensors in the micro-batch besides our usual keys:

``step_audio``           float [n, samples(, channels)]   the segments' waveforms, zero-padded
``step_audio_lengths``   int64 [n]                        their lengths in samples
``step_audio_segments``  int64 [n, 3]                     (row, first frame, frames) of each

frames counted in the document, before the input/target shift (``input`` = frames [0, T-1),
``targets`` = frames [1, T)). ``StepCodec`` asks a ``SegmentTokenizer`` for the segments' ids
(batched: one call per micro-batch, under ``torch.no_grad``), writes each segment's first
``frames`` rows into ``input`` and ``targets`` where they belong, and recounts the token
statistics of ``data_stats`` that the placeholders stood in for. It times itself (logged as
``time/step_codec_s``) and reports the memory its tokenizer holds.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from torchtitan_speechlm.model.vocab import VocabLayout

STEP_AUDIO_KEYS = ("step_audio", "step_audio_lengths", "step_audio_segments")


class SegmentTokenizer(Protocol):
    """Waveform segments -> our token ids as they lie in the sequence (interleaved)."""

    def describe(self) -> str:
        """One line: what tokenises (its name, streams x codebook, frame rate, layout)."""

    def to(self, device: torch.device) -> None:
        """Run on ``device`` from now on (called at the first batch, on the batch's device)."""

    def megabytes(self) -> float:
        """Memory its weights hold."""

    def tokenize(
        self, wave: torch.Tensor, lengths: torch.Tensor, frames: torch.Tensor
    ) -> torch.Tensor:
        """``wave`` [n, samples(, channels)] and ``lengths`` [n] on the run's device, ``frames``
        [n] each segment's length in the sequence -> ids [n, >= max(frames), N] (a segment's
        first ``frames[i]`` rows are placed)."""


def module_megabytes(modules: list[torch.nn.Module]) -> float:
    """Parameters and buffers of ``modules``, in MB."""
    total = 0
    for m in modules:
        total += sum(t.numel() * t.element_size() for t in m.parameters())
        total += sum(t.numel() * t.element_size() for t in m.buffers())
    return total / 2**20


def token_counts(ids: torch.Tensor, layout: VocabLayout) -> dict[str, torch.Tensor]:
    """The ``data_stats`` entries that depend on the ids of ``ids`` [B, T, N]: frames that are
    not all padding, padding frames, audio frames (codes per stream, averaged) and non-pad
    tokens per stream."""
    pads = torch.tensor(layout.pad_frame(), device=ids.device)
    pad = ids == pads
    real = ~pad.all(-1)
    rel = ids - layout.stream_offset(0)
    codes = (rel >= 0) & (ids < layout.size) & (rel % (layout.codebook_size + 1) != 0)
    out = {
        "frames": real.sum(),
        "pad_frames": real.numel() - real.sum(),
        "audio_frames": codes.sum() / layout.num_streams,
    }
    for k in range(layout.num_streams):
        out[f"tokens_stream{k}"] = (~pad[..., k]).sum()
    return out


class StepCodec:
    """Tokenises a micro-batch's ``STEP_AUDIO_KEYS`` into its rows (the module docstring)."""

    def __init__(self, tokenizer: SegmentTokenizer, layout: VocabLayout, stats_keys: tuple):
        self.tokenizer, self.layout = tokenizer, layout
        self.stats_index = {k: i for i, k in enumerate(stats_keys)}
        self.device: torch.device | None = None
        self.seconds, self.batches, self.segments = 0.0, 0, 0
        self.peak_wave_mb = 0.0

    def describe(self) -> str:
        return f"{self.tokenizer.describe()}; its weights hold {self.tokenizer.megabytes():.1f} MB"

    def _to(self, device: torch.device) -> None:
        if self.device != device:
            self.tokenizer.to(device)
            self.device = device

    def __call__(self, input_dict: dict, timed: bool = True) -> dict:
        """Place the codes of ``input_dict``'s waveform segments (in place; returns it).
        ``timed``: count its time in ``interval_metrics`` (training's, not validation's)."""
        if "step_audio" not in input_dict:
            return input_dict
        wave = input_dict.pop("step_audio")
        lengths = input_dict.pop("step_audio_lengths")
        segments = input_dict.pop("step_audio_segments")
        if len(segments) == 0:
            return input_dict
        inp, tgt = input_dict["input"], input_dict["targets"]
        start = time.perf_counter()
        self._to(inp.device)
        with torch.no_grad():
            ids = self.tokenizer.tokenize(wave, lengths, segments[:, 2])
        self.place(inp, tgt, ids.to(inp.device), segments.to(inp.device))
        if "data_stats" in input_dict:
            self.recount(input_dict["data_stats"], inp)
        if not timed:
            return input_dict
        if inp.device.type == "cuda":
            torch.cuda.synchronize(inp.device)
        self.seconds += time.perf_counter() - start
        self.batches += 1
        self.segments += len(segments)
        self.peak_wave_mb = max(self.peak_wave_mb, wave.numel() * wave.element_size() / 2**20)
        return input_dict

    @staticmethod
    def place(inp: torch.Tensor, tgt: torch.Tensor, ids: torch.Tensor, segments) -> None:
        """Frame ``p`` of the document is ``inp[:, p]`` (p < T-1) and ``tgt[:, p-1]`` (p > 0)."""
        rows, first, frames = segments.unbind(-1)
        seg = torch.repeat_interleave(torch.arange(len(frames), device=inp.device), frames)
        offset = torch.arange(len(seg), device=inp.device) - torch.repeat_interleave(
            torch.cumsum(frames, 0) - frames, frames
        )
        row, pos = rows[seg], first[seg] + offset
        values = ids[seg, offset]
        t = inp.shape[1]
        if int(pos.max()) > t:
            raise ValueError(f"an audio segment ends at frame {int(pos.max())} of {t + 1}")
        keep = pos < t
        inp[row[keep], pos[keep]] = values[keep]
        keep = pos > 0
        tgt[row[keep], pos[keep] - 1] = values[keep]

    def recount(self, stats: torch.Tensor, inp: torch.Tensor) -> None:
        """``data_stats`` [1, K]: its token counts of ``inp`` again, now holding the codes."""
        for key, value in token_counts(inp, self.layout).items():
            stats[0, self.stats_index[key]] = value.to(stats.dtype)

    def interval_metrics(self, steps: int) -> dict[str, float]:
        """Seconds per training step spent tokenising since the last call (then reset), and the
        largest waveform batch so far (MB)."""
        out = {
            "time/step_codec_s": self.seconds / max(steps, 1),
            "memory/step_codec_wave_mb": self.peak_wave_mb,
        }
        self.seconds = 0.0
        return out
