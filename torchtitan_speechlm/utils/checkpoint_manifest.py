"""Checkpoints that prove themselves: ``step-N/.manifest.json`` lists every file of the
checkpoint with its size and CRC-32C, written last (after DCP's ``.metadata``), and is checked
before a rerun loads the step.

Flipped or truncated bytes in a ``.distcp`` or in ``.metadata`` loaded silently (NaN losses
blamed on the data, a new checkpoint saved with NaN weights) or ended in a bare ``EOFError`` /
``UnpicklingError``; with the manifest the damage is named (the file and what differs) and the
newest intact step is loaded instead (trainer/run.py ``choose_intact_step``).

Rank 0 writes ``.manifest.pending`` into the step folder before any rank writes (the save
workaround in utils/compat.py) and replaces it with the manifest once DCP's save returned (by
then every rank's files and ``.metadata`` are written). A folder with ``.metadata`` and the
marker is a save stopped before its manifest: not intact. A folder with neither was written
before manifests existed and loads with a warning, but only where no step beside it has a
manifest and it carries no identity file: a manifest missing from one step of a run whose
other steps have theirs was deleted or lost, and that step is damaged (the newest intact one
is loaded instead), never taken as a legacy step loaded unverified.

**Identity.** Each step also carries what its rows mean: the codec, the text tokenizer, the
vocabulary layout and the data order it was trained with (``IDENTITY``, a file written with
the pending marker, so the manifest lists and sums it, and repeated in the manifest). The
trainer sets it for its run's checkpoint folder (``set_identity``) and components/resume.py checks it on every load, whatever
else the dump folder holds: a checkpoint folder copied into a new dump folder still refuses
data made with another codec.

The checksum is CRC-32C computed in hardware (the ``crc32c`` package; zlib's CRC-32 where it is
missing, recorded in the manifest), which releases the GIL: the files are summed in parallel
threads. Each rank sums the files it writes as DCP writes them (``install_stream_sums``: no file is
read again); what was written otherwise (``.metadata``) is read back right after the save. Its cost is measured by
benchmarks/bench_checkpoint_manifest.py (results/checkpoint_manifest_cpu.json).
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

MANIFEST = ".manifest.json"
PENDING = ".manifest.pending"
IDENTITY = "speechlm_identity.json"
MANIFEST_VERSION = 2  # 2: the manifest repeats the step's identity
_CHUNK = 8 << 20
_IDENTITY: dict = {}  # {"folder": checkpoint folder, "identity": ...} (set_identity)


def set_identity(identity: dict | None, folder: str | None = None) -> None:
    """What this process's saves into the checkpoint folder ``folder`` record as their
    identity (None: nothing; a save elsewhere records none)."""
    _IDENTITY.clear()
    if identity and folder:
        _IDENTITY.update(folder=os.path.abspath(folder), identity=dict(identity))


def read_identity(step_dir: str) -> dict | None:
    """A step's identity: its ``IDENTITY`` file, else its manifest's copy; None when it has
    neither (a step written before checkpoints carried one). A file that cannot be read is
    None too: the manifest's check names the damage."""
    for name, key in ((IDENTITY, None), (MANIFEST, "identity")):
        try:
            with open(os.path.join(step_dir, name)) as f:
                body = json.load(f)
        except (OSError, ValueError):
            continue
        found = body.get(key) if key else body
        if isinstance(found, dict) and found:
            return found
    return None


SUM = ".sum"  # "{file}.sum": "{size} {checksum}", summed while the file was written


