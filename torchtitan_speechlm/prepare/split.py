"""The dev split of ``torchtitan prepare --dev-fraction F`` (docs/data.md, *A dev split*).

Items are grouped into *units*: a labelled speaker's items form one unit (so no speaker is in
both splits), an item without a speaker is a unit of its own. Units are ranked by
``sha256("<seed>:spk:<speaker>")`` (``"<seed>:id:<id>"`` for an unlabelled item), and walked in
that order: a unit goes to dev if adding it brings dev's item count closer to ``round(F x
items)``. The result depends on the items' ids, speakers and the seed only, never on their
order in the source or on ``--workers``; with units of one item it is exactly ``round(F x
items)`` items (at least one; at most all but one).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from torchtitan_speechlm.prepare.items import ManifestItem

SPLITS = ("train", "dev")  # subfolders of --out, the names the recipes' `datasets` use
SPLIT_FILE = "split.json"  # <out>/split.json: the split's settings and counts


class SplitError(ValueError):
    """The dev split cannot be made (bad fraction, or too few units); names the flag."""


@dataclass
class Split:
    train: list[ManifestItem]
    dev: list[ManifestItem]
    info: dict  # recorded in <out>/split.json and each split's plan/metadata "source"


def check_fraction(fraction: float) -> None:
    if not 0.0 < fraction < 1.0:
        raise SplitError(
            f"--dev-fraction (dev_fraction) must be between 0 and 1, exclusive (e.g. 0.02 for "
            f"2% of the items in dev), got {fraction:g}"
        )


def _unit(it: ManifestItem) -> str:
    return f"spk:{it.speaker}" if it.speaker is not None else f"id:{it.id}"


def _rank(seed: int, unit: str) -> bytes:
    return hashlib.sha256(f"{seed}:{unit}".encode()).digest()


def split_items(items: list[ManifestItem], fraction: float, seed: int = 0) -> Split:
    """Carve ``items`` into train and dev (each in source order); see the module docstring."""
    check_fraction(fraction)
    sizes: dict[str, int] = {}
    for it in items:
        sizes[_unit(it)] = sizes.get(_unit(it), 0) + 1
    target = min(max(1, round(fraction * len(items))), len(items) - 1)
    dev_units, count = set(), 0
    for unit in sorted(sizes, key=lambda u: (_rank(seed, u), u)):
        if abs(count + sizes[unit] - target) < abs(count - target):
            dev_units.add(unit)
            count += sizes[unit]
    by_speaker = any(it.speaker is not None for it in items)
    if count == 0 or count == len(items):
        raise SplitError(
            f"--dev-fraction {fraction:g}: cannot carve a dev split of about {target} of the "
            f"{len(items)} items from {len(sizes)} "
            + (
                "speakers (a split keeps each speaker's items together; the smallest has "
                f"{min(sizes.values())} items)"
                if by_speaker
                else "items"
            )  # fmt: skip
        )
    dev = [it for it in items if _unit(it) in dev_units]
    train = [it for it in items if _unit(it) not in dev_units]
    speakers = {s: {_unit(it) for it in part if it.speaker is not None} for s, part in
                (("train", train), ("dev", dev))}  # fmt: skip
    info = {
        "dev_fraction": fraction,
        "seed": seed,
        "by": "speaker" if by_speaker else "item",
        "input_items": len(items),
        "target_dev_items": target,
        "train": {"items": len(train), "speakers": len(speakers["train"])},
        "dev": {"items": len(dev), "speakers": len(speakers["dev"])},
    }
    return Split(train, dev, info)


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
