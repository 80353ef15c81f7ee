"""The mixture: which item a shard's next draw takes.

Each (task, dataset) entry of the mixture is a ``Source``. In training, shard ``j`` (of ``S``
per optimizer step) walks a seeded permutation of each source per epoch, taking every
``S``-th item (a source smaller than ``S`` is shared whole, in the shard's own order), and the
shard's generator picks the source of each draw by weight. A finite (validation) pass takes
each source's share once, in order, source after source. Only the epoch and place per source
and the generator's state are needed to continue a walk: they are the window state
(position.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchtitan_speechlm.data.format import KINDS
from torchtitan_speechlm.data.keyed_order import KeyedShare, round_keys
from torchtitan_speechlm.data.planner import Draw
from torchtitan_speechlm.data.tasks import get_task

PERM_SEED = 104729  # an epoch's permutation is seeded [seed, src, epoch, (shard,) PERM_SEED]


@dataclass
class Source:
    task: str
    name: str
    weight: float
    data: object  # PreparedDataset
    indices: np.ndarray


class AllItems:
    """The item numbers ``0 .. n-1`` of a source that reads every item of its dataset (no
    hold-out, every kind usable), without an array of them: 4 bytes per item on every rank
    (1.2 GB per rank at 3x10^8 items). Indexed and sliced like the array it stands for;
    ``np.asarray`` makes that array (compact: int32 where item numbers fit)."""

    def __init__(self, n: int):
        self.n = int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return np.arange(*i.indices(self.n), dtype=np.int64)
        if np.ndim(i) == 0:
            k = int(i)
            if not -self.n <= k < self.n:
                raise IndexError(f"index {k} out of range for {self.n} items")
            return k % self.n
        a = np.asarray(i)
        if a.dtype == bool:
            return np.flatnonzero(a)
        a = a.astype(np.int64)
        if len(a) and (a.min() < -self.n or a.max() >= self.n):
            raise IndexError(f"an index out of range for {self.n} items")
        return a % self.n  # item k is k: no array of all of them

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.arange(self.n, dtype=dtype or (np.int32 if self.n <= 2**31 else np.int64))

    def __iter__(self):
        return iter(range(self.n))

    def tolist(self) -> list[int]:
        return list(range(self.n))

    def __eq__(self, other) -> bool:
        return isinstance(other, AllItems) and other.n == self.n

    def __repr__(self) -> str:
        return f"AllItems({self.n})"


def eligible(source: Source) -> np.ndarray | AllItems:
    """The source's indices whose kind of item its task can use (int32 where they fit: 4
    bytes per item of every source on every rank; ``AllItems`` where that is every item)."""
    codes = getattr(source.data, "kind_codes", None)
    kinds = getattr(source.data, "kinds", None)
    ok = get_task(source.task).kinds
    if codes is not None:
        usable = np.zeros(256, dtype=bool)  # a table lookup: ~10x np.isin's time at 10^7 items
        usable[[KINDS.index(k) for k in ok]] = True
        if isinstance(source.indices, AllItems):
            keep = usable[np.asarray(codes)]
            return source.indices if keep.all() else compact(np.flatnonzero(keep))
        idx = np.asarray(source.indices)
        idx = idx[usable[np.asarray(codes)[idx]]]
    elif kinds is not None:
        idx = np.array([i for i in source.indices if kinds[i] in ok], dtype=np.int64)
    else:
        return source.indices
    return compact(idx)


def compact(idx: np.ndarray) -> np.ndarray:
    """Item numbers as int32 where they fit (every item number is below 2**31), else int64."""
    small = len(idx) == 0 or int(idx.max()) < 2**31
    return np.asarray(idx, dtype=np.int32 if small else np.int64)


def is_identity(idx: np.ndarray | AllItems) -> bool:
    """Whether ``idx`` is ``0, 1, ..., len - 1``."""
    if isinstance(idx, AllItems):
        return True
    idx = np.asarray(idx)
    if len(idx) == 0:
        return True
    if int(idx[0]) != 0 or int(idx[-1]) != len(idx) - 1:
        return False
    return bool((np.diff(idx) == 1).all())


def _same(a, b) -> bool:
    if isinstance(a, AllItems) or isinstance(b, AllItems):
        return a == b
    return a.dtype == b.dtype and np.array_equal(a, b)


def keep_eligible(sources: list[Source]) -> None:
    """Narrow every source to its eligible items (in place); refuse a source left empty.
    Sources of one dataset with the same items (tts and asr over its speech) share one array."""
    kept: list[np.ndarray] = []
    for s in sources:
        idx = eligible(s)
        same = next((k for k in kept if _same(k, idx)), None)
        s.indices = idx if same is None else same
        if same is None and len(idx) > 4096:
            kept.append(idx)
        if len(s.indices) == 0:
            raise ValueError(
                f"{s.task}:{s.name} has no items usable for task {s.task!r} (after the "
                f"validation hold-out; needs items of kind {get_task(s.task).kinds})"
            )


class Mixture:
    """The weighted draw of the sources' items, per shard.

    ``length(src, item, cfg_drop)`` gives a drawn item's example length (lengths.py)."""

    def __init__(
        self,
        sources: list[Source],
        *,
        step_pieces: int,
        seed: int,
        shuffle: bool,
        infinite: bool,
        cfg_dropout: float,
        length: Callable[..., int],
        prompts=None,
        own_shards: list[int] | None = None,
        order: str,
    ):
        """``prompts``: the speaker prompts of prompted sources (speaker_prompts.py); a draw
        of such a source carries its prompt, and its length counts the prompt's frames.
        ``own_shards``: the shards this process walks (None: any); an epoch's permutation is
        then cut into their shares at once and not kept (a rank of dp 8 keeps 1/8 of it).
        ``order``: the epoch order ``speechlm_data.order`` resolved to (settings.py
        ``StreamSettings.start_order``, or a resumed stream's): ``"permutation"`` (an epoch's
        Fisher-Yates permutation of each source) or ``"keyed"`` (keyed_order.py: each shard's share
        evaluated where it is read; other batches)."""
        self.order = order
        self.sources, self.step_pieces, self.length = sources, step_pieces, length
        self.prompts = prompts
        self.seed, self.shuffle, self.infinite = seed, shuffle, infinite
        self.cfg_dropout = cfg_dropout
        self._cfg = [get_task(s.task).cfg_turn is not None for s in sources]  # CFG-droppable
        weights = np.array([s.weight for s in sources], dtype=np.float64)
        weights /= weights.sum()
        # Generator.choice(n, p=w) is searchsorted(cumsum(w) / its last, random()): the same
        # draw from the same random double, without choice's per-call validation (~15 us)
        self._cdf = weights.cumsum()
        self._cdf /= self._cdf[-1]
        # (src, shard) -> (epoch, the shard's items); (src, epoch) -> the epoch's permutation
        # of the source, computed once for every shard of this rank and sliced per shard
        self._perm_cache: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        self._epoch_perm: dict[tuple[int, int], np.ndarray | dict[int, np.ndarray]] = {}
        self.own_shards = None if own_shards is None else sorted(set(own_shards))
        # sources of every item of their dataset in order (no hold-out, every kind usable):
        # an epoch's order is its permutation itself, without a gather of 10^7 item numbers
        self._whole = [is_identity(s.indices) for s in sources]

    def reset(self) -> None:
        """Forget the cached permutations (they are recomputed identically on demand)."""
        self._perm_cache, self._epoch_perm = {}, {}

    def perm(self, src: int, epoch: int, shard: int) -> np.ndarray:
        """Shard ``shard``'s items of source ``src`` in epoch ``epoch``: every S-th item of the
        epoch's permutation (training), or of the source in order (a finite pass). A training
        source with fewer items than shards is shared whole, in the shard's own order."""
        key = (src, shard)
        cached = self._perm_cache.get(key)
        if cached is None or cached[0] != epoch:
            cached = self._perm_cache[key] = (epoch, self._shard_items(src, epoch, shard))
        return cached[1]

    def warm(self, epochs: set[tuple[int, int]]) -> None:
        """Compute the epoch orders ``(source, epoch)`` a walk is about to need (a start or a
        resume) at once, one thread each: numpy's shuffle runs without the GIL, so the
        sources' O(items) permutations (~0.4 s per 10^7 items) take the time of one where
        cores are free. Threads end before this returns (nothing runs across a fork of the
        loader's workers). The orders are those ``_epoch_share`` computes, so nothing
        changes but when."""
        keys = [(src, e) for src, e in sorted(epochs)
                if (src, e) not in self._epoch_perm and self._shuffled_whole(src)]  # fmt: skip
        if len(keys) < 2 or self.own_shards is None:
            return
        from concurrent.futures import ThreadPoolExecutor

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        with ThreadPoolExecutor(max_workers=max(1, min(len(keys), cores or 1))) as pool:
            orders = list(pool.map(lambda k: self.epoch_order(*k), keys))
        for key, order in zip(keys, orders, strict=True):
            self._epoch_perm[key] = self._own_shares(order)

    def _shuffled_whole(self, src: int) -> bool:
        """Whether the source's walk takes every S-th item of an epoch order (shuffled, at
        least as many items as shards): the orders ``warm`` can compute ahead."""
        return (self.shuffle and self.order == "permutation"
                and len(self.sources[src].indices) >= self.step_pieces)  # fmt: skip

    def epoch_order(self, src: int, epoch: int) -> np.ndarray:
        """Source ``src``'s items in epoch ``epoch``'s seeded order (compact: int32 where item
        numbers fit)."""
        idx = self.sources[src].indices
        perm = compact(
            np.random.default_rng([self.seed, src, epoch, PERM_SEED]).permutation(len(idx))
        )
        return perm if self._whole[src] else compact(idx[perm])

    def _own_shares(self, order: np.ndarray) -> dict[int, np.ndarray]:
        """Each own shard's every-S-th items of an epoch's order (copies: the order goes)."""
        return {j: order[j :: self.step_pieces].copy() for j in self.own_shards}

    def _epoch_share(self, src: int, epoch: int, shard: int) -> np.ndarray:
        """Shard ``shard``'s every-S-th items of the epoch's order, the order computed once per
        (source, epoch) for every shard of this process; only the epochs some shard of it is
        in are kept, and with ``own_shards`` only their shares (copies), not the order."""
        key = (src, epoch)
        got = self._epoch_perm.get(key)
        if got is None:
            order = self.epoch_order(src, epoch)
            in_own = self.own_shards is not None and shard in self.own_shards
            got = self._own_shares(order) if in_own else order
            live = {(s, e) for (s, _), (e, _) in self._perm_cache.items()} | {key}
            for k in [k for k in self._epoch_perm if k not in live]:
                del self._epoch_perm[k]
            self._epoch_perm[key] = got
        if isinstance(got, dict):
            share = got.get(shard)
            if share is not None:
                return share
            return self.epoch_order(src, epoch)[shard :: self.step_pieces].copy()
        return got[shard :: self.step_pieces]  # a view: no copy per shard

    def _shard_items(self, src: int, epoch: int, shard: int) -> np.ndarray:
        idx, n = self.sources[src].indices, self.step_pieces
        if self.shuffle:
            if len(idx) >= n and self.order == "keyed":  # no global array (keyed_order.py)
                keys = round_keys(self.seed, src, epoch, PERM_SEED)
                return KeyedShare(idx, shard, n, keys)
            if len(idx) >= n:
                return self._epoch_share(src, epoch, shard)
            perm = np.random.default_rng([self.seed, src, epoch, shard, PERM_SEED])
            return idx[perm.permutation(len(idx))]
        if self.infinite and len(idx) < n:
            return idx  # an unshuffled training source smaller than S: every shard walks it all
        return idx[shard::n]

    def _source(self, epoch: list[int], rng: np.random.Generator, shard: int) -> int | None:
        """The source of the next draw: by weight (training), or the first one whose share
        of a finite pass is not done (None: the pass is over)."""
        if self.infinite:
            return int(self._cdf.searchsorted(rng.random(), side="right"))
        return next(
            (i for i in range(len(self.sources)) if epoch[i] == 0 and len(self.perm(i, 0, shard))),
            None,
        )

    def draw(
        self, epoch: list[int], pos: list[int], rng: np.random.Generator, shard: int
    ) -> Draw | None:
        """Shard ``shard``'s next draw, advancing ``epoch``, ``pos`` (per source) and ``rng``;
        None at the end of a finite pass."""
        src = self._source(epoch, rng, shard)
        if src is None:
            return None
        perm = self.perm(src, epoch[src], shard)
        item = int(perm[pos[src]])
        drawn_in = epoch[src]
        pos[src] += 1
        if pos[src] >= len(perm):
            pos[src], epoch[src] = 0, epoch[src] + 1
        drop = bool(self._cfg[src] and self.cfg_dropout > 0 and rng.random() < self.cfg_dropout)
        if self.prompts is not None and self.prompts.prompted(src):
            # a pure function of (seed, source, epoch, shard, item): no generator is advanced
            prompt = self.prompts.draw(src, item, drawn_in, shard)
            return Draw(src, item, drop, self.length(src, item, drop, prompt), prompt=prompt)
        return Draw(src, item, drop, self.length(src, item, drop))
