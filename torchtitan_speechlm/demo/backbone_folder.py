"""``python -m torchtitan_speechlm.demo.backbone_folder``: a backbone folder as a download
would give one (a transformers ``save_pretrained`` folder with its tokenizer, in bf16 as
released checkpoints store their weights), random-init and tiny, so the docs' journey *A bf16
Qwen3 folder* (docs/checkpoints.md) runs in a minute on a CPU and without a download. A real
folder (``huggingface-cli download Qwen/Qwen3-0.6B-Base --local-dir DIR``) goes where it goes.
"""

from __future__ import annotations

import argparse
import os
import sys

from torchtitan_speechlm.demo.assets import build_backbone

DTYPES = ("bfloat16", "float16", "float32")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_speechlm.demo.backbone_folder",
        description="Write a tiny random-init backbone folder with a tokenizer, in a dtype.",
    )
    p.add_argument("--family", default="qwen3", choices=("qwen3", "llama", "qwen2", "qwen3_moe"))
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="as stored (bfloat16)")
    p.add_argument("--tokenizer", required=True, help="a tokenizer folder, copied in")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", required=True, help="the folder to write (must not exist)")
    return p


def write_backbone_folder(
    out: str, tokenizer: str, family: str = "qwen3", dtype: str = "bfloat16", hidden: int = 64,
    layers: int = 2,
) -> str:  # fmt: skip
    """``out``: the tokenizer of ``tokenizer`` and a random-init ``family`` decoder with as many
    embedding rows as it has tokens, saved in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.exists(out):
        raise FileExistsError(f"{out} exists: choose another --out (nothing was written)")
    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    build_backbone(out, family=family, vocab_size=len(tok), hidden_size=hidden,
                   num_layers=layers, intermediate_size=2 * hidden)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(out, dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        write_backbone_folder(a.out, a.tokenizer, a.family, a.dtype, a.hidden, a.layers)
    except (OSError, ValueError) as e:
        print(f"backbone_folder: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}: a random-init {a.family} ({a.layers} layers, hidden {a.hidden}), "
          f"stored as {a.dtype}, with the tokenizer of {a.tokenizer}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
