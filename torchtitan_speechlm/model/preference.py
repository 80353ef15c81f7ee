"""Preference losses (DPO, SimPO) on the head's multi-stream sequence log-probs, memory-safe.

A pair's loss depends on whole-sequence log-probs, so the loss of one row is not known until
every row of its documents is scored. Holding every row's logits until then is what the chunked
head exists to avoid (model/chunked_loss.py). Instead, two passes through the same kernel:

1. no gradient: each preference document's log-prob ``logp[d] = sum over its rows r and
   streams k of weights[r, k] * log p_k(targets[r, k])``, chunk by chunk;
2. the pair loss ``L`` on the small ``logp`` vector gives ``g[d] = dL/dlogp[d]``; the kernel
   runs again with row weights ``-g[doc[r]] * weights[r, k]`` (any sign: its gradient
   ``w_r * (softmax - onehot)`` is linear in ``w_r`` when the z-loss is off). The gradient of
   that weighted CE is ``sum_d g[d] dlogp[d]/dtheta = dL/dtheta``, computed while each chunk's
   logits exist, like the CE loss's.

Four matmuls per chunk instead of the CE loss's three; the backbone's cost is unchanged.
``weights`` are the run's loss weights (stream weights x masks, as the CE loss uses them), so
the log-probs are "summed over the streams with the run's stream weights and masks", and a
SimPO length is the sum of those weights (every loss token counted once when they are all 1,
ESPnet's normalisation by frames x streams). No z-loss: a log-prob is a log-prob.

Statistics are sums over pairs with their count ``count_pairs`` (components/stats.py divides
each by the count summed over ranks and micro-batches), named as TRL logs them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtitan_speechlm.model.chunked_loss import chunked_stream_loss
from torchtitan_speechlm.model.embedding import hold_rows, local
from torchtitan_speechlm.model.head import SpeechLMHead, out_of_range_error
from torchtitan_speechlm.model.preference_settings import DEFAULT_BETA, KINDS, PreferenceLoss  # noqa: F401


# ---- the math on sequence log-probs ------------------------------------------------------
def sigmoid_loss(z: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """``-(1 - ls) log sigmoid(z) - ls log sigmoid(-z)``: a pair's loss from its logit ``z``,
    ``ls`` the chance its label is flipped (cDPO, Mitchell 2023; SimPO's and CPO's "sigmoid"
    loss; TRL 1.16's DPO applies it in its "aot"/"robust" losses, not in "sigmoid")."""
    ls = label_smoothing
    return -(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z)


def dpo_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-pair DPO loss from summed sequence log-probs (policy and reference)."""
    z = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    return sigmoid_loss(z, label_smoothing)


def simpo_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    chosen_len: torch.Tensor,
    rejected_len: torch.Tensor,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-pair SimPO loss: length-normalised log-probs, a target margin ``gamma``, no
    reference model."""
    z = beta * (chosen / chosen_len - rejected / rejected_len) - gamma
    return sigmoid_loss(z, label_smoothing)


def pair_terms(
    settings: PreferenceLoss,
    logp: torch.Tensor,
    length: torch.Tensor,
    pairs: torch.Tensor,
    ref_logps: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses [P], rewards [P, 2], the log-probs the loss uses [P, 2] (chosen,
    rejected) and the chosen's NLL per loss token [P] from per-document ``logp`` and
    ``length`` (sum of loss weights). Rewards as TRL defines them: DPO ``beta * (logp -
    ref)``, SimPO ``beta * logp / length``; the log-probs are summed for DPO, per loss token
    for SimPO (TRL's ``logps/*`` of each). The loss includes ``nll_weight * nll`` (RPO)."""
    lp, n, b, ls = logp[pairs], length[pairs], settings.beta, settings.label_smoothing
    nll = -lp[:, 0] / n[:, 0]
    if settings.kind == "dpo":
        ref = ref_logps.to(lp.dtype)
        losses = dpo_losses(lp[:, 0], lp[:, 1], ref[:, 0], ref[:, 1], b, ls)
        rewards, logps = b * (lp - ref), lp
    else:
        losses = simpo_losses(lp[:, 0], lp[:, 1], n[:, 0], n[:, 1], b, settings.gamma, ls)
        rewards, logps = b * lp / n, lp / n
    if settings.nll_weight:
        losses = losses + settings.nll_weight * nll
    return losses, rewards, logps, nll


def pair_stats(
    losses: torch.Tensor, rewards: torch.Tensor, logps: torch.Tensor, nll: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Sums over the pairs and their count (components/stats.py normalises by ``count_pairs``
    over ranks and micro-batches): TRL's names; accuracy = the chosen's reward is higher;
    ``nll_loss`` the chosen's NLL per loss token (logged whether or not the loss weighs it)."""
    losses, rewards, logps = losses.detach(), rewards.detach(), logps.detach()
    margins = rewards[:, 0] - rewards[:, 1]
    return {
        "preference_loss": losses.sum(),
        "rewards/chosen": rewards[:, 0].sum(),
        "rewards/rejected": rewards[:, 1].sum(),
        "rewards/margins": margins.sum(),
        "rewards/accuracies": (margins > 0).float().sum(),
        "logps/chosen": logps[:, 0].sum(),
        "logps/rejected": logps[:, 1].sum(),
        "nll_loss": nll.detach().sum(),
        "count_pairs": losses.new_tensor(float(losses.numel())),
    }


# ---- the head-level loss -------------------------------------------------------------------
def preference_loss_sum(
    head: SpeechLMHead,
    h: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    doc: torch.Tensor,
    pairs: torch.Tensor,
    ref_logps: torch.Tensor | None,
    settings: PreferenceLoss,
    tied_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's summed pair loss (fp32; its value is the loss, its gradient the
    loss's, no [rows, V] logits beyond one chunk) and statistic sums.

    ``h`` [..., d] hidden states, ``targets``/``weights`` [..., N] as ``SpeechLMHead.forward``
    takes them; ``doc`` [...] int64 the preference document of each row (ids < the number of
    rows), -1 for none; ``pairs`` [P, 2] (chosen doc, rejected doc), both wholly in this
    micro-batch; ``ref_logps`` [P, 2] the reference model's log-probs of the same documents
    by ``sequence_logps`` (DPO; None for SimPO). Call it through the head's FSDP unit (its
    parameters are gathered by a call of the module, e.g. ``register_fsdp_forward_method``).
    A document's rows must all be on this rank: context parallelism, which splits them,
    would need ``logp`` summed over its group first (not done here)."""
    if settings.kind == "dpo":
        if ref_logps is None or ref_logps.shape != pairs.shape:
            raise ValueError(
                "DPO needs the reference model's log-probs of each pair (ref_logps "
                f"[P, 2] like pairs {tuple(pairs.shape)}, got "
                f"{None if ref_logps is None else tuple(ref_logps.shape)})"
            )
    w_out = local(head.output.weight if tied_weight is None else tied_weight)
    w_out = hold_rows(w_out, head.frozen_rows)
    trains = torch.is_grad_enabled() and any(
        t.requires_grad for t in (h, w_out, head.stream_emb.weight)
    )
    rows = _LossRows(head, h, targets, weights, doc, pairs)
    with torch.no_grad():
        logp = rows.logps(w_out)
    with torch.enable_grad():  # a tiny graph on the [docs] vector
        lp = logp.requires_grad_(trains)
        terms = pair_terms(settings, lp, rows.length, rows.pairs, ref_logps)
        loss = terms[0].sum()
        grad = torch.autograd.grad(loss, lp)[0] if trains else None
    stats = pair_stats(*terms)
    loss = loss.detach()
    if grad is not None:
        p2 = rows.weighted_ce(w_out, -grad)  # its gradient is the pair loss's
        loss = loss + (p2 - p2.detach())
    return loss, stats


def head_preference(
    head: SpeechLMHead,
    h: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    tied_weight: torch.Tensor | None,
    pref: dict,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``SpeechLMHead.forward``'s preference path: ``pref`` holds the batch's ``doc``,
    ``pairs``, ``ref`` (the reference log-probs, NaN where none) and ``settings``; with
    ``logps_only`` it returns the pairs' log-probs [P, 2] (and no statistics)."""
    settings, doc, pairs = pref["settings"], pref["doc"], pref["pairs"]
    if pref.get("logps_only"):
        return sequence_logps(head, h, targets, weights, doc, pairs, tied_weight), {}
    ref = pref.get("ref") if settings.kind == "dpo" else None
    if ref is not None and bool(torch.isnan(ref).any()):
        raise ValueError(
            "DPO: the batch has pairs without reference log-probs (computed before step 1 "
            "into {dump_folder}/preference_reference/: trainer/preference_reference.py)"
        )
    return preference_loss_sum(head, h, targets, weights, doc, pairs, ref, settings, tied_weight)


def sequence_logps(
    head: SpeechLMHead,
    h: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    doc: torch.Tensor,
    pairs: torch.Tensor,
    tied_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """[P, 2] the (chosen, rejected) documents' log-probs, no gradient: the reference
    model's ``ref_logps`` for ``preference_loss_sum`` (with the same weights)."""
    w_out = local(head.output.weight if tied_weight is None else tied_weight)
    rows = _LossRows(head, h, targets, weights, doc, pairs)
    with torch.no_grad():
        return rows.logps(w_out)[rows.pairs]


class _LossRows:
    """The loss-carrying rows of a micro-batch per stream (validated, one host sync), and the
    two passes of the chunked kernel over them."""

    def __init__(
        self,
        head: SpeechLMHead,
        h: torch.Tensor,
        targets: torch.Tensor,
        weights: torch.Tensor,
        doc: torch.Tensor,
        pairs: torch.Tensor,
    ):
        n = targets.shape[-1]
        h, targets, doc = h.flatten(0, -2), targets.reshape(-1, n), doc.reshape(-1)
        weights = weights.reshape(-1, n).float()
        self.head, self.pairs, rows = head, pairs.reshape(-1, 2), doc.numel()
        # only a document's rows with positive weight carry log-prob (as in the CE loss)
        active = (weights > 0) & (doc >= 0).unsqueeze(-1)
        weights = torch.where(active, weights, 0.0)
        d = doc.clamp(0, rows - 1)
        self.length = weights.new_zeros(rows).index_add_(0, d, weights.sum(-1))
        lo, hi = (targets.new_tensor(v) for v in zip(*head.ranges, strict=True))
        bad = active & ((targets < lo) | (targets >= hi))
        p = self.pairs.clamp(0, rows - 1)
        keep = active.any(-1)
        flags = torch.stack(
            [
                bad.any(),
                ((doc < -1) | (doc >= rows)).any(),
                ((self.pairs < 0) | (self.pairs >= rows)).any(),
                (self.pairs[:, 0] == self.pairs[:, 1]).any(),
                (self.length[p] <= 0).any(),
                keep.all(),
            ]
        )
        values = torch.cat([flags.long(), keep.sum()[None], active.sum(0)]).tolist()  # 1 sync
        checks, all_kept, kept, counts = values[:5], values[5], values[6], values[7:]
        if any(checks):
            raise bad_batch_error(head, checks, bad, targets, weights, doc, self.pairs, self.length)
        if not all_kept:
            sel = torch.nonzero_static(keep, size=max(kept, 1), fill_value=0).squeeze(-1)
            h, targets, weights, d = (t.index_select(0, sel) for t in (h, targets, weights, d))
        self.h, self.targets, self.weights, self.doc = h, targets, weights, d
        # a stream with loss on few rows projects those only (at least one: every rank's head
        # joins backward); row 0 of an all-zero stream keeps weight 0
        self.sel = [
            None
            if c >= kept // 2
            else torch.nonzero_static(weights[:, k] > 0, size=max(c, 1), fill_value=0).squeeze(-1)
            for k, c in enumerate(counts)
        ]

    def _streams(self, w_out: torch.Tensor):
        """Per stream: its input rows, output slice, target indices, weights, documents and
        rows per chunk."""
        for k, (a, b) in enumerate(self.head.ranges):
            h, t, w, d = self.h, self.targets[:, k], self.weights[:, k], self.doc
            if self.sel[k] is not None:
                h, t, w, d = (x.index_select(0, self.sel[k]) for x in (h, t, w, d))
            tgt = (t - a).clamp(0, b - a - 1)  # inactive rows: any valid index, weight 0
            yield self.head.stream_input(h, k), w_out[a:b], tgt, w, d, self.head.chunk_rows(k)

    def logps(self, w_out: torch.Tensor) -> torch.Tensor:
        """Pass 1: per-document log-probs [rows] (indexed by document id)."""
        logp = self.length.new_zeros(self.length.shape)
        for x, w, tgt, wk, d, rows in self._streams(w_out):
            ce = chunked_stream_loss(x, w, tgt, wk, 0.0, rows)[1]
            logp.index_add_(0, d, -(wk * ce))
        return logp

    def weighted_ce(self, w_out: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        """Pass 2: ``sum_rk coef[doc_r] * weights_rk * ce_rk`` with its gradient."""
        total = self.length.new_zeros(())
        for x, w, tgt, wk, d, rows in self._streams(w_out):
            total = total + chunked_stream_loss(x, w, tgt, coef[d] * wk, 0.0, rows)[0]
        return total


def bad_batch_error(
    head: SpeechLMHead,
    checks: list[int],
    bad: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    doc: torch.Tensor,
    pairs: torch.Tensor,
    length: torch.Tensor,
) -> ValueError:
    """The error for the first failed check of ``_LossRows`` (the checks' order)."""
    bad_target, bad_doc, bad_pair, same_doc, empty = checks
    rows = doc.numel()
    if bad_target:
        return out_of_range_error(head.ranges, bad, targets, weights)
    if bad_doc:
        r = int(((doc < -1) | (doc >= rows)).nonzero()[0])
        return ValueError(f"row {r} has document id {int(doc[r])}: ids are -1 or in [0, {rows})")
    if bad_pair:
        i = int(((pairs < 0) | (pairs >= rows)).any(-1).nonzero()[0])
        return ValueError(f"pair {i} {pairs[i].tolist()} names a document outside [0, {rows})")
    if same_doc:
        i = int((pairs[:, 0] == pairs[:, 1]).nonzero()[0])
        return ValueError(
            f"pair {i} has the same document {int(pairs[i, 0])} as chosen and rejected"
        )
    i = int((length[pairs] <= 0).any(-1).nonzero()[0])
    return ValueError(
        f"pair {i} {pairs[i].tolist()}: a document without loss-carrying rows in this "
        "micro-batch (both documents of a pair must be in it, with loss weight > 0)"
    )
