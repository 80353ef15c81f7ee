# ruff: noqa: I001  (torchtitan_speechlm must be imported before torchtitan: CPU device selection)
"""Generation as a user gets it, on a trained model (default: `make demo`'s step-400 checkpoint),
ratios in one run. Writes benchmarks/results/generate_cpu.json (``--out``).

1. Batching through the CLI's own path (``generation/requests.py::run_requests``, what
   ``torchtitan generate --batch`` runs): the same TTS requests at ``--batch-size`` 1 and 8,
   audio frames per second and their ratio (target >= 5x on CPU). Alternated A/B/A/B, medians.
2. End-to-end real-time factor, in-process: one sentence's generation + the codec's decode,
   seconds per second of audio (target <= 0.3 on 2 cores); and a batch of 8 decoded together.
3. Streaming: the seconds from the call to the first audio samples out of the codec's stream
   decoder (``--stream``; target <= 0.3 s).
4. Start-up: wall seconds of ``torchtitan --help`` and ``torchtitan generate --help`` beside
   ``python -c "import torch"`` (target < 2 s).

    python benchmarks/bench_generate.py [--model DIR] [--sentences 16] [--repeats 2]

Smallest setting (a smoke test of the script): ``--model DIR --sentences 2 --repeats 1
--max-frames 8 --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import torchtitan_speechlm  # noqa: F401
from torchtitan_speechlm.demo.grammar import split_sentences
from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.decode import DecodeConfig
from torchtitan_speechlm.generation.loading import load_model
from torchtitan_speechlm.generation.requests import Request, run_requests

DEMO = "outputs/speechlm_debug/checkpoint/step-400"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEMO, help="a checkpoint step or export folder (make demo)")
    p.add_argument("--sentences", type=int, default=16, help="TTS requests per batched run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-frames", type=int, default=500, help="decoding's limit (500)")
    p.add_argument("--out", default="benchmarks/results/generate_cpu.json")
    return p


def _frames_per_s(loaded, texts, cfg, batch_size: int) -> tuple[float, int]:
    t = time.perf_counter()
    outcomes = run_requests(loaded, [Request("tts", x) for x in texts], cfg, batch_size)
    dt = time.perf_counter() - t
    bad = [o.error for o in outcomes if o.error]
    if bad:
        raise RuntimeError(f"requests failed: {bad[:3]}")
    frames = sum(len(o.codes) for o in outcomes)
    return frames / dt, frames


def batching(loaded, texts, cfg, repeats: int) -> dict:
    rates: dict[int, list[float]] = {1: [], 8: []}
    _frames_per_s(loaded, texts[:2], cfg, 8)  # warm-up
    for _ in range(repeats):
        for b in (1, 8):
            rates[b].append(_frames_per_s(loaded, texts, cfg, b)[0])
    one, eight = (statistics.median(rates[b]) for b in (1, 8))
    return {"requests": len(texts), "frames_per_s_batch1": one, "frames_per_s_batch8": eight,
            "ratio": eight / one, "target": ">= 5"}  # fmt: skip


def end_to_end(loaded, texts, cfg) -> dict:
    codec, rate = loaded.codec, loaded.codec.sample_rate
    per = []
    for text in texts:
        t = time.perf_counter()
        codes = tasks.tts(loaded, [text], cfg)[0]
        gen = time.perf_counter() - t
        wav = codec.decode(codes)
        total = time.perf_counter() - t
        per.append((gen, total - gen, len(wav) / rate))
    t = time.perf_counter()
    batch = tasks.tts(loaded, texts[:8], cfg)
    wavs = tasks.decode_audio(loaded, batch)
    batch_s = time.perf_counter() - t
    audio = sum(a for *_, a in per)
    return {
        "sentences": len(per),
        "audio_s": audio,
        "rtf_generate": sum(g for g, _, _ in per) / audio,
        "rtf_codec_decode": sum(d for _, d, _ in per) / audio,
        "rtf_end_to_end": sum(g + d for g, d, _ in per) / audio,
        "rtf_end_to_end_batch8": batch_s / (sum(len(w) for w in wavs) / rate),
        "target": "rtf_end_to_end <= 0.3",
    }


def first_audio(loaded, text: str, cfg) -> dict:
    """Seconds until the stream decoder gives the first samples (generation streamed)."""
    make = getattr(loaded.codec, "stream_decoder", None)
    if make is None:
        return {"skipped": f"{type(loaded.codec).__name__} has no stream_decoder"}
    stream, first, total = make(), [], [0]

    def on_frames(_row, codes):
        new = codes[on_frames.sent :]
        on_frames.sent = len(codes)
        out = stream.push(new)
        total[0] += len(out)
        if len(out) and not first:
            first.append(time.perf_counter() - t)

    on_frames.sent = 0
    t = time.perf_counter()
    tasks.tts_with_ends(loaded, [text], cfg, on_frames=on_frames)
    total[0] += len(stream.flush())
    done = time.perf_counter() - t
    return {"first_audio_s": first[0] if first else done, "whole_s": done,
            "audio_s": total[0] / loaded.codec.sample_rate, "target": "<= 0.3"}  # fmt: skip


def startup() -> dict:
    def wall(cmd: list[str]) -> float:
        best = []
        for _ in range(3):
            t = time.perf_counter()
            subprocess.run(cmd, capture_output=True, check=True, timeout=120)
            best.append(time.perf_counter() - t)
        return min(best)

    exe = os.path.join(os.path.dirname(sys.executable), "torchtitan")
    return {
        "torchtitan --help": wall([exe, "--help"]),
        "torchtitan generate --help": wall([exe, "generate", "--help"]),
        "python -c 'import torch' (reference)": wall([sys.executable, "-c", "import torch"]),
        "target": "< 2 s",
    }


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not os.path.isdir(a.model):
        print(
            f"{a.model}: no such model folder; run `make demo` first or pass --model",
            file=sys.stderr,
        )
        return 2
    torch.manual_seed(0)
    loaded = load_model(a.model)
    _, held = split_sentences(0, max(a.sentences, 8), seed=1)
    texts = held[: max(a.sentences, 2)]
    cfg = DecodeConfig(max_frames=a.max_frames)
    result = {
        "model": a.model,
        "threads": torch.get_num_threads(),
        "batching": batching(loaded, texts, cfg, a.repeats),
        "end_to_end": end_to_end(loaded, texts[: min(4, len(texts))], cfg),
        "stream": first_audio(loaded, texts[0], cfg),
        "startup": startup(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
