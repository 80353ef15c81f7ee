"""Attention that keeps the documents of a packed row apart without an O(T^2) mask.

A packed row holds several samples, each with positions restarting at 0. transformers turns such
``position_ids`` into a dense [B, 1, T, T] block-diagonal mask for SDPA, which costs more than
plain causal attention. Here only the attention of each layer leaves the packed row: its
documents are gathered into a few batches of similar length (``[documents, heads, longest, d]``,
``is_causal=True``), attended, and gathered back; projections, MLP and norms stay on the packed
rows. Exact (a right-padded causal sequence does not change its real positions), and attention
costs about the documents' squares instead of the row's. Grouping by length keeps padding low
when lengths vary: one group padded to the longest document would cost ``documents x longest^2``.

Used by every backbone: registered with transformers as the attention implementation
``"sdpa_documents"`` (the default of ``speechlm.attn_implementation``), whose mask hook returns
no mask at all; any call this cannot serve (a KV-cache step, a padding mask, sliding windows)
goes to transformers' own SDPA with the mask it would have built. The native and qwen3
backbones swap it in for torchtitan's SDPA wrapper (model/backbones/native.py).

The grouping needs the document lengths on the host: one host sync point per micro-batch
(``nonzero``, then ``.tolist()`` of the lengths), made by the backbone's forward before its layers
(``HFBackbone.run`` passes the ``Documents`` to every layer's attention as a keyword; the native
and qwen3 decoders keep them per ``positions`` tensor and an attention pre-hook picks them per
call), never inside a layer. The grouped SDPA, the only code that sees the groups' variable shapes
(``attend`` here, ``DocumentSDPA`` there), is ``torch.compiler.disable``d: with per-layer
``torch.compile`` a layer is graphs of the row's fixed [B, T] shape around it, so rows whose
documents change every step do not recompile (tests/unit/model/test_compile_recompiles.py). No
state outlives a forward but the decoders' few recent ``positions`` -> ``Documents`` entries. On
GPUs, ``flex_attention`` / the native backbone's ``flex`` build a block mask instead of grouping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "sdpa_documents"
GROUP_RATIO = 1.25  # a group's documents are within this length ratio of its longest ...
SMALL = 64  # ... except that documents of up to this many frames all share one group


class Documents:
    """The documents of packed rows ([B, T] positions restarting at 0; a row start always starts
    one), grouped by length, with the indices to gather them and to put the result back."""

    def __init__(self, position_ids: torch.Tensor):
        b, t = position_ids.shape
        self.frames = b * t
        flat_pos = position_ids.reshape(-1)
        frame = torch.arange(b * t, device=position_ids.device)
        is_start = (flat_pos == 0) | (frame % t == 0)
        starts = is_start.nonzero().squeeze(-1)
        ends = torch.cat([starts[1:], starts.new_full((1,), b * t)])  # a fill: no host copy
        lengths = ends - starts
        self.one_per_row = starts.numel() == b
        doc_of = is_start.cumsum(0) - 1  # each frame's document
        offset = frame - starts[doc_of]
        # groups of similar length, longest first (host-side: read right after nonzero's)
        order = lengths.argsort(descending=True)
        sorted_lengths = lengths[order].tolist()
        self.groups: list[tuple[torch.Tensor, int, int]] = []  # (gather index, docs, width)
        slot_of_doc = torch.empty_like(lengths)
        width_of_doc = torch.empty_like(lengths)
        base, i = 0, 0
        while i < len(sorted_lengths):
            width = sorted_lengths[i]
            j = i + 1
            while j < len(sorted_lengths) and (
                sorted_lengths[j] * GROUP_RATIO >= width or width <= SMALL
            ):
                j += 1
            docs = order[i:j]
            n = j - i
            slot_of_doc[docs] = base + torch.arange(n, device=docs.device) * width
            width_of_doc[docs] = width
            offs = torch.arange(width, device=docs.device)
            real = offs[None] < lengths[docs][:, None]
            # padded slots read the document's first frame: causal attention never lets a real
            # query see a later (padded) key, and padded queries are dropped below
            index = starts[docs][:, None] + torch.where(real, offs[None], 0)
            self.groups.append((index.reshape(-1), n, width))
            base += n * width
            i = j
        self.slot = slot_of_doc[doc_of] + offset  # [B*T]: each frame's row in the groups' output
        self.widths = [w for _, _, w in self.groups]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        dropout: float = 0.0,
    ) -> torch.Tensor:
        """q [B, H, T, d], k/v [B, Hkv, T, d] (one causal sequence per document) -> [B*T, H, d]."""

        def flat(x):  # [B, H', T, d] -> [B*T, H', d]
            return x.transpose(1, 2).reshape(self.frames, x.shape[1], x.shape[3])

        if self.one_per_row:  # nothing packed: plain causal attention on the rows
            o = F.scaled_dot_product_attention(
                q,
                k,
                v,
                dropout_p=dropout,
                scale=scale,
                is_causal=True,
                enable_gqa=q.shape[1] != k.shape[1],
            )
            return flat(o)
        fq, fk, fv = flat(q), flat(k), flat(v)
        outs = []
        for index, n, width in self.groups:

            def docs(x, index=index, n=n, width=width):  # -> [n, H', width, d]
                return (
                    x.index_select(0, index).view(n, width, x.shape[1], x.shape[2]).transpose(1, 2)
                )

            o = F.scaled_dot_product_attention(
                docs(fq),
                docs(fk),
                docs(fv),
                dropout_p=dropout,
                scale=scale,
                is_causal=True,
                enable_gqa=q.shape[1] != k.shape[1],
            )
            outs.append(o.transpose(1, 2).reshape(n * width, q.shape[1], q.shape[3]))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.index_select(0, self.slot)


@torch.compiler.disable
def attend(
    documents: Documents | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    dropout: float = 0.0,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """``documents.attend(q, k, v)`` (the documents of ``positions`` when ``documents`` is None,
    computed here: one host sync per call). Never traced by dynamo: the only code that sees the
    groups' shapes, so a compiled layer is two graphs of the row's fixed shape around it."""
    if documents is None:
        documents = Documents(positions)
    return documents.attend(q, k, v, scale=scale, dropout=dropout)


def document_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    position_ids=None,
    documents: Documents | None = None,
    **kwargs,
):
    """transformers attention interface: q [B, H, T, d], k/v [B, Hkv, T, d] ->
    ([B, T, H, d], None). ``documents``: those of ``position_ids``, computed once per forward by
    the caller (``HFBackbone.run`` passes them as a keyword transformers hands every layer's
    attention); without them each call computes its own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, t, d = query.shape
    if (
        attention_mask is not None
        or key.shape[2] != t
        or (documents is None and (position_ids is None or position_ids.shape != (b, t)))
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = attend(
        documents, query, key, value, scale=scaling, dropout=dropout, positions=position_ids
    )
    return out.view(b, t, h, d), None


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
