"""Preference pairs from judged samples: K answers per prompt, each scored by independent judges,
become the chosen/rejected lines `torchtitan prepare --preference` reads (issue 40, item 1).

A reward is a weighted sum of judge scores (``RewardSpec``: ``"wer=-1,sim=0.5,ended=0.5"``).
Each prompt's best-rewarded answer is chosen and its worst rejected, ties going to the earlier
sample (seeded generation: the same pairs on a rerun). What cannot make a pair is counted,
never written: a prompt with one scored sample, one whose rewards do not differ by more than
``margin``, and one whose best and worst answers are the same (two identical generations).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

# the judge scores a reward may weigh (evaluation/tts_scores.py, text_scores.py name them so)
SCORES = ("wer", "cer", "sim", "dnsmos", "duration_ratio_error", "ended", "self_wer", "self_cer")

PAIR_SETS = ("tts", "asr", "tts_prompt")  # the --valid tasks --pairs makes pairs of (prepare's
# PAIR_TASKS); the answers of all but asr are audio


def check_sampling(task: str, samples: int, temperature: float, text_temperature: float) -> None:
    """K samples decoded greedily are one sample K times: refuse, naming the flag to set."""
    if samples < 2:
        raise ValueError(f"--pairs needs --samples K with K >= 2 (got {samples})")
    if task not in PAIR_SETS:
        raise ValueError(f"--pairs makes pairs of {' and '.join(PAIR_SETS)} sets, not {task!r}")
    flag, temp = (("--temperature", temperature) if task != "asr"
                  else ("--text-temperature", text_temperature))  # fmt: skip
    if temp <= 0:
        raise ValueError(
            f"--samples {samples} of a {task} set are all the same greedy decode: set "
            f"{flag} > 0 (e.g. 0.8) so that the samples differ"
        )


@dataclass(frozen=True)
class RewardSpec:
    """Judge score -> weight (``wer=-1``: fewer errors, more reward)."""

    weights: tuple[tuple[str, float], ...]

    @classmethod
    def parse(cls, text: str) -> RewardSpec:
        """``"wer=-1,sim=0.5"``; a ValueError naming the bad entry and the known scores."""
        weights = []
        for entry in (e.strip() for e in text.split(",") if e.strip()):
            name, sep, value = entry.partition("=")
            try:
                weight = float(value)
            except ValueError:
                weight = math.nan
            if not sep or name.strip() not in SCORES or not math.isfinite(weight):
                raise ValueError(
                    f"reward entry {entry!r}: write SCORE=WEIGHT with SCORE one of {SCORES} "
                    "and a finite weight (e.g. wer=-1,sim=0.5)"
                )
            weights.append((name.strip(), weight))
        if not weights or not any(w for _, w in weights):
            raise ValueError(f"reward {text!r} weighs no score (e.g. wer=-1,sim=0.5)")
        return cls(tuple(weights))

    def reward(self, scores: dict, where: str) -> float:
        """The weighted sum of ``scores``; a ValueError naming ``where`` if one is missing."""
        missing = [k for k, _ in self.weights if not _finite(scores.get(k))]
        if missing:
            raise ValueError(f"{where}: no finite {missing} score for the reward (judged: "
                             f"{sorted(scores)})")  # fmt: skip
        return sum(w * float(scores[k]) for k, w in self.weights)


@dataclass(frozen=True)
class Sample:
    """One generated answer to a prompt: ``answer`` is what the preference line holds for it
    (``{"audio": path}`` or ``{"text": ...}``), ``scores`` its judges' figures."""

    index: int
    answer: dict
    scores: dict
    transcript: str | None = None  # what the ASR judge heard (TTS samples), for the record


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)  # (a bool, e.g. ended, is 0 / 1)


def numeric(scores: dict) -> dict:
    """The finite numbers of a judge's output as floats (``ended``: 0 / 1; transcripts and
    other text left out): what a preference line's scores hold."""
    return {k: float(v) for k, v in scores.items() if _finite(v)}


def choose_pair(samples: list[Sample], spec: RewardSpec, margin: float, where: str):
    """``(chosen, rejected, rewards)`` of one prompt's samples, or the reason it has no pair
    (``"one_sample"``, ``"no_margin"``, ``"identical"``)."""
    if len(samples) < 2:
        return "one_sample"
    rewards = [spec.reward(s.scores, f"{where} sample {s.index}") for s in samples]
    best = max(range(len(samples)), key=lambda i: (rewards[i], -i))
    worst = min(range(len(samples)), key=lambda i: (rewards[i], i))
    if rewards[best] - rewards[worst] <= margin:
        return "no_margin"
    if samples[best].answer == samples[worst].answer:
        return "identical"
    return samples[best], samples[worst], (rewards[best], rewards[worst])


def preference_lines(prompts: list[dict], samples: dict[str, list[Sample]], spec: RewardSpec,
                     margin: float = 0.0) -> tuple[list[dict], Counter]:  # fmt: skip
    """The ``--preference`` lines of ``prompts`` (each ``{"id", "task", "text" and / or
    "audio", ["speaker"]}``) from their ``samples`` (by prompt id), and the count of each outcome
    (``pairs`` and the reasons a prompt has none)."""
    lines, counts = [], Counter()
    for prompt in prompts:
        got = choose_pair(samples.get(prompt["id"], []), spec, margin, f"prompt {prompt['id']!r}")
        if isinstance(got, str):
            counts[got] += 1
            continue
        chosen, rejected, (r_c, r_r) = got
        counts["pairs"] += 1
        lines.append({
            **prompt,
            "chosen": chosen.answer,
            "rejected": rejected.answer,
            "scores": {"chosen": dict(numeric(chosen.scores), reward=r_c, sample=chosen.index),
                       "rejected": dict(numeric(rejected.scores), reward=r_r,
                                        sample=rejected.index)},
        })  # fmt: skip
    return lines, counts
