"""Learning benchmark for speaker-prompted TTS: does a model trained with the ``tts_prompt`` task
speak in the prompt's voice, scored as Seed-TTS-eval scores it?

Data, all made here (``demo/voices.py``): the demo grammar's sentences spoken by the 18
espeak-ng settings a speaker judge tells apart (docs/quality.md, *Voices for speaker-prompted
TTS*); 14 speakers are seen in training, each saying its own ``--train-per-speaker`` sentences
(no sentence spoken twice), and 4 are held out entirely. Every speaker, seen or not, says the
same ``--heldout-per-speaker`` held-out sentences, which never occur in training. The baseline is
the unprompted single-voice recipe at the same budget: the same training sentences spoken by
the demo's one voice (``en-us``), task ``tts``. Both fit their own codec (``--codec``: k-means,
or the demo's mel codec) on their own training audio and start from the same random-init
backbone (the demo's 256-wide 6-layer Llama, train_configs/speechlm_debug.toml) and tokenizer; both train ``--steps`` steps with ASR
as a quarter of the mixture, then ``torchtitan eval`` scores (commands printed as run):

- the prompted model on ``tts_prompt:`` the held-out sentences of the seen speakers, and of the
  held-out speakers: each item prompted with another utterance of its speaker (never itself),
  WER by the grammar-restricted PocketSphinx, SIM(generated, prompt), SIM(generated, the other
  speakers) and speaker-identification accuracy among the set's speakers (Resemblyzer);
- the baseline on ``tts:`` its held-out sentences (the same texts): WER.

``codec_ceiling`` scores the codec's own resynthesis of each reference the same way: what a
perfect model would get through this codec. Targets (the issue): on seen speakers, speaker-ID
>= 0.9 and SIM(gen, prompt) >= SIM(gen, others) + 0.1; WER <= 1.5x the baseline's; held-out
speakers: the figure, whatever it is.

    python benchmarks/bench_speaker_prompt.py                 # about 40 minutes on 2 CPU cores
    python benchmarks/bench_speaker_prompt.py --steps 4 --train-per-speaker 2 \
        --heldout-per-speaker 2 --eval-limit 4 --quality-items 0 --no-baseline \
        --work /tmp/sp --out /tmp/sp.json                     # a smoke run (about a minute)

Defaults: 600 training sentences per seen speaker (8,400 in all), 10 held-out sentences per
speaker, 1,600 steps, 3-second prompts, a 25 frames/s codec fitted on 2,400 s of training audio.
Variants: ``--prompt-seconds``, ``--plain-tts-share`` (part of the TTS share trained unprompted
on the same data), ``--codec mel[:BOOKSxSIZE]`` (both recipes on the mel codec, decoded by
HiFi-GAN), ``--frame-rate`` (the prompted recipe's k-means codec), ``--tag`` (names the variant's
run; variants share the data and the baseline), ``--no-baseline``, and extra
``--section.key value`` train overrides; ``--best-of N`` scores what ``eval --best-of N``
speaks (the eval only: the training is the same run). The tried variants and their figures are in
docs/quality.md, *Speaker-prompted TTS: the learning benchmark*.

Writes benchmarks/results/speaker_prompt.json (``--out``); the work folder is reused (corpora,
prepared sets, trained runs: a finished step is not redone; a run's folder names a digest of
the settings that change it, so another setting never reuses it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time

from torchtitan_speechlm.demo import grammar
from torchtitan_speechlm.demo.assets import build_backbone, build_tokenizer
from torchtitan_speechlm.demo.speaking import console, run_command
from torchtitan_speechlm.demo.voices import build_voice_corpus, voice

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(os.path.dirname(HERE), "train_configs", "speechlm_debug.toml")
BASELINE_VOICE = "us"  # the demo's voice (en-us), demo/speaking.py VOICE


def build_data(work: str, a: argparse.Namespace) -> dict:
    """Both corpora, the shared tokenizer and backbone, and every prepared set (a work folder
    made with other data settings is refused: its prepared sets would not be these)."""
    from transformers import AutoTokenizer

    os.makedirs(work, exist_ok=True)
    plan = {
        "train_per_speaker": a.train_per_speaker,
        "heldout_per_speaker": a.heldout_per_speaker,
        "kmeans_seconds": a.kmeans_seconds,
    }
    record = os.path.join(work, "plan.json")  # fmt: skip
    if os.path.isfile(record):
        with open(record) as f:
            if json.load(f) != plan:
                raise SystemExit(f"{work} was made with other data settings ({record}); "
                                 "remove it or give another --work")  # fmt: skip
    else:
        with open(record, "w") as f:
            json.dump(plan, f)

    multi = build_voice_corpus(
        os.path.join(work, "corpus_voices"), a.train_per_speaker, a.heldout_per_speaker
    )
    n_train = len(multi.seen) * a.train_per_speaker
    single = build_voice_corpus(
        os.path.join(work, "corpus_one_voice"), n_train, a.heldout_per_speaker,
        voices=(voice(BASELINE_VOICE),), held_out=(),
    )  # fmt: skip  # the same sentences: grammar.split_sentences(n_train, held, seed)
    texts = [json.loads(line)["text"] for line in open(multi.train)]
    tok, backbone = os.path.join(work, "tokenizer"), os.path.join(work, "backbone")
    if not os.path.isfile(os.path.join(tok, "tokenizer.json")):
        build_tokenizer(tok, texts, vocab_size=512)
    if not os.path.isfile(os.path.join(backbone, "config.json")):
        vocab = len(AutoTokenizer.from_pretrained(tok, local_files_only=True))
        build_backbone(backbone, family="llama", vocab_size=vocab, hidden_size=256, num_layers=6,
                       num_heads=4, num_kv_heads=4, intermediate_size=768, seed=0)  # fmt: skip
    grammar_file = os.path.join(work, "grammar.jsgf")
    with open(grammar_file, "w") as f:
        f.write(grammar.jsgf())
    sets = {  # (manifests, k-means frame rate): the baseline is the demo recipe's 25 frames/s
        "voices": ({"train": multi.train, "heldout": multi.heldout,
                    "heldout_speakers": multi.heldout_speakers}, a.frame_rate),
        "one_voice": ({"train": single.train, "heldout": single.heldout}, 25),
    }  # fmt: skip
    if a.no_baseline:  # its codec fit and prepared sets serve only the baseline's training
        del sets["one_voice"]
    prepared: dict[str, dict[str, str]] = {}
    for corpus, (manifests, rate) in sets.items():
        suffix, fit = codec_fit(a, rate)
        folder = os.path.join(work, corpus + suffix)
        codec = os.path.join(folder, "codec")
        for name, manifest in manifests.items():
            out = os.path.join(folder, "prepared", name)
            prepared.setdefault(corpus, {})[name] = out
            if os.path.isfile(os.path.join(out, "metadata.json")):
                continue
            how = ["--codec", codec]
            if name == "train":  # each recipe fits its codec on its own training audio
                how = [fit[0], codec, *fit[1:], "--kmeans-seconds", f"{a.kmeans_seconds:g}"]
            run_command(
                [console("torchtitan"), "prepare", "--manifest", manifest, *how, "--tokenizer",
                 tok, "--out-dir", out, "--workers", str(a.workers), "--no-progress"],
            )  # fmt: skip
    return {"backbone": backbone, "grammar": grammar_file, "prepared": prepared,
            "seen": multi.seen, "held_out": multi.held_out, "n_train": n_train}  # fmt: skip


def codec_fit(a, rate: int) -> tuple[str, list[str]]:
    """``--codec``'s corpus-folder suffix and ``torchtitan prepare`` fit flags: ``kmeans`` at
    ``rate`` frames/s (no suffix at the demo's 25), or ``mel[:BOOKSxSIZE]`` (2 x 1024, the
    demo's mel codec; its frame rate is the vocoder's 21.5/s, so ``--frame-rate`` does not
    apply)."""
    kind, _, shape = a.codec.partition(":")
    if kind == "kmeans":
        suffix = "" if rate == 25 else f"_{rate}fps"
        return suffix, ["--fit-kmeans-codec", "--kmeans-frame-rate", str(rate)]
    if kind != "mel":
        raise SystemExit(f"--codec {a.codec}: kmeans or mel[:BOOKSxSIZE]")
    books, _, size = (shape or "2x1024").partition("x")
    return f"_mel{books}x{size}", ["--fit-mel-codec", "--codebooks", books, "--codebook-size", size]


def mixture(task: str, a) -> str:
    """The training mixture: ``task`` at ``--tts-share`` (of which ``--plain-tts-share`` goes
    to unprompted ``tts`` of the same data, for a prompted ``task``), ASR the rest."""
    parts = {task: a.tts_share - (a.plain_tts_share if task != "tts" else 0.0)}
    if task != "tts" and a.plain_tts_share > 0:
        parts["tts"] = a.plain_tts_share
    parts["asr"] = 1.0 - a.tts_share
    return ",".join(f"{t}:train:{round(w, 6)}" for t, w in parts.items() if w > 0)


def run_name(kind: str, mix: str, a, prompted: bool) -> str:
    """A run's folder: ``kind`` (and ``--tag``) plus a digest of every setting that changes
    what it trains, so that another setting never resumes (or reuses) a run made with this
    one."""
    settings = [a.steps, mix, a.kmeans_seconds, a.train_args]
    if prompted:
        settings += [a.prompt_seconds, a.frame_rate]
    if a.codec != "kmeans":  # (k-means runs keep the digests they had before --codec)
        settings.append(a.codec)
    digest = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:8]
    return f"{kind}{a.tag if prompted else ''}-{digest}"


def train(work: str, name: str, prepared: dict, backbone: str, task: str, mix: str, a) -> str:
    """``torchtitan train`` of the demo recipe on ``prepared``, training mixture ``mix``,
    validated on ``task``; returns the last checkpoint (a finished run is not redone)."""
    dump = os.path.join(work, "runs", name)
    ckpt = os.path.join(dump, "checkpoint", f"step-{a.steps}")
    if os.path.isdir(ckpt):
        return ckpt
    run_command(
        [console("torchtitan"), "train", "--job.config_file", CONFIG,
         "--job.dump_folder", dump, "--model.hf_assets_path", backbone,
         "--speechlm_data.datasets", f"train={prepared['train']},heldout={prepared['heldout']}",
         "--speechlm_data.train", mix,
         "--speechlm_data.valid", f"{task}:heldout", "--speechlm.prompt_seconds",
         str(a.prompt_seconds), "--speechlm.sample_every", "0", "--training.steps", str(a.steps),
         "--lr_scheduler.warmup_steps", str(min(30, a.steps // 4)),
         "--checkpoint.interval", str(a.steps), "--validation.freq", str(a.steps), *a.train_args],
        log=os.path.join(work, f"train_{name}.log"),
    )  # fmt: skip
    return ckpt


def evaluate(ckpt: str, specs: list[str], out: str, grammar_file: str, a) -> dict:
    quality = ["--judge-quality-items", str(a.quality_items)]
    if a.quality_items <= 0:
        quality = ["--judge-quality", "none"]
    decoding = []
    if a.best_of > 1:  # docs/generation.md, Best of N
        decoding = ["--best-of", str(a.best_of), "--temperature", str(a.temperature)]
        out = out.replace(".json", f"-best{a.best_of}-t{a.temperature:g}.json")
    run_command(
        [console("torchtitan"), "eval", "--model", ckpt, *[x for s in specs for x in ("--valid", s)],
         "--judge-grammar", grammar_file, *quality, "--limit", str(a.eval_limit), "--out", out,
         *decoding],
        log=out.replace(".json", ".log"),
    )  # fmt: skip
    with open(out) as f:
        return json.load(f)


def codec_ceiling(ckpt: str, path: str) -> dict:
    """The speaker scores of the codec's resynthesis of each reference, prompted and scored as
    eval does (``evaluation/prompted_tts.py``): a model that reproduced its targets exactly."""
    from torchtitan_speechlm.evaluation.prompted_tts import prompted_set, speaker_scores
    from torchtitan_speechlm.generation import tasks
    from torchtitan_speechlm.generation.loading import load_model
    from torchtitan_speechlm.judges import build_judge

    loaded = load_model(ckpt)
    s = prompted_set(path, 0.0, 0)
    resynth = tasks.decode_audio(loaded, [it.audio_codes for it in s["items"]])
    prompts = [p.audio_codes for p in s["prompts"]]
    scores = speaker_scores(loaded, build_judge("resemblyzer"), resynth, prompts, s["speakers"])
    scores.pop("per_item")
    return scores


def summary(res: dict) -> dict:
    keep = ("items", "wer", "cer", "sim", "eos_rate")
    row = {k: res[k] for k in keep if k in res}
    row["floor_wer"] = res.get("floor", {}).get("wer")
    q = res.get("prompted")
    if q:
        row.update({k: q.get(k) for k in ("speakers", "sim_prompt", "sim_other",
                                          "speaker_id_accuracy", "skipped")})  # fmt: skip
        if q.get("sim_prompt") is not None and q.get("sim_other") is not None:
            row["sim_margin"] = q["sim_prompt"] - q["sim_other"]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=os.path.join(HERE, "work", "speaker_prompt"))
    p.add_argument("--train-per-speaker", type=int, default=600)
    p.add_argument("--heldout-per-speaker", type=int, default=10)
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--tts-share", type=float, default=0.75)
    p.add_argument(
        "--plain-tts-share",
        type=float,
        default=0.0,
        help="of --tts-share, unprompted tts on the prompted recipe's data",
    )
    p.add_argument("--prompt-seconds", type=float, default=3.0)
    p.add_argument(
        "--frame-rate", type=int, default=25, help="the prompted recipe's k-means codec frames/s"
    )
    p.add_argument(
        "--codec",
        default="kmeans",
        help="both recipes' codec: kmeans (4 x 256) or mel[:BOOKSxSIZE] (2 x 1024, the demo's)",
    )
    p.add_argument(
        "--quality-items", type=int, default=5, help="DNSMOS items per scored set (0: none)"
    )
    p.add_argument("--eval-limit", type=int, default=0, help="items per scored set (0: all)")
    p.add_argument(
        "--kmeans-seconds",
        type=float,
        default=2400.0,
        help="audio each fitted codec is fitted on (torchtitan prepare --kmeans-seconds)",
    )
    p.add_argument("--workers", type=int, default=2, help="torchtitan prepare --workers")
    p.add_argument("--tag", default="", help="names the prompted run (variants share the data)")
    p.add_argument("--no-baseline", action="store_true", help="skip the unprompted baseline")
    p.add_argument(
        "--best-of",
        type=int,
        default=1,
        help="eval speaks each item N times and keeps what the model's own ASR reads back best "
        "(eval --best-of; 1: greedy, one rendition)",
    )
    p.add_argument("--temperature", type=float, default=0.6, help="with --best-of: eval's")
    p.add_argument("--out", default=os.path.join(HERE, "results", "speaker_prompt.json"))
    p.add_argument("train_args", nargs="*", help="extra --section.key value train overrides")
    a = p.parse_args()
    work = os.path.abspath(a.work)
    t0 = time.perf_counter()
    d = build_data(work, a)
    t_data = time.perf_counter() - t0
    voices, one = d["prepared"]["voices"], d["prepared"].get("one_voice")
    seconds = {"data": t_data}
    t = time.perf_counter()
    mix = mixture("tts_prompt", a)
    name = run_name("prompted", mix, a, prompted=True)
    prompted = train(work, name, voices, d["backbone"], "tts_prompt", mix, a)
    base_mix = mixture("tts", a)
    base_name = run_name("baseline", base_mix, a, prompted=False)
    seconds["train_prompted"] = time.perf_counter() - t
    baseline = None
    if not a.no_baseline:
        t = time.perf_counter()
        baseline = train(work, base_name, one, d["backbone"], "tts", base_mix, a)
        seconds["train_baseline"] = time.perf_counter() - t
    t = time.perf_counter()
    seen_spec = f"tts_prompt:{voices['heldout']}"
    held_spec = f"tts_prompt:{voices['heldout_speakers']}"
    scores = evaluate(prompted, [seen_spec, held_spec], os.path.join(work, f"eval_{name}.json"),
                      d["grammar"], a)  # fmt: skip
    result = {
        "seen_speakers": summary(scores[seen_spec]),
        "held_out_speakers": summary(scores[held_spec]),
    }
    if baseline:
        base_spec = f"tts:{one['heldout']}"
        base = evaluate(baseline, [base_spec], os.path.join(work, f"eval_{base_name}.json"),
                        d["grammar"], a)  # fmt: skip
        result["baseline_one_voice"] = summary(base[base_spec])
    seconds["eval"] = time.perf_counter() - t
    t = time.perf_counter()
    ceiling = {
        "seen_speakers": codec_ceiling(prompted, voices["heldout"]),
        "held_out_speakers": codec_ceiling(prompted, voices["heldout_speakers"]),
    }
    seconds["codec_ceiling"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - t0
    seen = result["seen_speakers"]
    targets = {
        "seen_speaker_id_accuracy >= 0.9": (seen.get("speaker_id_accuracy") or 0) >= 0.9,
        "seen_sim_margin >= 0.1": (seen.get("sim_margin") or -1) >= 0.1,
    }
    if baseline:
        b = result["baseline_one_voice"]["wer"]
        result["wer_ratio_to_baseline"] = seen["wer"] / b if b else None
        targets["seen_wer <= 1.5 x baseline"] = seen["wer"] <= 1.5 * b
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": "python benchmarks/bench_speaker_prompt.py " + " ".join(sys.argv[1:]),
        "corpus": {
            "seen_speakers": list(d["seen"]),
            "held_out_speakers": list(d["held_out"]),
            "train_per_speaker": a.train_per_speaker,
            "train_sentences": d["n_train"],
            "heldout_per_speaker": a.heldout_per_speaker,
            "baseline_voice": voice(BASELINE_VOICE).describe(),
        },  # fmt: skip
        "train": {
            "steps": a.steps,
            "mixture": mix,
            "baseline_mixture": base_mix,
            "prompt_seconds": a.prompt_seconds,
            "frame_rate": a.frame_rate,
            "codec": a.codec,
            "config": os.path.relpath(CONFIG, os.path.dirname(HERE)),
            "overrides": a.train_args,
            "tag": a.tag,
        },  # fmt: skip
        "decoding": (
            {"best_of": a.best_of, "temperature": a.temperature} if a.best_of > 1 else "greedy"
        ),
        **result,
        "codec_ceiling": ceiling,
        "checkpoints": {
            "prompted": os.path.relpath(prompted, work),
            "baseline": baseline and os.path.relpath(baseline, work),
        },  # fmt: skip
        "targets": targets,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: report[k] for k in (*result, "targets", "seconds")}, indent=1))
    print(f"[bench] wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
