"""Cross-entropy (+ z-loss) of one stream's logits without ever holding all of them.

``logits = x @ w.T`` over a 150k text vocabulary and 8k frames is 5 GB in fp32, and autograd
keeps it (or its softmax) alive until backward. ``chunked_stream_loss`` walks the rows in chunks
whose fp32 logits fit a byte budget, and computes each chunk's gradient right away, while its
logits exist: ``d loss / d logits = w_r * ((1 + 2 z lse) * softmax - onehot)``. Backward only
scales the stored ``grad_x`` and ``grad_w`` by the incoming gradient.

Compared with recomputing each chunk in backward (activation checkpointing), this runs three
matmuls per chunk instead of four, and it accumulates the weight gradient over chunks in fp32:
with bf16 parameters the result equals one full-logits matmul (which accumulates in fp32 inside
the kernel) instead of a sum of bf16-rounded chunk gradients. Logits, log-sum-exp and softmax
are always fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _ChunkedStreamLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, targets, weights, z_weight: float, rows: int, need_grad: bool):
        n, ctx.w_dtype = x.shape[0], w.dtype
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        ce = torch.empty(n, dtype=torch.float32, device=x.device)
        lse_all = torch.empty(n, dtype=torch.float32, device=x.device)
        pred = torch.empty(n, dtype=torch.long, device=x.device)
        grad_x = torch.empty_like(x) if need_grad else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_grad else None
        for s in range(0, n, rows):
            xs, ts, ws = x[s : s + rows], targets[s : s + rows], weights[s : s + rows]
            logits = F.linear(xs, w).float()
            lse = torch.logsumexp(logits, dim=-1)
            ce_s = lse - logits.gather(-1, ts.unsqueeze(-1)).squeeze(-1)
            loss += (ws * (ce_s + z_weight * lse.square())).sum()
            ce[s : s + rows], lse_all[s : s + rows] = ce_s, lse
            pred[s : s + rows] = logits.argmax(-1)
            if need_grad:
                # softmax in place of the logits: the chunk's one [rows, V] fp32 buffer
                dlogits = logits.sub_(lse.unsqueeze(-1)).exp_()
                dlogits.mul_((ws * (1 + 2 * z_weight * lse)).unsqueeze(-1))
                dlogits.scatter_add_(-1, ts.unsqueeze(-1), -ws.unsqueeze(-1))
                d = dlogits.to(x.dtype)
                grad_x[s : s + rows] = d @ w
                grad_w += (d.t() @ xs).float()  # each chunk rounded once, summed in fp32
        if need_grad:
            ctx.save_for_backward(grad_x, grad_w)  # fp32 until scaled, then w.dtype
        ctx.mark_non_differentiable(ce, lse_all, pred)
        return loss, ce, lse_all, pred

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grad_x, grad_w = ctx.saved_tensors
        scale = grad_loss.float()
        return (grad_x * scale).to(grad_x.dtype), (grad_w * scale).to(ctx.w_dtype), *[None] * 5


def chunked_stream_loss(
    x: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    z_weight: float,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted loss sum ``sum_r weights_r * (ce_r + z_weight * lse_r^2)`` of ``x @ w.T``
    ([R, d] x [V, d], targets in [0, V)), in chunks of ``rows``. Returns (loss, ce [R], lse [R],
    argmax [R]); only the loss is differentiable (with respect to ``x`` and ``w``)."""
    need_grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    weights = weights.float()  # loss weights are always applied in fp32, whatever x's dtype
    return _ChunkedStreamLoss.apply(x, w, targets, weights, z_weight, rows, need_grad)
