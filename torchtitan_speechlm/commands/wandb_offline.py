"""Read an offline wandb run (``run-*.wandb``) back without syncing it anywhere.

wandb >= 0.19 writes runs from its Go core and no longer ships a Python reader. The file is a
LevelDB-style record log (a 7-byte ``:W&B`` header, then 32 KiB blocks of records: crc32c(4),
length(2), type(1), payload) whose payloads are wandb's own ``Record`` protobufs; we decode them
with wandb's generated ``wandb_internal_pb2`` so the history is exactly what ``wandb sync`` would
upload. Usage: ``python -m torchtitan_speechlm.commands.wandb_offline RUN_DIR`` prints the logged keys;
RUN_DIR is an ``offline-run-*`` folder, a ``run-*.wandb`` file, or any folder above them such as
a run's dump folder (its runs are under ``tb/<time>/wandb/``; each one found is read).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import struct
import sys
from collections.abc import Iterator

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb run file (missing :W&B header)")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        block_left = _BLOCK - pos % _BLOCK
        if block_left < _HEADER:  # block trailer padding
            pos += block_left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:  # zero padding: skip to the next block
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
            continue
        if kind == _FULL:
            yield payload
        elif kind == _FIRST:
            pending = payload
        elif kind == _MIDDLE:
            pending += payload
        elif kind == _LAST:
            yield pending + payload
            pending = b""


def find_runs(path: str) -> list[str]:
    """The ``run-*.wandb`` files of ``path``: the file itself, the one in an ``offline-run-*``
    folder, or those of every offline run below a folder (e.g. a dump folder, whose runs are
    ``tb/<time>/wandb/offline-run-*``; one per start of the job), oldest first."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such file or folder")
    here = glob.glob(os.path.join(path, "run-*.wandb"))
    if here:
        return sorted(here)
    found = glob.glob(os.path.join(path, "**", "offline-run-*", "run-*.wandb"), recursive=True)
    if not found:
        raise FileNotFoundError(
            f"no offline wandb run (offline-run-*/run-*.wandb) in or below {path}"
        )
    return sorted(found, key=lambda f: (os.path.basename(os.path.dirname(f)), f))


def read_history(run_dir_or_file: str) -> list[dict]:
    """Every ``wandb.log`` call of an offline run, as {"_step": n, key: value, ...} dicts.
    ``run_dir_or_file``: anything :func:`find_runs` takes that holds exactly one run."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = find_runs(run_dir_or_file)
    if len(runs) > 1:
        listed = "\n  ".join(os.path.dirname(r) for r in runs)
        raise ValueError(
            f"{run_dir_or_file} holds {len(runs)} offline wandb runs; name one:\n  {listed}"
        )
    path = runs[0]
    rows = []
    for payload in _records(path):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        if record.history.HasField("step"):
            row.setdefault("_step", record.history.step.num)
        rows.append(row)
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_speechlm.commands.wandb_offline",
        description="Print the history rows and logged keys of offline wandb runs.",
    )
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="an offline-run-* folder, its run-*.wandb file, or a folder above them such as a "
        "dump folder (every run under its tb/<time>/wandb/ is read, oldest first)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        runs = find_runs(a.run_dir)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for i, run in enumerate(runs):
        rows = read_history(run)
        keys = sorted({k for r in rows for k in r})
        if len(runs) > 1:
            print(("\n" if i else "") + f"run {i + 1} of {len(runs)}: {os.path.dirname(run)}")
        print(f"{len(rows)} history rows; keys:\n  " + "\n  ".join(keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
