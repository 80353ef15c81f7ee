"""The on-disk contract of a "prepared dataset": text token ids and codec codes, ready for
training. prepare/ writes it and data/ reads it; this module is all they share.

Layout (``FORMAT_VERSION = 2``, described in docs/data.md)::

    metadata.json            codec + tokenizer identity, shard list (each shard's file sizes
                             and sha256), totals (written last)
    plan.json                what ``torchtitan prepare`` was asked to do (for resuming)
    failures.jsonl, summary.json
    shards/NNNNN/items.jsonl       per item: id, kind, [speaker], text, source, offsets, lengths,
                                   seconds, [turns], [preference]
    shards/NNNNN/text_tokens.npy   int32 [shard_text_tokens]
    shards/NNNNN/audio_codes.npy   int16 (int32 if codebook_size > 32767) [shard_frames, num_streams]
    shards/NNNNN/shard.json        format version, codec/tokenizer identity, totals
    shards/NNNNN/columns.npy       the index of items.jsonl as fixed-width columns
                                   (``COLUMN_DTYPE``; absent in datasets prepared before it)
    index/                         written by the first process that opens the dataset (or
                                   ``torchtitan prepare``): every shard's columns concatenated,
                                   one ``.npy`` per column, memory-mapped by every rank
                                   (data/index_store.py)

Shards let several processes write in parallel and let an interrupted run keep what it
finished: each shard directory appears atomically (temp dir + rename). Within a shard, two flat
arrays plus an index keep reads cheap: the reader memory-maps the arrays and slices them, so
opening a dataset costs nothing however large it is.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from torchtitan_speechlm.model.codec_identity import COMPATIBLE, CodecIdentity

FORMAT_VERSION = 2
METADATA = "metadata.json"
SHARDS_DIR = "shards"
SHARD_META = "shard.json"
ITEMS = "items.jsonl"
TEXT_TOKENS = "text_tokens.npy"
AUDIO_CODES = "audio_codes.npy"
TEXT_DTYPE = np.dtype("<i4")
# optional, for a continuous audio encoder (prepare/waveforms.py, docs/audio-encoder.md): each
# shard's items' waveforms, mono int16 at metadata["waveform"]["sample_rate"], one flat array,
# and per item (in items.jsonl order) its offset and length in samples
AUDIO_WAVE = "audio_wave.npy"
WAVE_INDEX = "waves.jsonl"
WAVE_DTYPE = np.dtype("<i2")


def to_int16(wav: np.ndarray) -> np.ndarray:
    """A float waveform in [-1, 1] as the stored int16 samples (rounded, clipped)."""
    return np.clip(np.round(np.asarray(wav, np.float32) * 32767.0), -32768, 32767).astype(
        WAVE_DTYPE
    )


# optional items.jsonl key (format 2 as before: readers that do not know it ignore it): the
# speaker the source named for the item. An item without it is unlabelled: its own speaker.
SPEAKER = "speaker"

INDEX_COLUMNS = ("text_offset", "text_len", "audio_offset", "audio_frames", "seconds")
# what an item holds (items.jsonl "kind"); "preference": a prompt turn and two answer turns,
# chosen and rejected (prepare/sources/preference.py), its record under items.jsonl "preference"
KINDS = ("speech", "text", "audio", "dialogue", "preference")
TURN_KINDS = ("dialogue", "preference")  # the kinds whose content is their turns
PREFERENCE = "preference"
ROLES = ("system", "user", "assistant")  # dialogue turn roles
MODALITIES = ("text", "audio")
# the binary index of a shard (``COLUMNS``): per item of items.jsonl, in its order, fixed-width
# columns a reader memory-maps instead of parsing JSON: the offsets and lengths, the seconds,
# ``kind`` (a code of ``KINDS``), the dialogue turn counts, whether the source named a speaker,
# ``line`` (the byte offset of the item's line in items.jsonl: ids, texts, turns and speakers
# are read from there, lazily) and ``id_hash`` (``id_hash(id)``: the validation hold-out)
COLUMNS = "columns.npy"
COLUMN_DTYPE = np.dtype([
    ("text_offset", "<i8"), ("text_len", "<i4"), ("audio_offset", "<i8"),
    ("audio_frames", "<i4"), ("seconds", "<f8"), ("line", "<i8"), ("id_hash", "<u4"),
    ("turns", "<u2"), ("audio_turns", "<u2"), ("kind", "u1"), ("labelled", "u1"),
])  # fmt: skip


def id_hash(item_id: str) -> int:
    """The first 32 bits of sha256(id): the validation hold-out's hash (``catalog.py``)."""
    return int(hashlib.sha256(item_id.encode()).hexdigest()[:8], 16)


