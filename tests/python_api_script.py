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
    model = assets.get("backbone")
    if spec.get("model_object"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(assets["backbone"])
    if spec.get("espnet"):  # ESPnet's real factory (tests/espnet_side), its job's ios
        from espnet2.speechlm.dataloader.iterator import DataIteratorFactory

        from tests.espnet_side.assets import job_config
        from tests.espnet_side.job import SpeechLMJobTemplate

        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        e = spec["espnet"]
        job = SpeechLMJobTemplate(job_config(e["assets"]))
        collate = job.build_preprocessor().collate_fn

        def factory(specs):
            return DataIteratorFactory(specs, "", stats_dir=e["stats"], collate_fn=collate,
                                       batch_size=300, num_workers=0, rank=rank,
                                       world_size=world, shuffle=True)  # fmt: skip

        train_factory = factory(e["specs"])
        log = os.path.join(spec["output_dir"], f"build_iter_rank{rank}.jsonl")
        build = train_factory.build_iter

        def logged(global_step=0, length=None):
            with open(log, "a") as f:
                f.write(json.dumps({"global_step": global_step, "length": length}) + "\n")
            return build(global_step, length)

        train_factory.build_iter = logged
        train = EspnetData(train_factory, job.vocab_intervals, multimodal_io=job.multimodal_io)
        valid = {"dev": factory(e["valid"])}
        model = e["assets"]["backbone"]
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
