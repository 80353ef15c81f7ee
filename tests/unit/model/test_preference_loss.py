"""Preference losses (DPO, SimPO) of the chunked head against an independent plain-PyTorch
computation: full logits per stream, log_softmax, per-document sums, the paper formula, autograd."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_speechlm.components.stats import StatsAccumulator
from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.head import SpeechLMHead
from torchtitan_speechlm.model.preference import (
    PreferenceLoss,
    dpo_losses,
    preference_loss_sum,
    sequence_logps,
    sigmoid_loss,
    simpo_losses,
)
from torchtitan_speechlm.model.vocab import VocabLayout

DIM = 16
# documents of different lengths, rows of no document (-1, one with loss weight), a document
# in no pair (5), one in two pairs (1); 2 x 24 rows
DOCS = [
    [-1, -1] + [0] * 7 + [1] * 9 + [4] * 6,
    [2] * 5 + [3] * 11 + [-1] * 3 + [5] * 5,
]
PAIRS = [[0, 1], [3, 2], [4, 1]]


def tiny_head(chunk: int = 5, tie: bool = False, dtype=torch.float32):
    """A head over a 3-stream layout (text slice 121 wide, codebooks 17), random weights and
    stream offsets; with ``tie`` the output matrix is a separate tensor (the embedding's)."""
    layout = VocabLayout(text_size=40, num_streams=3, codebook_size=16)
    args = SpeechLMModelArgs(vocab=layout.to_dict(), tie_embeddings=tie, loss_chunk_size=chunk)
    torch.manual_seed(0)
    head = SpeechLMHead(args, DIM)
    tied = nn.Parameter(torch.randn(layout.size, DIM) * 0.3) if tie else None
    with torch.no_grad():
        head.stream_emb.weight.normal_(0, 0.5)
        if not tie:
            head.output.weight.normal_(0, 0.3)
    head.to(dtype)
    if tied is not None:
        tied = nn.Parameter(tied.detach().to(dtype))
    return head, tied


def random_targets(head, doc: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[b, t, streams] targets, each stream's in its own vocabulary slice."""
    b, t = doc.shape
    targets = torch.empty(b, t, head.num_streams, dtype=torch.long)
    for k, (lo, hi) in enumerate(head.ranges):
        targets[..., k] = torch.randint(lo, hi, (b, t), generator=g)
    return targets


def tiny_batch(head, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    doc = torch.tensor(DOCS)
    b, t, n = *doc.shape, head.num_streams
    targets = random_targets(head, doc, g)
    weights = torch.rand(b, t, n, generator=g)
    weights[weights < 0.3] = 0.0
    weights[..., 2] *= 0.5  # a stream weight
    weights[0, :, 1] = 0.0  # stream 1 has loss on under half the rows: projects those only
    weights[0, :2] = 1.0  # loss weight outside any document: ignored
    weights[1, 6, 1] = 0.0
    targets[1, 6, 1] = -100  # no loss there: never read
    h = torch.randn(b, t, DIM, generator=g).to(dtype).requires_grad_()
    ref = -40 + 3 * torch.randn(len(PAIRS), 2, generator=g)
    return h, targets, weights, doc, torch.tensor(PAIRS), ref


def reference(head, tied, h, targets, weights, doc, pairs, ref, s: PreferenceLoss):
    """Plain PyTorch: every row's full logits, log_softmax, per-document weighted sums, the
    formula; returns (loss sum, per-pair losses, per-doc logp, per-doc length)."""
    logits = head.logits(h, tied)
    num_docs = int(doc.max()) + 1
    logp, length = [0.0] * num_docs, [0.0] * num_docs
    for k, (a, _) in enumerate(head.ranges):
        lsm = logits[k].log_softmax(-1)
        w, tgt = weights[..., k], targets[..., k]
        for d in range(num_docs):
            m = (doc == d) & (w > 0)
            lp = lsm[m].gather(-1, (tgt[m] - a).unsqueeze(-1)).squeeze(-1)
            logp[d] = logp[d] + (w[m] * lp).sum()
            length[d] = length[d] + w[m].sum()
    logp, length = torch.stack(logp), torch.stack(length)
    pc, pr = logp[pairs[:, 0]], logp[pairs[:, 1]]
    if s.kind == "dpo":
        z = s.beta * ((pc - ref[:, 0]) - (pr - ref[:, 1]))
    else:
        z = s.beta * (pc / length[pairs[:, 0]] - pr / length[pairs[:, 1]]) - s.gamma
    ls = s.label_smoothing
    losses = -(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z)
    losses = losses - s.nll_weight * pc / length[pairs[:, 0]]  # RPO: the chosen's NLL
    return losses.sum(), losses, logp, length


def grads(head, tied, h) -> dict[str, torch.Tensor]:
    w = head.output.weight if tied is None else tied
    out = {"h": h.grad, "output": w.grad, "stream_emb": head.stream_emb.weight.grad}
    out = {k: v.float().clone() for k, v in out.items()}
    for p in (h, w, head.stream_emb.weight):
        p.grad = None
    return out


SETTINGS = [
    PreferenceLoss("dpo"),
    PreferenceLoss("dpo", beta=0.3, label_smoothing=0.1),
    PreferenceLoss("dpo", nll_weight=0.7),
    PreferenceLoss("simpo"),
    PreferenceLoss("simpo", beta=2.5, gamma=1.0, label_smoothing=0.2, nll_weight=1.5),
]


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("s", SETTINGS, ids=["dpo", "dpo_ls", "dpo_nll", "simpo", "simpo_ls_nll"])
def test_loss_and_gradients_equal_plain_pytorch(s, tie):
    head, tied = tiny_head(chunk=5, tie=tie)
    h, targets, weights, doc, pairs, ref = tiny_batch(head)
    assert all(head.chunk_rows(k) < 20 for k in range(3))  # several chunks per stream
    loss, stats = preference_loss_sum(head, h, targets, weights, doc, pairs, ref, s, tied)
    loss.backward()
    got = grads(head, tied, h)
    want_loss, losses, logp, length = reference(head, tied, h, targets, weights, doc, pairs, ref, s)
    want_loss.backward()
    want = grads(head, tied, h)
    torch.testing.assert_close(loss, want_loss.detach(), atol=1e-5, rtol=1e-6)
    for name in want:
        scale = float(want[name].abs().max())
        assert scale > 0, name
        assert float((got[name] - want[name]).abs().max()) <= 1e-5 * scale, name
    # the statistics, as sums over pairs
    lp = logp.detach()[pairs]
    if s.kind == "simpo":
        lp = lp / length[pairs]
        rewards = s.beta * lp
    else:
        rewards = s.beta * (lp - ref)
    margins = rewards[:, 0] - rewards[:, 1]
    expect = {
        "preference_loss": losses.sum(),
        "rewards/chosen": rewards[:, 0].sum(),
        "rewards/rejected": rewards[:, 1].sum(),
        "rewards/margins": margins.sum(),
        "rewards/accuracies": (margins > 0).sum().float(),
        "logps/chosen": lp[:, 0].sum(),
        "logps/rejected": lp[:, 1].sum(),
        "nll_loss": -(logp / length).detach()[pairs[:, 0]].sum(),
        "count_pairs": torch.tensor(3.0),
    }
    assert set(stats) == set(expect)
    for key, value in expect.items():
        torch.testing.assert_close(stats[key], value.detach(), atol=1e-5, rtol=1e-5, msg=key)


@pytest.mark.parametrize(
    "s", [PreferenceLoss("dpo"), PreferenceLoss("simpo")], ids=["dpo", "simpo"]
)
def test_bf16_equals_plain_pytorch_at_bf16(s):
    """bf16 hidden states and weights (fp32 logits, softmax and sums): within a few bf16 ulps
    of the full-logits computation at the same precision."""
    head, _ = tiny_head(chunk=7, dtype=torch.bfloat16)
    h, targets, weights, doc, pairs, ref = tiny_batch(head, seed=1, dtype=torch.bfloat16)
    loss, _ = preference_loss_sum(head, h, targets, weights, doc, pairs, ref, s)
    loss.backward()
    got = grads(head, None, h)
    want_loss, *_ = reference(head, None, h, targets, weights, doc, pairs, ref, s)
    want_loss.backward()
    want = grads(head, None, h)
    tol = 2 * 2**-8  # two bf16 ulps of the largest value (the reference rounds too)
    loss, want_loss = float(loss.detach()), float(want_loss.detach())
    assert abs(loss - want_loss) <= tol * abs(want_loss)
    for name in want:
        scale = float(want[name].abs().max())
        assert float((got[name] - want[name]).abs().max()) <= tol * scale, name


def test_pair_formulas_by_hand():
    pc, pr, rc, rr = (torch.tensor([v], dtype=torch.float64) for v in (-10, -12, -11, -11.5))
    # DPO: -log sigmoid(beta * ((pc - rc) - (pr - rr))) = log(1 + exp(-0.1 * 1.5))
    assert math.isclose(float(dpo_losses(pc, pr, rc, rr, 0.1)), math.log1p(math.exp(-0.15)))
    z = 0.1 * 1.5
    smooth = 0.9 * math.log1p(math.exp(-z)) + 0.1 * math.log1p(math.exp(z))
    assert math.isclose(float(dpo_losses(pc, pr, rc, rr, 0.1, 0.1)), smooth, rel_tol=1e-6)
    # SimPO: -log sigmoid(beta * (pc / nc - pr / nr) - gamma), lengths 4 and 6
    nc, nr = torch.tensor([4.0], dtype=torch.float64), torch.tensor([6.0], dtype=torch.float64)
    z = 2.0 * (-10 / 4 + 12 / 6) - 0.5
    assert math.isclose(float(simpo_losses(pc, pr, nc, nr, 2.0, 0.5)), math.log1p(math.exp(-z)))
    assert math.isclose(float(sigmoid_loss(torch.tensor(0.0), 0.3)), math.log(2), rel_tol=1e-6)


def test_settings_defaults_and_bad_values():
    assert PreferenceLoss().beta == 0.1
    s = PreferenceLoss("simpo")
    assert (s.beta, s.gamma, s.label_smoothing) == (2.0, 0.5, 0.0)
    for beta in (0.0, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"speechlm\.preference_beta must be > 0"):
            PreferenceLoss("dpo", beta=beta)
    with pytest.raises(ValueError, match=r"speechlm\.preference_loss must be one of"):
        PreferenceLoss("ipo")
    with pytest.raises(ValueError, match=r"speechlm\.preference_label_smoothing"):
        PreferenceLoss("dpo", label_smoothing=0.5)
    with pytest.raises(ValueError, match=r"speechlm\.simpo_gamma"):
        PreferenceLoss("simpo", gamma=-1.0)
    with pytest.raises(ValueError, match="preference_nll_weight"):
        PreferenceLoss("dpo", nll_weight=-0.1)


def test_bad_batches_are_refused_naming_what():
    head, _ = tiny_head()
    h, targets, weights, doc, pairs, ref = tiny_batch(head)
    s = PreferenceLoss("dpo")

    def call(targets=targets, doc=doc, pairs=pairs, ref=...):
        ref = torch.zeros(pairs.shape) if ref is ... else ref
        return preference_loss_sum(head, h, targets, weights, doc, pairs, ref, s)

    with pytest.raises(ValueError, match="reference model's log-probs .* got None"):
        call(ref=None)
    with pytest.raises(ValueError, match=r"like pairs \(3, 2\), got \(2, 2\)"):
        call(ref=ref[:2])
    with pytest.raises(ValueError, match="pair 1 has the same document 3"):
        call(pairs=torch.tensor([[0, 1], [3, 3]]))
    with pytest.raises(ValueError, match=r"pair 0 \[0, 7\]: a document without loss-carrying"):
        call(pairs=torch.tensor([[0, 7]]))  # no row of document 7
    with pytest.raises(ValueError, match=r"pair 0 \[48, 1\] names a document outside"):
        call(pairs=torch.tensor([[48, 1]]))
    bad = doc.clone()
    bad[1, 3] = -2
    with pytest.raises(ValueError, match="row 27 has document id -2"):
        call(doc=bad)
    bad = targets.clone()
    bad[0, 4, 2] = head.ranges[2][1]
    weights[0, 4, 2] = 0.5
    with pytest.raises(ValueError, match="target id 155 of stream 2"):
        call(targets=bad)


def test_stats_are_exact_means_over_pairs_of_all_micro_batches():
    head, _ = tiny_head()
    s = PreferenceLoss("dpo")
    acc = StatsAccumulator()
    margins, losses = [], []
    for seed, pairs in ((0, PAIRS), (1, PAIRS[:1])):
        h, targets, weights, doc, _, ref = tiny_batch(head, seed)
        pairs, ref = torch.tensor(pairs), ref[: len(pairs)]
        _, stats = preference_loss_sum(head, h, targets, weights, doc, pairs, ref, s)
        acc.add(stats)
        _, per_pair, logp, _ = reference(head, None, h, targets, weights, doc, pairs, ref, s)
        r = s.beta * (logp.detach()[pairs] - ref)
        margins += (r[:, 0] - r[:, 1]).tolist()
        losses += per_pair.tolist()
    logged = acc.reduce()
    assert logged["preference_pairs"] == 4
    assert math.isclose(logged["rewards/margins"], sum(margins) / 4, rel_tol=1e-5)
    assert math.isclose(logged["preference_loss"], sum(losses) / 4, rel_tol=1e-5)
    assert logged["rewards/accuracies"] == sum(m > 0 for m in margins) / 4


def test_no_grad_reference_logps_and_an_empty_micro_batch():
    """Under no_grad: the loss value only (pass 1 alone); ``sequence_logps`` gives the
    reference's [P, 2]; a micro-batch without pairs still gives the head a (zero) gradient,
    as FSDP needs from every rank."""
    head, _ = tiny_head()
    h, targets, weights, doc, pairs, ref = tiny_batch(head)
    s = PreferenceLoss("simpo")
    with torch.no_grad():
        loss, _ = preference_loss_sum(head, h, targets, weights, doc, pairs, None, s)
        want, _, logp, _ = reference(head, None, h, targets, weights, doc, pairs, ref, s)
        got_logp = sequence_logps(head, h, targets, weights, doc, pairs)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(got_logp, logp[pairs], atol=1e-5, rtol=1e-6)
    loss, stats = preference_loss_sum(
        head, h, targets, weights, doc, pairs[:0], ref[:0], PreferenceLoss("dpo")
    )
    loss.backward()
    assert float(loss) == 0 and float(stats["count_pairs"]) == 0
    assert head.output.weight.grad is not None and not head.output.weight.grad.any()


def test_logits_are_never_held_beyond_one_chunk(monkeypatch):
    head, _ = tiny_head(chunk=4)
    h, targets, weights, doc, pairs, ref = tiny_batch(head)
    rows = []
    linear = F.linear

    def spy(x, w, *args):
        rows.append(x.shape[0])
        return linear(x, w, *args)

    monkeypatch.setattr(F, "linear", spy)
    loss, _ = preference_loss_sum(head, h, targets, weights, doc, pairs, ref, PreferenceLoss())
    loss.backward()
    assert rows and max(rows) <= 4, rows
