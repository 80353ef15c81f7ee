"""What a checkpoint's manifest costs (utils/checkpoint_manifest.py: every file's size and
CRC-32C, summed as DCP writes it, the manifest written after the save; verified before a resume): DCP's save of a checkpoint the size
of the 0.6B recipe's (600M parameters x (fp32 weight + AdamW's two moments) = 7.2 GB, in ~310
tensors as in Qwen3-0.6B) on CPU, with and without the manifest, and the verification a resume
adds. The promise (issue 39): the manifest costs <= 5% of the save time.

    python benchmarks/bench_checkpoint_manifest.py [--params 600000000] [--tensors 310] [--repeats 1]
Writes benchmarks/results/checkpoint_manifest_cpu.json (``--out``); the checkpoints are written
under ``--work`` (default: a temporary folder next to the results, removed afterwards). Smallest
setting (a smoke test of the script, not a measurement):
``--params 1000000 --tensors 8 --repeats 1 --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time

import torch

import torchtitan_speechlm  # noqa: F401  (CPU device selection before torchtitan)

HERE = os.path.dirname(os.path.abspath(__file__))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=int, default=600_000_000)
    p.add_argument("--tensors", type=int, default=310)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--work", default=None)
    p.add_argument("--out", default=os.path.join(HERE, "results", "checkpoint_manifest_cpu.json"))
    return p


def state_dict(params: int, tensors: int) -> dict[str, torch.Tensor]:
    """Weights and AdamW's two moments, ``params`` each, in ``tensors`` tensors per kind."""
    size = max(1, params // tensors)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i in range(tensors):
        w = torch.rand(size, generator=gen)
        out[f"model.layer{i}.weight"] = w
        out[f"optimizer.state.layer{i}.exp_avg"] = w * 1e-3
        out[f"optimizer.state.layer{i}.exp_avg_sq"] = w * 1e-6
    return out


def _save(state, path: str, summing: bool) -> float:
    """DCP's save; ``summing``: with the manifest's per-file sums computed as DCP writes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem

    from torchtitan_speechlm.utils.checkpoint_manifest import install_stream_sums

    install_stream_sums()
    hooked = FileSystem.create_stream
    if not summing:
        FileSystem.create_stream = FileSystem._speechlm_plain_create_stream
    if os.path.exists(path):
        shutil.rmtree(path)
    os.sync()
    try:
        t = time.perf_counter()
        dcp.save(state, checkpoint_id=path)
        return time.perf_counter() - t
    finally:
        FileSystem.create_stream = hooked


def file_checksum_of(tensor: torch.Tensor) -> int:
    from torchtitan_speechlm.utils.checkpoint_manifest import CHECKSUM, _update

    return _update(CHECKSUM, memoryview(tensor.numpy()).cast("B"), 0)


def summarise(rows: list[dict], params: int, tensors: int, nbytes: int) -> dict:
    """Each time as its best over the repeats (the least disturbed by other work: the machine
    is shared); the cost is the sums' CPU time (in the writer thread) + writing the manifest
    (``.metadata`` read back, the sums collected), over the save's time. The difference of
    the two saves' times is reported too: it is within the disk's noise."""
    best = {k: min(row[k] for row in rows) for k in rows[0] if k != "repeat"}
    return {
        "what": "DCP save (FileSystemWriter, one process, CPU) with and without the manifest",
        "params": params,
        "tensors_per_kind": tensors,
        "checkpoint_bytes": nbytes,
        "cpus": os.cpu_count(),
        "machine": platform.platform(),
        "torch": torch.__version__,
        "rows": rows,
        **{k: best[k] for k in ("save_s", "save_summing_s", "manifest_s", "sum_cpu_s")},
        "manifest_pct_of_save": 100 * (best["sum_cpu_s"] + best["manifest_s"]) / best["save_s"],
        "save_difference_pct": 100 * (best["save_summing_s"] - best["save_s"]) / best["save_s"],
        "verify_s": best["verify_s"],
        "verify_gb_per_s": nbytes / 1e9 / best["verify_s"],
        "note": "each file is summed as DCP writes it (CRC-32C in hardware, crc32c package); "
        "verify_s reads the files back (here from the page cache; a resume reads them from "
        "disk, bounded by its read speed)",
    }


def main() -> None:
    args = build_parser().parse_args()
    from torchtitan_speechlm.utils.checkpoint_manifest import verify, write_manifest

    work = args.work or tempfile.mkdtemp(prefix="bench_manifest_", dir=os.path.dirname(args.out))
    os.makedirs(work, exist_ok=True)
    state = state_dict(args.params, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    rows = []
    try:
        for r in range(args.repeats):
            path = os.path.join(work, "step-1")
            plain = _save(state, path, summing=False)
            summed = _save(state, path, summing=True)
            t = time.perf_counter()
            write_manifest(path)
            manifest = time.perf_counter() - t
            t = time.perf_counter()
            assert verify(path) == ""
            check = time.perf_counter() - t
            t = time.perf_counter()
            for tensor in state.values():  # the sums' own CPU time, without the disk's noise
                file_checksum_of(tensor)
            sums = time.perf_counter() - t
            rows.append(
                {
                    "repeat": r,
                    "save_s": plain,
                    "save_summing_s": summed,
                    "manifest_s": manifest,
                    "sum_cpu_s": sums,
                    "verify_s": check,
                }
            )
            print(
                f"repeat {r}: save {plain:.2f} s; summing while writing {summed:.2f} s + "
                f"manifest {manifest:.2f} s; the sums alone {sums:.2f} s "
                f"({100 * (sums + manifest) / plain:.1f}% of the save); verify {check:.2f} s",
                flush=True,
            )
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    result = summarise(rows, args.params, args.tensors, nbytes)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
