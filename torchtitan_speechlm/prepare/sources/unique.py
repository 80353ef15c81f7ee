"""Duplicate ids found in 8 bytes per item, named as a set of the ids would name them.

A source of 10^8 items cannot keep a set of its ids (~70 bytes each) to refuse a repeated one.
Each reader keeps a 64-bit hash of every id (or table key) instead, and only where two hashes
agree reads those few keys again (from its spilled items or its file) to tell a repeat from a
hash collision. The error names the first repeat in source order, as the set did; and an error
found later in the source (a bad line) yields to a repeat before it (``duplicates_first``), so
a reader stops on the same problem as when it checked each id as it went.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import numpy as np

from torchtitan_speechlm.prepare.items import ManifestError

_MASK = (1 << 64) - 1


def key_hash(key: str) -> int:
    """A string's 64-bit hash (Python's own: only ever compared within this process)."""
    return hash(key) & _MASK


class KeyHashes:
    """``key_hash`` of each key, in the order they were added."""

    def __init__(self) -> None:
        self._h = array("Q")

    def add(self, key: str) -> None:
        self._h.append(key_hash(key))

    def __len__(self) -> int:
        return len(self._h)

    def clear(self) -> None:
        self._h = array("Q")

    def _view(self) -> np.ndarray:  # (the array cannot grow while a view of it lives)
        return np.frombuffer(self._h, dtype=np.uint64) if len(self._h) else np.zeros(0, np.uint64)

    def sorted(self) -> np.ndarray:
        """The hashes as uint64, sorted (a copy: adding may go on)."""
        return np.sort(self._view())

    def among(self, sorted_values: np.ndarray) -> np.ndarray:
        """Whether each hash, in order, is one of ``sorted_values`` (bool)."""
        return contains(sorted_values, self._view())

    def first_repeat(
        self, keys_at: Callable[[np.ndarray], Iterable[tuple[int, str]]]
    ) -> tuple[int, int] | None:
        """``(position, position of its first occurrence)`` of the first key, in order, that
        an earlier key repeats; None if none does. ``keys_at(positions)`` yields ``(position,
        key)`` for ascending positions; it is called only where hashes agree."""
        h = self._view()
        s = np.sort(h)
        same = s[1:][s[1:] == s[:-1]]
        del s
        if not len(same):
            return None
        first: dict[str, int] = {}
        for pos, key in keys_at(np.flatnonzero(contains(np.unique(same), h))):
            if key in first:
                return int(pos), first[key]
            first[key] = int(pos)
        return None


def contains(sorted_values: np.ndarray, values: np.ndarray, block: int = 1 << 20) -> np.ndarray:
    """Which of ``values`` are among ``sorted_values`` (bool per value), a block at a time:
    the temporaries stay small, whatever the sizes (``np.isin`` sorts both together)."""
    out = np.zeros(len(values), dtype=bool)
    if not len(sorted_values):
        return out
    for a in range(0, len(values), block):
        v = values[a : a + block]
        i = np.minimum(np.searchsorted(sorted_values, v), len(sorted_values) - 1)
        out[a : a + block] = sorted_values[i] == v
    return out


def item_ids_at(items) -> Callable[[np.ndarray], Iterator[tuple[int, str]]]:
    """``keys_at`` for a sequence of items (a list or SpilledItems): their ids."""
    return lambda positions: ((int(p), items[int(p)].id) for p in positions)


def refuse_repeated_id(
    ids: KeyHashes, items, message: Callable[[object, object], str], pending=None
) -> None:
    """A ManifestError ``message(later item, first item)`` for the first item whose id an
    earlier item has (``ids``: the hashes of the items' ids, in order). ``pending``: the line
    being read when an error stopped the reading (its id hashed, its item not made), as an
    object with the ``id`` (and whatever ``message`` reads) its item would have had."""
    if hasattr(items, "seal"):
        items.seal()  # readable (an error stops the reading anyway)
    n = len(items)

    def item(p: int):
        return items[p] if p < n else pending

    def keys_at(positions):
        return ((int(p), item(int(p)).id) for p in positions if p < n or pending is not None)

    hit = ids.first_repeat(keys_at)
    if hit is not None:
        raise ManifestError(message(item(hit[0]), item(hit[1])))


@contextmanager
def duplicates_first(
    ids: KeyHashes, items, message: Callable[[object, object], str], pending=lambda: None
):
    """Reading inside this block: a ManifestError yields to a repeated id found before it
    (``pending()``: the line being read, see ``refuse_repeated_id``)."""
    try:
        yield
    except ManifestError:
        refuse_repeated_id(ids, items, message, pending())
        raise
