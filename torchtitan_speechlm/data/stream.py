"""The global, exactly resumable stream of training steps (packed or bucketed), in shards.

**The unit of the stream is the optimizer step**: ``S = step_pieces`` pieces (pack: rows of
``seq_len`` frames, the global batch ``training.global_batch_size``; bucket: ``dp x
accumulation`` micro-batches under the ``max_tokens`` budget). Piece ``j`` of every step comes
from *shard* ``j``, an independent sub-stream over its own share of the data: each (task,
dataset) mixture entry walks a seeded permutation per epoch of which shard ``j`` takes every
``S``-th item (a source smaller than ``S`` is shared whole), and a seeded generator of the shard
picks the entry of each draw by weight. A shard takes items ``window`` at a time and turns a
window into pieces from item lengths alone:

- ``pack``: a piece is a row of ``seq_len`` frames holding several samples, each with its own
  position ids (attention stays within a sample: model/documents.py);
- ``bucket``: a piece is a micro-batch: one sample per row, length-sorted, as many rows as fit
  the ``max_tokens`` budget, padded to the longest.

Samples of under-filled pieces at the end of a window are carried into the shard's next window;
piece order within a window is shuffled.

Rank ``r``'s micro-batch ``m`` (of ``accumulation``) is slice ``i = m * dp + r`` of the step:
pieces (shards) ``i*B .. i*B+B-1`` (pack, ``B`` rows) or ``i`` (bucket). So a rank only ever
builds its own shards: its data work per step is the same at dp = 8 and dp = 512. And 1 process
x 4 micro-batches, 2 x 2 and 4 x 1 train on the same samples in every step, since which samples
form a step depends only on ``S``. Loader worker ``w`` of ``n`` serves this rank's micro-batches
``w, w + n, ...``.

Position = optimizer steps done, micro-batches done in an unfinished step, and each shard's
cursor (its window's start state and the pieces taken from it). A rank knows its own shards'
cursors; the loader gathers all of them when a checkpoint is written (loader.py), so a resume
on another data-parallel degree or accumulation (same global batch) picks up its shards where
the stream left them.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import get_args

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger

from torchtitan_speechlm.config import Batching
from torchtitan_speechlm.data.tasks import TASKS, TemplateBuilder, get_task
from torchtitan_speechlm.model.vocab import VocabMismatchError

CONTINUOUS_KEYS = ("audio_wave", "audio_lengths", "audio_index")
BASE_STATS = (
    "examples",
    "rows",
    "frames",
    "pad_frames",
    "loss_frames",
    "audio_frames",
    "skipped_too_long",
    "skipped_bad",
    "cfg_dropped",
)


def data_stats_keys(num_streams: int) -> tuple[str, ...]:
    """Names of the ``data_stats`` vector every micro-batch carries (see DATA statistics docs)."""
    return (
        BASE_STATS
        + tuple(f"task_{t}" for t in TASKS.names())
        + tuple(f"tokens_stream{k}" for k in range(num_streams))
    )


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


@dataclass
class Plan:
    """A micro-batch before it is built: its unit, the samples skipped as too long since the
    previous one, and the stream position after it."""

    unit: Unit
    skipped: int
    position: dict


def eligible(source: Source) -> np.ndarray:
    kinds = getattr(source.data, "kinds", None)
    if kinds is None:
        return source.indices
    ok = get_task(source.task).kinds
    return np.array([i for i in source.indices if kinds[i] in ok], dtype=np.int64)


class StreamResumeError(ValueError):
    """A checkpoint's data position cannot be continued by this run; the message says why."""


class DataLengthError(ValueError):
    """No (or too few) samples fit the configured sequence length."""


