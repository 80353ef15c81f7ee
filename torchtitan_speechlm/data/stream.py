"""The global, exactly resumable stream of micro-batches (packed or bucketed).

One *global* stream of items, identical on every rank: each (task, dataset) mixture entry walks
its own seeded permutation, epoch by epoch, and a seeded generator picks the entry of each draw
by weight. Items are taken ``window`` at a time; a window is turned into *units* (one rank's
micro-batch each) from item lengths alone:

- ``pack``: first-fit-decreasing into rows of ``seq_len`` frames, ``B`` rows per unit; several
  samples share a row, each with its own position ids (transformers turns restarting positions
  into a block-diagonal causal mask, so attention never crosses samples);
- ``bucket``: one sample per row, length-sorted, as many rows as fit the token budget, padded to
  the unit's longest sample.

Items of under-filled rows/units at the end of a window are carried into the next window. Unit
order within a window is shuffled. Global micro-batch ``g`` is units ``[g*W, (g+1)*W)`` and rank
``r`` collates unit ``g*W + r``; loader worker ``w`` of ``n`` serves the ``g`` with ``g % n == w``.

State = (the snapshot taken at the start of the current window, units already consumed from it).
A resume regenerates that window deterministically and skips what was consumed, so it yields the
same micro-batches as an uninterrupted run, whatever ``training.steps`` is, and the state is the
same on every rank: a different data-parallel degree continues the same stream.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger

from ..model.vocab import VocabMismatchError
from .examples import TASKS, TemplateBuilder

BASE_STATS = ("examples", "rows", "frames", "pad_frames", "loss_frames", "audio_frames",
              "skipped_too_long", "skipped_bad", "cfg_dropped")
TASK_ELIGIBLE_KINDS = {
    "tts": ("speech",), "asr": ("speech",), "continuation": ("speech", "audio"),
    "text": ("speech", "text"), "dialogue": ("dialogue",),
}


def data_stats_keys(num_streams: int) -> tuple[str, ...]:
    """Names of the ``data_stats`` vector every micro-batch carries (see DATA statistics docs)."""
    return (BASE_STATS + tuple(f"task_{t}" for t in TASKS)
            + tuple(f"tokens_stream{k}" for k in range(num_streams)))


@dataclass
class Source:
    task: str
    name: str
    weight: float
    data: object  # PreparedDataset
    indices: np.ndarray


@dataclass
class Draw:
    src: int
    item: int
    cfg_drop: bool
    length: int  # frames of the example (the sample uses length - 1 input positions)
    age: int = 0  # windows this draw has been carried over (bounded: see _carry_underfilled)


@dataclass
class Unit:
    """One rank's micro-batch: rows of draws, padded to ``t`` frames."""

    rows: list[list[Draw]]
    t: int = 0


def eligible(source: Source) -> np.ndarray:
    kinds = getattr(source.data, "kinds", None)
    if kinds is None:
        return source.indices
    ok = TASK_ELIGIBLE_KINDS[source.task]
    return np.array([i for i in source.indices if kinds[i] in ok], dtype=np.int64)


