"""Does a model trained through ESPnet's data side speak as well as one trained from prepared data?

The demo's corpus (the grammar's sentences spoken by espeak-ng, 40 held-out sentences never in
training), its k-means codec (fitted by ``torchtitan prepare`` at 25 frames/s), tokenizer and
random-init 256-wide 6-layer Llama, trained with the demo's recipe (400 steps, AdamW 3e-3,
warmup 30 from 0, cosine to 0.1, about 2,048 frames a step, TTS 3 : ASR 1) in three arms of one run:

- ``prepare``: ``torchtitan prepare`` data and ``torchtitan train`` (train_configs/
  speechlm_debug.toml, the paths and the warmup set on the command line);
- ``espnet``: the same audio and texts as ESPnet's corpus (lhotse manifests, a text file, the
  dataset JSON, length statistics), ESPnet's ``DataIteratorFactory`` from ``espnet==202511``
  (bucket batches of 2,048 frames, ``text_to_audio:3 audio_to_text:1``), its job template and
  model object (tests/espnet_side), and ESPnet's ``bin/train.py`` with only the trainer import
  changed (tests/espnet_side/train_main.py); the audio is tokenised in the step by the same
  k-means codec (``speechlm_data.step_codec``), the stream weights 1/4 each (ours).

- ``espnet_mixed``: the same, but the factory's batches re-made from its own items in a random
  order (``torchtitan_speechlm.mix_espnet_batches``), 2,048 frames of data each as in the other arms (its rows padded to the longest, which
  the length-sorted batches never need). ESPnet's ``batchfy`` sorts every item by length, so
  an utterance's TTS and ASR items (the same length) and the resampled copies fall into
  neighbouring batches: most of its batches hold one task (85% of them here) and one length.
  This arm tells that batch composition apart from everything the trainer does with ESPnet's
  data (the conversion, the step codec, the chat template).

The final checkpoints are scored by the demo's ``torchtitan eval`` (the model's ASR WER; TTS
WER of the grammar-restricted PocketSphinx judge, SIM, DNSMOS on 3 items) on the held-out
sentences, the ESPnet-trained ones prompted with ESPnet's chat template (recorded with them).
Each arm is trained with three seeds (data order and initial weights): one run's TTS WER on 40
sentences moves by about 0.1 from seed to seed. Target: ESPnet's mean TTS and ASR WER within
1.2x of prepare's. A rerun reuses what is done (each run's final checkpoint and its scores).
Writes ``benchmarks/results/espnet_data.json``. Never in CI; about 2 hours on a 2-core CPU:

    python benchmarks/bench_espnet_data.py
    python benchmarks/bench_espnet_data.py --train-sentences 40 --held-out 4 --steps 2 \
        --eval-items 2 --hidden 32 --layers 1 --kmeans-seconds 20 --seeds 0 --work /tmp/b \
        --out /tmp/b.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # tests.espnet_side: ESPnet's model side (its wheel lacks it)

from tests.espnet_side.assets import TOKENIZER_SPECIALS  # noqa: E402
from tests.espnet_side.corpus import write_corpus, write_length_stats  # noqa: E402
from torchtitan_speechlm.demo.assets import build_tokenizer  # noqa: E402
from torchtitan_speechlm.demo.speaking import (  # noqa: E402
    CorpusPlan,
    build_corpus,
    console,
    run_command,
)

CONFIG = os.path.join(ROOT, "train_configs", "speechlm_debug.toml")
MAIN = os.path.join(ROOT, "tests", "espnet_side", "train_main.py")


def corpus(args) -> dict:
    """The demo's corpus and assets under ``--work``, its tokenizer made first with names
    ESPnet's job template accepts (its own specials are <|bos|>, <|eos|>, <|pad|>)."""
    from torchtitan_speechlm.demo import grammar

    plan = CorpusPlan(train=args.train_sentences, held_out=args.held_out, hidden=args.hidden,
                      layers=args.layers, kmeans_seconds=args.kmeans_seconds)  # fmt: skip
    tok = os.path.join(args.work, "tokenizer")
    if not os.path.isfile(os.path.join(tok, "tokenizer.json")):
        train, _ = grammar.split_sentences(plan.train, plan.held_out, plan.seed)
        build_tokenizer(tok, train, vocab_size=plan.tokenizer_vocab, specials=TOKENIZER_SPECIALS)
    return build_corpus(args.work, plan, workers=2)


