"""Preference pairs in pipeline microbatches (distributed/pipeline.py).

torch's pipeline schedules split every tensor of a micro-batch along dim 0 into microbatches
of rows. ``pref_doc`` [B, T] (data/pairs.py) splits with the rows, but the [P, 2] tensors do
not (their dim 0 is pairs), so a pipeline carries the reference log-probs per frame
(``reference_per_frame``, trainer/trainer.py) and the last stage finds each microbatch's pairs
again from its rows' document ids (``microbatch_pairs``): a pair's two documents share a row,
so a pair is never split between microbatches.
"""

from __future__ import annotations

import torch


def reference_per_frame(doc: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """float32 [B, T]: each frame's document's reference log-prob ``ref[d // 2, d % 2]`` (NaN
    off documents or where ``ref`` has none)."""
    flat = torch.cat([ref.float().reshape(-1), ref.new_full((1,), float("nan"))])
    return flat[torch.where(doc >= 0, doc, flat.numel() - 1)]  # -1: the NaN at the end


def microbatch_pairs(
    doc: torch.Tensor, ref_frames: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A microbatch's preference tensors from its rows: (``doc`` renumbered 0..2Q-1 in the
    order of the micro-batch's pairs, ``pairs`` [Q, 2], reference log-probs [Q, 2] or None,
    the micro-batch pair number of each [Q])."""
    pair = torch.where(doc >= 0, doc // 2, -1)
    ids = torch.unique(pair[pair >= 0])  # sorted
    q = ids.numel()
    local = 2 * torch.searchsorted(ids, pair.clamp(min=0)) + doc.remainder(2)
    local = torch.where(doc >= 0, local, -1)
    pairs = torch.arange(2 * q, device=doc.device).reshape(q, 2)
    ref = None
    if ref_frames is not None:
        on = local >= 0
        ref = torch.full((2 * q,), float("nan"), device=doc.device)
        ref = ref.scatter(0, local[on], ref_frames[on].float()).reshape(q, 2)
    return local, pairs, ref, ids
