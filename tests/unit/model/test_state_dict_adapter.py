"""The HF adapter: text-only logits equal transformers' own forward of the same checkpoint."""

import pytest
import torch

from tests.helpers import build_speechlm, save_tiny_backbone, text_only_inputs


@pytest.mark.parametrize(
    "family,tie", [("qwen3", False), ("llama", False), ("qwen3", True), ("qwen2", False)]
)
def test_text_logits_match_transformers(tmp_path, family, tie):
    hf_model = save_tiny_backbone(tmp_path / "bb", family=family, tie=tie)
    hf_model.eval()
    model = build_speechlm(tmp_path / "bb")
    model.eval()
    layout = model.args.layout
    ids = torch.randint(0, layout.text_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(input_ids=ids).logits
        ours = model.logits(text_only_inputs(layout, ids))[0]
    text = slice(layout.text_offset, layout.text_offset + layout.text_size)
    torch.testing.assert_close(ours[..., text], ref, atol=1e-5, rtol=0)


def test_missing_backbone_dir_is_named(tmp_path):
    from torchtitan_speechlm.model.backbones.hf import load_hf_config

    with pytest.raises(FileNotFoundError, match="nope"):
        load_hf_config(str(tmp_path / "nope"))


def test_new_rows_are_deterministic_and_text_rows_copied(tmp_path):
    hf_model = save_tiny_backbone(tmp_path / "bb")
    a = build_speechlm(tmp_path / "bb")
    b = build_speechlm(tmp_path / "bb")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    lay = a.args.layout
    rows = a.tok_embeddings.weight[lay.text_offset : lay.text_offset + lay.text_size]
    assert torch.equal(rows, hf_model.model.embed_tokens.weight)
    assert torch.count_nonzero(a.head.stream_emb.weight) == 0


def test_config_alone_gives_a_random_init(tmp_path):
    """A backbone directory with config.json only (no safetensors): random init, no error."""
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    cfg.save_pretrained(tmp_path / "cfg_only")
    model = build_speechlm(tmp_path / "cfg_only")
    norm = model.backbone.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    q = model.backbone.layers[0].self_attn.q_proj.weight
    assert 0.01 < float(q.std()) < 0.03  # initializer_range 0.02
    ids = torch.randint(0, 96, (1, 5))
    out = model.logits(text_only_inputs(model.args.layout, ids))
    assert all(torch.isfinite(o).all() for o in out)