def train_prepared(args, paths: dict, seed: int) -> str:
    dump = os.path.join(args.work, "runs", f"prepare_s{seed}")
    if os.path.isdir(os.path.join(dump, "checkpoint", f"step-{args.steps}")):
        return os.path.join(dump, "checkpoint", f"step-{args.steps}")
    run_command(
        [console("torchtitan"), "train", "--job.config_file", CONFIG,
         "--job.dump_folder", dump, "--model.hf_assets_path", paths["backbone"],
         "--speechlm_data.datasets",
         f"train={paths['prepared']}/train,heldout={paths['prepared']}/heldout",
         "--training.steps", str(args.steps), "--checkpoint.interval", str(args.steps),
         "--validation.freq", str(args.steps), "--speechlm.sample_every", "0",
         "--lr_scheduler.warmup_from_zero", "--speechlm_data.seed", str(seed),
         "--speechlm.init_seed", str(seed)],
        log=os.path.join(args.work, "runs", f"prepare_s{seed}.log"),
    )  # fmt: skip
    return os.path.join(dump, "checkpoint", f"step-{args.steps}")


def espnet_side(args, paths: dict, seed: int) -> dict:
    """ESPnet's corpus, stats and training YAML (the data order's and the initial weights'
    seed ``seed``) for the same audio, texts and model."""
    folder = os.path.join(args.work, "espnet")
    model = os.path.join(folder, "model")  # an HF tag's folder: the backbone and its tokenizer
    if not os.path.isdir(model):
        shutil.copytree(paths["backbone"], model)
        for name in os.listdir(paths["tokenizer"]):
            shutil.copy(os.path.join(paths["tokenizer"], name), model)
    manifest = paths["manifests"]["train"]
    with open(manifest) as f:
        rows = [json.loads(line) for line in f]
    items = [
        (r["id"], os.path.join(os.path.dirname(manifest), r["audio"]), r["text"]) for r in rows
    ]
    data_json = write_corpus(items, os.path.join(folder, "corpus"))
    from torchtitan_speechlm.codecs import load_codec

    n = load_codec(paths["codec"]).num_streams
    config = {
        "job_type": "speechlm",
        "multimodal_io": {
            "text": {"tokenizer_name": model},
            "discrete_audio": {"codec_choice": "local", "codec_hf_model_tag": paths["codec"],
                               "delay_interleave": True, "stream_weights": [1 / n] * n},
        },
        "preprocessor": {"audio_input": "discrete_audio", "audio_output": "discrete_audio",
                         "loss_region": "assistant"},
        "data_loading": {"batchfy_method": "bucket", "batch_size": 2048, "num_workers": 0,
                         "seed": seed},
        "model": {"model_choice": "parallel", "model_hf_tag": model, "model_conf": {}},
        "trainer": {
            "max_step": args.steps,
            "save_interval": args.steps,  # one build_iter chunk: ESPnet shuffles within chunks
            "log_interval": 10,
            "titan_config": {
                "mixed_precision_param": "float32",
                "gradient_clipping": 1.0,
                "optimizer": {"lr": 3e-3, "weight_decay": 0.01, "eps": 1e-8},
                "lr_scheduler": {"warmup_steps": 30, "min_lr_ratio": 0.1},
            },
            "speechlm": {"z_loss_weight": 1e-4, "init_seed": seed},
            "speechlm_data": {"step_codec": paths["codec"]},
        },
    }  # fmt: skip
    specs = f"text_to_audio:train:{data_json}:3 audio_to_text:train:{data_json}:1"
    stats = os.path.join(folder, "stats")
    from tests.espnet_side.job import SpeechLMJobTemplate

    write_length_stats(SpeechLMJobTemplate(config).build_preprocessor(), specs.split(), stats)
    conf = os.path.join(folder, f"train_s{seed}.yaml")
    with open(conf, "w") as f:
        yaml.safe_dump(config, f)
    return {"conf": conf, "specs": specs, "stats": stats}


