"""Reading prepared datasets at training time: a memory-mapped, validated view of every shard
(the format itself is ``torchtitan_speechlm.data.format``)."""

from __future__ import annotations

import json
import os

import numpy as np

from torchtitan_speechlm.data.format import (
    AUDIO_CODES,
    AUDIO_WAVE,
    FORMAT_VERSION,
    INDEX_COLUMNS,
    ITEMS,
    METADATA,
    REGENERATE,
    SHARD_META,
    SHARDS_DIR,
    TEXT_TOKENS,
    WAVE_INDEX,
    CorruptDatasetError,
    PreparedItem,
    ShardMismatchError,
    Turn,
    check_shard_files,
    first_difference,
    metadata_value,
    read_json,
)


def _open_array(path: str, dtype_kinds: str, ndim: int) -> np.ndarray:
    if not os.path.isfile(path):
        raise CorruptDatasetError(f"{path} is missing; {REGENERATE}")
    try:
        arr = np.load(path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:
        raise CorruptDatasetError(f"{path} is unreadable or truncated ({e}); {REGENERATE}") from e
    if arr.ndim != ndim or arr.dtype.kind not in dtype_kinds:
        raise CorruptDatasetError(f"{path} has shape {arr.shape} dtype {arr.dtype}; {REGENERATE}")
    return arr


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
        self.shard_paths: list[str] = []
        self._text_arrays: list[np.ndarray] = []
        self._code_arrays: list[np.ndarray] = []
        self.ids: list[str] = []
        self.texts: list[str] = []
        self._kinds: list[str] = []
        self._turns: dict[int, list[dict]] = {}
        index, shard_of = [], []
        for s, entry in enumerate(self.metadata.get("shards", [])):
            rows = self._open_shard(entry)
            index.append(rows)
            shard_of.append(np.full(len(rows), s, dtype=np.int32))
        idx = np.concatenate(index) if index else np.zeros((0, 5))
        self._shard = np.concatenate(shard_of) if shard_of else np.zeros(0, dtype=np.int32)
        self._seconds = idx[:, 4]
        self._text_off, self._text_len, self._audio_off, self._audio_frames = (
            idx[:, :4].astype(np.int64).T
        )
        self._kinds_array = np.array(self._kinds, dtype="<U8")
        self._num_turns = np.zeros((len(self.ids), 2), dtype=np.int64)  # turns, audio turns
        for i, turns in self._turns.items():
            self._num_turns[i] = (len(turns), sum(t["modality"] == "audio" for t in turns))
        if self.metadata.get("num_items") != len(self.ids):
            raise CorruptDatasetError(
                f"{meta_path} says {self.metadata.get('num_items')} items but its shards hold "
                f"{len(self.ids)}; {REGENERATE}"
            )
        self.waveform: dict | None = self.metadata.get("waveform")
        self._wave_arrays: list[np.ndarray] = []
        self._wave_index = np.zeros((0, 2), dtype=np.int64)  # per item: offset, samples
        if self.waveform:
            self._wave_index = np.concatenate(
                [np.zeros((0, 2), dtype=np.int64)]
                + [self._open_waves(s, e) for s, e in enumerate(self.metadata["shards"])]
            )

    def _open_shard(self, entry: dict) -> np.ndarray:
        sdir = os.path.join(self.path, SHARDS_DIR, str(entry.get("name")))
        if not os.path.isdir(sdir):
            raise CorruptDatasetError(f"shard {sdir} is missing; {REGENERATE}")
        if self.verify != "none" and entry.get("files"):
            check_shard_files(sdir, entry["files"], checksums=self.verify == "full")
        smeta = read_json(os.path.join(sdir, SHARD_META))
        if smeta.get("format_version") != FORMAT_VERSION:
            raise CorruptDatasetError(
                f"shard {sdir}: format_version {smeta.get('format_version')!r}, expected "
                f"{FORMAT_VERSION}; {REGENERATE}"
            )
        key = first_difference(smeta, self.metadata)
        if key is not None:
            raise ShardMismatchError(
                f"shard {sdir}: {key} is {metadata_value(smeta, key)!r} but {self.path}/{METADATA} says "
                f"{metadata_value(self.metadata, key)!r} (shards from different codecs/tokenizers cannot be "
                f"mixed); {REGENERATE}"
            )
        base = len(self.ids)
        rows = self._read_index(os.path.join(sdir, ITEMS), base)
        n = len(rows)
        if not n == smeta.get("num_items") == entry.get("num_items"):
            raise CorruptDatasetError(
                f"shard {sdir}: {ITEMS} has {n} items, shard.json says {smeta.get('num_items')}, "
                f"metadata.json says {entry.get('num_items')}; {REGENERATE}"
            )
        text = _open_array(os.path.join(sdir, TEXT_TOKENS), "i", 1)
        codes = _open_array(os.path.join(sdir, AUDIO_CODES), "i", 2)
        checks = [
            (TEXT_TOKENS, text.shape[0], smeta.get("total_text_tokens"), rows[:, 0], rows[:, 1]),
            (AUDIO_CODES, codes.shape[0], smeta.get("total_frames"), rows[:, 2], rows[:, 3]),
        ]
        for name, have, want, off, length in checks:
            file = os.path.join(sdir, name)
            if have != want:
                raise CorruptDatasetError(
                    f"{file} has {have} rows, shard.json says {want}; {REGENERATE}"
                )
            if n and ((off < 0).any() or (length < 0).any() or (off + length > have).any()):
                raise CorruptDatasetError(
                    f"{file}: {ITEMS} points past its {have} rows; {REGENERATE}"
                )
        if codes.shape[1] != self.num_streams:
            raise CorruptDatasetError(
                f"{os.path.join(sdir, AUDIO_CODES)} has {codes.shape[1]} streams, metadata says "
                f"{self.num_streams}; {REGENERATE}"
            )
        self.shard_paths.append(sdir)
        self._text_arrays.append(text)
        self._code_arrays.append(codes)
        return rows

    def _open_waves(self, s: int, entry: dict) -> np.ndarray:
        """Shard ``s``'s waveforms (prepare/waveforms.py): checked against metadata.json's
        record and the shard's items; returns its items' [offset, samples]."""
        sdir, fix = self.shard_paths[s], "add them again with prepare/waveforms.py"
        files = self.waveform.get("files", {}).get(str(entry.get("name")))
        if files is None:
            raise CorruptDatasetError(f"{sdir}: metadata.json records no waveforms; {fix}")
        if self.verify != "none":
            check_shard_files(sdir, files, checksums=self.verify == "full")
        wave = _open_array(os.path.join(sdir, AUDIO_WAVE), "i", 1)
        first = int(np.searchsorted(self._shard, s))
        rows = []
        with open(os.path.join(sdir, WAVE_INDEX), encoding="utf-8") as f:
            for k, line in enumerate(f):
                r = json.loads(line)
                if first + k >= len(self.ids) or r["id"] != self.ids[first + k]:
                    raise CorruptDatasetError(
                        f"{sdir}/{WAVE_INDEX}:{k + 1}: not the shard's item order; {fix}"
                    )
                rows.append((int(r["offset"]), int(r["samples"])))
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
        n = int((self._shard == s).sum())
        if len(rows) != n or (len(rows) and (rows.sum(1) > len(wave)).any()):
            raise CorruptDatasetError(
                f"{sdir}/{WAVE_INDEX}: does not index the shard's {n} items; {fix}"
            )
        self._wave_arrays.append(wave)
        return rows

    def _read_index(self, items_path: str, base: int) -> np.ndarray:
        if not os.path.isfile(items_path):
            raise CorruptDatasetError(f"{items_path} is missing; {REGENERATE}")
        cols: list[tuple] = []
        with open(items_path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                try:
                    r = json.loads(line)
                    cols.append(tuple(float(r[k]) for k in INDEX_COLUMNS))
                    item_id, text, kind = str(r["id"]), str(r["text"]), str(r["kind"])
                    if "turns" in r:
                        self._turns[base + len(cols) - 1] = [
                            {k: t[k] for k in ("role", "modality", "offset", "length", "text")}
                            for t in r["turns"]
                        ]
                except (ValueError, KeyError, TypeError) as e:
                    raise CorruptDatasetError(
                        f"{items_path}:{lineno}: bad index line ({e}); {REGENERATE}"
                    ) from e
                self.ids.append(item_id)
                self.texts.append(text)
                self._kinds.append(kind)
        return np.asarray(cols, dtype=np.float64).reshape(-1, 5)

    @property
    def text_lengths(self) -> np.ndarray:
        """Text tokens per item (summed over turns for dialogues), from the index."""
        return self._text_len

    @property
    def audio_lengths(self) -> np.ndarray:
        """Audio frames per item (summed over turns for dialogues), from the index."""
        return self._audio_frames

    @property
    def kinds(self) -> np.ndarray:
        """Per item: "speech" (text + audio), "text", "audio" or "dialogue"."""
        return self._kinds_array

    @property
    def num_turns(self) -> np.ndarray:
        """Turns per dialogue item (0 for other kinds), from the index: for length budgeting."""
        return self._num_turns[:, 0]

    @property
    def num_audio_turns(self) -> np.ndarray:
        """Audio turns per dialogue item (0 for other kinds), from the index."""
        return self._num_turns[:, 1]

    @property
    def wave_samples(self) -> np.ndarray | None:
        """Waveform samples per item (datasets with waveforms), else None."""
        return self._wave_index[:, 1] if self.waveform else None

    def wave(self, i: int) -> np.ndarray | None:
        if not self.waveform:
            return None
        off, n = self._wave_index[i]
        return np.array(self._wave_arrays[self._shard[i]][off : off + n])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> PreparedItem:
        n = len(self.ids)
        if not -n <= i < n:
            raise IndexError(f"item {i} out of range for {n} items")
        i %= n
        s = self._shard[i]
        text, codes = self._text_arrays[s], self._code_arrays[s]
        if i in self._turns:
            turns = [
                Turn(
                    t["role"],
                    t["modality"],
                    np.array(
                        (text if t["modality"] == "text" else codes)[
                            t["offset"] : t["offset"] + t["length"]
                        ],
                        dtype=np.int64,
                    ),
                    t["text"],
                )  # fmt: skip
                for t in self._turns[i]
            ]
            return PreparedItem(self.ids[i], self.texts[i], np.zeros(0, dtype=np.int64),
                                np.zeros((0, self.num_streams), dtype=np.int64),
                                float(self._seconds[i]), turns, self.wave(i))  # fmt: skip
        t0, a0 = self._text_off[i], self._audio_off[i]
        return PreparedItem(
            id=self.ids[i],
            text=self.texts[i],
            text_tokens=np.array(text[t0 : t0 + self._text_len[i]], dtype=np.int64),
            audio_codes=np.array(codes[a0 : a0 + self._audio_frames[i]], dtype=np.int64),
            seconds=float(self._seconds[i]),
            wave=self.wave(i),
        )
