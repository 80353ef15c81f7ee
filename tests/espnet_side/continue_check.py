"""Continue an ESPnet checkpoint with ``TitanTrainer`` and report what was loaded (run by
tests/integration/test_espnet_training.py in its own processes: the trainer starts a process
group). ``argv[1]``: a JSON spec {assets, out, stats, specs, trainer_args, espnet_steps,
espnet_total}; ``argv[2]``: ``make`` (one process) or ``continue`` (one process or under
torchrun).

``make``: ESPnet's side: its model from the job template, ``espnet_steps`` AdamW steps of a
stand-in loss (tests/espnet_side/model.py), ``OUT/espnet/checkpoints/step_N`` as ESPnet's
trainer saves it, and ESPnet's tensors (weights, Adam moments and steps, the LR) kept aside in
``OUT/espnet_reference.pt``. ``continue``: our trainer built with that ``resume_path``; rank 0
writes a report of, for every parameter, the largest difference between our tensor (gathered
whole) and ESPnet's at the ids mapped here by rule (not by the trainer's table), the same for
both Adam moments and the Adam step, the rows ESPnet has no id for, the step, the learning rate
and the data position; then one ``train()`` chunk runs."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight",
         "head.output.weight": "lm_head.weight", "head.stream_emb.weight": "stream_emb.weight"}  # fmt: skip
ROWS = ("tok_embeddings.weight", "head.output.weight")


def our_id(v: int, intervals: dict, layout) -> int | None:
    """ESPnet id -> ours by rule (None: no place in our vocabulary)."""
    (t0, t1), streams = intervals["text"][0], intervals["discrete_audio"]
    if v < 9:
        return v
    if t0 <= v < t1:
        return layout.text_offset + v - t0
    for k, (a, b) in enumerate(streams):
        if a <= v < b:
            return layout.stream_pad(k) if v == a else layout.code(k, v - a - 1)
    return None


def make(spec: dict) -> None:
    import torch

    from tests.espnet_side.assets import job_config
    from tests.espnet_side.job import SpeechLMJobTemplate
    from tests.espnet_side.model import save_espnet_checkpoint, train_some_steps

    job = SpeechLMJobTemplate(job_config(spec["assets"]))
    espnet = job.build_model()
    opt, sched = train_some_steps(espnet, spec["espnet_steps"], total=spec["espnet_total"])
    save_espnet_checkpoint(espnet, opt, sched, spec["espnet_steps"],
                           os.path.join(spec["out"], "espnet"))  # fmt: skip
    reference = {"lr": sched.get_last_lr()[0], "params": {}, "adam": {}}
    for name, p in espnet.named_parameters():
        reference["params"][name] = p.detach().clone()
        if p in opt.state:
            reference["adam"][name] = {k: v.clone() for k, v in opt.state[p].items()}
    torch.save(reference, os.path.join(spec["out"], "espnet_reference.pt"))


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def cont(spec: dict) -> None:
    import torch
    from espnet2.speechlm.dataloader.iterator import DataIteratorFactory

    from tests.espnet_side.assets import job_config
    from tests.espnet_side.job import SpeechLMJobTemplate
    from torchtitan_speechlm import TitanTrainer

    out, steps = spec["out"], spec["espnet_steps"]
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    job = SpeechLMJobTemplate(job_config(spec["assets"]))
    factory = DataIteratorFactory(
        spec["specs"], "", stats_dir=spec["stats"], collate_fn=job.build_preprocessor().collate_fn,
        batch_size=300, num_workers=0, shuffle=True, rank=rank, world_size=world,
    )  # fmt: skip
    calls = []
    build = factory.build_iter
    factory.build_iter = lambda global_step=0, length=None: (
        calls.append([global_step, length]) or build(global_step, length)
    )
    ckpt = os.path.join(out, "espnet", "checkpoints", f"step_{steps}")
    trainer = TitanTrainer(factory, {}, job.build_model(), ckpt, os.path.join(out, "run"),
                           spec["trainer_args"])  # fmt: skip
    reference = torch.load(os.path.join(out, "espnet_reference.pt"))
    ours = trainer.trainer.model_parts[0]
    layout = trainer.trainer.run.plan.layout
    intervals = job.vocab_intervals
    size = max(e for ivs in intervals.values() for _, e in ivs)
    pairs = [(v, our_id(v, intervals, layout)) for v in range(size)]
    o = torch.tensor([o for _, o in pairs if o is not None])
    v = torch.tensor([v for v, o in pairs if o is not None])
    opt = trainer.trainer.optimizers.optimizers[0]
    report = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}, "adam_step": {},
              "unmapped_moments": 0.0}  # fmt: skip
    for name, p in ours.named_parameters():
        theirs = NAMES.get(name, "model." + name[len("backbone.") :])
        state, adam = opt.state[p], reference["adam"][theirs]
        for key, a, b in (("params", full(p.detach()), reference["params"][theirs]),
                          ("exp_avg", full(state["exp_avg"]), adam["exp_avg"]),
                          ("exp_avg_sq", full(state["exp_avg_sq"]), adam["exp_avg_sq"])):  # fmt: skip
            if name in ROWS:
                report[key][name] = float((a[o] - b[v]).abs().max())
                if key != "params":
                    rest = torch.ones(len(a), dtype=torch.bool)
                    rest[o] = False
                    report["unmapped_moments"] = max(report["unmapped_moments"],
                                                     float(a[rest].abs().max()))  # fmt: skip
            else:
                report[key][name] = float((a - b).abs().max())
        report["adam_step"][name] = [float(state["step"]), float(adam["step"])]
    report["step"] = trainer.global_step
    report["lr"] = opt.param_groups[0]["lr"]
    report["espnet_lr"] = reference["lr"]
    trainer.train()
    report["build_iter_calls"] = calls
    report["step_after_train"] = trainer.global_step
    trainer.close()
    if rank == 0:
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    {"make": make, "continue": cont}[sys.argv[2]](json.loads(sys.argv[1]))
