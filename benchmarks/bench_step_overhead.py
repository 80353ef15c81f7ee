"""Where a CPU training step of the debug model goes: model math vs everything else.

Runs the real ``torchtitan train`` (one process, in this process) on the demo config under
cProfile and splits the time of torchtitan's ``Trainer.train_step`` into the model's forward,
backward and optimizer step, and the rest: the data loader's ``next``, statistics, metrics,
host syncs. Prints the table and writes benchmarks/results/step_overhead.json (``--label``
names the entry, so a before/after pair lands in one file).

    python benchmarks/bench_step_overhead.py [--steps 60] [--label after]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile

MATH = {  # (file suffix, function) -> category
    ("torchtitan_speechlm/model/model.py", "forward"): "forward",
    ("torch/_tensor.py", "backward"): "backward",
    ("torch/optim/optimizer.py", "wrapper"): "optimizer",
}
REST = {
    ("torchtitan/train.py", "batch_generator"): "data (loader next)",
    ("torchtitan_speechlm/components/stats.py", "add"): "statistics (add)",
    ("torchtitan_speechlm/components/stats.py", "reduce"): "statistics (reduce)",
    ("torchtitan_speechlm/components/metrics.py", "log"): "metrics (log)",
    ("torchtitan/components/metrics.py", "log"): "metrics (log)",
    ("torch/nn/utils/clip_grad.py", "_clip_grads_with_norm_"): "grad clipping",
    ("torchtitan/distributed/utils.py", "clip_grad_norm_"): "grad clipping",
}


def run(steps: int, config: str) -> pstats.Stats:
    from torchtitan_speechlm.cli import main as cli

    dump = tempfile.mkdtemp()
    args = ["train", "--job.config_file", config, "--training.steps", str(steps)]
    args += ["--job.dump_folder", dump, "--checkpoint.enable", "false"]
    args += ["--validation.enable", "false", "--metrics.log_freq", "10"]
    prof = cProfile.Profile()
    prof.enable()
    try:
        cli(args)
    except SystemExit:
        pass
    prof.disable()
    return pstats.Stats(prof)


def cumulative(stats: pstats.Stats, table: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for (file, _, name), (_, _, _, ct, _) in stats.stats.items():
        for (suffix, fn), category in table.items():
            if name == fn and file.endswith(suffix):
                out[category] = out.get(category, 0.0) + ct
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="train_configs/speechlm_debug.toml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--label", default="current")
    a = p.parse_args(argv)
    stats = run(a.steps, a.config)
    step = cumulative(stats, {("torchtitan/train.py", "train_step"): "train_step"})["train_step"]
    math = cumulative(stats, MATH)
    rest = cumulative(stats, REST)
    other = step - sum(math.values()) - rest.get("data (loader next)", 0.0)
    row = {
        "steps": a.steps,
        "ms_per_step": 1e3 * step / a.steps,
        "model_math_ms": {k: 1e3 * v / a.steps for k, v in math.items()},
        "named_rest_ms": {k: 1e3 * v / a.steps for k, v in rest.items()},
        "not_model_math_ms": 1e3 * (step - sum(math.values())) / a.steps,
        "not_model_math_share": (step - sum(math.values())) / step,
        "unattributed_ms": 1e3
        * (other - sum(v for k, v in rest.items() if "data" not in k))
        / a.steps,
    }
    print(json.dumps(row, indent=2))
    path = "benchmarks/results/step_overhead.json"
    results = json.load(open(path)) if os.path.exists(path) else {}
    results[a.label] = row
    os.makedirs("benchmarks/results", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    stats.sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
