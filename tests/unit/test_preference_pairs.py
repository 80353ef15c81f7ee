"""Preference pairs from judged samples (evaluation/pairs.py): rewards by hand, the best and the
worst sample of each prompt, what makes no pair counted, and the lines read back by the
``--preference`` source."""

from __future__ import annotations

import json

import pytest

from torchtitan_speechlm.evaluation.pairs import RewardSpec, Sample, preference_lines
from torchtitan_speechlm.prepare.sources.preference import read_preference_jsonl


def test_a_reward_is_the_weighted_sum_and_bad_specs_are_refused():
    spec = RewardSpec.parse("wer=-1, sim=0.5,ended=0.25")
    assert spec.reward({"wer": 0.2, "sim": 0.8, "ended": True}, "x") == pytest.approx(
        -0.2 + 0.4 + 0.25
    )
    for bad in ("", "wer", "wer=x", "bleu=1", "wer=0", "sim=inf"):
        with pytest.raises(ValueError, match="e.g. wer=-1,sim=0.5"):
            RewardSpec.parse(bad)
    with pytest.raises(ValueError, match=r"prompt 7: no finite \['sim'\] score"):
        spec.reward({"wer": 0.1, "ended": 1, "sim": float("nan")}, "prompt 7")


def test_best_and_worst_of_each_prompt_and_what_makes_no_pair(tmp_path):
    spec = RewardSpec.parse("wer=-1,sim=1")

    def s(i, wer, sim, audio):
        return Sample(i, {"audio": audio}, {"wer": wer, "sim": sim, "text": "heard", "ended": True})

    prompts = [{"id": f"p{k}", "task": "tts", "text": f"sentence {k}"} for k in range(5)]
    samples = {
        "p0": [s(0, 0.5, 0.8, "a.wav"), s(1, 0.0, 0.9, "b.wav"), s(2, 0.9, 0.7, "c.wav")],
        "p1": [s(0, 0.1, 0.9, "a.wav")],  # one sample
        "p2": [s(0, 0.1, 0.9, "a.wav"), s(1, 0.1, 0.9, "b.wav")],  # equal rewards
        "p3": [s(0, 0.0, 0.9, "same.wav"), s(1, 0.5, 0.9, "same.wav")],  # the same answer
        # p4: none generated
    }
    lines, counts = preference_lines(prompts, samples, spec)
    assert counts == {"pairs": 1, "one_sample": 2, "no_margin": 1, "identical": 1}
    (line,) = lines
    assert line["id"] == "p0" and line["chosen"] == {"audio": "b.wav"}
    assert line["rejected"] == {"audio": "c.wav"}
    assert line["scores"]["chosen"] == {"wer": 0.0, "sim": 0.9, "ended": 1.0,
                                        "reward": pytest.approx(0.9), "sample": 1}  # fmt: skip
    assert line["scores"]["rejected"]["reward"] == pytest.approx(-0.2)
    # a margin: pairs whose rewards differ by no more than it are not made
    assert preference_lines(prompts, samples, spec, margin=2.0)[1]["no_margin"] == 3
    # the lines are what `torchtitan prepare --preference` reads
    for name in ("b.wav", "c.wav"):
        (tmp_path / name).write_bytes(b"")
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    (item,) = list(read_preference_jsonl(str(path)))
    assert item.id == "p0" and item.extra["preference"]["scores"] == line["scores"]


def test_a_judged_record_gives_the_scores_a_reward_weighs():
    from torchtitan_speechlm.evaluation.sampled_pairs import rewards_by_task, sample_scores

    rec = {"wer": 0.25, "cer": 0.1, "sim": None, "self_wer": 0.0, "ended": False,
           "duration_ratio": 1.2, "dnsmos": {"dnsmos_ovrl": 3.1, "dnsmos_sig": 3.5},
           "transcript": "words", "frames": 40}  # fmt: skip
    assert sample_scores(rec) == {"wer": 0.25, "cer": 0.1, "self_wer": 0.0, "ended": 0.0,
                                  "dnsmos": 3.1, "duration_ratio_error": pytest.approx(0.2)}  # fmt: skip
    rewards = rewards_by_task(["wer=-1", "tts:wer=-1,ended=0.5"])
    assert rewards["asr"].weights == (("wer", -1.0),)
    assert rewards["tts"].weights == (("wer", -1.0), ("ended", 0.5))
    with pytest.raises(ValueError, match="e.g. wer=-1,sim=0.5"):
        rewards_by_task(["tts:bleu=1"])


def test_a_tts_prompt_sample_is_ranked_by_sim_to_its_prompt(tmp_path):
    """A tts_prompt set's ``sim`` is SIM to the prompt as heard (the record's ``sim_prompt``,
    not its SIM to the reference); its line holds the heard prompt's wav and the text."""
    from types import SimpleNamespace

    from torchtitan_speechlm.evaluation.sampled_pairs import (
        pair_prompts,
        rewards_by_task,
        sample_scores,
        samples_of,
    )

    recs = [{"wer": 0.5, "sim": 0.1, "sim_prompt": sim, "ended": True, "transcript": "x",
             "audio": {"generated": f"0-set/sample{k}/gen.wav", "prompt": f"0-set/sample{k}/p.wav"}}
            for k, sim in enumerate((0.2, 0.9))]  # fmt: skip
    assert sample_scores(recs[0], "tts_prompt")["sim"] == 0.2
    assert sample_scores(recs[0])["sim"] == 0.1  # a tts set's: to the reference
    item = SimpleNamespace(id="u1", text="say this")
    runs = [{"per_item": [r]} for r in recs]
    (prompt,) = pair_prompts(None, "tts_prompt", "", [item], runs, str(tmp_path), "0-set", {})
    assert prompt == {"id": "tts_prompt-u1", "task": "tts_prompt", "text": "say this",
                      "audio": str(tmp_path / "0-set/sample0/p.wav")}  # fmt: skip
    spec = rewards_by_task(["tts:wer=-1", "tts_prompt:sim=1,wer=-1"])["tts_prompt"]
    lines, _ = preference_lines([prompt], samples_of("tts_prompt", [item], runs, str(tmp_path)),
                                spec)  # fmt: skip
    (line,) = lines
    assert line["chosen"] == {"audio": str(tmp_path / "0-set/sample1/gen.wav")}
    assert line["scores"]["chosen"]["reward"] == pytest.approx(0.9 - 0.5)
    assert line["scores"]["rejected"]["reward"] == pytest.approx(0.2 - 0.5)
    for name in ("sample0/p.wav", "sample0/gen.wav", "sample1/gen.wav"):
        (tmp_path / "0-set" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "0-set" / name).write_bytes(b"")
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (read,) = list(read_preference_jsonl(str(path)))
    assert [(t.role, t.text is None) for t in read.turns] == [
        ("user", True), ("user", False), ("assistant", True), ("assistant", True)]  # fmt: skip
    assert read.turns[1].text == "say this"
    assert read.turns[0].audio.path == prompt["audio"]
