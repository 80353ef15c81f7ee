"""Which espeak-ng settings are different speakers to the speaker judge? The pairwise SIM table
behind ``demo/voices.py``'s ``VOICE_NAMES`` (docs/quality.md, *Voices for speaker-prompted TTS*).

Every candidate voice (``voices.CANDIDATES``: the en-us variants ``+m1`` ... ``+f5``, other
English voices, pitch and speed settings, named variants) says the same few sentences of the
demo grammar; Resemblyzer (the ``resemblyzer`` judge) embeds each utterance. The table is the
mean SIM between utterances of *different* sentences: a speaker against itself (the diagonal)
and against every other one. A speaker's *margin* is its own SIM minus its highest SIM to
another; ``choose_voices`` picks a set in which every member's margin is at least
``--min-margin``, among the voices the recogniser below understands (WER at most
``--max-wer``); speaker-ID accuracy is the share of utterances whose nearest speaker centroid
is their own. PocketSphinx restricted to the grammar (the learning benchmark's judge) gives
each candidate's WER, so an unintelligible voice is seen too (``--no-asr`` skips it).

    python benchmarks/voice_table.py                      # every candidate, 6 sentences (~2-4 min)
    python benchmarks/voice_table.py --voices chosen --sentences 10 \
        --out benchmarks/results/voice_sim_chosen_cpu.json  # the chosen set, more sentences

Writes ``benchmarks/results/voice_sim_cpu.json`` (``--out``); ``--voices a,b,c`` measures
only those. Smallest setting (a smoke test, not a measurement): ``--voices us,us-m1
--sentences 2 --no-asr --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from torchtitan_speechlm.demo import grammar, voices
from torchtitan_speechlm.judges import build_judge, error_rates

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "voice_sim_cpu.json")
SR = 16000


def candidates(spec: str) -> list[voices.Voice]:
    if spec == "all":
        return list(voices.CANDIDATES)
    if spec == "chosen":
        return list(voices.chosen_voices())
    return [voices.voice(n.strip()) for n in spec.split(",") if n.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--voices", default="all", help="all (default), chosen, or names a,b,c")
    p.add_argument("--sentences", type=int, default=6, help="sentences per voice (6; >= 2)")
    p.add_argument("--seed", type=int, default=1, help="which grammar sentences (1)")
    p.add_argument("--min-margin", type=float, default=0.1, help="choose_voices margin (0.1)")
    p.add_argument("--max-voices", type=int, default=20, help="choose_voices size (20)")
    p.add_argument("--max-wer", type=float, default=0.1, help="choose_voices WER limit (0.1)")
    p.add_argument("--no-asr", action="store_true", help="skip the PocketSphinx WER")
    p.add_argument("--out", default=OUT)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.sentences < 2:
        p.error("--sentences must be >= 2 (the table compares different sentences)")
    cands = candidates(a.voices)
    sentences = grammar.split_sentences(a.sentences, 0, seed=a.seed)[0]
    t0 = time.perf_counter()
    jobs = [(v, text) for v in cands for text in sentences]
    with ThreadPoolExecutor(max_workers=2) as pool:
        wavs = list(pool.map(lambda job: job[0].speak(job[1], SR), jobs))
    t_speak = time.perf_counter() - t0
    judge = build_judge("resemblyzer")
    emb = np.stack([judge.embed(w, SR) for w in wavs]).reshape(len(cands), a.sentences, -1)
    t_embed = time.perf_counter() - t0 - t_speak
    wer: list[float | None] = [None] * len(cands)
    if not a.no_asr:
        with tempfile.NamedTemporaryFile("w", suffix=".jsgf") as g:
            g.write(grammar.jsgf())
            g.flush()
            asr = build_judge("pocketsphinx", grammar=g.name)
            hyps = [asr.transcribe(w, SR) for w in wavs]
        for c in range(len(cands)):
            part = slice(c * a.sentences, (c + 1) * a.sentences)
            wer[c] = round(error_rates(sentences, hyps[part])["wer"], 3)
    t_asr = time.perf_counter() - t0 - t_speak - t_embed
    names = [v.name for v in cands]
    table = voices.sim_table(emb)
    margin = voices.margins(table)
    cross = np.where(np.eye(len(cands), dtype=bool), np.nan, table)
    chosen = voices.choose_voices(names, table, a.min_margin, a.max_voices, wer, a.max_wer)
    idx = [names.index(n) for n in chosen]
    sub = table[np.ix_(idx, idx)]
    off = ~np.eye(len(idx), dtype=bool)
    rows = []
    print(f"{'voice':16s} {'espeak-ng':22s} {'group':17s} same  cross  nearest          sim  "
          f"margin  WER")  # fmt: skip
    for c, v in enumerate(cands):
        near = int(np.nanargmax(cross[c])) if len(cands) > 1 else c
        rows.append({"name": v.name, "espeak": v.describe(), "group": v.group,
                     "same": round(float(table[c, c]), 3),
                     "cross_mean": round(float(np.nanmean(cross[c])), 3) if len(cands) > 1 else None,
                     "nearest": names[near], "nearest_sim": round(float(table[c, near]), 3),
                     "margin": round(float(margin[c]), 3), "wer": wer[c],
                     "chosen": v.name in chosen,
                     "in_VOICE_NAMES": v.name in voices.VOICE_NAMES})  # fmt: skip
        r = rows[-1]
        print(f"{v.name:16s} {v.describe():22s} {v.group:17s} {r['same']:.3f} "
              f"{r['cross_mean'] or 0:.3f}  {r['nearest']:16s} {r['nearest_sim']:.3f} "
              f"{r['margin']:+.3f}  {'-' if wer[c] is None else f'{wer[c]:.3f}'}"
              f"{'  *' if r['chosen'] else ''}")  # fmt: skip
    choice = {
        "min_margin": a.min_margin,
        "max_voices": a.max_voices,
        "max_wer": None if a.no_asr else a.max_wer,
        "voices": chosen,
        "same_mean": round(float(np.diag(sub).mean()), 3),
        "cross_mean": round(float(sub[off].mean()), 3) if len(idx) > 1 else None,
        "cross_max": round(float(sub[off].max()), 3) if len(idx) > 1 else None,
        "margin_min": round(float(voices.margins(table, idx).min()), 3),
        "speaker_id_accuracy": round(voices.speaker_id_accuracy(emb[idx]), 3),
        # how this run's choice differs from the set demo/voices.py keeps (measured: docs)
        "not_in_VOICE_NAMES": [n for n in chosen if n not in voices.VOICE_NAMES],
        "VOICE_NAMES_not_chosen": [
            n for n in voices.VOICE_NAMES if n in names and n not in chosen
        ],  # fmt: skip
    }
    result = {
        "what": "mean Resemblyzer SIM between utterances of different sentences",
        "judge": judge.describe(),
        "espeak_ng": os.popen("espeak-ng --version").read().strip(),
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "sentences": sentences,
        "seconds": {
            "speak": round(t_speak, 1),
            "embed": round(t_embed, 1),
            "asr": round(t_asr, 1),
        },  # fmt: skip
        "candidates": rows,
        "all": {  # every voice measured
            "speaker_id_accuracy": round(voices.speaker_id_accuracy(emb), 3),
            "same_mean": round(float(np.diag(table).mean()), 3),
            "cross_mean": round(float(np.nanmean(cross)), 3) if len(cands) > 1 else None,
            "margin_min": round(float(margin.min()), 3),
        },
        "choice": choice,
        "sim": {"names": names, "table": np.round(table, 3).tolist()},
    }
    limit = "" if a.no_asr else f", WER <= {a.max_wer}"
    print(f"\nchosen ({len(chosen)}, every margin >= {a.min_margin}{limit}): {', '.join(chosen)}")
    print(f"  same-speaker SIM {choice['same_mean']}, cross {choice['cross_mean']} (max "
          f"{choice['cross_max']}); speaker-ID accuracy {choice['speaker_id_accuracy']} "
          f"(all {len(cands)} measured: {result['all']['speaker_id_accuracy']}, smallest "
          f"margin {result['all']['margin_min']})")  # fmt: skip
    print(f"  {t_speak:.0f}s speech, {t_embed:.0f}s embeddings, {t_asr:.0f}s ASR", file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
