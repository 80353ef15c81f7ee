"""The shipped recipes (train_configs/*.toml) as a user runs them: only the FILL-IN paths
replaced (the backbone folder, each named dataset), everything else as shipped, sizes cut by
command-line overrides. Used by the recipe tests and by benchmarks/gpu_check (its dry run)."""

from __future__ import annotations

import re
from pathlib import Path

RECIPES = Path(__file__).resolve().parent.parent / "train_configs"
FILL_IN = re.compile(r'"/FILL-IN/[^"]*"')


def filled_recipe(recipe: str, out, backbone: str, datasets: dict[str, str], dump: str) -> str:
    """Write ``recipe`` (a file name in train_configs/ or a path) with its FILL-IN paths
    replaced to ``out``: ``model.hf_assets_path`` -> ``backbone``, each ``NAME=/FILL-IN/...``
    dataset -> ``datasets[NAME]``, and ``job.dump_folder`` -> ``dump``. Returns the path."""
    path = Path(recipe) if Path(recipe).is_file() else RECIPES / recipe
    text = path.read_text()

    def fill(match: re.Match) -> str:
        line_start = text.rfind("\n", 0, match.start()) + 1
        line = text[line_start : match.start()]
        if "hf_assets_path" in line:
            return f'"{backbone}"'
        raise AssertionError(f"{path}: a FILL-IN outside hf_assets_path/datasets: {line}")

    def dataset(match: re.Match) -> str:
        name = match.group(1)
        if name not in datasets:
            raise AssertionError(f"{path}: no data given for dataset {name!r}")
        return f'"{name}={datasets[name]}"'

    text = re.sub(r'"(\w+)=/FILL-IN/[^"]*"', dataset, text)
    text = FILL_IN.sub(fill, text)
    text = re.sub(r'(?m)^dump_folder = "[^"]*"', f'dump_folder = "{dump}"', text)
    Path(out).write_text(text)
    return str(out)


def cut_overrides(nproc: int, steps: int = 4, seq_len: int = 256, local: int = 2) -> list[str]:
    """Sizes a CPU run finishes in seconds; the recipe's compile, activation checkpointing,
    mixed precision, optimizer and loss settings stay as shipped."""
    return [
        "--training.steps", str(steps),
        "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(local),
        "--training.global_batch_size", str(local * nproc),
        "--lr_scheduler.warmup_steps", "1",
        "--checkpoint.interval", str(steps // 2),
        "--validation.freq", str(steps // 2),
        "--validation.steps", "2",
        "--validation.seq_len", str(seq_len),
        "--validation.local_batch_size", str(local),
        "--metrics.log_freq", "1",
    ]  # fmt: skip
