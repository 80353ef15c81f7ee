"""Checkpoints that prove themselves: ``step-N/.manifest.json`` lists every file of the
checkpoint with its size and CRC-32, written last (after DCP's ``.metadata``), and is checked
before a rerun loads the step.

Flipped or truncated bytes in a ``.distcp`` or in ``.metadata`` loaded silently (NaN losses
blamed on the data, a new checkpoint saved with NaN weights) or ended in a bare ``EOFError`` /
``UnpicklingError``; with the manifest the damage is named (the file and what differs) and the
newest intact step is loaded instead (trainer/run.py ``choose_intact_step``).

Rank 0 writes ``.manifest.pending`` into the step folder before any rank writes (the save
workaround in utils/compat.py) and replaces it with the manifest once DCP's save returned (by
then every rank's files and ``.metadata`` are written). A folder with ``.metadata`` and the
marker is a save stopped before its manifest: not intact. A folder with neither (written before
manifests existed) loads with a warning.

The checksum is zlib's CRC-32 (stdlib; it releases the GIL, so the files are summed in
parallel threads, read back from the page cache right after the save). Its cost is measured by
benchmarks/bench_checkpoint_manifest.py (results/checkpoint_manifest_cpu.json).
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

MANIFEST = ".manifest.json"
PENDING = ".manifest.pending"
_CHUNK = 8 << 20


def _files(step_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            if name in (MANIFEST, PENDING) or name.endswith(".tmp"):
                continue
            out.append(os.path.relpath(os.path.join(root, name), step_dir))
    return sorted(out)


def file_crc32(path: str) -> str:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def describe(step_dir: str) -> dict[str, dict]:
    """``{relative path: {"size", "crc32"}}`` of every file of the checkpoint, summed in
    parallel."""
    names = _files(step_dir)
    paths = [os.path.join(step_dir, n) for n in names]
    with ThreadPoolExecutor(_workers()) as pool:
        crcs = list(pool.map(file_crc32, paths))
    return {
        n: {"size": os.path.getsize(p), "crc32": c}
        for n, p, c in zip(names, paths, crcs, strict=True)
    }


def mark_pending(step_dir: str) -> None:
    """Before a save writes anything: the folder is not intact until its manifest is written."""
    os.makedirs(step_dir, exist_ok=True)
    manifest = os.path.join(step_dir, MANIFEST)
    if os.path.exists(manifest):
        os.remove(manifest)
    with open(os.path.join(step_dir, PENDING), "w") as f:
        f.write("a save is writing this checkpoint; it is not intact until .manifest.json\n")


def write_manifest(step_dir: str) -> dict:
    """After the save: the manifest of every file (tmp + rename, then the marker goes)."""
    files = describe(step_dir)
    body = {"version": 1, "checksum": "crc32", "files": files}
    tmp = os.path.join(step_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, MANIFEST))
    pending = os.path.join(step_dir, PENDING)
    if os.path.exists(pending):
        os.remove(pending)
    return body


LEGACY = "no manifest (written before checkpoints had one)"


def verify(step_dir: str, checksums: bool = True) -> str:
    """ "" if every file the manifest lists has its size and CRC-32 and nothing is missing;
    ``LEGACY`` when there is no manifest and no pending marker; else what differs (the file
    and the difference). ``checksums=False``: sizes only (no file is read)."""
    manifest = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(manifest):
        if os.path.isfile(os.path.join(step_dir, PENDING)):
            return (
                f"{step_dir} has {PENDING} and no {MANIFEST}: its save was stopped before the "
                "checkpoint was confirmed"
            )
        return LEGACY
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{manifest} is unreadable ({type(e).__name__}: {e})"
    for name, want in sorted(files.items()):
        path = os.path.join(step_dir, name)
        if not os.path.isfile(path):
            return f"{path} is missing"
        size = os.path.getsize(path)
        if size != want["size"]:
            return f"{path} has {size} bytes, its manifest says {want['size']} (truncated or grown)"
    if not checksums:
        return ""
    names = sorted(files)
    with ThreadPoolExecutor(_workers()) as pool:
        crcs = list(pool.map(file_crc32, [os.path.join(step_dir, n) for n in names]))
    for name, crc in zip(names, crcs, strict=True):
        if crc != files[name]["crc32"]:
            return (
                f"{os.path.join(step_dir, name)} has CRC-32 {crc}, its manifest says "
                f"{files[name]['crc32']} (bytes changed on disk)"
            )
    return ""
