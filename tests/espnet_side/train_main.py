"""ESPnet SpeechLM's ``bin/train.py``, with only the trainer import changed.

Written from espnet/espnet ``espnet2/speechlm/bin/train.py`` (commit 0add0313ecb0): the same
flags, the YAML config's ``job_type`` / ``data_loading`` / ``trainer`` sections, the job
template's preprocessor as the factories' ``collate_fn``, a ``loader_state`` file per rank, one
validation factory per specifier, ``job_template.build_model()`` as ``model``, wandb offline in
``--output-dir`` on rank 0 (disabled elsewhere), ``trainer.run()``. Differences, each forced:
the trainer is ``torchtitan_speechlm.TitanTrainer``; the process group starts with gloo (ESPnet
calls ``deepspeed.init_distributed`` on a CUDA device); the job template comes from
tests/espnet_side (the wheel lacks it); and the validation factories get
``registered_specifier=""`` (a required argument of the 202511 wheel's factory, which that
revision of train.py leaves out).

    python tests/espnet_side/train_main.py --train-config conf.yaml --output-dir exp/run \\
        --train-unregistered-specifier "text_to_audio:ljs:data.json" --stats-dir stats
    torchrun --nproc-per-node 2 tests/espnet_side/train_main.py ...
"""

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.espnet_side


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="SpeechLM Distributed Training Script")
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("--train-config", type=Path, required=True)
    parser.add_argument("--output-dir", type=Path, default=Path("exp/train"))
    parser.add_argument("--resume_path", type=Path, default=None)
    for split in ("train", "valid"):
        for kind in ("unregistered", "registered"):
            parser.add_argument(f"--{split}-{kind}-specifier", type=str, default="")
    parser.add_argument("--stats-dir", type=Path, required=True)
    parser.add_argument("--log-level", type=str, default="INFO")
    parser.add_argument("--wandb-name", type=str, default=None)
    parser.add_argument("--wandb-tags", type=str, nargs="+", default=None)
    return parser


build_parser = get_parser  # the name tests/command_parsing.py reads (`python -m` modules)


def main() -> None:
    import torch.distributed as dist
    import wandb
    import yaml
    from espnet2.speechlm.dataloader.iterator import DataIteratorFactory

    from tests.espnet_side.job import SpeechLMJobTemplate
    from torchtitan_speechlm import TitanTrainer  # was: espnet2.speechlm.trainer.titan_trainer

    args = get_parser().parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")  # ESPnet: torch.cuda.set_device + deepspeed's init
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    logging.basicConfig(
        level=args.log_level if rank == 0 else "CRITICAL",
        format=f"[Rank {rank}/{world_size}] %(asctime)s (%(module)s:%(lineno)d) "
        "%(levelname)s: %(message)s",
        stream=sys.stdout,
    )
    with open(args.train_config) as f:
        train_config = yaml.safe_load(f)
    job_template = {"speechlm": SpeechLMJobTemplate}[train_config["job_type"]](train_config)

    loading = train_config["data_loading"]
    preprocessor = job_template.build_preprocessor()
    loader_state_dir = args.output_dir / "loader_state"
    loader_state_dir.mkdir(parents=True, exist_ok=True)
    train_factory = DataIteratorFactory(
        args.train_unregistered_specifier,
        args.train_registered_specifier,
        stats_dir=args.stats_dir,
        loader_state=loader_state_dir / f"train_{rank}_{world_size}.json",
        collate_fn=preprocessor.collate_fn,
        batchfy_method=loading["batchfy_method"],
        batch_size=loading["batch_size"],
        num_workers=loading["num_workers"],
        rank=rank,
        world_size=world_size,
        shuffle=True,
        seed=loading["seed"],
    )
    valid_args = dict(
        stats_dir=args.stats_dir, collate_fn=preprocessor.collate_fn,
        batchfy_method=loading["batchfy_method"], batch_size=loading["batch_size"],
        num_workers=loading["num_workers"], rank=rank, world_size=world_size, shuffle=False,
    )  # fmt: skip
    valid_factories = {}
    for spec in args.valid_unregistered_specifier.split():
        valid_factories[spec] = DataIteratorFactory(
            unregistered_specifier=spec, registered_specifier="", **valid_args
        )
    for spec in args.valid_registered_specifier.split():
        valid_factories[spec] = DataIteratorFactory(
            unregistered_specifier="", registered_specifier=spec, **valid_args
        )

    model = job_template.build_model()
    name = args.wandb_name or f"run_{args.output_dir.name}"
    if rank == 0:
        wandb.init(mode="offline", project="local", name=name, tags=args.wandb_tags,
                   config={"train_args": {k: str(v) for k, v in vars(args).items()},
                           "train_config": train_config},
                   dir=str(args.output_dir), resume="auto")  # fmt: skip
    else:
        wandb.init(mode="disabled")

    trainer = TitanTrainer(
        train_data_factory=train_factory,
        valid_data_factories=valid_factories,
        model=model,
        resume_path=args.resume_path,
        output_dir=args.output_dir,
        trainer_args=train_config["trainer"],
    )
    trainer.run()
    wandb.finish()


if __name__ == "__main__":
    main()
