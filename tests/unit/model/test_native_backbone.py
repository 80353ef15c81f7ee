"""The native backbone (torchtitan's llama3 blocks): the same text logits as transformers' Llama
from the same checkpoint (tied and untied), document attention within each sample (a packed row equals
each sample alone), the same loss as the hf backbone on the same batch, and a text LM export that
transformers loads with the same logits."""

import numpy as np
import pytest
import torch

from tests.helpers import (
    assert_packed_row_equals_each_sample,
    build_speechlm,
    packed_row,
    random_batch,
    save_tiny_backbone,
    text_only_inputs,
)


@pytest.mark.parametrize("tie", [False, True])
def test_text_logits_equal_transformers_llama(tmp_path, tie):
    hf = save_tiny_backbone(tmp_path / "llama", family="llama", tie=tie).eval()
    model = build_speechlm(tmp_path / "llama", backbone="native").eval()
    lay = model.args.layout
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.logits(text_only_inputs(lay, ids))[0]
        text = ours[..., lay.text_offset : lay.text_offset + lay.text_size]
        torch.testing.assert_close(text, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_native_and_hf_backbones_give_the_same_loss(tmp_path):
    save_tiny_backbone(tmp_path / "llama", family="llama")
    native = build_speechlm(tmp_path / "llama", backbone="native")
    ours = build_speechlm(tmp_path / "llama")
    inputs, targets, weights = random_batch(native.args.layout)
    a = native(inputs, targets=targets, loss_weights=weights)
    b = ours(inputs, targets=targets, loss_weights=weights)
    torch.testing.assert_close(a.loss_sum, b.loss_sum, atol=1e-4, rtol=1e-5)


def test_a_packed_row_equals_each_sample_alone(tmp_path):
    save_tiny_backbone(tmp_path / "llama", family="llama")
    model = build_speechlm(tmp_path / "llama", backbone="native").eval()
    assert_packed_row_equals_each_sample(model, [5, 11, 3, 9], seed=1)


def test_text_lm_export_of_the_native_backbone_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from torchtitan_speechlm.commands.export import save_text_lm

    save_tiny_backbone(tmp_path / "llama", family="llama")
    model = build_speechlm(tmp_path / "llama", backbone="native").eval()
    state = {n: p.detach() for n, p in model.named_parameters()}
    save_text_lm(model, state, str(tmp_path / "text"), torch.float32, 1 << 30)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "text")).eval()
    src = AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama"), dtype=torch.float32).eval()
    for (n, p), (_, q) in zip(hf.named_parameters(), src.named_parameters(), strict=True):
        assert torch.equal(p, q), n  # the permutation round-trips exactly
    assert np.isfinite(float(model.head.output.weight.sum()))


@pytest.mark.slow
def test_flex_attention_keeps_packed_documents_apart(tmp_path):
    """torchtitan's flex path with a BlockMask from the positions (forward only: torch's flex
    attention has no backward on CPU; training with it is for GPUs)."""
    save_tiny_backbone(tmp_path / "llama", family="llama")
    flex = build_speechlm(tmp_path / "llama", backbone="native", attn_implementation="flex").eval()
    sdpa = build_speechlm(tmp_path / "llama", backbone="native").eval()
    lay = flex.args.layout
    lengths = [7, 12, 4, 9]
    inputs, pos = packed_row(lay, lengths, seed=2)
    assert flex.backbone.args.attn_type == "flex" and sdpa.backbone.args.attn_type == "sdpa"
    with torch.no_grad():
        a, b = flex.logits(inputs, position_ids=pos), sdpa.logits(inputs, position_ids=pos)
        crossing = flex.logits(inputs)  # no positions: one causal sequence, documents mixed
    assert not torch.allclose(crossing[1][:, 7:], a[1][:, 7:], atol=1e-3)
    for k in range(3):
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5)
