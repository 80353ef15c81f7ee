# ruff: noqa: I001  (torchtitan_speechlm must be imported before torchtitan: CPU device selection)
"""SpeechLM vs torchtitan's native llama3 of equal dimensions, on the paths real training takes.

Every variant trains (forward + loss + backward + AdamW) on the same kind of batch: packed rows
with real position ids (documents of random lengths), ``B x T`` above the loss head's chunk so
the chunked head runs more than once, and part of the frames carrying no loss. Two configs:

- *speech*: 8 streams (a 1024-code codebook each), 30% of the frames without loss;
- *text*: the same model on text-only frames (streams 1..7 pads, loss on stream 0 only).

Variants: SpeechLM with each backbone family (``hf`` over a Llama config, ``hf`` over a Qwen3
config, ``native`` torchtitan blocks), and torchtitan's llama3 ``Transformer`` with the same
hidden size, layers, heads, FFN width and as many vocabulary rows as the SpeechLM's head
predicts (speech: the whole layout; text: stream 0's slice), on the same token count. On a GPU
llama3 uses torchtitan's own document masking (flex, block-causal from the same documents);
on CPU torch's flex attention has no backward, so llama3 runs its default causal SDPA there
(more attention work than document masking: the CPU ratio flatters SpeechLM on packed rows;
the ``speechlm plain`` row, without packing, is the like-for-like CPU comparison).

All variants of a config run interleaved (A, B, C, A, B, C, ...) in one process after a
warm-up; the report has the median and spread of the repeats, frames/s, ratios to llama3 and
peak memory (GPU: ``max_memory_allocated`` per variant; CPU: the peak RSS of a separate process
running two steps of that variant alone, over its RSS after the imports).

    python benchmarks/bench_vs_llama3.py [--shape small] [--repeats 5] [--compile]
Writes benchmarks/results/vs_llama3_<shape>_{cpu,gpu}.json (and _compile with --compile; the
folder: ``--results-dir``). Smallest setting (a smoke test of the script): ``--shape tiny
--repeats 1 --configs speech --variants "speechlm hf-llama" --results-dir DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F

import torchtitan_speechlm  # noqa: F401
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Transformer

from torchtitan_speechlm.distributed.parallelize import apply_compile
from bench_common import (
    train_step,
    peak_rss_bytes,
    amp_context,
    build_speechlm,
    device_name,
    interleaved,
    packed_positions,
    random_frames,
)

# hidden, layers, heads, kv heads, ffn, text vocab, batch, seq_len, documents per row
SHAPES = {
    "tiny": (64, 2, 4, 2, 192, 512, 2, 512, 4),  # a smoke test of the script itself
    "small": (512, 8, 8, 4, 1536, 4096, 4, 2048, 8),
    "qwen3_0.6b": (1024, 28, 16, 8, 3072, 151_936, 4, 4096, 8),
    "qwen3_1.7b": (2048, 28, 16, 8, 6144, 151_936, 2, 4096, 8),
}
STREAMS, CODEBOOK, NO_LOSS = 8, 1024, 0.3
FLOPS: dict[str, float] = {}  # training FLOPs per frame of each variant (torchtitan's count)


def llama3(shape: str, vocab: int, device: str, flex: bool):
    h, layers, heads, kv, ffn, *_ = SHAPES[shape]
    args = TransformerModelArgs(
        dim=h,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        vocab_size=vocab,
        multiple_of=ffn,
        ffn_dim_multiplier=None,
        max_seq_len=16384,
        attn_type="flex" if flex else "sdpa",
        attn_mask_type="block_causal" if flex else "causal",
    )
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    return model


def batch(layout, config: str, b: int, t: int, docs: int, device: str):
    g = torch.Generator().manual_seed(1)
    frames = random_frames(layout, b, t + 1, device)
    weights = torch.full((b, t, STREAMS), 1.0 / STREAMS)
    weights[torch.rand(b, t, generator=g) < NO_LOSS] = 0.0
    if config == "text":
        for k in range(1, STREAMS):
            frames[..., k] = layout.stream_pad(k)
        weights[..., 1:] = 0.0
        lo = layout.text_offset
        frames[..., 0] = torch.randint(lo, lo + layout.text_size, (b, t + 1), generator=g).to(
            device
        )
    return frames, weights.to(device), packed_positions(b, t, docs, device)


def variants(
    shape: str,
    config: str,
    device: str,
    compile_: bool,
    only: str | None = None,
    names: tuple[str, ...] | None = None,
):
    """({name: step function}, frames per step); ``only``: build that variant alone."""
    h, layers, heads, kv, ffn, text, b, t, docs = SHAPES[shape]
    dims = dict(hidden=h, layers=layers, heads=heads, kv=kv, ffn=ffn, text=text)
    dims.update(streams=STREAMS, codebook=CODEBOOK)
    amp = amp_context(device)
    out = {}
    flex_hf = "flex_attention" if device == "cuda" else "sdpa_documents"
    models = {
        "speechlm hf-llama": ("hf", "llama", flex_hf, True),
        "speechlm hf-qwen3": ("hf", "qwen3", flex_hf, True),
        "speechlm native": (
            "native",
            "llama",
            "flex" if device == "cuda" else "sdpa_documents",
            True,
        ),
        "speechlm hf-llama plain": ("hf", "llama", "sdpa_documents", False),
    }
    for name, (backbone, family, attn, packed) in models.items():
        if only not in (None, name) or (names is not None and name not in names):
            continue
        model, layout = build_speechlm(device, backbone=backbone, family=family, attn=attn, **dims)
        if compile_:
            apply_compile(model, "inductor")
        frames, weights, pos = batch(layout, config, b, t, docs, device)
        pos = pos if packed else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

        out[name] = train_step(model, frames, weights, pos, opt, amp)
        nonhead = (
            model.args.get_nparams_and_flops(model, t)[1] - model.args.head_flops_per_loss_frame()
        )
        loss_share = float((weights > 0).any(-1).float().mean())
        FLOPS[name] = nonhead + model.args.head_flops_per_loss_frame() * loss_share
    if only not in (None, "llama3 (torchtitan)"):
        return out, b * t
    from torchtitan_speechlm.model.vocab import VocabLayout

    layout = VocabLayout(text_size=text, num_streams=STREAMS, codebook_size=CODEBOOK)
    # llama3 with as many head rows as the SpeechLM predicts for this config
    vocab = (
        layout.size if config == "speech" else layout.stream_range(0)[1] - layout.stream_range(0)[0]
    )
    ref = llama3(shape, vocab, device, flex=device == "cuda")
    if compile_:
        for layer_id, block in ref.layers.named_children():
            ref.layers.register_module(layer_id, torch.compile(block))
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, vocab, (b, t + 1), generator=g).to(device)
    keep = (torch.rand(b, t, generator=g) >= NO_LOSS).to(device)
    labels = torch.where(keep, tokens[:, 1:], -100)
    pos = packed_positions(b, t, docs, device)
    opt_l = torch.optim.AdamW(ref.parameters(), lr=1e-4, foreach=True)

    def step_llama():
        masks = None
        if device == "cuda":  # torchtitan's own block-causal mask over the same documents
            from torchtitan.models.attention import create_attention_mask

            doc = (pos == 0).cumsum(-1)
            masks = create_attention_mask(same_document_causal(doc), b, None, t, t)
        with amp:
            logits = ref(tokens[:, :-1], attention_masks=masks)
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
            )
        (loss / b).backward()
        opt_l.step()
        opt_l.zero_grad(set_to_none=True)

    out["llama3 (torchtitan)"] = step_llama
    FLOPS["llama3 (torchtitan)"] = ref.model_args.get_nparams_and_flops(ref, t)[1]
    return out, b * t


def same_document_causal(doc: torch.Tensor):
    from torch.nn.attention.flex_attention import and_masks
    from torchtitan.models.attention import get_causal_mask_mod

    def same_document(bi, h, q, kv):
        return doc[bi, q] == doc[bi, kv]

    return and_masks(get_causal_mask_mod(), same_document)


def mfu(med: dict[str, float], frames: int, device: str) -> dict[str, float] | None:
    """Model FLOPs utilisation: torchtitan's FLOPs count per frame (SpeechLM: the head on loss
    frames only) x frames/s over the GPU's peak bf16 FLOP/s (torchtitan's table)."""
    if device != "cuda":
        return None
    from torchtitan.tools.utils import get_peak_flops

    peak = get_peak_flops(torch.cuda.get_device_name())
    return {n: FLOPS[n] * frames / m / peak for n, m in med.items()}


def peak_memory(shape: str, config: str, name: str, device: str, compile_: bool) -> float:
    """MiB: GPU max_memory_allocated of two steps; CPU: the peak RSS of a process running them,
    over its RSS after the imports (model, optimizer state, activations, workspace)."""
    if device == "cuda":
        steps, _ = variants(shape, config, device, compile_, only=name)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            steps[name]()
        return torch.cuda.max_memory_allocated() / 2**20
    cmd = [sys.executable, __file__, "--shape", shape, "--memory-of", f"{config}:{name}"]
    return float(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1])


def result_name(a) -> str:
    device = "gpu" if torch.cuda.is_available() else "cpu"
    return f"vs_llama3_{a.shape}_{device}{'_compile' if a.compile else ''}{a.tag}.json"


def run_config(
    shape: str, config: str, repeats: int, device: str, compile_: bool, names=None
) -> dict:
    steps, frames = variants(shape, config, device, compile_, names=names)
    times = interleaved(steps, repeats, device)
    med = {n: statistics.median(v) for n, v in times.items()}
    ref = med["llama3 (torchtitan)"]
    return {
        "config": config,
        "median_s": med,
        "spread_s": {n: [min(v), max(v)] for n, v in times.items()},
        "frames_per_s": {n: frames / m for n, m in med.items()},
        "mfu": mfu(med, frames, device),
        "over_llama3": {n: ref / m for n, m in med.items() if n != "llama3 (torchtitan)"},
        "peak_memory_mib": {n: peak_memory(shape, config, n, device, compile_) for n in steps},
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--configs", default="speech,text")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--memory-of", help=argparse.SUPPRESS)
    p.add_argument("--memory-only", action="store_true", help="only (re)measure peak memory")
    p.add_argument("--variants", help="comma-separated SpeechLM variants (llama3 always runs)")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    p.add_argument("--results-dir", default="benchmarks/results", help="where results go")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.memory_of:  # child: two steps of one variant, print the peak RSS in MiB
        config, name = a.memory_of.split(":", 1)
        base = peak_rss_bytes()  # after the imports
        steps, _ = variants(a.shape, config, device, a.compile, only=name)
        for _ in range(2):
            steps[name]()
        print((peak_rss_bytes() - base) / 2**20)
        return 0
    if a.memory_only:  # fill in peak memory of an earlier run's results file
        path = os.path.join(a.results_dir, result_name(a))
        with open(path) as f:
            result = json.load(f)
        for row in result["results"]:
            names = list(row["median_s"])
            row["peak_memory_mib"] = {
                n: peak_memory(a.shape, row["config"], n, device, a.compile) for n in names
            }
            print(row["config"], row["peak_memory_mib"], flush=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        return 0
    h, layers, heads, kv, ffn, text, b, t, docs = SHAPES[a.shape]
    rows = []
    for config in a.configs.split(","):
        names = tuple(a.variants.split(",")) if a.variants else None
        rows.append(run_config(a.shape, config, a.repeats, device, a.compile, names))
        print(json.dumps(rows[-1], indent=2), flush=True)
    result = {
        "device": device_name(device),
        "torch": torch.__version__,
        "shape": dict(
            hidden=h,
            layers=layers,
            heads=heads,
            kv_heads=kv,
            ffn=ffn,
            text_vocab=text,
            batch=b,
            seq_len=t,
            documents_per_row=docs,
            streams=STREAMS,
        ),
        "compile": a.compile,
        "llama3_attention": "flex block_causal"
        if device == "cuda"
        else "causal sdpa (no CPU flex backward)",
        "results": rows,
    }
    os.makedirs(a.results_dir, exist_ok=True)
    with open(os.path.join(a.results_dir, result_name(a)), "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
