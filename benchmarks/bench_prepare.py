"""Benchmark `torchtitan prepare`: seconds of audio prepared per second of wall time.

Corpus: espeak-ng speech from ``demo_assets.synthesize_corpus`` (cached). Codecs: the tiny
random-init Encodec of the tests (``demo_assets.build_codec``) and a k-means codec fitted on
the corpus itself (its fit time and round-trip quality are reported too). Each codec is run
with 1 worker process (all cores' threads, then 1 thread) and 2 worker processes. Wall time
includes loading the codec, planning and starting workers. Prints a table and writes ``benchmarks/results/prepare.json``
(``--out``). Not a test: `python benchmarks/bench_prepare.py [--n 200] [--cache DIR]`. Smallest
setting (a smoke test of the script): ``--n 8 --held-out 2 --codecs kmeans --cache DIR
--out FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from torchtitan_speechlm.audio import load_audio
from torchtitan_speechlm.codecs import load_codec
from torchtitan_speechlm.codecs.kmeans import fit_kmeans_codec, log_mel_distance
from torchtitan_speechlm.demo import assets as demo_assets
from torchtitan_speechlm.prepare.pipeline import prepare_dataset
from torchtitan_speechlm.prepare.sources.jsonl import read_jsonl_manifest

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "prepare.json")


def build_assets(cache: str, n: int) -> dict:
    sentences = demo_assets.load_sentences()
    paths = {k: os.path.join(cache, k) for k in ("tok", "encodec", "corpus", "kmeans")}
    if not os.path.isfile(os.path.join(paths["tok"], "tokenizer.json")):
        demo_assets.build_tokenizer(paths["tok"], sentences)
    if not os.path.isfile(os.path.join(paths["encodec"], "config.json")):
        demo_assets.build_codec(paths["encodec"], "encodec")
    paths["manifest"] = demo_assets.synthesize_corpus(paths["corpus"], sentences, n=n)
    return paths


def kmeans_fit(paths: dict, held_out: int = 10) -> dict:
    """Fit 4 x 256 on all but the last ``held_out`` utterances; report time and quality."""
    wavs = [load_audio(it.audio, 16000) for it in read_jsonl_manifest(paths["manifest"])]
    shutil.rmtree(paths["kmeans"], ignore_errors=True)
    t0 = time.perf_counter()
    fit_kmeans_codec(wavs[:-held_out], paths["kmeans"], num_codebooks=4, codebook_size=256)
    fit_s = time.perf_counter() - t0
    codec = load_codec(paths["kmeans"])
    rng = np.random.default_rng(0)
    rt, noise, usage = [], [], []
    for w in wavs[-held_out:]:
        codes = codec.encode([w])[0]
        rt.append(log_mel_distance(w, codec.decode(codes)))
        n = (rng.standard_normal(len(w)) * np.sqrt(np.mean(w**2))).astype(np.float32)
        noise.append(log_mel_distance(w, n))
    codes = np.concatenate(codec.encode(wavs[-held_out:]))
    usage = [len(np.unique(codes[:, k])) / 256 for k in range(4)]
    return {
        "fit_audio_minutes": round(sum(len(w) for w in wavs[:-held_out]) / 16000 / 60, 2),
        "fit_seconds": round(fit_s, 2),
        "heldout_roundtrip_logmel_db": round(float(np.mean(rt)), 2),
        "heldout_noise_logmel_db": round(float(np.mean(noise)), 2),
        "heldout_codebook_usage": [round(u, 3) for u in usage],
    }


def run(paths: dict, codec: str, workers: int, shard_size: int, threads: int) -> dict:
    """One preparation; ``threads`` = torch intra-op threads of the in-process worker (worker
    processes get cpu_count // workers each)."""
    out = tempfile.mkdtemp(prefix="bench_prepare_")
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        s = prepare_dataset(paths["manifest"], codec, paths["tok"], os.path.join(out, "ds"),
                            batch_size=8, progress=False, workers=workers,
                            shard_size=shard_size)  # fmt: skip
        wall = time.perf_counter() - t0
    finally:
        torch.set_num_threads(default_threads)
        shutil.rmtree(out, ignore_errors=True)
    threads = threads if workers == 1 else max(1, (os.cpu_count() or 1) // workers)
    return {"codec": os.path.basename(codec), "workers": workers, "threads_per_worker": threads,
            "items": s["num_items"],
            "audio_seconds": s["total_audio_seconds"], "wall_seconds": round(wall, 2),
            "audio_s_per_s": round(s["total_audio_seconds"] / wall, 1)}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200, help="utterances (default 200, ~9 min)")
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "speechlm_bench_prepare"))
    p.add_argument("--shard-size", type=int, default=25)
    p.add_argument("--held-out", type=int, default=10, help="k-means codec: utterances not fitted")
    p.add_argument("--codecs", default="encodec,kmeans", help="the codecs to prepare with")
    p.add_argument("--out", default=RESULTS, help="results file")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    paths = build_assets(args.cache, args.n)
    km = kmeans_fit(paths, args.held_out)
    ncpu = os.cpu_count() or 1
    configs = [(1, ncpu), (1, 1), (2, 1)] if ncpu > 1 else [(1, 1), (2, 1)]
    rows = [run(paths, paths[c], w, args.shard_size, t) for c in args.codecs.split(",")
            for w, t in configs]  # fmt: skip
    print(f"{'codec':8} {'workers':>7} {'threads':>7} {'items':>6} {'audio s':>8} {'wall s':>7} "
          f"{'audio s/s':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['codec']:8} {r['workers']:>7} {r['threads_per_worker']:>7} {r['items']:>6} "
              f"{r['audio_seconds']:>8.1f} {r['wall_seconds']:>7.2f} {r['audio_s_per_s']:>9.1f}")  # fmt: skip
    print("k-means codec:", json.dumps(km))
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },  # fmt: skip
        "corpus": {"utterances": args.n, "shard_size": args.shard_size, "batch_size": 8},
        "runs": rows,
        "kmeans_codec": km,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
