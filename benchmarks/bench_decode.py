# ruff: noqa: I001  (torchtitan_speechlm must be imported before torchtitan: CPU device selection)
"""Decode speed: TTS frames per second with and without the KV cache, in the same run.

A random-init SpeechLM of a given shape (the demo's on CPU; a Qwen3-0.6B shape on a GPU) speaks
a fixed prompt for exactly --frames audio frames (the end is never chosen), greedy, batch 1 and
batch 8; cached and uncached runs alternate (A/B/A/B) after a warm-up and the median of the
repeats is reported with the ratio. Writes benchmarks/results/decode_<device>.json (``--out``).

    python benchmarks/bench_decode.py [--shape demo|qwen3_0.6b] [--frames 64] [--repeats 3]

Smallest setting (a smoke test of the script): ``--shape demo --frames 4 --repeats 1 --out FILE``.
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
    "demo": (128, 4, 4, 2, 384, 259, 4, 64),
    "qwen3_0.6b": (1024, 28, 16, 8, 3072, 151669, 8, 2048),
}


def model_of(shape: str, device: str) -> SpeechLM:
    import transformers

    h, layers, heads, kv, ffn, text, n, c = SHAPES[shape]
    cfg = transformers.Qwen3Config(
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
        hf_assets_path=d, backbone_config=cfg.to_dict(), vocab=layout.to_dict(), load_weights=False
    )
    with torch.device("meta"):
        model = SpeechLM(args)
    model.to_empty(device=device)
    model.init_weights()
    return model.eval().to(torch.bfloat16 if device == "cuda" else torch.float32)


def run(model, prompts, frames: int, cache: bool) -> float:
    cfg = DecodeConfig(max_frames=frames, min_frames=frames, use_cache=cache)
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
    p.add_argument("--out", help="results file (default benchmarks/results/decode_<device>.json)")
    return p


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model_of(a.shape, device)
    lay = model.args.layout
    builder = TemplateBuilder(
        lay, model.args.pattern, LossWeights(1.0, 1.0, (1 / lay.num_streams,) * lay.num_streams)
    )
    prompt = builder.prefix([Segment("user", "text", np.arange(3, 40))], "assistant", "audio")
    result = {
        "shape": a.shape,
        "device": device,
        "frames": a.frames,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
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
    path = a.out or f"benchmarks/results/decode_{device}.json"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
