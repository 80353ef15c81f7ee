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
    """Classifier-free guidance on log-probabilities: uncond + scale * (cond - uncond)."""
    lc = torch.log_softmax(cond.float(), -1)
    if uncond is None or scale == 1.0:
        return lc
    lu = torch.log_softmax(uncond.float(), -1)
    return lu + scale * (lc - lu)


def pick(
    scores: torch.Tensor,
    allowed: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One index per row of ``scores`` [B, V], among ``allowed`` ([V] or [B, V] bool)."""
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
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
