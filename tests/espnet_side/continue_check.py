"""Continue an ESPnet checkpoint with ``TitanTrainer`` and report what was loaded (run by
tests/integration/test_espnet_training.py in its own process: the trainer starts a process
group). ``argv[1]``: a JSON spec {assets, out, stats, specs, trainer_args, espnet_steps}.

ESPnet's side: its model from the job template, ``espnet_steps`` AdamW steps of a stand-in loss
(tests/espnet_side/model.py), ``checkpoints/step_N`` as ESPnet's trainer saves it. Ours: the
trainer built with ``resume_path`` = that folder. The report holds, for every parameter, the
largest difference between our tensor and ESPnet's at the ids mapped here by rule (not by the
trainer's table), the same for both Adam moments and the Adam step, the rows ESPnet has no id
for, the step, the learning rate and the data position; then one ``train()`` chunk runs."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


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


def main(spec: dict) -> None:
    import torch
    from espnet2.speechlm.dataloader.iterator import DataIteratorFactory

    from tests.espnet_side.assets import job_config
    from tests.espnet_side.job import SpeechLMJobTemplate
    from tests.espnet_side.model import save_espnet_checkpoint, train_some_steps
    from torchtitan_speechlm import TitanTrainer

    assets, out = spec["assets"], spec["out"]
    job = SpeechLMJobTemplate(job_config(assets))
    espnet = job.build_model()
    opt, sched = train_some_steps(espnet, spec["espnet_steps"], total=spec["espnet_total"])
    steps = spec["espnet_steps"]
    ckpt = save_espnet_checkpoint(espnet, opt, sched, steps, os.path.join(out, "espnet"))
    factory = DataIteratorFactory(
        spec["specs"], "", stats_dir=spec["stats"], collate_fn=job.build_preprocessor().collate_fn,
        batch_size=300, num_workers=0, shuffle=True,
    )  # fmt: skip
    calls = []
    build = factory.build_iter
    factory.build_iter = lambda global_step=0, length=None: (
        calls.append([global_step, length]) or build(global_step, length)
    )
    trainer = TitanTrainer(factory, {}, job.build_model(), ckpt, os.path.join(out, "run"),
                           spec["trainer_args"])  # fmt: skip
    ours = trainer.trainer.model_parts[0]
    layout = trainer.trainer.run.plan.layout
    intervals = job.vocab_intervals
    pairs = [(v, our_id(v, intervals, layout)) for v in range(max(e for iv in intervals.values()
                                                                  for _, e in iv))]  # fmt: skip
    pairs = [(v, o) for v, o in pairs if o is not None]
    espnet_sd = dict(espnet.named_parameters())
    adam = {p: opt.state[p] for p in espnet.parameters() if p in opt.state}
    our_opt = trainer.trainer.optimizers.optimizers[0]
    names = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "head.output.weight": "lm_head.weight", "head.stream_emb.weight": "stream_emb.weight"}  # fmt: skip
    report = {
        "params": {},
        "exp_avg": {},
        "exp_avg_sq": {},
        "adam_step": {},
        "unmapped_moments": 0.0,
    }
    for name, p in ours.named_parameters():
        theirs_name = names.get(name, "model." + name[len("backbone.") :])
        theirs = espnet_sd[theirs_name]
        state = our_opt.state[p]
        for key, a, b in (("params", p.detach(), theirs.detach()),
                          ("exp_avg", state["exp_avg"], adam[theirs]["exp_avg"]),
                          ("exp_avg_sq", state["exp_avg_sq"], adam[theirs]["exp_avg_sq"])):  # fmt: skip
            if name in ("tok_embeddings.weight", "head.output.weight"):
                o, v = torch.tensor([o for _, o in pairs]), torch.tensor([v for v, _ in pairs])
                diff = (a[o] - b[v]).abs().max()
                if key != "params":
                    rest = torch.ones(len(a), dtype=torch.bool)
                    rest[o] = False
                    report["unmapped_moments"] = max(report["unmapped_moments"],
                                                     float(a[rest].abs().max()))  # fmt: skip
            else:
                diff = (a - b).abs().max()
            report[key][name] = float(diff)
        report["adam_step"][name] = [float(state["step"]), float(adam[theirs]["step"])]
    report["step"] = trainer.global_step
    report["lr"] = trainer.trainer.optimizers.optimizers[0].param_groups[0]["lr"]
    report["espnet_lr"] = sched.get_last_lr()[0]
    trainer.train()
    report["build_iter_calls"] = calls
    report["step_after_train"] = trainer.global_step
    trainer.close()
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
