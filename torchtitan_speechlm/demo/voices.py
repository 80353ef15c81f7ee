"""Voices for speaker-prompted TTS: espeak-ng settings that are different speakers to a speaker
judge, and a multi-speaker corpus spoken by them, with some speakers held out entirely.

espeak-ng has voices (``en-us``, ``en-gb-x-rp``, ...), variants (``+m1`` ... ``+m7``,
``+f1`` ... ``+f5`` and some 70 named ones: ``+Marco``, ``+edward``, ...), a pitch (``-p``,
0-99) and a speed (``-s``, words per minute); each setting here is one *speaker*. Not every
setting is a voice of its own to a speaker-verification model: ``benchmarks/voice_table.py``
measures every one of ``CANDIDATES`` with the Resemblyzer judge (the pairwise mean SIM of
different sentences) and ``VOICES`` is the set it tells apart (docs/quality.md, *Voices for
speaker-prompted TTS*; chosen with ``choose_voices``). Two espeak-ng 1.51 quirks: a variant
of ``en-gb`` is ignored (``en-gb+f3`` is byte for byte ``en-gb``; ``en+f3``, the same
British voice, takes it), and mbrola voices (``mb-us1`` ...) need the mbrola package.

``build_voice_corpus`` writes JSONL manifests whose lines name their ``speaker``, ready for
``torchtitan prepare --manifest`` (the speakers reach the prepared index: docs/data.md).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np
import soundfile as sf

from torchtitan_speechlm.demo import grammar
from torchtitan_speechlm.demo.assets import speak
from torchtitan_speechlm.utils.fileio import write_text_atomic

DEFAULT_SPEED = 175  # espeak-ng's default words per minute (the demo's one speed)


@dataclass(frozen=True)
class Voice:
    """One speaker: espeak-ng ``-v voice -s speed [-p pitch]``, named ``name`` in a corpus."""

    name: str
    voice: str
    speed: int = DEFAULT_SPEED
    pitch: int | None = None  # 0-99; None: espeak-ng's default (50)
    group: str = ""  # what the candidate varies (the table's grouping)

    def speak(self, text: str, sample_rate: int = 16000, tmp_dir: str | None = None) -> np.ndarray:
        """This voice saying ``text``: float32 at ``sample_rate``, peak 0.9."""
        return speak(text, self.voice, self.speed, sample_rate, self.pitch, tmp_dir)

    def describe(self) -> str:
        """The espeak-ng options, e.g. ``-v en-us+f3 -p 80``."""
        out = f"-v {self.voice}"
        out += f" -s {self.speed}" if self.speed != DEFAULT_SPEED else ""
        return out + (f" -p {self.pitch}" if self.pitch is not None else "")


def _named(names: str) -> list[Voice]:
    return [Voice(f"us-{n.lower()}", f"en-us+{n}", group="named variant") for n in names.split()]


CANDIDATES: tuple[Voice, ...] = (
    Voice("us", "en-us", group="voice"),
    *[Voice(f"us-m{k}", f"en-us+m{k}", group="numbered variant") for k in range(1, 8)],
    *[Voice(f"us-f{k}", f"en-us+f{k}", group="numbered variant") for k in range(1, 6)],
    Voice("gb", "en-gb", group="voice"),
    Voice("gb-m3", "en+m3", group="numbered variant"),
    Voice("gb-f3", "en+f3", group="numbered variant"),
    Voice("gb-rp", "en-gb-x-rp", group="voice"),
    Voice("gb-scotland", "en-gb-scotland", group="voice"),
    Voice("gb-lancaster", "en-gb-x-gbclan", group="voice"),
    Voice("gb-westmidlands", "en-gb-x-gbcwmd", group="voice"),
    Voice("caribbean", "en-029", group="voice"),
    Voice("us-nyc", "en-us-nyc", group="voice"),
    Voice("us-p20", "en-us", pitch=20, group="pitch"),
    Voice("us-p80", "en-us", pitch=80, group="pitch"),
    Voice("us-f3-p80", "en-us+f3", pitch=80, group="pitch"),
    Voice("us-s130", "en-us", speed=130, group="speed"),
    Voice("us-s230", "en-us", speed=230, group="speed"),
    *_named(
        "Alicia Andrea Andy Annie Gene Hugo Jacky Lee Marco Nguyen anika antonio aunty belinda "
        "david edward grandma iven klatt m8 norbert robert shelby steph Storm travis zac"
    ),
)

# The set Resemblyzer tells apart and PocketSphinx understands, most distinct first
# (docs/quality.md): choose_voices over every candidate (benchmarks/voice_table.py, 6
# sentences) picked 20, each member's SIM to itself at least 0.1 above its SIM to any other
# member; checked on 10 other sentences (--voices chosen --sentences 10 --seed 2: every
# margin still >= 0.107, speaker-ID accuracy 1.0), where us-robert and us-andy were misheard
# (WER 0.43, 0.36), so they are left out.
VOICE_NAMES: tuple[str, ...] = (
    "us-steph", "us-edward", "us-iven", "us-anika", "us-hugo", "us-klatt", "us-david",
    "us-belinda", "us-jacky", "us-antonio", "us-m8", "us-f3-p80", "us-storm", "us-f1",
    "us-gene", "us-nguyen", "us-aunty", "us-m2",
)  # fmt: skip
# held out of training by default (build_voice_corpus): a female voice, two named male
# variants and a numbered one; 14 speakers (5 female) remain for training
HELD_OUT: tuple[str, ...] = ("us-belinda", "us-antonio", "us-gene", "us-m2")


def voice(name: str) -> Voice:
    """The candidate named ``name``."""
    for v in CANDIDATES:
        if v.name == name:
            return v
    raise KeyError(f"no voice {name!r}; candidates: {', '.join(v.name for v in CANDIDATES)}")


def chosen_voices() -> tuple[Voice, ...]:
    """``VOICE_NAMES`` as Voices."""
    return tuple(voice(n) for n in VOICE_NAMES)


# --- measuring: the SIM table and the choice -----------------------------------------------


def sim_table(embeddings: np.ndarray) -> np.ndarray:
    """``[speakers, speakers]`` mean cosine similarity between utterances of *different*
    sentences, from ``embeddings`` ``[speakers, sentences, dim]`` (sentence ``k`` the same text
    for every speaker): the diagonal is a speaker against itself on another sentence, the rest
    a speaker against another one, the text never shared."""
    e = np.asarray(embeddings, np.float64)
    if e.ndim != 3 or e.shape[1] < 2:
        raise ValueError(f"embeddings of shape {e.shape}: need [speakers, >= 2 sentences, dim]")
    e = e / np.linalg.norm(e, axis=-1, keepdims=True)
    sims = np.einsum("asd,btd->abst", e, e)
    other = ~np.eye(e.shape[1], dtype=bool)
    return sims[:, :, other].mean(-1)


def margins(table: np.ndarray, members: list[int] | None = None) -> np.ndarray:
    """Per speaker of ``members`` (default: all): its same-speaker SIM minus its highest SIM
    to another member (how clearly it stands apart from the nearest one)."""
    idx = list(range(len(table))) if members is None else list(members)
    sub = np.asarray(table)[np.ix_(idx, idx)]
    cross = np.where(np.eye(len(idx), dtype=bool), -np.inf, sub)
    return np.diag(sub) - cross.max(1) if len(idx) > 1 else np.full(len(idx), np.inf)


def choose_voices(
    names: list[str],
    table: np.ndarray,
    min_margin: float = 0.1,
    max_voices: int = 20,
    wer: list[float | None] | None = None,
    max_wer: float = 0.1,
) -> list[str]:
    """A set of speakers each at least ``min_margin`` more similar to itself than to any other
    member: candidates in order of their margin against every candidate, each kept if it keeps
    every member's margin at least ``min_margin``; at most ``max_voices``. With ``wer`` (the
    recogniser's WER on each candidate's recordings), candidates above ``max_wer`` are left
    out: a voice the judge cannot understand would make TTS intelligibility unmeasurable."""
    order = np.argsort(-margins(table), kind="stable")
    kept: list[int] = []
    for c in order:
        if len(kept) == max_voices:
            break
        if wer is not None and wer[c] is not None and wer[c] > max_wer:
            continue
        if margins(table, [*kept, int(c)]).min() >= min_margin:
            kept.append(int(c))
    return [names[k] for k in kept]


def speaker_id_accuracy(embeddings: np.ndarray) -> float:
    """Share of utterances whose nearest speaker centroid is their speaker's, each speaker's
    centroid the mean of its utterances of the *other* sentences (so no centroid holds the
    utterance's text): the issue's speaker identification, on the recordings themselves."""
    e = np.asarray(embeddings, np.float64)
    e = e / np.linalg.norm(e, axis=-1, keepdims=True)
    n_spk, n_utt = e.shape[:2]
    total = e.sum(1)
    right = 0
    for k in range(n_utt):
        cents = total - e[:, k]
        cents /= np.linalg.norm(cents, axis=-1, keepdims=True)
        right += int((np.argmax(e[:, k] @ cents.T, axis=1) == np.arange(n_spk)).sum())
    return right / (n_spk * n_utt)


# --- the corpus ------------------------------------------------------------------------------

SPLITS = ("train", "heldout", "heldout_speakers")
RECORD = "voices.json"


@dataclass(frozen=True)
class VoiceCorpus:
    """The manifests ``build_voice_corpus`` wrote (lines ``{"id", "audio", "text",
    "speaker"}``) and its speakers."""

    out_dir: str
    train: str  # seen speakers, training sentences (each sentence spoken once)
    heldout: str  # seen speakers, held-out sentences (never in training; each speaker all)
    heldout_speakers: str  # held-out speakers (never in training), the same held-out sentences
    seen: tuple[str, ...]
    held_out: tuple[str, ...]


def build_voice_corpus(
    out_dir: str,
    train_per_speaker: int,
    heldout_per_speaker: int,
    voices: tuple[Voice, ...] | None = None,
    held_out: tuple[str, ...] | None = None,
    seed: int = 0,
    sample_rate: int = 16000,
    workers: int = 2,
) -> VoiceCorpus:
    """Speak a multi-speaker corpus of the grammar's sentences into ``out_dir``.

    ``voices`` (default: the measured set, ``VOICE_NAMES``) are the speakers; ``held_out``
    (default ``HELD_OUT``) of them never occur in training. Sentences come from
    ``grammar.split_sentences(seen * train_per_speaker, heldout_per_speaker, seed)``: training
    sentence ``j`` is spoken by seen speaker ``j % seen`` only, and every speaker, seen or
    held out, says all the held-out sentences (the same texts, so a speaker's utterance can be
    scored against another speaker's of the same text). Writes ``wavs/<split>/<id>.wav``
    (16-bit, ``sample_rate``), ``train.jsonl``, ``heldout.jsonl``, ``heldout_speakers.jsonl``
    (ids ``<split>-<speaker>-NNNN``) and, last, ``voices.json`` (the settings and every
    speaker's espeak-ng options). A folder whose ``voices.json`` records these settings is
    reused; one made with others is refused."""
    voices = tuple(voices if voices is not None else chosen_voices())
    held = tuple(held_out if held_out is not None else HELD_OUT)
    names = [v.name for v in voices]
    if len(set(names)) != len(names):
        raise ValueError(f"voice names must be unique: {names}")
    unknown = sorted(set(held) - set(names))
    if unknown:
        raise ValueError(f"held-out speakers {unknown} are not among the voices {names}")
    seen = [v for v in voices if v.name not in held]
    if not seen:
        raise ValueError("every speaker is held out: nothing to train on")
    if heldout_per_speaker < 2 or train_per_speaker < 2:
        raise ValueError(
            "train_per_speaker and heldout_per_speaker must be >= 2: a speaker prompt is "
            "another utterance of the same speaker"
        )
    record = {"train_per_speaker": train_per_speaker, "heldout_per_speaker": heldout_per_speaker,
              "seed": seed, "sample_rate": sample_rate, "held_out": list(held),
              "voices": [asdict(v) for v in voices],
              "espeak": {v.name: v.describe() for v in voices}}  # fmt: skip
    corpus = VoiceCorpus(out_dir, *(os.path.join(out_dir, f"{s}.jsonl") for s in SPLITS),
                         tuple(v.name for v in seen), held)  # fmt: skip
    record_path = os.path.join(out_dir, RECORD)
    if os.path.isfile(record_path):
        with open(record_path) as f:
            if json.load(f) == record:
                return corpus
        raise ValueError(
            f"{out_dir} holds a voice corpus made with other settings ({record_path}); remove "
            "it or choose another folder"
        )
    train_text, held_text = grammar.split_sentences(
        len(seen) * train_per_speaker, heldout_per_speaker, seed
    )
    jobs = {
        "train": [(seen[j % len(seen)], j // len(seen), t) for j, t in enumerate(train_text)],
        "heldout": [(v, k, t) for v in seen for k, t in enumerate(held_text)],
        "heldout_speakers": [
            (v, k, t) for v in voices if v.name in held for k, t in enumerate(held_text)
        ],  # fmt: skip
    }

    def one(split: str, v: Voice, k: int, text: str) -> dict:
        item = f"{split}-{v.name}-{k:04d}"
        rel = os.path.join("wavs", split, f"{item}.wav")
        folder = os.path.join(out_dir, "wavs", split)
        wav = v.speak(text, sample_rate, tmp_dir=folder)
        sf.write(os.path.join(out_dir, rel), wav, sample_rate, subtype="PCM_16")
        return {"id": item, "audio": rel, "text": text, "speaker": v.name}

    for split, todo in jobs.items():
        os.makedirs(os.path.join(out_dir, "wavs", split), exist_ok=True)
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            rows = list(pool.map(lambda job, s=split: one(s, *job), todo))
        lines = "".join(json.dumps(r) + "\n" for r in rows)
        write_text_atomic(getattr(corpus, split), lines)
    write_text_atomic(record_path, json.dumps(record, indent=1) + "\n")
    return corpus
