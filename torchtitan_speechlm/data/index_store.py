"""A prepared dataset's index as files every process memory-maps (MosaicML Streaming's idea:
a per-shard binary index, shared through the page cache).

``open_index`` returns the dataset's columns (``format.COLUMN_DTYPE``'s fields, every shard's
concatenated, one ``.npy`` per column) and ``starts`` (int64 [shards + 1]) from the folder
``<dataset>/index/`` (or, where the dataset is read-only, ``$TORCHTITAN_SPEECHLM_INDEX_CACHE``,
default ``~/.cache/torchtitan_speechlm/index/<hash of the path>``). The first process that opens
a dataset builds it, from each shard's ``columns.npy`` (written by ``torchtitan prepare``), or
from its ``items.jsonl`` for a dataset prepared before (said once, when it is built), checking
every shard against its arrays on the way; later opens (every rank of every run) only map it.
``index.json`` records what it was built from (``metadata.json``'s bytes and the size and time
of each shard's index files: a changed dataset is rebuilt, never read stale) and whether every
byte of the shards was verified against metadata.json's sha256s (``verify_shards = "full"``:
done once per dataset, then recorded; sizes are checked by every open).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass

import numpy as np

from torchtitan_speechlm.data.format import (
    AUDIO_CODES,
    COLUMN_DTYPE,
    COLUMNS,
    ITEMS,
    REGENERATE,
    SHARD_META,
    TEXT_TOKENS,
    CorruptDatasetError,
)
from torchtitan_speechlm.data.item_index import columns_from_items
from torchtitan_speechlm.data.shard_files import (
    LAYOUT_WIDTH,
    check_shard,
    check_sizes,
    layout_row,
    limit_error,
    shard_dir,
)
from torchtitan_speechlm.utils.fileio import write_json_atomic
from torchtitan_speechlm.utils.upstream import logger

INDEX_DIR = "index"
INDEX_META = "index.json"
# 2: LAYOUT added (a shard is opened from it without checking it again in every process)
INDEX_VERSION = 2
STARTS = "starts"
LAYOUT = "layout"  # int64 [shards, LAYOUT_WIDTH] (shard_files.layout_row)
NAMES = (*COLUMN_DTYPE.names, STARTS, LAYOUT)


@dataclass
class IndexInfo:
    """Where a dataset's index lives and how it came to be (for logs and tests)."""

    folder: str | None  # None: built in memory (no writable folder)
    built: bool  # built by this open (False: mapped)
    from_items: int  # shards whose index was parsed from items.jsonl (no columns.npy)
    seconds: float  # time of the build or of the mapping
    verified_full: bool  # every byte was checked against the recorded sha256s (by any open)
    build_s: float = 0.0  # of which building the index (this open)
    verify_s: float = 0.0  # of which reading every byte for the sha256s (this open)


def cache_folder(root: str) -> str:
    base = os.environ.get("TORCHTITAN_SPEECHLM_INDEX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "torchtitan_speechlm", "index"
    )
    return os.path.join(base, hashlib.sha256(root.encode()).hexdigest()[:16])


KEY_FILES = (ITEMS, COLUMNS, TEXT_TOKENS, AUDIO_CODES, SHARD_META)


