"""Autoregressive decoding of a SpeechLM: frame by frame, every stream at once, with the
backbone's KV cache (or a full recompute where a backbone has none), batched (left-padded
rows; feeding the model is ``generation/incremental.py``'s), per-modality sampling,
classifier-free guidance and masks.

Every step is one model call and, per stream, one masked pick over all rows of the batch (the
rows' masks stacked into one [rows, vocabulary] tensor); a row that ends leaves the batch (its KV
cache rows are dropped, ``IncrementalForward.keep``), so the others run at the cost of their own
number, and rows may join it between steps (``audio``'s ``join``: a server's continuous
batching). Each row draws from its own generator, seeded with its own seed: a sampled row is the
same whether it runs alone, beside others or joins them late.

Audio follows the interleave pattern: an *index map* (the pattern applied to code indices)
says, for frame j and stream s, which code (frame f, codebook k) sits there or that it is the
stream's pad. Pads are forced, known codes (a continuation prompt) are forced, every other slot
is sampled among codebook k's codes only. The length is the model's decision: where codebook 0's
next code would go, the end markers are allowed too (the turn's end token, or stream 0's pad that
ends codebook 0 in the delay pattern); once chosen, the remaining slots of the segment are
completed and the turn ends.

``stop(i)``, when given, is asked for every row still decoding after each step: a row it
answers True for ends there (its codes cut to the frames complete so far, or its text so far)
and leaves the batch, so that a server drops the work of a client that has left (serving/
batcher.py) between two steps rather than at the end of the batch.
"""

from __future__ import annotations

from collections.abc import Callable
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
    seed: int = 0  # every row's seed unless the caller gives one per row
    # TTS: draw this many samples per text (seeds seed..seed+n-1) and keep the one the model's
    # own ASR reads back closest to the text (generation/tasks.py::tts_with_ends); 1 = off
    best_of: int = 1
    # the one-frame decode step under torch.compile: auto (on CUDA only) | on | off | graphs
    # (compiled and replayed as a CUDA graph: torch.compile's mode="reduce-overhead")
    # (generation/incremental.py::compile_wanted; backbones with a static cache: native, qwen3)
    compile: str = "auto"


def index_map(pattern, frames: int, num_streams: int) -> np.ndarray:
    """[model frames, N]: ``f * N + k`` where code (f, k) sits, -1 where the stream pads."""
    idx = np.arange(frames * num_streams, dtype=np.int64).reshape(frames, num_streams)
    return pattern.interleave(idx, np.full(num_streams, -1, dtype=np.int64))


@dataclass
class Joining:
    """A row that joins ``Decoder.audio``'s batch in progress (``join``): its prompt, its
    unconditional twin's when the batch is guided, its seed (None: ``cfg.seed``)."""

    prompt: np.ndarray
    uncond: np.ndarray | None = None
    seed: int | None = None


@dataclass
class AudioRow:
    """One row's place in its audio segment while ``Decoder.audio`` generates it."""

    map: np.ndarray  # the index map the row follows (index_map); cut short once the model ends
    codes: np.ndarray  # [max_frames, N]: the codes so far
    j: int = 0  # the next model frame of ``map``
    length: int | None = None  # the segment's codec frames, once known
    done: bool = False  # the segment is complete: nothing left to emit
    ended: bool = False  # the model chose the end (not the max_frames limit)

    def complete(self) -> int:
        """How many leading codec frames have all their codes: those whose every slot in
        ``map`` lies before ``j`` (all of them once the segment is done)."""
        if self.done:
            return int(self.length or 0)
        slots = self.map[: self.j]
        have = np.zeros(len(self.codes) * self.codes.shape[1] + 1, dtype=bool)
        have[slots[slots >= 0]] = True
        frames = have[:-1].reshape(len(self.codes), -1).all(1)
        upto = len(frames) if self.length is None else self.length
        return int(np.argmin(np.append(frames[:upto], False)))


