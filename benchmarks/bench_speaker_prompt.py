"""Learning benchmark for speaker-prompted TTS: does a model trained with the ``tts_prompt`` task
speak in the prompt's voice, scored as Seed-TTS-eval scores it?

Data, all made here (``demo/voices.py``): the demo grammar's sentences spoken by the 18
espeak-ng settings a speaker judge tells apart (docs/quality.md, *Voices for speaker-prompted
TTS*); 14 speakers are seen in training, each saying its own ``--train-per-speaker`` sentences
(no sentence spoken twice), and 4 are held out entirely. Every speaker, seen or not, says the
same ``--heldout-per-speaker`` held-out sentences, which never occur in training. The baseline is
the unprompted single-voice recipe at the same budget: the same training sentences spoken by
the demo's one voice (``en-us``), task ``tts``. Both fit their own k-means codec on their own
training audio and start from the same random-init backbone (the demo's 256-wide 6-layer
Llama, train_configs/speechlm_debug.toml) and tokenizer; both train ``--steps`` steps with ASR
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

    python benchmarks/bench_speaker_prompt.py                 # about 30 minutes on 2 CPU cores
    python benchmarks/bench_speaker_prompt.py --steps 4 --train-per-speaker 2 \
        --heldout-per-speaker 2 --eval-limit 8 --quality-items 0 \
        --work /tmp/sp --out /tmp/sp.json                     # a smoke run (a minute or two)

Writes benchmarks/results/speaker_prompt.json (``--out``); the work folder is reused (corpora,
prepared sets, trained runs: a finished step is not redone).
"""

from __future__ import annotations

import argparse
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
    """Both corpora, the shared tokenizer and backbone, and every prepared set."""
    from transformers import AutoTokenizer

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
    sets = {
        "voices": {"train": multi.train, "heldout": multi.heldout,
                   "heldout_speakers": multi.heldout_speakers},
        "one_voice": {"train": single.train, "heldout": single.heldout},
    }  # fmt: skip
    prepared: dict[str, dict[str, str]] = {}
    for corpus, manifests in sets.items():
        codec = os.path.join(work, corpus, "codec")
        for name, manifest in manifests.items():
            out = os.path.join(work, corpus, "prepared", name)
            prepared.setdefault(corpus, {})[name] = out
            if os.path.isfile(os.path.join(out, "metadata.json")):
                continue
            how = ["--codec", codec]
            if name == "train":  # each recipe fits its codec on its own training audio
                how = ["--fit-kmeans-codec", codec, "--kmeans-frame-rate", "25",
                       "--kmeans-seconds", f"{a.kmeans_seconds:g}"]  # fmt: skip
            run_command(
                [console("torchtitan"), "prepare", "--manifest", manifest, *how, "--tokenizer",
                 tok, "--out", out, "--workers", str(a.workers), "--no-progress"],
            )  # fmt: skip
    return {"backbone": backbone, "grammar": grammar_file, "prepared": prepared,
            "seen": multi.seen, "held_out": multi.held_out, "n_train": n_train}  # fmt: skip


def train(work: str, name: str, prepared: dict, backbone: str, task: str, a) -> str:
    """``torchtitan train`` of the demo recipe on ``prepared`` with ``task`` (plus ASR);
    returns the last checkpoint (a finished run is not redone)."""
    dump = os.path.join(work, "runs", name)
    ckpt = os.path.join(dump, "checkpoint", f"step-{a.steps}")
    if os.path.isdir(ckpt):
        return ckpt
    asr = round(1.0 - a.tts_share, 6)
    run_command(
        [console("torchtitan"), "train", "--job.config_file", CONFIG,
         "--job.dump_folder", dump, "--model.hf_assets_path", backbone,
         "--speechlm_data.datasets", f"train={prepared['train']},heldout={prepared['heldout']}",
         "--speechlm_data.train", f"{task}:train:{a.tts_share},asr:train:{asr}",
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
    run_command(
        [console("torchtitan"), "eval", "--model", ckpt, *[x for s in specs for x in ("--valid", s)],
         "--judge-grammar", grammar_file, *quality, "--limit", str(a.eval_limit), "--out", out],
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
    p.add_argument("--train-per-speaker", type=int, default=150)
    p.add_argument("--heldout-per-speaker", type=int, default=10)
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--tts-share", type=float, default=0.75)
    p.add_argument("--prompt-seconds", type=float, default=3.0)
    p.add_argument(
        "--quality-items", type=int, default=5, help="DNSMOS items per scored set (0: none)"
    )
    p.add_argument("--eval-limit", type=int, default=0, help="items per scored set (0: all)")
    p.add_argument(
        "--kmeans-seconds",
        type=float,
        default=2400.0,
        help="audio each k-means codec is fitted on (torchtitan prepare --kmeans-seconds)",
    )
    p.add_argument("--workers", type=int, default=2, help="torchtitan prepare --workers")
    p.add_argument("--tag", default="", help="names the prompted run (variants share the data)")
    p.add_argument("--no-baseline", action="store_true", help="skip the unprompted baseline")
    p.add_argument("--out", default=os.path.join(HERE, "results", "speaker_prompt.json"))
    p.add_argument("train_args", nargs="*", help="extra --section.key value train overrides")
    a = p.parse_args()
    work = os.path.abspath(a.work)
    t0 = time.perf_counter()
    d = build_data(work, a)
    t_data = time.perf_counter() - t0
    voices, one = d["prepared"]["voices"], d["prepared"]["one_voice"]
    seconds = {"data": t_data}
    t = time.perf_counter()
    prompted = train(work, f"prompted{a.tag}", voices, d["backbone"], "tts_prompt", a)
    seconds["train_prompted"] = time.perf_counter() - t
    baseline = None
    if not a.no_baseline:
        t = time.perf_counter()
        baseline = train(work, "baseline", one, d["backbone"], "tts", a)
        seconds["train_baseline"] = time.perf_counter() - t
    t = time.perf_counter()
    seen_spec = f"tts_prompt:{voices['heldout']}"
    held_spec = f"tts_prompt:{voices['heldout_speakers']}"
    scores = evaluate(prompted, [seen_spec, held_spec],
                      os.path.join(work, f"eval_prompted{a.tag}.json"), d["grammar"], a)  # fmt: skip
    result = {
        "seen_speakers": summary(scores[seen_spec]),
        "held_out_speakers": summary(scores[held_spec]),
    }
    if baseline:
        base_spec = f"tts:{one['heldout']}"
        base = evaluate(baseline, [base_spec], os.path.join(work, "eval_baseline.json"),
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
            "tts_share": a.tts_share,
            "prompt_seconds": a.prompt_seconds,
            "config": os.path.relpath(CONFIG, os.path.dirname(HERE)),
            "overrides": a.train_args,
            "tag": a.tag,
        },  # fmt: skip
        **result,
        "codec_ceiling": ceiling,
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
