"""``torchtitan eval --samples K --pairs FILE``: K seeded samples per prompt, each judged, become
the preference lines ``torchtitan prepare --preference`` reads (issue 40, item 1).

Sample ``k`` of every item is decoded with seed ``--seed + k`` (batched as ``eval`` batches;
a rerun writes the same samples), scored by the set's judges as ``eval`` scores it, and its
audio (TTS) or transcript (ASR) kept. ``evaluation/pairs.py`` then picks each prompt's best and
worst sample by the configured reward. Next to FILE go ``FILE``'s samples (``*.samples.jsonl``:
every sample's answer, scores and reward, what a reader checks a pair against) and, without
``--report``, their wavs (``*.samples/``).

The sets: ``tts`` (prompt: the text; answers: the generated wavs), ``tts_prompt`` (prompt: the
item's speaker prompt as the model heard it, i.e. the prompt item's codes cut to the model's
``prompt_seconds`` and resynthesised, the wav ``score_tts`` writes for the report, and the text;
answers: the generated wavs) and ``asr`` (prompt: the item's recording, else its resynthesis;
answers: the transcripts).

The figures a reward can weigh (``pairs.SCORES``) come from the per-item records of
``tts_scores.score_tts`` / ``text_scores.score_asr``: ``wer`` / ``cer`` (the ASR judge), ``sim``,
``dnsmos`` (overall), ``ended`` (1 if the model ended the speech), ``duration_ratio_error``
(``|generated / reference duration - 1|``) and ``self_wer`` / ``self_cer`` (the model's own ASR
of its speech). In a ``tts_prompt`` set, ``sim`` is SIM to the prompt as the model heard it
(``sim_prompt``: the voice it was asked for), not to the item's reference.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import replace

from torchtitan_speechlm.evaluation.pairs import PAIR_SETS, RewardSpec, Sample, preference_lines
from torchtitan_speechlm.evaluation.recordings import find_recordings
from torchtitan_speechlm.generation.tasks import write_wav


def sample_configs(cfg, seed: int, samples: int) -> list:
    """The decode config of each sample: seed ``seed + k``."""
    return [replace(cfg, seed=seed + k) for k in range(samples)]


def sample_scores(rec: dict, task: str = "tts") -> dict:
    """A judged item record's figures as a reward weighs them (module docstring; a
    ``tts_prompt`` set's ``sim`` is its ``sim_prompt``)."""
    out = {}
    for key in ("wer", "cer", "sim", "self_wer", "self_cer"):
        value = rec.get("sim_prompt" if (task, key) == ("tts_prompt", "sim") else key)
        if _finite(value):
            out[key] = float(value)
    if isinstance(rec.get("ended"), bool):
        out["ended"] = float(rec["ended"])
    dnsmos = rec.get("dnsmos")
    if isinstance(dnsmos, dict) and _finite(dnsmos.get("dnsmos_ovrl")):
        out["dnsmos"] = float(dnsmos["dnsmos_ovrl"])
    if _finite(rec.get("duration_ratio")):
        out["duration_ratio_error"] = abs(float(rec["duration_ratio"]) - 1.0)
    return out


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def pair_prompts(loaded, task: str, path: str, items: list, runs: list[dict], root: str,
                 folder: str, manifests: dict) -> list[dict]:  # fmt: skip
    """The prompt part of each item's preference line (module docstring): ``{"id", "task",
    "text" | "audio" | both}``; ``runs``: the set's sample runs, whose wavs are under
    ``root`` (a ``tts_prompt`` item's prompt as heard: sample 0's ``prompt`` wav)."""
    prompts = [{"id": f"{task}-{it.id}", "task": task} for it in items]
    if task == "asr":
        audio = asr_prompt_audio(loaded, path, items, root, folder, manifests)
        return [dict(p, audio=audio[it.id]) for p, it in zip(prompts, items, strict=True)]
    if task == "tts_prompt":
        for p, rec in zip(prompts, runs[0]["per_item"], strict=True):
            heard = (rec.get("audio") or {}).get("prompt")
            if heard is None:
                raise ValueError(f"{p['id']}: no wav of its speaker prompt was written")
            p["audio"] = os.path.join(os.path.abspath(root), heard)
    return [dict(p, text=it.text) for p, it in zip(prompts, items, strict=True)]