def train_espnet(args, paths: dict, seed: int, mixed: bool = False) -> str:
    side = espnet_side(args, paths, seed)
    name = f"{'espnet_mixed' if mixed else 'espnet'}_s{seed}"
    out = os.path.join(args.work, "runs", name)
    ckpt = os.path.join(out, "checkpoint", f"step-{args.steps}")
    if os.path.isdir(ckpt):
        return ckpt
    flags = ["--train-config", side["conf"], "--output-dir", out,
             "--train-unregistered-specifier", side["specs"], "--stats-dir", side["stats"]]  # fmt: skip
    cmd = [sys.executable, os.path.abspath(__file__), "--mixed-batches", *flags] if mixed else [
        sys.executable, MAIN, *flags]  # fmt: skip
    run_command(cmd, log=os.path.join(args.work, "runs", f"{name}.log"))
    return ckpt


def train_mixed_main(argv: list[str]) -> None:
    """bin/train.py's steps (tests/espnet_side/train_main.py) with ``mix_espnet_batches``
    applied to the training factory before the trainer is built."""
    import wandb
    from espnet2.speechlm.dataloader.iterator import DataIteratorFactory

    from tests.espnet_side.job import SpeechLMJobTemplate
    from tests.espnet_side.train_main import get_parser
    from torchtitan_speechlm import TitanTrainer, mix_espnet_batches

    args = get_parser().parse_args(argv)
    with open(args.train_config) as f:
        config = yaml.safe_load(f)
    job = SpeechLMJobTemplate(config)
    loading = config["data_loading"]
    factory = DataIteratorFactory(
        args.train_unregistered_specifier, "", stats_dir=args.stats_dir,
        collate_fn=job.build_preprocessor().collate_fn, batchfy_method="bucket",
        batch_size=loading["batch_size"], num_workers=0, shuffle=True, seed=loading["seed"],
    )  # fmt: skip
    mix_espnet_batches(factory, str(args.stats_dir), loading["batch_size"], seed=loading["seed"])
    wandb.init(mode="offline", project="local", dir=str(args.output_dir))
    TitanTrainer(factory, {}, job.build_model(), None, args.output_dir, config["trainer"]).run()
    wandb.finish()


def evaluate(args, ckpt: str, paths: dict, name: str) -> dict:
    out = os.path.join(args.work, "runs", f"eval_{name}.json")
    held = os.path.join(paths["prepared"], "heldout")
    if not os.path.isfile(out):
        run_command(
        [console("torchtitan"), "eval", "--model", ckpt, "--valid", f"asr:{held}",
         "--valid", f"tts:{held}", "--limit", str(args.eval_items),
         "--judge-grammar", paths["grammar.jsgf"], "--judge-quality-items", "3",
         "--out", out, "--no-progress"],
            log=out.replace(".json", ".log"),
        )  # fmt: skip
    with open(out) as f:
        scores = json.load(f)
    asr, tts = scores[f"asr:{held}"], scores[f"tts:{held}"]
    return {
        "asr_wer": asr["wer"],
        "tts_wer": tts["wer"],
        "tts_cer": tts["cer"],
        "floor_wer": tts["floor"]["wer"],
        "sim": tts.get("sim"),
        "dnsmos": tts.get("dnsmos"),
        "eos_rate": tts["eos_rate"],
        "duration_ratio_median": tts["duration_ratio"]["median"],
    }


