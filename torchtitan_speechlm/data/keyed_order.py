"""An epoch's order of n items as a keyed bijection, evaluated only where it is read
(``speechlm_data.order = "keyed"``).

The default order (``"permutation"``, data/mixing.py) is numpy's Fisher-Yates shuffle of every
source per epoch: O(items) time and memory on every rank before its first batch (~0.4 s and
40 MB per 10^7 items and source). Here position ``p`` of the epoch's order is
``keyed_order(p)``: a 4-round Feistel network over the smallest even-bit domain that holds
``n``, its round keys drawn from (seed, source, epoch), walked again while the result falls
outside ``[0, n)`` ("cycle walking": the walk stays inside the bijection's cycles, so the map
restricted to ``[0, n)`` is a bijection too; the domain is < 4n, so under 4 rounds of walking
on average). A shard reads positions ``j, j + S, j + 2S, ...``: its share is computed from its
own positions only, O(items / S) per shard, nothing global.

It is another order than the default's (other batches), so it is a setting, recorded with the
stream's position: a run resumes only with the order it started with.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 4
_M1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finaliser constants
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective avalanche of each uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def round_keys(seed: int, source: int, epoch: int, salt: int) -> np.ndarray:
    """The ``ROUNDS`` keys of epoch ``epoch`` of source ``source`` under ``seed``."""
    rng = np.random.default_rng([seed, source, epoch, salt])
    return rng.integers(0, 2**63, size=ROUNDS, dtype=np.uint64)


def keyed_order(positions: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """The items at ``positions`` (each in ``[0, n)``) of the order keyed by ``keys``: a
    bijection of ``[0, n)`` onto itself. int64."""
    pos = np.asarray(positions, dtype=np.uint64)
    if n <= 1:
        return np.zeros(len(pos), dtype=np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)
    out = pos.copy()
    todo = np.arange(len(pos))
    while len(todo):
        x = out[todo]
        left, right = x >> shift, x & mask
        with np.errstate(over="ignore"):
            for k in keys:
                left, right = right, left ^ (_mix(right ^ k) & mask)
        out[todo] = (left << shift) | right
        todo = todo[out[todo] >= np.uint64(n)]  # outside [0, n): walk on
    return out.astype(np.int64)


class KeyedShare:
    """Shard ``shard``'s items of an epoch in the keyed order: ``items[keyed_order(shard +
    k * step)]`` for k = 0, 1, ..., evaluated ``BLOCK`` positions at a time as the walk reads
    them (``len`` and integer indexing: what a shard's walk uses). ``items``: the source's
    item numbers (an array, or ``AllItems``)."""

    BLOCK = 4096

    def __init__(self, items, shard: int, step: int, keys: np.ndarray):
        self.items, self.shard, self.step, self.keys = items, shard, step, keys
        self.n = len(items)
        self._len = max(0, -(-(self.n - shard) // step))
        self._block, self._values = -1, np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, k: int) -> int:
        k = int(k)
        if not 0 <= k < self._len:
            raise IndexError(f"position {k} of a share of {self._len}")
        b = k // self.BLOCK
        if b != self._block:
            first = b * self.BLOCK
            ks = np.arange(first, min(first + self.BLOCK, self._len), dtype=np.int64)
            order = keyed_order(self.shard + ks * self.step, self.n, self.keys)
            self._block, self._values = b, np.asarray(self.items[order], dtype=np.int64)
        return int(self._values[k - b * self.BLOCK])

    def tolist(self) -> list[int]:
        return [self[k] for k in range(self._len)]
