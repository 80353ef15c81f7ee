"""The demo's headline over training seeds: how far one `make demo` figure moves with the seed.

One run of `make demo` is one model; its held-out TTS WER on 40 sentences moves from seed to seed
(and from CPU to CPU: float32 training follows the instruction set MKL picks, so a run under
``MKL_ENABLE_INSTRUCTIONS=AVX2`` is another model from the same data and codec). This runs the
demo (``python -m torchtitan_speechlm.demo``: its data, recipe, eval command and judges) once per
seed, the seed setting both the data order and the initial weights (``--speechlm_data.seed``,
``--speechlm.init_seed``), each in its own dump folder, and reports every figure per seed with
the mean and the range. Seed 0 is ``make demo`` itself (its ``outputs/speechlm_debug`` is reused
when complete). Run from the repository root of a clone where the demo's data exists or may be
built:

    python benchmarks/bench_demo_seeds.py --seeds 0 1 2      # about 8 minutes a seed, 2 CPU cores

Writes benchmarks/results/demo_seeds.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FIGURES = {  # the name in the report: where eval.json has it
    "tts_wer": ("tts:heldout", "wer"),
    "tts_word_loop_wer": ("tts:heldout", "word_loop", "wer"),
    "sim": ("tts:heldout", "sim"),
    "sim_recording": ("tts:heldout", "sim_recording"),
    "asr_wer": ("asr:heldout", "wer"),
    "tts_floor_wer": ("tts:heldout", "floor", "wer"),
    "tts_word_loop_floor_wer": ("tts:heldout", "word_loop", "floor_wer"),
}


def dump_folder(seed: int) -> str:
    return "./outputs/speechlm_debug" if seed == 0 else f"./outputs/demo_seed{seed}"


def run_seed(seed: int) -> tuple[dict, float]:
    """The demo with this seed (skipped when its eval.json exists); its eval.json and seconds."""
    dump = dump_folder(seed)
    scores = os.path.join(dump, "listen", "eval.json")
    t = time.perf_counter()
    if not os.path.isfile(scores):
        overrides = [] if seed == 0 else [
            "--speechlm_data.seed", str(seed), "--speechlm.init_seed", str(seed),
            "--job.dump_folder", dump,
        ]  # fmt: skip
        cmd = [sys.executable, "-m", "torchtitan_speechlm.demo", "--", *overrides]
        print("[bench] $ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    with open(scores) as f:
        return json.load(f), time.perf_counter() - t


def figure(scores: dict, path: tuple) -> float | None:
    value = scores
    for key in path:
        value = (value or {}).get(key)
    return value


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=os.path.join(HERE, "results", "demo_seeds.json"))
    a = p.parse_args()
    runs = {}
    for seed in a.seeds:
        scores, seconds = run_seed(seed)
        runs[seed] = {name: figure(scores, path) for name, path in FIGURES.items()}
        runs[seed]["seconds"] = round(seconds, 1)
        print(f"[bench] seed {seed}: {json.dumps(runs[seed])}", flush=True)
    spread = {}
    for name in FIGURES:
        values = [r[name] for r in runs.values() if r[name] is not None]
        if values:
            spread[name] = {"mean": statistics.fmean(values), "min": min(values),
                            "max": max(values)}  # fmt: skip
    report = {
        "benchmark": "bench_demo_seeds",
        "command": "python benchmarks/bench_demo_seeds.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "(the CPU's best)"),
        "seeds": runs,
        "spread": spread,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(spread, indent=1))
    print(f"[bench] wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
