"""The dev split of ``torchtitan prepare --dev-fraction F`` (docs/data.md, *A dev split*).

Items are grouped into *units*: a labelled speaker's items form one unit (so no speaker is in
both splits), an item without a speaker is a unit of its own. Units are ranked by
``sha256("<seed>:spk:<speaker>")`` (``"<seed>:id:<id>"`` for an unlabelled item), and walked in
that order: a unit goes to dev if adding it brings dev's item count closer to ``round(F x
items)``. The result depends on the items' ids, speakers and the seed only, never on their
order in the source or on ``--workers``; with units of one item it is exactly ``round(F x
items)`` items (at least one; at most all but one).

Memory: a dict of the named speakers, 8 bytes per unlabelled item (its rank to 64 bits, 16
while they are sorted), and the two splits in spill files (``prepare/spill.py``), not lists.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from torchtitan_speechlm.prepare.items import ManifestItem
from torchtitan_speechlm.prepare.sources.unique import contains
from torchtitan_speechlm.prepare.spill import SpilledItems

SPLITS = ("train", "dev")  # subfolders of --out-dir, the names the recipes' `datasets` use
SPLIT_FILE = "split.json"  # <out>/split.json: the split's settings and counts


class SplitError(ValueError):
    """The dev split cannot be made (bad fraction, or too few units); names the flag."""


@dataclass
class Split:
    train: Sequence[ManifestItem]  # SpilledItems: on disk (prepare/spill.py), in source order
    dev: Sequence[ManifestItem]
    info: dict  # recorded in <out>/split.json and each split's plan/metadata "source"


def check_fraction(fraction: float) -> None:
    if not 0.0 < fraction < 1.0:
        raise SplitError(
            f"--dev-fraction (dev_fraction) must be between 0 and 1, exclusive (e.g. 0.02 for "
            f"2% of the items in dev), got {fraction:g}"
        )


def _rank(seed: int, unit: str) -> bytes:
    return hashlib.sha256(f"{seed}:{unit}".encode()).digest()


def _prefix(rank: bytes) -> int:
    """A rank's first 64 bits: ordered as the ranks are, but for ties."""
    return int.from_bytes(rank[:8], "big")


def split_items(items: Sequence[ManifestItem], fraction: float, seed: int = 0) -> Split:
    """Carve ``items`` into train and dev (each in source order); see the module docstring."""
    check_fraction(fraction)
    speakers: dict[str, int] = {}  # items per named speaker (speakers are few)
    loose = array("Q")  # each unlabelled item's rank, to 64 bits, in source order
    for it in items:
        if it.speaker is not None:
            speakers[it.speaker] = speakers.get(it.speaker, 0) + 1
        else:
            loose.append(_prefix(_rank(seed, f"id:{it.id}")))
    n = len(items)
    target = min(max(1, round(fraction * n)), n - 1)
    walk = _Walk(items, seed, speakers, loose)
    count = walk.run(target)
    if count == 0 or count == n:
        raise SplitError(
            f"--dev-fraction {fraction:g}: cannot carve a dev split of about {target} of the "
            f"{n} items from {walk.units} "
            + (
                "speakers (a split keeps each speaker's items together; the smallest has "
                f"{walk.smallest} items)"
                if speakers
                else "items"
            )  # fmt: skip
        )
    train, dev = SpilledItems(), SpilledItems()
    for it, in_dev in zip(items, walk.in_dev(items), strict=True):
        (dev if in_dev else train).append(it)
    dev_speakers = len(walk.dev_speakers)
    info = {
        "dev_fraction": fraction,
        "seed": seed,
        "by": "speaker" if speakers else "item",
        "input_items": n,
        "target_dev_items": target,
        "train": {"items": len(train), "speakers": len(speakers) - dev_speakers},
        "dev": {"items": len(dev), "speakers": dev_speakers},
    }
    return Split(train.seal(), dev.seal(), info)


