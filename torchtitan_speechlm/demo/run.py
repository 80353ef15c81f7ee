"""`make demo`: synthesise a speech corpus, prepare it, train a tiny SpeechLM, plot its loss.

Every asset is made here from scratch (nothing downloaded): a BPE tokenizer trained on the bundled
sentences, a tiny random-init (calibrated) codec, a tiny random-init Qwen3 backbone, and 240
espeak-ng utterances. Each step is skipped when its output already exists.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time

DEFAULT_CONFIG = "train_configs/speechlm_debug.toml"


def build_demo_data(work_dir: str, n_utterances: int = 240, backbone_family: str = "qwen3") -> dict:
    from transformers import AutoTokenizer

    from torchtitan_speechlm.demo.assets import (
        build_backbone,
        build_codec,
        build_tokenizer,
        load_sentences,
        synthesize_corpus,
    )
    from torchtitan_speechlm.prepare.pipeline import prepare_dataset

    os.makedirs(work_dir, exist_ok=True)
    sentences = load_sentences()
    paths = {
        k: os.path.join(work_dir, k)
        for k in ("tokenizer", "codec", "backbone", "corpus", "prepared")
    }
    if not os.path.isfile(os.path.join(paths["tokenizer"], "tokenizer.json")):
        build_tokenizer(paths["tokenizer"], sentences)
    if not os.path.isfile(os.path.join(paths["codec"], "config.json")):
        build_codec(paths["codec"])
    if not os.path.isfile(os.path.join(paths["backbone"], "config.json")):
        vocab = len(AutoTokenizer.from_pretrained(paths["tokenizer"], local_files_only=True))
        build_backbone(
            paths["backbone"],
            family=backbone_family,
            vocab_size=vocab,
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=384,
        )
    t0 = time.perf_counter()
    manifest = synthesize_corpus(paths["corpus"], sentences, n=n_utterances)
    print(f"[demo] corpus: {manifest} ({time.perf_counter() - t0:.1f}s)", flush=True)
    if not os.path.isfile(os.path.join(paths["prepared"], "metadata.json")):
        summary = prepare_dataset(manifest, paths["codec"], paths["tokenizer"], paths["prepared"])
        print(f"[demo] prepared: {summary}", flush=True)
    return paths


def plot_loss_curve(dump_folder: str, out_png: str) -> str | None:
    """Read torchtitan's TensorBoard scalars back and plot train and validation loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted(glob.glob(os.path.join(dump_folder, "tb", "*")))
    if not runs:
        return None
    series: dict[str, list] = {}
    for run in runs:
        acc = EventAccumulator(run)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            if tag == "train/loss" or (tag.startswith("val/") and tag.endswith("/loss")):
                series.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for tag, points in sorted(series.items()):
        points.sort()
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker="." if "val" in tag else None,
            label=tag,
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss per loss frame")
    ax.set_title("SpeechLM debug demo")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    return out_png


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--work-dir", default="demo_work")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--utterances", type=int, default=240)
    p.add_argument("train_args", nargs="*", help="extra --section.key value overrides")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    build_demo_data(args.work_dir, args.utterances)
    t_data = time.perf_counter() - t0
    from torchtitan_speechlm.launch import already_complete, check_config

    job = check_config(["--job.config_file", args.config, *args.train_args])
    complete = already_complete(job)
    if complete:
        print(f"\n[demo] nothing trained: {complete} (`make clean` removes it)")
    else:
        cmd = [
            sys.executable,
            "-m",
            "torchtitan_speechlm.cli",
            "train",
            "--job.config_file",
            args.config,
            "--nproc-per-node",
            str(args.nproc_per_node),
            *args.train_args,
        ]
        print(f"[demo] training: {' '.join(cmd[2:])}", flush=True)
        t1 = time.perf_counter()
        rc = subprocess.call(cmd)
        t_train = time.perf_counter() - t1
        if rc != 0:
            print(f"[demo] training failed (exit {rc})", file=sys.stderr)
            return rc
        print(
            f"\n[demo] done in {time.perf_counter() - t0:.0f}s (data {t_data:.0f}s, "
            f"training {t_train:.0f}s)"
        )
    dump = job.job.dump_folder
    png = plot_loss_curve(dump, os.path.join(dump, "loss_curve.png"))
    ckpts = sorted(
        glob.glob(os.path.join(dump, job.checkpoint.folder, "step-*")),
        key=lambda p: int(p.rsplit("-", 1)[1]),
    )
    wandb_dirs = sorted(glob.glob(os.path.join(dump, "tb", "*", "wandb", "offline-run-*")))
    print(f"[demo] checkpoints : {', '.join(ckpts) or 'none'}")
    print(f"[demo] tensorboard : tensorboard --logdir {os.path.join(dump, 'tb')}")
    print(f"[demo] wandb       : {', '.join(wandb_dirs) or 'none'} (offline; `wandb sync DIR`)")
    print(f"[demo] loss curve  : {png or 'not written (no TensorBoard scalars found)'}")
    if ckpts:
        print(
            f"[demo] export      : {os.path.join(os.path.dirname(sys.executable), 'torchtitan')} "
            f"export --checkpoint {ckpts[-1]} --out exported/"
        )
        listen(ckpts[-1], job, dump)
    return 0


def listen(checkpoint: str, job, dump: str) -> None:
    """Hear and score the demo model: TTS of a held-out sentence (wav + spectrogram PNG), ASR
    of a held-out utterance, and the ASR word error rate on the held-out set."""
    import soundfile as sf

    from torchtitan_speechlm.inference import tasks
    from torchtitan_speechlm.inference.command import eval_items
    from torchtitan_speechlm.inference.decode import DecodeConfig
    from torchtitan_speechlm.inference.evaluate import evaluate_asr
    from torchtitan_speechlm.inference.loading import load_model

    t0 = time.perf_counter()
    loaded = load_model(checkpoint)
    held = eval_items(loaded, "demo", job.speechlm_data.valid_fraction, 0)
    cfg = DecodeConfig(max_frames=400)
    out = os.path.join(dump, "listen")
    os.makedirs(out, exist_ok=True)
    wav_path = os.path.join(out, "tts.wav")
    tasks.write_wav(loaded, tasks.tts(loaded, [held[0].text], cfg)[0], wav_path)
    png = plot_spectrogram(wav_path, os.path.join(out, "tts_spectrogram.png"), held[0].text)
    scores = evaluate_asr(loaded, held, cfg)
    first = scores["examples"][0]
    with open(os.path.join(out, "asr.txt"), "w") as f:
        f.write(f"ref: {first['ref']}\nhyp: {first['hyp']}\n")
    print(
        f"[demo] tts wav     : {wav_path} ({len(sf.read(wav_path)[0]) / loaded.codec.sample_rate:.1f}s"
        f' of "{held[0].text}")'
    )
    print(f"[demo] spectrogram : {png}")
    print(f'[demo] asr         : {os.path.join(out, "asr.txt")} (hyp: "{first["hyp"]}")')
    print(
        f"[demo] held-out ASR: WER {scores['wer']:.3f}, CER {scores['cer']:.3f} on "
        f"{scores['items']} utterances ({time.perf_counter() - t0:.0f}s)"
    )


def plot_spectrogram(wav_path: str, out_png: str, title: str) -> str:
    import matplotlib
    import soundfile as sf

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wav, rate = sf.read(wav_path)
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.specgram(wav, NFFT=512, Fs=rate, noverlap=384, cmap="magma")
    ax.set_xlabel("seconds")
    ax.set_ylabel("Hz")
    ax.set_title(title[:70])
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


if __name__ == "__main__":
    sys.exit(main())
