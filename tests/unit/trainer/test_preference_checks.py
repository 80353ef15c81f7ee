"""The start-up checks of a preference run (trainer/checks.py: check_preference): a preference
loss needs preference tasks and they need it, and the layouts that split a pair's frames are
refused, each naming the key and the fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.data.catalog import MixEntry
from torchtitan_speechlm.trainer.checks import check_preference


def job(loss: str, pp: int = 1, cp: int = 1):
    return SimpleNamespace(
        speechlm=SimpleNamespace(preference_loss=loss),
        parallelism=SimpleNamespace(pipeline_parallel_degree=pp, context_parallel_degree=cp),
    )


def plan(*tasks: str):
    return SimpleNamespace(data=SimpleNamespace(train=[MixEntry(t, "d", 1.0) for t in tasks]))


def test_a_preference_run_needs_pairs_and_pairs_need_a_preference_loss():
    check_preference(job("dpo"), plan("tts_pref", "asr_pref"))  # fine
    check_preference(job(""), plan("tts", "asr"))  # no preference at all: fine
    with pytest.raises(ConfigError, match=r"preference_loss = 'dpo' .* no preference task"):
        check_preference(job("dpo"), plan("tts", "asr"))
    with pytest.raises(ConfigError, match=r"preference tasks \['tts_pref:d'\] .* not set"):
        check_preference(job(""), plan("tts_pref"))


@pytest.mark.parametrize("pp,cp", [(2, 1), (1, 2)])
def test_layouts_that_split_a_pair_are_refused_naming_them(pp, cp):
    with pytest.raises(ConfigError, match=r"pipeline_parallel_degree = .*\(not supported yet\)"):
        check_preference(job("simpo", pp, cp), plan("tts_pref"))
    check_preference(job("", pp, cp), plan("tts"))  # other runs are not this check's
