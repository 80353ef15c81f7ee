"""Which items each validation set reads: never the items training sees, unless asked."""

import logging

import numpy as np
import pytest
from torchtitan.config import ConfigManager

from tests.helpers import make_tiny_run_assets, write_tiny_config
from torchtitan_speechlm.trainer.builders import train_stream, validation_sets
from torchtitan_speechlm.trainer.run import start_run


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_tiny_run_assets(tmp_path_factory.mktemp("assets"), n_items=40)


def job(assets, tmp_path, *overrides, toml_edit=("", "")):
    cfg = write_tiny_config(tmp_path / "c.toml", assets, tmp_path / "run")
    with open(cfg) as f:
        text = f.read().replace(*toml_edit)
    with open(cfg, "w") as f:
        f.write(text)
    return ConfigManager().parse_args(["--job.config_file", cfg, *overrides])


def train_items(job_config) -> set[int]:
    plan = start_run(job_config).plan
    ds = train_stream(job_config, plan, dp_rank=0, dp_world_size=1)
    return {int(i) for s in ds.sources for i in s.indices}


def valid_items(job_config, name) -> set[int]:
    sets = validation_sets(job_config, start_run(job_config), dp_rank=0, dp_world_size=1)
    return {int(i) for i in sets[name]().sources[0].indices}


def test_explicit_valid_set_of_a_training_dataset_reads_only_held_out_items(assets, tmp_path):
    jc = job(assets, tmp_path, "--speechlm_data.valid_fraction", "0.3")
    held, trained = valid_items(jc, "asr_tiny"), train_items(jc)
    assert held and trained
    assert not held & trained
    assert held | trained == set(range(40))


def test_without_hold_out_a_training_dataset_is_validated_whole_with_a_warning(
    assets, tmp_path, caplog
):
    jc = job(assets, tmp_path)
    with caplog.at_level(logging.WARNING):
        items = valid_items(jc, "asr_tiny")
    assert items == set(range(40))
    assert "also training data" in caplog.text and "valid_fraction" in caplog.text


def test_a_dataset_training_does_not_use_is_validated_whole(assets, tmp_path):
    jc = job(
        assets,
        tmp_path,
        "--speechlm_data.valid_fraction",
        "0.3",
        "--speechlm_data.datasets",
        f"tiny={assets['prepared']},other={assets['prepared']}",
        "--speechlm_data.valid",
        "asr:other",
    )
    assert valid_items(jc, "asr_other") == set(range(40))
    assert len(train_items(jc)) < 40


def test_held_out_sets_without_explicit_valid(assets, tmp_path):
    jc = job(
        assets,
        tmp_path,
        "--speechlm_data.valid_fraction",
        "0.3",
        toml_edit=('valid = ["asr:tiny"]', ""),
    )
    sets = validation_sets(jc, start_run(jc), dp_rank=0, dp_world_size=1)
    assert sorted(sets) == ["asr_tiny_heldout", "tts_tiny_heldout"]
    held = valid_items(jc, "tts_tiny_heldout")
    assert held == valid_items(jc, "asr_tiny_heldout")
    assert not held & train_items(jc)
    assert np.isclose(len(held) / 40, 0.3, atol=0.2)


def test_a_valid_fraction_that_holds_out_nothing_is_named_with_the_count_and_the_fix(
    assets, tmp_path
):
    """A validation set on the held-out part of a training dataset with a valid_fraction too
    small for it (0 of its items held out) fails before any rank starts, in one line naming
    the setting, the count, the set and the smallest fraction that holds one item out; that
    fraction does, and the one 0.001 below it does not."""
    from torchtitan_speechlm.config import ConfigError
    from torchtitan_speechlm.trainer.builders import check_data

    jc = job(assets, tmp_path, "--speechlm_data.valid_fraction", "0.0001")
    with pytest.raises(ConfigError) as e:
        check_data(jc, start_run(jc).plan)
    msg = str(e.value)
    fix = float(msg.split("raise valid_fraction to ")[1].split()[0])
    assert msg == (
        "speechlm_data.valid_fraction = 0.0001 holds out 0 of the 40 items of dataset 'tiny', "
        "so the validation set 'asr_tiny' (asr:tiny) would be empty: raise valid_fraction to "
        f"{fix:g} or more (the smallest that holds out one of its items), or validate on a "
        "dataset training does not use"
    )
    assert len(valid_items(job(assets, tmp_path, "--speechlm_data.valid_fraction", f"{fix}"),
                           "asr_tiny")) >= 1  # fmt: skip
    with pytest.raises(ConfigError, match="holds out 0 of the 40 items"):
        jc = job(assets, tmp_path, "--speechlm_data.valid_fraction", f"{fix - 0.001:g}")
        check_data(jc, start_run(jc).plan)
