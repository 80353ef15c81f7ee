"""Reading prepared datasets at training time: a memory-mapped, validated view of every shard
(the format itself is ``torchtitan_speechlm.data.format``; opening and checking one shard is
``data/shard_files.py``, the index columns ``data/item_index.py``)."""

from __future__ import annotations

import copy
import os

import numpy as np

from torchtitan_speechlm.data.format import (
    FORMAT_VERSION,
    METADATA,
    REGENERATE,
    CorruptDatasetError,
    PreparedItem,
    Turn,
    codec_of,
    gc_paused,
    parse_metadata,
)
from torchtitan_speechlm.data.index_store import LAYOUT, STARTS, open_index
from torchtitan_speechlm.data.item_index import ItemIndex, KindColumn
from torchtitan_speechlm.data.remote import Mirror, RemoteCache, files_of, is_url
from torchtitan_speechlm.data.shard_files import (
    ShardCache,
    read_wave_index,
    recorded_array_sizes,
)
from torchtitan_speechlm.data.speakers import SpeakerTable


def _read_metadata(path: str, meta_path: str) -> bytes:
    """A local dataset's metadata.json bytes; a missing folder or file says what to do."""
    if not os.path.isdir(path):
        raise CorruptDatasetError(
            f"prepared dataset {path} not found; create it with `torchtitan prepare`"
        )
    if not os.path.isfile(meta_path):
        raise CorruptDatasetError(
            f"{meta_path} is missing (unfinished or not a prepared dataset); {REGENERATE}"
        )
    with open(meta_path, "rb") as f:
        return f.read()


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
    in the order ``metadata.json`` lists them, which is input order. The index is mapped from
    the dataset's ``index/`` folder (data/index_store.py: built by the first open); shards are
    opened when first read, at most ``shard_cache`` at a time (data/shard_files.py).
    """

    def __init__(self, path: str, verify: str = "size", shard_cache: int | None = None,
                 remote: RemoteCache | None = None):  # fmt: skip
        """``verify``: what is checked against the file sizes and sha256s that metadata.json
        recorded for each shard: ``"size"`` (cheap: truncated or appended files; every open),
        ``"full"`` (also the checksums: any modification; reads every byte once per dataset,
        then recorded in its index), ``"none"``. ``path`` may be an fsspec URL (``s3://...``):
        the dataset is then read through a local mirror (data/remote.py; ``remote``: where
        and how large)."""
        self.verify = verify
        self.mirror = Mirror(path, remote) if is_url(path) else None
        if self.mirror is not None:
            self.source = self.mirror.url  # what messages name
            self.path = self.mirror.root
            meta_path = f"{self.source}/{METADATA}"
            meta_bytes = self.mirror.metadata()
        else:
            self.source = self.path = os.path.abspath(path)
            meta_path = os.path.join(self.path, METADATA)
            meta_bytes = _read_metadata(self.path, meta_path)
        try:
            parsed = parse_metadata(meta_bytes)  # shared: copied (its shards' records below)
            self.metadata: dict = copy.deepcopy({k: v for k, v in parsed.items() if k != "shards"})
            self.metadata["shards"] = parsed.get("shards", [])
        except ValueError as e:
            raise CorruptDatasetError(f"{meta_path} is not valid JSON ({e}); {REGENERATE}") from e
        version = self.metadata.get("format_version")
        if version != FORMAT_VERSION:
            raise CorruptDatasetError(
                f"{meta_path}: format_version {version!r} is not supported (this code reads "
                f"{FORMAT_VERSION}); {REGENERATE} with this version of torchtitan_speechlm"
            )
        self.codec = codec_of(self.metadata)  # model/codec_identity.py
        self.num_streams = self.codec.num_streams
        fetch = None
        if self.mirror is not None:
            self.mirror.index_files(self.metadata, sizes=verify != "none")
            fetch = self._fetcher([(files_of(self.metadata, e), str(e.get("name")))
                                   for e in self.metadata.get("shards", [])])  # fmt: skip
        columns, self.index_info = open_index(
            self.path, self.metadata, meta_bytes, verify, remote=self.mirror is not None
        )
        starts, layout = columns.pop(STARTS), columns.pop(LAYOUT)
        # checked: their records of files (sha256s) are not kept, only the arrays' sizes,
        # which each shard's first open checks (ShardCache)
        entries = self.metadata.get("shards", [])
        with gc_paused():
            sizes = recorded_array_sizes(entries)
            self.metadata["shards"] = [{k: v for k, v in e.items() if k != "files"}
                                       for e in entries]  # fmt: skip
        self.waveform: dict | None = self.metadata.get("waveform")
        self.shards = ShardCache(self.path, self.metadata, columns, starts, shard_cache,
                                 waves=bool(self.waveform), fetch=fetch, layout=layout,
                                 sizes=sizes)  # fmt: skip
        self.index = ItemIndex(columns, starts, self.shards.path)
        self.ids = self.index.ids  # read lazily (data/item_index.py)
        self.texts = self.index.texts
        if self.metadata.get("num_items") != len(self.index):
            raise CorruptDatasetError(
                f"{meta_path} says {self.metadata.get('num_items')} items but its shards hold "
                f"{len(self.index)}; {REGENERATE}"
            )
        self._wave_index = np.zeros((0, 2), dtype=np.int64)  # per item: offset, samples
        if self.waveform:
            self._open_waves()

    def _fetcher(self, shards: list[tuple[dict, str]]):
        """For a mirrored dataset: ``fetch(s, keep)`` puts shard s's arrays in the mirror,
        checked against ``shards[s]``'s recorded files (sizes, sha256s), sparing the open shard
        folders ``keep`` from eviction."""
        mirror, checksums = self.mirror, self.verify == "full"

        def fetch(s: int, keep: list[str]) -> None:
            files, name = shards[s]
            mirror.shard_arrays(files, name, checksums,
                                [os.path.relpath(k, mirror.root) for k in keep])  # fmt: skip

        return fetch

    @property
    def shard_paths(self) -> list[str]:
        return [self.shards.path(s) for s in range(self.index.num_shards)]

    def _open_waves(self) -> None:
        """Every shard's waveform index, checked against metadata.json's record and the items."""
        rows = [np.zeros((0, 2), dtype=np.int64)]
        for s, entry in enumerate(self.metadata["shards"]):
            files = self.waveform.get("files", {}).get(str(entry.get("name")))
            ids = [str(r["id"]) for r in self.index.shard_rows(s)]
            # mirrored: the URL's listing checked the files' sizes, and the arrays come when the
            # shard is read (checked then); the samples indexed are not bounded here
            verify, wave_len = (
                ("none", np.iinfo(np.int64).max) if self.mirror else (self.verify, None)
            )
            rows.append(read_wave_index(
                self.shards.path(s), files, verify, ids, self.index.shard_items(s)[1], wave_len
            ))  # fmt: skip
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
    def kinds(self) -> KindColumn:
        """Per item: "speech" (text + audio), "text", "audio" or "dialogue" (``kinds.codes``:
        uint8 indices into ``format.KINDS``, memory-mapped)."""
        return self.index.kinds

    @property
    def kind_codes(self) -> np.ndarray:
        """uint8 [items]: each item's kind as an index into ``format.KINDS``."""
        return self.index.kind_codes

    @property
    def id_hashes(self) -> np.ndarray:
        """uint32 [items]: ``format.id_hash`` of each item's id (the validation hold-out)."""
        return self.index.id_hash

    @property
    def num_turns(self) -> np.ndarray:
        """Turns per dialogue item (0 for other kinds), from the index: for length budgeting."""
        return np.asarray(self.index.columns["turns"], dtype=np.int64)

    @property
    def num_audio_turns(self) -> np.ndarray:
        """Audio turns per dialogue item (0 for other kinds), from the index."""
        return np.asarray(self.index.columns["audio_turns"], dtype=np.int64)

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
        return np.array(self.shards.get(self.index.shard_of(i)).wave[off : off + n])

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> PreparedItem:
        n = len(self.index)
        if not -n <= i < n:
            raise IndexError(f"item {i} out of range for {n} items")
        i = int(i) % n
        x = self.index
        shard = self.shards.get(x.shard_of(i))
        row = x.row(i)  # its items.jsonl line: id, text (and a dialogue's turns)
        item_id, text = str(row["id"]), str(row["text"])
        if x.is_dialogue(i):
            turns = [{k: t[k] for k in ("role", "modality", "offset", "length", "text")}
                     for t in row["turns"]]  # fmt: skip
            return PreparedItem(
                id=item_id,
                text=text,
                text_tokens=np.zeros(0, dtype=np.int64),
                audio_codes=np.zeros((0, self.num_streams), dtype=np.int64),
                seconds=float(x.seconds[i]),
                turns=decode_turns(turns, shard.text, shard.codes),
                wave=self.wave(i),
            )
        t0, a0 = int(x.text_off[i]), int(x.audio_off[i])
        return PreparedItem(
            id=item_id,
            text=text,
            text_tokens=np.array(shard.text[t0 : t0 + int(x.text_len[i])], dtype=np.int64),
            audio_codes=np.array(shard.codes[a0 : a0 + int(x.audio_frames[i])], dtype=np.int64),
            seconds=float(x.seconds[i]),
            wave=self.wave(i),
        )
