"""Autoregressive decoding of a SpeechLM: frame by frame, every stream at once, with the
backbone's KV cache (or a full recompute where a backbone has none), batched (left-padded
rows; feeding the model is ``generation/incremental.py``'s), per-modality sampling,
classifier-free guidance and masks.

Audio follows the interleave pattern: an *index map* (the pattern applied to code indices)
says, for frame j and stream s, which code (frame f, codebook k) sits there or that it is the
stream's pad. Pads are forced, known codes (a continuation prompt) are forced, every other slot
is sampled among codebook k's codes only. The length is the model's decision: where codebook 0's
next code would go, the end markers are allowed too (the turn's end token, or stream 0's pad that
ends codebook 0 in the delay pattern); once chosen, the remaining slots of the segment are
completed and the turn ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from torchtitan_speechlm.data.template_pieces import end_of_stream0
from torchtitan_speechlm.generation.incremental import IncrementalForward
from torchtitan_speechlm.generation.sampling import Sampling, guided, pick
from torchtitan_speechlm.model.patterns import get_pattern


@dataclass
class DecodeConfig:
    text: Sampling = field(default_factory=Sampling)
    audio: Sampling = field(default_factory=Sampling)
    cfg_scale: float = 1.0  # classifier-free guidance (TTS); 1 = off
    min_frames: int = 1  # audio frames before the end may be chosen
    max_frames: int = 500
    max_text_tokens: int = 200
    use_cache: bool = True
    seed: int = 0
    # the one-frame decode step under torch.compile: auto (on CUDA only) | on | off
    # (generation/incremental.py::compile_wanted; backbones with a static cache: native, qwen3)
    compile: str = "auto"


def index_map(pattern, frames: int, num_streams: int) -> np.ndarray:
    """[model frames, N]: ``f * N + k`` where code (f, k) sits, -1 where the stream pads."""
    idx = np.arange(frames * num_streams, dtype=np.int64).reshape(frames, num_streams)
    return pattern.interleave(idx, np.full(num_streams, -1, dtype=np.int64))


@dataclass
class AudioRow:
    """One row's place in its audio segment while ``Decoder.audio`` generates it."""

    map: np.ndarray  # the index map the row follows (index_map); cut short once the model ends
    codes: np.ndarray  # [max_frames, N]: the codes so far
    j: int = 0  # the next model frame of ``map``
    length: int | None = None  # the segment's codec frames, once known
    done: bool = False  # the segment is complete: nothing left to emit
    ended: bool = False  # the model chose the end (not the max_frames limit)


