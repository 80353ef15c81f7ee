"""A backbone read through another spelling of its path is the same backbone: transformers
records the path as given in ``_name_or_path`` (the demo's config says ``./demo_work/backbone``),
so a resume or an ``init_from`` that reaches the same backbone through an absolute path (as
`torchtitan prefer` and the benchmarks do) must not be refused; any real difference still is."""

from __future__ import annotations

import pytest

from torchtitan_speechlm.model.pretrained import PretrainedError
from torchtitan_speechlm.model.run_record import RunRecordError, check_same_model
from torchtitan_speechlm.model.starting_point import check_same

CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 400}


def args(path: str, **change) -> dict:
    return {"backbone": "hf", "backbone_config": {**CONFIG, **change, "_name_or_path": path},
            "vocab": {"text": 400}, "pattern": "delay", "tie_embeddings": False}  # fmt: skip


def test_the_path_spelling_is_not_the_model():
    old, new = args("demo_work/backbone"), args("/work/clone/demo_work/backbone")
    check_same_model({"model_args": old}, new, "R")  # a resume
    check_same({"model_args": old}, new, None, "X")  # an init_from
    other = args("/work/clone/demo_work/backbone", hidden_size=96)
    with pytest.raises(RunRecordError, match="backbone_config differs"):
        check_same_model({"model_args": old}, other, "R")
    with pytest.raises(PretrainedError, match="another backbone_config"):
        check_same({"model_args": old}, other, None, "X")
