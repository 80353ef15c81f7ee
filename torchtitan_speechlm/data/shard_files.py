"""Opening the shards of a prepared dataset for reading: a shard's ``shard.json`` checked against
the dataset's codec and tokenizer, its arrays against its index, the arrays and its
``items.jsonl`` memory-mapped. Shards are opened when first read, through a bounded cache
(``ShardCache``), so the open files and memory maps of a process do not grow with the number of
shards. Every problem is a ``CorruptDatasetError`` naming the file; a limit of the process
(open files, memory maps) is a ``ShardLimitError`` naming the limit and how to raise it."""

from __future__ import annotations

import errno
import json
import os
import resource
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchtitan_speechlm.data.format import (
    AUDIO_CODES,
    AUDIO_WAVE,
    FORMAT_VERSION,
    ITEMS,
    METADATA,
    REGENERATE,
    SHARD_META,
    SHARDS_DIR,
    TEXT_TOKENS,
    WAVE_INDEX,
    CorruptDatasetError,
    ShardMismatchError,
    check_shard_files,
    codec_of,
    first_difference,
    metadata_value,
    read_json,
)

WAVE_FIX = "add them again with prepare/waveforms.py"
# shards a process keeps open at once (2 files and maps each: text tokens and codes; 3 with
# waveforms); the environment variable overrides it
SHARD_CACHE = int(os.environ.get("TORCHTITAN_SPEECHLM_SHARD_CACHE", "32"))


class ShardLimitError(CorruptDatasetError):
    """A shard could not be opened because of a limit of the process (open files, memory maps),
    not because anything is wrong with it; the message names the limit and how to raise it."""


def limit_error(path: str, e: OSError) -> ShardLimitError | None:
    """The ``ShardLimitError`` for an ``OSError`` of opening or mapping ``path`` that a process
    limit caused (EMFILE, ENFILE, ENOMEM), else None."""
    cache = f"TORCHTITAN_SPEECHLM_SHARD_CACHE (now {SHARD_CACHE} shards open at most)"
    if e.errno == errno.EMFILE:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
        return ShardLimitError(
            f"cannot open {path}: this process has reached its limit of open files "
            f"(RLIMIT_NOFILE: soft {soft}, hard {hard}); raise it before starting, e.g. "
            f"`ulimit -n {want}` (in the shell or the SLURM script), or lower {cache}; the "
            "file itself is fine"
        )
    if e.errno == errno.ENFILE:
        return ShardLimitError(
            f"cannot open {path}: the system's table of open files is full (fs.file-max); "
            f"raise it (`sysctl -w fs.file-max=...`) or lower {cache}; the file itself is fine"
        )
    if e.errno == errno.ENOMEM:
        try:
            with open("/proc/sys/vm/max_map_count") as f:
                maps = f"vm.max_map_count = {f.read().strip()}"
        except OSError:
            maps = "vm.max_map_count"
        return ShardLimitError(
            f"cannot memory-map {path}: out of memory maps ({maps}) or address space "
            f"(`ulimit -v`); raise them (`sysctl -w vm.max_map_count=1048576`, `ulimit -v "
            f"unlimited`) or lower {cache}; the file itself is fine"
        )
    return None


def open_array(path: str, dtype_kinds: str, ndim: int) -> np.ndarray:
    """``np.load(path, mmap_mode="r")``, refused unless it has ``ndim`` dimensions and a dtype
    kind among ``dtype_kinds``."""
    if not os.path.isfile(path):
        raise CorruptDatasetError(f"{path} is missing; {REGENERATE}")
    try:
        arr = np.load(path, mmap_mode="r")
    except OSError as e:
        limit = limit_error(path, e)
        if limit is not None:
            raise limit from e
        raise CorruptDatasetError(f"{path} is unreadable or truncated ({e}); {REGENERATE}") from e
    except (ValueError, EOFError) as e:
        raise CorruptDatasetError(f"{path} is unreadable or truncated ({e}); {REGENERATE}") from e
    if arr.ndim != ndim or arr.dtype.kind not in dtype_kinds:
        raise CorruptDatasetError(f"{path} has shape {arr.shape} dtype {arr.dtype}; {REGENERATE}")
    return arr


