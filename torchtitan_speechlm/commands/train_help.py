"""``torchtitan train --help``: a page, not tyro's 1,200 lines.

Our sections first (every key with its default and the first sentence of its docstring, the
docs' underscore spelling), then the torchtitan keys a SpeechLM run sets most, then where the
rest is: ``--help-all`` (tyro's full list, hyphenated, every torchtitan key) and docs/config.md.
It imports neither torch nor torchtitan, so it answers as fast as the other commands' help.
"""

from __future__ import annotations

import shutil
import textwrap

from torchtitan_speechlm.config.field_docs import SECTIONS, keys_of

USAGE = (
    "usage: torchtitan train --job.config_file FILE.toml [--nproc-per-node N] "
    "[--section.key value ...]"
)
# torchtitan keys a SpeechLM run sets most often (tests/unit/commands check each exists upstream)
TORCHTITAN_KEYS = (
    ("job.config_file", "the training TOML (required)"),
    ("job.dump_folder", "where checkpoints, logs and the run record go"),
    ("model.hf_assets_path", "the backbone folder (a Hugging Face causal LM: config.json ...)"),
    ("training.steps", "optimizer steps in all"),
    ("training.local_batch_size", "sequences per rank per micro-batch"),
    (
        "training.global_batch_size",
        "sequences per step (gradient accumulation = this / ranks x local)",
    ),
    ("training.seq_len", "tokens per sequence (packed)"),
    ("training.max_norm", "gradient clipping norm"),
    ("optimizer.lr", "peak learning rate"),
    ("lr_scheduler.warmup_steps", "warmup steps (see [lr_scheduler] warmup_from_zero above)"),
    ("lr_scheduler.decay_type", "linear, sqrt or cosine"),
    ("lr_scheduler.min_lr_factor", "the LR floor, as a fraction of the peak"),
    ("checkpoint.enable", "save checkpoints (DCP, reshardable)"),
    ("checkpoint.interval", "steps between saves"),
    ("checkpoint.keep_latest_k", "checkpoints kept (0: all)"),
    ("parallelism.data_parallel_shard_degree", "FSDP2 ranks (-1: all that are left)"),
    ("parallelism.data_parallel_replicate_degree", "DDP / HSDP replicas"),
    ("parallelism.tensor_parallel_degree", "tensor-parallel ranks"),
    ("activation_checkpoint.mode", "none, selective or full"),
    ("compile.enable", "torch.compile the model"),
    ("validation.enable", "validate on [speechlm_data] valid sets"),
    ("validation.freq", "steps between validations"),
    ("metrics.log_freq", "steps between logged metrics"),
    ("metrics.enable_wandb", "log to wandb (offline files unless WANDB_MODE says otherwise)"),
)
EXTRA_SECTIONS = {  # torchtitan's sections with keys of ours in them
    name: f"[{name}] (torchtitan's, with these keys of ours)"
    for name in ("checkpoint", "lr_scheduler", "metrics")
}


def _first_sentence(text: str) -> str:
    cut = text.find(". ")
    return text if cut < 0 else text[: cut + 1]


def _entry(key: str, meaning: str, width: int) -> list[str]:
    """``  --key``, its meaning wrapped and indented under it."""
    body = textwrap.wrap(meaning, width=width - 8) or [""]
    return [f"  --{key}", *(f"        {line}" for line in body)]


def train_help(width: int | None = None) -> str:
    """The page ``torchtitan train --help`` prints (module docstring)."""
    width = width or min(shutil.get_terminal_size((100, 24)).columns, 100)
    lines = [
        USAGE,
        "",
        "Trains with torchtitan's own loop. Every TOML key can be set on the command line as",
        "--section.key value (underscores, as the docs and TOMLs write them; a bool as",
        "--section.key true|false). docs/config.md: every key of ours in full.",
        "",
        "launcher:",
        *_entry("nproc-per-node N", "processes on this machine (torchrun's; default 1)", width),
        "",
    ]
    for name, cls in SECTIONS:
        title = EXTRA_SECTIONS.get(name, f"[{name}]")
        doc = (cls.__doc__ or "").split(":", 1)[-1].strip()
        lines.append(f"{title}: {doc}" if name not in EXTRA_SECTIONS else title)
        for key, default, meaning in keys_of(cls):
            lines += _entry(f"{name}.{key} (default {default})", _first_sentence(meaning), width)
        lines.append("")
    lines.append("torchtitan's keys a run sets most (defaults: `--help-all`):")
    for key, meaning in TORCHTITAN_KEYS:
        lines += _entry(key, meaning, width)
    lines += [
        "",
        "`torchtitan train --help-all`: every torchtitan key (tyro's list, about 1,200 lines;",
        "it prints hyphens, both spellings work).",
    ]
    return "\n".join(lines)
