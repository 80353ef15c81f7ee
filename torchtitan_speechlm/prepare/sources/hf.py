"""Audio datasets saved with HF ``datasets`` (``save_to_disk``) as a ``torchtitan prepare`` source.

``datasets`` >= 4 decodes its ``Audio`` feature with torchcodec (which needs FFmpeg and a
matching torch build), so this module never lets ``datasets`` decode: it reads the column's
stored Arrow struct ``{"bytes", "path"}`` directly and decodes the bytes (or the file) with
soundfile, like every other source. A column of plain ``{"array", "sampling_rate"}`` structs
is also accepted. Workers open the dataset themselves (memory-mapped Arrow, cheap) and read the
rows they encode, so audio bytes never travel between processes.
"""

from __future__ import annotations

import os

import numpy as np

from torchtitan_speechlm.prepare.items import AudioRef, ManifestError, ManifestItem
from torchtitan_speechlm.prepare.sources.base import (
    PrepareSource,
    SourceOption,
    SourceRead,
    register_source,
)
from torchtitan_speechlm.utils.audio import (
    BadAudioError,
    decode_audio_bytes,
    load_audio,
    to_codec_audio,
)


def open_hf_dataset(path: str, split: str | None = None):
    """``(dataset, split)`` from ``load_from_disk(path)``; a DatasetDict needs ``split`` unless
    it has a single split."""
    from datasets import DatasetDict, load_from_disk

    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"HF dataset directory {path} not found (expected save_to_disk output)"
        )
    try:
        ds = load_from_disk(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{path} is not a dataset saved with save_to_disk ({e})") from e
    if isinstance(ds, DatasetDict):
        splits = list(ds.keys())
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in ds:
            raise ManifestError(
                f"{path}: choose a split with --split (available: {', '.join(splits)})"
            )
        return ds[split], split
    if split is not None:
        raise ManifestError(f"{path} holds a single Dataset (no splits); drop --split {split}")
    return ds, None


def read_hf_items(
    path: str,
    audio_column: str = "audio",
    text_column: str | None = "text",
    split: str | None = None,
) -> list[ManifestItem]:
    """One item per row; ids come from an ``id`` column if there is one, else ``row-N``."""
    ds, split = open_hf_dataset(path, split)
    where0 = f"{os.path.abspath(path)}" + (f"[{split}]" if split else "")
    cols = ds.column_names
    if audio_column not in cols:
        raise ManifestError(f"{where0}: no audio column {audio_column!r} (columns: {cols})")
    if text_column is not None and text_column not in cols:
        raise ManifestError(
            f"{where0}: no text column {text_column!r} (columns: {cols}); pass --text-column"
        )
    keep = [c for c in ("id", text_column) if c in cols]
    table = ds.select_columns(keep).with_format("arrow")[:] if keep else None
    ids = [str(x) for x in table.column("id").to_pylist()] if "id" in keep else None
    texts = table.column(text_column).to_pylist() if text_column in keep else None
    items, seen = [], set()
    for row in range(len(ds)):
        item_id = ids[row] if ids else f"row-{row:08d}"
        where = f"{where0}:row {row}"
        if item_id in seen:
            raise ManifestError(f"{where}: duplicate id {item_id!r}")
        seen.add(item_id)
        text = texts[row] if texts is not None else ""
        if text is not None and not isinstance(text, str):
            raise ManifestError(f"{where}: text must be a string, got {type(text).__name__}")
        items.append(ManifestItem(item_id, None, text or "", row + 1, where, ref=AudioRef(row=row)))
    return items


class HFAudioReader:
    """Decodes the audio of given rows of an HF dataset without ``datasets``' decoders."""

    def __init__(self, path: str, audio_column: str = "audio", split: str | None = None):
        self.path, self.audio_column, self.split = os.path.abspath(path), audio_column, split
        self._ds = None

    def load(self, row: int, target_sr: int) -> np.ndarray:
        if self._ds is None:
            ds = open_hf_dataset(self.path, self.split)[0].select_columns([self.audio_column])
            self._ds = ds.with_format("arrow")
        name = f"{self.path}:row {row}"
        value = self._ds[row : row + 1].column(0).to_pylist()[0]
        if not isinstance(value, dict):
            raise BadAudioError(name, f"audio cell is {type(value).__name__}, not an Audio struct")
        if value.get("array") is not None:
            return to_codec_audio(np.asarray(value["array"]), int(value["sampling_rate"]),
                                  target_sr, name=name)  # fmt: skip
        if value.get("bytes"):
            return decode_audio_bytes(value["bytes"], target_sr, name)
        path = value.get("path")
        if path:
            if not os.path.isabs(path) and os.path.isfile(os.path.join(self.path, path)):
                path = os.path.join(self.path, path)
            return load_audio(path, target_sr)
        raise BadAudioError(name, "audio cell has neither bytes nor path", "missing_audio")


def _read(
    path: str, audio_column: str = "audio", text_column: str = "text", split: str | None = None
) -> SourceRead:
    items = read_hf_items(path, audio_column, text_column, split)
    ds, split = open_hf_dataset(path, split)
    description = {
        "type": "hf_dataset",
        "split": split,
        "audio_column": audio_column,
        "text_column": text_column,
        "fingerprint": getattr(ds, "_fingerprint", None),
    }
    return SourceRead(items, description, (os.path.abspath(path), audio_column, split))


register_source(
    PrepareSource(
        "hf_dataset",
        "--hf-dataset",
        "DIR",
        "HF datasets folder (save_to_disk)",
        _read,
        options=(
            SourceOption("audio_column", "audio", "HF audio column (default: audio)"),
            SourceOption("text_column", "text", "HF text column (default: text)"),
            SourceOption("split", None, "HF split of a saved DatasetDict"),
        ),
    )
)
