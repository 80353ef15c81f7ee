"""The SpeechLM's output head: per-stream logits, the weighted loss and its statistics.

*One shared output matrix plus a learned per-stream offset* ``stream_emb[k]`` added to the
hidden state for the audio streams k > 0 (zero-initialised; stream 0's is fixed at zero, so the
text LM inside is exactly the backbone's). We chose it over N separate heads because (a) it can
be tied to the input embedding, (b) the pretrained text head is reused unchanged for stream 0,
and (c) each stream only computes logits over its own vocabulary slice (see
VocabLayout.stream_range), so the per-stream cost is that of N small heads anyway.

The loss is computed *inside* the model's ``forward`` (by ``SpeechLMHead``, an FSDP unit of its
own), so FSDP2 always gathers and reduces the head's parameters: ESPnet's lm_head-outside-forward
bug cannot happen. It returns torchtitan's contract: a loss SUM (torchtitan divides by the global
count of loss frames) plus raw statistic sums for exact count-normalised logging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.chunked_loss import chunked_stream_loss
from torchtitan_speechlm.model.embedding import hold_rows, local
from torchtitan_speechlm.model.patterns import get_pattern


@dataclass
class SpeechLMOutput:
    """What the model hands to the loss function: torchtitan's loss sum plus statistic sums."""

    loss_sum: torch.Tensor
    stats: dict[str, torch.Tensor]