def _files(step_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            if name in (MANIFEST, PENDING) or name.endswith((".tmp", SUM)):
                continue
            out.append(os.path.relpath(os.path.join(root, name), step_dir))
    return sorted(out)


try:  # CRC-32C in hardware (SSE4.2 / ARMv8): ~4x zlib's CRC-32 (the benchmark)
    from crc32c import crc32c as _crc32c

    CHECKSUM = "crc32c"
except ImportError:  # the package is a dependency; a copy without it uses zlib's CRC-32
    _crc32c = None
    CHECKSUM = "crc32"


def _update(kind: str, data, value: int) -> int:
    if kind == "crc32c":
        return _crc32c(data, value=value)
    return zlib.crc32(data, value)


def file_checksum(path: str, kind: str = CHECKSUM) -> str:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = _update(kind, view[:n], crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class _SummingStream:
    """DCP's file stream, summing the bytes as they are written (no re-read after the save)."""

    def __init__(self, stream) -> None:
        self._stream, self.crc, self.size, self.sequential = stream, 0, 0, True

    def write(self, data):
        n = self._stream.write(data)
        view = memoryview(data).cast("B")
        view = view if n is None else view[:n]
        self.crc = _update(CHECKSUM, view, self.crc)
        self.size += len(view)
        return n

    def seek(self, *args):
        self.sequential = False  # summed by reading the file instead
        return self._stream.seek(*args)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def install_stream_sums() -> None:
    """Sum each file of a ``step-N`` checkpoint as DCP writes it, into ``{file}.sum`` (every
    rank its own files; rank 0's manifest collects them). Idempotent."""
    from contextlib import contextmanager

    from torch.distributed.checkpoint.filesystem import FileSystem

    if getattr(FileSystem, "_speechlm_sums", False):
        return
    original = FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        summing = None
        with original(self, path, mode) as stream:
            folder = os.path.basename(os.path.dirname(str(path)))
            if "w" in mode and folder.startswith("step-") and _crc32c is not None:
                summing = _SummingStream(stream)
                yield summing
            else:
                yield stream
        if summing is not None and summing.sequential:
            with open(str(path) + SUM, "w") as f:
                f.write(f"{summing.size} {summing.crc & 0xFFFFFFFF:08x}")

    FileSystem.create_stream = create_stream
    FileSystem._speechlm_sums = True
    FileSystem._speechlm_plain_create_stream = original  # the benchmark's save without


def _summed(path: str) -> str:
    """The checksum summed while ``path`` was written, if its size still matches, else read."""
    try:
        with open(path + SUM) as f:
            size, crc = f.read().split()
        if int(size) == os.path.getsize(path):
            return crc
    except (OSError, ValueError):
        pass
    return file_checksum(path)


def describe(step_dir: str) -> dict[str, dict]:
    """``{relative path: {"size", "checksum"}}`` of every file of the checkpoint: summed as
    written, else (``.metadata``, a file written another way) read back in parallel."""
    names = _files(step_dir)
    paths = [os.path.join(step_dir, n) for n in names]
    with ThreadPoolExecutor(_workers()) as pool:
        crcs = list(pool.map(_summed, paths))
    return {
        n: {"size": os.path.getsize(p), "checksum": c}
        for n, p, c in zip(names, paths, crcs, strict=True)
    }


def mark_pending(step_dir: str) -> None:
    """Before a save writes anything: the folder is not intact until its manifest is written;
    the step's identity (``set_identity``) is written beside the marker."""
    os.makedirs(step_dir, exist_ok=True)
    manifest = os.path.join(step_dir, MANIFEST)
    if os.path.exists(manifest):
        os.remove(manifest)
    with open(os.path.join(step_dir, PENDING), "w") as f:
        f.write("a save is writing this checkpoint; it is not intact until .manifest.json\n")
    if _IDENTITY and os.path.dirname(os.path.abspath(step_dir)) == _IDENTITY["folder"]:
        with open(os.path.join(step_dir, IDENTITY), "w") as f:
            json.dump(_IDENTITY["identity"], f, indent=1, sort_keys=True)


def write_manifest(step_dir: str) -> dict:
    """After the save: the manifest of every file (tmp + rename, then the marker goes)."""
    files = describe(step_dir)
    body = {"version": MANIFEST_VERSION, "checksum": CHECKSUM, "files": files}
    identity = read_identity(step_dir)
    if identity:
        body["identity"] = identity
    tmp = os.path.join(step_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, MANIFEST))
    pending = os.path.join(step_dir, PENDING)
    if os.path.exists(pending):
        os.remove(pending)
    for root, _, names in os.walk(step_dir):
        for name in names:
            if name.endswith(SUM):
                os.remove(os.path.join(root, name))
    return body


LEGACY = "no manifest (written before checkpoints had one)"


def manifested_siblings(step_dir: str) -> list[str]:
    """The other ``step-N`` folders beside ``step_dir`` that have a manifest."""
    parent, own = os.path.split(os.path.abspath(step_dir))
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith("step-") and n != own
                  and os.path.isfile(os.path.join(parent, n, MANIFEST)))  # fmt: skip


def verify(step_dir: str, checksums: bool = True) -> str:
    """ "" if every file the manifest lists has its size and checksum and nothing is missing;
    ``LEGACY`` when there is no manifest, no pending marker, no identity file and no sibling
    step with a manifest (a run from before manifests); else what differs (the file and the
    difference). ``checksums=False``: sizes only (no file is read)."""
    manifest = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(manifest):
        if os.path.isfile(os.path.join(step_dir, PENDING)):
            return (
                f"{step_dir} has {PENDING} and no {MANIFEST}: its save was stopped before the "
                "checkpoint was confirmed"
            )
        siblings = manifested_siblings(step_dir)
        if siblings or os.path.isfile(os.path.join(step_dir, IDENTITY)):
            beside = (
                f"its sibling {', '.join(siblings[:3])} ha{'ve' if len(siblings) > 1 else 's'} one"
                if siblings
                else f"it carries {IDENTITY}, written with one"
            )
            return (
                f"{manifest} is missing although {beside}: deleted or lost, so its files "
                "cannot be checked"
            )
        return LEGACY
    try:
        with open(manifest) as f:
            body = json.load(f)
        files, kind = body["files"], body["checksum"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{manifest} is unreadable ({type(e).__name__}: {e})"
    for name, want in sorted(files.items()):
        path = os.path.join(step_dir, name)
        if not os.path.isfile(path):
            return f"{path} is missing"
        size = os.path.getsize(path)
        if size != want["size"]:
            return f"{path} has {size} bytes, its manifest says {want['size']} (truncated or grown)"
    if not checksums or (kind == "crc32c" and _crc32c is None):
        return ""  # sizes only (without the crc32c package no CRC-32C can be computed)
    names = sorted(files)
    with ThreadPoolExecutor(_workers()) as pool:
        paths = [os.path.join(step_dir, n) for n in names]
        crcs = list(pool.map(lambda p: file_checksum(p, kind), paths))
    label = {"crc32c": "CRC-32C", "crc32": "CRC-32"}.get(kind, kind)
    for name, crc in zip(names, crcs, strict=True):
        if crc != files[name]["checksum"]:
            return (
                f"{os.path.join(step_dir, name)} has {label} {crc}, its manifest says "
                f"{files[name]['checksum']} (bytes changed on disk)"
            )
    return ""
