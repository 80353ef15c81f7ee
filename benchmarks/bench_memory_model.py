# ruff: noqa: I001  (torchtitan_speechlm must be imported before torchtitan: CPU device selection)
"""Activation memory per frame and per decoder layer, with and without activation checkpointing.

The figure behind docs/performance.md's memory model. For each activation-checkpointing mode
(torchtitan's ``apply_ac``: none, selective "op", full) a fresh process builds a bf16 SpeechLM
(as FSDP's mixed precision computes), runs one forward over packed rows and reads how much
memory the forward left behind for backward (process RSS after the forward minus before it;
glibc is told to serve every allocation over 64 KiB with mmap so freed tensors leave the RSS).
Two depths (L and 2L layers) are measured: their difference over L is the cost of one layer,
the rest is the depth-independent part (embeddings, the chunked loss head's saved rows).

    python benchmarks/bench_memory_model.py [--hidden 1024 --layers 2 --seq-len 4096]

Writes benchmarks/results/memory_model_cpu.json (bytes per frame per layer, also in units of
the hidden size, so the figure scales to other widths; ``--out``). Smallest setting (a smoke
test of the script): ``--hidden 64 --layers 1 --seq-len 64 --docs 2 --modes none
--out FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import build_speechlm, packed_positions, random_frames  # noqa: E402

MODES = ("none", "selective", "full")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(mode: str, hidden: int, layers: int, seq_len: int, docs: int) -> int:
    """Bytes the forward keeps alive for backward (run in a fresh process)."""
    import torchtitan_speechlm  # noqa: F401  (selects the CPU device before torchtitan)
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

    torch.manual_seed(0)
    model, layout = build_speechlm(
        "cpu",
        hidden=hidden,
        layers=layers,
        heads=hidden // 64,
        kv=max(1, hidden // 128),
        ffn=3 * hidden,
        text=4096,
        streams=8,
        codebook=1024,
    )
    model.to(torch.bfloat16)
    if mode != "none":
        cfg = ActivationCheckpoint(mode=mode, selective_ac_option="op")
        apply_ac(model.backbone, cfg, op_sac_save_list=_op_sac_save_list)
    frames = random_frames(layout, 1, seq_len + 1, "cpu")
    weights = torch.full((1, seq_len, 8), 1.0 / 8)
    pos = packed_positions(1, seq_len, docs, "cpu")
    for _ in range(2):  # warm-up: lazily built state (rotary caches, kernels) is not activation
        out = model(frames[:, :-1], targets=frames[:, 1:], loss_weights=weights, position_ids=pos)
        out.loss_sum.backward()
        model.zero_grad(set_to_none=True)
        del out
    before = rss_bytes()
    out = model(frames[:, :-1], targets=frames[:, 1:], loss_weights=weights, position_ids=pos)
    kept = rss_bytes() - before
    out.loss_sum.backward()
    return kept


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--modes", default=",".join(MODES), help="activation checkpointing modes")
    p.add_argument("--out", help="results file (default benchmarks/results/memory_model_cpu.json)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # "mode:layers", run in a child process
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.one:
        mode, layers = a.one.split(":")
        print(measure(mode, a.hidden, int(layers), a.seq_len, a.docs))
        return 0
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="2")
    common = ["--hidden", str(a.hidden), "--seq-len", str(a.seq_len), "--docs", str(a.docs)]
    rows = {}
    from torchtitan_speechlm.model.vocab import VocabLayout

    head_rows = VocabLayout(text_size=4096, num_streams=8, codebook_size=1024).size
    head_grad = 4 * a.hidden * head_rows
    for mode in a.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"bench_memory_model: --modes: {mode!r} is not one of {MODES}")
        kept = {}
        for depth in (a.layers, 2 * a.layers):
            cmd = [sys.executable, __file__, *common, "--one", f"{mode}:{depth}"]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            kept[depth] = int(out.stdout.split()[-1])
        per_layer = (kept[2 * a.layers] - kept[a.layers]) / a.layers / a.seq_len
        # the loss head keeps its weight gradient (fp32, summed over chunks) from forward to
        # backward: a fixed 4 bytes per head parameter, not a per-frame cost
        rest = (kept[a.layers] - per_layer * a.layers * a.seq_len - head_grad) / a.seq_len
        rows[mode] = {
            "bytes_per_frame_per_layer": per_layer,
            "per_frame_per_layer_in_hidden_units": per_layer / a.hidden,
            "depth_independent_bytes_per_frame": rest,
            "head_weight_gradient_bytes": head_grad,
            "kept_bytes": kept,
        }
        print(
            f"{mode:>9}: {per_layer / 1024:8.1f} KiB/frame/layer = {per_layer / a.hidden:5.1f} x "
            f"hidden bytes; depth-independent {rest / 1024:7.1f} KiB/frame"
        )
    result = {
        "device": "cpu",
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "model": {"hidden": a.hidden, "heads": a.hidden // 64, "ffn": 3 * a.hidden, "streams": 8},
        "seq_len": a.seq_len,
        "documents_per_row": a.docs,
        "command": "python benchmarks/bench_memory_model.py",
        "modes": rows,
    }
    path = a.out or os.path.join(os.path.dirname(__file__), "results", "memory_model_cpu.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
