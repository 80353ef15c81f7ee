"""The index of a prepared dataset: each shard's ``items.jsonl`` read into columns, and the
columns of every shard concatenated in ``metadata.json``'s order. Lengths, kinds and turn
counts come from here, so a loader budgets examples without reading an array; so do speakers
(``data/speakers.py``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from torchtitan_speechlm.data.format import INDEX_COLUMNS, REGENERATE, SPEAKER, CorruptDatasetError
from torchtitan_speechlm.data.speakers import SpeakerTable

TURN_KEYS = ("role", "modality", "offset", "length", "text")


@dataclass
class IndexLines:
    """One shard's ``items.jsonl``: ``rows`` float64 [n, 5] (``INDEX_COLUMNS``), the items'
    ids, texts and kinds, the turns of its dialogues by item of the shard, and the items'
    speakers as the source named them (None: unlabelled)."""

    rows: np.ndarray
    ids: list[str]
    texts: list[str]
    kinds: list[str]
    turns: dict[int, list[dict]]
    speakers: list[str | None] = field(default_factory=list)


def read_index(items_path: str) -> IndexLines:
    """A shard's ``items.jsonl``; a missing file or a bad line is a ``CorruptDatasetError``
    naming the line."""
    if not os.path.isfile(items_path):
        raise CorruptDatasetError(f"{items_path} is missing; {REGENERATE}")
    lines = IndexLines(np.zeros(0), [], [], [], {}, [])
    cols: list[tuple] = []
    with open(items_path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                r = json.loads(line)
                cols.append(tuple(float(r[k]) for k in INDEX_COLUMNS))
                item_id, text, kind = str(r["id"]), str(r["text"]), str(r["kind"])
                speaker = r.get(SPEAKER)
                if speaker is not None and (not isinstance(speaker, str) or not speaker):
                    raise ValueError(f"speaker {speaker!r} is not a non-empty string")
                if "turns" in r:
                    lines.turns[len(cols) - 1] = [{k: t[k] for k in TURN_KEYS} for t in r["turns"]]
            except (ValueError, KeyError, TypeError) as e:
                raise CorruptDatasetError(
                    f"{items_path}:{lineno}: bad index line ({e}); {REGENERATE}"
                ) from e
            lines.ids.append(item_id)
            lines.texts.append(text)
            lines.kinds.append(kind)
            lines.speakers.append(speaker)
    lines.rows = np.asarray(cols, dtype=np.float64).reshape(-1, 5)
    return lines


class ItemIndex:
    """The index columns of every item, shards concatenated in order: item ``i`` of the
    dataset is item ``i - start(s)`` of shard ``s``."""

    def __init__(self, shards: list[IndexLines]):
        self.ids: list[str] = [i for s in shards for i in s.ids]
        self.texts: list[str] = [t for s in shards for t in s.texts]
        # per item: the speaker its source named, None if unlabelled (SpeakerTable: numbered)
        self.speaker_labels: list[str | None] = [x for s in shards for x in s.speakers]
        self.turns: dict[int, list[dict]] = {}  # dialogue items: their turns (TURN_KEYS)
        base = 0
        for s in shards:
            self.turns.update({base + k: turns for k, turns in s.turns.items()})
            base += len(s.ids)
        idx = np.concatenate([s.rows for s in shards]) if shards else np.zeros((0, 5))
        shard_of = [np.full(len(s.rows), k, dtype=np.int32) for k, s in enumerate(shards)]
        self.shard = np.concatenate(shard_of) if shard_of else np.zeros(0, dtype=np.int32)
        self.seconds = idx[:, 4]
        self.text_off, self.text_len, self.audio_off, self.audio_frames = (
            idx[:, :4].astype(np.int64).T
        )
        self.kinds = np.array([k for s in shards for k in s.kinds], dtype="<U8")
        self.num_turns = np.zeros((len(self.ids), 2), dtype=np.int64)  # turns, audio turns
        for i, turns in self.turns.items():
            self.num_turns[i] = (len(turns), sum(t["modality"] == "audio" for t in turns))

    def shard_items(self, s: int) -> tuple[int, int]:
        """The first item of shard ``s`` and its number of items."""
        return int(np.searchsorted(self.shard, s)), int((self.shard == s).sum())

    @cached_property
    def has_speakers(self) -> bool:
        """Whether the source named any item's speaker (False for datasets prepared before
        speakers existed: every item is then its own speaker)."""
        return any(x is not None for x in self.speaker_labels)

    @cached_property
    def speakers(self) -> SpeakerTable:
        """The speaker table, built on first use (one pass over the labels)."""
        return SpeakerTable.from_labels(self.ids, self.speaker_labels)
