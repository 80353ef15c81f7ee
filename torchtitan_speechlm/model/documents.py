"""Attention that keeps the documents of a packed row apart without an O(T^2) mask.

A packed row holds several samples, each with positions restarting at 0. transformers turns such
``position_ids`` into a dense [B, 1, T, T] block-diagonal mask for SDPA, which costs more than
plain causal attention. Here the attention of each layer runs on the row's documents regrouped
into a batch of short causal sequences ([documents, heads, longest, d], ``is_causal=True``) and
scattered back; everything else in the layer stays on the packed row. Exact (a right-padded
causal sequence does not change its real positions), and attention costs the documents' squares
instead of the row's.

Registered with transformers as the attention implementation ``"sdpa_documents"`` (the default
of ``speechlm.attn_implementation``): the backbone skips transformers' mask construction, and
any call this cannot serve (a KV-cache step, a padding mask, sliding windows) goes to
transformers' own SDPA with the mask it would have built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "sdpa_documents"


def regroup(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents of packed rows (positions restarting at 0) as rows of their own:
    (index [D, L] into the flattened [B*T] frames, valid [D, L])."""
    b, t = position_ids.shape
    starts = (position_ids == 0).flatten().nonzero().squeeze(-1)  # a row starts at 0 too
    ends = torch.cat([starts[1:], starts.new_tensor([b * t])])
    ends = torch.minimum(ends, (starts // t + 1) * t)  # a document never crosses a row
    lengths = ends - starts
    width = int(lengths.max())
    offsets = torch.arange(width, device=position_ids.device)
    index = starts[:, None] + offsets[None]
    valid = offsets[None] < lengths[:, None]
    return torch.where(valid, index, 0), valid


_last: list = [None, None]  # (position_ids, regroup of it): one computation per forward


def _regrouped(position_ids: torch.Tensor):
    if _last[0] is not position_ids:
        _last[0], _last[1] = position_ids, regroup(position_ids)
    return _last[1]


def document_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    position_ids=None,
    **kwargs,
):
    """transformers attention interface: q [B, H, T, d], k/v [B, Hkv, T, d] ->
    ([B, T, H, d], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, t, d = query.shape
    if (
        position_ids is None
        or attention_mask is not None
        or key.shape[2] != t
        or position_ids.shape != (b, t)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    index, valid = _regrouped(position_ids)
    n, width = index.shape

    def docs(x):  # [B, H', T, d] -> [D, H', L, d]
        hh = x.shape[1]
        flat = x.transpose(1, 2).reshape(b * t, hh, d)
        return flat[index].transpose(1, 2)

    q, k, v = docs(query), docs(key), docs(value)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        dropout_p=dropout,
        scale=scaling,
        is_causal=True,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    out = out.transpose(1, 2)[valid]  # [real frames, H, d], in document order
    flat = out.new_zeros(b * t, h, d).index_put((index[valid],), out)
    return flat.view(b, t, h, d), None


def document_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    attention_mask=None,
    local_size=None,
    **kwargs,
):
    """transformers' mask hook: no mask at all where ``document_attention`` keeps documents
    apart itself (a full sequence, no padding mask, no sliding window); SDPA's mask elsewhere
    (KV-cache steps, left padding in generation, sliding-window layers)."""
    from transformers.masking_utils import sdpa_mask

    if (
        q_length == kv_length
        and q_offset == 0
        and local_size is None
        and (attention_mask is None or bool(attention_mask.all()))
    ):
        return None
    return sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset,
        kv_offset,
        attention_mask=attention_mask,
        local_size=local_size,
        **kwargs,
    )


def register() -> None:
    """Make ``"sdpa_documents"`` an attention implementation of transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, document_attention)
    AttentionMaskInterface.register(NAME, document_mask)
