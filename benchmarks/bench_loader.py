# ruff: noqa: I001  (torchtitan_speechlm must be imported before torchtitan: CPU device selection)
"""Loader throughput (0 and 2 workers) next to the debug model's training step rate, and padding
of `pack` vs `bucket`, on the demo corpus (run `make demo` first, or this builds its data).

    python benchmarks/bench_loader.py [--config train_configs/speechlm_debug.toml]

Writes benchmarks/results/loader.json. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

import torchtitan_speechlm  # noqa: F401  (CPU device selection before torchtitan)
from torchtitan.config import ConfigManager

from torchtitan_speechlm.config import parse_datasets, parse_mix
from torchtitan_speechlm.data.loader import SpeechLMDataLoader, build_dataset


def job(config: str, *overrides: str):
    return ConfigManager().parse_args(
        [
            "--job.config_file",
            config,
            "--job.custom_config_module",
            "torchtitan_speechlm.config",
            *overrides,
        ]
    )


def dataset(jc, training=True):
    entries = parse_mix(jc.speechlm_data.train, "train", parse_datasets(jc.speechlm_data.datasets))
    return build_dataset(jc, entries, "train", dp_rank=0, dp_world_size=1, training=training)


def loader_rate(jc, workers: int, n: int) -> dict:
    dl = SpeechLMDataLoader(
        dataset(jc),
        dp_rank=0,
        dp_world_size=1,
        batch_size=None,
        num_workers=workers,
        prefetch_factor=4 if workers else None,
    )
    it = iter(dl)
    next(it)  # worker start-up is not throughput
    t0, tokens = time.perf_counter(), 0
    for _ in range(n):
        batch, _ = next(it)
        tokens += batch["input"].shape[0] * batch["input"].shape[1]
    dt = time.perf_counter() - t0
    return {"workers": workers, "micro_batches_per_s": n / dt, "frames_per_s": tokens / dt}


def train_step_rate(jc, steps: int) -> dict:
    """Forward + backward + AdamW of the debug model on real loader batches (1 process)."""
    from torchtitan_speechlm.model.args import SpeechLMModelArgs
    from torchtitan_speechlm.model.model import SpeechLM

    args = SpeechLMModelArgs()
    args.update_from_config(jc)
    with torch.device("meta"):
        model = SpeechLM(args)
    model.to_empty(device="cpu")
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [b for _, b in zip(range(steps + 2), iter(dataset(jc)), strict=False)]
    times = []
    for batch, _ in batches:
        t0 = time.perf_counter()
        inputs = dict(batch)
        out = model(inputs.pop("input"), **inputs)
        (out.loss_sum / out.stats["count"]).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    dt = sum(times[2:]) / len(times[2:])
    frames = batches[0][0]["input"].shape[0] * batches[0][0]["input"].shape[1]
    return {"steps_per_s": 1 / dt, "frames_per_s": frames / dt}


def padding(jc, mode: str, n: int) -> float:
    ds = dataset(job(jc.job.config_file, "--speechlm_data.batching", mode))
    keys = ds.stats_keys
    pad = frames = 0.0
    for (batch, _), _i in zip(iter(ds), range(n), strict=False):
        st = dict(zip(keys, batch["data_stats"][0].tolist(), strict=True))
        pad, frames = pad + st["pad_frames"], frames + st["frames"]
    return pad / (pad + frames)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="train_configs/speechlm_debug.toml")
    p.add_argument("--micro-batches", type=int, default=200)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    jc = job(a.config)
    if not os.path.isdir(parse_datasets(jc.speechlm_data.datasets)["demo"]):
        from torchtitan_speechlm.demo.run import build_demo_data

        build_demo_data("demo_work")
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    train = train_step_rate(jc, a.steps)
    loaders = [loader_rate(jc, w, a.micro_batches) for w in (0, 2)]
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "config": a.config,
        "seq_len": jc.training.seq_len,
        "local_batch_size": jc.training.local_batch_size,
        "train": train,
        "loaders": loaders,
        "loader_margin": {
            f"{x['workers']}_workers": x["micro_batches_per_s"] / train["steps_per_s"]
            for x in loaders
        },
        "padding_ratio": {m: padding(jc, m, 100) for m in ("pack", "bucket")},
    }
    print(json.dumps(result, indent=2))
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/loader.json", "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
