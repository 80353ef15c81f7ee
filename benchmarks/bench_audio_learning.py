"""Does ASR learn through a continuous audio encoder as it does from codec tokens? The same
backbone, data, optimizer and step budget two ways, scored on held-out sentences.

Data: the demo's espeak-ng grammar corpus (``demo/speaking.py``: 2,000 training sentences, 40
held-out ones never in training; built under ``demo_work/`` if missing), its prepared datasets
copied here and given waveforms (``prepare/waveforms.py``). ``codec``: task ``asr`` on the
k-means codec's tokens (25 frames/s). ``continuous``: task ``asr_wave`` through a random-init
Whisper-shaped encoder (128 wide, 2 layers, 3 s windows, trained with the LM) and an adaptor
stacking 2 frames (25 LM frames/s, the codec's rate). Both: the demo's 256-wide 6-layer Llama
(train_configs/speechlm_debug.toml), ``--steps`` steps; then greedy transcripts of the held-out
set, WER and CER (jiwer, after ``normalise_text``: ``evaluation/text_scores.evaluate_asr``).

    python benchmarks/bench_audio_learning.py [--steps 200] [--modes codec,continuous]

``--spoken-qa``: spoken question answering besides ASR, half of the draws each. Every sentence
becomes two dialogues, ``[user audio: the sentence] [user text: "Who?" | "Whom?"] ->
[assistant text: the subject | the object]`` (``qa_pairs``; e.g. "Peter saw a sleepy dog." ->
"Peter." / "A sleepy dog."), prepared by ``torchtitan prepare --waveforms 16000``: task
``dialogue`` (codec tokens) or ``dialogue_wave`` (the encoder). Scored on the held-out
sentences' dialogues: the share of answers exactly right and their WER, against the grammar's
own parse (no model involved).

    python benchmarks/bench_audio_learning.py --steps 600 --spoken-qa \
        --out benchmarks/results/spoken_qa.json

Writes benchmarks/results/audio_learning.json (``--out``). Not run by the smoke tests (two
trainings: minutes on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch

from torchtitan_speechlm.commands.export import export
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.demo import grammar
from torchtitan_speechlm.demo.run import build_demo_data
from torchtitan_speechlm.demo.speaking import console, run_command
from torchtitan_speechlm.evaluation.text_scores import evaluate_asr, score_answers
from torchtitan_speechlm.generation.decode import DecodeConfig
from torchtitan_speechlm.generation.loading import load_model
from torchtitan_speechlm.prepare.waveforms import add_waveforms

CONFIG = "train_configs/speechlm_debug.toml"


def encoder_folder(path: str, seed: int = 0) -> str:
    from transformers import WhisperConfig, WhisperModel

    if not os.path.isfile(os.path.join(path, "config.json")):
        torch.manual_seed(seed)
        cfg = WhisperConfig(
            d_model=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=512,
            decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=512,
            max_source_positions=150, vocab_size=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, decoder_start_token_id=1,
        )  # fmt: skip
        WhisperModel(cfg).save_pretrained(path)
    return path


def data(work: str, demo: str) -> dict:
    """The demo's prepared sets copied under ``work``, with their waveforms."""
    paths = build_demo_data(demo)
    out = {}
    for name in ("train", "heldout"):
        dst = os.path.join(work, name)
        if not os.path.isfile(os.path.join(dst, "metadata.json")):
            shutil.copytree(os.path.join(paths["prepared"], name), dst, dirs_exist_ok=True)
        with open(os.path.join(dst, "metadata.json")) as f:
            if "waveform" not in json.load(f):
                manifest = os.path.join(paths["corpus"], name, "manifest.jsonl")
                add_waveforms(dst, manifest)
        out[name] = dst
    return out


def qa_pairs(sentence: str) -> list[tuple[str, str]]:
    """(question, answer) pairs of a sentence of the grammar (``demo/grammar.py``): who did it
    (the subject) and to whom (the object), read off the sentence's template."""
    w = sentence.rstrip(".").lower().split()

    def cap(words: list[str]) -> str:
        s = " ".join(words)
        return s[0].upper() + s[1:] + "."

    if w[0] == "the" and w[1] in grammar.ADJECTIVES:  # the ADJ NOUN VERB the NOUN
        who, whom = w[:3], w[4:]
    elif w[0] == "the":  # the NOUN VERB NAME TIME
        who, whom = w[:2], w[3:4]
    else:  # NAME VERB a ADJ NOUN
        who, whom = w[:1], w[2:]
    return [("Who?", cap(who)), ("Whom?", cap(whom))]


