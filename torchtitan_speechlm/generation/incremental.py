"""The model run over rows that grow by one frame per step: the next frame's logits of every
row, for the decoder (``generation/decode.py``) to sample from.

Through the backbone's KV cache, the rows left-padded into one batch (an attention mask and
positions that skip the padding, only the new frame fed after the prompts), or, where a backbone
has no cache, a full recompute of each row (the same tokens, slower). Rows may join a batch in
progress (``join``: their prompts run apart, then the two caches joined, left-padded to the same
length), for a server's continuous batching. The prompts' continuous
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
        self.joined = False  # whether rows have joined (join): the cache may then be trimmed
        if not self.cfg.use_cache:
            return self._full()
        self.cache = None
        try:
            logits, self.mask, self.cache = self._prefill(self.rows)
            return logits
        except NotImplementedError:  # this backbone has no cache: recompute in full
            self.cfg.use_cache = False
            return self._full()

    @property
    def can_join(self) -> bool:
        """Whether ``join`` can add rows to the batch now: a cache its backbone can join
        (not a compiled step, whose shapes are fixed)."""
        return (
            self.cfg.use_cache
            and not self.compiled
            and self.cache is not None
            and self.model.can_join_cache_rows(self.cache)
        )

    @torch.no_grad()
    def join(self, rows: list[np.ndarray]) -> list:
        """Add ``rows`` (prompts without continuous segments: TTS's) to the batch in progress, after its rows:
        their prompts are run apart (a cache of their own) and the two caches joined, the
        shorter side left-padded. Returns the new rows' logits (as ``start``'s); ``advance``
        then feeds every row. Only where ``can_join``."""
        first = len(self.prompts)
        self.prompts += [torch.as_tensor(r, dtype=torch.long) for r in rows]
        self.fed += [[] for _ in rows]
        self.audio += [[] for _ in rows]
        new = list(range(first, first + len(rows)))
        logits, mask, cache = self._prefill(new)
        self.cache = self.model.join_cache_rows(self.cache, cache)
        width = max(self.mask.shape[1], mask.shape[1])
        self.mask = torch.cat([_left_padded(self.mask, width), _left_padded(mask, width)])
        self.rows += new
        self.joined = True
        return logits

    def _prefill(self, rows: list[int]) -> tuple[list, torch.Tensor, object]:
        """The prompts of ``rows`` left-padded into one batch and run with a new cache: their
        logits, attention mask and cache."""
        prompts = [self.prompts[i] for i in rows]
        width = max(len(r) for r in prompts)
        inputs = self.pads.repeat(len(rows), width, 1)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for j, r in enumerate(prompts):
            inputs[j, width - len(r) :] = r
            mask[j, width - len(r) :] = 1
        shifts = [width - len(r) for r in prompts]
        audio = self._audio_inputs(rows, shifts, width)
        logits, cache = self._run(inputs, mask, None, **audio)
        return logits, mask, cache

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
            self._trim()
        rows = [self.rows[p] for p in positions]
        if self.joined:  # a continuous batch: what the rows that left were fed is not kept
            for i in set(self.rows) - set(rows):
                self.fed[i] = []
        self.rows = rows
        return True

    def _trim(self) -> None:
        """Drop the leading slots that are padding in every row left (a continuous batch's:
        rows that joined late were padded back to the first row's start), so that the cache
        and each step's attention stay as long as the oldest row still decoding, not as the
        batch's age. Only for a batch that has had rows join (its cache can drop slots)."""
        if not self.joined or not self.mask.any():
            return
        lead = int(self.mask.any(0).long().argmax())
        if lead >= 16 and 2 * lead >= self.mask.shape[1]:  # worth a copy of the cache
            self.cache = self.model.drop_first_cache_slots(self.cache, lead)
            self.mask = self.mask[:, lead:]

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
        logits, self.cache = self._run(new, self.mask, self.cache, **audio)
        return logits

    def _run(self, new: torch.Tensor, mask: torch.Tensor, cache, **audio) -> tuple[list, object]:
        """The last position's logits after ``new`` (the frames after ``cache``'s; ``mask``:
        the rows' attention mask over both), and the cache."""
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -new.shape[1] :]
        logits, cache = self.model.decode_step(
            new.to(self.device), pos.to(self.device), mask.to(self.device), cache, **audio
        )
        return [x[:, -1].float().cpu() for x in logits], cache

    def _full(self):
        outs = [
            self.model.logits(r[None].to(self.device), **self._audio_inputs([i], [0], len(r)))
            for i, r in ((i, self.seq(i)) for i in self.rows)
        ]
        return [torch.cat([o[s][:, -1] for o in outs]).float().cpu() for s in range(self.n)]


def _left_padded(mask: torch.Tensor, width: int) -> torch.Tensor:
    """An attention mask [rows, T] with 0 columns before it, to ``width``."""
    return torch.nn.functional.pad(mask, (width - mask.shape[1], 0))
