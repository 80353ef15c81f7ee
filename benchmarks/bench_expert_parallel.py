"""The expert-parallel step against EP=1 at equal global batch, through the real ``torchtitan
train`` (CPU, gloo, one thread per rank), on the qwen3 MoE backbone.

Both runs use the same ranks and global batch: FSDP alone (every rank holds all experts' shards
and computes its own tokens' experts) and FSDP x EP (each rank holds ``E / ep`` experts and
receives the tokens routed to them by all-to-all). Reports each run's median step time, the
ratio, peak memory per rank and whether the losses agree. On CPU the all-to-all is gloo's and the
experts are torchtitan's for-loop; on GPUs (benchmarks/gpu_check.sh, 2 GPUs or more) NCCL and
grouped GEMM. Results: benchmarks/results/expert_parallel_cpu.json.

    python benchmarks/bench_expert_parallel.py [--steps 8] [--ranks 2]

Smallest setting (a smoke test of the script): ``--steps 2 --hidden 32 --experts 4 --seq-len
512 --work DIR --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import ROOT, train  # noqa: E402  (the same runner)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2, help="processes of both runs; EP = this")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--local-batch", type=int, default=4)
    p.add_argument("--work", default="/tmp/bench_expert_parallel")
    p.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "expert_parallel_cpu.json")
    )
    return p.parse_args(argv)


def assets(args) -> dict:
    """A varied espeak-ng corpus and a Qwen3-MoE (``--experts`` experts, top 2)."""
    import transformers

    sys.path.insert(0, str(ROOT))
    from tests.helpers import make_varied_kaldi_assets, write_tiny_config

    work = Path(args.work)
    shape = dict(hidden_size=args.hidden, num_layers=args.layers, intermediate_size=2 * args.hidden)
    a = make_varied_kaldi_assets(work / "assets", n_utts=40, family="qwen3_moe", **shape)
    config = transformers.AutoConfig.from_pretrained(a["backbone"])
    config.num_experts = args.experts
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(a["backbone"])
    a["config"] = write_tiny_config(work / "c.toml", a, work / "unused")
    return a


def main(argv=None) -> None:
    args = parse_args(argv)
    a = assets(args)
    common = ["--speechlm.load_balance_weight", "0.01"]
    ep_flags = [*common, "--parallelism.expert_parallel_degree", str(args.ranks)]
    runs = {
        "ep1": train(args, a, "ep1", args.ranks, common, flavor="qwen3"),
        f"ep{args.ranks}": train(args, a, f"ep{args.ranks}", args.ranks, ep_flags, flavor="qwen3"),
    }
    one, ep = runs["ep1"], runs[f"ep{args.ranks}"]
    out = {
        "shape": vars(args),
        "runs": runs,
        "ep_step_over_ep1": ep["step_s"] / one["step_s"],
        "loss_rel_diff": abs(ep["loss"] - one["loss"]) / abs(one["loss"]),
    }
    print(
        f"EP=1: {one['step_s']:.3f} s/step, EP={args.ranks}: {ep['step_s']:.3f} s/step "
        f"(x{out['ep_step_over_ep1']:.2f}); peak memory per rank {one['peak_memory_gib_per_rank']} "
        f"vs {ep['peak_memory_gib_per_rank']} GiB; final losses differ by {out['loss_rel_diff']:.1e}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