def column_row(row: dict, line_offset: int) -> tuple:
    """One ``COLUMN_DTYPE`` record of an items.jsonl row (a dict) at byte ``line_offset``."""
    turns = row.get("turns") or ()
    return (
        int(row["text_offset"]), int(row["text_len"]), int(row["audio_offset"]),
        int(row["audio_frames"]), float(row["seconds"]), line_offset, id_hash(str(row["id"])),
        len(turns), sum(t["modality"] == "audio" for t in turns), KINDS.index(row["kind"]),
        row.get(SPEAKER) is not None,
    )  # fmt: skip


REGENERATE = "re-create it with `torchtitan prepare` (see docs/data.md)"
CODEC_COMPAT_KEYS = COMPATIBLE  # model/codec_identity.py: what must agree for codes to mix


class CorruptDatasetError(ValueError):
    """A prepared dataset is missing, incomplete or inconsistent; the message names the file."""


class ShardMismatchError(CorruptDatasetError):
    """A shard was written with another codec layout or tokenizer than ``metadata.json`` says."""


def codes_dtype(codebook_size: int) -> np.dtype:
    return np.dtype("<i2") if codebook_size <= 32767 else np.dtype("<i4")


def shard_name(index: int) -> str:
    return f"{index:05d}"


@dataclass
class Turn:
    """One dialogue turn: ``tokens`` is int64 [L] text ids or int64 [F, N] codec codes."""

    role: str  # system | user | assistant
    modality: str  # text | audio
    tokens: np.ndarray
    text: str = ""  # the turn's text (text turns only)


@dataclass
class PreparedItem:
    id: str
    text: str
    text_tokens: np.ndarray  # int64 [L]; empty for dialogue items (see turns)
    audio_codes: np.ndarray  # int64 [F, N]; empty for text-only and dialogue items
    seconds: float
    turns: list[Turn] | None = None  # dialogue items only
    wave: np.ndarray | None = None  # int16 [samples] where the dataset carries waveforms


def speaker_summary(labelled: dict[str, int], unlabelled: int) -> dict:
    """The ``speakers`` entry of summary.json (and of metadata.json when the source named
    speakers): ``labelled`` = utterances of each speaker the source named, ``unlabelled`` =
    items without a speaker, each counted as its own speaker with one utterance."""
    counts = np.sort(np.array([*labelled.values(), *([1] * unlabelled)], dtype=np.int64))
    median = float(np.median(counts)) if counts.size else 0.0
    return {
        "count": int(counts.size),
        "labelled": len(labelled),
        "unlabelled_items": int(unlabelled),
        "utterances_min": int(counts[0]) if counts.size else 0,
        "utterances_median": int(median) if median.is_integer() else median,
        "utterances_max": int(counts[-1]) if counts.size else 0,
        "single_utterance": int((counts == 1).sum()),
    }


def codec_of(meta: dict) -> CodecIdentity:
    """The codec a metadata.json, shard.json or plan.json records (its ``codec`` entry): the one
    place that entry is read."""
    return CodecIdentity.from_dict(meta.get("codec"))


def first_difference(a: dict, b: dict) -> str | None:
    """Name (``codec.<key>`` / ``tokenizer.hash``) of the first codec-layout or tokenizer key
    where two metadata dicts differ, or None."""
    key = codec_of(a).difference(codec_of(b), CODEC_COMPAT_KEYS)
    if key is not None:
        return f"codec.{key}"
    if a.get("tokenizer", {}).get("hash") != b.get("tokenizer", {}).get("hash"):
        return "tokenizer.hash"
    return None


def metadata_value(meta: dict, dotted: str):
    """``metadata_value(meta, "codec.name")``: a value of a metadata dict by its dotted key."""
    section, key = dotted.split(".")
    if section == "codec":
        return codec_of(meta).value_of(key)
    return meta.get(section, {}).get(key)


