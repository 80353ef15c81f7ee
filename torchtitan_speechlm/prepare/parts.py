"""``torchtitan prepare`` as N independent parts (``--part i/N``, torchrun, a SLURM array).

Part ``i`` of ``N`` encodes the shards ``j`` with ``j % N == i`` of the one plan that every
part derives from the same source and settings, into the same ``--out-dir``; nothing but finished
shards is shared, so parts run on any mix of processes, GPUs and machines (one file system).
The last part to find every shard finished joins them (``finalize``: failures.jsonl,
summary.json, metadata.json); ``torchtitan prepare --join OUT`` does the same by hand and
refuses, naming the missing shards and their parts, while any is missing. The joined dataset
is the one a one-part run writes, byte for byte (same shards, same order, same metadata.json).

Locks (``OUT/.prepare/``, advisory ``fcntl.flock``): a part holds an exclusive lock on
``part-I-of-N.lock`` (its host, PID and run id) for as long as it runs; ``lock`` is a mutex held
for the short checks at the start and for the join. A part refuses to start while a live part of
another run (another plan, i.e. source, codec, tokenizer or shard settings), or the same part of
this run, holds ``OUT``; a lock file nobody holds is stale and removed. A part only ever deletes
temporary shard folders of its own shards, so it never touches another live part's work.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
from dataclasses import replace

from torchtitan_speechlm.data.format import codec_of, shard_name
from torchtitan_speechlm.utils.fileio import json_hash, write_json_atomic

STATE_DIR = ".prepare"  # OUT/.prepare: locks, part records, the whole-corpus checks
CHECKS = "checks.json"


class PartError(ValueError):
    """A bad ``--part``, a held ``--out-dir``, or a join with shards missing."""


def parse_part(spec: str | None, env: dict | None = None) -> tuple[int, int]:
    """``(i, N)`` of this part: ``--part i/N``, else torchrun's ``RANK``/``WORLD_SIZE``, else a
    SLURM array's ``SLURM_ARRAY_TASK_ID``/``SLURM_ARRAY_TASK_COUNT`` (task ids from 0, as
    ``--array=0-(N-1)``), else ``srun``'s ``SLURM_PROCID``/``SLURM_NTASKS``, else ``(0, 1)``."""
    env = os.environ if env is None else env
    if spec is not None:
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
        if not m:
            raise PartError(f"--part {spec!r}: give I/N, e.g. 0/4 (parts 0..N-1)")
        i, n = int(m.group(1)), int(m.group(2))
        where = f"--part {spec}"
    else:
        for a, b in (("RANK", "WORLD_SIZE"), ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"),
                     ("SLURM_PROCID", "SLURM_NTASKS")):  # fmt: skip
            if a in env and b in env:
                i, n, where = int(env[a]), int(env[b]), f"{a}={env[a]} {b}={env[b]}"
                if a == "SLURM_ARRAY_TASK_ID" and "SLURM_ARRAY_TASK_MIN" in env:
                    i -= int(env["SLURM_ARRAY_TASK_MIN"])  # --array=1-N counts from 1
                break
        else:
            return 0, 1
    if n < 1 or not 0 <= i < n:
        raise PartError(f"{where}: part {i} of {n} is not one of 0..{n - 1}")
    return i, n


def part_device(device: str, env: dict | None = None) -> str:
    """The codec device of this part: ``cuda`` becomes ``cuda:LOCAL_RANK`` (torchrun) or
    ``cuda:SLURM_LOCALID`` where set (modulo the GPUs this process sees); an explicit
    ``cuda:K`` or other device is kept."""
    env = os.environ if env is None else env
    if device != "cuda":
        return device
    for k in ("LOCAL_RANK", "SLURM_LOCALID"):
        if k in env:
            return f"cuda:{int(env[k]) % max(count, 1) if (count := _cuda_count()) else env[k]}"
    return device


