"""The JSONL manifest source (``--manifest M.jsonl``).

One JSON object per line (docs/data.md has the full description)::

    {"id": "u1", "audio": "wavs/u1.wav", "text": "hello"}        speech (text + audio)
    {"id": "t1", "text": "just text"}                              text only
    {"id": "a1", "audio": "wavs/a1.wav"}                           audio only (--allow-audio-only)
    {"id": "d1", "turns": [{"role": "user", "audio": "q.wav"},
                           {"role": "assistant", "text": "an answer"}]}   dialogue

Any line may name its speaker, ``"speaker": "spk12"`` (a string or an integer; missing or null:
the item is its own speaker).
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array

import numpy as np

from torchtitan_speechlm.prepare.items import (
    ROLES,
    AudioRef,
    ManifestError,
    ManifestItem,
    TurnSpec,
    speaker_label,
)
from torchtitan_speechlm.prepare.sources.base import (
    PrepareSource,
    SourceRead,
    register_source,
)
from torchtitan_speechlm.prepare.spill import SpilledItems
from torchtitan_speechlm.utils.text_files import text_lines


def _str_key(row: dict, key: str, where: str, required: bool) -> str | None:
    if key not in row or (row[key] is None and not required):
        if required:
            raise ManifestError(f"{where}: missing key {key!r}")
        return None
    if not isinstance(row[key], str):
        raise ManifestError(f"{where}: {key!r} must be a string, got {type(row[key]).__name__}")
    return row[key]


def _resolve(base: str, path: str) -> str:
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def _parse_turns(turns, base: str, where: str) -> list[TurnSpec]:
    if not isinstance(turns, list) or not turns:
        raise ManifestError(f"{where}: 'turns' must be a non-empty list of objects")
    out = []
    for k, t in enumerate(turns):
        at = f"{where}: turn {k}"
        if not isinstance(t, dict):
            raise ManifestError(f"{at}: expected an object, got {type(t).__name__}")
        role = _str_key(t, "role", at, True)
        if role not in ROLES:
            raise ManifestError(f"{at}: role {role!r} is not one of {', '.join(ROLES)}")
        text, audio = _str_key(t, "text", at, False), _str_key(t, "audio", at, False)
        if (text is None) == (audio is None):
            raise ManifestError(f"{at}: needs exactly one of 'text' or 'audio'")
        ref = AudioRef(path=_resolve(base, audio)) if audio is not None else None
        out.append(TurnSpec(role=role, text=text, audio=ref))
    return out


def read_jsonl_manifest(path: str, items=None):
    """Parse a JSONL manifest; blank lines are skipped, ids must be unique.

    Relative audio paths resolve against the manifest's folder so a corpus directory can be
    moved as a whole. ``items``: where the items go (``append``; default a new list, returned),
    e.g. a ``SpilledItems``: the reader itself keeps 8 bytes per item (a hash of its id, for the
    duplicate check).
    """
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"manifest {path} not found")
    base = os.path.dirname(path)
    items = [] if items is None else items
    ids = array("Q")  # a 64-bit hash of every id: duplicates are found when the file is read
    for lineno, line in text_lines(path, ManifestError):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(row, dict):
            raise ManifestError(f"{where}: expected a JSON object, got {type(row).__name__}")
        item_id = _str_key(row, "id", where, True)
        if not item_id:
            raise ManifestError(f"{where}: empty id")
        ids.append(_id_hash(item_id))
        speaker = speaker_label(row.get("speaker"), where)
        if "turns" in row:
            if "audio" in row or "text" in row:
                raise ManifestError(
                    f"{where}: a dialogue line has 'turns' only, not 'audio'/'text'"
                )
            turns = _parse_turns(row["turns"], base, where)
            items.append(
                ManifestItem(item_id, None, "", lineno, where, turns=turns, speaker=speaker)
            )
            continue
        audio = _str_key(row, "audio", where, False)
        text = _str_key(row, "text", where, False)
        if audio is None and text is None:
            raise ManifestError(f"{where}: needs 'audio', 'text' or 'turns'")
        audio = _resolve(base, audio) if audio is not None else None
        items.append(ManifestItem(item_id, audio, text or "", lineno, where, speaker=speaker))
    if hasattr(items, "seal"):
        items.seal()  # readable: the duplicate check names the lines
    _refuse_duplicates(ids, items)
    return items


def _id_hash(item_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(item_id.encode(), digest_size=8).digest(), "little")


def _refuse_duplicates(ids: array, items) -> None:
    """The first line (in file order) whose id an earlier line has, named with both lines."""
    h = np.frombuffer(ids, dtype=np.uint64) if len(ids) else np.zeros(0, np.uint64)
    ordered = np.sort(h)  # 8 more bytes per item, for a moment
    if not (ordered[1:] == ordered[:-1]).any():
        return
    del ordered
    order = np.argsort(h, kind="stable")  # only when there is a duplicate: to name it
    same = np.flatnonzero(h[order][1:] == h[order][:-1])
    clashes = sorted((int(order[k + 1]), int(order[k])) for k in same)  # (later, earlier)
    for later, earlier in clashes:
        a, b = items[earlier], items[later]
        if a.id == b.id:  # (not a 64-bit hash collision of two ids)
            first = int(np.flatnonzero(h == h[later])[0])
            raise ManifestError(
                f"{b.where}: duplicate id {b.id!r} (first on line {items[first].line})"
            )


def _read(path: str) -> SourceRead:
    # on disk while prepare plans and encodes (prepare/spill.py): O(shards) in memory
    return SourceRead(read_jsonl_manifest(path, SpilledItems()), {"type": "manifest"})


register_source(
    PrepareSource(
        "manifest",
        "--manifest",
        "M.jsonl",
        "JSONL: speech, text-only, audio-only or dialogue lines",
        _read,
    )
)
