# ruff: noqa: I001  (torchtitan_speechlm must be imported before torchtitan: CPU device selection)
"""LoRA vs full fine-tuning of the same SpeechLM: step time and peak memory.

Each mode runs in a fresh process (so peak memory is its own): the same randomly initialised
SpeechLM, one packed row batch, AdamW over the parameters that train. ``full`` trains every
parameter; ``lora`` wraps every decoder linear layer in PEFT's LoRA (model/lora.py, rank
``--rank``) with the added vocabulary rows training (``lora.train_audio_rows``, the default:
the embedding and head tables then keep gradients and AdamW moments in full, their text rows
held by a gradient mask) and the rest frozen; ``lora_adapters_only`` trains the adapters alone
(``train_audio_rows = false``). Peak memory is the process's peak RSS on CPU (VmHWM; model, gradients,
AdamW's moments, activations) and ``torch.cuda.max_memory_allocated`` on a GPU (bf16 autocast).

    python benchmarks/bench_lora.py [--device cpu|cuda] [--shape small] [--rank 16]

Writes benchmarks/results/lora_{device}.json (``--out``). Smallest setting (a smoke test of the
script): ``--shape tiny --repeats 1 --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    amp_context,
    build_speechlm,
    device_name,
    interleaved,
    packed_positions,
    peak_rss_bytes,
    random_frames,
    summary,
    train_step,
)

# hidden, layers, heads, kv heads, ffn, text vocabulary, rows, frames per row, documents per row
SHAPES = {
    "tiny": (64, 1, 4, 2, 192, 512, 1, 64, 2),
    "small": (512, 4, 8, 4, 1536, 16_384, 2, 1024, 4),  # CPU
    "qwen3_0.6b": (1024, 28, 16, 8, 3072, 151_936, 4, 4096, 8),  # GPU
}
MODES = ("full", "lora", "lora_adapters_only")


def measure(mode: str, shape: str, rank: int, device: str, repeats: int) -> dict:
    """One mode's step time and peak memory (run in a fresh process)."""
    import torchtitan_speechlm  # noqa: F401  (selects the CPU device before torchtitan)
    from torchtitan_speechlm.model.lora import LoraSettings, apply_lora

    h, layers, heads, kv, ffn, text, b, t, docs = SHAPES[shape]
    torch.manual_seed(0)
    model, layout = build_speechlm(
        device,
        hidden=h,
        layers=layers,
        heads=heads,
        kv=kv,
        ffn=ffn,
        text=text,
        streams=8,
        codebook=1024,
        family="qwen3",
    )
    if mode != "full":
        settings = LoraSettings(
            rank=rank,
            alpha=2.0 * rank,
            dropout=0.0,
            target_modules=["all-linear"],
            train_audio_rows=mode == "lora",
            train_head=False,
        )
        apply_lora(model, settings)
        model.to(device)  # the adapters were made on the CPU
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4, foreach=True)
    frames = random_frames(layout, b, t + 1, device)
    weights = torch.ones(b, t, layout.num_streams, device=device)
    positions = packed_positions(b, t, docs, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step = train_step(model, frames, weights, positions, opt, amp_context(device))
    times = interleaved({mode: step}, repeats, device)[mode]
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else peak_rss_bytes()
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    return {
        "step_s": summary(times),
        "peak_memory_bytes": peak,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trained_parameters": sum(p.numel() for p in trained),
        "optimizer_state_bytes": state,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="results file (default benchmarks/results/lora_{device}.json)")
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # run in a child process
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.one, a.shape, a.rank, a.device, a.repeats)))
        return 0
    common = ["--device", a.device, "--shape", a.shape, "--rank", str(a.rank)]
    rows = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, *common, "--repeats", str(a.repeats), "--one", mode]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        r = rows[mode]
        print(
            f"{mode:>18}: step {r['step_s']['median'] * 1e3:8.1f} ms, peak "
            f"{r['peak_memory_bytes'] / 2**20:8.1f} MiB, trains {r['trained_parameters']:,} of "
            f"{r['parameters']:,} parameters, AdamW state {r['optimizer_state_bytes'] / 2**20:.1f} MiB"
        )
    full = rows["full"]
    h, layers, heads, kv, ffn, text, b, t, docs = SHAPES[a.shape]
    result = {
        "device": device_name(a.device),
        "torch": torch.__version__,
        "dtype": "bfloat16 autocast" if a.device == "cuda" else "float32",
        "shape": a.shape,
        "model": {"hidden": h, "layers": layers, "ffn": ffn, "text_vocab": text, "streams": 8},
        "batch": {"rows": b, "frames_per_row": t, "documents_per_row": docs},
        "lora_rank": a.rank,
        "command": f"python benchmarks/bench_lora.py --device {a.device} --shape {a.shape} "
        f"--rank {a.rank} --repeats {a.repeats}",
        "modes": rows,
        "vs_full": {
            mode: {
                "step_time": r["step_s"]["median"] / full["step_s"]["median"],
                "peak_memory": r["peak_memory_bytes"] / full["peak_memory_bytes"],
                "trained_parameters": r["trained_parameters"] / full["trained_parameters"],
            }
            for mode, r in rows.items()
            if mode != "full"
        },
    }
    path = a.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"lora_{a.device}.json"
    )
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    for mode, r in result["vs_full"].items():
        print(f"{mode} / full: step time {r['step_time']:.2f}, peak memory {r['peak_memory']:.2f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
