"""The in-forward loss head against an independent plain-PyTorch computation."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import build_speechlm, random_batch, save_tiny_backbone


def reference(model, inputs, targets, weights, z_w):
    h = model.hidden_states(inputs)
    w_out = model.tok_embeddings.weight if model.args.tie_embeddings else model.head.output.weight
    layout = model.args.layout
    n, c = layout.num_streams, layout.codebook_size
    out = {"loss": 0.0, "ce_loss": 0.0, "z_loss": 0.0}
    out["codes_pred_hist"], out["codes_target_hist"] = torch.zeros(n, c), torch.zeros(n, c)

    def count_codes(hist, ids):  # codebook j's code i is vocabulary id layout.code(j, i)
        for j in range(n):
            rel = ids - layout.code(j, 0)
            hist[j] += torch.bincount(rel[(rel >= 0) & (rel < c)], minlength=c).float()

    for k in range(inputs.shape[-1]):
        a, b = model.args.layout.stream_range(k)
        offset = model.head.stream_emb.weight[k] if k else 0.0  # stream 0: no offset (text LM)
        logits = ((h + offset) @ w_out[a:b].T).float()
        tgt = targets[..., k] - a
        ce = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="none").view_as(tgt)
        z = z_w * torch.logsumexp(logits, -1) ** 2
        wk = weights[..., k]
        out["ce_loss"] += (wk * ce).sum()
        out["z_loss"] += (wk * z).sum()
        out[f"z_{k}"] = (wk * z).sum()
        out[f"acc_stream{k}"] = ((logits.argmax(-1) == tgt) & (wk > 0)).sum().float()
        out[f"ce_stream{k}"] = (ce * (wk > 0)).sum()
        out[f"count_stream{k}"] = (wk > 0).sum().float()
        count_codes(out["codes_pred_hist"], (logits.argmax(-1) + a)[wk > 0])
        count_codes(out["codes_target_hist"], targets[..., k][wk > 0])
    out["loss"] = out["ce_loss"] + out["z_loss"]
    return out


def assert_stream_stats_equal(stats, ref):
    """Per-stream [N] statistics and the code histograms against the reference's."""
    for name in ("acc_stream", "ce_stream", "count_stream"):
        for k in range(len(stats[name])):
            got, want = stats[name][k], ref[f"{name}{k}"].detach()
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6, msg=f"{name}{k}")
    for name in ("codes_pred_hist", "codes_target_hist"):
        assert torch.equal(stats[name], ref[name]), name
        assert ref[name].sum() > 0  # the batch has codes to count


