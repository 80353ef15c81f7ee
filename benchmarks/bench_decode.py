# ruff: noqa: I001  (torchtitan_speechlm must be imported before torchtitan: CPU device selection)
"""Decode speed: TTS frames per second with and without the KV cache, in the same run.

``--suite tts`` (default): a random-init SpeechLM of a given shape (the demo's on CPU; a
Qwen3-0.6B shape on a GPU; the hf backbone) speaks a fixed prompt for exactly --frames audio
frames (the end is never chosen), greedy, batch 1 and batch 8; cached and uncached runs
alternate (A/B/A/B) after a warm-up and the median of the repeats is reported with the ratio.
Writes benchmarks/results/decode_<device>.json (``--out``).

``--suite backbones``: the same shape as a Llama config, built once with the ``native``
backbone (torchtitan's blocks, kv_cache.py) and once with ``hf`` (transformers' DynamicCache):
native cached vs native recomputed (batch 1), native cached vs hf cached (batch 1 and 8), and
native cached with the one-frame step compiled vs eager (``DecodeConfig.compile``; the first
compiled run, which compiles, is timed apart: ``first_compiled_run_s``), alternating in one run. Writes
benchmarks/results/decode_backbones_<device>.json (``--out``). ``--suite all``: both, into one
file with ``--out``.

    python benchmarks/bench_decode.py [--shape tiny|demo|qwen3_0.6b] [--frames 64] [--repeats 3]
    python benchmarks/bench_decode.py --suite backbones --frames 512 --repeats 3

Smallest setting (a smoke test of the script):
``--suite all --shape tiny --frames 4 --repeats 1 --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import numpy as np
import torch

import torchtitan_speechlm  # noqa: F401
from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
from torchtitan_speechlm.data.template_pieces import Segment
from torchtitan_speechlm.generation.decode import DecodeConfig, Decoder
from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.model import SpeechLM
from torchtitan_speechlm.model.vocab import VocabLayout

SHAPES = {  # hidden, layers, heads, kv heads, ffn, text vocab, streams, codebook
    "tiny": (64, 1, 2, 1, 128, 259, 2, 64),  # the smoke run's: one layer to compile, not four
    "demo": (128, 4, 4, 2, 384, 259, 4, 64),
    "qwen3_0.6b": (1024, 28, 16, 8, 3072, 151669, 8, 2048),
}


def model_of(shape: str, device: str, family: str = "qwen3", backbone: str = "hf") -> SpeechLM:
    import transformers

    h, layers, heads, kv, ffn, text, n, c = SHAPES[shape]
    config = transformers.LlamaConfig if family == "llama" else transformers.Qwen3Config
    cfg = config(
        vocab_size=text,
        hidden_size=h,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=h // heads,
        max_position_embeddings=8192,
    )
    d = tempfile.mkdtemp()
    cfg.save_pretrained(d)
    layout = VocabLayout(text_size=text, num_streams=n, codebook_size=c)
    args = SpeechLMModelArgs(
        hf_assets_path=d,
        backbone_config=cfg.to_dict(),
        vocab=layout.to_dict(),
        load_weights=False,
        backbone=backbone,
    )
    with torch.device("meta"):
        model = SpeechLM(args)
    model.to_empty(device=device)
    model.init_weights()
    if device == "cuda":
        model.to(torch.bfloat16)
        model.family.reset_buffers(model.backbone, device)  # .to() casts complex RoPE to real
    return model.eval()


def run(model, prompts, frames: int, cache: bool, compile: str = "off") -> float:
    cfg = DecodeConfig(max_frames=frames, min_frames=frames, use_cache=cache, compile=compile)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    codes = Decoder(model, cfg).audio(prompts)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    assert all(len(c) == frames for c in codes)
    return len(prompts) * frames / (time.perf_counter() - t)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = "qwen3_0.6b" if torch.cuda.is_available() else "demo"
    p.add_argument("--shape", default=default, choices=sorted(SHAPES))
    p.add_argument("--frames", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--suite", default="tts", choices=("tts", "backbones", "all"))
    p.add_argument(
        "--out",
        help="results file (default benchmarks/results/decode_<device>.json, "
        "decode_backbones_<device>.json for --suite backbones)",
    )
    return p


def prompt_of(model) -> np.ndarray:
    lay = model.args.layout
    builder = TemplateBuilder(
        lay, model.args.pattern, LossWeights(1.0, 1.0, (1 / lay.num_streams,) * lay.num_streams)
    )
    return builder.prefix([Segment("user", "text", np.arange(3, 40))], "assistant", "audio")


def header(a, device: str) -> dict:
    return {
        "shape": a.shape,
        "device": device,
        "frames": a.frames,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }


def summary(times: list[float]) -> dict:
    return {"frames_per_s": statistics.median(times), "spread": [min(times), max(times)]}


def backbones(a, device: str) -> dict:
    """native cached vs native recomputed, native cached vs hf cached, compiled vs eager."""
    native = model_of(a.shape, device, "llama", "native")
    hf = model_of(a.shape, device, "llama", "hf")
    prompt = prompt_of(native)
    result = header(a, device)
    result["prompt_frames"] = len(prompt)
    for batch in (1, 8):
        prompts = [prompt] * batch
        for m in (native, hf):
            run(m, prompts, 4, True)  # warm-up
        t = time.perf_counter()  # the compiled step's compilations (each capacity), timed apart
        run(native, prompts, a.frames, True, "on")
        first_compiled = time.perf_counter() - t
        runs: dict[str, list[float]] = {"native": [], "hf": [], "native_compiled": []}
        graphs = device == "cuda"  # the compiled step replayed as CUDA graphs
        if graphs:
            run(native, prompts, a.frames, True, "graphs")  # its compilation and capture
            runs["native_graphs"] = []
        if batch == 1:
            runs["native_recompute"] = []
        for _ in range(a.repeats):  # A/B/C/D
            runs["native"].append(run(native, prompts, a.frames, True))
            runs["hf"].append(run(hf, prompts, a.frames, True))
            runs["native_compiled"].append(run(native, prompts, a.frames, True, "on"))
            if graphs:
                runs["native_graphs"].append(run(native, prompts, a.frames, True, "graphs"))
            if batch == 1:
                runs["native_recompute"].append(run(native, prompts, a.frames, False))
        row = {k: summary(v) for k, v in runs.items()}
        fps = {k: v["frames_per_s"] for k, v in row.items()}
        row["native_vs_hf"] = fps["native"] / fps["hf"]
        row["compiled_vs_eager"] = fps["native_compiled"] / fps["native"]
        row["first_compiled_run_s"] = first_compiled  # compiling included
        if graphs:
            row["graphs_vs_eager"] = fps["native_graphs"] / fps["native"]
        if batch == 1:
            row["cache_speedup"] = fps["native"] / fps["native_recompute"]
        result[f"batch{batch}"] = row
        print(json.dumps({f"batch{batch}": row}), flush=True)
    return result


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out: dict[str, dict] = {}
    if a.suite in ("tts", "all"):
        out["tts"] = tts(a, device)
    if a.suite in ("backbones", "all"):
        out["backbones"] = backbones(a, device)
    if a.out:
        write(a.out, out[a.suite] if a.suite != "all" else out)
    else:
        for suite, result in out.items():
            name = "decode" if suite == "tts" else "decode_backbones"
            write(f"benchmarks/results/{name}_{device}.json", result)


def write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def tts(a, device: str) -> dict:
    """The hf backbone's (Qwen3 shape) cached vs uncached TTS decoding."""
    model = model_of(a.shape, device)
    prompt = prompt_of(model)
    result = header(a, device)
    for batch in (1, 8):
        prompts = [prompt] * batch
        run(model, prompts, 4, True)  # warm-up
        cached, full = [], []
        for _ in range(a.repeats):  # A/B/A/B
            cached.append(run(model, prompts, a.frames, True))
            full.append(run(model, prompts, a.frames, False))
        result[f"batch{batch}"] = {
            "cached_frames_per_s": statistics.median(cached),
            "uncached_frames_per_s": statistics.median(full),
            "cache_speedup": statistics.median(cached) / statistics.median(full),
            "cached_spread": [min(cached), max(cached)],
            "uncached_spread": [min(full), max(full)],
        }
        print(json.dumps({f"batch{batch}": result[f"batch{batch}"]}), flush=True)
    return result


if __name__ == "__main__":
    main()