class SpeechLMDataset(IterableDataset):
    """This rank's share of the global stream; a torchdata-Stateful IterableDataset.

    An optimizer step is ``step_pieces`` pieces (pack: the global batch in rows of ``seq_len``
    frames; bucket: ``dp x accumulation`` micro-batches under the ``max_tokens`` budget), piece
    ``j`` from shard ``j``. Which samples form a step depends only on the data, the seed, the
    piece parameters and ``step_pieces``; rank ``r``'s micro-batch ``m`` is the slice
    ``m * dp + r`` of it, built from that slice's shards only, so the layout (processes x
    accumulation) decides who computes which slice, never which samples form a step.
    """

    def __init__(
        self,
        sources: list[Source],
        builder: TemplateBuilder,
        *,
        seq_len: int,
        local_batch_size: int,
        mode: str,
        window: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int,
        shuffle: bool,
        infinite: bool,
        accumulation: int = 1,
        max_tokens: int = 0,
        cfg_dropout: float = 0.0,
        max_too_long_fraction: float = 1.0,
        seq_len_key: str = "training.seq_len",
    ):
        if mode not in get_args(Batching):
            raise ValueError(f"batching must be one of {get_args(Batching)}, got {mode!r}")
        self.sources, self.builder = sources, builder
        self.layout = builder.layout
        self.seq_len, self.mode, self.window = seq_len, mode, window
        self.local_batch_size = local_batch_size
        self.max_tokens = max_tokens or local_batch_size * seq_len
        self.dp_rank, self.dp_world_size, self.accumulation = dp_rank, dp_world_size, accumulation
        # pieces per optimizer step: the global batch's rows (pack) or micro-batches (bucket)
        per_micro = local_batch_size if mode == "pack" else 1
        self.step_pieces = per_micro * dp_world_size * accumulation
        self.seed, self.shuffle, self.infinite = seed, shuffle, infinite
        # CFG dropout is a training augmentation: a finite (validation) pass never applies it.
        self.cfg_dropout = cfg_dropout if infinite else 0.0
        self.stats_keys = data_stats_keys(self.layout.num_streams)
        for s in sources:
            s.indices = eligible(s)
            if len(s.indices) == 0:
                raise ValueError(
                    f"{s.task}:{s.name} has no items usable for task {s.task!r} (after the "
                    f"validation hold-out; needs items of kind {get_task(s.task).kinds})"
                )
        self._length_tables: dict[tuple[int, bool], np.ndarray | None] = {}
        self.check_lengths(max_too_long_fraction, seq_len_key)
        self._cfg = [get_task(s.task).cfg_turn is not None for s in sources]  # CFG-droppable
        self._weights = np.array([s.weight for s in sources], dtype=np.float64)
        self._weights /= self._weights.sum()
        # Generator.choice(n, p=w) is searchsorted(cumsum(w) / its last, random()): the same
        # draw from the same random double, without choice's per-call validation (~15 us)
        self._cdf = self._weights.cumsum()
        self._cdf /= self._cdf[-1]
        self._pad_frame = np.array(self.layout.pad_frame(), dtype=np.int64)
        # batches carry audio_wave / audio_lengths / audio_index (model/audio/tower.py)
        self.continuous = any(get_task(s.task).continuous for s in sources)
        self._warned_bad: set[tuple[int, int]] = set()
        self._warned_long: set[int] = set()
        self.reset()

    # ---- lengths ---------------------------------------------------------------------------
    def lengths(self, src: int) -> np.ndarray:
        """Frames of every eligible item's example (no CFG drop), from the index alone."""
        s = self.sources[src]
        table = self._length_table(src, False)
        if table is not None:
            return table[s.indices]
        return np.array([self._length(src, int(i), False) for i in s.indices], dtype=np.int64)

    def check_lengths(self, max_fraction: float, key: str) -> None:
        """Stop before the first step if no sample (or too large a share) fits ``seq_len``:
        otherwise a stream with nothing to emit spins for ever."""
        for i, s in enumerate(self.sources):
            need = self.lengths(i) - 1  # input positions a sample occupies
            too_long = need > self.seq_len
            if not too_long.any():
                continue
            name = f"{s.task}:{s.name}"
            shortest, longest = int(need.min()), int(need.max())
            if too_long.all():
                raise DataLengthError(
                    f"no sample of {name} fits {key} = {self.seq_len} frames: the shortest of "
                    f"its {len(need)} samples needs {shortest} frames (the longest {longest}); "
                    f"set {key} >= {shortest}, or >= {longest} to keep them all"
                )
            frac = float(too_long.mean())
            if frac > max_fraction:
                keep99 = int(np.quantile(need, 0.99, method="higher"))
                raise DataLengthError(
                    f"{100 * frac:.1f}% of the samples of {name} ({int(too_long.sum())} of "
                    f"{len(need)}) are longer than {key} = {self.seq_len} frames and would be "
                    f"skipped (limit speechlm_data.max_too_long_fraction = {max_fraction}); set "
                    f"{key} >= {keep99} to keep 99% of them (>= {longest} for all), or raise "
                    "speechlm_data.max_too_long_fraction"
                )

    # ---- state -----------------------------------------------------------------------------
    def reset(self) -> None:
        self._start = {
            "steps": 0,
            "micro_done": 0,
            "accumulation": self.accumulation,
            "step_pieces": self.step_pieces,
            "shards": {j: self._shard_start(j) for j in self.own_shards()},
        }
        self._position = self._start
        self._perm_cache: dict[tuple[int, int], tuple[int, np.ndarray]] = {}

    def _shard_start(self, shard: int) -> dict:
        window = {
            "epoch": [0] * len(self.sources),
            "pos": [0] * len(self.sources),
            "rng": np.random.default_rng([self.seed, 7919, shard]).bit_generator.state,
            "carried": [],
            "window": 0,
        }
        return {"window": window, "consumed": 0}

    def slice_shards(self, m: int, r: int | None = None) -> list[int]:
        """The shards (pieces of a step) of rank ``r``'s micro-batch ``m``."""
        i = m * self.dp_world_size + (self.dp_rank if r is None else r)
        per_micro = self.local_batch_size if self.mode == "pack" else 1
        return list(range(i * per_micro, (i + 1) * per_micro))

    def own_shards(self) -> list[int]:
        return [j for m in range(self.accumulation) for j in self.slice_shards(m)]

    @property
    def piece_params(self) -> dict:
        """What a piece is made of: a resume with other values cannot continue the stream."""
        return {"mode": self.mode, "seq_len": self.seq_len}

    def state_dict(self) -> dict:
        """The position after the last yielded micro-batch (this rank's shards; the loader
        merges all ranks' when it saves), plus what the stream is made of, to refuse an
        incompatible resume."""
        return {
            "position": copy.deepcopy(self._position),
            "pieces": self.piece_params,
            "sources": [f"{s.task}:{s.name}" for s in self.sources],
            "vocab": self.layout.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        names = [f"{s.task}:{s.name}" for s in self.sources]
        if "shards" not in state.get("position", {}):
            raise StreamResumeError(
                "the checkpoint's data position was written by an older torchtitan_speechlm "
                "stream format; add 'dataloader' to checkpoint.exclude_from_loading to restart "
                "the data stream, or start a new dump_folder"
            )
        if state.get("sources") != names:
            raise StreamResumeError(
                f"checkpointed data mixture {state.get('sources')} differs from the configured "
                f"{names}; resume with the same speechlm_data.train, or start a new dump_folder"
            )
        if state.get("vocab") != self.layout.fingerprint():
            raise VocabMismatchError(
                f"the checkpoint was trained with vocabulary layout {state.get('vocab')} but this "
                f"run builds {self.layout.fingerprint()} (different backbone, tokenizer or codec); "
                "resume with the original assets or start a new dump_folder"
            )
        saved = state.get("pieces", {})
        for key, now in self.piece_params.items():
            if saved.get(key) != now:
                what = "speechlm_data.batching" if key == "mode" else f"training.{key}"
                raise StreamResumeError(
                    f"the checkpoint's data stream was cut with {what} = {saved.get(key)!r}, "
                    f"this run uses {now!r}: the saved position cannot be continued. Keep "
                    f"{what} = {saved.get(key)!r}, or add 'dataloader' to "
                    "checkpoint.exclude_from_loading to restart the data stream"
                )
        pos = copy.deepcopy(state["position"])
        if pos["step_pieces"] != self.step_pieces:
            unit = "rows" if self.mode == "pack" else "micro-batches"
            raise StreamResumeError(
                f"the checkpoint's data stream has {pos['step_pieces']} {unit} per optimizer "
                f"step and this run {self.step_pieces} (training.global_batch_size, or local "
                "batch x data-parallel degree x accumulation): the stream is sharded by it and "
                "cannot continue with another. Keep the global batch, or add 'dataloader' to "
                "checkpoint.exclude_from_loading to restart the data stream"
            )
        if pos["micro_done"] and pos["accumulation"] != self.accumulation:
            raise StreamResumeError(
                "the checkpoint was taken in the middle of an optimizer step and this run has "
                "another data-parallel layout; resume with the original layout"
            )
        missing = [j for j in self.own_shards() if j not in pos["shards"]]
        if missing:
            raise StreamResumeError(
                f"the saved data position lacks shards {missing[:8]} of this rank (a state "
                "saved by one rank of a multi-rank run without merging; see "
                "SpeechLMDataLoader.state_dict)"
            )
        pos["shards"] = {j: pos["shards"][j] for j in self.own_shards()}
        pos["accumulation"] = self.accumulation
        self._start = self._position = pos

    # ---- drawing items ---------------------------------------------------------------------
    def _perm(self, src: int, epoch: int, shard: int) -> np.ndarray:
        """Shard ``shard``'s items of source ``src`` in epoch ``epoch``: every S-th item of the
        epoch's permutation (training), or of the source in order (a finite pass). A training
        source with fewer items than shards is shared whole, in the shard's own order."""
        key = (src, shard)
        cached = self._perm_cache.get(key)
        if cached is None or cached[0] != epoch:
            idx, n = self.sources[src].indices, self.step_pieces
            if self.shuffle:
                if len(idx) >= n:
                    perm = np.random.default_rng([self.seed, src, epoch, 104729])
                    idx = idx[perm.permutation(len(idx))][shard::n]
                else:
                    perm = np.random.default_rng([self.seed, src, epoch, shard, 104729])
                    idx = idx[perm.permutation(len(idx))]
            elif self.infinite and len(idx) < n:
                pass  # an unshuffled training source smaller than S: every shard walks it all
            else:
                idx = idx[shard::n]
            cached = self._perm_cache[key] = (epoch, idx)
        return cached[1]

    def _length(self, src: int, item: int, cfg_drop: bool) -> int:
        table = self._length_table(src, cfg_drop)
        if table is not None:
            return int(table[item])
        # a dialogue reader without turn counts: build the example to measure it
        s = self.sources[src]
        return len(self.builder.build(s.task, s.data[item]).frames)

    def _length_table(self, src: int, cfg_drop: bool) -> np.ndarray | None:
        """Example lengths of every item of a source, computed once from the index (a draw
        looks its length up); None for a dialogue reader without turn counts."""
        key = (src, cfg_drop)
        if key not in self._length_tables:
            s, table = self.sources[src], None
            data, own_turns = s.data, get_task(s.task).turns is None
            continuous = get_task(s.task).continuous  # audio: the (one) turn's wave samples

            def lengths():
                audio = getattr(data, "wave_samples", None) if continuous else data.audio_lengths
                return np.asarray(data.text_lengths), np.asarray(audio)

            if not own_turns:
                table = self.builder.length(s.task, *lengths(), cfg_drop=cfg_drop)
            elif getattr(data, "num_turns", None) is not None:
                table = self.builder.length(
                    s.task,
                    *lengths(),
                    n_audio_turns=np.asarray(data.num_audio_turns),
                    n_turns=np.asarray(data.num_turns),
                )
            # int32: 4 bytes per item of the source (40 MB for 10M items) for every rank
            self._length_tables[key] = None if table is None else np.asarray(table, np.int32)
        return self._length_tables[key]

    def _draw(self, st: dict, rng: np.random.Generator, shard: int) -> Draw | None:
        if self.infinite:
            src = int(self._cdf.searchsorted(rng.random(), side="right"))
        else:  # a finite pass: each source's share once, in order
            src = next(
                (
                    i
                    for i in range(len(self.sources))
                    if st["epoch"][i] == 0 and len(self._perm(i, 0, shard))
                ),
                None,
            )
            if src is None:
                return None
        perm = self._perm(src, st["epoch"][src], shard)
        item = int(perm[st["pos"][src]])
        st["pos"][src] += 1
        if st["pos"][src] >= len(perm):
            st["pos"][src], st["epoch"][src] = 0, st["epoch"][src] + 1
        drop = bool(self._cfg[src] and self.cfg_dropout > 0 and rng.random() < self.cfg_dropout)
        return Draw(src, item, drop, self._length(src, item, drop))

    # ---- windows -> pieces -----------------------------------------------------------------
    def _window(self, st: dict, shard: int) -> tuple[list, list[Draw], bool]:
        """Turn shard ``shard``'s window starting at state ``st`` into pieces (pack: rows, bucket: units);
        advances ``st`` in place. Returns (pieces, samples skipped as too long, stream done).

        Nothing here depends on the data-parallel layout. The window's size and token budget
        are part of its saved state (``st["build"]``), so a resumed window is rebuilt exactly
        even if those settings changed; later windows use the new ones."""
        build = st.setdefault("build", {"window": self.window, "max_tokens": self.max_tokens})
        rng = np.random.default_rng(0)
        rng.bit_generator.state = st["rng"]
        draws = [Draw(*d) for d in st["carried"]]
        exhausted = False
        while len(draws) < build["window"]:
            d = self._draw(st, rng, shard)
            if d is None:
                exhausted = True
                break
            draws.append(d)
        too_long = [d for d in draws if d.length - 1 > self.seq_len]
        draws = [d for d in draws if d.length - 1 <= self.seq_len]
        final = exhausted or not self.infinite
        carried: list[Draw] = []
        if self.mode == "pack":
            pieces = self._pack(draws, st["window"], shard)
            if not final:
                pieces, carried = self._carry_underfilled(pieces, build["window"])
        else:
            pieces = self._bucket(draws, build["max_tokens"])
            last = pieces[-1] if pieces else None
            if not final and last and len(last.rows) * last.t < 0.75 * build["max_tokens"]:
                carried = [
                    Draw(d.src, d.item, d.cfg_drop, d.length, d.age + 1)
                    for row in pieces.pop().rows
                    for d in row
                ]
        if self.shuffle:
            order = np.random.default_rng([self.seed, shard, st["window"], 31337])
            order = order.permutation(len(pieces))
            pieces = [pieces[i] for i in order]
        for d in too_long:
            if d.src not in self._warned_long:  # once per source; all are counted
                self._warned_long.add(d.src)
                logger.warning(
                    f"skipping samples of {self.sources[d.src].task}:{self.sources[d.src].name} "
                    f"longer than seq_len {self.seq_len} (first: item {d.item}, {d.length - 1} "
                    "frames); all are counted in data/skipped_too_long"
                )
        st["rng"] = rng.bit_generator.state
        st["carried"] = [(d.src, d.item, d.cfg_drop, d.length, d.age) for d in carried]
        st["window"] += 1
        st.pop("build")  # the next window takes the current settings
        return pieces, too_long, exhausted and not carried

    def _carry_underfilled(self, rows: list[list[Draw]], window: int) -> tuple[list, list[Draw]]:
        """Keep the well-filled rows; carry the others' samples to the next window (at most
        half a window, so nothing can be carried for ever)."""

        def ok(row: list[Draw]) -> bool:  # well filled, or holding a sample carried twice
            return sum(d.length - 1 for d in row) >= 0.97 * self.seq_len or any(
                d.age >= 2 for d in row
            )

        good, poor = [r for r in rows if ok(r)], [r for r in rows if not ok(r)]
        carried = [d for row in poor for d in row]
        if len(carried) > window // 2:
            return rows, []  # cannot pack better: emit everything
        return good, [Draw(d.src, d.item, d.cfg_drop, d.length, d.age + 1) for d in carried]

    def _pack(self, draws: list[Draw], window: int, shard: int) -> list[list[Draw]]:
        """Rows filled by exact subset-sum: each row takes the longest remaining sample, then
        the subset of the others that fills the rest best (bitset DP, O(items) big-int ops).
        The candidates are offered in a seeded random order, so rows mix tasks and lengths
        instead of grouping similar samples. Padding ends up in the last rows of a window,
        which are carried into the next one."""
        order = np.random.default_rng([self.seed, shard, window, 65537]).permutation(len(draws))
        pool = [draws[i] for i in order]
        need = [d.length - 1 for d in pool]  # input positions of each, in step with pool
        rows: list[list[Draw]] = []
        while pool:
            first = need.index(max(need))  # the longest; the first of equals
            head = pool.pop(first)
            need.pop(first)
            chosen = _best_subset(need, self.seq_len - head.length + 1)
            rows.append([head] + [pool[i] for i in chosen])
            for i in reversed(chosen):
                pool.pop(i)
                need.pop(i)
        return rows

    def _bucket(self, draws: list[Draw], max_tokens: int) -> list[Unit]:
        units: list[Unit] = []
        rows: list[list[Draw]] = []
        for d in sorted(draws, key=lambda d: d.length):
            t = _round_up(d.length - 1, 8)
            if rows and (len(rows) + 1) * min(t, self.seq_len) > max_tokens:
                units.append(Unit(rows, t=_round_up(rows[-1][0].length - 1, 8)))
                rows = []
            rows.append([d])
        if rows:
            units.append(Unit(rows, t=_round_up(rows[-1][0].length - 1, 8)))
        for u in units:
            u.t = min(u.t, self.seq_len)
        return units

    def _pieces(self, shard: int, cursor: dict):
        """Yield ``(cursor after it, piece, skipped)`` for shard ``shard`` from ``cursor`` =
        its window's start state and the pieces already taken from it; ``skipped`` = samples
        dropped as too long since the previous piece (a resumed window's were counted before
        it was interrupted)."""
        st = copy.deepcopy(cursor["window"])
        skip, skipped = cursor["consumed"], 0
        while True:
            start = copy.deepcopy(st)
            pieces, too_long, done = self._window(st, shard)
            if not skip:
                skipped += len(too_long)
            for i in range(skip, len(pieces)):
                yield {"window": start, "consumed": i + 1}, pieces[i], skipped
                skipped = 0
            skip = max(0, skip - len(pieces))
            if done:
                return

    def batch_bytes(self, unit: Unit) -> int:
        """Bytes of the micro-batch ``collate`` builds from ``unit`` (for the loader's bundles):
        input and targets int64, weights float32 per frame and stream, positions and labels."""
        return len(unit.rows) * unit.t * (20 * self.layout.num_streams + 16)

    def micro_batch(self, pieces: list) -> Unit:
        """A micro-batch from its slice's pieces: B rows (pack) or the one unit (bucket)."""
        if self.mode == "pack":
            return Unit([p for p in pieces if p is not None], t=self.seq_len)
        return pieces[0] if pieces and pieces[0] is not None else Unit([], t=0)

    # ---- iteration -------------------------------------------------------------------------
    def plans(self):
        """This rank's micro-batches as ``Plan``s (which samples go where), without building
        them: cheap, from item lengths alone. The loader computes them once, in the main
        process, and hands each to one loader worker to build (loader.py)."""
        start = self._start
        shards = {j: self._pieces(j, c) for j, c in start["shards"].items()}
        cursors = dict(start["shards"])
        steps, m = start["steps"], start["micro_done"]
        done: set[int] = set()  # shards at the end of a finite pass
        while len(done) < len(shards):
            own = self.slice_shards(m)
            got = [None if j in done else next(shards[j], None) for j in own]
            done.update(j for j, g in zip(own, got, strict=True) if g is None)
            skipped = 0
            for j, g in zip(own, got, strict=True):
                if g is not None:
                    cursors[j] = g[0]
                    skipped += g[2]
            unit = self.micro_batch([g[1] if g is not None else None for g in got])
            last = m == self.accumulation - 1
            self._position = {
                "steps": steps + last,
                "micro_done": 0 if last else m + 1,
                "accumulation": self.accumulation,
                "step_pieces": self.step_pieces,
                "shards": dict(cursors),
            }
            steps, m = steps + last, 0 if last else m + 1
            if unit.rows:  # else nothing is left for this slice in a finite pass
                yield Plan(unit, skipped, self._position)

    def __iter__(self):
        """Micro-batches ``(inputs, labels)``; in a plain DataLoader's worker ``w`` of ``n``,
        micro-batches ``w, w + n, ...`` (SpeechLMDataLoader instead plans once, in the main
        process, and spreads only the building over its workers)."""
        worker = get_worker_info()
        n_workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        for i, plan in enumerate(self.plans()):
            if i % n_workers == worker_id:
                yield self.collate(plan.unit, plan.skipped)

    def fetch(
        self, plan: Plan, sample_hashes: bool = False
    ) -> tuple[tuple[dict, torch.Tensor], dict]:
        """Build a planned micro-batch: ``(batch, meta)``, meta holding the stream position
        after it, the sample ids and (``sample_hashes``) each sample's content hash."""
        hashes: list[str] | None = [] if sample_hashes else None
        batch = self.collate(plan.unit, plan.skipped, hashes)
        ids = [self.sample_id(d) for row in plan.unit.rows for d in row]
        return batch, {"position": plan.position, "samples": hashes, "ids": ids}

    # ---- collation -------------------------------------------------------------------------
    def sample_id(self, d: Draw) -> str:
        """``TASK:DATASET:ITEM_ID`` of a draw: what a log of a bad step names."""
        s = self.sources[d.src]
        return f"{s.task}:{s.name}:{s.data.ids[d.item]}"

    def _example(self, d: Draw):
        s = self.sources[d.src]
        try:
            return self.builder.build(s.task, s.data[d.item], d.cfg_drop)
        except Exception as e:  # a corrupt item must not kill a multi-day run
            if (d.src, d.item) not in self._warned_bad:
                self._warned_bad.add((d.src, d.item))
                logger.warning(
                    f"skipping bad sample {s.name}[{d.item}] for {s.task}: {e} "
                    "(counted in data/skipped_bad)"
                )
            return None

    def collate(
        self, unit: Unit, skipped_too_long: int = 0, sample_hashes: list[str] | None = None
    ) -> tuple[dict, torch.Tensor]:
        """Frames, targets, weights and positions of a unit's rows; with ``sample_hashes``, a
        content hash of every sample placed is appended to it."""
        b, t, n = len(unit.rows), unit.t, self.layout.num_streams
        inp = np.broadcast_to(self._pad_frame, (b, t, n)).copy()
        tgt = inp.copy()
        w = np.zeros((b, t, n), dtype=np.float32)
        pos = np.zeros((b, t), dtype=np.int64)
        stats = dict.fromkeys(self.stats_keys, 0.0)
        stats["rows"], stats["skipped_too_long"] = b, skipped_too_long
        continuous = []  # (row, first frame, frames, waveform) of each continuous segment
        for r, row in enumerate(unit.rows):
            at = 0
            for d in row:
                ex = self._example(d)
                if ex is None:
                    stats["skipped_bad"] += 1
                    continue
                length = len(ex.frames) - 1
                for first, wave in ex.continuous:
                    frames = int(self.builder.continuous_frames(len(wave)))
                    continuous.append((r, at + first, frames, wave))
                if sample_hashes is not None:
                    sample_hashes.append(example_hash(ex))
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
        # an audio frame is N codes, wherever the pattern put them
        base, block = self.layout.stream_offset(0), self.layout.codebook_size + 1
        rel = inp - base
        codes = (rel >= 0) & (inp < self.layout.size) & (rel % block != 0)
        stats["audio_frames"] = float(codes.sum()) / n
        batch = {
            "input": torch.from_numpy(inp),
            "targets": torch.from_numpy(tgt),
            "loss_weights": torch.from_numpy(w),
            "position_ids": torch.from_numpy(pos),
            "data_stats": torch.tensor([[stats[k] for k in self.stats_keys]], dtype=torch.float32),
        }
        if self.continuous:
            batch.update(continuous_batch(continuous, b, t))
        return batch, torch.from_numpy(np.where(loss_frames, 0, IGNORE_INDEX))


def continuous_batch(segments: list[tuple[int, int, int, np.ndarray]], b: int, t: int) -> dict:
    """The model's continuous inputs (model/audio/tower.py) of ``(row, first frame, frames,
    int16 waveform)`` segments: waveforms zero-padded to the longest, their lengths, and each
    frame's row in the concatenation of the segments' adaptor frames (-1 elsewhere)."""
    longest = max((len(s[3]) for s in segments), default=0)
    wave = np.zeros((len(segments), longest), dtype=np.int16)
    index = np.full((b, t), -1, dtype=np.int64)
    done = 0
    for i, (r, first, n, w) in enumerate(segments):
        wave[i, : len(w)] = w
        index[r, first : first + n] = done + np.arange(n)
        done += n
    return {
        "audio_wave": torch.from_numpy(wave),
        "audio_lengths": torch.tensor([len(s[3]) for s in segments], dtype=torch.int64),
        "audio_index": torch.from_numpy(index),
    }


def _best_subset(sizes: list[int], cap: int) -> list[int]:
    """Indices (ascending) of a subset of ``sizes`` with the largest sum <= cap."""
    if cap <= 0 or not sizes:
        return []
    mask, full = (1 << (cap + 1)) - 1, 1 << cap
    reach = [1]  # reach[i]: bit s set if some subset of sizes[:i] sums to s
    for w in sizes:
        if reach[-1] & full:  # cap reached exactly: later items would never be chosen
            break
        reach.append((reach[-1] | (reach[-1] << w)) & mask if w <= cap else reach[-1])
    best = reach[-1].bit_length() - 1
    chosen = []
    for i in range(len(reach) - 1, 0, -1):
        if not (reach[i - 1] >> best) & 1:
            chosen.append(i - 1)
            best -= sizes[i - 1]
    return sorted(chosen)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def example_hash(ex) -> str:
    """Content hash of one sample (its frames and loss weights)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(ex.frames.tobytes())
    h.update(ex.weights.tobytes())
    return h.hexdigest()


def batch_hash(batch: dict) -> str:
    """Content hash of a micro-batch (inputs, targets, weights, positions)."""
    h = hashlib.blake2b(digest_size=12)
    for key in ("input", "targets", "loss_weights", "position_ids", *CONTINUOUS_KEYS):
        if key in batch:  # the continuous keys only in runs with continuous tasks
            h.update(batch[key].numpy().tobytes())
    return h.hexdigest()