class SpeechLMHead(nn.Module):
    """Per-stream logits on vocabulary slices, and the weighted loss with its statistics."""

    def __init__(self, args: SpeechLMModelArgs, dim: int):
        super().__init__()
        layout = args.layout
        pattern = get_pattern(args.pattern)
        # what each stream predicts: its own slice (flatten: stream 0 predicts every codebook)
        self.ranges = [pattern.prediction_range(layout, k) for k in range(layout.num_streams)]
        self.num_streams = layout.num_streams
        self.code_base = layout.stream_offset(0)  # codebook k's block: pad, then its C codes
        self.output = None if args.tie_embeddings else nn.Linear(dim, layout.size, bias=False)
        self.stream_emb = nn.Embedding(layout.num_streams, dim)
        self.z_loss_weight = args.z_loss_weight
        self.codebook_size = layout.codebook_size
        self.chunk = max(1, args.loss_chunk_size)
        self.chunk_bytes = args.loss_chunk_mb * 2**20
        self.frozen_rows: tuple[int, int] | None = None  # output rows without gradient (LoRA)

    def stream_input(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """What stream ``k``'s logits are computed from: ``h + stream_emb[k]``. Stream 0 (text
        and specials) takes ``h`` as is: its offset is fixed at zero (row 0 of ``stream_emb``
        gets no gradient), so the text LM inside is exactly the backbone's causal LM and
        exports to a plain transformers model with the same text logits."""
        return h if k == 0 else h + local(self.stream_emb.weight)[k]

    def logits(self, h: torch.Tensor, weight: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Per-stream fp32 logits [..., V_k] (for generation and tests; training uses forward)."""
        w = hold_rows(local(self.output.weight if weight is None else weight), self.frozen_rows)
        return [
            F.linear(self.stream_input(h, k), w[a:b]).float()
            for k, (a, b) in enumerate(self.ranges)
        ]

    def _stream_loss(
        self,
        h: torch.Tensor,
        w_k: torch.Tensor,
        k: int,
        targets: torch.Tensor,
        weights: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stream ``k``'s loss sum over the rows of ``h``, its stats (weighted ce, weighted z,
        ce, correct) and its predicted vocabulary ids. ``w_k`` is the stream's slice of the
        output matrix; logits are computed chunk by chunk, never all at once
        (model/chunked_loss.py)."""
        a, b = self.ranges[k]
        active = weights > 0
        # forward() verified every positive-weight target is in range; the clamp only keeps
        # gather valid at positions without loss (their value is never used)
        tgt = (targets - a).clamp(0, b - a - 1)
        x = self.stream_input(h, k)
        loss, ce, lse, pred = chunked_stream_loss(
            x, w_k, tgt, weights, self.z_loss_weight, self.chunk_rows(k)
        )
        correct = (pred == tgt) & active
        z = self.z_loss_weight * lse.square()
        stats = torch.stack(
            [(weights * ce).sum(), (weights * z).sum(), (ce * active).sum(), correct.sum().float()]
        )
        return loss, stats, pred + a

    def chunk_rows(self, k: int) -> int:
        """Rows per logits chunk of stream ``k``: at most ``loss_chunk_size``, and few enough
        that the chunk's fp32 logits stay under ``loss_chunk_mb`` (a 150k text vocabulary
        gets short chunks, a 1k codebook long ones)."""
        a, b = self.ranges[k]
        return max(1, min(self.chunk, int(self.chunk_bytes // (4 * (b - a)))))

    def forward(
        self,
        h: torch.Tensor,
        targets: torch.Tensor,
        weights: torch.Tensor,
        tied_weight: torch.Tensor | None = None,
        pref: dict | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if pref is not None:  # a preference batch: its loss (pref["fn"]) in this FSDP unit
            return pref["fn"](self, h, targets, weights, tied_weight, pref)
        w_out = local(self.output.weight if tied_weight is None else tied_weight)
        w_out = hold_rows(w_out, self.frozen_rows)
        n = targets.shape[-1]
        h, targets, weights = h.flatten(0, -2), targets.reshape(-1, n), weights.reshape(-1, n)
        # Only positions that carry loss are projected; keep >= 1 so every rank's head takes
        # part in backward (FSDP needs each rank to produce a gradient for a reduce-scatter).
        active = weights > 0
        keep = active.any(-1)
        lo, hi = (targets.new_tensor(v) for v in zip(*self.ranges, strict=True))
        bad = active & ((targets < lo) | (targets >= hi))
        per_stream = active.sum(0)
        all_kept, any_bad, kept, *counts = torch.cat(  # one host sync
            [torch.stack([keep.all(), bad.any()]).long(), keep.sum()[None], per_stream]
        ).tolist()
        if any_bad:
            raise out_of_range_error(self.ranges, bad, targets, weights)
        if not all_kept:
            # the sizes are known from the one sync above: nonzero_static needs no other
            sel = torch.nonzero_static(keep, size=max(kept, 1), fill_value=0).squeeze(-1)
            # index_select: its backward (index_add) is much cheaper than advanced indexing's
            h = h.index_select(0, sel)
            targets, weights = targets.index_select(0, sel), weights.index_select(0, sel)
        loss = h.new_zeros((), dtype=torch.float32)
        parts, preds, tgts, actives = [], [], [], []
        for k, (a, b) in enumerate(self.ranges):
            hk, tk, wk = h, targets[:, k], weights[:, k]
            if counts[k] < kept // 2:
                # a stream with loss on few frames (codebooks on text, or text-only batches):
                # project those frames only (at least one, so the head joins every backward)
                sel = torch.nonzero_static(wk > 0, size=max(counts[k], 1), fill_value=0).squeeze(-1)
                hk, tk, wk = (
                    h.index_select(0, sel),
                    tk.index_select(0, sel),
                    wk.index_select(0, sel),
                )
            part, st, pred = self._stream_loss(hk, w_out[a:b], k, tk, wk)
            loss = loss + part
            parts.append(st)
            preds.append(pred)
            tgts.append(tk)
            actives.append(wk > 0)
        st = torch.stack(parts)  # [N, 4]
        hist = code_histograms(
            torch.cat(preds),
            torch.cat(tgts),
            torch.cat(actives),
            self.code_base,
            self.codebook_size,
            self.num_streams,
        )
        return loss, head_stats(st, per_stream, hist)


def head_stats(
    st: torch.Tensor, per_stream: torch.Tensor, hist: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The head's statistic sums, named, from the per-stream ``st`` [N, 4] (weighted ce,
    weighted z, ce, correct), the loss frames per stream and the code histograms [2, N, C].

    Per-stream values stay [N] vectors (one tensor each, not N): the accumulator sums them as
    they are and names them ce_stream0, ce_stream1, ... when it logs (components/stats.py)."""
    return {
        "ce_loss": st[:, 0].sum(),
        "z_loss": st[:, 1].sum(),
        "z_loss_s0": st[0, 1],
        "z_loss_mm": st[1:, 1].sum(),
        "ce_stream": st[:, 2],
        "acc_stream": st[:, 3],
        "count_stream": per_stream.float(),
        "acc_layer0": st[0, 3],
        "codes_pred_hist": hist[0],
        "codes_target_hist": hist[1],
    }


def code_histograms(
    pred: torch.Tensor,
    target: torch.Tensor,
    active: torch.Tensor,
    code_base: int,
    codebook_size: int,
    num_streams: int,
) -> torch.Tensor:
    """[2, N, C] counts of codebook j's code c among the predicted and the target vocabulary
    ids at loss positions, wherever the pattern put them (a stream's own codebook, or all of
    them in stream 0): one bincount for every stream and both kinds. ``code_base``: the first
    id of codebook 0's block (each codebook's block: its pad, then its C codes)."""
    c, n = codebook_size, num_streams
    rel = torch.cat([pred, target]) - code_base
    book, code = rel.div(c + 1, rounding_mode="floor"), rel.remainder(c + 1) - 1
    keep = torch.cat([active, active]) & (rel >= 0) & (book < n) & (code >= 0)
    kind = torch.arange(rel.numel(), device=rel.device) >= pred.numel()  # 1 = target
    flat = torch.bincount((kind * (n * c) + book * c + code)[keep], minlength=2 * n * c)
    return flat.float().detach().view(2, n, c)


def out_of_range_error(
    ranges: list[tuple[int, int]], bad: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
) -> ValueError:
    """The error for loss-carrying targets outside their stream's vocabulary slice: ``bad``
    [frames, N] marks them, ``ranges`` holds each stream's ``[a, b)``; it names the first."""
    pos, k = (int(i) for i in bad.nonzero()[0])
    a, b = ranges[k]
    return ValueError(
        f"target id {int(targets[pos, k])} of stream {k} (frame {pos} of the flattened "
        f"batch, loss weight {float(weights[pos, k]):g}) is outside stream {k}'s vocabulary "
        f"[{a}, {b}); {int(bad.sum())} such target(s) in this batch. The data and the "
        "model's vocabulary layout disagree: check that the datasets were prepared with this "
        "codec and tokenizer and that the targets were built with this run's vocab.json"
    )
