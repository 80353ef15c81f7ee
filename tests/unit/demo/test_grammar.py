"""The demo's grammar corpus: held-out sentences never occur in training, every word is in the
restricted judge's dictionary, and its JSGF lets that judge read espeak-ng speech of
sentences it was never given."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

from tests.data_fixtures import needs_espeak
from torchtitan_speechlm.demo import grammar
from torchtitan_speechlm.utils.audio import load_audio


def test_split_is_disjoint_reproducible_and_covers_the_vocabulary():
    train, held = grammar.split_sentences(2500, 40, seed=0)
    assert len(set(train)) == 2500 and len(set(held)) == 40
    assert not set(train) & set(held)
    assert (train, held) == grammar.split_sentences(2500, 40, seed=0)
    assert grammar.split_sentences(2500, 40, seed=1)[1] != held
    words = {w.strip(".").lower() for s in train for w in s.split()}
    assert words == set(grammar.vocabulary())
    with pytest.raises(ValueError, match="the grammar has"):
        grammar.split_sentences(len(grammar.all_sentences()), 1)


def test_every_word_is_in_the_judges_dictionary():
    ps = pytest.importorskip("pocketsphinx")
    path = os.path.join(os.path.dirname(ps.__file__), "model", "en-us", "cmudict-en-us.dict")
    with open(path) as f:
        known = {line.split()[0] for line in f if line.strip()}
    assert set(grammar.vocabulary()) <= known


@pytest.mark.skipif(not needs_espeak, reason="espeak-ng binary not installed")
def test_the_grammar_judge_reads_held_out_espeak_speech(tmp_path):
    pytest.importorskip("pocketsphinx")
    from torchtitan_speechlm.judges import build_judge, error_rates

    jsgf = tmp_path / "g.jsgf"
    jsgf.write_text(grammar.jsgf())
    judge = build_judge("pocketsphinx", grammar=str(jsgf))
    _, held = grammar.split_sentences(100, 8, seed=3)
    hyps = []
    for i, text in enumerate(held):
        wav = tmp_path / f"{i}.wav"
        subprocess.run(["espeak-ng", "-w", str(wav), "-v", "en-us", text], check=True)
        hyps.append(judge.transcribe(load_audio(str(wav), 16000), 16000))
    assert error_rates(held, hyps)["wer"] <= 0.1, list(zip(held, hyps, strict=True))
    # a sentence outside the grammar is not forced onto one of its own: silence gives nothing
    assert judge.transcribe(np.zeros(16000, np.float32), 16000) == ""


def test_a_work_folder_made_with_another_plan_is_refused(tmp_path):
    """The demo and bench_learning reuse what a work folder holds; made with another plan (more
    sentences, another model), it would mix a new corpus with stale prepared data."""
    from torchtitan_speechlm.demo.speaking import CorpusPlan, _check_plan

    _check_plan(str(tmp_path), CorpusPlan(train=100, held_out=5))
    _check_plan(str(tmp_path), CorpusPlan(train=100, held_out=5))  # same plan: reused
    with pytest.raises(ValueError, match="train: 100 there, 200 now"):
        _check_plan(str(tmp_path), CorpusPlan(train=200, held_out=5))
    # a record written before a key was added to the plan reads that key as its default
    record = tmp_path / "plan.json"
    old = json.loads(record.read_text())
    del old["kmeans_seconds"]
    record.write_text(json.dumps(old))
    _check_plan(str(tmp_path), CorpusPlan(train=100, held_out=5))
    with pytest.raises(ValueError, match="kmeans_seconds: 600.0 there, 2400 now"):
        _check_plan(str(tmp_path), CorpusPlan(train=100, held_out=5, kmeans_seconds=2400))