def check_compatible(meta_a: dict, meta_b: dict) -> None:
    """Raise ``ValueError`` naming the first key where two datasets' codec layout or tokenizer differ."""
    key = first_difference(meta_a, meta_b)
    if key is not None:
        raise ValueError(
            f"prepared datasets are incompatible: {key} differs "
            f"({metadata_value(meta_a, key)!r} vs {metadata_value(meta_b, key)!r})"
        )


# what metadata.json fingerprints (shard.json is checked field by field against metadata.json,
# which gives a better message: the codec or tokenizer key that differs)
SHARD_FILES = (ITEMS, TEXT_TOKENS, AUDIO_CODES, COLUMNS)  # COLUMNS: where the shard has it


def file_digest(path: str) -> str:
    """sha256 of a file's bytes (hex), read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint_shard(shard_dir: str) -> dict:
    """``{file: {"bytes": n, "sha256": hex}}`` of a finished shard, recorded in metadata.json
    so that a shard truncated or modified afterwards is refused when it is opened."""
    return {
        name: {
            "bytes": os.path.getsize(os.path.join(shard_dir, name)),
            "sha256": file_digest(os.path.join(shard_dir, name)),
        }
        for name in SHARD_FILES
        if name != COLUMNS or os.path.isfile(os.path.join(shard_dir, name))
    }


def check_shard_files(shard_dir: str, files: dict, checksums: bool) -> None:
    """Refuse a shard whose files differ from what metadata.json recorded: a missing file, a
    size change (truncated, appended) always; a content change too with ``checksums``."""
    for name, want in files.items():
        path = os.path.join(shard_dir, name)
        if not os.path.isfile(path):
            raise CorruptDatasetError(f"{path} is missing; {REGENERATE}")
        check_recorded(path, want, checksums)


def check_recorded(path: str, want: dict, checksums: bool, name: str | None = None) -> None:
    """Refuse the file ``path`` if its size (with ``checksums``: its sha256) is not the one
    metadata.json recorded in ``want``; ``name``: what the message calls it (a URL it was
    fetched from; default the path)."""
    name = name or path
    size = os.path.getsize(path)
    if size != want.get("bytes"):
        raise CorruptDatasetError(
            f"{name} has {size} bytes but metadata.json recorded {want.get('bytes')} "
            f"(truncated or modified after the dataset was prepared); {REGENERATE}"
        )
    if checksums and want.get("sha256") and file_digest(path) != want["sha256"]:
        raise CorruptDatasetError(
            f"{name} was modified after metadata.json was written (its sha256 differs from "
            f"the recorded one); {REGENERATE}, or set speechlm_data.verify_shards = "
            '"size" only if you changed it on purpose and know it is consistent'
        )


_PARSED: dict[int, tuple[bytes, dict]] = {}  # metadata.json files parsed by this process


def parse_metadata(data: bytes) -> dict:
    """``json.loads`` of a metadata.json's bytes, parsed once per process (the catalog, the
    reader and the pre-start checks each read it; at 10^4 shards it is megabytes). The dict is
    shared: callers copy what they change. Raises ``ValueError`` for bad JSON."""
    key = hash(data)
    got = _PARSED.get(key)
    if got is None or got[0] != data:
        if len(_PARSED) >= 4:
            _PARSED.pop(next(iter(_PARSED)))
        got = _PARSED[key] = (data, loads_paused(data))
    return got[1]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused: a metadata.json of 10^4 shards makes ~3x10^5
    objects, and every collection they trigger walks the millions that torch and transformers
    hold (its ``json.loads`` takes 0.34 s instead of 0.05 s in a training process). Only for
    code that makes no cycles (JSON, dicts of shard records)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def loads_paused(data: bytes) -> dict:
    """``json.loads`` under ``gc_paused``."""
    with gc_paused():
        return json.loads(data)


def read_json(path: str, what: str = "") -> dict:
    if not os.path.isfile(path):
        raise CorruptDatasetError(f"{path} is missing{what}; {REGENERATE}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, OSError) as e:
        raise CorruptDatasetError(f"{path} is not valid JSON ({e}); {REGENERATE}") from e