class RowFile:
    """The rows of a ``.npy`` array whose data start at byte ``offset`` (known from the index or
    a checked open), read with ``os.pread`` from one open descriptor: ``rows[a:b]`` reads those
    rows' bytes and nothing else. A training stream reads a few rows of each of thousands of
    shards in random order; a read costs one system call, where a memory map cost two more
    (map, unmap) and a page fault per page. The page cache is the node's either way."""

    def __init__(self, path: str, offset: int, dtype: np.dtype, shape: tuple):
        self.path, self.offset, self.dtype = path, int(offset), np.dtype(dtype)
        self.shape = tuple(int(x) for x in shape)
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))
        self.fd = -1
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CorruptDatasetError(f"{path} is missing; {REGENERATE}") from None
        except OSError as e:
            limit = limit_error(path, e)
            if limit is not None:
                raise limit from e
            raise CorruptDatasetError(f"{path} is unreadable ({e}); {REGENERATE}") from e

    @classmethod
    def of(cls, arr: np.ndarray) -> RowFile:
        """The rows of an array ``open_array`` returned (its map is released with it)."""
        return cls(arr.filename, arr.offset, arr.dtype, arr.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> np.ndarray:
        a, b, step = rows.indices(self.shape[0])
        if step != 1:
            raise IndexError("RowFile reads contiguous rows only")
        n = max(0, b - a)
        want = n * self.row_bytes
        data = os.pread(self.fd, want, self.offset + a * self.row_bytes) if want else b""
        if len(data) != want:
            raise CorruptDatasetError(
                f"{self.path} is truncated (since it was opened); {REGENERATE}"
            )
        return np.frombuffer(data, self.dtype).reshape((n, *self.shape[1:]))

    def __del__(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def shard_dir(root: str, entry: dict) -> str:
    return os.path.join(root, SHARDS_DIR, str(entry.get("name")))


def check_sizes(root: str, entries: list[dict], checksums: bool = False) -> None:
    """Every shard's files against the sizes (``checksums``: and sha256s) metadata.json
    recorded; a missing shard folder is named."""
    for entry in entries:
        sdir = shard_dir(root, entry)
        if not os.path.isdir(sdir):
            raise CorruptDatasetError(f"shard {sdir} is missing; {REGENERATE}")
        if entry.get("files"):
            check_shard_files(sdir, entry["files"], checksums=checksums)


def shard_meta(sdir: str, root: str, metadata: dict) -> dict:
    """The shard's ``shard.json``, refused if its format, codec layout or tokenizer is not the
    dataset's (shards of different codecs or tokenizers cannot be mixed)."""
    smeta = read_json(os.path.join(sdir, SHARD_META))
    if smeta.get("format_version") != FORMAT_VERSION:
        raise CorruptDatasetError(
            f"shard {sdir}: format_version {smeta.get('format_version')!r}, expected "
            f"{FORMAT_VERSION}; {REGENERATE}"
        )
    key = first_difference(smeta, metadata)
    if key is not None:
        raise ShardMismatchError(
            f"shard {sdir}: {key} is {metadata_value(smeta, key)!r} but {root}/{METADATA} says "
            f"{metadata_value(metadata, key)!r} (shards from different codecs/tokenizers cannot be "
            f"mixed); {REGENERATE}"
        )
    return smeta


def check_shard(
    sdir: str, root: str, metadata: dict, entry: dict, cols: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """A shard against its index columns ``cols`` (``COLUMN_DTYPE`` rows, or a dict of column
    arrays): its shard.json, item count and both arrays (shape, dtype, every offset inside
    them). Returns the memory-mapped text tokens and codes."""
    smeta = shard_meta(sdir, root, metadata)
    n = len(cols["text_len"])
    if not n == smeta.get("num_items") == entry.get("num_items"):
        raise CorruptDatasetError(
            f"shard {sdir}: {ITEMS} has {n} items, shard.json says {smeta.get('num_items')}, "
            f"metadata.json says {entry.get('num_items')}; {REGENERATE}"
        )
    text = open_array(os.path.join(sdir, TEXT_TOKENS), "i", 1)
    codes = open_array(os.path.join(sdir, AUDIO_CODES), "i", 2)
    checks = [
        (TEXT_TOKENS, text.shape[0], smeta.get("total_text_tokens"), "text_offset", "text_len"),
        (AUDIO_CODES, codes.shape[0], smeta.get("total_frames"), "audio_offset", "audio_frames"),
    ]
    for name, have, want, off_key, len_key in checks:
        file = os.path.join(sdir, name)
        if have != want:
            raise CorruptDatasetError(
                f"{file} has {have} rows, shard.json says {want}; {REGENERATE}"
            )
        off = np.asarray(cols[off_key], dtype=np.int64)
        length = np.asarray(cols[len_key], dtype=np.int64)
        if n and ((off < 0).any() or (length < 0).any() or (off + length > have).any()):
            raise CorruptDatasetError(f"{file}: {ITEMS} points past its {have} rows; {REGENERATE}")
    num_streams = codec_of(metadata).num_streams
    if codes.shape[1] != num_streams:
        raise CorruptDatasetError(
            f"{os.path.join(sdir, AUDIO_CODES)} has {codes.shape[1]} streams, metadata says "
            f"{num_streams}; {REGENERATE}"
        )
    return text, codes


def array_layout(text: np.ndarray, codes: np.ndarray) -> tuple:
    """Where the data of a shard's two checked arrays (``check_shard``'s) start, their dtypes
    and shapes."""
    return tuple((int(x.offset), x.dtype, x.shape) for x in (text, codes))


# an index's per-shard layout row (data/index_store.py: LAYOUT): the text tokens' data offset,
# item size and rows, then the codes'; all -1 for a shard not checked when the index was built
LAYOUT_WIDTH = 6


def layout_row(text: np.ndarray, codes: np.ndarray) -> list[int]:
    """A shard's ``LAYOUT`` row from its two checked arrays."""
    return [int(v) for x in (text, codes) for v in (x.offset, x.dtype.itemsize, x.shape[0])]


def recorded_array_sizes(entries: list[dict]) -> np.ndarray:
    """int64 [shards, 2]: each shard's text tokens' and codes' sizes as metadata.json records
    them (-1 where it records none), kept where the records themselves are not."""
    out = np.full((len(entries), 2), -1, dtype=np.int64)
    for s, entry in enumerate(entries):
        files = entry.get("files") or {}
        for k, name in enumerate((TEXT_TOKENS, AUDIO_CODES)):
            size = (files.get(name) or {}).get("bytes")
            if isinstance(size, int):
                out[s, k] = size
    return out


@dataclass
class OpenShard:
    """One shard, checked: its folder, its text tokens and codes (and waveforms, for a dataset
    that has them) as ``RowFile``s: sliced like arrays, each slice one read."""

    path: str
    text: RowFile
    codes: RowFile
    wave: RowFile | None = None


class ShardCache:
    """The open shards of one dataset, at most ``capacity`` at a time (least recently used
    closed first: its maps are released when nothing refers to them any more). ``columns``
    and ``starts`` are the dataset's index (data/item_index.py)."""

    def __init__(self, root: str, metadata: dict, columns: dict, starts: np.ndarray,
                 capacity: int | None = None, waves: bool = False,
                 fetch: Callable[[int, list[str]], None] | None = None,
                 layout: np.ndarray | None = None,
                 sizes: np.ndarray | None = None):  # fmt: skip
        """``fetch(s, keep)``: a mirrored dataset's (data/remote.py), called before shard s is
        opened to put its arrays in the local folder; ``keep``: the open shards' folders.
        ``layout``: the index's per-shard ``LAYOUT`` rows (where each shard's arrays' data start
        and the codes' item size, found when the index was built and the shard checked;
        -1: not checked there, so checked here on its first open). ``sizes``: int64 [shards,
        2], the text tokens' and codes' sizes metadata.json records (``recorded_array_sizes``;
        -1: none), checked when a shard is opened from the index's layout."""
        self.root, self.metadata, self.columns, self.starts = root, metadata, columns, starts
        self.sizes = sizes
        self.fetch = fetch
        self.layout = layout
        self.entries = metadata.get("shards", [])
        self.num_streams = codec_of(metadata).num_streams
        self.capacity = max(1, capacity if capacity is not None else SHARD_CACHE)
        self.waves = waves
        self._open: OrderedDict[int, OpenShard] = OrderedDict()
        # shards checked by this process (check_shard: once each): where their arrays' data
        # start, dtype and shape, so that opening one again is two plain maps (~20 us)
        self._layout: dict[int, tuple] = {}
        self.opened = 0  # shards opened so far (a shard evicted and opened again counts twice)

    def path(self, s: int) -> str:
        return shard_dir(self.root, self.entries[s])

    def __len__(self) -> int:
        return len(self._open)

    def get(self, s: int) -> OpenShard:
        shard = self._open.get(s)
        if shard is not None:
            self._open.move_to_end(s)
            return shard
        while len(self._open) >= self.capacity:
            self._open.popitem(last=False)
        shard = self._open[s] = self._load(s)
        self.opened += 1
        return shard

    def _load(self, s: int) -> OpenShard:
        if self.fetch is None:
            return self._open_shard(s)
        self.fetch(s, [x.path for x in self._open.values()])
        try:
            return self._open_shard(s)
        except CorruptDatasetError:  # another process of the node evicted it just now
            self.fetch(s, [x.path for x in self._open.values()])
            return self._open_shard(s)

    def _known_layout(self, s: int) -> tuple | None:
        """Shard s's arrays' (offset, dtype, shape), from this process's first open of it or
        from the index (checked when it was built)."""
        got = self._layout.get(s)
        if got is None and self.layout is not None and self.layout[s][0] >= 0:
            text_at, text_size, text_rows, codes_at, codes_size, codes_rows = (
                int(x) for x in self.layout[s]
            )
            n = self.num_streams
            got = ((text_at, np.dtype(f"<i{text_size}"), (text_rows,)),
                   (codes_at, np.dtype(f"<i{codes_size}"), (codes_rows, n)))  # fmt: skip
        return got

    def _check_sizes(self, s: int, files: tuple) -> None:
        """Shard s's open arrays against the sizes metadata.json records (one ``fstat`` each):
        the index's layout is that of the files it was built from."""
        if self.sizes is None:
            return
        for k, (_name, rows) in enumerate(files):
            want, got = int(self.sizes[s, k]), os.fstat(rows.fd).st_size
            if want >= 0 and got != want:
                raise CorruptDatasetError(
                    f"{rows.path} has {got} bytes, metadata.json records {want} (changed since "
                    f"the dataset's index was checked); {REGENERATE}"
                )

    def _open_shard(self, s: int) -> OpenShard:
        sdir = self.path(s)
        layout = self._known_layout(s)
        if layout is None:  # checked on its first open: its shard.json, arrays and ranges
            a, b = int(self.starts[s]), int(self.starts[s + 1])
            cols = {k: self.columns[k][a:b] for k in ("text_offset", "text_len", "audio_offset",
                                                      "audio_frames")}  # fmt: skip
            arrays = check_shard(sdir, self.root, self.metadata, self.entries[s], cols)
            layout = self._layout[s] = array_layout(*arrays)
        text, codes = (RowFile(os.path.join(sdir, f), *lay)
                       for f, lay in zip((TEXT_TOKENS, AUDIO_CODES), layout, strict=True))  # fmt: skip
        if s not in self._layout:  # known from the index: its sizes, checked on this open
            self._check_sizes(s, ((TEXT_TOKENS, text), (AUDIO_CODES, codes)))
        wave = (
            RowFile.of(open_array(os.path.join(sdir, AUDIO_WAVE), "i", 1)) if self.waves else None
        )
        return OpenShard(sdir, text, codes, wave)

    def clear(self) -> None:
        self._open.clear()


def read_wave_index(
    sdir: str, files: dict | None, verify: str, ids: list[str], n: int, wave_len: int | None
) -> np.ndarray:
    """A shard's waveform index (prepare/waveforms.py): ``files`` is metadata.json's record of
    them, ``ids`` the shard's item ids (``n`` of them). Returns each item's [offset, samples];
    ``wave_len``: the samples of the shard's waveform array, checked when given."""
    if files is None:
        raise CorruptDatasetError(f"{sdir}: metadata.json records no waveforms; {WAVE_FIX}")
    if verify != "none":
        check_shard_files(sdir, files, checksums=verify == "full")
    if wave_len is None:
        wave_len = len(open_array(os.path.join(sdir, AUDIO_WAVE), "i", 1))
    rows = []
    with open(os.path.join(sdir, WAVE_INDEX), encoding="utf-8") as f:
        for k, line in enumerate(f):
            r = json.loads(line)
            if k >= len(ids) or r["id"] != ids[k]:
                raise CorruptDatasetError(
                    f"{sdir}/{WAVE_INDEX}:{k + 1}: not the shard's item order; {WAVE_FIX}"
                )
            rows.append((int(r["offset"]), int(r["samples"])))
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
    if len(rows) != n or (len(rows) and (rows.sum(1) > wave_len).any()):
        raise CorruptDatasetError(
            f"{sdir}/{WAVE_INDEX}: does not index the shard's {n} items; {WAVE_FIX}"
        )
    return rows