class _Walk:
    """The units in rank order, each taken into dev if it brings dev closer to the target.

    Speakers are ranked exactly (full hash, then name). Unlabelled items are a sorted array of
    64-bit rank prefixes: one is taken exactly when dev is still short of the target (it adds
    1), so dev's unlabelled items are the first ``taken`` of that array, and a speaker's place
    among them is a binary search. A prefix that two items share, or an item with a speaker,
    is ranked exactly like a speaker (its full hash, then its id), which keeps the order of
    the full hashes everywhere."""

    def __init__(self, items, seed: int, speakers: dict[str, int], loose: array):
        self.items, self.loose = items, loose
        ranked = np.sort(np.frombuffer(loose, np.uint64) if len(loose) else np.zeros(0, np.uint64))
        exact = [(_rank(seed, f"spk:{s}"), f"spk:{s}", size) for s, size in speakers.items()]
        named = np.array([_prefix(r) for r, _, _ in exact], dtype=np.uint64)
        shared = ranked[1:][ranked[1:] == ranked[:-1]]
        self.tied = np.unique(np.concatenate([shared, named[contains(ranked, named)]]))
        self.tied_set = {int(p) for p in self.tied}
        self.exact_loose: dict[str, int] = {}
        if len(self.tied):  # rare: the units these prefixes stand for, ranked in full
            for it, p in self._loose_items():
                if p in self.tied_set:
                    unit = f"id:{it.id}"
                    self.exact_loose[unit] = self.exact_loose.get(unit, 0) + 1
            ranked = ranked[~contains(self.tied, ranked)]
            exact += [(_rank(seed, u), u, size) for u, size in self.exact_loose.items()]
        self.ranked, self.exact = ranked, sorted(exact)
        self.units = len(exact) + len(ranked)
        self.smallest = min([size for _, _, size in exact] + [1] * bool(len(ranked)))

    def _loose_items(self):
        k = 0
        for it in self.items:
            if it.speaker is None:
                yield it, self.loose[k]
                k += 1

    def run(self, target: int) -> int:
        """Walk the units; return dev's item count."""
        count, before, self.taken, self.dev_units = 0, 0, 0, set()
        for rank, unit, size in self.exact:
            at = int(np.searchsorted(self.ranked, np.uint64(_prefix(rank))))  # (never equal)
            take = min(at - before, max(0, target - count))
            self.taken, count, before = self.taken + take, count + take, at
            if abs(count + size - target) < abs(count - target):
                self.dev_units.add(unit)
                count += size
        take = min(len(self.ranked) - before, max(0, target - count))
        self.taken, count = self.taken + take, count + take
        self.last = int(self.ranked[self.taken - 1]) if self.taken else -1
        self.dev_speakers = {u[4:] for u in self.dev_units if u.startswith("spk:")}
        del self.ranked  # (8 bytes per unlabelled item)
        return count

    def in_dev(self, items) -> Iterator[bool]:
        """Whether each item, in source order, is in dev."""
        k = 0
        for it in items:
            if it.speaker is not None:
                yield it.speaker in self.dev_speakers
                continue
            p = self.loose[k]
            k += 1
            yield f"id:{it.id}" in self.dev_units if p in self.tied_set else p <= self.last


def describe_split(info: dict, written: dict[str, int] | None = None) -> str:
    """The line prepare prints: items (and speakers) per split, the fraction asked and got."""
    parts = []
    for name in SPLITS:
        s = info[name]
        n = f"{s['items']} items" + (
            f" of {s['speakers']} speakers" if info["by"] == "speaker" else ""
        )
        if written is not None and written.get(name, s["items"]) != s["items"]:
            n += f" ({written[name]} written)"
        parts.append(f"{name} {n}")
    got = info["dev"]["items"] / info["input_items"]
    return (
        f"split: {', '.join(parts)}; dev holds {got:.3f} of the {info['input_items']} input items "
        f"(--dev-fraction {info['dev_fraction']:g}, by {info['by']}, seed {info['seed']})"
        + ("; no speaker in both" if info["by"] == "speaker" else "")
    )
