"""Audio datasets saved with HF ``datasets`` (``save_to_disk``) as a ``torchtitan prepare`` source.

``datasets`` >= 4 decodes its ``Audio`` feature with torchcodec (which needs FFmpeg and a
matching torch build), so this module never lets ``datasets`` decode: it reads the column's
stored Arrow struct ``{"bytes", "path"}`` directly and decodes the bytes (or the file) with
soundfile, like every other source. A column of plain ``{"array", "sampling_rate"}`` structs
is also accepted. Workers open the dataset themselves (memory-mapped Arrow, cheap) and read the
rows they encode, so audio bytes never travel between processes.

Speakers: ``--speaker-column NAME`` (strings or integers; None = unlabelled); by default the
``speaker_id`` column, else the ``speaker`` column, if the dataset has one (LibriTTS, VCTK and
Common Voice exports name it so); ``--speaker-column none``: no speakers.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np

from torchtitan_speechlm.prepare.items import AudioRef, ManifestError, ManifestItem, speaker_label
from torchtitan_speechlm.prepare.sources.base import (
    PrepareSource,
    SourceOption,
    SourceRead,
    register_source,
)
from torchtitan_speechlm.prepare.sources.unique import (
    KeyHashes,
    duplicates_first,
    refuse_repeated_id,
)
from torchtitan_speechlm.prepare.spill import SpilledItems
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


SPEAKER_COLUMNS = ("speaker_id", "speaker")  # the default speaker column: the first one present
NO_SPEAKERS = "none"


def speaker_column_of(columns: list[str], speaker_column: str | None, where: str) -> str | None:
    """The column speakers are read from (None: no speakers): ``speaker_column`` itself (a
    ManifestError if the dataset lacks it), ``"none"``, or by default the first of
    ``SPEAKER_COLUMNS`` the dataset has."""
    if speaker_column is None:
        return next((c for c in SPEAKER_COLUMNS if c in columns), None)
    if speaker_column == NO_SPEAKERS:
        return None
    if speaker_column not in columns:
        raise ManifestError(
            f"{where}: no speaker column {speaker_column!r} (columns: {columns}); pass "
            f"--speaker-column NAME, or {NO_SPEAKERS} for no speakers"
        )
    return speaker_column


BATCH = 4096  # rows turned into Python objects at a time (the Arrow table is memory-mapped)


def read_hf_items(
    path: str,
    audio_column: str = "audio",
    text_column: str | None = "text",
    split: str | None = None,
    speaker_column: str | None = None,
    items=None,
):
    """One item per row; ids come from an ``id`` column if there is one, else ``row-N``;
    speakers from ``speaker_column_of(columns, speaker_column)``. ``items``: where they go
    (``append``; default a new list, returned), e.g. a ``SpilledItems``: the columns are read
    ``BATCH`` rows at a time, and the reader keeps 8 bytes per row (a hash of its id)."""
    ds, split = open_hf_dataset(path, split)
    where0 = f"{os.path.abspath(path)}" + (f"[{split}]" if split else "")
    cols = ds.column_names
    if audio_column not in cols:
        raise ManifestError(f"{where0}: no audio column {audio_column!r} (columns: {cols})")
    if text_column is not None and text_column not in cols:
        raise ManifestError(
            f"{where0}: no text column {text_column!r} (columns: {cols}); pass --text-column"
        )
    spk_col = speaker_column_of(cols, speaker_column, where0)
    keep = list(dict.fromkeys(c for c in ("id", text_column, spk_col) if c in cols))
    table = ds.select_columns(keep).with_format("arrow") if keep else None
    items = [] if items is None else items
    ids = KeyHashes()
    reading: list = [None]  # the row being read once its id is hashed (unique.py: pending)
    with duplicates_first(ids, items, _duplicate, lambda: reading[0]):
        for start in range(0, len(ds), BATCH):
            stop = min(start + BATCH, len(ds))
            batch_ids, texts, spks = _columns(table, start, stop, ("id", text_column, spk_col))
            for k, row in enumerate(range(start, stop)):
                item_id = str(batch_ids[k]) if batch_ids is not None else f"row-{row:08d}"
                where = f"{where0}:row {row}"
                ids.add(item_id)
                reading[0] = SimpleNamespace(id=item_id, where=where)
                text = texts[k] if texts is not None else ""
                if text is not None and not isinstance(text, str):
                    raise ManifestError(
                        f"{where}: text must be a string, got {type(text).__name__}"
                    )
                speaker = (
                    speaker_label(spks[k], f"{where}: column {spk_col!r}")
                    if spks is not None
                    else None
                )
                items.append(ManifestItem(item_id, None, text or "", row + 1, where,
                                          ref=AudioRef(row=row), speaker=speaker))  # fmt: skip
                reading[0] = None
    refuse_repeated_id(ids, items, _duplicate)
    return items


def _columns(table, start: int, stop: int, names) -> list[list | None]:
    """Rows ``[start, stop)`` of each named column as Python values (None: no such column)."""
    batch = table[start:stop] if table is not None else None
    return [batch.column(n).to_pylist() if n is not None and n in batch.column_names else None
            for n in names] if batch is not None else [None] * len(names)  # fmt: skip


def _duplicate(later: ManifestItem, first: ManifestItem) -> str:
    return f"{later.where}: duplicate id {later.id!r}"


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
    path: str,
    audio_column: str = "audio",
    text_column: str = "text",
    split: str | None = None,
    speaker_column: str | None = None,
) -> SourceRead:
    # on disk while prepare plans and encodes (prepare/spill.py): O(shards) in memory
    items = read_hf_items(path, audio_column, text_column, split, speaker_column, SpilledItems())
    ds, split = open_hf_dataset(path, split)
    description = {
        "type": "hf_dataset",
        "split": split,
        "audio_column": audio_column,
        "text_column": text_column,
        "fingerprint": getattr(ds, "_fingerprint", None),
    }
    spk_col = speaker_column_of(ds.column_names, speaker_column, path)
    if spk_col is not None:  # (absent without speakers: such plans are unchanged)
        description["speaker_column"] = spk_col
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
            SourceOption(
                "speaker_column",
                None,
                "HF speaker column (default: speaker_id or speaker if present; none: no speakers)",
            ),
        ),
    )
)
