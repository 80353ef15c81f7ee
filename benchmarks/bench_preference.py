"""Learning benchmark for preference training (issue 40, item 4): does DPO on the model's own
judged samples make the demo's TTS more intelligible, as an independent judge hears it?

Start: the demo's step-400 model (``make demo`` in ``--demo``: ``demo_work/`` and
``outputs/speechlm_debug/checkpoint/step-400``). Loop: ``torchtitan prefer`` (rounds of
``--samples`` samples per training sentence at ``--temperature``, the reward judge, pairs of the
best and worst sample, DPO from the round's model). Scored before and after by ``torchtitan
eval`` (greedy decoding, as the demo scores) on the demo's 20 held-out sentences and on 200 more
held-out sentences of the grammar made here (never in training, nor among the demo's). The
loop's prompts are the demo's training sentences, or with ``--prompt-set fresh`` unseen grammar
sentences after the held-out ones (a TTS prompt is a text: the answers are the model's own).

**Two judges.** The reward judge ranks the samples (``--reward``, default ``tts:self_wer=-1``:
the model's own ASR, or ``wer=-1`` with ``--reward-judge`` pocketsphinx's free word loop); the
evaluation judge is the demo's, PocketSphinx restricted to the grammar (``--judge-grammar``),
which the loop never sees. Both are reported before and after, so a gain the evaluation judge
does not confirm shows as reward hacking. Also reported: SIM (Resemblyzer), DNSMOS (the first
``--quality-items`` items), the duration ratio, the end rate and the held-out ASR WER.

    python benchmarks/bench_preference.py --demo /path/to/clone   # about 30 minutes on 2 cores
    python benchmarks/bench_preference.py --demo . --prompts 8 --samples 2 --steps 2 \
        --heldout 4 --eval-limit 4 --quality-items 0 --work /tmp/bp --out /tmp/bp.json  # smoke

Writes benchmarks/results/preference.json (``--out``); the work folder is reused (a finished
round is not redone: ``torchtitan prefer`` continues).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from torchtitan_speechlm.demo import grammar
from torchtitan_speechlm.demo.assets import synthesize_corpus
from torchtitan_speechlm.demo.speaking import SPEED, VOICE, console

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TRAIN, DEMO_HELD_OUT = 2000, 40  # demo/run.py's plan: the bench's sentences come after


def run(cmd: list[str], log: str) -> None:
    print("$ " + " ".join(cmd), flush=True)
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        with open(log) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{tail}")


def sentence_set(demo: str, work: str, name: str, start: int, n: int) -> str:
    """Grammar sentences ``start .. start + n`` of the draw after the demo's held-out ones (the
    demo's seeded draw, disjoint from its training and held-out sentences), spoken by the demo's
    voice and prepared with its codec: the bench's held-out set and the loop's fresh prompts."""
    out = os.path.join(work, name, "prepared")
    if os.path.isfile(os.path.join(out, "metadata.json")):
        return out
    train, held = grammar.split_sentences(DEMO_TRAIN, DEMO_HELD_OUT + start + n)
    sentences = held[DEMO_HELD_OUT + start :]
    assert len(sentences) == n and not set(sentences) & set(train)
    manifest = synthesize_corpus(os.path.join(work, name, "corpus"), sentences,
                                 len(sentences), [VOICE], speeds=(SPEED,))  # fmt: skip
    data = os.path.join(demo, "demo_work")
    run([console("torchtitan"), "prepare", "--manifest", manifest, "--codec",
         os.path.join(data, "codec"), "--tokenizer", os.path.join(data, "tokenizer"),
         "--out-dir", out, "--no-progress"], os.path.join(work, name, "prepare.log"))  # fmt: skip
    return out


def evaluate(model: str, sets: dict, a, out: str, reward_judge: bool) -> dict:
    """Greedy ``torchtitan eval`` of ``model``: with the evaluation judge (the grammar) or the
    reward judge (``--reward-judge``: its figures show what the loop optimised)."""
    if os.path.isfile(out):
        with open(out) as f:
            return json.load(f)
    cmd = [console("torchtitan"), "eval", "--model", model, "--out", out, "--no-progress"]
    cmd += ["--limit", str(a.eval_limit)] if a.eval_limit else []
    for spec in sets.values():
        cmd += ["--valid", spec]
    if reward_judge:
        cmd += ["--judge-asr", a.reward_judge, "--judge-speaker", "none", "--judge-quality", "none"]
    else:
        grammar_file = os.path.join(a.demo, "demo_work", "grammar.jsgf")
        cmd += ["--judge-grammar", grammar_file, "--judge-quality-items", str(a.quality_items)]
        if a.quality_items == 0:
            cmd += ["--judge-quality", "none"]
    run(cmd, out.replace(".json", ".log"))
    with open(out) as f:
        return json.load(f)


def mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def figures(scores: dict, reward: dict | None) -> dict:
    """The table's numbers of one model: per set, both judges' WER and the rest (``reward``
    None: the reward judge is the model's own ASR, which ``scores`` holds)."""
    out = {}
    for spec, s in scores.items():
        if s.get("task") != "tts":
            out[spec] = {"asr_wer": s["wer"]}
            continue
        own = s["self"]["asr_of_tts"]["wer"]
        out[spec] = {
            "wer_eval_judge": s["wer"],
            # the demo reports its first 20 held-out sentences (demo/run.py: --limit 20)
            "wer_eval_judge_first_20": mean([r["wer"] for r in s["per_item"][:20]]),
            "wer_reward_judge": own if reward is None else reward[spec]["wer"],
            "self_wer": own,
            "sim": s.get("sim"),
            "dnsmos": s.get("dnsmos"),
            "duration_ratio": s["duration_ratio"]["mean"],
            "ended": s.get("eos_rate"),
        }
    return out


def write_config(demo: str, path: str, a) -> str:
    """The DPO config: the demo's recipe, from its step-400 model, at --lr and --beta."""
    with open(os.path.join(ROOT, "train_configs", "speechlm_debug.toml")) as f:
        text = f.read()
    step = os.path.join(demo, "outputs", "speechlm_debug", "checkpoint", "step-400")
    text = text.replace(
        "sample_every = 100",
        f'sample_every = 0\npreference_loss = "dpo"\npreference_beta = {a.beta}\n'
        f'preference_nll_weight = {a.nll_weight}\ninit_from = "{step}"',
    )
    text = text.replace('"./demo_work/', f'"{demo}/demo_work/')  # the demo clone's assets
    for old, new in (("lr = 3e-3", f"lr = {a.lr}"), ("warmup_steps = 30", "warmup_steps = 5"),
                     ("enable_wandb = true", "enable_wandb = false"),
                     ("enable_tensorboard = true", "enable_tensorboard = false"),
                     ("interval = 200", f"interval = {a.steps}")):  # fmt: skip
        text = text.replace(old, new)
    with open(path, "w") as f:
        f.write(text)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", required=True, help="a clone where `make demo` ran")
    p.add_argument("--work", default="/tmp/bench_preference")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "preference.json"))
    p.add_argument("--prompts", type=int, default=1000, help="prompt sentences sampled (1000)")
    p.add_argument(
        "--prompt-set",
        choices=("train", "fresh"),
        default="train",
        help="the prompts: the demo's training sentences (default) or fresh grammar sentences "
        "after the held-out ones (results/preference_fresh.json)",
    )
    p.add_argument("--nll-weight", type=float, default=0.0, help="preference_nll_weight (RPO)")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=100, help="DPO steps per round (100)")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--reward", default="tts:self_wer=-1")
    p.add_argument("--reward-judge", default="none", help="the loop's ASR judge (none: own ASR)")
    p.add_argument("--heldout", type=int, default=200, help="the bench's extra held-out set")
    p.add_argument("--eval-limit", type=int, default=0, help="items per set (0: all)")
    p.add_argument("--quality-items", type=int, default=20)
    p.add_argument("--tag", default="", help="names this variant's loop folder")
    a = p.parse_args(argv)
    a.demo = os.path.abspath(a.demo)
    os.makedirs(a.work, exist_ok=True)
    t0 = time.perf_counter()
    data = os.path.join(a.demo, "demo_work", "prepared")
    bench = sentence_set(a.demo, a.work, "heldout_bench", 0, a.heldout)
    sets = {"demo": f"tts:{data}/heldout", "bench": f"tts:{bench}", "asr": f"asr:{data}/heldout"}
    # the loop's prompts: texts only matter (the samples are the model's); "fresh" sentences
    # come after the bench's held-out ones, so no prompt is a held-out sentence of either set
    prompts = (f"{data}/train" if a.prompt_set == "train"
               else sentence_set(a.demo, a.work, "prompts_fresh", a.heldout, a.prompts))  # fmt: skip
    start = os.path.join(a.demo, "outputs", "speechlm_debug", "checkpoint", "step-400")
    variant = (f"r{a.rounds}_s{a.steps}_k{a.samples}_t{a.temperature}_lr{a.lr}_b{a.beta}"
               f"_n{a.nll_weight}_{a.prompt_set}{a.prompts}{a.tag}")  # fmt: skip
    loop = os.path.join(a.work, variant)
    os.makedirs(loop, exist_ok=True)
    config = write_config(a.demo, os.path.join(loop, "dpo.toml"), a)
    t_loop = time.perf_counter()
    cmd = [console("torchtitan"), "prefer", "--job.config_file", config, "--prompts", f"tts:{prompts}",
           "--work", loop, "--rounds", str(a.rounds), "--steps", str(a.steps), "--limit",
           str(a.prompts), "--samples", str(a.samples), "--temperature", str(a.temperature),
           "--reward", a.reward, "--judge-asr", a.reward_judge, "--judge-speaker", "none",
           "--judge-quality", "none"]  # fmt: skip
    run(cmd, os.path.join(loop, "prefer.log"))
    loop_s = time.perf_counter() - t_loop
    with open(os.path.join(loop, "loop.json")) as f:
        state = json.load(f)
    last = os.path.join(loop, f"round-{a.rounds - 1}", "train", "checkpoint", f"step-{a.steps}")
    results = {}
    for name, model, where in (("before", start, a.work), ("after", last, loop)):
        # the file names the settings that change the figures: another run never reuses it
        tag = f"{name}_n{a.eval_limit}_q{a.quality_items}_h{a.heldout}"
        evals = evaluate(model, sets, a, os.path.join(where, f"eval_{tag}.json"), False)
        tts = {k: v for k, v in sets.items() if k != "asr"}
        rewards = (
            evaluate(model, tts, a, os.path.join(where, f"reward_{tag}.json"), True)
            if a.reward_judge != "none"
            else None
        )  # none: the model's own ASR is eval's
        results[name] = figures(evals, rewards)
    report = {
        "benchmark": "bench_preference",
        "command": "python benchmarks/bench_preference.py " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "settings": {k: v for k, v in vars(a).items() if k not in ("demo", "work", "out")},
        "sets": sets,
        "rounds": state["rounds"],
        "loop_seconds": round(loop_s, 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
        "before": results["before"],
        "after": results["after"],
    }
    write_report(a.out, report, table(report))
    return 0


def write_report(path: str, report: dict, text: str) -> None:
    """The report as JSON at ``path``, and its table on stdout."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(text)
    print(f"wrote {path}")


def table(report: dict) -> str:
    def v(f: dict, key: str) -> str:
        return f"{f[key]:.3f}" if f.get(key) is not None else "-"

    keys = ("wer_eval_judge", "wer_eval_judge_first_20", "wer_reward_judge", "self_wer", "sim", "dnsmos", "duration_ratio",
            "ended", "asr_wer")  # fmt: skip
    rows = ["set | model | WER (eval judge) | first 20 | WER (reward judge) | self WER | SIM | "
            "DNSMOS | dur ratio | ended | ASR WER", "|".join(["---"] * 11)]  # fmt: skip
    for name in ("before", "after"):
        for spec, f in report[name].items():
            rows.append(" | ".join([spec, name, *(v(f, k) for k in keys)]))
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