class SpeechLMDataset(IterableDataset):
    """This rank's share of the global stream; a torchdata-Stateful IterableDataset."""

    def __init__(self, sources: list[Source], builder: TemplateBuilder, *, seq_len: int,
                 rows_per_unit: int, max_tokens: int, mode: str, window: int, dp_rank: int,
                 dp_world_size: int, seed: int, shuffle: bool, infinite: bool,
                 cfg_dropout: float = 0.0):
        if mode not in ("pack", "bucket"):
            raise ValueError(f"batching must be 'pack' or 'bucket', got {mode!r}")
        self.sources, self.builder = sources, builder
        self.layout = builder.layout
        self.seq_len, self.rows_per_unit, self.mode, self.window = seq_len, rows_per_unit, mode, window
        self.max_tokens = max_tokens or rows_per_unit * seq_len
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seed, self.shuffle, self.infinite = seed, shuffle, infinite
        # CFG dropout is a training augmentation: a finite (validation) pass never applies it.
        self.cfg_dropout = cfg_dropout if infinite else 0.0
        self.stats_keys = data_stats_keys(self.layout.num_streams)
        for s in sources:
            s.indices = eligible(s)
            if len(s.indices) == 0:
                raise ValueError(
                    f"{s.task}:{s.name} has no items usable for task {s.task!r} (after the "
                    f"validation hold-out; needs items of kind {TASK_ELIGIBLE_KINDS[s.task]})"
                )
        self._weights = np.array([s.weight for s in sources], dtype=np.float64)
        self._weights /= self._weights.sum()
        n = self.layout.num_streams
        self._pad_frame = np.array([self.layout.pad] + [self.layout.stream_pad(k)
                                                        for k in range(1, n)], dtype=np.int64)
        self._warned_bad: set[tuple[int, int]] = set()
        self.reset()

    # ---- state -----------------------------------------------------------------------------
    def reset(self) -> None:
        self._src_state = {
            "epoch": [0] * len(self.sources),
            "pos": [0] * len(self.sources),
            "rng": np.random.default_rng([self.seed, 7919]).bit_generator.state,
            "carried": [],
            "window": 0,
        }
        self._resume = {"window_start": copy.deepcopy(self._src_state), "consumed": 0,
                        "batches": 0}
        self._state = copy.deepcopy(self._resume)
        self._perm_cache: dict[int, tuple[int, np.ndarray]] = {}

    def state_dict(self) -> dict:
        return {**copy.deepcopy(self._state),
                "sources": [f"{s.task}:{s.name}" for s in self.sources],
                "vocab": self.layout.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        names = [f"{s.task}:{s.name}" for s in self.sources]
        if state.get("sources") != names:
            raise ValueError(
                f"checkpointed data mixture {state.get('sources')} differs from the configured "
                f"{names}; resume with the same speechlm_data.train, or start a new dump_folder"
            )
        if state.get("vocab") != self.layout.fingerprint():
            raise VocabMismatchError(
                f"the checkpoint was trained with vocabulary layout {state.get('vocab')} but this "
                f"run builds {self.layout.fingerprint()} (different backbone, tokenizer or codec); "
                "resume with the original assets or start a new dump_folder"
            )
        self._resume = {k: copy.deepcopy(state[k]) for k in ("window_start", "consumed", "batches")}
        self._state = copy.deepcopy(self._resume)

    # ---- drawing items ---------------------------------------------------------------------
    def _perm(self, src: int, epoch: int) -> np.ndarray:
        cached = self._perm_cache.get(src)
        if cached is None or cached[0] != epoch:
            idx = self.sources[src].indices
            if self.shuffle:
                idx = idx[np.random.default_rng([self.seed, src, epoch, 104729]).permutation(len(idx))]
            cached = self._perm_cache[src] = (epoch, idx)
        return cached[1]

    def _length(self, src: int, item: int, cfg_drop: bool) -> int:
        s = self.sources[src]
        if s.task == "dialogue":
            turns = getattr(s.data, "num_turns", None)
            if turns is None:  # a reader without turn counts: build the example to measure it
                return len(self.builder.build("dialogue", s.data[item]).frames)
            return self.builder.length("dialogue", int(s.data.text_lengths[item]),
                                       int(s.data.audio_lengths[item]),
                                       n_audio_turns=int(s.data.num_audio_turns[item]),
                                       n_turns=int(turns[item]))
        n_text = 1 if cfg_drop else int(s.data.text_lengths[item])
        return self.builder.length(s.task, n_text, int(s.data.audio_lengths[item]))

    def _draw(self, st: dict, rng: np.random.Generator) -> Draw | None:
        if self.infinite:
            src = int(rng.choice(len(self.sources), p=self._weights))
        else:  # validation: each source once, in order
            src = next((i for i in range(len(self.sources)) if st["epoch"][i] == 0), None)
            if src is None:
                return None
        perm = self._perm(src, st["epoch"][src])
        item = int(perm[st["pos"][src]])
        st["pos"][src] += 1
        if st["pos"][src] >= len(perm):
            st["pos"][src], st["epoch"][src] = 0, st["epoch"][src] + 1
        drop = bool(self.sources[src].task == "tts" and self.cfg_dropout > 0
                    and rng.random() < self.cfg_dropout)
        return Draw(src, item, drop, self._length(src, item, drop))

    # ---- windows -> units ------------------------------------------------------------------
    def _window(self, st: dict, group_rows: int) -> tuple[list, int, bool]:
        """Turn the window starting at state ``st`` into pieces (pack: rows, bucket: units);
        advances ``st`` in place. Returns (pieces, samples skipped as too long, stream done).

        ``group_rows`` (rows per *global* micro-batch) is part of the window's saved state, so
        a resumed window is rebuilt exactly even if the data-parallel degree changed."""
        rng = np.random.default_rng(0)
        rng.bit_generator.state = st["rng"]
        draws = [Draw(*d) for d in st["carried"]]
        exhausted = False
        while len(draws) < self.window:
            d = self._draw(st, rng)
            if d is None:
                exhausted = True
                break
            draws.append(d)
        too_long = [d for d in draws if d.length - 1 > self.seq_len]
        draws = [d for d in draws if d.length - 1 <= self.seq_len]
        final = exhausted or not self.infinite
        carried: list[Draw] = []
        if self.mode == "pack":
            pieces = self._pack(draws, st["window"])
            if not final:
                pieces, carried = self._carry_underfilled(pieces, group_rows)
        else:
            pieces = self._bucket(draws)
            last = pieces[-1] if pieces else None
            if not final and last and len(last.rows) * last.t < 0.75 * self.max_tokens:
                carried = [Draw(d.src, d.item, d.cfg_drop, d.length, d.age + 1)
                           for row in pieces.pop().rows for d in row]
        if self.shuffle:
            order = np.random.default_rng([self.seed, st["window"], 31337]).permutation(len(pieces))
            pieces = [pieces[i] for i in order]
        for d in too_long[:1]:
            logger.warning(f"skipping {self.sources[d.src].name} item {d.item}: {d.length} frames "
                           f"> seq_len {self.seq_len} (counted in data/skipped_too_long)")
        st["rng"] = rng.bit_generator.state
        st["carried"] = [(d.src, d.item, d.cfg_drop, d.length, d.age) for d in carried]
        st["window"] += 1
        return pieces, len(too_long), exhausted and not carried

    def _carry_underfilled(self, rows: list[list[Draw]], group_rows: int) -> tuple[list, list[Draw]]:
        """Keep whole units of well-filled rows; carry the rest's samples to the next window
        (at most half a window, so nothing can be carried for ever)."""
        def ok(row: list[Draw]) -> bool:  # well filled, or holding a sample carried twice
            return (sum(d.length - 1 for d in row) >= 0.97 * self.seq_len
                    or any(d.age >= 2 for d in row))

        good, poor = [r for r in rows if ok(r)], [r for r in rows if not ok(r)]
        keep = len(good) - len(good) % group_rows
        carried = [d for row in good[keep:] + poor for d in row]
        if len(carried) > self.window // 2:
            return rows, []  # cannot pack better: emit everything (last unit may be short)
        return good[:keep], [Draw(d.src, d.item, d.cfg_drop, d.length, d.age + 1)
                             for d in carried]

    def _pack(self, draws: list[Draw], window: int) -> list[list[Draw]]:
        """Rows filled by exact subset-sum: each row takes the longest remaining sample, then
        the subset of the others that fills the rest best (bitset DP, O(items) big-int ops).
        The candidates are offered in a seeded random order, so rows mix tasks and lengths
        instead of grouping similar samples. Padding ends up in the last rows of a window,
        which are carried into the next one."""
        order = np.random.default_rng([self.seed, window, 65537]).permutation(len(draws))
        pool = [draws[i] for i in order]
        rows: list[list[Draw]] = []
        while pool:
            first = max(range(len(pool)), key=lambda i: (pool[i].length, -i))
            head = pool.pop(first)
            chosen = _best_subset([d.length - 1 for d in pool], self.seq_len - head.length + 1)
            rows.append([head] + [pool[i] for i in chosen])
            for i in reversed(chosen):
                pool.pop(i)
        return rows

    def _bucket(self, draws: list[Draw]) -> list[Unit]:
        units: list[Unit] = []
        rows: list[list[Draw]] = []
        for d in sorted(draws, key=lambda d: d.length):
            t = _round_up(d.length - 1, 8)
            if rows and (len(rows) + 1) * min(t, self.seq_len) > self.max_tokens:
                units.append(Unit(rows, t=_round_up(rows[-1][0].length - 1, 8)))
                rows = []
            rows.append([d])
        if rows:
            units.append(Unit(rows, t=_round_up(rows[-1][0].length - 1, 8)))
        for u in units:
            u.t = min(u.t, self.seq_len)
        return units

    # ---- iteration -------------------------------------------------------------------------
    def __iter__(self):
        worker = get_worker_info()
        n_workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        b, world = self.rows_per_unit, self.dp_world_size
        per_global = b * world if self.mode == "pack" else world
        st = copy.deepcopy(self._resume["window_start"])
        skip, batches = self._resume["consumed"], self._resume["batches"]
        pending: list = []
        pending_skips = 0
        while True:
            start = copy.deepcopy(st)
            start.setdefault("group_rows", b * world)  # a resumed window keeps its own
            pieces, too_long, done = self._window(st, start["group_rows"])
            st.pop("group_rows", None)
            for i, piece in enumerate(pieces):
                if i == 0 and not skip:  # a resumed window's skips were counted already
                    pending_skips += too_long
                if skip:
                    skip -= 1
                    continue
                pending.append(piece)
                if len(pending) == per_global:
                    g, batches = batches, batches + 1
                    self._state = {"window_start": start, "consumed": i + 1, "batches": batches}
                    if g % n_workers == worker_id:
                        yield self.collate(self._mine(pending), pending_skips * (self.dp_rank == 0))
                    pending, pending_skips = [], 0
            if done:
                break
        if pending and not self.infinite:
            # last, partial global batch of a finite set: ranks beyond it get no batch
            mine = self._mine(pending)
            if mine.rows and batches % n_workers == worker_id:
                yield self.collate(mine, pending_skips * (self.dp_rank == 0))

    def _mine(self, pieces: list) -> Unit:
        """This rank's share of a global micro-batch: B rows (pack) or one unit (bucket)."""
        r = self.dp_rank
        if self.mode == "pack":
            b = self.rows_per_unit
            return Unit(pieces[r * b : (r + 1) * b], t=self.seq_len)
        return pieces[r] if r < len(pieces) else Unit([], t=0)

    # ---- collation -------------------------------------------------------------------------
    def _example(self, d: Draw):
        s = self.sources[d.src]
        try:
            return self.builder.build(s.task, s.data[d.item], d.cfg_drop)
        except Exception as e:  # a corrupt item must not kill a multi-day run
            if (d.src, d.item) not in self._warned_bad:
                self._warned_bad.add((d.src, d.item))
                logger.warning(f"skipping bad sample {s.name}[{d.item}] for {s.task}: {e} "
                               "(counted in data/skipped_bad)")
            return None

    def collate(self, unit: Unit, skipped_too_long: int = 0) -> tuple[dict, torch.Tensor]:
        b, t, n = len(unit.rows), unit.t, self.layout.num_streams
        inp = np.broadcast_to(self._pad_frame, (b, t, n)).copy()
        tgt = inp.copy()
        w = np.zeros((b, t, n), dtype=np.float32)
        pos = np.zeros((b, t), dtype=np.int64)
        stats = dict.fromkeys(self.stats_keys, 0.0)
        stats["rows"], stats["skipped_too_long"] = b, skipped_too_long
        for r, row in enumerate(unit.rows):
            at = 0
            for d in row:
                ex = self._example(d)
                if ex is None:
                    stats["skipped_bad"] += 1
                    continue
                length = len(ex.frames) - 1
                inp[r, at : at + length] = ex.frames[:-1]
                tgt[r, at : at + length] = ex.frames[1:]
                w[r, at : at + length] = ex.weights[1:]
                pos[r, at : at + length] = np.arange(length)
                at += length
                stats["examples"] += 1
                stats["cfg_dropped"] += d.cfg_drop
                stats[f"task_{self.sources[d.src].task}"] += 1
            stats["frames"] += at
            pos[r, at:] = np.arange(t - at)  # padding is its own "document"
        loss_frames = (w > 0).any(-1)
        stats["pad_frames"] = b * t - stats["frames"]
        stats["loss_frames"] = float(loss_frames.sum())
        for k in range(n):
            pads = (self._pad_frame[k], self.layout.stream_pad(k))
            stats[f"tokens_stream{k}"] = float((~np.isin(inp[..., k], pads)).sum())
        last = inp[..., n - 1]  # every audio frame has exactly one code in the last stream
        stats["audio_frames"] = float(((last >= self.layout.code(n - 1, 0))
                                       & (last < self.layout.size)).sum())
        batch = {
            "input": torch.from_numpy(inp),
            "targets": torch.from_numpy(tgt),
            "loss_weights": torch.from_numpy(w),
            "position_ids": torch.from_numpy(pos),
            "data_stats": torch.tensor([[stats[k] for k in self.stats_keys]], dtype=torch.float32),
        }
        return batch, torch.from_numpy(np.where(loss_frames, 0, IGNORE_INDEX))


def _best_subset(sizes: list[int], cap: int) -> list[int]:
    """Indices (ascending) of a subset of ``sizes`` with the largest sum <= cap."""
    if cap <= 0 or not sizes:
        return []
    mask = (1 << (cap + 1)) - 1
    reach = [1]
    for w in sizes:
        reach.append((reach[-1] | (reach[-1] << w)) & mask)
    best = reach[-1].bit_length() - 1
    chosen = []
    for i in range(len(sizes), 0, -1):
        if not (reach[i - 1] >> best) & 1:
            chosen.append(i - 1)
            best -= sizes[i - 1]
    return sorted(chosen)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def batch_hash(batch: dict) -> str:
    """Content hash of a micro-batch (inputs, targets, weights, positions)."""
    h = hashlib.blake2b(digest_size=12)
    for key in ("input", "targets", "loss_weights", "position_ids"):
        h.update(batch[key].numpy().tobytes())
    return h.hexdigest()
