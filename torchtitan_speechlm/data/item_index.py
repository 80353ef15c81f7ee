"""The index of a prepared dataset: fixed-width columns per item (``format.COLUMN_DTYPE``),
every shard's concatenated in ``metadata.json``'s order and memory-mapped from the dataset's
``index/`` folder (``data/index_store.py``), so an index costs bytes of page cache shared by the
ranks of a node, not Python objects per rank. Lengths, kinds and turn counts come from the
columns, so a loader budgets examples without reading an array; ids, texts, turns and speaker
labels are read from ``items.jsonl`` only when asked for (one line at ``line``, or a shard at a
time), through the shards' bounded cache (``data/shard_files.py``)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property

import numpy as np

from torchtitan_speechlm.data.format import (
    COLUMN_DTYPE,
    ITEMS,
    KINDS,
    REGENERATE,
    SPEAKER,
    TURN_KINDS,
    CorruptDatasetError,
    column_row,
)
from torchtitan_speechlm.data.shard_files import limit_error
from torchtitan_speechlm.data.speakers import SpeakerTable

TURN_KEYS = ("role", "modality", "offset", "length", "text")
WITH_TURNS = tuple(KINDS.index(k) for k in TURN_KINDS)  # dialogue and preference items


def check_row(row: dict) -> None:
    """Refuse an items.jsonl row whose keys or values a reader cannot use (``ValueError``)."""
    str(row["id"]), str(row["text"])
    speaker = row.get(SPEAKER)
    if speaker is not None and (not isinstance(speaker, str) or not speaker):
        raise ValueError(f"speaker {speaker!r} is not a non-empty string")
    if row["kind"] not in KINDS:
        raise ValueError(f"kind {row['kind']!r} is not one of {KINDS}")
    for t in row.get("turns") or ():
        [t[k] for k in TURN_KEYS]


def columns_from_items(items_path: str) -> np.ndarray:
    """A shard's ``COLUMN_DTYPE`` columns parsed from its ``items.jsonl`` (datasets prepared
    before prepare wrote ``columns.npy``); a missing file or a bad line is a
    ``CorruptDatasetError`` naming the line."""
    if not os.path.isfile(items_path):
        raise CorruptDatasetError(f"{items_path} is missing; {REGENERATE}")
    rows, offset = [], 0
    with open(items_path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                r = json.loads(line)
                check_row(r)
                rows.append(column_row(r, offset))
            except (ValueError, KeyError, TypeError) as e:
                raise CorruptDatasetError(
                    f"{items_path}:{lineno}: bad index line ({e}); {REGENERATE}"
                ) from e
            offset += len(line)
    return np.array(rows, dtype=COLUMN_DTYPE)


class LazyStrings(Sequence):
    """``ids`` / ``texts`` of a dataset: item ``i``'s value read from its items.jsonl line when
    asked for; iteration reads a shard at a time."""

    def __init__(self, index: ItemIndex, key: str):
        self.index, self.key = index, key

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"item {i} out of range for {n} items")
        return str(self.index.row(int(i) % n)[self.key])

    def __iter__(self) -> Iterator[str]:
        for s in range(self.index.num_shards):
            for r in self.index.shard_rows(s):
                yield str(r[self.key])

    def __eq__(self, other) -> bool:
        if isinstance(other, (LazyStrings, list, tuple)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __add__(self, other) -> list[str]:
        return list(self) + list(other)

    def __radd__(self, other) -> list[str]:
        return list(other) + list(self)

    def __repr__(self) -> str:
        return f"<{len(self)} {self.key}s, read from items.jsonl when asked for>"


class ItemIndex:
    """The index columns of every item, shards concatenated in order: item ``i`` of the
    dataset is item ``i - starts[s]`` of shard ``s``. ``columns``: ``COLUMN_DTYPE``'s name ->
    an array of every item (memory-mapped); ``starts``: int64 [shards + 1]; ``where(s)``: shard
    ``s``'s folder. An item's line is read with one ``pread`` of its items.jsonl, opened and
    closed again (no descriptor stays open for it)."""

    def __init__(
        self, columns: dict[str, np.ndarray], starts: np.ndarray, where: Callable[[int], str]
    ):
        # plain array views of the maps: np.memmap's own indexing costs ~1 us per element read
        columns = {k: np.asarray(v) for k, v in columns.items()}
        self.columns, self.starts, self._where = columns, np.asarray(starts), where
        self.seconds = columns["seconds"]
        self.text_off, self.text_len = columns["text_offset"], columns["text_len"]
        self.audio_off, self.audio_frames = columns["audio_offset"], columns["audio_frames"]
        self.kind_codes = columns["kind"]  # uint8: an index into format.KINDS
        self.id_hash = columns["id_hash"]
        self._rows: dict[int, dict] = {}  # the last items read (an example, then its id)
        self.ids = LazyStrings(self, "id")
        self.texts = LazyStrings(self, "text")

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def num_shards(self) -> int:
        return len(self.starts) - 1

    def shard_of(self, i: int) -> int:
        """The shard holding item ``i``."""
        return int(self.starts.searchsorted(i, side="right")) - 1

    def shard_items(self, s: int) -> tuple[int, int]:
        """The first item of shard ``s`` and its number of items."""
        return int(self.starts[s]), int(self.starts[s + 1] - self.starts[s])

    @cached_property
    def kinds(self) -> KindColumn:
        return KindColumn(self.kind_codes)

    def is_dialogue(self, i: int) -> bool:
        """Whether item ``i`` is made of turns (a dialogue or a preference pair)."""
        return int(self.kind_codes[i]) in WITH_TURNS

    def _items_path(self, s: int) -> str:
        return os.path.join(self._where(s), ITEMS)

    def row(self, i: int) -> dict:
        """Item ``i``'s items.jsonl line, parsed (its id, text, speaker, turns, ...)."""
        got = self._rows.get(i)
        if got is None:
            got = self._read_row(i)
            if len(self._rows) >= 1024:
                self._rows.pop(next(iter(self._rows)))
            self._rows[i] = got
        return got

    def _read_row(self, i: int) -> dict:
        s = self.shard_of(i)
        path, off = self._items_path(s), int(self.columns["line"][i])
        try:
            with open(path, "rb") as f:
                f.seek(off)
                line = f.readline()
        except OSError as e:
            limit = limit_error(path, e)
            if limit is not None:
                raise limit from e
            raise CorruptDatasetError(f"{path} is unreadable ({e}); {REGENERATE}") from e
        try:
            return json.loads(line)
        except ValueError as e:
            raise CorruptDatasetError(
                f"{path}: no index line at byte {off} for item {i - int(self.starts[s])} of the "
                f"shard ({e}); {REGENERATE}"
            ) from e

    def shard_rows(self, s: int) -> Iterator[dict]:
        """Shard ``s``'s items.jsonl lines, parsed, in order."""
        path = self._items_path(s)
        with open(path, "rb") as f:
            data = f.read()
        for lineno, line in enumerate(data.splitlines(), start=1):
            try:
                r = json.loads(line)
                check_row(r)
            except (ValueError, KeyError, TypeError) as e:
                raise CorruptDatasetError(
                    f"{path}:{lineno}: bad index line ({e}); {REGENERATE}"
                ) from e
            yield r

    def turns(self, i: int) -> list[dict]:
        """A dialogue item's turns (``TURN_KEYS``)."""
        return [{k: t[k] for k in TURN_KEYS} for t in self.row(i)["turns"]]

    @cached_property
    def has_speakers(self) -> bool:
        """Whether the source named any item's speaker (False for datasets prepared before
        speakers existed: every item is then its own speaker)."""
        return bool(np.asarray(self.columns["labelled"]).any())

    @cached_property
    def speaker_labels(self) -> list[str | None]:
        """Per item: the speaker its source named, None if unlabelled (read on first use)."""
        if not self.has_speakers:
            return [None] * len(self)
        return [r.get(SPEAKER) for s in range(self.num_shards) for r in self.shard_rows(s)]

    @cached_property
    def speakers(self) -> SpeakerTable:
        """The speaker table, built on first use (one pass over the labels)."""
        return SpeakerTable.from_labels(self.ids, self.speaker_labels)


class KindColumn(Sequence):
    """Per item: ``"speech"``, ``"text"``, ``"audio"``, ``"dialogue"`` or ``"preference"``, over
    the uint8 codes (``codes``; ``np.asarray`` gives the strings of every item)."""

    _names = np.array(KINDS)

    def __init__(self, codes: np.ndarray):
        self.codes = codes

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, i):
        if isinstance(i, (int, np.integer)):
            return KINDS[int(self.codes[i])]
        return self._names[np.asarray(self.codes[i])]

    def __array__(self, dtype=None, copy=None):
        out = self._names[np.asarray(self.codes)]
        return out if dtype is None else out.astype(dtype)

    def __eq__(self, other):
        return np.asarray(self.codes) == KINDS.index(other) if other in KINDS else NotImplemented

    __hash__ = None
