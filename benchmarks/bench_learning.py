"""Learning benchmark: does a model trained here speak and hear, scored by independent judges?

The recipe (docs/quality.md): sentences of a small grammar (``demo/grammar.py``) spoken by
espeak-ng, held-out sentences that never occur in training (checked), the offline k-means codec
fitted on the training audio, a random-init Llama, then ``torchtitan prepare`` / ``train`` /
``eval`` exactly as a user runs them (each command is printed). Every ``--eval-every`` steps a
checkpoint is scored on the held-out sentences: the model's ASR WER, the TTS intelligibility WER
of an independent recogniser (PocketSphinx restricted to the grammar's words; its WER on the
reference recordings is the floor), speaker similarity to the reference voice (Resemblyzer),
the duration ratio and the share of utterances that end by themselves. Another espeak-ng voice
saying the same held-out texts gives the SIM any other speaker would get.

Writes ``benchmarks/results/learning.json`` and ``learning.png`` (curves against steps).
``--sweep`` then scores the last checkpoint's TTS under a grid of decoding settings (the
``sweep`` of the JSON): the decoding defaults of ``torchtitan generate`` / ``eval`` come from
it. Never in CI; about 25 minutes on a 2-core CPU (data 3, training 15-20, three scored
checkpoints 1.3 each with DNSMOS on 10 of their 50 items; the sweep another 6):

    python benchmarks/bench_learning.py            # corpus, train, curves
    python benchmarks/bench_learning.py --sweep    # + the decoding sweep on the last checkpoint
    python benchmarks/bench_learning.py --steps 2400 --eval-every 800 --tts-share 0.85 \
        --tag _2400                                # longer (40 minutes): docs/quality.md

``--codecs``: the demo instead (its corpus of 2,000 training and 40 held-out sentences, its model
and recipe, ``train_configs/speechlm_debug.toml``), once per codec fitted by ``torchtitan
prepare`` (KIND or KIND:BOOKSxSIZE: ``kmeans`` is the demo's 4 x 256 at 25 frames/s, ``mel``
4 x 1024 at 21.5, ``world`` 3 x 1024 at 25), each trained for ``--steps`` with a checkpoint every
``--eval-every``, and compared at equal wall time: the checkpoint of each codec whose training
time (torchtitan's end-to-end step times summed) is closest to, and not over, what the first
codec's ``--steps`` took. Each is scored on every held-out sentence by both PocketSphinx judges
(the grammar and the free word loop), SIM, DNSMOS and the model's ASR. Writes
``learning_codecs.json`` (about 15 minutes per codec on a 2-core CPU):

    python benchmarks/bench_learning.py --codecs kmeans,mel,mel:2x1024,world --steps 400 \
        --eval-every 100
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import sys
import time

import numpy as np

from torchtitan_speechlm.demo.speaking import (
    OTHER_VOICE,
    VOICE,
    CorpusPlan,
    build_corpus,
    console,
    run_command,
)

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

TOML = """
[job]
dump_folder = "{dump}"
description = "bench_learning: TTS + ASR on the grammar corpus"
custom_config_module = "torchtitan_speechlm.config"

[experimental]
custom_import = "torchtitan_speechlm"

[model]
name = "speechlm"
flavor = "hf"
hf_assets_path = "{backbone}"

[speechlm]
pattern = "delay"
z_loss_weight = 1e-4

[speechlm_data]
datasets = ["train={train}", "heldout={heldout}"]
train = ["tts:train:{tts_share}", "asr:train:{asr_share}"]
valid = ["tts:heldout", "asr:heldout"]
cfg_dropout = {cfg_dropout}
seed = 0

[optimizer]
name = "AdamW"
lr = {lr}
weight_decay = 0.01
implementation = "foreach"

[lr_scheduler]
warmup_steps = 50
decay_type = "cosine"
min_lr_factor = 0.1

[training]
local_batch_size = 2
seq_len = 1024
steps = {steps}
max_norm = 1.0

[checkpoint]
enable = true
interval = {every}
keep_latest_k = 0

[metrics]
log_freq = 25
enable_tensorboard = true

