"""JSONL manifests: the input list of (id, audio file, transcript) for dataset preparation.

One JSON object per line with string keys ``id``, ``audio`` and ``text`` (other keys are
ignored). Relative audio paths resolve against the manifest's folder so a corpus directory can
be moved as a whole. Errors name the file and line so a bad row in a large manifest is easy to
find.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

REQUIRED_KEYS = ("id", "audio", "text")


class ManifestError(ValueError):
    """A manifest line is malformed; the message starts with ``<file>:<line>:``."""


@dataclass
class ManifestItem:
    id: str
    audio: str  # absolute path
    text: str
    line: int = 0  # 1-based line in the manifest, for error messages


def read_jsonl_manifest(path: str) -> list[ManifestItem]:
    """Parse a JSONL manifest; blank lines are skipped, ids must be unique."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"manifest {path} not found")
    base = os.path.dirname(path)
    items: list[ManifestItem] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ManifestError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(row, dict):
                raise ManifestError(f"{where}: expected a JSON object, got {type(row).__name__}")
            for key in REQUIRED_KEYS:
                if key not in row:
                    raise ManifestError(
                        f"{where}: missing key {key!r} (need {', '.join(REQUIRED_KEYS)})"
                    )
                if not isinstance(row[key], str):
                    raise ManifestError(
                        f"{where}: {key!r} must be a string, got {type(row[key]).__name__}"
                    )
            item_id = row["id"]
            if not item_id:
                raise ManifestError(f"{where}: empty id")
            if item_id in seen:
                raise ManifestError(
                    f"{where}: duplicate id {item_id!r} (first on line {seen[item_id]})"
                )
            seen[item_id] = lineno
            audio = os.path.normpath(os.path.join(base, os.path.expanduser(row["audio"])))
            items.append(ManifestItem(id=item_id, audio=audio, text=row["text"], line=lineno))
    return items
