"""Small file helpers used everywhere: atomic writes, the one canonical-JSON hash, and JSON
files that carry their own checksum.

Atomic: write to a temp file next to the target and ``os.replace`` it, so a reader (or a rerun
after a crash) sees the old file or the new one, never half of one; the temp file is removed
when the write fails (a full disk leaves nothing behind). Hashes identify configs,
vocabularies, tokenizers and inputs by the canonical JSON of a value (sorted keys, compact
separators, ASCII), optionally followed by the bytes of files.

Checked JSON (``write_checked_json`` / ``read_checked_json``): a run's own files
(``speechlm_run.json``, ``vocab.json``) hold ``"sha256"``, the hash of the rest, so that a
flipped byte that still parses is found too; a damaged file is a ``DamagedFileError`` naming
the file and what is wrong with it (not UTF-8, not JSON: where; a checksum that differs). A
file written before it had a checksum is read as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable

CHECKSUM_KEY = "sha256"


class DamagedFileError(ValueError):
    """A file of the run cannot be trusted; ``path`` and the message say what is wrong."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path} is damaged: {why}")
        self.path, self.why = path, why


def write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


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


def write_checked_json(path: str, obj: dict, indent: int = 2) -> None:
    """``write_json_atomic`` of ``obj`` with its checksum (``CHECKSUM_KEY``)."""
    body = {k: v for k, v in obj.items() if k != CHECKSUM_KEY}
    write_json_atomic(path, {**body, CHECKSUM_KEY: json_hash(body, length=64)}, indent)


def describe_json_error(e: json.JSONDecodeError, line: bool = True) -> str:
    """``Expecting ',' delimiter at line 3, column 7 (character 41)`` (``line=False``: ``...
    at column 7``, for one line of a JSONL file): json's message without its own trailing
    "at" (``Invalid control character at``), which read "at at column" before."""
    msg = e.msg[: -len(" at")] if e.msg.endswith(" at") else e.msg
    if not line:
        return f"{msg} at column {e.colno}"
    return f"{msg} at line {e.lineno}, column {e.colno} (character {e.pos})"


def read_checked_json(path: str) -> dict:
    """A JSON object written by ``write_checked_json`` (its checksum checked and dropped) or
    without a checksum; ``DamagedFileError`` naming what is wrong; OSError as ``open``'s."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DamagedFileError(path, f"byte {data[e.start]:#04x} at offset {e.start} is not "
                                     "UTF-8 (bytes changed on disk)") from None  # fmt: skip
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        what = "it ends early (cut short)" if e.pos >= len(text.rstrip()) else "not JSON"
        raise DamagedFileError(path, f"{what}: {describe_json_error(e)}") from None
    if not isinstance(obj, dict):
        raise DamagedFileError(path, f"a JSON object was expected, not {type(obj).__name__}")
    want = obj.pop(CHECKSUM_KEY, None)
    if want is not None and json_hash(obj, length=64) != want:
        raise DamagedFileError(path, f"its contents no longer match their {CHECKSUM_KEY} "
                                     "(bytes changed on disk)")  # fmt: skip
    return obj


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
