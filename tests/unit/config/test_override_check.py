"""``config/override_check.py`` on torchtitan's real JobConfig with our sections merged: a key
in neither spelling is one line naming the nearest keys; every real key passes in both
spellings, a bool in its ``no_`` form, nested sections too; values are not keys."""

from __future__ import annotations

import pytest

from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.config.field_docs import SECTIONS
from torchtitan_speechlm.config.override_check import check_override_keys, config_keys


@pytest.fixture(scope="module")
def merged():
    from torchtitan_speechlm.utils import upstream

    return upstream.job_config_class("torchtitan_speechlm.config")


def test_every_real_key_passes_in_both_spellings(merged):
    keys = config_keys(merged)
    assert {"training.steps", "speechlm.pattern", "lora.rank", "job.config_file"} <= keys
    for name, cls in SECTIONS:  # ours are merged in
        assert {f"{name}.{k}" for k in cls.__dataclass_fields__} <= keys
    argv = []
    for k in sorted(keys):
        argv += [f"--{k}", "1", f"--{k.replace('_', '-')}=1"]
    check_override_keys(argv, merged)
    check_override_keys(["--speechlm_data.no_shuffle", "--speechlm-data.no-shuffle"], merged)
    check_override_keys(["-h", "value", "-1", "--"], merged)


def test_a_mistyped_key_names_the_nearest(merged):
    with pytest.raises(ConfigError) as e:
        check_override_keys(["--training.steps", "3", "--training.local-batch-sise", "2"], merged)
    assert str(e.value).startswith(
        "unknown command-line key --training.local_batch_sise: did you mean "
        "--training.local_batch_size"
    )
    with pytest.raises(ConfigError, match=r"--trainin\.steps: did you mean --training\.steps"):
        check_override_keys(["--trainin.steps=3"], merged)
    with pytest.raises(ConfigError, match=r"there is no section \[qqqq\]"):
        check_override_keys(["--qqqq.qqqqqqqq", "1"], merged)
    with pytest.raises(ConfigError, match=r"\[speechlm\] has no such key \(`torchtitan train"):
        check_override_keys(["--speechlm.stepz", "1"], merged)
    with pytest.raises(
        ConfigError, match=r"--speechlm\.seed: did you mean .*--speechlm_data\.seed"
    ):
        check_override_keys(["--speechlm.seed", "1"], merged)  # the key of another section
    with pytest.raises(
        ConfigError, match=r"--speechlm_dat\.seed: did you mean --speechlm_data\.seed"
    ):
        check_override_keys(["--speechlm_dat.seed", "1"], merged)  # a mistyped section
