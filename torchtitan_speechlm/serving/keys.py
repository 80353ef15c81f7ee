"""The API keys a server takes: one (``--api-key`` or ``TORCHTITAN_SERVE_API_KEY``) and/or
several from a file (``--api-key-file``), read again when the file changes, so that keys are
added and revoked without a restart (docs/serving.md *API keys*).

The file holds one key per line, optionally after a name (``alice sk-...``; ``#`` comments and
blank lines skipped); the name, never the key, is what the access log and the per-key rate
limits use (a key without a name is ``line-N``). A key is printable ASCII without spaces: the
``Authorization`` header is ASCII, so any other key could never match; such a key is refused
at start with one line. A file changed into something that cannot be read as keys (empty, a
bad line) leaves the previous keys in force, and one line says why.
"""

from __future__ import annotations

import hmac
import os
import re
import threading
import time
from collections.abc import Callable

KEY_CHARS = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: what a header can carry
SINGLE = "api-key"  # the name of --api-key's key
RECHECK_S = 1.0  # the file's stat is looked at once a second at most


def check_key(key: str, where: str) -> None:
    """ValueError (one line naming ``where``) unless ``key`` can be sent in a header."""
    if not KEY_CHARS.fullmatch(key):
        bad = next((c for c in key if not KEY_CHARS.fullmatch(c)), " ")
        raise ValueError(
            f"{where}: the key holds {bad!r}, which an Authorization header cannot carry, so "
            "no request could ever match it; use printable ASCII without spaces"
        )


def read_key_file(path: str) -> dict[str, str]:
    """``{name: key}`` of a key file; ValueError naming the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {path}: cannot be read ({e})") from None
    keys: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split() if not line.lstrip().startswith("#") else []
        if not fields:
            continue
        if len(fields) > 2:
            raise ValueError(f"--api-key-file {path}:{n}: expected 'KEY' or 'NAME KEY', got "
                             f"{len(fields)} words")  # fmt: skip
        name, key = fields if len(fields) == 2 else (f"line-{n}", fields[0])
        check_key(key, f"--api-key-file {path}:{n}")
        if name in keys:
            raise ValueError(f"--api-key-file {path}:{n}: the name {name!r} is used twice")
        keys[name] = key
    if not keys:
        raise ValueError(f"--api-key-file {path}: holds no keys (one per line: KEY or NAME KEY)")
    return keys


class KeyRing:
    """Who may call: ``match(token)`` is the key's name, or None. Empty (no key given): nobody
    is checked (``enabled`` is False)."""

    def __init__(self, key: str | None = None, path: str | None = None,
                 say: Callable[[str], None] = print):  # fmt: skip
        self.path, self.say = path, say
        self._single = {}
        if key:
            check_key(key, "--api-key")
            self._single = {SINGLE: key}
        self._file: dict[str, str] = read_key_file(path) if path else {}
        self._stat = self._file_stat()
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """Picklable (a ``--replicas`` process gets the ring the supervisor checked): all
        but the lock."""
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self._single or self.path)

    def _file_stat(self):
        if not self.path:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def reload_if_changed(self) -> None:
        """Read the file again if it changed (checked once per ``RECHECK_S``)."""
        if not self.path or time.monotonic() - self._checked < RECHECK_S:
            return
        with self._lock:
            self._checked = time.monotonic()
            stat = self._file_stat()
            if stat == self._stat:
                return
            self._stat = stat
            try:
                self._file = read_key_file(self.path)
            except ValueError as e:
                self.say(f"error: {e}; the previous {len(self._file)} keys stay in force")
                return
            self.say(
                f"--api-key-file {self.path}: {len(self._file)} keys ({', '.join(self._file)})"
            )

    def match(self, token: str) -> str | None:
        """The name of the key ``token`` is (every key compared, in constant time each)."""
        self.reload_if_changed()
        found = None
        given = token.encode("latin-1", "replace")
        for name, key in {**self._single, **self._file}.items():
            if hmac.compare_digest(given, key.encode()):
                found = found or name
        return found
