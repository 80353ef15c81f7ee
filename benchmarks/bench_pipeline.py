"""The pipeline bubble per schedule against the schedule's theory, and each stage's peak memory
against one process, through the real ``torchtitan train`` (CPU, gloo, one thread per rank).

One process trains the model alone (its step time ``T1``); then 2-stage pipelines train the
same global batch with each schedule and microbatch count ``m``. With ``p`` ranks and no bubble
a step would take ``T1 / p``; the measured bubble is ``1 - T1 / (p * T_pp)`` (it also holds the
send/recv and the stages' imbalance: the first stage has the embeddings, the last the head and
its loss). Theory: ``(p - 1) / (m + p - 1)`` for 1F1B and GPipe, ``(p - 1) / (v m + p - 1)`` for
Interleaved1F1B with ``v = 2`` stages per rank. Peak memory: each rank's peak RSS (the console's
``memory:``) beside one process's. Results: benchmarks/results/pipeline_cpu.json.

    python benchmarks/bench_pipeline.py [--steps 8] [--micro 4,2,1]

Smallest setting (a smoke test of the script): ``--steps 2 --micro 2 --hidden 32 --layers 4
--seq-len 512 --schedules 1F1B --work DIR --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the console's step line ("[rankN]:" prefixed by torchrun; a single process has none)
MEMORY = re.compile(r"^(?:\[rank(\d+)\]:)?.*step:\s*\d+.*memory:\s*([\d.]+)GiB", re.M)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--micro", default="4,2,1", help="microbatch sizes (local batch 8)")
    p.add_argument("--schedules", default="1F1B,GPipe,Interleaved1F1B")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--local-batch", type=int, default=8)
    p.add_argument("--work", default="/tmp/bench_pipeline")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline_cpu.json"))
    return p.parse_args(argv)


def theory(schedule: str, p: int, m: int) -> float:
    v = 2 if schedule.startswith("Interleaved") else 1
    return (p - 1) / (v * m + p - 1)


def assets(args) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.helpers import make_varied_kaldi_assets, write_tiny_config

    work = Path(args.work)
    shape = dict(hidden_size=args.hidden, num_layers=args.layers, intermediate_size=3 * args.hidden)
    a = make_varied_kaldi_assets(work / "assets", n_utts=40, **shape)
    a["config"] = write_tiny_config(work / "c.toml", a, work / "unused")
    return a


def train(args, a: dict, name: str, nproc: int, flags: list[str], flavor: str = "native") -> dict:
    """One run: median step seconds after the first two steps, each rank's peak memory."""
    dump = Path(args.work) / name
    cmd = [sys.executable, "-m", "torchtitan_speechlm.cli", "train", "--job.config_file",
           a["config"], "--nproc-per-node", str(nproc), "--job.dump_folder", str(dump),
           "--model.flavor", flavor, "--validation.enable", "false",
           "--checkpoint.enable", "false", "--training.steps", str(args.steps),
           "--training.local_batch_size", str(args.local_batch),
           "--training.seq_len", str(args.seq_len), *flags]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", LOG_RANK=",".join(map(str, range(nproc))))
    subprocess.run(["rm", "-rf", str(dump)], check=True)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{name} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    with open(dump / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    times = [m["time_metrics/end_to_end(s)"] for m in rows if m["step"] > 2]
    memory: dict[int, float] = {}
    for rank, gib in MEMORY.findall(r.stdout + r.stderr):
        memory[int(rank or 0)] = max(memory.get(int(rank or 0), 0.0), float(gib))
    return {
        "step_s": statistics.median(times or [rows[-1]["time_metrics/end_to_end(s)"]]),
        "loss": rows[-1]["loss_metrics/global_avg_loss"],
        "peak_memory_gib_per_rank": [memory[k] for k in sorted(memory)],
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    a = assets(args)
    one = train(args, a, "one", 1, [])
    print(f"one process: {one['step_s']:.3f} s/step, peak {one['peak_memory_gib_per_rank']} GiB")
    rows, p = [], 2
    for schedule in args.schedules.split(","):
        for mb in (int(x) for x in args.micro.split(",")):
            m = args.local_batch // mb
            flags = ["--parallelism.pipeline_parallel_degree", str(p),
                     "--parallelism.pipeline_parallel_schedule", schedule,
                     "--parallelism.pipeline_parallel_microbatch_size", str(mb)]  # fmt: skip
            got = train(args, a, f"{schedule}_m{m}", p, flags)
            bubble = 1 - one["step_s"] / (p * got["step_s"])
            row = {"schedule": schedule, "microbatches": m, "theory_bubble": theory(schedule, p, m),
                   "measured_bubble": bubble, "speedup_vs_one_process": one["step_s"] / got["step_s"],
                   # float order differs (microbatch sums); lr 1e-2 amplifies it over the steps
                   "loss_rel_diff": abs(got["loss"] - one["loss"]) / abs(one["loss"]),
                   "peak_memory_ratio_per_rank": [g / one["peak_memory_gib_per_rank"][0]
                                                  for g in got["peak_memory_gib_per_rank"]],
                   **got}  # fmt: skip
            rows.append(row)
            print(
                f"{schedule:16s} m={m}: bubble {bubble:.3f} (theory {row['theory_bubble']:.3f}), "
                f"x{row['speedup_vs_one_process']:.2f} vs one process, memory/rank "
                f"{[round(x, 2) for x in row['peak_memory_ratio_per_rank']]} of one process's"
            )
    out = {"shape": vars(args) | {"stages": p}, "one_process": one, "pipelines": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
