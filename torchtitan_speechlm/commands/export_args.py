"""The arguments of ``torchtitan export`` (commands/export.py); standard library only, so that
``torchtitan export --help`` answers before torch is imported (cli.py)."""

from __future__ import annotations

import argparse

DTYPE_NAMES = ("bf16", "fp16", "fp32")  # commands/export.py maps each to its torch dtype


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchtitan export",
        description="write a training checkpoint as a self-contained model folder",
    )
    p.add_argument(
        "--checkpoint",
        "--model",
        dest="checkpoint",
        required=True,
        help="a checkpoint folder: DUMP/checkpoint/step-N (--model: the same flag, by the name "
        "generate, eval and serve give theirs)",
    )
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES)
    p.add_argument(
        "--text-only",
        action="store_true",
        help="write only the text LM inside, as a transformers causal-LM folder",
    )
    p.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run: keep the adapters apart (text/ base weights + adapter/, a PEFT "
        "adapter folder) instead of merging them into the weights",
    )
    p.add_argument("--max-shard-size", default="5GB", help="split weights above this (5GB)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    return p