class Decoder:
    """Generates audio codes (``audio``) or text ids (``text``) after prompts, all rows of a
    batch together; the model side (KV cache, inputs) is ``IncrementalForward``'s."""

    def __init__(self, model, config: DecodeConfig | None = None,
                 stop: Callable[[int], bool] | None = None):  # fmt: skip
        self.model, self.cfg = model.eval(), config or DecodeConfig()
        self.stop = stop  # stop(i): end row i now (see the module's docstring)
        lay = model.args.layout
        self.layout, self.n = lay, lay.num_streams
        self.pattern = get_pattern(model.args.pattern)
        self.ranges = model.head.ranges
        self.pads = torch.tensor([lay.stream_pad(k) for k in range(self.n)])
        self.ends = (lay.special("<|eos|>"), lay.special("<|eot|>"))
        self.device = next(model.parameters()).device
        # does stream 0 end a segment with its pad before the segment ends (delay)? Then that
        # pad is the trained end marker (data/template_pieces.py::end_of_stream0), else the end
        # token is
        self.pad_ends = end_of_stream0(index_map(self.pattern, 2, self.n), -1) is not None
        self.forward = IncrementalForward(self.model, self.cfg, self.pads, self.device)
        self._masks: dict[tuple[int, int | None], torch.Tensor] = {}

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

    def _mask(self, s: int, k: int) -> torch.Tensor:
        """Stream ``s``'s mask of codebook ``k``'s codes (``k = -1``: the end markers), cached."""
        if (s, k) not in self._masks:
            ends = [self.layout.stream_pad(s)] if self.pad_ends else list(self.ends)
            self._masks[s, k] = self.allowed(s, ends if k < 0 else self.code_ids(k))
        return self._masks[s, k]

    def _codebook_masks(self, s: int) -> torch.Tensor:
        """[N, V_s]: stream ``s``'s mask of each codebook's codes (rows indexed by codebook)."""
        if (s, None) not in self._masks:
            a, b = self.ranges[s]
            inside = [
                a <= self.layout.code(k, 0) and self.layout.code(k, 0) < b for k in range(self.n)
            ]
            rows = [
                self._mask(s, k) if ok else torch.zeros(b - a, dtype=torch.bool)
                for k, ok in enumerate(inside)
            ]
            self._masks[s, None] = torch.stack(rows)  # (a codebook outside the range: never asked)
        return self._masks[s, None]

    def _scores(self, logits, s: int, pos: list[int], rows: int) -> torch.Tensor:
        """Guided scores of batch positions ``pos`` (their unconditional twins ``rows`` later)."""
        cond = logits[s][pos]
        uncond = logits[s][[p + rows for p in pos]] if len(logits[s]) > rows else None
        return guided(cond, uncond, self.cfg.cfg_scale)

    def _generators(self, b: int, seeds: list[int] | None) -> list[torch.Generator]:
        seeds = [self.cfg.seed] * b if seeds is None else list(seeds)
        if len(seeds) != b:
            raise ValueError(f"{len(seeds)} seeds for {b} prompts")
        return [torch.Generator().manual_seed(int(x)) for x in seeds]

    def _leave(self, batch: list[int], done, guided_rows: bool) -> list[int]:
        """Drop the rows that are ``done`` from the batch (and their unconditional twins);
        returns the rows left, or ``batch`` unchanged when the backbone cannot drop cache rows
        (the finished rows are then fed padding, masked, until the others end)."""
        keep = [p for p, i in enumerate(batch) if not done(i)]
        if len(keep) == len(batch) or not keep:
            return batch
        twins = [p + len(batch) for p in keep] if guided_rows else []
        if not self.forward.keep(keep + twins):
            return batch
        return [batch[p] for p in keep]

    # ---- audio ---------------------------------------------------------------------------------
    def audio(
        self,
        prompts: list[np.ndarray],
        uncond: list[np.ndarray] | None = None,
        known: list[np.ndarray | None] | None = None,
        seeds: list[int] | None = None,
        on_frames: Callable[[int, np.ndarray], None] | None = None,
        join: Callable[[int], list[Joining]] | None = None,
        on_done: Callable[[int, np.ndarray, bool], None] | None = None,
    ) -> list[np.ndarray]:
        """Codes [F, N] generated after each prompt (which ends with ``<|audio|>``); ``uncond``
        prompts enable guidance; ``known`` codes start each segment (continuation); ``seeds``:
        one per prompt (default ``cfg.seed`` for all). ``on_frames(i, codes)`` is called each
        time row i's leading complete codec frames grow (streaming: a frame is complete once
        the pattern has emitted all its codebooks), with all of them so far.

        Continuous batching (a server's): ``join(live)`` is asked after every step while rows
        are decoding (``live`` of them) and the backbone's cache can take more rows; the rows it
        returns join the batch there (rows ``len(prompts)``, ``len(prompts) + 1``, ... in every
        callback and in the list returned) and decode as they would alone. ``on_done(i, codes,
        ended)`` is called once per row, at the step its segment completes, so that a row is
        answered without waiting for the batch.

        Afterwards ``self.ended[i]`` says whether row i's end was the model's choice (True) or
        the ``max_frames`` limit's (False): evaluation reports the share that ended by itself."""
        b = len(prompts)
        guided_rows = uncond is not None
        known = list(known or [None] * b)
        state = [self._row() for _ in range(b)]
        gens = self._generators(b, seeds)
        sent = [0] * b  # complete frames passed to on_frames
        reported: set[int] = set()  # rows passed to on_done
        logits = self.forward.start(list(prompts) + list(uncond or []))
        batch = list(range(b))  # the rows in the model's batch, in its order
        while True:
            frames = self._audio_step(state, batch, logits, known, gens)
            if on_frames is not None:
                for i in batch:
                    ready = state[i].complete()
                    if ready > sent[i]:
                        on_frames(i, state[i].codes[:ready])
                        sent[i] = ready
            self._stop_audio(state, batch)
            if on_done is not None:
                for i in batch:
                    st = state[i]
                    if st.done and i not in reported:
                        st.codes, st.map = st.codes[: st.length].copy(), st.map[:0]  # (kept small)
                        on_done(i, st.codes, st.ended)
                        reported.add(i)
            if all(state[i].done for i in batch):
                break
            left = self._leave(batch, lambda i: state[i].done, guided_rows)
            if left is not batch:  # rows left the batch: their frames are not fed
                frames, batch = frames[_positions(batch, left)], left
            logits = self.forward.advance(torch.cat([frames, frames]) if guided_rows else frames)
            if join is not None and self.forward.can_join:
                joining = join(sum(not state[i].done for i in batch))
                if joining:
                    logits = self._join(joining, batch, logits, guided_rows, state, known, gens)
                    sent += [0] * len(joining)
        self.ended = [st.ended for st in state]
        return [st.codes[: st.length] for st in state]

    def _row(self) -> AudioRow:
        cfg = self.cfg
        full = index_map(self.pattern, cfg.max_frames, self.n)
        return AudioRow(full, np.zeros((cfg.max_frames, self.n), dtype=np.int64))

    def _join(self, rows: list[Joining], batch, logits, guided_rows, state, known, gens) -> list:
        """Add ``rows`` to the batch in progress (``batch`` extended in place); returns the
        logits of the whole batch, in its order (a guided batch keeps its conditional rows
        first and their twins after them, in the same order)."""
        if guided_rows != all(r.uncond is not None for r in rows):
            raise ValueError("join: a guided batch's rows need their unconditional prompts, "
                             "an unguided batch's none")  # fmt: skip
        m, k = len(batch), len(rows)
        new = self.forward.join(
            [r.prompt for r in rows] + ([r.uncond for r in rows] if guided_rows else [])
        )
        if guided_rows:  # [old cond, old uncond, new cond, new uncond] -> cond first
            order = [*range(m), *range(2 * m, 2 * m + k), *range(m, 2 * m), *range(2 * m + k, 2 * m + 2 * k)]  # fmt: skip
            self.forward.keep(order)
            logits = [
                torch.cat([o[:m], x[:k], o[m:], x[k:]]) for o, x in zip(logits, new, strict=True)
            ]
        else:
            logits = [torch.cat([o, x]) for o, x in zip(logits, new, strict=True)]
        first = len(state)
        for r in rows:
            state.append(self._row())
            known.append(None)
            gens.append(
                torch.Generator().manual_seed(int(self.cfg.seed if r.seed is None else r.seed))
            )
        batch += range(first, first + k)
        return logits

    def _stop_audio(self, state: list[AudioRow], batch: list[int]) -> None:
        """End the rows ``stop`` asks to: cut to their complete frames, not ``ended``."""
        if self.stop is None:
            return
        for i in batch:
            st = state[i]
            if not st.done and self.stop(i):
                st.length = st.complete()
                st.done = True

    def _audio_step(self, state, batch, logits, known, gens) -> torch.Tensor:
        """The next frame of every row of ``batch`` ([rows, N]): per stream, the forced slots
        (pattern pads, known codes) are set and the rest picked in one masked call."""
        n, lay, cfg = self.n, self.layout, self.cfg
        frames = self.pads.repeat(len(batch), 1)
        stop = [state[i].done for i in batch]  # rows whose frame is complete already
        for s in range(n):
            pos, ks, may_end = [], [], []
            for p, i in enumerate(batch):
                st = state[i]
                slot = -1 if stop[p] else int(st.map[st.j, s])
                if slot < 0:
                    continue  # the pattern's pad
                f, k = divmod(slot, n)
                kn = known[i]
                if kn is not None and f < len(kn):
                    frames[p, s] = lay.code(k, int(kn[f, k]))
                    st.codes[f, k] = int(kn[f, k])
                    continue
                pos.append(p)
                ks.append(k)
                may_end.append(
                    st.length is None
                    and k == 0
                    and f >= cfg.min_frames + len(kn if kn is not None else ())
                )
            if not pos:
                continue
            allowed = self._codebook_masks(s)[torch.tensor(ks)]
            if any(may_end):  # where training put the end: stream 0's pad (a tail), else end tokens
                allowed |= torch.tensor(may_end)[:, None] & self._mask(s, -1)
            picked = pick(
                self._scores(logits, s, pos, len(batch)),
                allowed,
                cfg.audio,
                [gens[batch[p]] for p in pos],
            )
            a = self.ranges[s][0]
            for p, k, end, idx in zip(pos, ks, may_end, picked.tolist(), strict=True):
                st, token = state[batch[p]], a + idx
                f = int(st.map[st.j, s]) // n
                first = lay.code(k, 0)
                if end and not first <= token < first + lay.codebook_size:
                    st.length = f  # the model ended the audio before code (f, 0)
                    st.ended = True
                    st.map = index_map(self.pattern, f, n)
                    if token in self.ends or len(st.map) <= st.j:
                        frames[p] = self.pads
                        frames[p, 0] = token if token in self.ends else self.ends[0]
                        st.done = stop[p] = True
                        continue
                frames[p, s] = token
                if first <= token < first + lay.codebook_size:
                    st.codes[f, k] = token - first
        for i in batch:
            st = state[i]
            if st.done:
                continue
            st.j += 1
            if st.length is None and st.j >= len(st.map):
                st.length = cfg.max_frames  # the longest allowed: the segment is complete
            if st.length is not None and st.j >= len(st.map):
                st.done = True  # the turn's end token would come next
        return frames

    # ---- text ----------------------------------------------------------------------------------
    def text(
        self,
        prompts: list[np.ndarray],
        audio: list[list] | None = None,
        seeds: list[int] | None = None,
    ) -> list[list[int]]:
        """Text token ids (the tokenizer's) generated after each prompt (ending ``<|text|>``);
        ``audio``: the prompts' continuous segments (``IncrementalForward.start``); ``seeds``:
        one per prompt (default ``cfg.seed``)."""
        lay, b = self.layout, len(prompts)
        ids = list(range(lay.text_offset, lay.text_offset + lay.text_size)) + list(self.ends)
        mask = self.allowed(0, ids)
        gens = self._generators(b, seeds)
        out: list[list[int]] = [[] for _ in range(b)]
        done = [False] * b
        logits = self.forward.start(list(prompts), audio)
        batch = list(range(b))
        for _ in range(self.cfg.max_text_tokens):
            live = [p for p, i in enumerate(batch) if not done[i]]
            picked = pick(
                self._scores(logits, 0, live, len(batch)),
                mask,
                self.cfg.text,
                [gens[batch[p]] for p in live],
            )
            frames = self.pads.repeat(len(batch), 1)
            for p, idx in zip(live, picked.tolist(), strict=True):
                token = self.ranges[0][0] + idx
                if token in self.ends:
                    done[batch[p]] = True
                else:
                    out[batch[p]].append(token - lay.text_offset)
                frames[p, 0] = token
            if self.stop is not None:
                for i in batch:
                    done[i] = done[i] or self.stop(i)
            if all(done):
                break
            left = self._leave(batch, lambda i: done[i], False)
            if left is not batch:  # rows left the batch: their frames are not fed
                frames, batch = frames[_positions(batch, left)], left
            logits = self.forward.advance(frames)
        return out


def _positions(batch: list[int], left: list[int]) -> list[int]:
    """Where the rows ``left`` sit in ``batch``."""
    kept = set(left)
    return [p for p, i in enumerate(batch) if i in kept]
