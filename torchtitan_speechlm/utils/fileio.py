"""Small file helpers used everywhere: atomic writes and the one canonical-JSON hash.

Atomic: write to a temp file next to the target and ``os.replace`` it, so a reader (or a rerun
after a crash) sees the old file or the new one, never half of one. Hashes identify configs,
vocabularies, tokenizers and inputs by the canonical JSON of a value (sorted keys, compact
separators, ASCII), optionally followed by the bytes of files.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable


def write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json_atomic(path: str, obj, indent: int = 2) -> None:
    write_text_atomic(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def json_hash(obj, files: Iterable[str] = (), length: int = 16) -> str:
    """sha256 of ``canonical_json(obj)`` then of each file's bytes, as ``length`` hex chars."""
    h = hashlib.sha256(canonical_json(obj).encode())
    for path in files:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()[:length]
