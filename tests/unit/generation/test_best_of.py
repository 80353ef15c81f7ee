"""generation/best_of.py: the order of a text's candidates, read off the rule itself (the
integration test tests/integration/test_eval.py decodes real candidates)."""

from __future__ import annotations

from torchtitan_speechlm.generation.best_of import candidate_rows, candidate_seeds, choose


def test_candidates_are_laid_out_per_text_with_consecutive_seeds():
    assert candidate_rows(["a", "b"], 3) == ["a", "a", "a", "b", "b", "b"]
    assert candidate_seeds([10, 0], 2) == [10, 11, 0, 1]


def test_ended_then_wer_then_cer_then_the_first_sample():
    text = "The small doctor called the farmer."
    # text 0: the one cut by max_frames loses to an ended one with errors
    # text 1: equal WER (one word wrong each): the lower CER wins
    # text 2: identical transcripts: the first sample; no speech counts as all wrong
    transcripts = [
        "the small doctor called the farmer", "the small doctor called the teacher",
        "the small doctor called the farmers", "the small doctor called the teacher",
        None, "the small doctor", "the small doctor",
    ]  # fmt: skip
    texts, n = [text] * 3, 2
    ended = [False, True, True, True]
    assert choose(texts[:2], transcripts[:4], ended, n) == [1, 2]
    assert choose([text], [None, "the small doctor"], [True, True], 2) == [1]
    assert choose([text], transcripts[5:], [True, True], 2) == [0]
    # punctuation and case are normalised away, as the judges normalise them
    assert choose(
        [text],
        ["the small doctor called the Teacher", "The small doctor, called the farmer!"],
        [True, True],
        2,
    ) == [1]
