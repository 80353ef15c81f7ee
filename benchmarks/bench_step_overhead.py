# ruff: noqa: I001  (torchtitan_speechlm must be imported before torchtitan: CPU device selection)
"""Where a CPU training step of the debug model goes: model math vs everything else.

Runs the real ``torchtitan train`` (one process, in this process) on the demo config under
cProfile and splits the time of torchtitan's ``Trainer.train_step`` into the model's forward,
backward and optimizer step, and the rest: the data loader's ``next``, statistics, metrics,
host syncs. Prints the table and writes benchmarks/results/step_overhead.json (``--label``
names the entry, so a before/after pair lands in one file).

    python benchmarks/bench_step_overhead.py [--steps 60] [--label after]

Smallest setting (a smoke test of the script): ``--steps 2 --config TINY.toml --out FILE``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile

MATH = {  # (file suffix, function) -> category; nested entries would count twice
    ("torchtitan_speechlm/model/model.py", "SpeechLM.forward"): "forward",
    ("torch/_tensor.py", "backward"): "backward",
    ("torch/optim/optimizer.py", "wrapper"): "optimizer",
}
REST = {
    ("torchtitan/train.py", "batch_generator"): "data (loader next)",
    ("torchtitan_speechlm/components/stats.py", "add"): "statistics (add)",
    ("torchtitan_speechlm/components/stats.py", "reduce"): "statistics (reduce)",
    ("torchtitan_speechlm/components/metrics.py", "log"): "metrics (log)",
    ("torchtitan/components/metrics.py", "log"): "metrics (log)",
    ("torchtitan/distributed/utils.py", "clip_grad_norm_"): "grad clipping",
    ("torchtitan_speechlm/components/nonfinite.py", "allow_update"): "non-finite guard",
}


def run(steps: int, config: str, profile: bool) -> tuple[pstats.Stats | None, list[float]]:
    """Train ``steps`` steps in this process; the profile (or None) and each step's seconds."""
    import time

    from torchtitan_speechlm.cli import main as cli  # first: selects the CPU device
    from torchtitan.train import Trainer

    original, seconds = Trainer.train_step, []

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    dump = tempfile.mkdtemp()
    args = ["train", "--job.config_file", config, "--training.steps", str(steps)]
    args += ["--job.dump_folder", dump, "--checkpoint.enable", "false"]
    args += ["--validation.enable", "false", "--metrics.log_freq", "10"]
    prof = cProfile.Profile() if profile else None
    Trainer.train_step = timed
    if prof:
        prof.enable()
    try:
        cli(args)
    except SystemExit:
        pass
    finally:
        if prof:
            prof.disable()
        Trainer.train_step = original
    return (pstats.Stats(prof) if prof else None), seconds


def dispatched_ops() -> dict[str, int]:
    """Aten ops dispatched by one packed forward (8 streams, with its loss and statistics) and
    by adding its statistics to the accumulator: on a GPU, every non-view op is a kernel
    launch, which is what per-step overhead there is made of."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_common import build_speechlm, packed_positions, random_frames

    from torchtitan_speechlm.components.stats import StatsAccumulator

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    model, layout = build_speechlm(
        "cpu", hidden=64, layers=2, heads=4, kv=2, ffn=128, text=512, streams=8, codebook=64
    )
    frames = random_frames(layout, 2, 257, "cpu")
    weights, pos = torch.full((2, 256, 8), 0.125), packed_positions(2, 256, 4, "cpu")
    acc = StatsAccumulator()
    acc.add(
        model(frames[:, :-1], targets=frames[:, 1:], loss_weights=weights, position_ids=pos).stats
    )
    with Count() as fwd:
        out = model(frames[:, :-1], targets=frames[:, 1:], loss_weights=weights, position_ids=pos)
    with Count() as add:
        acc.add(out.stats)
    return {"forward_with_loss_and_stats": fwd.n, "statistics_add": add.n}


def cumulative(stats: pstats.Stats, table: dict) -> dict[str, float]:
    from torchtitan_speechlm.model.model import SpeechLM

    lines = {"SpeechLM.forward": SpeechLM.forward.__code__.co_firstlineno}
    out: dict[str, float] = {}
    for (file, line, name), (_, _, _, ct, _) in stats.stats.items():
        for (suffix, fn), category in table.items():
            fn_name = fn.split(".")[-1]
            if name == fn_name and file.endswith(suffix) and lines.get(fn, line) == line:
                out[category] = out.get(category, 0.0) + ct
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="train_configs/speechlm_debug.toml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--label", default="current")
    p.add_argument("--out", default="benchmarks/results/step_overhead.json", help="results file")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    import statistics

    _, wall = run(a.steps, a.config, profile=False)
    stats, _ = run(a.steps, a.config, profile=True)
    step = cumulative(stats, {("torchtitan/train.py", "train_step"): "train_step"})["train_step"]
    math = cumulative(stats, MATH)
    rest = cumulative(stats, REST)
    other = step - sum(math.values()) - rest.get("data (loader next)", 0.0)
    row = {
        "steps": a.steps,
        "median_step_ms_unprofiled": 1e3 * statistics.median(wall[5:] or wall),  # warm steps
        "dispatched_ops": dispatched_ops(),
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
    path = a.out
    results = json.load(open(path)) if os.path.exists(path) else {}
    results[a.label] = row
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    stats.sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
