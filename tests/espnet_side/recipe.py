"""An ESPnet SpeechLM recipe's data stage, tiny and offline: what an ESPnet user has before
``bin/train.py`` (docs/python-api.md's walkthrough runs it).

    python -m tests.espnet_side.recipe --out espnet_demo

writes ``OUT/`` with a backbone folder holding its tokenizer (an HF tag's folder), a tiny codec,
a corpus in ESPnet's dataset format (lhotse manifests, a text file, ``dataset.json``), the length
statistics of ``text_to_audio`` and ``audio_to_text`` (``bin/prepare_length_stats.py``'s files)
and ``train.yaml`` (ESPnet's training config: ``job_type``, ``multimodal_io``, ``preprocessor``,
``data_loading``, ``model`` and the ``trainer`` section its ``TitanTrainer`` reads).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TASKS = ("text_to_audio", "audio_to_text")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="a tiny ESPnet SpeechLM data stage")
    p.add_argument("--out", required=True, help="the recipe folder")
    p.add_argument("--items", type=int, default=24, help="utterances of the corpus")
    p.add_argument("--max-step", type=int, default=4, help="trainer.max_step of train.yaml")
    return p


def main(argv: list[str] | None = None) -> None:
    import yaml

    from tests.espnet_side.assets import (
        job_config,
        make_espnet_assets,
        prepare_stats,
        specifiers,
    )

    args = build_parser().parse_args(argv)
    out = os.path.abspath(args.out)
    if os.path.isfile(os.path.join(out, "corpus", "dataset.json")):  # made before: train.yaml only
        assets = {k: os.path.join(out, k) for k in ("backbone", "codec", "corpus", "stats")}
        assets.update(data_json=os.path.join(out, "corpus", "dataset.json"), delay=True)
    else:
        assets = make_espnet_assets(out, n_items=args.items)
    config = job_config(assets)
    config["trainer"] = {
        "max_step": args.max_step,
        "save_interval": 2,
        "log_interval": 1,
        "titan_config": {
            "mixed_precision_param": "float32",  # a CPU: no bf16 matmuls to gain
            "optimizer": {"lr": 1e-2},
            "lr_scheduler": {"warmup_steps": 2, "decay_end_step": 8},
        },
    }
    prepare_stats(assets, config, specifiers(assets, TASKS))
    with open(os.path.join(out, "train.yaml"), "w") as f:
        yaml.safe_dump(config, f)
    print(f"ESPnet data stage in {out}: train.yaml (max_step {args.max_step}), stats/, corpus/")
    print(f"  --train-unregistered-specifier {specifiers(assets, TASKS)!r}")


if __name__ == "__main__":
    main()
