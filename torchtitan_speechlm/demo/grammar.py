"""A small English grammar: many distinct sentences over a few dozen words.

A model generalises only from enough distinct sentences. A fixed list of a few hundred sentences
(the old demo) is memorised, never generalised; this grammar yields tens of thousands of
sentences over 42 words, so a corpus of a few thousand utterances covers every word hundreds of
times in ever new combinations, and *held-out sentences that never occur in training* test
whether a model learned words rather than sentences. Every word is in PocketSphinx's shipped
English dictionary, so the restricted recogniser judge (``judges.pocketsphinx``) can score any
sentence of it.

``split_sentences`` draws a reproducible training and held-out set and checks that they are
disjoint.
"""

from __future__ import annotations

import itertools

import numpy as np

ADJECTIVES = ("big", "small", "red", "green", "old", "young", "happy", "quiet", "brave", "sleepy")
NOUNS = ("cat", "dog", "bird", "horse", "fish", "farmer", "teacher", "doctor", "baby", "king",
         "girl", "boy")  # fmt: skip
VERBS = ("saw", "found", "helped", "followed", "painted", "called", "watched", "chased")
NAMES = ("anna", "peter", "maria", "david")
TIMES = ("today", "yesterday", "at night", "in the morning")


def _templates():
    """Each template is (format, slot word lists); sentences are generated in a fixed order."""
    return [
        ("the {} {} {} the {}", (ADJECTIVES, NOUNS, VERBS, NOUNS)),
        ("{} {} a {} {}", (NAMES, VERBS, ADJECTIVES, NOUNS)),
        ("the {} {} {} {}", (NOUNS, VERBS, NAMES, TIMES)),
    ]


def all_sentences() -> list[str]:
    """Every sentence of the grammar (capitalised, with a full stop), in a fixed order."""
    out = []
    for fmt, slots in _templates():
        for words in itertools.product(*slots):
            s = fmt.format(*words)
            out.append(s[0].upper() + s[1:] + ".")
    return out


def vocabulary() -> list[str]:
    """The grammar's words, lower case, sorted (what a restricted recogniser needs)."""
    words = set()
    for fmt, slots in _templates():
        words.update(w for w in fmt.replace("{}", " ").split())
        for slot in slots:
            for entry in slot:
                words.update(entry.split())
    return sorted(words)


def split_sentences(n_train: int, n_held_out: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``n_train`` and ``n_held_out`` distinct sentences, drawn without replacement (seeded);
    no held-out sentence occurs in training (checked)."""
    pool = all_sentences()
    if n_train + n_held_out > len(pool):
        raise ValueError(f"the grammar has {len(pool)} sentences; asked for {n_train + n_held_out}")
    order = np.random.default_rng(seed).permutation(len(pool))
    train = [pool[i] for i in order[:n_train]]
    held = [pool[i] for i in order[n_train : n_train + n_held_out]]
    if set(train) & set(held):
        raise AssertionError("a held-out sentence occurs in training")
    return train, held


def jsgf() -> str:
    """The grammar as JSGF, for a recogniser restricted to the language (not to the sentences):
    PocketSphinx's ``--judge-grammar``. Any sentence of the grammar is accepted, held-out or not;
    a word sequence outside it is not, so the judge is sharp on this corpus."""
    rules, alts = [], []
    for i, (fmt, slots) in enumerate(_templates()):
        parts = fmt.split("{}")
        body = parts[0]
        for j, slot in enumerate(slots):
            body += "(" + " | ".join(slot) + ")" + parts[j + 1]
        rules.append(f"<t{i}> = {' '.join(body.split())};")
        alts.append(f"<t{i}>")
    head = ["#JSGF V1.0;", "grammar speechlm_demo;", f"public <sentence> = {' | '.join(alts)};"]
    return "\n".join(head + rules) + "\n"