def asr_prompt_audio(loaded, path: str, items: list, root: str, folder: str,
                     manifests: dict) -> dict[str, str]:  # fmt: skip
    """Each ASR item's audio file for its preference line: its original recording, else its
    reference codes resynthesised and written under ``root/folder/prompts``."""
    found = find_recordings(path, [it.id for it in items], manifests)
    out = {}
    for i, it in enumerate(items):
        if found.get(it.id) is None:
            wav = os.path.join(os.path.abspath(root), folder, "prompts", f"{i:04d}.wav")
            write_wav(loaded, it.audio_codes, wav)
        out[it.id] = found.get(it.id) or wav
    return out


def samples_of(task: str, items: list, runs: list[dict], audio_root: str) -> dict:
    """``{prompt id: [Sample]}`` from each sample run's per-item records (``runs[k]``: the
    result of sample ``k``); a TTS answer (``tts``, ``tts_prompt``) is its generated wav
    (absolute), an ASR answer its transcript. An item whose sample has no audio (an empty
    generation) has no answer there."""
    out: dict[str, list[Sample]] = {}
    speech = task != "asr"
    for k, run in enumerate(runs):
        for it, rec in zip(items, run["per_item"], strict=True):
            if speech:
                rel = (rec.get("audio") or {}).get("generated")
                if rel is None:
                    continue
                answer = {"audio": os.path.join(os.path.abspath(audio_root), rel)}
            else:
                answer = {"text": rec["transcript"]}
            heard = rec.get("transcript") if speech else None
            out.setdefault(f"{task}-{it.id}", []).append(
                Sample(k, answer, sample_scores(rec, task), heard)
            )
    return out


def rewards_by_task(specs: list[str]) -> dict[str, RewardSpec]:
    """``--reward`` values: ``SPEC`` for every set, or ``TASK:SPEC`` for one task's (``tts:wer=-1,
    self_wer=-1``, ``asr:wer=-1``, ``tts_prompt:sim=1,wer=-1``); the later one wins, a task none
    names is ranked by ``wer=-1``.
    A ValueError for a bad one."""
    out = dict.fromkeys(PAIR_SETS, RewardSpec.parse("wer=-1"))
    for text in specs:
        task, sep, rest = text.partition(":")
        if sep and task in PAIR_SETS:
            out[task] = RewardSpec.parse(rest)
        else:
            out.update(dict.fromkeys(PAIR_SETS, RewardSpec.parse(text)))
    return out


def write_pairs(path: str, prompts: list[dict], samples: dict, rewards: dict[str, RewardSpec],
                margin: float, seed: int) -> Counter:  # fmt: skip
    """The preference lines of ``prompts`` to ``path`` (each prompt ranked by its task's reward)
    and every sample (its seed, answer, scores and reward) to ``*.samples.jsonl`` beside it; the
    counts of pairs and of prompts without one (``pairs.preference_lines``)."""
    lines, counts = [], Counter()
    for task in PAIR_SETS:
        of_task = [p for p in prompts if p["task"] == task]
        got, n = preference_lines(of_task, samples, rewards[task], margin)
        lines += got
        counts.update(n)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    with open(samples_file(path), "w") as f:
        for prompt in prompts:
            spec = rewards[prompt["task"]]
            for s in samples.get(prompt["id"], []):
                reward = spec.reward(s.scores, f"prompt {prompt['id']!r} sample {s.index}")
                f.write(json.dumps({"id": prompt["id"], "sample": s.index, "seed": seed + s.index,
                                    "answer": s.answer, "scores": s.scores,
                                    "reward": reward, "transcript": s.transcript}) + "\n")  # fmt: skip
    counts["prompts"] = len(prompts)
    return counts


def samples_file(path: str) -> str:
    return os.path.splitext(path)[0] + ".samples.jsonl"


def samples_audio_root(path: str) -> str:
    """Where the samples' wavs go without ``--report``."""
    return os.path.splitext(path)[0] + ".samples"


def counts_line(path: str, counts: Counter) -> str:
    return (
        f"pairs: {counts['pairs']} of {counts['prompts']} prompts written to {path}; no pair: "
        f"{counts['one_sample']} with one sample, {counts['no_margin']} whose rewards tie, "
        f"{counts['identical']} whose best and worst are identical"
    )
