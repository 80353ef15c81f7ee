"""The original recordings of prepared items, where they can still be found.

A prepared dataset holds codec codes, not audio; but each item's row in
``shards/NNNNN/items.jsonl`` records its ``source``: for a JSONL manifest
(``prepare/sources/jsonl.py``) the manifest's absolute path and the item's 1-based line,
``"/abs/path/manifest.jsonl:12"``, whose ``"audio"`` is the recording (relative to the
manifest's folder, or absolute). ``torchtitan eval`` uses that recording as a second reference
beside the codec's resynthesis (``evaluation/tts_scores.py``).

Only that case is resolved: an item whose source is a Kaldi, HF or lhotse input (other
``source`` forms, or ``metadata.json`` naming another source type), a manifest that is gone or
unreadable, a line that is not a JSON object with a string ``audio`` and this item's ``id`` (the
manifest was edited since), or an audio file that no longer exists, has no recording (None):
the evaluation falls back to the resynthesised reference for it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from torchtitan_speechlm.data.format import ITEMS, METADATA, SHARDS_DIR

MANIFEST_SOURCE = "manifest"  # metadata.json's source.type for JSONL manifests


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _shard_items(prepared: str, meta: dict) -> list[str]:
    """The shards' items.jsonl paths, in the order metadata.json lists the shards."""
    names = [str(s.get("name")) for s in meta.get("shards", []) if isinstance(s, dict)]
    if not names:  # no usable list: every shard folder there is
        try:
            names = sorted(os.listdir(os.path.join(prepared, SHARDS_DIR)))
        except OSError:
            names = []
    return [os.path.join(prepared, SHARDS_DIR, n, ITEMS) for n in names]


def item_sources(prepared: str, ids: Iterable[str]) -> dict[str, str]:
    """``{id: source}`` for those of ``ids`` the dataset's items.jsonl files list (each file
    read once, stopping when all are found)."""
    wanted, out = set(ids), {}
    for path in _shard_items(prepared, _read_json(os.path.join(prepared, METADATA))):
        if len(out) == len(wanted):
            break
        try:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(row, dict) and row.get("id") in wanted:
                        if isinstance(row.get("source"), str):
                            out[row["id"]] = row["source"]
        except (OSError, UnicodeDecodeError):
            continue
    return out


def manifest_line(source: str) -> tuple[str, int] | None:
    """``"/abs/manifest.jsonl:12"`` -> (its path, 12); None for any other form."""
    path, sep, line = source.rpartition(":")
    if not sep or not path or not line.isdigit() or int(line) < 1:
        return None
    return path, int(line)


def _read_lines(path: str, numbers: set[int]) -> dict[int, str]:
    """The lines ``numbers`` (1-based) of ``path``, in one pass; {} if it cannot be read."""
    out: dict[int, str] = {}
    if not numbers or not os.path.isfile(path):
        return out
    last = max(numbers)
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if n in numbers:
                    out[n] = line
                if n >= last:
                    break
    except (OSError, UnicodeDecodeError):
        return {}
    return out


def _audio_of(line: str | None, manifest: str, item_id: str) -> str | None:
    if line is None:
        return None
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict) or row.get("id") != item_id or "turns" in row:
        return None
    audio = row.get("audio")
    if not isinstance(audio, str) or not audio:
        return None
    # the same resolution as prepare/sources/jsonl.py: relative to the manifest's folder
    path = os.path.normpath(
        os.path.join(os.path.dirname(os.path.abspath(manifest)), os.path.expanduser(audio))
    )
    return path if os.path.isfile(path) else None


def find_recordings(
    prepared: str, ids: Iterable[str], manifests: dict[str, dict[int, str]] | None = None
) -> dict[str, str | None]:
    """``{id: the original audio file, or None}`` for ``ids`` of the prepared dataset folder
    ``prepared`` (see the module docstring for when it is None). items.jsonl is read once per
    call; each manifest once, keeping only the lines asked for, in ``manifests`` (``{path:
    {line: text}}``): pass the same dict to later calls and lines already read are not read
    again."""
    ids = list(ids)
    out: dict[str, str | None] = dict.fromkeys(ids)
    meta = _read_json(os.path.join(prepared, METADATA))
    kind = (meta.get("source") or {}).get("type") if isinstance(meta.get("source"), dict) else None
    if kind is not None and kind != MANIFEST_SOURCE:
        return out
    where: dict[str, tuple[str, int]] = {}
    for item_id, source in item_sources(prepared, ids).items():
        loc = manifest_line(source)
        if loc is not None:
            where[item_id] = loc
    cache = {} if manifests is None else manifests
    needed: dict[str, set[int]] = {}
    for path, n in where.values():
        if n not in cache.get(path, {}):
            needed.setdefault(path, set()).add(n)
    for path, numbers in needed.items():
        lines = _read_lines(path, numbers)
        cache.setdefault(path, {}).update({n: lines.get(n) for n in numbers})
    for item_id, (path, n) in where.items():
        out[item_id] = _audio_of(cache.get(path, {}).get(n), path, item_id)
    return out
