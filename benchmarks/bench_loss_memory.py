# ruff: noqa: I001  (torchtitan_speechlm must be imported before torchtitan: CPU device selection)
"""Peak memory of the loss side at a real vocabulary: naive full logits vs SpeechLM's head.

A 150k text vocabulary (Qwen's 151,936) plus 8 codebook streams of 1024 codes, 8k frames, every
stream carrying loss. *Naive*: each stream's full fp32 logits, ``F.cross_entropy``, backward
(what an HF Trainer script does). *Ours*: ``SpeechLMHead`` (fp32 logits in memory-bounded
chunks, gradients computed per chunk). Each variant runs in its own process; the loss side's
peak is that process's peak memory minus its peak after building the inputs (peak RSS on CPU,
``torch.cuda.max_memory_allocated`` on a GPU). The two must give the same loss and gradients
(fp32: 1e-5 relative; bf16 parameters: within two bf16 ulps of the largest value).

    python benchmarks/bench_loss_memory.py [--frames 8192] [--hidden 256] [--dtypes float32,bfloat16]
Writes benchmarks/results/loss_memory_{cpu,gpu}.json (``--results``). Smallest setting (a smoke
test of the script): ``--frames 64 --hidden 16 --dtypes float32 --results FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

import torchtitan_speechlm  # noqa: F401
from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.head import SpeechLMHead
from torchtitan_speechlm.model.vocab import VocabLayout
from bench_common import peak_rss_bytes

TEXT_VOCAB, STREAMS, CODEBOOK = 151_936, 8, 1024
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def peak_bytes() -> int:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return peak_rss_bytes()


def inputs(frames: int, hidden: int, dtype: torch.dtype):
    layout = VocabLayout(text_size=TEXT_VOCAB, num_streams=STREAMS, codebook_size=CODEBOOK)
    args = SpeechLMModelArgs(vocab=layout.to_dict(), tie_embeddings=False)
    head = SpeechLMHead(args, hidden).to(DEVICE, dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head.output.weight.normal_(0, 0.02, generator=g)
        head.stream_emb.weight.normal_(0, 0.02, generator=g)
    h = torch.randn(frames, hidden, generator=g).to(DEVICE, dtype).requires_grad_()
    targets = torch.stack(
        [torch.randint(*head.ranges[k], (frames,), generator=g) for k in range(STREAMS)], -1
    ).to(DEVICE)
    weights = torch.full((frames, STREAMS), 1.0 / STREAMS, device=DEVICE)
    return head, h, targets, weights


def naive_loss(head, h, targets, weights) -> torch.Tensor:
    """Every stream's full fp32 logits at once, then cross-entropy: the usual way."""
    w = head.output.weight
    losses = []
    for k, (a, b) in enumerate(head.ranges):
        logits = F.linear(head.stream_input(h, k), w[a:b]).float()
        ce = F.cross_entropy(logits, targets[:, k] - a, reduction="none")
        losses.append((weights[:, k] * ce).sum())
    return torch.stack(losses).sum()


def child(variant: str, frames: int, hidden: int, dtype: str, out: str) -> None:
    head, h, targets, weights = inputs(frames, hidden, getattr(torch, dtype))
    head.output.weight.grad = torch.zeros_like(head.output.weight)  # both need it: not loss side
    h.grad = torch.zeros_like(h)
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = peak_bytes()
    if variant == "naive":
        loss = naive_loss(head, h, targets, weights)
    else:
        loss = head(h, targets, weights)[0]
    loss.backward()
    peak = peak_bytes() - base
    torch.save(
        {
            "peak": peak,
            "loss": loss.detach().cpu(),
            "h": h.grad.float().cpu(),
            "w": head.output.weight.grad.float().cpu(),
        },
        out,
    )


def run(frames: int, hidden: int, dtype: str) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for variant in ("naive", "ours"):
            path = os.path.join(d, f"{variant}.pt")
            cmd = [sys.executable, __file__, "--child", variant, "--frames", str(frames)]
            cmd += ["--hidden", str(hidden), "--dtypes", dtype, "--out", path]
            subprocess.run(cmd, check=True)
            results[variant] = torch.load(path)
    naive, ours = results["naive"], results["ours"]
    tol = 1e-5 if dtype == "float32" else 2 * 2**-8

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    errors = {
        "loss": float(abs(ours["loss"] - naive["loss"]) / abs(naive["loss"])),
        "grad_hidden": rel(ours["h"], naive["h"]),
        "grad_output_weight": rel(ours["w"], naive["w"]),
    }
    return {
        "dtype": dtype,
        "frames": frames,
        "hidden": hidden,
        "peak_mib": {"naive": naive["peak"] / 2**20, "ours": ours["peak"] / 2**20},
        "reduction": naive["peak"] / max(ours["peak"], 1),
        "relative_error": errors,
        "tolerance": tol,
        "equal": all(e <= tol for e in errors.values()),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--frames", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024 if DEVICE == "cuda" else 256)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument(
        "--results",
        default=f"benchmarks/results/loss_memory_{'gpu' if DEVICE == 'cuda' else 'cpu'}.json",
        help="results file",
    )
    p.add_argument("--child", choices=["naive", "ours"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)  # the child's output
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.child:
        child(a.child, a.frames, a.hidden, a.dtypes, a.out)
        return 0
    rows = [run(a.frames, a.hidden, dt) for dt in a.dtypes.split(",")]
    result = {
        "device": torch.cuda.get_device_name()
        if DEVICE == "cuda"
        else f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__,
        "vocab": {"text": TEXT_VOCAB, "streams": STREAMS, "codebook": CODEBOOK},
        "results": rows,
    }
    print(json.dumps(result, indent=2))
    os.makedirs(os.path.dirname(os.path.abspath(a.results)), exist_ok=True)
    with open(a.results, "w") as f:
        json.dump(result, f, indent=2)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
