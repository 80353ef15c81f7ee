"""Task templates: a prepared item becomes model frames [L, N] with per-stream loss weights.

Every frame has N streams. A special/text frame puts its token in stream 0 and each other
stream's pad in stream k; an audio frame puts codebook k in stream k (interleaved by the pattern,
one segment at a time, so delay padding never crosses a segment or sample boundary).

Chat-style template, one block per turn:  <|role|><|modality|> content <|eot|>
    tts:           <bos> [user text] [assistant audio] <eos>
    asr:           <bos> [user audio] [assistant text] <eos>
    continuation:  <bos> [assistant audio] <eos>        (speech LM on audio alone)
    text:          <bos> [assistant text] <eos>         (text LM)
    dialogue:      <bos> [turn] [turn] ... <eos>        (roles and modalities from the data)
The last turn closes with <eos> instead of <eot>. Loss is on assistant turns (from their modality
tag through <eot>/<eos>) or, with loss_region = "all", on every frame after <bos>. A target that
is a stream's pad never carries loss, so delay padding is never "learned".

Classifier-free-guidance dropout (TTS, training only): the user text is replaced by a single
<|cfg_drop|> token, so the model also learns the unconditional distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torchtitan_speechlm.config import TASKS
from torchtitan_speechlm.model.patterns import extra_frames, interleave
from torchtitan_speechlm.model.vocab import VocabLayout

ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
MODALITY_TOKENS = {"text": "<|text|>", "audio": "<|audio|>"}


@dataclass(frozen=True)
class LossWeights:
    text: float
    audio: float
    streams: tuple[float, ...]  # sums to 1


@dataclass
class Example:
    frames: np.ndarray  # int64 [L, N]
    weights: np.ndarray  # float32 [L, N]: weight of predicting frames[j] from frames[:j]


@dataclass(frozen=True)
class Segment:
    """One turn of a template: role, modality and its tokens (text ids [L] or codes [F, N])."""

    role: str
    modality: str
    tokens: np.ndarray


class TemplateBuilder:
    def __init__(self, layout: VocabLayout, pattern: str, weights: LossWeights,
                 loss_region: str = "assistant"):
        if loss_region not in ("assistant", "all"):
            raise ValueError(f"loss_region must be 'assistant' or 'all', got {loss_region!r}")
        self.layout = layout
        self.pattern = pattern
        self.w = weights
        self.loss_region = loss_region
        n = layout.num_streams
        self.pads = np.array([layout.stream_pad(k) for k in range(n)], dtype=np.int64)
        self.code_offsets = np.array([layout.code(k, 0) for k in range(n)], dtype=np.int64)
        self._extra = extra_frames(pattern, n)

    # ---- pieces ----------------------------------------------------------------------------
    def _tokens(self, ids, loss: bool) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        frames = np.broadcast_to(self.pads, (len(ids), len(self.pads))).copy()
        frames[:, 0] = ids
        weights = np.zeros(frames.shape, dtype=np.float32)
        if loss:
            weights[:, 0] = self.w.text
        return frames, weights

    def _audio(self, codes: np.ndarray, loss: bool) -> tuple[np.ndarray, np.ndarray]:
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

    # ---- templates -------------------------------------------------------------------------
    def segments(self, task: str, item, cfg_drop: bool = False) -> list[Segment]:
        """The turns a task makes of a prepared item."""
        text = np.asarray(item.text_tokens, dtype=np.int64)
        audio = item.audio_codes
        if task == "tts":
            prompt = (np.array([self.layout.special("<|cfg_drop|>") - self.layout.text_offset])
                      if cfg_drop else text)
            return [Segment("user", "text", prompt), Segment("assistant", "audio", audio)]
        if task == "asr":
            return [Segment("user", "audio", audio), Segment("assistant", "text", text)]
        if task == "continuation":
            return [Segment("assistant", "audio", audio)]
        if task == "text":
            return [Segment("assistant", "text", text)]
        if task == "dialogue":
            turns = getattr(item, "turns", None)
            if not turns:
                raise ValueError(f"item {item.id!r} has no dialogue turns")
            return [Segment(t.role, t.modality, t.tokens) for t in turns]
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")

    def build(self, task: str, item, cfg_drop: bool = False) -> Example:
        lay = self.layout
        sp = lay.special
        segs = self.segments(task, item, cfg_drop)
        parts = [self._tokens([sp("<|bos|>")], False)]
        for i, seg in enumerate(segs):
            if seg.role not in ROLE_TOKENS or seg.modality not in MODALITY_TOKENS:
                raise ValueError(f"bad turn role/modality {seg.role!r}/{seg.modality!r}")
            loss = self.loss_region == "all" or seg.role == "assistant"
            parts.append(self._tokens([sp(ROLE_TOKENS[seg.role])], self.loss_region == "all"))
            parts.append(self._tokens([sp(MODALITY_TOKENS[seg.modality])], loss))
            if seg.modality == "text":
                parts.append(self._tokens(lay.text_offset + np.asarray(seg.tokens), loss))
            else:
                parts.append(self._audio(np.asarray(seg.tokens), loss))
            end = "<|eos|>" if i == len(segs) - 1 else "<|eot|>"
            parts.append(self._tokens([sp(end)], loss))
        return Example(
            frames=np.concatenate([p[0] for p in parts]),
            weights=np.concatenate([p[1] for p in parts]),
        )

    def length(self, task: str, n_text: int, n_audio_frames: int, n_audio_turns: int = 1,
               n_turns: int = 2) -> int:
        """Frames an example will take, from index lengths alone (for budgeting)."""
        if task in ("tts", "asr"):
            n_turns, n_audio_turns = 2, 1
        elif task == "continuation":
            n_turns, n_audio_turns, n_text = 1, 1, 0
        elif task == "text":
            n_turns, n_audio_turns, n_audio_frames = 1, 0, 0
        return 1 + 3 * n_turns + n_text + n_audio_frames + self._extra * n_audio_turns
