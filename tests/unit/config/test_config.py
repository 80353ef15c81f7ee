"""Config extension: every shipped recipe parses; bad keys and values name the key and fix."""

import glob

import pytest
import tomli

from torchtitan_speechlm.config import ConfigError, check_toml
from torchtitan_speechlm.data.catalog import parse_datasets, parse_mix
from torchtitan_speechlm.data.tasks import normalised_stream_weights
from torchtitan_speechlm.trainer.plan import REGISTERED_VALUES


def merged_config_cls():
    from torchtitan.config import ConfigManager

    m = ConfigManager()
    return m._maybe_add_custom_config(
        ["--job.custom_config_module", "torchtitan_speechlm.config"], None
    )


@pytest.mark.parametrize("path", sorted(glob.glob("train_configs/*.toml")))
def test_shipped_recipes_have_only_valid_keys(path):
    with open(path, "rb") as f:
        values = tomli.load(f)
    check_toml(values, merged_config_cls(), source=path)
    assert values["model"]["name"] == "speechlm"
    assert values["job"]["custom_config_module"] == "torchtitan_speechlm.config"


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"x\.toml: unknown key `training.sequence_len`.*seq_len"):
        check_toml({"training": {"sequence_len": 3}}, merged_config_cls(), "x.toml")
    with pytest.raises(ConfigError, match="unknown key `speechlmm`.*speechlm"):
        check_toml({"speechlmm": {}}, merged_config_cls(), "x.toml")


def test_wrong_types_are_rejected():
    cls = merged_config_cls()
    with pytest.raises(ConfigError, match="speechlm.pattern"):
        check_toml(
            {"speechlm": {"pattern": "diagonal"}}, cls, "x.toml", registered=REGISTERED_VALUES
        )
    with pytest.raises(ConfigError, match="training.steps"):
        check_toml({"training": {"steps": "100"}}, cls, "x.toml")
    check_toml({"speechlm": {"stream_weights": [1, 0.5]}, "training": {"steps": 3}}, cls, "x")


def test_dataset_and_mixture_specs():
    names = parse_datasets(["a=/x", "b=/y"])
    mix = parse_mix(["tts:a:0.7", "asr:b"], "train", names)
    assert [(m.task, m.dataset, m.weight) for m in mix] == [("tts", "a", 0.7), ("asr", "b", 1.0)]
    with pytest.raises(ConfigError, match="NAME=PATH"):
        parse_datasets(["nopath"])
    with pytest.raises(ConfigError, match="no dataset named 'c'"):
        parse_mix(["tts:c"], "train", names)
    with pytest.raises(ConfigError, match="unknown task 'tss'"):
        parse_mix(["tss:a"], "train", names)
    with pytest.raises(ConfigError, match="weight must be > 0"):
        parse_mix(["tts:a:0"], "train", names)
    assert normalised_stream_weights([], 4) == [0.25] * 4
    assert normalised_stream_weights([3, 1], 2) == [0.75, 0.25]


def test_config_docs_are_generated_from_the_field_docstrings():
    from dataclasses import fields

    from tools.config_doc import render
    from torchtitan_speechlm.config import Checkpoint, SpeechLM, SpeechLMData
    from torchtitan_speechlm.config.field_docs import field_docs

    text = open("docs/config.md").read()
    assert render(text) == text, "run `python tools/config_doc.py`"
    for cls in (SpeechLM, SpeechLMData, Checkpoint):
        docs = field_docs(cls)
        for f in fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            assert f"| `{f.name}` |" in text


def test_spec_registration_is_idempotent():
    import importlib

    from torchtitan.protocols.train_spec import get_train_spec

    import torchtitan_speechlm

    spec = get_train_spec("speechlm")
    assert torchtitan_speechlm.register() is spec
    importlib.reload(torchtitan_speechlm)  # importing again must not raise "already registered"
    assert get_train_spec("speechlm") is spec
