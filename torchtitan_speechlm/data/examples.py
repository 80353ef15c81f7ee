"""Task templates: a prepared item becomes model frames [L, N] with per-stream loss weights.

Every frame has N streams. A special/text frame puts its token in stream 0 and each other stream's
pad in stream k; an audio frame puts codebook k in stream k (interleaved by the pattern).

    tts:  <bos><user><text> text... <eot> <assistant><audio> AUDIO... <eos>
    asr:  <bos><user><audio> AUDIO... <eot> <assistant><text> text... <eos>

Loss is only on the assistant part (from the modality tag after <assistant> through <eos>).
A target that is a stream's pad never carries loss, so delay padding is never "learned".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.patterns import interleave
from ..model.vocab import VocabLayout


@dataclass(frozen=True)
class LossWeights:
    text: float
    audio: float
    streams: tuple[float, ...]  # sums to 1


@dataclass
class Example:
    frames: np.ndarray  # int64 [L, N]
    weights: np.ndarray  # float32 [L, N]: weight of predicting frames[j] from frames[:j]


class TemplateBuilder:
    def __init__(self, layout: VocabLayout, pattern: str, weights: LossWeights):
        self.layout = layout
        self.pattern = pattern
        self.w = weights
        n = layout.num_streams
        self.pads = np.array([layout.stream_pad(k) for k in range(n)], dtype=np.int64)
        self.code_offsets = np.array([layout.code(k, 0) for k in range(n)], dtype=np.int64)

    def _token_frames(self, ids: list[int] | np.ndarray, loss: bool) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        frames = np.broadcast_to(self.pads, (len(ids), len(self.pads))).copy()
        frames[:, 0] = ids
        weights = np.zeros(frames.shape, dtype=np.float32)
        if loss:
            weights[:, 0] = self.w.text
        return frames, weights

    def _audio_frames(self, codes: np.ndarray, loss: bool) -> tuple[np.ndarray, np.ndarray]:
        if codes.ndim != 2 or codes.shape[1] != len(self.pads):
            raise ValueError(
                f"audio codes have shape {codes.shape}; expected [frames, {len(self.pads)}]"
            )
        if codes.size and (codes.min() < 0 or codes.max() >= self.layout.codebook_size):
            raise ValueError("audio code outside the codebook (dataset/codec mismatch)")
        frames = interleave(codes.astype(np.int64) + self.code_offsets, self.pads, self.pattern)
        weights = np.zeros(frames.shape, dtype=np.float32)
        if loss:
            weights[:] = self.w.audio * np.asarray(self.w.streams, dtype=np.float32)
            weights[frames == self.pads] = 0.0
        return frames, weights

    def build(self, task: str, text_tokens: np.ndarray, audio_codes: np.ndarray) -> Example:
        lay = self.layout
        sp = lay.special
        text_ids = lay.text_offset + np.asarray(text_tokens, dtype=np.int64)
        if task == "tts":
            parts = [
                self._token_frames([sp("<|bos|>"), sp("<|user|>"), sp("<|text|>")], False),
                self._token_frames(text_ids, False),
                self._token_frames([sp("<|eot|>"), sp("<|assistant|>")], False),
                self._token_frames([sp("<|audio|>")], True),
                self._audio_frames(audio_codes, True),
                self._token_frames([sp("<|eos|>")], True),
            ]
        elif task == "asr":
            parts = [
                self._token_frames([sp("<|bos|>"), sp("<|user|>"), sp("<|audio|>")], False),
                self._audio_frames(audio_codes, False),
                self._token_frames([sp("<|eot|>"), sp("<|assistant|>")], False),
                self._token_frames([sp("<|text|>")], True),
                self._token_frames(text_ids, True),
                self._token_frames([sp("<|eos|>")], True),
            ]
        else:
            raise ValueError(f"unknown task {task!r}")
        return Example(
            frames=np.concatenate([p[0] for p in parts]),
            weights=np.concatenate([p[1] for p in parts]),
        )

    def length(self, task: str, n_text: int, n_audio_frames: int) -> int:
        """Frames an example will take, without building it (for budgeting)."""
        extra = self.layout.num_streams - 1 if self.pattern == "delay" else 0
        return 7 + n_text + n_audio_frames + extra
