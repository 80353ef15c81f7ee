"""Kaldi tables read in bounded memory: checked in one pass, then merged or looked up.

A Kaldi data dir joins its tables by key (``text`` and ``utt2spk`` by utterance, ``wav.scp`` by
recording). Read into dicts, they cost ~150-250 bytes per line each, ~1 kB per utterance in
all. Kaldi's tools keep every table sorted by its key (``LC_ALL=C sort``, which is Python's
string order; ``utils/validate_data_dir.sh`` checks it, ``utils/fix_data_dir.sh`` sorts), so
when the file the items follow is sorted too, each table is merged with it as both are read,
holding nothing (``Lookup``). A table that is not sorted is read into a dict (as before).

Each table is first read once to check it (``check_table``): bad lines and repeated keys stop
the run naming the line, in the order reading it into a dict found them, while only a 64-bit
hash of each key is kept (``unique.KeyHashes``), and whether the keys are sorted is noted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from torchtitan_speechlm.prepare.items import ManifestError
from torchtitan_speechlm.prepare.sources.unique import KeyHashes
from torchtitan_speechlm.utils.text_files import text_lines

Row = tuple[int, str, list[str]]  # (line number, key, the other fields)
RowCheck = Callable[[str, str, list[str]], None]  # (where, key, other fields): raises


def table_rows(path: str, fields: int) -> Iterator[Row]:
    """The non-blank lines of a table of at least ``fields`` fields; the last field keeps its
    spaces (``fields=1``: the key, then the rest of the line if any)."""
    for lineno, line in text_lines(path, ManifestError):
        line = line.strip()
        if not line:
            continue
        parts = line.split(None, max(fields, 2) - 1)
        if len(parts) < fields:
            raise ManifestError(f"{path}:{lineno}: expected {fields} fields, got {line!r}")
        yield lineno, parts[0], parts[1:]


class TableCheck:
    """What one pass over a table found: its keys' hashes in order (while it is checked, or
    until ``release``), whether they are sorted, its last line, its number of keys."""

    def __init__(self, path: str, fields: int):
        self.path, self.fields = path, fields
        self.keys = KeyHashes()
        self.sorted, self.last_line, self.count, self._prev = True, 0, 0, None

    def release(self) -> None:
        self.keys = KeyHashes()  # (8 bytes per line)

    def note(self, key: str, lineno: int) -> None:
        self.keys.add(key)
        self.count += 1
        if self._prev is not None and key < self._prev:
            self.sorted = False
        self._prev, self.last_line = key, lineno

    def refuse_repeat(self, what: str) -> None:
        """``PATH:LINE: duplicate WHAT 'KEY'`` for the first key an earlier line has."""
        found: dict[int, Row] = {}

        def keys_at(positions) -> Iterator[tuple[int, str]]:
            yield from rows_at(table_rows(self.path, self.fields), positions, found)

        hit = self.keys.first_repeat(keys_at)
        if hit is not None:
            lineno, key, _ = found[hit[0]]
            raise ManifestError(f"{self.path}:{lineno}: duplicate {what} {key!r}")


def rows_at(rows: Iterable[Row], positions, found: dict[int, Row] | None = None
            ) -> Iterator[tuple[int, str]]:  # fmt: skip
    """``(position, key)`` of the rows at ascending ``positions`` (``found[position]``: the
    row); reads no further than the last one (a bad line after it stays unread)."""
    wanted = iter(positions)
    want = next(wanted, None)
    if want is None:
        return
    for pos, row in enumerate(rows):
        if pos == want:
            if found is not None:
                found[pos] = row
            yield pos, row[1]
            want = next(wanted, None)
            if want is None:
                return


def check_table(path: str, fields: int, what: str, before: RowCheck | None = None,
                after: RowCheck | None = None, repeats_first: bool = True,
                keep_keys: bool = False) -> TableCheck:  # fmt: skip
    """Read a table once: ``before`` and ``after`` check each line before and after its key is
    noted; a repeated key is refused (``what``: the key's name in the message). The order of
    the dict reader: a line with too few fields (or not UTF-8) anywhere first (it parsed the
    whole table), then the first bad line or, with ``repeats_first``, a repeat before it;
    else repeats only once every line passed. The keys' hashes are then released unless
    ``keep_keys``."""
    table, error = TableCheck(path, fields), None
    for lineno, key, rest in table_rows(path, fields):  # (its errors stop the run at once)
        if error is not None:
            continue  # read on: a line with too few fields further on comes first
        where = f"{path}:{lineno}"
        try:
            if before is not None:
                before(where, key, rest)
            table.note(key, lineno)
            if after is not None:
                after(where, key, rest)
        except ManifestError as e:
            error = e
    if error is not None:
        if repeats_first:
            table.refuse_repeat(what)
        raise error
    table.refuse_repeat(what)
    if not keep_keys:
        table.release()
    return table


class Lookup:
    """A table's values by key: ``merge``: keys are asked in sorted order of a sorted table,
    which is read alongside (nothing held); else the table is read into a dict."""

    def __init__(self, rows: Iterable[tuple[str, object]], merge: bool):
        self.merge = merge
        if merge:
            self._rows = iter(rows)
            self._key, self._value = next(self._rows, (None, None))
            self._asked = ""
        else:
            self._dict = dict(rows)

    def get(self, key: str):
        if not self.merge:
            return self._dict.get(key)
        if key < self._asked:  # (the callers check the order first: a bug if it happens)
            raise RuntimeError(f"merge lookup asked {key!r} after {self._asked!r}")
        self._asked = key
        while self._key is not None and self._key < key:
            self._key, self._value = next(self._rows, (None, None))
        return self._value if self._key == key else None


class KeyedTable:
    """A checked table and its values: ``lookup(ordered)`` merges when the keys will be asked
    in sorted order (``ordered``) and the table is sorted, else uses one dict, built once."""

    def __init__(
        self, check: TableCheck | None, values: Callable[[], Iterable[tuple[str, object]]]
    ):
        self.check, self.values = check, values
        self._dict: Lookup | None = None

    def lookup(self, ordered: bool) -> Lookup:
        if ordered and self.check is not None and self.check.sorted:
            return Lookup(self.values(), merge=True)
        if self._dict is None:
            self._dict = Lookup(self.values(), merge=False)
        return self._dict
