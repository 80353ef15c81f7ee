"""The SpeechLM's input embedding: N token streams per frame, summed into one vector.

Input ``inputs`` [B, T, N]: N token streams per frame (stream 0: specials, text or codebook 0;
stream k > 0: codebook k, or its pad). The input embedding is the sum of the streams' embeddings,
pads contributing zero (so a text-only frame embeds exactly like the text LM it came from).

Also the two tensor helpers the output head (model/head.py) shares with the embedding: ``local``
(a replicated tensor-parallel parameter used as a plain tensor) and ``hold_rows`` (a gradient
mask over a row range, with which LoRA keeps the text rows as loaded).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """A parameter as a plain tensor: with tensor parallelism the embeddings and the head are
    replicated DTensors on the tensor-parallel mesh (distributed/parallelize.py), used locally."""
    return t.to_local() if isinstance(t, DTensor) else t


class _HoldRows(torch.autograd.Function):
    """Identity forward; backward zeroes the gradient of rows ``[a, b)``."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, a: int, b: int) -> torch.Tensor:
        ctx.rows = (a, b)
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.rows
        keep = torch.ones(grad.shape[0], 1, dtype=grad.dtype, device=grad.device)
        keep[a:b] = 0
        return grad * keep, None, None


def hold_rows(w: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    """``w`` whose rows ``rows`` get no gradient (None: all train): LoRA keeps the text rows of
    the embedding and head as loaded while the added rows train (model/lora.py)."""
    return w if rows is None or not w.requires_grad else _HoldRows.apply(w, *rows)


class StreamEmbedding(nn.Embedding):
    """Sum of the N streams' embeddings; a stream's pad contributes nothing.

    One module call for all streams, so FSDP all-gathers the table once per forward.
    """

    def __init__(self, num_embeddings: int, dim: int, stream_pads: list[int]):
        super().__init__(num_embeddings, dim)
        self.stream_pads = stream_pads
        self.frozen_rows: tuple[int, int] | None = None  # rows without gradient (LoRA)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [B, T, N]
        h, weight = None, hold_rows(local(self.weight), self.frozen_rows)
        for k, pad in enumerate(self.stream_pads):
            ids_k = ids[..., k]
            e = F.embedding(ids_k, weight) * (ids_k != pad).unsqueeze(-1).to(weight.dtype)
            h = e if h is None else h + e
        return h
