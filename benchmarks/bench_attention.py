# ruff: noqa: I001  (torchtitan_speechlm must be imported before torchtitan: CPU device selection)
"""What document masking costs: a packed step vs the same step with plain causal positions.

Same SpeechLM (hidden 512, 8 layers, 8 heads, 8 streams), same [B, T] batch; one training step
= forward + loss + backward + AdamW. *plain*: no ``position_ids`` (one causal sequence per
row). *packed*: each row holds D documents of random lengths, positions restarting at 0, with
each attention path that runs here: ``sdpa_documents`` (our default: SDPA per document, no
mask tensor), ``sdpa`` (transformers' dense [B, 1, T, T] block mask) and, on a GPU,
``flex_attention`` (transformers' BlockMask) and the native backbone's flex. Variants run
interleaved (A, B, C, A, B, C, ...) after a warm-up, so machine noise hits them alike; the
report has the median and spread of the repeats and packed/plain ratios.

    python benchmarks/bench_attention.py [--shapes 2048x8,8192x16] [--repeats 5]
Writes benchmarks/results/attention_{cpu,gpu}.json (``--out``). Smallest setting (a smoke test of
the script, not a measurement): ``--shapes 64x2 --repeats 1 --hidden 64 --layers 1 --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

import torchtitan_speechlm  # noqa: F401
from bench_common import (
    amp_context,
    build_speechlm,
    device_name,
    interleaved,
    packed_positions,
    random_frames,
    train_step,
)

HIDDEN, LAYERS, HEADS, KV, FFN, TEXT, STREAMS, CODEBOOK = 512, 8, 8, 4, 1536, 4096, 8, 1024


def measure(
    shape: str, repeats: int, device: str, hidden: int = HIDDEN, layers: int = LAYERS
) -> dict:
    t, docs = (int(x) for x in shape.split("x"))
    b = 2
    amp = amp_context(device)
    variants = {  # name: (backbone, attention, packed)
        "hf plain": ("hf", "sdpa_documents", False),
        "hf packed sdpa_documents": ("hf", "sdpa_documents", True),
        "hf packed sdpa (dense mask)": ("hf", "sdpa", True),
        "native plain": ("native", "sdpa_documents", False),
        "native packed (grouped documents)": ("native", "sdpa_documents", True),
    }
    if device == "cuda":
        variants["hf packed flex_attention"] = ("hf", "flex_attention", True)
        variants["native packed flex"] = ("native", "flex", True)
    ffn = FFN * hidden // HIDDEN
    dims = dict(hidden=hidden, layers=layers, heads=HEADS, kv=KV, ffn=ffn, text=TEXT)
    steps = {}
    for name, (backbone, attn, packed) in variants.items():
        model, layout = build_speechlm(
            device, backbone=backbone, attn=attn, streams=STREAMS, codebook=CODEBOOK, **dims
        )
        frames = random_frames(layout, b, t + 1, device)
        weights = torch.full((b, t, STREAMS), 1.0 / STREAMS, device=device)
        pos = packed_positions(b, t, docs, device) if packed else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        steps[name] = train_step(model, frames, weights, pos, opt, amp)
    times = interleaved(steps, repeats, device, warmup=1)
    med = {n: statistics.median(v) for n, v in times.items()}
    return {
        "shape": {"batch": b, "seq_len": t, "documents_per_row": docs},
        "median_s": med,
        "spread_s": {n: [min(v), max(v)] for n, v in times.items()},
        "packed_over_plain": {
            n: med[n] / med[n.split()[0] + " plain"] for n in med if "packed" in n
        },
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default="2048x8,8192x16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hidden", type=int, default=HIDDEN, help="model width (FFN 3x)")
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--out", help="results file (default benchmarks/results/attention_<dev>.json)")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = a.out or f"benchmarks/results/attention_{'gpu' if device == 'cuda' else 'cpu'}.json"
    rows = []
    for shape in a.shapes.split(","):
        rows.append(dict(measure(shape, a.repeats, device, a.hidden, a.layers), repeats=a.repeats))
        print(json.dumps(rows[-1], indent=2), flush=True)
    rows += kept_rows(path, rows)
    result = {
        "device": device_name(device),
        "torch": torch.__version__,
        "model": dict(
            hidden=a.hidden,
            layers=a.layers,
            heads=HEADS,
            kv_heads=KV,
            ffn=FFN * a.hidden // HIDDEN,
            streams=STREAMS,
        ),
        "results": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return 0


def kept_rows(path: str, new: list[dict]) -> list[dict]:
    """Earlier results of shapes not measured this time (a long shape can be rerun alone)."""
    if not os.path.exists(path):
        return []
    done = {json.dumps(r["shape"], sort_keys=True) for r in new}
    with open(path) as f:
        old = json.load(f)["results"]
    return [r for r in old if json.dumps(r["shape"], sort_keys=True) not in done]


if __name__ == "__main__":
    sys.exit(main())
