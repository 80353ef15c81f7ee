"""Document-masked attention without a dense mask (model/documents.py): packed rows run SDPA per
document with is_causal and no mask tensor, give each sample's logits alone (test_stream checks
that on the real loader's rows), and the same loss and gradients as transformers' dense mask."""

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
    lengths = [40, 13, 70, 5, 30]
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
    assert all(shape[0] == 2 * len(lengths) and shape[2] == max(lengths) for shape, *_ in calls)
    monkeypatch.setattr(F, "scaled_dot_product_attention", real_sdpa)
    ref = dense(x[:, :-1], targets=x[:, 1:], loss_weights=w[:, 1:], position_ids=pos[:, :-1])
    ref.loss_sum.backward()
    torch.testing.assert_close(out.loss_sum, ref.loss_sum, atol=1e-4, rtol=1e-5)
    for (n, p), (_, q) in zip(docs.named_parameters(), dense.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=n)
