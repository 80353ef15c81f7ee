"""The multi-speaker voice corpus (demo/voices.py): the SIM table, margins, the choice of
voices and speaker-ID accuracy on known embeddings; the candidate and chosen sets; and a tiny
corpus spoken by espeak-ng (speakers in every line, held-out speakers and sentences apart,
reused, refused when made with other settings)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import soundfile as sf

from tests.data_fixtures import needs_espeak
from torchtitan_speechlm.demo import grammar, voices
from torchtitan_speechlm.prepare.sources.jsonl import read_jsonl_manifest


def clusters(centres: np.ndarray, n: int, spread: float, seed: int = 0) -> np.ndarray:
    """``[speakers, n, dim]``: each speaker's utterances around its centre."""
    rng = np.random.default_rng(seed)
    return centres[:, None, :] + spread * rng.standard_normal((len(centres), n, centres.shape[1]))


def test_sim_table_compares_only_different_sentences():
    e = np.zeros((2, 2, 3))
    e[0, 0], e[0, 1] = [1, 0, 0], [0, 1, 0]  # speaker 0: orthogonal utterances
    e[1, 0], e[1, 1] = [1, 0, 0], [1, 0, 0]  # speaker 1: its first equals speaker 0's first
    t = voices.sim_table(e)
    # same sentence pairs (0,0) and (1,1) never count: speaker 0 against 1 is the mean of
    # cos(e00, e11) = 1 and cos(e01, e10) = 0
    np.testing.assert_allclose(t, [[0.0, 0.5], [0.5, 1.0]])
    with pytest.raises(ValueError, match="need \\[speakers, >= 2 sentences, dim\\]"):
        voices.sim_table(np.ones((2, 1, 3)))


def test_margins_and_the_choice():
    table = np.array([
        [0.90, 0.85, 0.50, 0.40],
        [0.85, 0.88, 0.55, 0.45],
        [0.50, 0.55, 0.80, 0.60],
        [0.40, 0.45, 0.60, 0.85],
    ])  # fmt: skip
    np.testing.assert_allclose(voices.margins(table), [0.05, 0.03, 0.20, 0.25])
    np.testing.assert_allclose(voices.margins(table, [0, 2]), [0.40, 0.30])
    names = ["a", "b", "c", "d"]
    assert voices.choose_voices(names, table, min_margin=0.1) == ["d", "c", "a"]
    assert voices.choose_voices(names, table, min_margin=0.1, max_voices=2) == ["d", "c"]
    assert voices.choose_voices(names, table, 0.1, wer=[0.5, 0.0, 0.0, 0.0]) == ["d", "c", "b"]


def test_speaker_id_accuracy():
    centres = np.eye(5, 16)
    assert voices.speaker_id_accuracy(clusters(centres, 4, 0.05)) == 1.0
    same = clusters(np.ones((5, 16)), 4, 0.3)  # five names for one voice: about chance
    assert voices.speaker_id_accuracy(same) < 0.6


def test_candidates_and_the_chosen_set():
    names = [v.name for v in voices.CANDIDATES]
    assert len(set(names)) == len(names) >= 40
    assert {f"us-m{k}" for k in range(1, 8)} | {f"us-f{k}" for k in range(1, 6)} <= set(names)
    assert 12 <= len(voices.VOICE_NAMES) <= 20 and set(voices.VOICE_NAMES) <= set(names)
    assert set(voices.HELD_OUT) < set(voices.VOICE_NAMES)
    assert voices.voice("us-f3-p80").describe() == "-v en-us+f3 -p 80"
    assert voices.voice("us-s130").describe() == "-v en-us -s 130"
    assert voices.voice("us").describe() == "-v en-us"
    with pytest.raises(KeyError, match="no voice 'nobody'"):
        voices.voice("nobody")


@pytest.mark.skipif(not needs_espeak, reason="espeak-ng binary not installed")
def test_a_tiny_corpus(tmp_path):
    chosen = tuple(voices.voice(n) for n in ("us-steph", "us-edward", "us-m2"))
    out = str(tmp_path / "voices")
    c = voices.build_voice_corpus(out, 3, 2, voices=chosen, held_out=("us-m2",), sample_rate=8000)
    assert c.seen == ("us-steph", "us-edward") and c.held_out == ("us-m2",)
    rows = {s: [json.loads(x) for x in open(getattr(c, s))] for s in voices.SPLITS}
    assert [r["speaker"] for r in rows["train"]] == ["us-steph", "us-edward"] * 3
    assert [r["speaker"] for r in rows["heldout"]] == ["us-steph"] * 2 + ["us-edward"] * 2
    assert [r["speaker"] for r in rows["heldout_speakers"]] == ["us-m2"] * 2
    train_text, held_text = grammar.split_sentences(6, 2, seed=0)
    assert [r["text"] for r in rows["train"]] == train_text  # each spoken once
    assert [r["text"] for r in rows["heldout_speakers"]] == held_text
    assert {r["text"] for r in rows["heldout"]} == set(held_text)
    assert rows["train"][1]["id"] == "train-us-edward-0000"
    wav, sr = sf.read(os.path.join(out, rows["heldout_speakers"][0]["audio"]))
    assert sr == 8000 and len(wav) > 4000
    items = read_jsonl_manifest(c.train)  # what torchtitan prepare reads
    assert [it.speaker for it in items] == [r["speaker"] for r in rows["train"]]
    record = json.load(open(os.path.join(out, voices.RECORD)))
    assert record["espeak"]["us-m2"] == "-v en-us+m2" and record["held_out"] == ["us-m2"]
    mtime = os.path.getmtime(c.train)
    again = voices.build_voice_corpus(out, 3, 2, voices=chosen, held_out=("us-m2",),
                                      sample_rate=8000)  # fmt: skip
    assert again == c and os.path.getmtime(c.train) == mtime  # reused, not spoken again
    with pytest.raises(ValueError, match="made with other settings"):
        voices.build_voice_corpus(out, 4, 2, voices=chosen, held_out=("us-m2",), sample_rate=8000)


def test_bad_corpus_settings(tmp_path):
    two = (voices.voice("us-steph"), voices.voice("us-edward"))
    with pytest.raises(ValueError, match=r"held-out speakers \['x'\] are not among"):
        voices.build_voice_corpus(str(tmp_path), 2, 2, voices=two, held_out=("x",))
    with pytest.raises(ValueError, match="every speaker is held out"):
        voices.build_voice_corpus(
            str(tmp_path), 2, 2, voices=two, held_out=("us-steph", "us-edward")
        )
    with pytest.raises(ValueError, match="another utterance of the same speaker"):
        voices.build_voice_corpus(str(tmp_path), 2, 1, voices=two, held_out=())
    with pytest.raises(ValueError, match="must be unique"):
        voices.build_voice_corpus(str(tmp_path), 2, 2, voices=(two[0], two[0]), held_out=())
