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

import json
import os
from types import SimpleNamespace

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
from torchtitan_speechlm.prepare.sources.unique import (
    KeyHashes,
    duplicates_first,
    refuse_repeated_id,
)
from torchtitan_speechlm.prepare.spill import SpilledItems
from torchtitan_speechlm.utils.fileio import describe_json_error
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
    ids = KeyHashes()  # a 64-bit hash of every id: duplicates are found in 8 bytes per item
    reading: list = [None]  # the line being read once its id is hashed (its item not made)
    with duplicates_first(ids, items, _duplicate, lambda: reading[0]):
        for lineno, line in text_lines(path, ManifestError):
            if not line.strip():
                continue
            items.append(_parse_line(line, lineno, f"{path}:{lineno}", base, ids, reading))
            reading[0] = None
    refuse_repeated_id(ids, items, _duplicate)  # (seals a SpilledItems: readable)
    return items


def json_object(line: str, where: str) -> dict:
    """A JSONL line's object; a ManifestError naming ``where`` if it is not one."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{where}: invalid JSON ({describe_json_error(e, line=False)})") from e
    if not isinstance(row, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return row


def _parse_line(
    line: str, lineno: int, where: str, base: str, ids: KeyHashes, reading: list
) -> ManifestItem:
    row = json_object(line, where)
    item_id = _str_key(row, "id", where, True)
    if not item_id:
        raise ManifestError(f"{where}: empty id")
    ids.add(item_id)  # (a repeat is named before any later problem of its line)
    reading[0] = SimpleNamespace(id=item_id, where=where, line=lineno)
    speaker = speaker_label(row.get("speaker"), where)
    if "turns" in row:
        if "audio" in row or "text" in row:
            raise ManifestError(f"{where}: a dialogue line has 'turns' only, not 'audio'/'text'")
        turns = _parse_turns(row["turns"], base, where)
        return ManifestItem(item_id, None, "", lineno, where, turns=turns, speaker=speaker)
    audio = _str_key(row, "audio", where, False)
    text = _str_key(row, "text", where, False)
    if audio is None and text is None:
        raise ManifestError(f"{where}: needs 'audio', 'text' or 'turns'")
    audio = _resolve(base, audio) if audio is not None else None
    return ManifestItem(item_id, audio, text or "", lineno, where, speaker=speaker)


def _duplicate(later: ManifestItem, first: ManifestItem) -> str:
    return f"{later.where}: duplicate id {later.id!r} (first on line {first.line})"


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
