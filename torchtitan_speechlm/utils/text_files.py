"""Where a user's text file stops being UTF-8, in words: the file, the line, the column, the
byte and the fix.

Python's own ``UnicodeDecodeError`` says ``'utf-8' codec can't decode byte 0xe9 in position
391``: a position inside whatever chunk the decoder was handed, no file, no line. Every reader of
a user's text file (manifests, Kaldi tables, ``generate --batch``, TOML configs) reads as
before and, when the decoder fails, asks :func:`not_utf8` for the message: it scans the file's
bytes line by line (only then, so reading stays as fast as before) for the first line that does
not decode.
"""

from __future__ import annotations


def fix(path: str) -> str:
    """What to do about a file that is not UTF-8."""
    return f"save it as UTF-8 (from Latin-1: iconv -f latin1 -t utf-8 {path} > {path}.utf8)"


def not_utf8(path: str, data: bytes | None = None, error: Exception | None = None) -> str:
    """``PATH:LINE: byte 0xe9 at column 12 (byte offset 391) is not UTF-8 (near `caf\\xe9 au
    lait`): save it as UTF-8 ...``. ``data``: the file's bytes when the caller holds them
    (else the file is read); ``error``: the decoder's own error, quoted when no bad line is
    found (a file changed since)."""
    if data is None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            return f"{path}: not UTF-8 ({error or e}); {fix(path)}"
    offset = 0
    for lineno, raw in enumerate(data.splitlines(keepends=True), start=1):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return line_not_utf8(path, lineno, raw, offset, e)
        offset += len(raw)
    return f"{path}: not UTF-8 ({error}); {fix(path)}"


def line_not_utf8(path: str, lineno: int, raw: bytes, offset: int, e: UnicodeDecodeError) -> str:
    """:func:`not_utf8`'s message for line ``lineno`` (its bytes ``raw``, starting at byte
    ``offset`` of the file) that failed to decode with ``e``."""
    lo, hi = max(e.start - 20, 0), min(e.start + 20, len(raw))
    near = raw[lo:hi].decode("utf-8", errors="backslashreplace").strip()
    return (
        f"{path}:{lineno}: byte {raw[e.start]:#04x} at column {e.start + 1} (byte offset "
        f"{offset + e.start}) is not UTF-8 (near `{near}`): {fix(path)}"
    )


def text_lines(path: str, error_cls: type[Exception] = ValueError):
    """``(line number, line)`` of a UTF-8 text file, as ``enumerate(open(path), 1)`` gives them;
    bytes that are not UTF-8 raise ``error_cls`` with :func:`not_utf8`'s message."""
    try:
        with open(path, encoding="utf-8") as f:
            yield from enumerate(f, start=1)
    except UnicodeDecodeError as e:
        raise error_cls(not_utf8(path, error=e)) from None
