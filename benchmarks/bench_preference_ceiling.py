"""How far can preference training on the model's own samples go? Best-of-K, by each judge.

Preference methods that learn from the model's own judged samples (DPO on best/worst pairs,
iterated DPO, GRPO, reward-ranked fine-tuning) move probability towards the samples their
reward ranks first. What such a sample is worth, as the *evaluation* judge hears it, bounds
what sharpening the policy towards it can give: if even the reward's best of K samples misses a
WER target, a policy that says one sample greedily will not meet it unless training reaches
sentences the model cannot say in K tries.

This benchmark draws K samples per held-out sentence from one model (``torchtitan eval
--samples K --pairs``, sample k seeded ``k``, so every run draws the same samples) and scores
each by three judges: the evaluation judge (PocketSphinx restricted to the demo's grammar), the
model's own ASR and PocketSphinx's free loop over the set's words (the two reward judges
bench_preference.py uses). For each ranking judge and each k <= K it reports the evaluation
judge's WER of the ranker's best of the first k samples (ties averaged): the eval judge's own
ranking is the oracle, k = 1 is one sample's WER.

    python benchmarks/bench_preference_ceiling.py --demo .   # after `make demo`; ~6 min

Writes benchmarks/results/preference_ceiling.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from bench_preference import ROOT, run, write_report

from torchtitan_speechlm.demo.speaking import console


def draw(model: str, valid: str, a, judge: str, out: str) -> dict:
    """``(item, sample) -> scores`` of K samples per item, scored by ``judge``: ``grammar`` (the
    evaluation judge) or ``loop`` (PocketSphinx's free loop over the set's words)."""
    samples = out.replace(".jsonl", ".samples.jsonl")
    if not os.path.isfile(samples):
        cmd = [console("torchtitan"), "eval", "--model", model, "--valid", valid,
               "--samples", str(a.samples), "--temperature", str(a.temperature), "--pairs", out,
               "--reward", "tts:wer=-1", "--judge-speaker", "none", "--judge-quality", "none",
               "--no-progress"]  # fmt: skip
        if judge == "grammar":
            cmd += ["--judge-grammar", os.path.join(a.demo, "demo_work", "grammar.jsgf")]
        run(cmd, out.replace(".jsonl", ".log"))
    with open(samples) as f:
        return {(r["id"], r["sample"]): r["scores"] for r in map(json.loads, f)}


def best_of(items: list[str], k: int, rank, truth) -> float:
    """Mean over items of ``truth`` of the ``rank``-best of samples 0..k-1 (ties averaged)."""
    total = 0.0
    for item in items:
        keys = [(item, s) for s in range(k)]
        best = min(rank(x) for x in keys)
        tied = [truth(x) for x in keys if rank(x) == best]
        total += sum(tied) / len(tied)
    return total / len(items)


def ceilings(grammar: dict, loop: dict, samples: int, first: int) -> dict:
    if grammar.keys() != loop.keys():
        raise SystemExit("the two runs drew different samples: rerun with an empty --work")
    for key in grammar:  # the same samples: the model's own ASR heard the same audio
        if grammar[key]["self_wer"] != loop[key]["self_wer"]:
            raise SystemExit(f"sample {key} differs between the two runs (self_wer)")
    items = list(dict.fromkeys(i for i, _ in sorted(grammar, key=lambda x: (x[0], x[1]))))
    truth = lambda x: grammar[x]["wer"]  # noqa: E731
    ranks = {
        "eval judge (oracle)": truth,
        "own ASR": lambda x: grammar[x]["self_wer"],
        "word loop": lambda x: loop[x]["wer"],
        "own ASR + word loop": lambda x: grammar[x]["self_wer"] + loop[x]["wer"],
    }
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= samples]
    out = {}
    for name, subset in ((f"first {first}", items[:first]), (f"all {len(items)}", items)):
        out[name] = {r: {k: round(best_of(subset, k, f, truth), 4) for k in ks}
                     for r, f in ranks.items()}  # fmt: skip
    return out


def table(report: dict) -> str:
    rows = []
    for subset, by_ranker in report["ceilings"].items():
        ks = list(next(iter(by_ranker.values())))
        rows += [f"\n{subset} held-out sentences: eval-judge WER of the best of k, ranked by",
                 "ranker | " + " | ".join(f"k={k}" for k in ks), "|".join(["---"] * (len(ks) + 1))]  # fmt: skip
        for ranker, by_k in by_ranker.items():
            rows.append(ranker + " | " + " | ".join(f"{v:.3f}" for v in by_k.values()))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", required=True, help="a clone where `make demo` ran")
    p.add_argument("--model", default=None, help="default: the demo's step-400 model")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--first", type=int, default=20, help="the demo reports its first 20")
    p.add_argument("--work", default="/tmp/bench_preference_ceiling")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                 "preference_ceiling.json"))  # fmt: skip
    a = p.parse_args(argv)
    a.demo = os.path.abspath(a.demo)
    model = a.model or os.path.join(a.demo, "outputs", "speechlm_debug", "checkpoint", "step-400")
    valid = f"tts:{os.path.join(a.demo, 'demo_work', 'prepared', 'heldout')}"
    os.makedirs(a.work, exist_ok=True)
    t0 = time.perf_counter()
    scores = {
        judge: draw(model, valid, a, judge, os.path.join(a.work, f"{judge}_k{a.samples}_t{a.temperature}.jsonl"))
        for judge in ("grammar", "loop")
    }  # fmt: skip
    report = {
        "benchmark": "bench_preference_ceiling",
        "command": "python benchmarks/bench_preference_ceiling.py " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "model": model,
        "set": valid,
        "settings": {"samples": a.samples, "temperature": a.temperature, "first": a.first},
        "mean_sample_wer": round(sum(s["wer"] for s in scores["grammar"].values()) / len(scores["grammar"]), 4),
        "ceilings": ceilings(scores["grammar"], scores["loop"], a.samples, a.first),
        "seconds": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    write_report(a.out, report, table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
