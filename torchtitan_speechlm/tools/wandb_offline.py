"""Read an offline wandb run (``run-*.wandb``) back without syncing it anywhere.

wandb >= 0.19 writes runs from its Go core and no longer ships a Python reader. The file is a
LevelDB-style record log (a 7-byte ``:W&B`` header, then 32 KiB blocks of records: crc32c(4),
length(2), type(1), payload) whose payloads are wandb's own ``Record`` protobufs; we decode them
with wandb's generated ``wandb_internal_pb2`` so the history is exactly what ``wandb sync`` would
upload. Usage: ``python -m torchtitan_speechlm.tools.wandb_offline RUN_DIR`` prints the logged keys.
"""

from __future__ import annotations

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


def read_history(run_dir_or_file: str) -> list[dict]:
    """Every ``wandb.log`` call of an offline run, as {"_step": n, key: value, ...} dicts."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = run_dir_or_file
    if os.path.isdir(path):
        files = glob.glob(os.path.join(path, "run-*.wandb"))
        if not files:
            raise FileNotFoundError(f"no run-*.wandb file in {path}")
        path = files[0]
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m torchtitan_speechlm.tools.wandb_offline RUN_DIR", file=sys.stderr)
        return 2
    rows = read_history(argv[0])
    keys = sorted({k for r in rows for k in r})
    print(f"{len(rows)} history rows; keys:\n  " + "\n  ".join(keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
