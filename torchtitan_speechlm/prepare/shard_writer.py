"""Writing one shard of a prepared dataset (format in :mod:`.prepared` and docs/data.md).

A shard is written into a temporary directory by one worker and renamed into place by the
caller once :meth:`ShardWriter.finish` returns, so a shard directory that exists is complete.
Arrays are streamed to raw files and only get their ``.npy`` headers at the end, so a worker
never holds a whole shard's codes in memory twice.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from torchtitan_speechlm.data.format import (
    AUDIO_CODES,
    COLUMN_DTYPE,
    COLUMNS,
    FORMAT_VERSION,
    ITEMS,
    SHARD_META,
    SPEAKER,
    TEXT_DTYPE,
    TEXT_TOKENS,
    Turn,
    codes_dtype,
    column_row,
)
from torchtitan_speechlm.utils.fileio import write_json_atomic


class ShardWriter:
    """Append items to one new shard directory, then :meth:`finish` it (shard.json last)."""

    def __init__(self, path: str, num_streams: int, codebook_size: int):
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.num_streams, self.codebook_size = int(num_streams), int(codebook_size)
        self.codes_dtype = codes_dtype(self.codebook_size)
        self._items = open(os.path.join(path, ITEMS), "w", encoding="utf-8")
        self._text_raw = open(os.path.join(path, TEXT_TOKENS + ".raw"), "wb")
        self._codes_raw = open(os.path.join(path, AUDIO_CODES + ".raw"), "wb")
        self.num_items = self.total_text_tokens = self.total_frames = 0
        self.total_audio_seconds = 0.0
        self.kinds: dict[str, int] = {}
        self.speakers: dict[str, int] = {}  # utterances of each speaker the source named
        self._columns: list[tuple] = []  # COLUMN_DTYPE rows of the items written
        self._items_bytes = 0  # bytes of items.jsonl written: the next line's offset

    def _put_text(self, item_id: str, tokens) -> tuple[int, int]:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(TEXT_DTYPE).max):
            raise ValueError(f"{item_id}: token ids do not fit int32")
        self._text_raw.write(tokens.astype(TEXT_DTYPE).tobytes())
        off = self.total_text_tokens
        self.total_text_tokens += int(tokens.size)
        return off, int(tokens.size)

    def _put_codes(self, item_id: str, codes) -> tuple[int, int]:
        codes = np.asarray(codes).reshape(-1, self.num_streams) if np.size(codes) == 0 else codes
        if codes.ndim != 2 or codes.shape[1] != self.num_streams:
            raise ValueError(
                f"{item_id}: codes shape {codes.shape}, expected [frames, {self.num_streams}]"
            )
        if codes.size and (codes.min() < 0 or codes.max() >= self.codebook_size):
            raise ValueError(f"{item_id}: codes outside [0, {self.codebook_size})")
        self._codes_raw.write(np.ascontiguousarray(codes, dtype=self.codes_dtype).tobytes())
        off = self.total_frames
        self.total_frames += int(codes.shape[0])
        return off, int(codes.shape[0])

    def add(
        self,
        item_id: str,
        kind: str,
        text: str,
        text_tokens,
        audio_codes,
        seconds: float,
        source: str = "",
        turns: list[Turn] | None = None,
        speaker: str | None = None,
        extra: dict | None = None,
    ) -> None:
        """Append an item. A dialogue passes ``turns`` (and empty tokens/codes); its turns are
        stored back to back, so the item's text/audio ranges cover exactly its turns.
        ``speaker``: the speaker the source named (None: unlabelled, no ``speaker`` key, so
        such items' lines are those of datasets made before speakers existed). ``extra``:
        more keys of the line, written last as they are (``ManifestItem.extra``)."""
        t0, a0 = self.total_text_tokens, self.total_frames
        row_turns = None
        if turns is not None:
            row_turns = []
            for t in turns:
                put = self._put_text if t.modality == "text" else self._put_codes
                off, n = put(item_id, t.tokens)
                row_turns.append({"role": t.role, "modality": t.modality, "offset": off,
                                  "length": n, "text": t.text})  # fmt: skip
        else:
            self._put_text(item_id, text_tokens)
            self._put_codes(item_id, audio_codes)
        row = {"id": item_id, "kind": kind}
        if speaker is not None:
            row[SPEAKER] = speaker
            self.speakers[speaker] = self.speakers.get(speaker, 0) + 1
        row.update({
            "text": text,
            "source": source,
            "text_offset": t0,
            "text_len": self.total_text_tokens - t0,
            "audio_offset": a0,
            "audio_frames": self.total_frames - a0,
            "seconds": round(float(seconds), 6),
        })  # fmt: skip
        if row_turns is not None:
            row["turns"] = row_turns
        clash = sorted(set(extra or ()) & set(row))
        if clash:
            raise ValueError(f"{item_id}: extra keys {clash} would replace the item's own")
        row.update(extra or {})
        line = json.dumps(row, ensure_ascii=False) + "\n"
        self._items.write(line)
        self._columns.append(column_row(row, self._items_bytes))
        self._items_bytes += len(line.encode("utf-8"))
        self.num_items += 1
        self.total_audio_seconds += float(seconds)
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def finish(self, header: dict) -> dict:
        """Write the ``.npy`` arrays, then ``shard.json`` = ``header`` + totals; return it."""
        self.close()
        _raw_to_npy(os.path.join(self.path, TEXT_TOKENS), TEXT_DTYPE, (self.total_text_tokens,))
        _raw_to_npy(os.path.join(self.path, AUDIO_CODES), self.codes_dtype,
                    (self.total_frames, self.num_streams))  # fmt: skip
        # the index as fixed-width columns (data/index_store.py maps them; items.jsonl stays
        # the record of ids, texts and turns)
        np.save(os.path.join(self.path, COLUMNS), np.array(self._columns, dtype=COLUMN_DTYPE))
        meta = dict(header, format_version=FORMAT_VERSION, **self.totals())
        write_json_atomic(os.path.join(self.path, SHARD_META), meta)
        return meta

    def totals(self) -> dict:
        totals = {
            "num_items": self.num_items,
            "total_audio_seconds": round(self.total_audio_seconds, 6),
            "total_text_tokens": self.total_text_tokens,
            "total_frames": self.total_frames,
            "kinds": dict(sorted(self.kinds.items())),
        }
        if self.speakers:  # labelled items only (absent: shard.json as before speakers)
            totals["speakers"] = dict(sorted(self.speakers.items()))
        return totals

    def close(self) -> None:
        """Close open files (also on failure, before the temp dir is removed)."""
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
