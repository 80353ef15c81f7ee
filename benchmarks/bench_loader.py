# ruff: noqa: I001  (torchtitan_speechlm must be imported before torchtitan: CPU device selection)
"""The data loader's cost: flat in the data-parallel degree, divided among workers.

1. *dp scaling* (one process plays rank 0 of dp = 1 ... 512): a varied-length synthetic corpus
   (lognormal lengths, 20 to 500 frames), pack, local batch 2, seq_len 512, two tasks; the time
   rank 0's loader spends per optimizer step. Target: dp = 512 within 1.5x of dp = 8.
2. *workers*: micro-batches/s through the real ``SpeechLMDataLoader`` with 0, 1 and 2 loader
   workers on the demo corpus (run ``make demo`` first, or this builds its data), and the CPU
   time per micro-batch of the main process and of the workers. Target: 2 workers >= 1.6x 0
   workers. The repeats alternate 0, 1 and 2 workers. ``two_process_ceiling`` is what two
   processes gain over one on this machine for equal CPU-bound jobs: the most 2 workers can.
3. padding of ``pack`` vs ``bucket``, and the debug model's training step rate for scale.

    python benchmarks/bench_loader.py [--dps 1,8,64,512] [--repeats 5]
Writes benchmarks/results/loader.json (``--out``). Not a test: timings depend on the machine.
Smallest setting (a smoke test of the script): ``--dps 1,2 --steps 1 --micro-batches 2
--repeats 1 --config TINY.toml --out FILE`` (any config whose datasets exist).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

import torchtitan_speechlm  # noqa: F401  (CPU device selection before torchtitan)
from torchtitan.config import ConfigManager

from bench_common import device_name
from torchtitan_speechlm.components.dataloader import SpeechLMDataLoader
from torchtitan_speechlm.data.catalog import parse_datasets
from torchtitan_speechlm.data.mixing import Source
from torchtitan_speechlm.data.stream import SpeechLMDataset
from torchtitan_speechlm.trainer.builders import stream, train_stream
from torchtitan_speechlm.trainer.run import prepare_run
from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
from torchtitan_speechlm.model.vocab import VocabLayout


# ---- 1. dp scaling on a synthetic corpus ----------------------------------------------------
@dataclass
class Item:
    id: str
    text: str
    text_tokens: np.ndarray
    audio_codes: np.ndarray
    seconds: float
    turns: list | None = None


class SyntheticCorpus:
    """The reader API the stream uses, in memory: lognormal text and audio lengths."""

    def __init__(self, n: int, streams: int, codebook: int, text: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.text_lengths = np.clip(rng.lognormal(3.0, 0.6, n), 3, 120).astype(np.int64)
        self.audio_lengths = np.clip(rng.lognormal(4.5, 0.7, n), 10, 380).astype(np.int64)
        self.ids = [f"utt{i}" for i in range(n)]
        self.kinds = ["speech"] * n
        self.streams, self.codebook, self.text = streams, codebook, text

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Item:
        rng = np.random.default_rng(i)
        return Item(
            self.ids[i],
            "",
            rng.integers(0, self.text, self.text_lengths[i]),
            rng.integers(0, self.codebook, (self.audio_lengths[i], self.streams)),
            1.0,
        )


def synthetic_stream(corpus, dp: int) -> SpeechLMDataset:
    layout = VocabLayout(
        text_size=corpus.text, num_streams=corpus.streams, codebook_size=corpus.codebook
    )
    builder = TemplateBuilder(
        layout, "delay", LossWeights(1.0, 1.0, (1 / corpus.streams,) * corpus.streams)
    )
    idx = np.arange(len(corpus))
    sources = [Source(t, "synthetic", 1.0, corpus, idx) for t in ("tts", "asr")]
    return SpeechLMDataset(
        sources,
        builder,
        seq_len=512,
        local_batch_size=2,
        mode="pack",
        window=256,
        dp_rank=0,
        dp_world_size=dp,
        seed=0,
        shuffle=True,
        infinite=True,
    )


def dp_scaling(dps: list[int], steps: int, repeats: int) -> dict:
    corpus = SyntheticCorpus(200_000, streams=8, codebook=1024, text=4096)
    times: dict[int, list[float]] = {dp: [] for dp in dps}
    for _ in range(repeats):  # interleaved over dp
        for dp in dps:
            it = iter(synthetic_stream(corpus, dp))
            next(it)  # the first windows are start-up, not steady state
            t0 = time.perf_counter()
            for _ in range(steps):
                next(it)
            times[dp].append((time.perf_counter() - t0) / steps * 1e3)
    med = {dp: statistics.median(v) for dp, v in times.items()}
    ref = 8 if 8 in med else dps[0]
    return {
        "corpus": "synthetic, 200k items, lognormal lengths; pack, local batch 2, seq_len 512",
        "ms_per_step_rank0": {
            str(dp): {"median": med[dp], "min": min(times[dp]), "max": max(times[dp])} for dp in dps
        },
        f"over_dp{ref}": {str(dp): med[dp] / med[ref] for dp in dps},
    }


# ---- 2. workers on the demo corpus ----------------------------------------------------------
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
    plan = prepare_run(jc)[0]
    if training:
        return train_stream(jc, plan, dp_rank=0, dp_world_size=1)
    valid = plan.train_stream.for_validation(jc.validation)  # a finite pass over the mixture
    return stream(plan, plan.data.train, "train", valid, dp_rank=0, dp_world_size=1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loader_rate(jc, workers: int, n: int) -> tuple[float, float, float]:
    """Micro-batches/s, and CPU ms per micro-batch of the main process and of all workers."""
    import multiprocessing

    dl = SpeechLMDataLoader(
        dataset(jc),
        dp_rank=0,
        dp_world_size=1,
        batch_size=None,
        num_workers=workers,
        prefetch_factor=4 if workers else None,
    )
    it = iter(dl)
    for _ in range(20):  # worker start-up is not throughput
        next(it)
    kids = [p.pid for p in multiprocessing.active_children()] if workers else []
    main0, kids0 = cpu_seconds(os.getpid()), sum(cpu_seconds(k) for k in kids)
    t0 = time.perf_counter()
    for _ in range(n):
        next(it)
    rate = n / (time.perf_counter() - t0)
    main_ms = (cpu_seconds(os.getpid()) - main0) / n * 1e3
    kids_ms = (sum(cpu_seconds(k) for k in kids) - kids0) / n * 1e3
    del it
    return rate, main_ms, kids_ms


def _spin(q) -> None:
    t0 = time.perf_counter()
    a, s = np.random.default_rng(0).random(50_000), 0
    for i in range(4_000_000):
        s += i * i
    for _ in range(3000):
        a.copy()
    q.put(time.perf_counter() - t0)


def two_process_ceiling() -> float:
    """How much faster 2 processes finish 2 equal CPU-bound jobs than 1 process finishes one
    job, i.e. the most 2 loader workers can gain on this machine (2.0 on 2 free, full cores)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    times = {}
    for n in (1, 2):
        q = ctx.Queue()
        procs = [ctx.Process(target=_spin, args=(q,)) for _ in range(n)]
        for p in procs:
            p.start()
        times[n] = [q.get() for _ in procs]
        for p in procs:
            p.join()
    return 2 * times[1][0] / max(times[2])