def index_key(root: str, metadata_bytes: bytes, entries: list[dict], check: bool) -> str:
    """What the index is made from: metadata.json's bytes and each shard file's size and
    modification time (a shard changed since is indexed and verified again). ``check``: also
    refuse a shard file whose size is not the one metadata.json recorded (the same ``stat``)."""
    h = hashlib.sha256(metadata_bytes)
    for entry in entries:
        sdir = shard_dir(root, entry)
        files = entry.get("files") or {}
        for name in KEY_FILES:
            try:
                st = os.stat(os.path.join(sdir, name))
            except FileNotFoundError:
                if check and (name in files or not os.path.isdir(sdir)):
                    check_sizes(root, [entry])  # raises, naming the shard or the file
                h.update(f"{entry.get('name')}/{name}:-;".encode())
                continue
            if check and name in files and st.st_size != files[name].get("bytes"):
                check_sizes(root, [entry])  # raises, naming the file and both sizes
            h.update(f"{entry.get('name')}/{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return f"{INDEX_VERSION}:{h.hexdigest()}"


# The launcher checks every dataset (a ``stat`` of every shard file: 5 x 10^4 at 10^7 items,
# 1.5 x 10^6 at 3 x 10^8) moments before it starts the ranks; they inherit its keys through
# this variable instead of each repeating the stats (on a parallel file system, 8 ranks x
# nodes of them). A rank still checks each shard's array sizes when it opens it
# (shard_files.ShardCache), and a dataset changed after the launcher's check has another
# metadata.json or is caught there.
CHECKED_ENV = "TORCHTITAN_SPEECHLM_CHECKED_INDEXES"
_CHECKED: dict[str, list[str]] = {}  # root -> [sha256 of metadata.json, key], checked here


def export_checked_indexes() -> None:
    """Hand the index keys this process checked to the processes it starts from now on."""
    if _CHECKED:
        os.environ[CHECKED_ENV] = json.dumps(_CHECKED)


def inherited_key(root: str, metadata_sha: str) -> str | None:
    """The key the launcher checked for ``root`` with this metadata.json, if any."""
    try:
        got = json.loads(os.environ.get(CHECKED_ENV) or "{}").get(root)
    except (ValueError, AttributeError):
        return None
    if isinstance(got, list) and len(got) == 2 and got[0] == metadata_sha:
        return str(got[1])
    return None


def _path(folder: str, name: str) -> str:
    return os.path.join(folder, f"{name}.npy")


def _save(path: str, arr: np.ndarray) -> None:
    with open(path, "wb") as f:  # np.save(path) would append ".npy" to a temporary name
        np.save(f, arr)


def _writable(folder: str) -> bool:
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".probe-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
        return True
    except OSError:
        return False


def _read_meta(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, INDEX_META), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _map(folder: str, meta: dict, n_items: int, n_shards: int) -> dict[str, np.ndarray]:
    """The columns of a built index, memory-mapped; a damaged file names itself."""
    fix = f"delete {folder} (the next open rebuilds it from the shards)"
    out = {}
    for name in NAMES:
        path = _path(folder, name)
        want = {STARTS: (n_shards + 1,), LAYOUT: (n_shards, LAYOUT_WIDTH)}.get(name, (n_items,))
        dtype = np.dtype("<i8") if name in (STARTS, LAYOUT) else COLUMN_DTYPE[name]
        try:
            arr = np.load(path, mmap_mode="r") if all(want) else np.zeros(want, dtype)
        except OSError as e:
            limit = limit_error(path, e)
            if limit is not None:
                raise limit from e
            raise CorruptDatasetError(
                f"{path}: the dataset's index is unreadable ({e}); {fix}"
            ) from e
        except (ValueError, EOFError) as e:
            raise CorruptDatasetError(
                f"{path}: the dataset's index is unreadable or truncated ({e}); {fix}"
            ) from e
        if arr.shape != want or arr.dtype != dtype:
            raise CorruptDatasetError(
                f"{path}: the dataset's index has shape {arr.shape} dtype {arr.dtype}, expected "
                f"{want} {dtype}; {fix}"
            )
        out[name] = arr
    return out


def _shard_columns(sdir: str) -> tuple[np.ndarray, bool]:
    """A shard's columns: its ``columns.npy``, else parsed from its ``items.jsonl`` (True)."""
    path = os.path.join(sdir, COLUMNS)
    if not os.path.isfile(path):
        return columns_from_items(os.path.join(sdir, ITEMS)), True
    try:
        cols = np.load(path)
    except (ValueError, OSError, EOFError) as e:
        raise CorruptDatasetError(
            f"shard {sdir}: its index {path} is unreadable or truncated ({e}); {REGENERATE}"
        ) from e
    if cols.dtype != COLUMN_DTYPE or cols.ndim != 1:
        raise CorruptDatasetError(
            f"shard {sdir}: its index {path} has shape {cols.shape} dtype {cols.dtype}, "
            f"not the {COLUMNS} columns; {REGENERATE}"
        )
    return cols, False


def _edited_since(sdir: str) -> bool:
    """Whether the shard's items.jsonl was modified after its columns.npy was written."""
    items, cols = os.path.join(sdir, ITEMS), os.path.join(sdir, COLUMNS)
    return os.stat(items).st_mtime_ns > os.stat(cols).st_mtime_ns


def _lines_match(sdir: str, cols: np.ndarray) -> bool:
    """Whether the columns' line offsets are the starts of the lines of the shard's
    items.jsonl, one per item (a shard's items.jsonl edited since prepare wrote both does not)."""
    path = os.path.join(sdir, ITEMS)
    if not os.path.isfile(path):
        raise CorruptDatasetError(f"{path} is missing; {REGENERATE}")
    data = np.fromfile(path, dtype=np.uint8)
    line = cols["line"].astype(np.int64)
    if not len(line):
        return not len(data)
    if line[0] != 0 or (np.diff(line) <= 0).any() or line[-1] >= len(data):
        return False
    newlines = data == 10
    return bool(newlines[line[1:] - 1].all()) and int(newlines.sum()) == len(line)


def _build(
    root: str, metadata: dict, folder: str | None, mirrored: bool = False
) -> tuple[dict, int]:
    """Every shard's columns, checked, concatenated into ``folder`` (None: in memory).
    ``mirrored``: ``root`` is a mirror (data/remote.py): its files' times are those of their
    download, and a shard's arrays are checked when fetched and when first opened, not here."""
    entries = metadata.get("shards", [])
    counts = np.array([int(e.get("num_items") or 0) for e in entries], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype("<i8")
    n = int(starts[-1])
    tmp = f".tmp-{os.getpid()}"
    if folder is None:
        out = {k: np.empty(n, COLUMN_DTYPE[k]) for k in COLUMN_DTYPE.names}
    else:
        out = {
            k: np.lib.format.open_memmap(_path(folder, k) + tmp, "w+", COLUMN_DTYPE[k], (n,))
            if n else np.zeros(0, COLUMN_DTYPE[k])
            for k in COLUMN_DTYPE.names
        }  # fmt: skip
    from_items = 0
    layout = np.full((len(entries), LAYOUT_WIDTH), -1, dtype="<i8")
    for s, entry in enumerate(entries):
        sdir = shard_dir(root, entry)
        cols, parsed = _shard_columns(sdir)
        # (a mirror's file times are those of their download)
        edited = not parsed and not mirrored and _edited_since(sdir)
        if not parsed and (edited or not _lines_match(sdir, cols)):
            # items.jsonl is the record: an index that may not be its own is read again
            logger.warning(f"shard {sdir}: {COLUMNS} does not index its {ITEMS}; reading {ITEMS}")
            cols, parsed = columns_from_items(os.path.join(sdir, ITEMS)), True
        from_items += parsed
        if not mirrored:  # counts, shard.json, arrays, ranges
            layout[s] = layout_row(*check_shard(sdir, root, metadata, entry, cols))
        a, b = int(starts[s]), int(starts[s + 1])
        for k in COLUMN_DTYPE.names:
            out[k][a:b] = cols[k]
    out[STARTS], out[LAYOUT] = starts, layout
    if folder is not None:
        for k in COLUMN_DTYPE.names:
            if n:
                out[k].flush()
                del out[k]
            else:
                _save(_path(folder, k) + tmp, out[k])
            os.replace(_path(folder, k) + tmp, _path(folder, k))
        for name, arr in ((STARTS, starts), (LAYOUT, layout)):
            _save(_path(folder, name) + tmp, arr)
            os.replace(_path(folder, name) + tmp, _path(folder, name))
    return out, from_items


def open_index(
    root: str, metadata: dict, metadata_bytes: bytes, verify: str, remote: bool = False
) -> tuple[dict[str, np.ndarray], IndexInfo]:
    """The dataset's index columns (and ``"starts"``), mapped or built (module docstring);
    ``verify``: ``"none"``, ``"size"`` or ``"full"`` (``check_sizes`` of every shard file by
    every open, except ``"none"``; the sha256s once per dataset, recorded). ``remote``: ``root``
    is a mirror (data/remote.py) that holds the shards' index files and only some of their
    arrays: its sizes were checked against the URL's listing, the arrays are checked (and with
    ``"full"`` hashed) when fetched, and the index is keyed by metadata.json alone."""
    t0 = time.perf_counter()
    entries = metadata.get("shards", [])
    if remote:
        key = f"{INDEX_VERSION}:remote:{hashlib.sha256(metadata_bytes).hexdigest()}"
        verify = "none"  # done by the mirror
    else:
        sha = hashlib.sha256(metadata_bytes).hexdigest()
        key = inherited_key(root, sha)
        if key is None:
            key = index_key(root, metadata_bytes, entries, check=verify != "none")  # sizes
            _CHECKED[root] = [sha, key]
    n_items = sum(int(e.get("num_items") or 0) for e in entries)
    folders = [os.path.join(root, INDEX_DIR), cache_folder(root)]
    for folder in folders:
        meta = _read_meta(folder)
        if meta is not None and meta.get("key") == key:
            cols = _map(folder, meta, n_items, len(entries))
            info = IndexInfo(folder, False, 0, 0.0, bool(meta.get("verified_full")))
            break
    else:
        folder = next((f for f in folders if _writable(f)), None)
        cols, from_items = _build(root, metadata, folder, mirrored=remote)
        info = IndexInfo(folder, True, from_items, 0.0, False)
        meta = {"version": INDEX_VERSION, "key": key, "items": n_items,
                "shards": len(entries), "from_items": from_items,
                "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
        if folder is not None:
            write_json_atomic(os.path.join(folder, INDEX_META), meta)
            cols = _map(folder, meta, n_items, len(entries))
        if from_items:
            where = (f"saved to {folder}: later opens map it" if folder else
                     f"kept in memory ({folders[0]} and {folders[1]} are not writable): every "
                     "open reads items.jsonl again")  # fmt: skip
            logger.warning(
                f"prepared dataset {root}: {from_items} of {len(entries)} shards have no "
                f"{COLUMNS} (prepared before the columnar index); their index was read from "
                f"{ITEMS} ({time.perf_counter() - t0:.1f} s) and {where}"
            )
    info.build_s = time.perf_counter() - t0 if info.built else 0.0
    if verify == "full" and not info.verified_full:
        t1 = time.perf_counter()
        check_sizes(root, entries, checksums=True)  # every byte, once per dataset
        info.verify_s = time.perf_counter() - t1
        info.verified_full = True
        if folder is not None:
            write_json_atomic(os.path.join(folder, INDEX_META), dict(meta, verified_full=True))
    info.seconds = time.perf_counter() - t0
    return cols, info
