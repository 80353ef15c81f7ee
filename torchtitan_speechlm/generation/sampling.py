"""Choosing the next token: per-modality temperature / top-k / top-p (greedy at temperature 0),
over an allowed set only (a token of another modality or stream can never be drawn), with
classifier-free guidance mixing conditional and unconditional scores."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0


def guided(cond: torch.Tensor, uncond: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Classifier-free guidance on log-probabilities: uncond + scale * (cond - uncond). Without
    guidance the logits themselves: ``pick`` is shift-invariant (argmax, temperature, top-k,
    top-p and the softmax all give what the log-probabilities give)."""
    if uncond is None or scale == 1.0:
        return cond.float()
    lc = torch.log_softmax(cond.float(), -1)
    lu = torch.log_softmax(uncond.float(), -1)
    return lu + scale * (lc - lu)


def pick(
    scores: torch.Tensor,
    allowed: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> torch.Tensor:
    """One index per row of ``scores`` [B, V], among ``allowed`` ([V] or [B, V] bool).

    Sampling draws one uniform number per row and takes the token where the row's cumulative
    probability reaches it; with ``generator`` a list (one per row), each row's number comes
    from its own generator, so a row's draw does not depend on the rows beside it."""
    scores = scores.float().masked_fill(~allowed.expand_as(scores), float("-inf"))
    if not bool(allowed.expand_as(scores).any(-1).all()):
        raise ValueError("nothing is allowed to be sampled here")
    if sampling.temperature <= 0:
        return scores.argmax(-1)
    scores = scores / sampling.temperature
    if sampling.top_k > 0:
        kth = scores.topk(min(sampling.top_k, scores.shape[-1]), -1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = scores.sort(-1, descending=True)
        probs = sorted_scores.softmax(-1)
        drop = probs.cumsum(-1) - probs > sampling.top_p  # keep the smallest set reaching p
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    cdf = scores.softmax(-1).cumsum(-1)
    if isinstance(generator, list):
        if len(generator) != len(scores):
            raise ValueError(f"{len(generator)} generators for {len(scores)} rows")
        u = torch.cat([torch.rand(1, generator=g) for g in generator])
    else:
        u = torch.rand(len(scores), generator=generator)
    # u in (0, 1], scaled to the row's total: the first token reaching it has a probability > 0
    target = (1.0 - u)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(-1).clamp(max=scores.shape[-1] - 1)