def step_times(dump: str) -> dict:
    """Median seconds per step (torchtitan's end-to-end) and the step codec's share."""
    import statistics

    e2e, codec, wave = [], [], 0.0
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "time_metrics/end_to_end(s)" in row and row["step"] > 1:
                e2e.append(row["time_metrics/end_to_end(s)"])
                if "time/step_codec_s" in row:
                    codec.append(row["time/step_codec_s"])
                    wave = max(wave, row.get("memory/step_codec_wave_mb", 0.0))
    out = {"step_s": statistics.median(e2e) if e2e else None}
    if codec:
        out["step_codec_s"] = statistics.median(codec)
        out["step_codec_share"] = out["step_codec_s"] / out["step_s"] if e2e else None
        out["step_codec_wave_mb"] = wave
    return out


def mean(values: list):
    return sum(values) / len(values) if None not in values else None


def ratio(a, b):
    return a / b if a is not None and b else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default=os.path.join(HERE, "work", "espnet_data"))
    p.add_argument("--out", default=os.path.join(HERE, "results", "espnet_data.json"))
    p.add_argument("--train-sentences", type=int, default=2000)
    p.add_argument("--held-out", type=int, default=40)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--eval-items", type=int, default=40)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--kmeans-seconds", type=float, default=600.0)
    p.add_argument(
        "--seeds",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[0, 1, 2],
        help="each arm trained with each seed (data order and initial weights)",
    )
    # the espnet_mixed arm's training process: bin/train.py's flags follow
    p.add_argument("--mixed-batches", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.mixed_batches is not None:
        train_mixed_main(args.mixed_batches)
        return
    os.makedirs(os.path.join(args.work, "runs"), exist_ok=True)
    t0 = time.perf_counter()
    paths = corpus(args)
    t_data = time.perf_counter() - t0
    result = {"machine": platform.processor() or platform.machine(), "args": vars(args),
              "seconds": {"data": round(t_data)}}  # fmt: skip
    arms = {
        "prepare": train_prepared,
        "espnet": train_espnet,
        "espnet_mixed": lambda a, p, seed: train_espnet(a, p, seed, mixed=True),
    }
    keys = ("tts_wer", "asr_wer", "sim", "step_s")
    for name, train in arms.items():
        result[name] = {"seeds": {}}
        for seed in args.seeds:
            t = time.perf_counter()
            ckpt = train(args, paths, seed)
            result["seconds"][f"train_{name}_s{seed}"] = round(time.perf_counter() - t)
            scores = evaluate(args, ckpt, paths, f"{name}_s{seed}")
            scores.update(step_times(os.path.dirname(os.path.dirname(ckpt))))
            result[name]["seeds"][seed] = scores
            print(f"[bench] {name} seed {seed}: {json.dumps(scores)}", flush=True)
        runs = list(result[name]["seeds"].values())
        result[name]["mean"] = {k: mean([r[k] for r in runs]) for k in keys}
        result[name]["range"] = {k: [min(r[k] for r in runs), max(r[k] for r in runs)]
                                 for k in keys if None not in [r[k] for r in runs]}  # fmt: skip
    q = result["prepare"]["mean"]
    result["ratio"], result["met"] = {}, {}
    for arm in ("espnet", "espnet_mixed"):
        e = result[arm]["mean"]
        result["ratio"][arm] = {k: ratio(e[k], q[k]) for k in ("tts_wer", "asr_wer", "step_s")}
        result["met"][arm] = all(e[k] <= 1.2 * q[k] + 1e-9 for k in ("tts_wer", "asr_wer"))
    result["target"] = "mean tts_wer and asr_wer over the seeds <= 1.2 x prepare's"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("ratio", "met", "seconds")}), flush=True)


if __name__ == "__main__":
    main()
