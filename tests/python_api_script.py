"""Runs a TitanTrainer as a user script would (one process, or one per rank under torchrun);
driven by tests/integration/test_python_api.py with a JSON spec in argv[1]."""

import json
import os
import sys


def main(spec: dict) -> None:
    import torchtitan_speechlm
    from torchtitan_speechlm import EspnetData, PreparedData, TitanTrainer

    assets = spec["assets"]
    if spec.get("wandb"):  # the caller's own run, as ESPnet recipes start one
        import wandb

        wandb.init(mode="offline", dir=spec["wandb"], project="caller")
    model = assets["backbone"]
    if spec.get("model_object"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(assets["backbone"])
    if spec.get("espnet"):
        from tests.espnet_fake import FakeFactory, vocab_intervals

        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        intervals = vocab_intervals(spec["espnet"]["text_size"])
        log = os.path.join(spec["output_dir"], f"build_iter_rank{rank}.jsonl")
        train = EspnetData(FakeFactory(intervals, rank, world, log=log), intervals)
        valid = {"dev": FakeFactory(intervals, rank, world, n_batches=2, seed=7)}
    else:
        train = PreparedData({"tiny": assets["prepared"]}, ["tts:tiny:0.5", "asr:tiny:0.5"])
        valid = spec.get("valid", {"dev": "asr:tiny"})
    dims = None
    if spec.get("parallel_dims"):  # the caller's own process group and ParallelDims
        import torch.distributed as dist
        from torchtitan.distributed import ParallelDims

        dist.init_process_group("gloo")
        n = dist.get_world_size()
        dims = ParallelDims(
            dp_shard=-1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=n
        )
    trainer = TitanTrainer(
        train, valid, model, spec.get("resume_path"), spec["output_dir"], spec["trainer_args"], dims
    )
    assert dims is None or trainer.trainer.parallel_dims is dims
    steps = []
    for action in spec["actions"]:
        getattr(trainer, action)()
        steps.append([action, trainer.global_step])
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(spec["output_dir"], "actions.json"), "w") as f:
            json.dump(steps, f)
    trainer.close()
    if dims is not None:
        import torch.distributed as dist

        dist.destroy_process_group()  # the caller's: the trainer leaves it up
    if spec.get("wandb"):
        import wandb

        assert wandb.run is not None, "the caller's wandb run was finished by the trainer"
        wandb.finish()
    assert torchtitan_speechlm


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