@pytest.mark.parametrize("tie,z_w", [(False, 0.0), (False, 1e-3), (True, 1e-2)])
def test_loss_and_stats_match_plain_pytorch(tmp_path, tie, z_w):
    save_tiny_backbone(tmp_path / "bb", tie=tie)
    model = build_speechlm(tmp_path / "bb", z_loss_weight=z_w)
    # make stream embeddings non-zero so they are exercised
    with torch.no_grad():
        model.head.stream_emb.weight.normal_(0, 0.1)
    inputs, targets, weights = random_batch(model.args.layout)
    out = model(inputs, targets=targets, loss_weights=weights)
    ref = reference(model, inputs, targets, weights, z_w)
    torch.testing.assert_close(out.loss_sum, ref["loss"], atol=1e-5, rtol=1e-6)
    st = out.stats
    for key in ("ce_loss", "z_loss"):
        torch.testing.assert_close(st[key], ref[key].detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(st["z_loss_s0"], ref["z_0"].detach(), atol=1e-5, rtol=1e-6)
    mm = sum(ref[f"z_{k}"] for k in range(1, 3)).detach()
    torch.testing.assert_close(st["z_loss_mm"], mm, atol=1e-5, rtol=1e-6)
    assert_stream_stats_equal(st, ref)
    assert st["count"] == (weights > 0).any(-1).sum()


def test_chunked_loss_equals_unchunked_with_gradients(tmp_path):
    save_tiny_backbone(tmp_path / "bb")
    a = build_speechlm(tmp_path / "bb", loss_chunk_size=4096)
    b = build_speechlm(tmp_path / "bb", loss_chunk_size=7)
    inputs, targets, weights = random_batch(a.args.layout)
    la = a(inputs, targets=targets, loss_weights=weights).loss_sum
    lb = b(inputs, targets=targets, loss_weights=weights).loss_sum
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-6)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_a_target_outside_its_stream_vocabulary_is_an_error(tmp_path):
    """Carrying loss, it raises naming stream and id (it used to be clamped into range and
    trained on silently); without loss weight it is ignored."""
    save_tiny_backbone(tmp_path / "bb")
    model = build_speechlm(tmp_path / "bb")
    layout = model.args.layout
    inputs, targets, weights = random_batch(layout)
    a, b = layout.stream_range(2)
    targets[1, 5, 2] = b  # the first id of the next stream
    weights[1, 5, 2] = 0.0
    model(inputs, targets=targets, loss_weights=weights)  # no loss there: fine
    weights[1, 5, 2] = 0.5
    with pytest.raises(ValueError, match=rf"target id {b} of stream 2 .* \[{a}, {b}\)"):
        model(inputs, targets=targets, loss_weights=weights)
    targets[1, 5, 2] = -3
    with pytest.raises(ValueError, match="target id -3 of stream 2"):
        model(inputs, targets=targets, loss_weights=weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_bounded_chunks_equal_plain_pytorch_loss_and_gradients(tmp_path, dtype):
    """loss_chunk_mb splits each stream by its own vocabulary size (here the text stream into
    chunks of a few rows, the codebooks into longer ones); loss and every gradient equal the
    full-logits computation, also with bf16 parameters (fp32 logits and softmax)."""
    save_tiny_backbone(tmp_path / "bb")
    mb = 6 * 4 * 300 / 2**20  # about 6 rows of the ~300-wide text stream
    model = build_speechlm(tmp_path / "bb", loss_chunk_mb=mb, z_loss_weight=1e-3).to(dtype)
    with torch.no_grad():
        model.head.stream_emb.weight.normal_(0, 0.1)
    rows = [model.head.chunk_rows(k) for k in range(3)]
    assert rows[0] < 12 and rows[1] > rows[0], rows  # text in short chunks, codes in longer
    inputs, targets, weights = random_batch(model.args.layout, t=40)
    out = model(inputs, targets=targets, loss_weights=weights)
    out.loss_sum.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref = reference(model, inputs, targets, weights, 1e-3)
    ref["loss"].backward()
    # bf16: equal within two bf16 ulps of the largest value (the reference rounds too)
    tol = 1e-5 if dtype == torch.float32 else 2 * 2**-8
    assert abs(float(out.loss_sum) - float(ref["loss"])) <= tol * abs(float(ref["loss"]))
    for n, p in model.named_parameters():
        if p.grad is not None:
            scale = float(p.grad.float().abs().max())
            assert float((grads[n] - p.grad.float()).abs().max()) <= tol * scale, n


def test_streams_with_loss_on_few_frames_equal_plain_pytorch_with_gradients(tmp_path):
    """A stream with loss on under half the frames projects only those (here stream 1 has
    none at all: a text-only batch); loss, statistics and every gradient are unchanged."""
    save_tiny_backbone(tmp_path / "bb")
    model = build_speechlm(tmp_path / "bb", z_loss_weight=1e-3)
    with torch.no_grad():
        model.head.stream_emb.weight.normal_(0, 0.1)
    inputs, targets, weights = random_batch(model.args.layout, t=30)
    weights[..., 1] = 0.0
    weights[..., 2] = 0.0
    weights[0, 4:7, 2] = 0.7
    out = model(inputs, targets=targets, loss_weights=weights)
    out.loss_sum.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref = reference(model, inputs, targets, weights, 1e-3)
    ref["loss"].backward()
    torch.testing.assert_close(out.loss_sum, ref["loss"], atol=1e-5, rtol=1e-6)
    assert_stream_stats_equal(out.stats, ref)
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-5, msg=n)
