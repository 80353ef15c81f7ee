"""The arguments of ``torchtitan export`` (commands/export.py): ``ExportArgs``, one field per
flag (commands/flag_fields.py), and its parser, generated from them. Standard library only, so
that ``torchtitan export --help`` answers before torch is imported (cli.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from torchtitan_speechlm.commands.flag_fields import add_flags, flag, from_namespace

DTYPE_NAMES = ("bf16", "fp16", "fp32")  # commands/export.py maps each to its torch dtype
SIZE_UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


@dataclass(kw_only=True)
class ExportArgs:
    """The settings of ``torchtitan export``: ``export_command`` (commands/export.py) takes the
    value whole. ``--out-dir`` is the folder written (``--out``, its old spelling, still taken:
    generate's and eval's ``--out`` is a FILE)."""

    checkpoint: str = flag(
        names=("--checkpoint", "--model"),
        help="a checkpoint folder: DUMP/checkpoint/step-N (--model: the same flag, by the name "
        "generate, eval and serve give theirs)",
    )
    out_dir: str = flag(old=("--out",), help="the folder to write")
    dtype: str = flag("fp32", choices=DTYPE_NAMES, help="the weights' dtype (fp32)")
    text_only: bool = flag(
        False, help="write only the text LM inside, as a transformers causal-LM folder"
    )
    adapter: bool = flag(
        False,
        help="a LoRA run: keep the adapters apart (text/ base weights + adapter/, a PEFT "
        "adapter folder) instead of merging them into the weights",
    )
    max_shard_size: str = flag("5GB", help="split weights above this (5GB)")
    force: bool = flag(False, help="replace an existing --out-dir")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ExportArgs:
        """The parsed ``torchtitan export`` command line (``build_parser().parse_args``)."""
        return from_namespace(cls, ns)

    def validate(self) -> None:
        """The checks of the settings themselves (before the checkpoint is read): a ValueError
        naming the flag."""
        self.shard_bytes()  # the dtype: export() (a Python caller's too)

    def shard_bytes(self) -> int:
        """``--max-shard-size`` in bytes (5GB, 500MB, 2048KB or a number of bytes)."""
        return parse_size(self.max_shard_size)


def parse_size(text: str) -> int:
    """A size in bytes: ``5GB``, ``500MB``, ``64KB`` (binary units) or a number; ValueError
    naming ``--max-shard-size`` otherwise."""
    try:
        for unit, factor in SIZE_UNITS.items():
            if text.upper().endswith(unit):
                return int(float(text[: -len(unit)]) * factor)
        return int(text)
    except ValueError:
        raise ValueError(
            f"--max-shard-size {text!r}: a size such as 5GB, 500MB, 64KB or a number of bytes"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchtitan export",
        description="write a training checkpoint as a self-contained model folder",
    )
    add_flags(p, ExportArgs)
    return p