def _cuda_count() -> int:
    """GPUs this process sees (0 without CUDA): a task that sees only its own GPU
    (``CUDA_VISIBLE_DEVICES`` set per task by SLURM) uses ``cuda:0`` whatever its local id."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def worker_devices(device: str, workers: int) -> list[str]:
    """One device per worker process: with ``cuda:K`` (or ``cuda``) and several GPUs, worker
    ``w`` gets ``cuda:(K + w) % count``; other devices are shared."""
    if not device.startswith("cuda") or workers == 1:
        return [device] * workers
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        return [device] * workers
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return [f"cuda:{(base + w) % count}" for w in range(workers)]


def owned(num_shards: int, part: tuple[int, int]) -> list[int]:
    """The shards of part ``(i, N)``: ``j % N == i``."""
    i, n = part
    return list(range(i, num_shards, n))


def run_id(plan: dict) -> str:
    """One id for every part of one preparation (the plan without paths, which may differ)."""
    codec = replace(codec_of(plan), path="").to_dict()  # (an unknown path is left out)
    tokenizer = {k: v for k, v in plan.get("tokenizer", {}).items() if k != "path"}
    return json_hash(dict(plan, codec=codec, tokenizer=tokenizer))


def _lock_name(part: tuple[int, int]) -> str:
    return f"part-{part[0]}-of-{part[1]}.lock"


def _record_name(part: tuple[int, int]) -> str:
    return f"part-{part[0]}-of-{part[1]}.json"


class Mutex:
    """``OUT/.prepare/lock``, held exclusively (blocking) inside ``with``."""

    def __init__(self, out_dir: str):
        self.dir = os.path.join(out_dir, STATE_DIR)
        self.path = os.path.join(self.dir, "lock")

    def __enter__(self):
        while True:  # the file may be removed (remove_state) while we wait: then lock anew
            os.makedirs(self.dir, exist_ok=True)
            self.f = open(self.path, "a+")
            fcntl.flock(self.f, fcntl.LOCK_EX)
            try:
                if os.stat(self.path).st_ino == os.fstat(self.f.fileno()).st_ino:
                    return self
            except FileNotFoundError:
                pass
            self.f.close()

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def _holder(path: str) -> dict | None:
    """The record of a live lock holder of ``path``, or None (stale or gone: removed)."""
    try:
        f = open(path, "r+")
    except FileNotFoundError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return json.loads(f.read() or "{}")
            except ValueError:
                return {}
        os.remove(path)  # nobody holds it: left by a part that died
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


class PartLock:
    """The lock of one running part on ``OUT`` (see the module docstring)."""

    def __init__(self, out_dir: str, part: tuple[int, int], rid: str):
        self.out_dir, self.part, self.rid = out_dir, part, rid
        self.dir = os.path.join(out_dir, STATE_DIR)
        self.path = os.path.join(self.dir, _lock_name(part))
        self.f = None

    def check_others(self) -> None:
        """Refuse if a live part of another run, or this same part, holds ``OUT`` (call with
        the :class:`Mutex` held)."""
        for name in sorted(os.listdir(self.dir)):
            if not name.endswith(".lock") or not name.startswith("part-"):
                continue
            path = os.path.join(self.dir, name)
            h = _holder(path)
            if h is None:
                continue
            who = f"host {h.get('host', '?')}, PID {h.get('pid', '?')}"
            if h.get("run") != self.rid:
                raise PartError(
                    f"{self.out_dir} is being prepared by another run ({who}, part "
                    f"{h.get('part', '?')}, run {h.get('run', '?')}; this run is {self.rid}): "
                    "wait for it to finish (or stop it), or use another --out-dir"
                )
            if path == self.path:
                raise PartError(
                    f"part {self.part[0]}/{self.part[1]} of this run is already running on "
                    f"{self.out_dir} ({who})"
                )

    def acquire(self) -> None:
        """Take this part's lock (call with the :class:`Mutex` held, after check_others)."""
        f = open(self.path, "a+")
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.seek(0)
        f.truncate()
        rec = {"host": socket.gethostname(), "pid": os.getpid(), "run": self.rid,
               "part": f"{self.part[0]}/{self.part[1]}"}  # fmt: skip
        f.write(json.dumps(rec))
        f.flush()
        self.f = f

    def release(self) -> None:
        if self.f is None:
            return
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()
        self.f = None


def remove_state(out_dir: str) -> None:
    """Remove ``OUT/.prepare`` after a one-part run (call with the :class:`Mutex` held): a
    finished dataset of one part has no trace of the locks. Kept while any lock is held."""
    d = os.path.join(out_dir, STATE_DIR)
    names = os.listdir(d) if os.path.isdir(d) else []
    if any(n.endswith(".lock") and n != "lock" and _holder(os.path.join(d, n)) for n in names):
        return
    for n in os.listdir(d):
        if n != "lock":
            os.remove(os.path.join(d, n))
    os.remove(os.path.join(d, "lock"))
    os.rmdir(d)


def write_record(out_dir: str, part: tuple[int, int], rid: str, run_info: dict) -> None:
    """What part ``part`` did (summed into the joined summary.json)."""
    rec = dict(run_info, run=rid, part=f"{part[0]}/{part[1]}")
    write_json_atomic(os.path.join(out_dir, STATE_DIR, _record_name(part)), rec)


def read_records(out_dir: str, rid: str) -> list[dict]:
    d = os.path.join(out_dir, STATE_DIR)
    recs = []
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if name.startswith("part-") and name.endswith(".json"):
            try:
                with open(os.path.join(d, name)) as f:
                    r = json.load(f)
            except (OSError, ValueError):
                continue
            if r.get("run") == rid:
                recs.append(r)
    return recs


def write_checks(out_dir: str, checks: dict) -> None:
    write_json_atomic(os.path.join(out_dir, STATE_DIR, CHECKS), checks)


def read_checks(out_dir: str) -> dict:
    try:
        with open(os.path.join(out_dir, STATE_DIR, CHECKS)) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def missing_message(out_dir: str, missing: list[int], n_parts: int | None) -> str:
    """Which shards (and, for ``n_parts``, which parts) are not finished yet."""
    names = ", ".join(shard_name(s) for s in missing[:20]) + (" ..." if len(missing) > 20 else "")
    msg = f"{out_dir}: {len(missing)} shard(s) not finished yet ({names})"
    if n_parts:
        parts = sorted({s % n_parts for s in missing})
        msg += f"; run part(s) {', '.join(f'{p}/{n_parts}' for p in parts)} (again) to finish them"
    return msg
