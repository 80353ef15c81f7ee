"""Prepared datasets on object storage (any fsspec URL: ``s3://``, ``gs://``, ``az://``, ...),
read through a local mirror.

Training memory-maps its shards (data/shard_files.py), so a dataset at a URL is mirrored into a
local folder (``speechlm_data.remote_cache_dir``, one subfolder per URL) in two parts:

- when the dataset is opened: ``metadata.json`` and each shard's small index files
  (``shard.json``, ``columns.npy``, ``items.jsonl``, ``waves.jsonl``: about 100 bytes per
  item), fetched in one batched call, after one listing of the URL has checked every shard
  file's size against the one metadata.json recorded (``verify_shards`` "size" and "full");
- when a rank first reads a shard: its arrays (text tokens, codes, waveforms), checked against
  the recorded size (and sha256, with ``verify_shards = "full"``) before they are used. These
  are a cache bounded by ``speechlm_data.remote_cache_gb``: the shards read least recently are
  deleted first, never one this process has open (a rank that maps a file another process
  deletes keeps reading it: POSIX keeps the data until the map is closed).

Every file lands under a temporary name and is renamed, so the ranks of a node that share the
mirror never read half a file; two ranks fetching one shard at once both write it whole. A
dataset whose metadata.json changed at the URL (prepared again) is mirrored again from scratch.

Credentials and endpoints are fsspec's and the storage library's own (for S3: s3fs and botocore,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or ``AWS_PROFILE``, ``AWS_ENDPOINT_URL`` for an
S3-compatible server; ``FSSPEC_S3_*`` variables for any s3fs option). A URL that cannot be read
(no credentials, no bucket, nothing there) is one ``RemoteDatasetError`` line naming it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass

from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.data.format import (
    AUDIO_CODES,
    AUDIO_WAVE,
    COLUMNS,
    ITEMS,
    METADATA,
    REGENERATE,
    SHARD_META,
    SHARDS_DIR,
    TEXT_TOKENS,
    WAVE_INDEX,
    CorruptDatasetError,
    check_recorded,
)
from torchtitan_speechlm.utils.upstream import logger

ARRAYS = (TEXT_TOKENS, AUDIO_CODES, AUDIO_WAVE)  # fetched when a shard is first read
SMALL = (SHARD_META, COLUMNS, ITEMS, WAVE_INDEX)  # fetched when the dataset is opened
LOW_WATER = 0.9  # a full mirror is cut to this share of remote_cache_gb
SOURCE = "source.url"  # the mirror's URL, beside its files (which URL a folder mirrors)


class RemoteDatasetError(ConfigError):
    """A dataset URL that cannot be read: the message is one line naming the URL and why."""


def is_url(path: str) -> bool:
    """Whether ``path`` is an fsspec URL of a remote store (``file://`` is a local path)."""
    proto, sep, _ = str(path).partition("://")
    return bool(sep) and proto not in ("", "file", "local")


def local_path(path: str) -> str:
    """A local dataset path as the catalog keys it (absolute); a URL unchanged."""
    return path.rstrip("/") if is_url(path) else os.path.abspath(path)


@dataclass(frozen=True)
class RemoteCache:
    """``speechlm_data.remote_cache_dir`` ("" = ``~/.cache/torchtitan_speechlm/remote``) and
    ``remote_cache_gb`` (the shard arrays a mirror keeps)."""

    folder: str = ""
    max_gb: float = 100.0

    def root(self, url: str) -> str:
        base = self.folder or os.path.join(
            os.path.expanduser("~"), ".cache", "torchtitan_speechlm", "remote"
        )
        return os.path.join(base, hashlib.sha256(url.encode()).hexdigest()[:16])


def _why(e: BaseException) -> str:
    """A storage library's exception as the reason of one line."""
    name = type(e).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError") or isinstance(e, PermissionError):
        return (
            f"no credentials or access denied ({e}); set the store's credentials (for S3: "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE; AWS_ENDPOINT_URL for an "
            "S3-compatible server)"
        )
    if isinstance(e, FileNotFoundError) and "bucket" in str(e).lower():
        return f"the bucket does not exist ({e})"
    if isinstance(e, ImportError):
        return f"this URL's protocol needs a package that is not installed ({e})"
    return f"{name}: {e}"


def filesystem(url: str):
    """fsspec's filesystem and path for ``url``; a missing protocol package is one line."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise RemoteDatasetError(f"cannot read {url}: {_why(e)}") from None


class Mirror:
    """The local mirror of the prepared dataset at ``url`` (module docstring)."""

    def __init__(self, url: str, cache: RemoteCache | None = None):
        self.url = url.rstrip("/")
        self.cache = cache or RemoteCache()
        self.root = self.cache.root(self.url)
        self.fs, self.base = filesystem(self.url)
        self.max_bytes = int(self.cache.max_gb * 2**30)
        self._sizes: dict[str, int] | None = None  # the mirror's arrays: path -> bytes (a scan)
        self.fetched = 0  # shard arrays fetched by this process

    # ---- the dataset's index -----------------------------------------------------------------
    def metadata(self) -> bytes:
        """metadata.json's bytes, fetched; a mirror of another version of it is wiped first."""
        try:
            data = self.fs.cat_file(f"{self.base}/{METADATA}")
        except FileNotFoundError as e:
            if "bucket" in str(e).lower():
                raise RemoteDatasetError(f"cannot read {self.url}: {_why(e)}") from None
            raise RemoteDatasetError(
                f"{self.url}/{METADATA} not found: not a prepared dataset (or an unfinished one: "
                "metadata.json is written last); create it with `torchtitan prepare --out-dir "
                f"{self.url}`"
            ) from None
        except Exception as e:  # the storage library's own errors (botocore, gcsfs, ...)
            raise RemoteDatasetError(f"cannot read {self.url}: {_why(e)}") from None
        local = os.path.join(self.root, METADATA)
        if os.path.isfile(local) and _read_bytes(local) != data:
            logger.warning(f"{self.url}: metadata.json changed since {self.root} mirrored it; "
                           "mirroring it again")  # fmt: skip
            shutil.rmtree(self.root, ignore_errors=True)
        os.makedirs(self.root, exist_ok=True)
        _write_atomic(os.path.join(self.root, SOURCE), self.url.encode())
        _write_atomic(local, data)
        return data

    def index_files(self, metadata: dict, sizes: bool = True) -> None:
        """Every shard's small files, fetched where the mirror lacks them; ``sizes``: first one
        listing of the URL checks every recorded shard file's size (``CorruptDatasetError``
        naming the URL of the first that differs or is missing)."""
        entries = metadata.get("shards", [])
        if sizes:
            listed = self._listing()
            for entry in entries:
                for name, want in files_of(metadata, entry).items():
                    rel = f"{SHARDS_DIR}/{entry.get('name')}/{name}"
                    have = listed.get(rel)
                    if have is None:
                        raise CorruptDatasetError(f"{self.url}/{rel} is missing; {REGENERATE}")
                    if have != want.get("bytes"):
                        raise CorruptDatasetError(
                            f"{self.url}/{rel} has {have} bytes but metadata.json recorded "
                            f"{want.get('bytes')} (truncated or modified after the dataset was "
                            f"prepared); {REGENERATE}"
                        )
        wanted = []
        for entry in entries:
            files = files_of(metadata, entry)
            for name in SMALL:
                rel = f"{SHARDS_DIR}/{entry.get('name')}/{name}"
                if name not in files and name != SHARD_META:
                    continue  # not part of this dataset (no waveforms; before columns.npy)
                if not _present(os.path.join(self.root, rel), files.get(name)):
                    wanted.append((rel, files.get(name)))
        if wanted:
            t0 = time.perf_counter()
            self._get(wanted, checksums=False)
            logger.info(f"{self.url}: fetched the index files of {len(entries)} shards "
                        f"({len(wanted)} files) in {time.perf_counter() - t0:.1f} s")  # fmt: skip

    def _listing(self) -> dict[str, int]:
        """Every object under the URL's shards/ with its size (one paginated listing)."""
        prefix = f"{self.base}/{SHARDS_DIR}/"
        try:
            found = self.fs.find(prefix, detail=True)
        except Exception as e:
            raise RemoteDatasetError(f"cannot list {self.url}/{SHARDS_DIR}: {_why(e)}") from None
        return {k[len(self.base) + 1 :]: int(v.get("size") or 0) for k, v in found.items()}

    # ---- a shard's arrays --------------------------------------------------------------------
    def shard_arrays(self, files: dict, name: str, checksums: bool,
                     keep: Iterable[str] = ()) -> None:  # fmt: skip
        """The shard's arrays in the mirror (fetched if absent; touched if present), then the
        mirror's arrays cut to ``remote_cache_gb``, sparing the shard folders in ``keep``.
        ``files``: ``files_of`` the shard ``name``."""
        sdir = f"{SHARDS_DIR}/{name}"
        wanted = [(f"{sdir}/{n}", files.get(n)) for n in ARRAYS
                  if n in files or n != AUDIO_WAVE]  # fmt: skip
        missing, now = [], time.time()
        for rel, want in wanted:
            if _present(self._abs(rel), want):
                os.utime(self._abs(rel), (now, now))  # read recently: evicted last
            else:
                missing.append((rel, want))
        if not missing:
            return
        self._get(missing, checksums)
        self.fetched += 1
        sizes = self._scan()
        for rel, want in missing:
            sizes[rel] = int((want or {}).get("bytes") or 0)
        self._evict(sizes, {os.path.join(self.root, k) for k in keep} | {self._abs(sdir)})

    def _abs(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def _scan(self) -> dict[str, int]:
        """The arrays in the mirror with their sizes: scanned once, then kept up to date by
        this process (rescanned when over the limit: other processes fetch too)."""
        if self._sizes is None:
            self._sizes = self._scan_disk()
        return self._sizes

    def _scan_disk(self) -> dict[str, int]:
        out = {}
        shards = os.path.join(self.root, SHARDS_DIR)
        for d in os.scandir(shards) if os.path.isdir(shards) else ():
            for name in ARRAYS:
                try:
                    out[f"{SHARDS_DIR}/{d.name}/{name}"] = os.stat(
                        os.path.join(d.path, name)
                    ).st_size
                except FileNotFoundError:
                    pass
        return out

    def _evict(self, sizes: dict[str, int], keep: set[str]) -> None:
        """Over ``remote_cache_gb``: rescan the mirror (what every process of the node has
        fetched) and delete the arrays read least recently down to ``LOW_WATER`` of it, so that
        the scan (a ``stat`` per shard folder) runs once per tenth of the cache fetched, not
        once per fetch of a full cache."""
        if sum(sizes.values()) <= self.max_bytes:
            return
        self._sizes = sizes = self._scan_disk()
        total = sum(sizes.values())
        by_age = []
        for rel in sizes:
            try:
                by_age.append((os.stat(self._abs(rel)).st_mtime, rel))
            except FileNotFoundError:
                total -= sizes[rel]
        for _, rel in sorted(by_age):
            if total <= LOW_WATER * self.max_bytes:
                break
            if os.path.dirname(self._abs(rel)) in keep:
                continue
            try:
                os.remove(self._abs(rel))
            except FileNotFoundError:
                pass
            total -= sizes.pop(rel)

    # ---- fetching ----------------------------------------------------------------------------
    def _get(self, files: list[tuple[str, dict | None]], checksums: bool) -> None:
        """``files`` (mirror-relative path, metadata.json's record of it) fetched in one batched
        call under temporary names, checked, then renamed into place."""
        tag = f".part-{os.getpid()}"
        remote = [f"{self.base}/{rel}" for rel, _ in files]
        local = [self._abs(rel) + tag for rel, _ in files]
        for path in local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            self.fs.get(remote, local)
        except FileNotFoundError as e:
            raise CorruptDatasetError(
                f"{self.url}: a shard file is missing ({e}); {REGENERATE}"
            ) from None
        except Exception as e:
            raise RemoteDatasetError(f"cannot read {self.url}: {_why(e)}") from None
        try:
            for (rel, want), path in zip(files, local, strict=True):
                _check(path, f"{self.url}/{rel}", want, checksums)
                os.replace(path, self._abs(rel))
        finally:
            for path in local:
                if os.path.exists(path):
                    os.remove(path)


def files_of(metadata: dict, entry: dict) -> dict:
    """A shard's files as metadata.json records them (size, sha256): its own and, for a dataset
    with waveforms (prepare/waveforms.py), those recorded under ``waveform``."""
    waves = (metadata.get("waveform") or {}).get("files", {}).get(str(entry.get("name"))) or {}
    return {**(entry.get("files") or {}), **waves}


def _present(path: str, want: dict | None) -> bool:
    """Whether the mirror holds ``path`` whole (its recorded size, where one is recorded)."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return False
    return want is None or size == want.get("bytes")


def _check(path: str, url: str, want: dict | None, checksums: bool) -> None:
    if want:
        check_recorded(path, want, checksums, name=url)


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.part-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def staging_folder(url: str) -> str:
    """Where ``torchtitan prepare --out-dir URL`` prepares the dataset before uploading it."""
    base = os.path.join(os.path.expanduser("~"), ".cache", "torchtitan_speechlm", "upload")
    return os.path.join(base, hashlib.sha256(url.encode()).hexdigest()[:16])


def upload(local_root: str, url: str) -> int:
    """A prepared dataset written locally, put at ``url``: every file but metadata.json first
    (those already there with the same size are skipped: a rerun puts what is missing), then
    metadata.json, so that a reader never sees a dataset without all its shards. Returns the
    files put."""
    fs, base = filesystem(url.rstrip("/"))
    try:
        there = {k[len(base) + 1 :]: int(v.get("size") or 0)
                 for k, v in fs.find(base, detail=True).items()}  # fmt: skip
    except FileNotFoundError:
        there = {}
    except Exception as e:
        raise RemoteDatasetError(f"cannot write {url}: {_why(e)}") from None
    put_local, put_remote = [], []
    for dirpath, _, names in os.walk(local_root):
        for name in sorted(names):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, local_root).replace(os.sep, "/")
            if rel == METADATA or rel.split("/")[0] in ("index", ".lock") or ".tmp" in name:
                continue
            if there.get(rel) != os.path.getsize(path):
                put_local.append(path)
                put_remote.append(f"{base}/{rel}")
    try:
        if put_local:
            fs.put(put_local, put_remote)
        fs.put_file(os.path.join(local_root, METADATA), f"{base}/{METADATA}")
    except Exception as e:
        raise RemoteDatasetError(f"cannot write {url}: {_why(e)}") from None
    return len(put_local) + 1