class Decoder:
    """Generates audio codes (``audio``) or text ids (``text``) after prompts, all rows of a
    batch together; the model side (KV cache, inputs) is ``IncrementalForward``'s."""

    def __init__(self, model, config: DecodeConfig | None = None):
        self.model, self.cfg = model.eval(), config or DecodeConfig()
        lay = model.args.layout
        self.layout, self.n = lay, lay.num_streams
        self.pattern = get_pattern(model.args.pattern)
        self.ranges = model.head.ranges
        self.pads = torch.tensor([lay.stream_pad(k) for k in range(self.n)])
        self.ends = (lay.special("<|eos|>"), lay.special("<|eot|>"))
        self.device = next(model.parameters()).device
        self.generator = torch.Generator().manual_seed(self.cfg.seed)
        # does stream 0 end a segment with its pad before the segment ends (delay)? Then that
        # pad is the trained end marker (data/template_pieces.py::end_of_stream0), else the end
        # token is
        self.pad_ends = end_of_stream0(index_map(self.pattern, 2, self.n), -1) is not None
        self.forward = IncrementalForward(self.model, self.cfg, self.pads, self.device)

    @property
    def seqs(self) -> list[torch.Tensor]:
        """Each row's frames fed to the model so far (its prompt first)."""
        return self.forward.seqs

    # ---- masks -------------------------------------------------------------------------------
    def allowed(self, s: int, ids: list[int]) -> torch.Tensor:
        """Bool mask over stream ``s``'s logits slice admitting exactly ``ids``."""
        a, b = self.ranges[s]
        mask = torch.zeros(b - a, dtype=torch.bool)
        mask[[i - a for i in ids]] = True
        return mask

    def code_ids(self, k: int) -> list[int]:
        start = self.layout.code(k, 0)
        return list(range(start, start + self.layout.codebook_size))

    def _scores(self, logits, s: int, i: int, rows: int) -> torch.Tensor:
        cond = logits[s][i : i + 1]
        uncond = logits[s][i + rows : i + rows + 1] if len(logits[s]) > rows else None
        return guided(cond, uncond, self.cfg.cfg_scale)

    # ---- audio ---------------------------------------------------------------------------------
    def audio(
        self,
        prompts: list[np.ndarray],
        uncond: list[np.ndarray] | None = None,
        known: list[np.ndarray | None] | None = None,
    ) -> list[np.ndarray]:
        """Codes [F, N] generated after each prompt (which ends with ``<|audio|>``); ``uncond``
        prompts enable guidance; ``known`` codes start each segment (continuation).

        Afterwards ``self.ended[i]`` says whether row i's end was the model's choice (True) or
        the ``max_frames`` limit's (False): evaluation reports the share that ended by itself."""
        b, n, cfg = len(prompts), self.n, self.cfg
        known = known or [None] * b
        rows = list(prompts) + list(uncond or [])
        full = index_map(self.pattern, cfg.max_frames, n)
        state = [AudioRow(full, np.zeros((cfg.max_frames, n), dtype=np.int64)) for _ in range(b)]
        logits = self.forward.start(rows)
        while True:
            frames = [self._audio_frame(st, logits, i, b, known[i]) for i, st in enumerate(state)]
            if all(st.done for st in state):
                break
            logits = self.forward.advance(frames + frames[: len(rows) - b])
        self.ended = [st.ended for st in state]
        return [st.codes[: st.length] for st in state]

    def _audio_frame(self, st: AudioRow, logits, i: int, rows: int, known) -> torch.Tensor:
        frame = self.pads.clone()
        if st.done:
            return frame
        n, j = self.n, st.j
        for s in range(n):
            slot = int(st.map[j, s])
            if slot < 0:
                continue  # the pattern's pad
            f, k = divmod(slot, n)
            if known is not None and f < len(known):
                frame[s] = self.layout.code(k, int(known[f, k]))
                st.codes[f, k] = int(known[f, k])
                continue
            ids = self.code_ids(k)
            may_end = (
                st.length is None
                and k == 0
                and f >= self.cfg.min_frames + (0 if known is None else len(known))
            )
            if may_end:  # where training put the end: stream 0's pad (a tail), else end tokens
                ids = ids + ([self.layout.stream_pad(s)] if self.pad_ends else list(self.ends))
            a = self.ranges[s][0]
            token = a + int(
                pick(
                    self._scores(logits, s, i, rows),
                    self.allowed(s, ids),
                    self.cfg.audio,
                    self.generator,
                )
            )
            if may_end and token not in ids[: self.layout.codebook_size]:
                st.length = f  # the model ended the audio before code (f, 0)
                st.ended = True
                st.map = index_map(self.pattern, f, n)
                if token in self.ends or len(st.map) <= j:
                    frame[:] = self.pads
                    frame[0] = token if token in self.ends else self.ends[0]
                    st.done = True
                    return frame
                frame[s] = token
                continue
            frame[s] = token
            st.codes[f, k] = token - self.layout.code(k, 0)
        st.j = j + 1
        if st.length is None and st.j >= len(st.map):
            st.length = self.cfg.max_frames  # the longest allowed: the segment is complete
        if st.length is not None and st.j >= len(st.map):
            st.done = True  # the turn's end token would come next
        return frame

    # ---- text ----------------------------------------------------------------------------------
    def text(self, prompts: list[np.ndarray], audio: list[list] | None = None) -> list[list[int]]:
        """Text token ids (the tokenizer's) generated after each prompt (ending ``<|text|>``);
        ``audio``: the prompts' continuous segments (``IncrementalForward.start``)."""
        lay, b = self.layout, len(prompts)
        ids = list(range(lay.text_offset, lay.text_offset + lay.text_size)) + list(self.ends)
        mask = self.allowed(0, ids)
        out: list[list[int]] = [[] for _ in range(b)]
        done = [False] * b
        logits = self.forward.start(list(prompts), audio)
        for _ in range(self.cfg.max_text_tokens):
            frames = []
            for i in range(b):
                frame = self.pads.clone()
                if not done[i]:
                    token = self.ranges[0][0] + int(
                        pick(self._scores(logits, 0, i, b), mask, self.cfg.text, self.generator)
                    )
                    if token in self.ends:
                        done[i] = True
                    else:
                        out[i].append(token - lay.text_offset)
                    frame[0] = token
                frames.append(frame)
            if all(done):
                break
            logits = self.forward.advance(frames)
        return out
