"""The pieces a task template (``data/tasks.py``) is laid out from, each as frames [L, N] with
their loss weights [L, N]: special and text tokens (stream 0, every other stream its pad), a
turn's audio codes interleaved by the pattern, and the placeholder frames of continuous audio.

Pattern padding never carries loss, except stream 0's first pad after its last code in a
delayed segment (``end_of_stream0``): it marks the end of codebook 0, the one decision about
the audio's length generation has to make.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchtitan_speechlm.model.patterns import Pattern
from torchtitan_speechlm.model.vocab import VocabLayout

ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
MODALITY_TOKENS = {"text": "<|text|>", "audio": "<|audio|>"}
CHAT_TEMPLATES = ("ours", "espnet")


def turn_end(chat_template: str, role: str, next_role: str | None) -> str:
    """The token closing a turn of ``role`` followed by a turn of ``next_role`` (None: the
    last turn): ``<|eos|>`` at the end; before another turn ``<|eot|>``, except in ESPnet's
    template (speechlm_job.py's SpeechLMPreprocessor), where a change of role ends the turn
    with ``<|eos|>`` too."""
    if next_role is None or (chat_template == "espnet" and next_role != role):
        return "<|eos|>"
    if chat_template not in CHAT_TEMPLATES:
        raise ValueError(f"chat_template must be one of {CHAT_TEMPLATES}, got {chat_template!r}")
    return "<|eot|>"


@dataclass(frozen=True)
class Segment:
    """One turn of a template: role, modality and its tokens (text ids [L] or codes [F, N])."""

    role: str
    modality: str
    tokens: np.ndarray


def end_of_stream0(frames: np.ndarray, pad0: int) -> int | None:
    """The frame where stream 0 ends a segment with its pad before the segment ends (the delay
    pattern's tail), or None. That pad is a target with loss: it tells generation where
    codebook 0 stops (elsewhere the turn's end token, which always carries loss, does)."""
    codes = np.nonzero(frames[:, 0] != pad0)[0]
    last = int(codes[-1]) if len(codes) else -1
    return last + 1 if last + 1 < len(frames) else None


class TemplatePieces:
    """Frames and weights of each piece of a template, for one vocabulary layout, pattern and
    set of loss weights (a text token's: ``text_weight``; a code's: ``audio_weight`` x its
    stream's)."""

    def __init__(
        self,
        layout: VocabLayout,
        pattern: Pattern,
        text_weight: float,
        audio_weight: float,
        stream_weights: tuple[float, ...],
        continuous_frames: Callable | None = None,
        chat_template: str = "ours",
    ):
        """The weights are ``LossWeights``' (``stream_weights`` sum to 1);
        ``continuous_frames``: as ``TemplateBuilder``'s; ``chat_template``: ``turn_end``'s."""
        self.layout, self.pattern = layout, pattern
        self.chat_template = chat_template
        self.text_weight = text_weight
        # a code's loss weight, per stream
        self.stream_w = (audio_weight * np.asarray(stream_weights, dtype=np.float32)).astype(
            np.float32
        )
        self.continuous_frames = continuous_frames
        n = layout.num_streams
        self.pads = np.array([layout.stream_pad(k) for k in range(n)], dtype=np.int64)
        self.code_offsets = np.array([layout.code(k, 0) for k in range(n)], dtype=np.int64)

    def tokens(self, ids, loss: bool) -> tuple[np.ndarray, np.ndarray]:
        """Special or text tokens (vocabulary ids): one frame each, the id in stream 0."""
        ids = np.asarray(ids, dtype=np.int64)
        frames = np.empty((len(ids), len(self.pads)), dtype=np.int64)
        frames[:] = self.pads  # (not broadcast_to().copy(): its Python overhead is 3x the copy)
        frames[:, 0] = ids
        weights = np.zeros(frames.shape, dtype=np.float32)
        if loss:
            weights[:, 0] = self.text_weight
        return frames, weights

    def audio(self, codes: np.ndarray, loss: bool) -> tuple[np.ndarray, np.ndarray]:
        """Codec codes [F, N] as vocabulary ids, interleaved by the pattern."""
        if codes.ndim != 2 or codes.shape[1] != len(self.pads):
            raise ValueError(
                f"audio codes have shape {codes.shape}; expected [frames, {len(self.pads)}]"
            )
        if codes.size and (codes.min() < 0 or codes.max() >= self.layout.codebook_size):
            raise ValueError("audio code outside the codebook (dataset/codec mismatch)")
        frames = self.pattern.interleave(codes.astype(np.int64) + self.code_offsets, self.pads)
        if loss:  # each code's stream weight moves with the code; pattern padding weighs 0
            w = np.broadcast_to(self.stream_w, codes.shape).astype(np.float32)
            weights = self.pattern.interleave(w, np.zeros(len(self.pads), dtype=np.float32))
            end = end_of_stream0(frames, self.pads[0])
            if end is not None:  # the end of codebook 0 is a decision generation must learn
                weights[end, 0] = self.stream_w[0]
        else:
            weights = np.zeros(frames.shape, dtype=np.float32)
        return frames, weights

    def placeholders(self, samples: int) -> tuple[np.ndarray, np.ndarray]:
        """A continuous segment's frames: the pad frame (the model replaces their embeddings),
        no loss."""
        if self.continuous_frames is None:
            raise ValueError(
                "a continuous-audio task in a run without an audio encoder: set "
                "[audio_encoder] path (docs/audio-encoder.md)"
            )
        n = int(self.continuous_frames(samples))
        frames = np.broadcast_to(self.pads, (n, len(self.pads))).copy()
        frames[:, 0] = self.layout.pad
        return frames, np.zeros(frames.shape, dtype=np.float32)