def workers(jc, n: int, repeats: int) -> dict:
    runs: dict[int, list[tuple[float, float, float]]] = {0: [], 1: [], 2: []}
    for _ in range(repeats):  # interleaved
        for w in runs:
            runs[w].append(loader_rate(jc, w, n))
    out: dict = {"micro_batches_per_s": {}, "cpu_ms_per_micro_batch": {}}
    for w, v in runs.items():
        rates = [r for r, _, _ in v]
        out["micro_batches_per_s"][str(w)] = {
            "median": statistics.median(rates),
            "min": min(rates),
            "max": max(rates),
        }
        out["cpu_ms_per_micro_batch"][str(w)] = {
            "main": statistics.median(m for _, m, _ in v),
            "workers": statistics.median(k for _, _, k in v),
        }
    med = {w: out["micro_batches_per_s"][str(w)]["median"] for w in runs}
    out["1_over_0_workers"] = med[1] / med[0]
    out["2_over_0_workers"] = med[2] / med[0]
    out["two_process_ceiling"] = statistics.median(
        two_process_ceiling() for _ in range(min(3, repeats))
    )
    return out


# ---- 3. context: padding and the training step rate ------------------------------------------
def train_step_rate(jc, steps: int) -> float:
    """Forward + backward + AdamW of the debug model on real loader batches (1 process)."""
    from torchtitan_speechlm.model.model import SpeechLM

    args = prepare_run(jc)[1]  # the run's model args
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
    return 1 / statistics.median(times[2:])


def padding(jc, mode: str, n: int) -> float:
    ds = dataset(job(jc.job.config_file, "--speechlm_data.batching", mode))
    keys = ds.stats_keys
    pad = frames = 0.0
    for (batch, _), _i in zip(iter(ds), range(n), strict=False):
        st = dict(zip(keys, batch["data_stats"][0].tolist(), strict=True))
        pad, frames = pad + st["pad_frames"], frames + st["frames"]
    return pad / (pad + frames)


DEFAULT_CONFIG = "train_configs/speechlm_debug.toml"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--dps", default="1,8,64,512")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--micro-batches", type=int, default=1500)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/loader.json", help="results file")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    jc = job(a.config)
    missing = [
        p for p in parse_datasets(jc.speechlm_data.datasets).values() if not os.path.isdir(p)
    ]
    if missing and a.config == DEFAULT_CONFIG:  # the demo's data: build it
        from torchtitan_speechlm.demo.run import build_demo_data

        build_demo_data("demo_work")
    elif missing:
        raise SystemExit(f"bench_loader: {a.config}: no prepared dataset at {missing}")
    scaling = dp_scaling([int(x) for x in a.dps.split(",")], a.steps, a.repeats)
    print(json.dumps(scaling, indent=2), flush=True)
    rates = workers(jc, a.micro_batches, a.repeats)
    print(json.dumps(rates, indent=2), flush=True)
    result = {
        "machine": device_name("cpu"),
        "dp_scaling": scaling,
        "workers": {
            "config": a.config,
            "seq_len": jc.training.seq_len,
            "local_batch_size": jc.training.local_batch_size,
            **rates,
        },
        "train_steps_per_s": train_step_rate(jc, 20),
        "padding_ratio": {m: padding(jc, m, 100) for m in ("pack", "bucket")},
    }
    print(json.dumps(result, indent=2))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
