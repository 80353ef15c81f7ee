"""The on-disk "prepared dataset": text token ids and codec codes, ready for training.

Layout (``FORMAT_VERSION = 1``, described in docs/data.md)::

    metadata.json     codec + tokenizer identity and totals
    items.jsonl       per item: id, text, text_offset, text_len, audio_offset, audio_frames, seconds
    text_tokens.npy   int32 [total_text_tokens], all items concatenated
    audio_codes.npy   int16 (int32 if codebook_size > 32767) [total_frames, num_streams]

Two flat arrays plus an index keep reads cheap: the training loader memory-maps the arrays and
slices them, so opening a dataset costs nothing however large it is. The writer streams to raw
files and only adds the ``.npy`` headers at the end, so it never holds the corpus in memory.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import numpy as np

FORMAT_VERSION = 1
METADATA = "metadata.json"
ITEMS = "items.jsonl"
TEXT_TOKENS = "text_tokens.npy"
AUDIO_CODES = "audio_codes.npy"
TEXT_DTYPE = np.dtype("<i4")
_INDEX_COLUMNS = ("text_offset", "text_len", "audio_offset", "audio_frames", "seconds")
_REGENERATE = "re-create it with `torchtitan prepare` (see docs/data.md)"


class CorruptDatasetError(ValueError):
    """A prepared dataset is missing, incomplete or inconsistent; the message names the file."""


def codes_dtype(codebook_size: int) -> np.dtype:
    return np.dtype("<i2") if codebook_size <= 32767 else np.dtype("<i4")


@dataclass
class PreparedItem:
    id: str
    text: str
    text_tokens: np.ndarray  # int64 [L]
    audio_codes: np.ndarray  # int64 [F, N]
    seconds: float


class PreparedWriter:
    """Append items to a new prepared dataset in ``path``, then :meth:`finish` it."""

    def __init__(self, path: str, codec_meta: dict, tokenizer_meta: dict):
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.codec_meta = codec_meta
        self.tokenizer_meta = tokenizer_meta
        self.num_streams = int(codec_meta["num_streams"])
        self.codebook_size = int(codec_meta["codebook_size"])
        self.codes_dtype = codes_dtype(self.codebook_size)
        self._items = open(os.path.join(path, ITEMS), "w", encoding="utf-8")
        self._text_raw = open(os.path.join(path, TEXT_TOKENS + ".raw"), "wb")
        self._codes_raw = open(os.path.join(path, AUDIO_CODES + ".raw"), "wb")
        self.num_items = self.total_text_tokens = self.total_frames = 0
        self.total_audio_seconds = 0.0

    def add(
        self, item_id: str, text: str, text_tokens, audio_codes: np.ndarray, seconds: float
    ) -> None:
        tokens = np.asarray(text_tokens, dtype=np.int64)
        codes = np.asarray(audio_codes)
        if codes.ndim != 2 or codes.shape[1] != self.num_streams:
            raise ValueError(
                f"{item_id}: codes shape {codes.shape}, expected [frames, {self.num_streams}]"
            )
        if codes.size and (codes.min() < 0 or codes.max() >= self.codebook_size):
            raise ValueError(f"{item_id}: codes outside [0, {self.codebook_size})")
        if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(TEXT_DTYPE).max):
            raise ValueError(f"{item_id}: token ids do not fit int32")
        self._text_raw.write(tokens.astype(TEXT_DTYPE).tobytes())
        self._codes_raw.write(np.ascontiguousarray(codes, dtype=self.codes_dtype).tobytes())
        row = {
            "id": item_id,
            "text": text,
            "text_offset": self.total_text_tokens,
            "text_len": int(tokens.size),
            "audio_offset": self.total_frames,
            "audio_frames": int(codes.shape[0]),
            "seconds": round(float(seconds), 6),
        }
        self._items.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.num_items += 1
        self.total_text_tokens += int(tokens.size)
        self.total_frames += int(codes.shape[0])
        self.total_audio_seconds += float(seconds)

    def finish(self) -> dict:
        """Close the files, write the ``.npy`` arrays and ``metadata.json`` (last); return it."""
        for f in (self._items, self._text_raw, self._codes_raw):
            f.close()
        _raw_to_npy(os.path.join(self.path, TEXT_TOKENS), TEXT_DTYPE, (self.total_text_tokens,))
        _raw_to_npy(
            os.path.join(self.path, AUDIO_CODES),
            self.codes_dtype,
            (self.total_frames, self.num_streams),
        )
        meta = {
            "format_version": FORMAT_VERSION,
            "codec": self.codec_meta,
            "tokenizer": self.tokenizer_meta,
            "num_items": self.num_items,
            "total_audio_seconds": round(self.total_audio_seconds, 3),
            "total_text_tokens": self.total_text_tokens,
            "total_frames": self.total_frames,
        }
        with open(os.path.join(self.path, METADATA), "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        return meta

    def close(self) -> None:
        """Close open files without finishing (on failure)."""
        for f in (self._items, self._text_raw, self._codes_raw):
            f.close()


def _raw_to_npy(npy_path: str, dtype: np.dtype, shape: tuple) -> None:
    """Prepend an .npy header to the raw little-endian data in ``npy_path + '.raw'``."""
    raw = npy_path + ".raw"
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    with open(npy_path, "wb") as out, open(raw, "rb") as src:
        np.lib.format.write_array_header_1_0(out, header)
        shutil.copyfileobj(src, out, 16 << 20)
    os.remove(raw)


def _open_array(path: str, dtype_kinds: str, ndim: int) -> np.ndarray:
    if not os.path.isfile(path):
        raise CorruptDatasetError(f"{path} is missing; {_REGENERATE}")
    try:
        arr = np.load(path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:
        raise CorruptDatasetError(f"{path} is unreadable or truncated ({e}); {_REGENERATE}") from e
    if arr.ndim != ndim or arr.dtype.kind not in dtype_kinds:
        raise CorruptDatasetError(f"{path} has shape {arr.shape} dtype {arr.dtype}; {_REGENERATE}")
    return arr


class PreparedDataset:
    """Read-only, memory-mapped view of a prepared dataset; validates it on open."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        meta_path = os.path.join(self.path, METADATA)
        if not os.path.isdir(self.path):
            raise CorruptDatasetError(
                f"prepared dataset {self.path} not found; create it with `torchtitan prepare`"
            )
        if not os.path.isfile(meta_path):
            raise CorruptDatasetError(
                f"{meta_path} is missing (unfinished or not a prepared dataset); {_REGENERATE}"
            )
        try:
            with open(meta_path) as f:
                self.metadata: dict = json.load(f)
        except (ValueError, OSError) as e:
            raise CorruptDatasetError(f"{meta_path} is not valid JSON ({e}); {_REGENERATE}") from e
        version = self.metadata.get("format_version")
        if version != FORMAT_VERSION:
            raise CorruptDatasetError(
                f"{meta_path}: format_version {version!r} is not supported (this code reads "
                f"{FORMAT_VERSION}); {_REGENERATE} with this version of torchtitan_speechlm"
            )
        self._read_index(os.path.join(self.path, ITEMS))
        self.text_tokens = _open_array(os.path.join(self.path, TEXT_TOKENS), "i", 1)
        self.audio_codes = _open_array(os.path.join(self.path, AUDIO_CODES), "i", 2)
        self._validate()

    def _read_index(self, items_path: str) -> None:
        if not os.path.isfile(items_path):
            raise CorruptDatasetError(f"{items_path} is missing; {_REGENERATE}")
        self.ids: list[str] = []
        self.texts: list[str] = []
        cols: list[tuple] = []
        with open(items_path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                try:
                    r = json.loads(line)
                    cols.append(tuple(r[k] for k in _INDEX_COLUMNS))
                    self.ids.append(str(r["id"]))
                    self.texts.append(str(r["text"]))
                except (ValueError, KeyError, TypeError) as e:
                    raise CorruptDatasetError(
                        f"{items_path}:{lineno}: bad index line ({e}); {_REGENERATE}"
                    ) from e
        idx = np.asarray(cols, dtype=np.float64).reshape(-1, 5)
        self._seconds = idx[:, 4]
        self._text_off, self._text_len, self._audio_off, self._audio_frames = (
            idx[:, :4].astype(np.int64).T
        )

    def _validate(self) -> None:
        m, n = self.metadata, len(self.ids)
        items_path = os.path.join(self.path, ITEMS)
        if m.get("num_items") != n:
            raise CorruptDatasetError(
                f"{items_path} has {n} items, metadata says {m.get('num_items')}; {_REGENERATE}"
            )
        checks = [
            (
                TEXT_TOKENS,
                self.text_tokens.shape[0],
                m.get("total_text_tokens"),
                self._text_off,
                self._text_len,
            ),
            (
                AUDIO_CODES,
                self.audio_codes.shape[0],
                m.get("total_frames"),
                self._audio_off,
                self._audio_frames,
            ),
        ]
        for name, have, want, off, length in checks:
            file = os.path.join(self.path, name)
            if have != want:
                raise CorruptDatasetError(
                    f"{file} has {have} rows, metadata says {want}; {_REGENERATE}"
                )
            if n and ((off < 0).any() or (length < 0).any() or (off + length > have).any()):
                raise CorruptDatasetError(
                    f"{file}: {items_path} points past its {have} rows; {_REGENERATE}"
                )
        streams = m.get("codec", {}).get("num_streams")
        if self.audio_codes.shape[1] != streams:
            raise CorruptDatasetError(
                f"{os.path.join(self.path, AUDIO_CODES)} has {self.audio_codes.shape[1]} streams, "
                f"metadata says {streams}; {_REGENERATE}"
            )

    @property
    def text_lengths(self) -> np.ndarray:
        """Text tokens per item, from the index (no array is read)."""
        return self._text_len

    @property
    def audio_lengths(self) -> np.ndarray:
        """Audio frames per item, from the index (no array is read)."""
        return self._audio_frames

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> PreparedItem:
        n = len(self.ids)
        if not -n <= i < n:
            raise IndexError(f"item {i} out of range for {n} items")
        i %= n
        t0, a0 = self._text_off[i], self._audio_off[i]
        return PreparedItem(
            id=self.ids[i],
            text=self.texts[i],
            text_tokens=np.array(self.text_tokens[t0 : t0 + self._text_len[i]], dtype=np.int64),
            audio_codes=np.array(self.audio_codes[a0 : a0 + self._audio_frames[i]], dtype=np.int64),
            seconds=float(self._seconds[i]),
        )


CODEC_COMPAT_KEYS = ("name", "num_streams", "codebook_size", "config_hash", "frame_rate")


def check_compatible(meta_a: dict, meta_b: dict) -> None:
    """Raise ``ValueError`` naming the first key where two datasets' codec layout or tokenizer differ."""
    for key in CODEC_COMPAT_KEYS:
        a, b = meta_a.get("codec", {}).get(key), meta_b.get("codec", {}).get(key)
        if a != b:
            raise ValueError(
                f"prepared datasets are incompatible: codec.{key} differs ({a!r} vs {b!r})"
            )
    a, b = meta_a.get("tokenizer", {}).get("hash"), meta_b.get("tokenizer", {}).get("hash")
    if a != b:
        raise ValueError(
            f"prepared datasets are incompatible: tokenizer.hash differs ({a!r} vs {b!r})"
        )
