"""Document-masked attention without a dense mask (model/documents.py): packed rows run SDPA per
document with is_causal and no mask tensor, give each sample's logits alone (test_stream checks
that on the real loader's rows), and the same loss and gradients as transformers' dense mask."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import build_speechlm, save_tiny_backbone


def packed_batch(layout, lengths, rows=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    x = torch.stack(
        [
            torch.randint(*layout.stream_range(k), (rows, t), generator=g)
            for k in range(layout.num_streams)
        ],
        -1,
    )
    pos = torch.cat([torch.arange(n) for n in lengths]).expand(rows, -1).contiguous()
    return x, pos


def test_no_mask_tensor_and_the_same_numbers_as_the_dense_mask(tmp_path, monkeypatch):
    save_tiny_backbone(tmp_path / "bb", hidden_size=32, num_hidden_layers=2)
    docs = build_speechlm(tmp_path / "bb")
    dense = build_speechlm(tmp_path / "bb", attn_implementation="sdpa")
    lay = docs.args.layout
    lengths = [40, 13, 70, 5, 30]  # the last loses its final frame to the target shift
    x, pos = packed_batch(lay, lengths)
    w = torch.rand(*x.shape)
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((tuple(q.shape), attn_mask is None, kw.get("is_causal")))
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    out = docs(x[:, :-1], targets=x[:, 1:], loss_weights=w[:, 1:], position_ids=pos[:, :-1])
    out.loss_sum.backward()
    assert calls and all(no_mask and causal for _, no_mask, causal in calls)
    # per layer: every document of both rows once, in groups of similar length (the 70-frame
    # documents apart from the short ones), none wider than the longest document
    per_layer = [shape[0] for shape, *_ in calls]
    assert sum(per_layer) == 2 * 2 * len(lengths)  # 2 layers
    assert sorted({shape[2] for shape, *_ in calls}) == [40, 70]
    monkeypatch.setattr(F, "scaled_dot_product_attention", real_sdpa)
    ref = dense(x[:, :-1], targets=x[:, 1:], loss_weights=w[:, 1:], position_ids=pos[:, :-1])
    ref.loss_sum.backward()
    torch.testing.assert_close(out.loss_sum, ref.loss_sum, atol=1e-4, rtol=1e-5)
    for (n, p), (_, q) in zip(docs.named_parameters(), dense.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=n)


def dense_document_attention(q, k, v, pos):
    """Independent reference: SDPA with the explicit [B, 1, T, T] same-document causal mask."""
    doc = (pos == 0).cumsum(-1)
    t = pos.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    mask = (doc[:, :, None] == doc[:, None, :]) & causal
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


@pytest.mark.parametrize(
    "rows",
    [
        [[300, 2, 17, 90, 91], [1, 499, 0]],  # very unequal lengths, a 1-frame document
        [[128, 128, 128, 116], [500]],  # a row holding one document
        [[500], [500]],  # nothing packed: the plain causal path
    ],
)
def test_grouped_documents_equal_the_dense_mask_with_gradients(rows):
    from torchtitan_speechlm.model.documents import Documents

    g = torch.Generator().manual_seed(1)
    pos = torch.stack([torch.cat([torch.arange(n) for n in r if n]) for r in rows])
    b, t = pos.shape
    q = torch.randn(b, 4, t, 8, generator=g, requires_grad=True)
    k = torch.randn(b, 2, t, 8, generator=g, requires_grad=True)
    v = torch.randn(b, 2, t, 8, generator=g, requires_grad=True)
    docs = Documents(pos)
    out = docs.attend(q, k, v).view(b, t, 4, 8).transpose(1, 2)
    ref = dense_document_attention(q, k, v, pos)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, atol=2e-6, rtol=1e-5)
    widths = sorted(docs.widths)
    if len(rows[0]) > 2:  # lengths 2..499 do not share one padded width
        assert len(widths) > 1 and widths[-1] == max(max(r) for r in rows)
