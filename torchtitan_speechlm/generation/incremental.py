"""The model run over rows that grow by one frame per step: the next frame's logits of every
row, for the decoder (``generation/decode.py``) to sample from.

Through the backbone's KV cache, the rows left-padded into one batch (an attention mask and
positions that skip the padding, only the new frame fed after the prompts), or, where a backbone
has no cache, a full recompute of each row (the same tokens, slower). The prompts' continuous
audio segments (``model/audio/tower.py``) are encoded with the prompt and then carried by the
cache. Kept apart from the decoder so that it only decides tokens: what the model is shown, and
how, is here.
"""

from __future__ import annotations

import numpy as np
import torch

from torchtitan_speechlm.data.collation import continuous_batch
from torchtitan_speechlm.utils import upstream

COMPILE_SETTINGS = ("auto", "on", "graphs", "off")


def compile_wanted(setting: str, device: torch.device) -> bool:
    """Whether ``DecodeConfig.compile`` asks for the compiled one-frame step on ``device``:
    ``auto`` only on CUDA (on CPU, measured at the demo shape, the compiled step is ~10% faster
    per frame but its compiling, 13-15 s, is not repaid by 512 frames: docs/generation.md)."""
    if setting not in COMPILE_SETTINGS:
        raise ValueError(f"DecodeConfig.compile = {setting!r}: expected one of {COMPILE_SETTINGS}")
    return setting in ("on", "graphs") or (
        setting == "auto" and torch.device(device).type == "cuda"
    )


class IncrementalForward:
    """``start(rows, audio)`` and then ``advance(frames)`` per step, each returning the last
    position's logits per stream (``[rows, stream vocabulary]`` float CPU tensors) of the rows in
    the batch; ``keep(positions)`` drops the others (finished rows). ``seqs`` holds every row's
    frames so far. ``cfg.use_cache`` is cleared (on the shared config) once a backbone turns out
    to have no cache, so that later decoders recompute from the start."""

    def __init__(self, model, cfg, pads: torch.Tensor, device: torch.device) -> None:
        self.model, self.cfg, self.pads, self.device = model, cfg, pads, device
        self.n = len(pads)
        wanted = compile_wanted(cfg.compile, device)
        mode = "reduce-overhead" if cfg.compile == "graphs" else "default"  # CUDA graphs
        self.compiled = model.compile_decode(wanted, mode)
        if wanted and not self.compiled and cfg.compile == "on":
            upstream.logger.warning(
                f"decode compile = 'on': the {model.family.name} backbone has no static cache "
                "to compile a step over; decoding eagerly"
            )

    @torch.no_grad()
    def start(self, rows: list[np.ndarray], audio: list[list] | None = None) -> list:
        """``audio``: per row, its prompt's continuous segments ``(first frame, int16 wave)``
        (model/audio/tower.py), encoded with the prompt."""
        self.prompts = [torch.as_tensor(r, dtype=torch.long) for r in rows]
        self.fed: list[list[torch.Tensor]] = [[] for _ in rows]  # frames fed after the prompts
        self.audio = audio or [[] for _ in rows]
        self.rows = list(range(len(rows)))  # the batch: indices into seqs
        if not self.cfg.use_cache:
            return self._full()
        width = max(len(r) for r in self.prompts)
        inputs = self.pads.repeat(len(rows), width, 1)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(self.prompts):
            inputs[i, width - len(r) :] = r
            mask[i, width - len(r) :] = 1
        self.mask, self.cache = mask, None
        shifts = [width - len(r) for r in self.prompts]
        try:
            return self._cached(inputs, **self._audio_inputs(range(len(rows)), shifts, width))
        except NotImplementedError:  # this backbone has no cache: recompute in full
            self.cfg.use_cache = False
            return self._full()

    @torch.no_grad()
    def advance(self, frames: torch.Tensor | list[torch.Tensor]) -> list:
        """Append one frame ([N]) to each row of the batch and return the logits after it."""
        frames = torch.stack(list(frames)) if isinstance(frames, list) else frames
        new = frames[:, None]  # [rows, 1, N]
        for i, f in zip(self.rows, frames, strict=True):
            self.fed[i].append(f)
        if not self.cfg.use_cache:
            return self._full()
        self.mask = torch.cat([self.mask, torch.ones(len(frames), 1, dtype=torch.long)], 1)
        return self._cached(new)

    @property
    def seqs(self) -> list[torch.Tensor]:
        """Each row's frames so far [T, N]: its prompt, then the frames fed after it."""
        return [self.seq(i) for i in range(len(self.prompts))]

    def seq(self, i: int) -> torch.Tensor:
        return torch.cat([self.prompts[i], *(f[None] for f in self.fed[i])])

    def keep(self, positions: list[int]) -> bool:
        """Keep only the rows at ``positions`` of the batch (the others have finished): their
        cache rows are selected and the rest freed. False (nothing changed) when the backbone
        cannot select cache rows; the caller then keeps feeding the finished rows."""
        if self.compiled:
            return False  # a compiled step keeps its shapes: finished rows stay, masked
        if self.cfg.use_cache:
            index = torch.tensor(positions, device=self.device)
            try:
                self.cache = self.model.select_cache_rows(self.cache, index)
            except NotImplementedError:
                return False
            self.mask = self.mask[index.cpu()]
        self.rows = [self.rows[p] for p in positions]
        return True

    def _audio_inputs(self, rows, shifts, width: int) -> dict:
        """The model's continuous inputs of ``rows`` (their frames shifted right by ``shifts``,
        left padding), none when their prompts have no continuous segment."""
        segments = [
            (j, first + shift, int(self.model.args.audio.frames_of(len(wave))), wave)
            for j, (i, shift) in enumerate(zip(rows, shifts, strict=True))
            for first, wave in self.audio[i]
        ]
        if not segments:
            return {}
        batch = continuous_batch(segments, len(shifts), width)
        return {k: v.to(self.device) for k, v in batch.items()}

    def _cached(self, new: torch.Tensor, **audio):
        pos = (self.mask.cumsum(-1) - 1).clamp(min=0)[:, -new.shape[1] :]
        logits, self.cache = self.model.decode_step(
            new.to(self.device), pos.to(self.device), self.mask.to(self.device), self.cache, **audio
        )
        return [x[:, -1].float().cpu() for x in logits]

    def _full(self):
        outs = [
            self.model.logits(r[None].to(self.device), **self._audio_inputs([i], [0], len(r)))
            for i, r in ((i, self.seq(i)) for i in self.rows)
        ]
        return [torch.cat([o[s][:, -1] for o in outs]).float().cpu() for s in range(self.n)]
