"""evaluation/prompted_tts.py's speaker scores: a generated clip the speaker judge cannot embed (no
speech in it: Resemblyzer's VAD trims the whole clip) is that item's recorded failure, not the end
of the evaluation. It was the end: `torchtitan eval` of the speaker-prompt benchmark's step-6,400
model exited with the judge's error after 8 minutes of scoring, nothing written."""

from types import SimpleNamespace

import numpy as np
import pytest

from torchtitan_speechlm.evaluation.prompted_tts import speaker_scores
from torchtitan_speechlm.judges.base import JudgeError


class FirstSamplesJudge:
    """Embeds a clip as its first 3 samples; a silent clip has no speech, as for Resemblyzer."""

    def embed(self, wav, rate):
        if not np.any(wav):
            raise JudgeError("resemblyzer: no speech found (the VAD trimmed the whole clip)")
        return np.asarray(wav[:3], dtype=np.float64)


def test_a_generated_clip_without_speech_is_that_items_failure_not_the_evaluations():
    loaded = SimpleNamespace(codec=SimpleNamespace(sample_rate=16000))
    a, b = np.array([1.0, 0.0, 0.0]), np.array([0.0, 1.0, 0.0])
    heard = [a, a, b, b]  # the prompts as the model heard them: speakers 0, 0, 1, 1
    generated = [2 * a, np.zeros(3), b, None]
    r = speaker_scores(loaded, FirstSamplesJudge(), generated, [None] * 4, [0, 0, 1, 1], heard)
    items = r["per_item"]
    assert items[0] == {"sim_prompt": pytest.approx(1.0), "speaker_id_correct": True}
    assert items[1]["sim_prompt"] is None and not items[1]["speaker_id_correct"]
    assert "no speech found" in items[1]["failure"]
    assert items[2] == {"sim_prompt": pytest.approx(1.0), "speaker_id_correct": True}
    assert items[3]["failure"] == "no audio generated"
    assert r["speaker_id_accuracy"] == 0.5  # a clip without a voice is not identified
    assert r["sim_prompt"] == pytest.approx(1.0) and r["sim_other"] == pytest.approx(0.0)
