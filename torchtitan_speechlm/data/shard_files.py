"""Opening one shard of a prepared dataset for reading: its files checked against the sizes (and
sha256s) ``metadata.json`` recorded, its ``shard.json`` against the dataset's codec and tokenizer,
its index against its arrays, the arrays memory-mapped. Every problem is a
``CorruptDatasetError`` naming the file, so a broken dataset fails on open, not mid-run."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from torchtitan_speechlm.data.format import (
    AUDIO_CODES,
    AUDIO_WAVE,
    FORMAT_VERSION,
    ITEMS,
    METADATA,
    REGENERATE,
    SHARD_META,
    SHARDS_DIR,
    TEXT_TOKENS,
    WAVE_INDEX,
    CorruptDatasetError,
    ShardMismatchError,
    check_shard_files,
    first_difference,
    metadata_value,
    read_json,
)
from torchtitan_speechlm.data.item_index import IndexLines, read_index

WAVE_FIX = "add them again with prepare/waveforms.py"


def open_array(path: str, dtype_kinds: str, ndim: int) -> np.ndarray:
    """``np.load(path, mmap_mode="r")``, refused unless it has ``ndim`` dimensions and a dtype
    kind among ``dtype_kinds``."""
    if not os.path.isfile(path):
        raise CorruptDatasetError(f"{path} is missing; {REGENERATE}")
    try:
        arr = np.load(path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:
        raise CorruptDatasetError(f"{path} is unreadable or truncated ({e}); {REGENERATE}") from e
    if arr.ndim != ndim or arr.dtype.kind not in dtype_kinds:
        raise CorruptDatasetError(f"{path} has shape {arr.shape} dtype {arr.dtype}; {REGENERATE}")
    return arr


@dataclass
class OpenShard:
    """One shard, checked: its folder, index, and memory-mapped text tokens and codes."""

    path: str
    lines: IndexLines
    text: np.ndarray
    codes: np.ndarray


def open_shard(root: str, entry: dict, metadata: dict, verify: str) -> OpenShard:
    """Shard ``entry`` (of ``metadata["shards"]``) of the dataset at ``root``. ``verify``:
    ``"size"``, ``"full"`` (also the sha256s) or ``"none"``: what is checked against the
    files metadata.json recorded."""
    sdir = os.path.join(root, SHARDS_DIR, str(entry.get("name")))
    if not os.path.isdir(sdir):
        raise CorruptDatasetError(f"shard {sdir} is missing; {REGENERATE}")
    if verify != "none" and entry.get("files"):
        check_shard_files(sdir, entry["files"], checksums=verify == "full")
    smeta = _shard_meta(sdir, root, metadata)
    lines = read_index(os.path.join(sdir, ITEMS))
    n = len(lines.rows)
    if not n == smeta.get("num_items") == entry.get("num_items"):
        raise CorruptDatasetError(
            f"shard {sdir}: {ITEMS} has {n} items, shard.json says {smeta.get('num_items')}, "
            f"metadata.json says {entry.get('num_items')}; {REGENERATE}"
        )
    text = open_array(os.path.join(sdir, TEXT_TOKENS), "i", 1)
    codes = open_array(os.path.join(sdir, AUDIO_CODES), "i", 2)
    _check_index_range(sdir, smeta, lines.rows, text, codes)
    num_streams = int(metadata["codec"]["num_streams"])
    if codes.shape[1] != num_streams:
        raise CorruptDatasetError(
            f"{os.path.join(sdir, AUDIO_CODES)} has {codes.shape[1]} streams, metadata says "
            f"{num_streams}; {REGENERATE}"
        )
    return OpenShard(sdir, lines, text, codes)


def _shard_meta(sdir: str, root: str, metadata: dict) -> dict:
    """The shard's ``shard.json``, refused if its format, codec layout or tokenizer is not the
    dataset's (shards of different codecs or tokenizers cannot be mixed)."""
    smeta = read_json(os.path.join(sdir, SHARD_META))
    if smeta.get("format_version") != FORMAT_VERSION:
        raise CorruptDatasetError(
            f"shard {sdir}: format_version {smeta.get('format_version')!r}, expected "
            f"{FORMAT_VERSION}; {REGENERATE}"
        )
    key = first_difference(smeta, metadata)
    if key is not None:
        raise ShardMismatchError(
            f"shard {sdir}: {key} is {metadata_value(smeta, key)!r} but {root}/{METADATA} says "
            f"{metadata_value(metadata, key)!r} (shards from different codecs/tokenizers cannot be "
            f"mixed); {REGENERATE}"
        )
    return smeta


def _check_index_range(
    sdir: str, smeta: dict, rows: np.ndarray, text: np.ndarray, codes: np.ndarray
) -> None:
    """Both arrays have the rows shard.json says, and every index offset lies inside them."""
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
        if len(rows) and ((off < 0).any() or (length < 0).any() or (off + length > have).any()):
            raise CorruptDatasetError(f"{file}: {ITEMS} points past its {have} rows; {REGENERATE}")


def open_waves(
    sdir: str, files: dict | None, verify: str, ids: list[str], first: int, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """A shard's waveforms (prepare/waveforms.py): ``files`` is metadata.json's record of them,
    ``ids[first : first + n]`` the shard's items. Returns the memory-mapped int16 samples and
    each item's [offset, samples]."""
    if files is None:
        raise CorruptDatasetError(f"{sdir}: metadata.json records no waveforms; {WAVE_FIX}")
    if verify != "none":
        check_shard_files(sdir, files, checksums=verify == "full")
    wave = open_array(os.path.join(sdir, AUDIO_WAVE), "i", 1)
    rows = []
    with open(os.path.join(sdir, WAVE_INDEX), encoding="utf-8") as f:
        for k, line in enumerate(f):
            r = json.loads(line)
            if first + k >= len(ids) or r["id"] != ids[first + k]:
                raise CorruptDatasetError(
                    f"{sdir}/{WAVE_INDEX}:{k + 1}: not the shard's item order; {WAVE_FIX}"
                )
            rows.append((int(r["offset"]), int(r["samples"])))
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
    if len(rows) != n or (len(rows) and (rows.sum(1) > len(wave)).any()):
        raise CorruptDatasetError(
            f"{sdir}/{WAVE_INDEX}: does not index the shard's {n} items; {WAVE_FIX}"
        )
    return wave, rows
