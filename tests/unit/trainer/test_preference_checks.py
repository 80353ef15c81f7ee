"""The start-up checks of a preference run (trainer/checks.py: check_preference): a preference
loss needs preference tasks and they need it, each refusal naming the key and the fix
(pipelines train pairs: tests/integration/test_preference_training.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.data.catalog import MixEntry
from torchtitan_speechlm.trainer.checks import check_preference


def job(loss: str):
    return SimpleNamespace(speechlm=SimpleNamespace(preference_loss=loss))


def plan(*tasks: str):
    return SimpleNamespace(data=SimpleNamespace(train=[MixEntry(t, "d", 1.0) for t in tasks]))


def test_a_preference_run_needs_pairs_and_pairs_need_a_preference_loss():
    check_preference(job("dpo"), plan("tts_pref", "asr_pref"))  # fine
    check_preference(job(""), plan("tts", "asr"))  # no preference at all: fine
    with pytest.raises(ConfigError, match=r"preference_loss = 'dpo' .* no preference task"):
        check_preference(job("dpo"), plan("tts", "asr"))
    with pytest.raises(ConfigError, match=r"preference tasks \['tts_pref:d'\] .* not set"):
        check_preference(job(""), plan("tts_pref"))
