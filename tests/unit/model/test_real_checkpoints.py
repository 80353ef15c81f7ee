"""Backbones as they really ship (tests/real_checkpoints.py: the config.json keys of Qwen3-0.6B,
Qwen3-1.7B, Qwen3-30B-A3B, Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-0.5B, bf16 safetensors, widths
shrunk, the real 128k/152k vocabularies) on every backbone flavor that takes them: the
parameters are float32 whatever the checkpoint stores, and the text logits equal transformers'
own model of the same folder loaded in float32 (an independent reading of the same keys: RoPE
scaling, head_dim, tied heads, MoE routing). Keys the installed transformers does not know, an
unknown model_type and contradicting dtype settings are named with the file or key."""

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import build_speechlm, text_only_inputs
from tests.real_checkpoints import save_real_backbone
from torchtitan_speechlm.config import ConfigError

CASES = [
    ("hf", "qwen3_0.6b"), ("hf", "qwen3_1.7b"), ("hf", "qwen3_30b_a3b"), ("hf", "llama3.2_1b"),
    ("hf", "llama3.1_8b"), ("hf", "qwen2.5_0.5b"),
    ("native", "llama3.2_1b"), ("native", "llama3.1_8b"),
    ("qwen3", "qwen3_0.6b"), ("qwen3", "qwen3_1.7b"), ("qwen3", "qwen3_30b_a3b"),
]  # fmt: skip


@pytest.mark.parametrize("flavor,name", CASES)
def test_float32_parameters_and_transformers_logits(tmp_path, flavor, name):
    from transformers import AutoModelForCausalLM

    shipped = save_real_backbone(tmp_path / name, name, shrink=True)
    assert (shipped.get("torch_dtype") or shipped.get("dtype")) == "bfloat16"
    model = build_speechlm(tmp_path / name, backbone=flavor).eval()
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.float32}, dtypes
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / name), dtype=torch.float32).eval()
    lay = model.args.layout
    assert lay.text_size == shipped["vocab_size"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shipped["vocab_size"], (2, 23), generator=g)
    with torch.no_grad():
        ours = model.logits(text_only_inputs(lay, ids))[0]
        text = ours[..., lay.text_offset : lay.text_offset + lay.text_size]
        torch.testing.assert_close(text, hf(input_ids=ids).logits, atol=2e-5, rtol=1e-5)


def test_unknown_config_key_is_named_with_the_file(tmp_path, caplog):
    from torchtitan_speechlm.model.backbones import get_backbone

    save_real_backbone(tmp_path / "q", "qwen3_0.6b", shrink=True, vocab_size=64)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["attention_sink_size"] = 4  # an option of some future release
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        read = get_backbone("hf").read_config(str(tmp_path / "q"))
    assert read["attention_sink_size"] == 4
    said = [r.getMessage() for r in caplog.records if "attention_sink_size" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path / "q" / "config.json") in said[0], said
    assert "torch_dtype" not in said[0] and "rope_theta" not in said[0]  # converted, known


def test_unknown_model_type_names_the_file(tmp_path):
    from torchtitan_speechlm.model.backbones.hf import load_hf_config

    save_real_backbone(tmp_path / "q", "qwen3_0.6b", shrink=True, vocab_size=64)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["model_type"] = "qwen9_next"
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"q/config.json: model_type 'qwen9_next' is unknown"):
        load_hf_config(str(tmp_path / "q"))


def _job(dtype="float32", mp="bfloat16"):
    return SimpleNamespace(
        training=SimpleNamespace(dtype=dtype, mixed_precision_param=mp, steps=10),
        checkpoint=SimpleNamespace(
            keep_latest_k=0, last_save_in_hf=False, last_save_model_only=False,
            initial_load_in_hf=False, initial_load_model_only=True, enable=True, interval=5,
        ),
    )  # fmt: skip


def test_bf16_master_weights_only_with_mixed_precision_off(tmp_path):
    from torchtitan_speechlm.model.backbones import get_backbone
    from torchtitan_speechlm.trainer.checks import check_conflicts, master_weights_note

    with pytest.raises(ConfigError, match=r"training.dtype = 'bfloat16'.*mixed_precision_param"):
        check_conflicts(_job("bfloat16", "bfloat16"))
    check_conflicts(_job("bfloat16", "float32"))
    save_real_backbone(tmp_path / "q", "qwen3_0.6b", shrink=True, vocab_size=64)
    family = get_backbone("hf")
    plan = SimpleNamespace(
        family=family,
        backbone_path=str(tmp_path / "q"),
        backbone_config=family.read_config(str(tmp_path / "q")),
    )
    note = master_weights_note(_job(), plan)
    assert "stores the weights as bfloat16" in note and "float32 master weights" in note
    assert "no float32 master copy" in master_weights_note(_job("bfloat16", "float32"), plan)
    save_real_backbone(
        tmp_path / "f", "qwen3_0.6b", shrink=True, vocab_size=64, torch_dtype="float32"
    )
    plan.backbone_config = family.read_config(str(tmp_path / "f"))
    assert master_weights_note(_job(), plan) is None
