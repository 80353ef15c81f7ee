"""Reading prepared datasets at training time: a memory-mapped, validated view of every shard
(the format itself is ``torchtitan_speechlm.data.format``; opening and checking one shard is
``data/shard_files.py``, the index columns ``data/item_index.py``)."""

from __future__ import annotations

import os

import numpy as np

from torchtitan_speechlm.data.format import (
    FORMAT_VERSION,
    METADATA,
    REGENERATE,
    CorruptDatasetError,
    PreparedItem,
    Turn,
    read_json,
)
from torchtitan_speechlm.data.item_index import ItemIndex
from torchtitan_speechlm.data.shard_files import open_shard, open_waves
from torchtitan_speechlm.data.speakers import SpeakerTable


def decode_turns(turns: list[dict], text: np.ndarray, codes: np.ndarray) -> list[Turn]:
    """A dialogue's turns from its index entries: text turns index the shard's text tokens,
    audio turns its codes (copied out of the memory map as int64)."""
    out = []
    for t in turns:
        source = text if t["modality"] == "text" else codes
        tokens = np.array(source[t["offset"] : t["offset"] + t["length"]], dtype=np.int64)
        out.append(Turn(t["role"], t["modality"], tokens, t["text"]))
    return out


class PreparedDataset:
    """Read-only, memory-mapped view of a prepared dataset (all shards as one); validated on open.

    Item ``i`` of the dataset is item ``i - start(s)`` of shard ``s``: shards are concatenated
    in the order ``metadata.json`` lists them, which is input order.
    """

    def __init__(self, path: str, verify: str = "size"):
        """``verify``: what is checked against the file sizes and sha256s that metadata.json
        recorded for each shard: ``"size"`` (cheap: truncated or appended files), ``"full"``
        (also the checksums: any modification; reads every byte once), ``"none"``."""
        self.path = os.path.abspath(path)
        self.verify = verify
        if not os.path.isdir(self.path):
            raise CorruptDatasetError(
                f"prepared dataset {self.path} not found; create it with `torchtitan prepare`"
            )
        meta_path = os.path.join(self.path, METADATA)
        self.metadata: dict = read_json(meta_path, " (unfinished or not a prepared dataset)")
        version = self.metadata.get("format_version")
        if version != FORMAT_VERSION:
            raise CorruptDatasetError(
                f"{meta_path}: format_version {version!r} is not supported (this code reads "
                f"{FORMAT_VERSION}); {REGENERATE} with this version of torchtitan_speechlm"
            )
        self.num_streams = int(self.metadata["codec"]["num_streams"])
        shards = [
            open_shard(self.path, entry, self.metadata, verify)
            for entry in self.metadata.get("shards", [])
        ]
        self.shard_paths: list[str] = [s.path for s in shards]
        self._text_arrays = [s.text for s in shards]
        self._code_arrays = [s.codes for s in shards]
        self.index = ItemIndex([s.lines for s in shards])
        self.ids: list[str] = self.index.ids
        self.texts: list[str] = self.index.texts
        if self.metadata.get("num_items") != len(self.ids):
            raise CorruptDatasetError(
                f"{meta_path} says {self.metadata.get('num_items')} items but its shards hold "
                f"{len(self.ids)}; {REGENERATE}"
            )
        self.waveform: dict | None = self.metadata.get("waveform")
        self._wave_arrays: list[np.ndarray] = []
        self._wave_index = np.zeros((0, 2), dtype=np.int64)  # per item: offset, samples
        if self.waveform:
            self._open_waves()

    def _open_waves(self) -> None:
        """Every shard's waveforms, checked against metadata.json's record and the items."""
        rows = [np.zeros((0, 2), dtype=np.int64)]
        for s, entry in enumerate(self.metadata["shards"]):
            files = self.waveform.get("files", {}).get(str(entry.get("name")))
            wave, index = open_waves(
                self.shard_paths[s], files, self.verify, self.ids, *self.index.shard_items(s)
            )
            self._wave_arrays.append(wave)
            rows.append(index)
        self._wave_index = np.concatenate(rows)

    @property
    def text_lengths(self) -> np.ndarray:
        """Text tokens per item (summed over turns for dialogues), from the index."""
        return self.index.text_len

    @property
    def audio_lengths(self) -> np.ndarray:
        """Audio frames per item (summed over turns for dialogues), from the index."""
        return self.index.audio_frames

    @property
    def kinds(self) -> np.ndarray:
        """Per item: "speech" (text + audio), "text", "audio" or "dialogue"."""
        return self.index.kinds

    @property
    def num_turns(self) -> np.ndarray:
        """Turns per dialogue item (0 for other kinds), from the index: for length budgeting."""
        return self.index.num_turns[:, 0]

    @property
    def num_audio_turns(self) -> np.ndarray:
        """Audio turns per dialogue item (0 for other kinds), from the index."""
        return self.index.num_turns[:, 1]

    # --- speakers (data/speakers.py): from the index, no array read ---------------------------

    @property
    def has_speakers(self) -> bool:
        """Whether the source named speakers (False: every item is its own speaker, as for
        every dataset prepared before speakers existed)."""
        return self.index.has_speakers

    @property
    def speaker_table(self) -> SpeakerTable:
        """Names, labelled flags, each item's speaker and each speaker's items."""
        return self.index.speakers

    @property
    def speakers(self) -> list[str]:
        """Speaker names, numbered in order of their first item: the source's label, or for an
        unlabelled item (its own speaker) the item's id (``speaker_labelled`` tells which)."""
        return self.index.speakers.names

    @property
    def speaker_labelled(self) -> np.ndarray:
        """bool [speakers]: False for an unlabelled item's own speaker."""
        return self.index.speakers.labelled

    @property
    def item_speakers(self) -> np.ndarray:
        """int32 [items]: each item's speaker (an index into ``speakers``)."""
        return self.index.speakers.of_item

    def speaker_of(self, i: int) -> int:
        """Item ``i``'s speaker (an index into ``speakers``)."""
        return int(self.index.speakers.of_item[i])

    def items_of_speaker(self, s: int) -> np.ndarray:
        """int64: the items of speaker ``s``, in dataset order."""
        return self.index.speakers.items_of(s)

    @property
    def utterances_per_speaker(self) -> np.ndarray:
        """int64 [speakers]: items of each speaker."""
        return self.index.speakers.utterances

    @property
    def wave_samples(self) -> np.ndarray | None:
        """Waveform samples per item (datasets with waveforms), else None."""
        return self._wave_index[:, 1] if self.waveform else None

    def wave(self, i: int) -> np.ndarray | None:
        if not self.waveform:
            return None
        off, n = self._wave_index[i]
        return np.array(self._wave_arrays[self.index.shard[i]][off : off + n])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> PreparedItem:
        n = len(self.ids)
        if not -n <= i < n:
            raise IndexError(f"item {i} out of range for {n} items")
        i %= n
        x, s = self.index, self.index.shard[i]
        text, codes = self._text_arrays[s], self._code_arrays[s]
        if i in x.turns:
            return PreparedItem(
                id=self.ids[i],
                text=self.texts[i],
                text_tokens=np.zeros(0, dtype=np.int64),
                audio_codes=np.zeros((0, self.num_streams), dtype=np.int64),
                seconds=float(x.seconds[i]),
                turns=decode_turns(x.turns[i], text, codes),
                wave=self.wave(i),
            )
        t0, a0 = x.text_off[i], x.audio_off[i]
        return PreparedItem(
            id=self.ids[i],
            text=self.texts[i],
            text_tokens=np.array(text[t0 : t0 + x.text_len[i]], dtype=np.int64),
            audio_codes=np.array(codes[a0 : a0 + x.audio_frames[i]], dtype=np.int64),
            seconds=float(x.seconds[i]),
            wave=self.wave(i),
        )