def qa_data(work: str, demo: dict) -> dict:
    """Spoken-QA dialogues of the demo corpus' recordings, prepared with their waveforms."""
    out = {}
    for name in ("train", "heldout"):
        dst = os.path.join(work, f"qa_{name}")
        out[f"qa_{name}"] = dst
        if os.path.isfile(os.path.join(dst, "metadata.json")):
            continue
        src = os.path.join(demo["corpus"], name, "manifest.jsonl")
        manifest = os.path.join(work, f"qa_{name}.jsonl")
        with open(src) as f, open(manifest, "w") as g:
            for line in f:
                r = json.loads(line)
                audio = os.path.join(os.path.dirname(src), r["audio"])
                for k, (question, answer) in enumerate(qa_pairs(r["text"])):
                    turns = [{"role": "user", "audio": os.path.relpath(audio, work)},
                             {"role": "user", "text": question},
                             {"role": "assistant", "text": answer}]  # fmt: skip
                    g.write(json.dumps({"id": f"{r['id']}_q{k}", "turns": turns}) + "\n")
        run_command(
            [console("torchtitan"), "prepare", "--manifest", manifest, "--codec", demo["codec"],
             "--tokenizer", demo["tokenizer"], "--out-dir", dst, "--workers", "2", "--no-progress",
             "--waveforms", "16000"],
        )  # fmt: skip
    return out


CONTINUOUS = {  # mode -> the encoder's freeze flag
    "continuous": "no-freeze-encoder",  # the random-init encoder trains with the LM
    "continuous_frozen": "freeze-encoder",  # it stays random: only the adaptor and LM learn
}


def train(
    mode: str, work: str, sets: dict, steps: int, encoder: str, spoken_qa: bool = False
) -> tuple[str, float]:
    dump = os.path.join(work, mode)
    continuous = mode in CONTINUOUS
    task = "asr_wave" if continuous else "asr"
    datasets = ",".join(f"{k}={v}" for k, v in sets.items())
    mix = f"{task}:train"
    if spoken_qa:
        qa = "dialogue_wave" if continuous else "dialogue"
        mix = f"{task}:train:0.5,{qa}:qa_train:0.5"
    flags = [
        "--job.config_file", CONFIG, "--job.dump_folder", dump,
        "--speechlm_data.datasets", datasets,
        "--speechlm_data.train", mix, "--speechlm_data.valid", f"{task}:heldout",
        "--training.steps", str(steps), "--checkpoint.interval", str(steps),
        "--validation.enable", "false", "--speechlm.sample_every", "-1",
        "--metrics.no-enable-wandb", "--metrics.no-enable-tensorboard",
    ]  # fmt: skip
    if continuous:
        freeze = CONTINUOUS[mode]
        flags += ["--audio_encoder.path", encoder, "--audio_encoder.stack", "2",
                  f"--audio_encoder.{freeze}"]  # fmt: skip
    # a fresh run: torchtitan would resume from a checkpoint an earlier run left there
    shutil.rmtree(dump, ignore_errors=True)
    t0 = time.perf_counter()
    log = os.path.join(work, f"{mode}.log")
    with open(log, "w") as f:
        rc = subprocess.call([console("torchtitan"), "train", *flags], stdout=f, stderr=f)
    if rc != 0:
        raise RuntimeError(f"{mode} training failed (exit {rc}); see {log}")
    return os.path.join(dump, "checkpoint", f"step-{steps}"), time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--work", default="benchmarks/work/audio_learning")
    p.add_argument("--demo-work", default="demo_work")
    p.add_argument(
        "--modes",
        default="codec,continuous",
        help="which of codec,continuous,continuous_frozen (the encoder trained or frozen)",
    )
    p.add_argument("--out", default="benchmarks/results/audio_learning.json")
    p.add_argument("--spoken-qa", action="store_true", help="spoken QA besides ASR (above)")
    a = p.parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    sets = data(a.work, a.demo_work)
    if a.spoken_qa:
        sets.update(qa_data(a.work, build_demo_data(a.demo_work)))
    encoder = encoder_folder(os.path.join(a.work, "encoder"))
    held = PreparedDataset(sets["heldout"])
    items = [held[i] for i in range(len(held))]
    command = f"python benchmarks/bench_audio_learning.py --steps {a.steps} --modes {a.modes}"
    result = {"command": command + (" --spoken-qa" if a.spoken_qa else ""),
              "steps": a.steps, "held_out": len(items), "modes": {}}  # fmt: skip
    for mode in a.modes.split(","):
        ckpt, seconds = train(mode, a.work, sets, a.steps, encoder, a.spoken_qa)
        out = os.path.join(a.work, f"{mode}_export")
        export(ckpt, out, force=True)
        loaded, cfg = load_model(out, "cpu"), DecodeConfig(max_text_tokens=40)
        scored = evaluate_asr(loaded, items, cfg)
        result["modes"][mode] = {"train_s": seconds, **scored}
        line = f"{mode:>10}: WER {scored['wer']:.3f} CER {scored['cer']:.3f} ({seconds:.0f} s)"
        if a.spoken_qa:
            qa = PreparedDataset(sets["qa_heldout"])
            answers = score_answers(loaded, [qa[i] for i in range(len(qa))], cfg)
            answers["examples"] = answers.pop("per_item")[:6]
            result["modes"][mode]["spoken_qa"] = answers
            line += f"; spoken QA exact {answers['exact']:.3f} WER {answers['wer']:.3f}"
        print(line)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
