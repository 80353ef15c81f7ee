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


def current_umask() -> int:
    """The process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(folder: str, names: Iterable[str] | None = None) -> None:
    """Give ``folder`` and everything under it (or only its entries ``names``) the modes a
    plain ``mkdir`` / ``open`` would under the user's umask: ``tempfile.mkdtemp`` (the atomic
    export's temporary folder) makes 0700 and safetensors' writer 0600 files, so an export
    was readable by its owner alone, whatever the umask said (a shared model folder, a
    server's user)."""
    mask = current_umask()
    dir_mode, file_mode = 0o777 & ~mask, 0o666 & ~mask

    def fix(path: str) -> None:
        if not os.path.islink(path):
            os.chmod(path, dir_mode if os.path.isdir(path) else file_mode)

    if names is not None:
        for name in names:
            fix(os.path.join(folder, name))
        return
    fix(folder)
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            fix(os.path.join(root, name))


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