[validation]
enable = true
freq = {every}
steps = -1
local_batch_size = 2
seq_len = 1024
"""

# TTS decoding settings of --sweep: (temperature, top_k, top_p, cfg_scale)
SWEEP = [
    (0.0, 0, 1.0, 1.0),
    (0.7, 30, 1.0, 1.0),
    (0.7, 0, 0.9, 1.0),
    (0.0, 0, 1.0, 1.5),
    (0.7, 0, 0.9, 1.5),
    (0.0, 0, 1.0, 3.0),
]


def evaluate(ckpt: str, paths: dict, out: str, items: int, extra: list[str]) -> dict:
    if os.path.isfile(out):  # a rerun reuses the scores of a checkpoint it has
        with open(out) as f:
            return json.load(f)
    run_command(
        [console("torchtitan"), "eval", "--model", ckpt, "--valid", "asr:heldout", "--valid",
         "tts:heldout", "--limit", str(items), "--judge-grammar", paths["grammar.jsgf"],
         "--out", out, *extra],
        log=out.replace(".json", ".log"),
    )  # fmt: skip
    with open(out) as f:
        return json.load(f)


def other_voice_sim(paths: dict, items: int) -> dict:
    """Mean SIM(another espeak voice saying the held-out text, the reference voice): on the
    recordings, and with both through the codec (as eval's ``sim`` compares generated speech
    with the codec's resynthesis of the reference)."""
    import soundfile as sf

    from torchtitan_speechlm.codecs import load_codec
    from torchtitan_speechlm.judges import build_judge

    judge, codec = build_judge("resemblyzer"), load_codec(paths["codec"])
    raw, coded = [], []
    folder = os.path.join(paths["corpus"], "heldout", "wavs")
    for name in sorted(os.listdir(folder))[:items]:
        ref, rate = sf.read(os.path.join(folder, name), dtype="float32")
        other, _ = sf.read(
            os.path.join(paths["corpus"], "heldout_other_voice", "wavs", name), dtype="float32"
        )
        raw.append(judge.similarity(judge.embed(ref, rate), judge.embed(other, rate)))
        ref_c, other_c = (codec.decode(codec.encode([w])[0]) for w in (ref, other))
        coded.append(
            judge.similarity(judge.embed(ref_c, codec.sample_rate), judge.embed(other_c, rate))
        )
    return {"recordings": float(np.mean(raw)), "resynthesised": float(np.mean(coded))}


def val_losses(dump: str) -> dict[int, dict]:
    out: dict[int, dict] = {}
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            for key in ("val/tts_heldout/loss", "val/asr_heldout/loss"):
                if key in row:
                    out.setdefault(int(row["step"]), {})[key.split("/")[1]] = row[key]
    return out


def summarise(scores: dict) -> dict:
    asr, tts = scores["asr:heldout"], scores["tts:heldout"]
    return {
        "asr_wer": asr["wer"],
        "tts_wer": tts["wer"],
        "tts_cer": tts["cer"],
        "floor_wer": tts["floor"]["wer"],
        "floor_recording_wer": (tts.get("floor_recording") or {}).get("wer"),
        "sim": tts.get("sim"),
        "sim_recording": tts.get("sim_recording"),
        "duration_ratio_median": tts["duration_ratio"]["median"],
        "eos_rate": tts["eos_rate"],
        "dnsmos": tts.get("dnsmos"),
        "reference_dnsmos": tts.get("reference_dnsmos"),
        "word_loop": tts.get("word_loop"),
    }


def parse_codec(spec: str) -> dict:
    """``kmeans`` / ``mel`` / ``world`` or ``KIND:BOOKSxSIZE`` -> CorpusPlan's codec fields."""
    kind, _, shape = spec.partition(":")
    if kind not in ("kmeans", "mel", "world"):
        raise SystemExit(f"--codecs {spec}: the kind is kmeans, mel or world")
    books, _, size = shape.partition("x") if shape else ("4", "", "0")
    return {"codec": kind, "codebooks": int(books), "codebook_size": int(size or 0)}


def training_seconds(dump: str) -> dict[int, float]:
    """{step: seconds of training up to it} (torchtitan's end-to-end step times summed; the
    first step's compile-free warm-up included)."""
    total, out = 0.0, {}
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = sorted({int(r["step"]) for r in rows if "time_metrics/end_to_end(s)" in r})
    by_step = {int(r["step"]): r["time_metrics/end_to_end(s)"] for r in rows
               if "time_metrics/end_to_end(s)" in r}  # fmt: skip
    last = 0
    for step in steps:  # a logged step's time stands for each step since the last logged one
        total += by_step[step] * (step - last)
        out[step], last = total, step
    return out


def codec_comparison(a) -> int:
    """``--codecs`` (the module docstring)."""
    from torchtitan_speechlm.demo.run import DEFAULT_CONFIG, DEMO_HELD_OUT, DEMO_TRAIN

    root = os.path.dirname(HERE)
    config = os.path.join(root, DEFAULT_CONFIG)
    rows, budget, shared = {}, None, None
    for spec in a.codecs.split(","):
        name = spec.replace(":", "_")
        work = os.path.join(a.work, name)
        if shared is not None and not os.path.exists(os.path.join(work, "corpus")):
            os.makedirs(work, exist_ok=True)  # one spoken corpus for every codec
            os.symlink(os.path.abspath(shared), os.path.join(work, "corpus"))
        plan = CorpusPlan(DEMO_TRAIN, DEMO_HELD_OUT, **parse_codec(spec))
        t = time.perf_counter()
        paths = build_corpus(work, plan, workers=2)
        data_s = time.perf_counter() - t
        shared = shared or paths["corpus"]
        dump = os.path.join(work, "run")
        if not glob.glob(os.path.join(dump, "checkpoint", f"step-{a.steps}")):
            prepared = paths["prepared"]
            run_command(
                [console("torchtitan"), "train", "--job.config_file", config,
                 "--job.dump_folder", dump, "--model.hf_assets_path", paths["backbone"],
                 "--speechlm_data.datasets",
                 f"train={prepared}/train,heldout={prepared}/heldout",
                 "--training.steps", str(a.steps), "--checkpoint.interval", str(a.eval_every),
                 "--checkpoint.keep_latest_k", "0", "--validation.freq", str(a.steps),
                 "--speechlm.sample_every", "0"],
                log=os.path.join(work, "train.log"),
            )  # fmt: skip
        seconds = training_seconds(dump)
        budget = budget or seconds[a.steps]
        saved = [s for s in range(a.eval_every, a.steps + 1, a.eval_every) if s in seconds]
        within = [s for s in saved if seconds[s] <= budget * 1.02] or saved[:1]
        step = max(within)
        scores = evaluate(os.path.join(dump, "checkpoint", f"step-{step}"), paths,
                          os.path.join(work, f"eval_step{step}.json"), DEMO_HELD_OUT,
                          ["--judge-word-loop", "--judge-quality-items", str(a.quality_items)])  # fmt: skip
        from torchtitan_speechlm.codecs import load_codec

        codec = load_codec(paths["codec"])
        rows[spec] = {"codec": {"name": codec.name, "frame_rate": codec.frame_rate,
                                "streams": codec.num_streams, "size": codec.codebook_size},
                      "data_s": round(data_s, 1), "step": step,
                      "train_s": round(seconds[step], 1),
                      "step_s": round(seconds[a.steps] / a.steps, 3),
                      **summarise(scores)}  # fmt: skip
        print(f"[bench] {spec}: {json.dumps(rows[spec])}", flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    out = os.path.join(RESULTS, f"learning_codecs{a.tag}.json")
    with open(out, "w") as f:
        json.dump({"machine": f"{platform.machine()}, {os.cpu_count()} cores",
                   "command": "python benchmarks/bench_learning.py " + " ".join(sys.argv[1:]),
                   "budget_s": budget, "codecs": rows}, f, indent=1)  # fmt: skip
    print(f"[bench] wrote {out}")
    return 0


def plot(curve: list[dict], sim_other: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [c["step"] for c in curve]
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    for key in ("tts_heldout", "asr_heldout"):
        pts = [(c["step"], c["val_loss"][key]) for c in curve if key in c.get("val_loss", {})]
        ax[0].plot(*zip(*pts, strict=True), marker="o", label=key)
    ax[0].set_title("validation loss (held-out sentences)")
    ax[1].plot(steps, [c["asr_wer"] for c in curve], marker="o", label="ASR WER (the model)")
    ax[1].plot(steps, [c["tts_wer"] for c in curve], marker="o", label="TTS WER (judge)")
    ax[1].plot(steps, [c["floor_wer"] for c in curve], ls="--", label="judge on references")
    ax[1].set_ylim(0, 1.05)
    ax[1].set_title("word error rate, held-out sentences")
    ax[2].plot(steps, [c["sim"] for c in curve], marker="o", label="SIM(generated, reference)")
    ax[2].axhline(
        sim_other["resynthesised"], ls="--", color="gray", label="SIM(other voice, reference)"
    )
    ax[2].set_title("speaker similarity (Resemblyzer)")
    for a in ax:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=os.path.join(HERE, "work", "learning"))
    p.add_argument("--train-sentences", type=int, default=12000)
    p.add_argument("--held-out", type=int, default=100)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-items", type=int, default=50, help="held-out items per evaluation")
    p.add_argument(
        "--quality-items",
        type=int,
        default=10,
        help="items per evaluation DNSMOS scores (torchtitan eval --judge-quality-items; "
        "DNSMOS is most of an evaluation's time)",
    )
    p.add_argument(
        "--tts-share", type=float, default=0.6, help="TTS weight of the mixture (ASR: the rest)"
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--cfg-dropout", type=float, default=0.1)
    p.add_argument(
        "--kmeans-seconds",
        type=float,
        default=2400.0,
        help="audio the k-means codec is fitted on (torchtitan prepare --kmeans-seconds; "
        "2400 s = the fit's 60,000-frame budget at 25 frames/s: docs/quality.md)",
    )
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--sweep", action="store_true", help="also sweep TTS decoding settings")
    p.add_argument(
        "--eval-only",
        action="store_true",
        help="skip training: score the checkpoints the work folder already has",
    )
    p.add_argument("--tag", default="", help="suffix of the result files")
    p.add_argument("--codecs", default=None, help="KIND[:BOOKSxSIZE],...: the demo per codec")
    a = p.parse_args()
    if a.codecs:
        if a.work == p.get_default("work"):
            a.work = os.path.join(HERE, "work", "learning_codecs")
        return codec_comparison(a)
    t0 = time.perf_counter()
    plan = CorpusPlan(a.train_sentences, a.held_out, hidden=a.hidden, layers=a.layers,
                      kmeans_seconds=a.kmeans_seconds)  # fmt: skip
    paths = build_corpus(a.work, plan, workers=2)
    t_data = time.perf_counter() - t0
    dump = os.path.join(a.work, "run")
    toml = os.path.join(a.work, "learning.toml")
    with open(toml, "w") as f:
        f.write(
            TOML.format(
                dump=dump,
                backbone=paths["backbone"],
                steps=a.steps,
                every=a.eval_every,
                train=os.path.join(paths["prepared"], "train"),
                lr=a.lr,
                heldout=os.path.join(paths["prepared"], "heldout"),
                cfg_dropout=a.cfg_dropout,
                tts_share=a.tts_share,
                asr_share=round(1.0 - a.tts_share, 6),
            )  # fmt: skip
        )
    t1 = time.perf_counter()
    if not a.eval_only:
        run_command(
            [console("torchtitan"), "train", "--job.config_file", toml],
            log=os.path.join(a.work, "train.log"),
        )
    t_train = time.perf_counter() - t1
    ckpts = sorted(
        glob.glob(os.path.join(dump, "checkpoint", "step-*")), key=lambda s: int(s.split("-")[-1])
    )
    losses, curve, t2 = val_losses(dump), [], time.perf_counter()
    for ckpt in ckpts:
        step = int(ckpt.split("-")[-1])
        scores = evaluate(ckpt, paths, os.path.join(a.work, f"eval_step{step}.json"),
                          a.eval_items, ["--judge-quality-items", str(a.quality_items)])  # fmt: skip
        row = {"step": step, **summarise(scores), "val_loss": losses.get(step, {})}
        curve.append(row)
        print(f"[bench] step {step}: {json.dumps({k: v for k, v in row.items()})}", flush=True)
    t_eval = time.perf_counter() - t2
    sim_other = other_voice_sim(paths, a.eval_items)
    os.makedirs(RESULTS, exist_ok=True)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": "python benchmarks/bench_learning.py " + " ".join(sys.argv[1:]),
        "corpus": {
            "train_sentences": a.train_sentences,
            "held_out_sentences": a.held_out,
            "shared_sentences": 0,
            "voice": VOICE,
            "other_voice": OTHER_VOICE,
            "kmeans_seconds": a.kmeans_seconds,
        },  # fmt: skip
        "model": {"family": "llama", "hidden": a.hidden, "layers": a.layers},
        "train": {
            "steps": a.steps,
            "lr": a.lr,
            "cfg_dropout": a.cfg_dropout,
            "tts_share": a.tts_share,
        },  # fmt: skip
        "eval_items": a.eval_items,
        "quality_items": a.quality_items,
        "sim_other_voice_vs_reference": sim_other,
        "curve": curve,
        "seconds": {"data": t_data, "train": t_train, "eval": t_eval},
    }
    tag = a.tag
    png = os.path.join(RESULTS, f"learning{tag}.png")
    plot(curve, sim_other, png)
    if a.sweep and ckpts:
        sweep = []
        for temp, k, top_p, cfg in SWEEP:
            name = f"t{temp}_k{k}_p{top_p}_cfg{cfg}"
            flags = ["--temperature", str(temp), "--top-k", str(k), "--top-p", str(top_p),
                     "--cfg-scale", str(cfg), "--judge-quality", "none"]  # fmt: skip
            s = evaluate(ckpts[-1], paths, os.path.join(a.work, f"sweep_{name}.json"),
                         a.eval_items, flags)  # fmt: skip
            sweep.append({"temperature": temp, "top_k": k, "top_p": top_p, "cfg_scale": cfg,
                          **summarise(s)})  # fmt: skip
            print(f"[bench] sweep {name}: {json.dumps(sweep[-1])}", flush=True)
        result["sweep"] = {"checkpoint_step": int(ckpts[-1].split("-")[-1]), "rows": sweep}
    result["seconds"]["total"] = time.perf_counter() - t0
    with open(os.path.join(RESULTS, f"learning{tag}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"[bench] wrote {png} and learning{tag}.json ({result['seconds']['total']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
