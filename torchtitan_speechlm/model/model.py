"""SpeechLM: a decoder (a registered backbone, transformers' by default) over summed multi-stream
embeddings, with a loss head.

Input  ``inputs`` [B, T, N]: N token streams per frame (stream 0: specials, text or codebook 0;
stream k > 0: codebook k, or its pad). The input embedding is the sum of the streams' embeddings,
pads contributing zero (so a text-only frame embeds exactly like the text LM it came from).

Output head: *one shared output matrix plus a learned per-stream offset* ``stream_emb[k]`` added
to the hidden state for the audio streams k > 0 (zero-initialised; stream 0's is fixed at zero,
so the text LM inside is exactly the backbone's). We chose it over N separate heads because (a)
it can be tied to the input embedding, (b) the pretrained text head is reused unchanged for
stream 0, and
(c) each stream only computes logits over its own vocabulary slice (see VocabLayout.stream_range),
so the per-stream cost is that of N small heads anyway.

The loss is computed *inside* ``forward`` (by ``SpeechLMHead``, an FSDP unit of its own), so
FSDP2 always gathers and reduces the head's parameters: ESPnet's lm_head-outside-forward bug
cannot happen. It returns torchtitan's contract: a loss SUM (torchtitan divides by the global
count of loss frames) plus raw statistic sums for exact count-normalised logging.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.protocols import ModelProtocol

from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.audio.encoders import AudioEncoderError
from torchtitan_speechlm.model.audio.tower import AudioTower
from torchtitan_speechlm.model.chunked_loss import chunked_stream_loss
from torchtitan_speechlm.model.lora import apply_lora, base_name, is_lora_param, lora_init
from torchtitan_speechlm.model.patterns import get_pattern
from torchtitan_speechlm.model.pretrained import (
    PretrainedError,
    args_from_record,
    read_export_config,
    read_safetensors,
)
from torchtitan_speechlm.model.starting_point import load_starting_point
from torchtitan_speechlm.model.state_dict_adapter import text_tensor_map

_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """Strip activation-checkpoint / compile wrapper prefixes from a parameter name."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


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


@dataclass
class SpeechLMOutput:
    """What the model hands to the loss function: torchtitan's loss sum plus statistic sums."""

    loss_sum: torch.Tensor
    stats: dict[str, torch.Tensor]


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

    def _code_hists(
        self, pred: torch.Tensor, target: torch.Tensor, active: torch.Tensor
    ) -> torch.Tensor:
        """[2, N, C] counts of codebook j's code c among the predicted and the target vocabulary
        ids at loss positions, wherever the pattern put them (a stream's own codebook, or all of
        them in stream 0): one bincount for every stream and both kinds."""
        c, n = self.codebook_size, self.num_streams
        rel = torch.cat([pred, target]) - self.code_base
        book, code = rel.div(c + 1, rounding_mode="floor"), rel.remainder(c + 1) - 1
        keep = torch.cat([active, active]) & (rel >= 0) & (book < n) & (code >= 0)
        kind = torch.arange(rel.numel(), device=rel.device) >= pred.numel()  # 1 = target
        flat = torch.bincount((kind * (n * c) + book * c + code)[keep], minlength=2 * n * c)
        return flat.float().detach().view(2, n, c)

    def _raise_out_of_range(
        self, bad: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
    ) -> None:
        pos, k = (int(i) for i in bad.nonzero()[0])
        a, b = self.ranges[k]
        raise ValueError(
            f"target id {int(targets[pos, k])} of stream {k} (frame {pos} of the flattened "
            f"batch, loss weight {float(weights[pos, k]):g}) is outside stream {k}'s vocabulary "
            f"[{a}, {b}); {int(bad.sum())} such target(s) in this batch. The data and the "
            "model's vocabulary layout disagree: check that the datasets were prepared with this "
            "codec and tokenizer and that the targets were built with this run's vocab.json"
        )

    def forward(
        self,
        h: torch.Tensor,
        targets: torch.Tensor,
        weights: torch.Tensor,
        tied_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
            self._raise_out_of_range(bad, targets, weights)
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
        hist = self._code_hists(torch.cat(preds), torch.cat(tgts), torch.cat(actives))
        # Per-stream values stay [N] vectors (one tensor each, not N): the accumulator sums
        # them as they are and names them ce_stream0, ce_stream1, ... when it logs (stats.py).
        stats = {
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
        return loss, stats


class SpeechLM(ModelProtocol):
    """StreamEmbedding + a backbone's decoder + SpeechLMHead. Parameter names are stable DCP keys."""

    def __init__(self, args: SpeechLMModelArgs):
        super().__init__(args)
        self.args = args
        self.model_args = args
        self.family = args.family  # the backbone's adapter (not a module)
        layout = args.layout
        dim = args.hidden_size
        self.tok_embeddings = StreamEmbedding(
            layout.size, dim, [layout.stream_pad(k) for k in range(layout.num_streams)]
        )
        self.backbone = self.family.build(args.backbone_config, args.attn_implementation)
        self.head = SpeechLMHead(args, dim)
        # continuous audio input (model/audio/tower.py); None keeps a token-only model's keys
        self.audio_encoder = AudioTower(args.audio, dim) if args.audio else None

    @classmethod
    def from_pretrained(cls, path: str, device: str = "cpu", dtype: torch.dtype | None = None):
        """The SpeechLM of a folder written by ``torchtitan export`` (eval mode)."""
        cfg = read_export_config(path)
        model = build_model(args_from_record(cfg["model_args"], path), device)
        state = read_safetensors(path)
        check_keys(model, state, path)
        model.load_state_dict(state, strict=False)  # checked above; buffers are not exported
        if dtype is not None:
            model.to(dtype)
        return model.eval()

    # ---- forward ---------------------------------------------------------------------------
    def hidden_states(
        self, inputs: torch.Tensor, position_ids: torch.Tensor | None = None, **audio
    ) -> torch.Tensor:
        return self._backbone(inputs, position_ids, **audio)[0]

    def embed(
        self,
        inputs: torch.Tensor,
        audio_wave: torch.Tensor | None = None,
        audio_lengths: torch.Tensor | None = None,
        audio_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Input embeddings [B, T, D]: the streams' token embeddings, continuous segments
        replaced by the audio encoder's adaptor outputs (model/audio/tower.py)."""
        h = self.tok_embeddings(inputs)
        if self.audio_encoder is not None:
            return self.audio_encoder(h, audio_wave, audio_lengths, audio_index)
        if audio_wave is not None and audio_wave.shape[0]:
            raise ValueError(
                "the batch holds continuous audio (audio_wave) but the model has no audio "
                "encoder; set [audio_encoder] path in the config (docs/audio-encoder.md)"
            )
        return h

    def _backbone(self, inputs: torch.Tensor, position_ids: torch.Tensor | None, **audio):
        """Hidden states, and the MoE router load-balance loss (None for dense backbones)."""
        h = self.embed(inputs, **audio)
        if position_ids is None:
            position_ids = torch.arange(inputs.shape[1], device=inputs.device).expand(
                inputs.shape[0], -1
            )
        real = inputs[..., 0] != self.args.layout.pad
        return self.family.run(self.backbone, h, position_ids, real)

    def forward(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        data_stats: torch.Tensor | None = None,
        audio_wave: torch.Tensor | None = None,
        audio_lengths: torch.Tensor | None = None,
        audio_index: torch.Tensor | None = None,
        **unused: torch.Tensor,
    ) -> SpeechLMOutput | list[torch.Tensor]:
        h, aux = self._backbone(
            inputs,
            position_ids,
            audio_wave=audio_wave,
            audio_lengths=audio_lengths,
            audio_index=audio_index,
        )
        tied = self.tok_embeddings.weight if self.args.tie_embeddings else None
        if targets is None:
            return self.head.logits(h, tied)
        loss, stats = self.head(h, targets, loss_weights, tied)
        count = (loss_weights > 0).any(-1).sum().float()
        stats["count"] = count
        if aux is not None:
            # a per-frame mean, so it enters torchtitan's sum as aux * (this batch's frames)
            lb = self.args.load_balance_weight * aux.float() * count
            loss = loss + lb
            stats["load_balance_loss"] = lb.detach()
            stats["router_aux_loss"] = aux.detach().float() * count
        else:
            stats["load_balance_loss"] = torch.zeros((), device=loss.device)
        stats["loss"] = loss.detach()
        if data_stats is not None:
            stats["data_stats"] = data_stats.detach().float().sum(0)
        if self.audio_encoder is not None:  # clips the tower ran on (MFU counts them)
            clips = 0 if audio_wave is None else audio_wave.shape[0]
            stats["data/audio_clips"] = loss.new_tensor(float(clips)).float()
        return SpeechLMOutput(loss, stats)

    @torch.no_grad()
    def decode_step(
        self,
        inputs: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache,
        **audio: torch.Tensor,
    ):
        """Generation: per-stream fp32 logits of the new positions, with the backbone's KV
        cache (``None`` the first time); raises NotImplementedError for a backbone without one.
        ``audio``: the prompt's continuous segments (``embed``'s keywords)."""
        h = self.embed(inputs, **audio)
        hidden, cache = self.family.decode(self.backbone, h, position_ids, attention_mask, cache)
        tied = self.tok_embeddings.weight if self.args.tie_embeddings else None
        return self.head.logits(hidden, tied), cache

    def logits(self, inputs: torch.Tensor, position_ids: torch.Tensor | None = None, **audio):
        """Per-stream fp32 logits for every position (inference helper)."""
        return self.forward(inputs, position_ids=position_ids, **audio)

    # ---- initialisation --------------------------------------------------------------------
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Deterministic, world-size-invariant init, then pretrained weights where they exist.

        Every parameter's full value is computed on CPU from (init_seed, parameter name) and then
        sharded like the parameter, so 1 process and N processes start from identical weights.
        """
        args = self.args
        device = buffer_device or self.tok_embeddings.weight.device
        self.family.reset_buffers(self.backbone, device)
        std = args.init_std or self.family.init_std(args.backbone_config)
        # a LoRA-wrapped layer's base weight initialises (and loads) as the plain layer's
        named = [(base_name(canonical_name(n)), p) for n, p in self.named_parameters()]
        audio = {}
        if self.audio_encoder is not None:
            self.audio_encoder.reset_buffers(device)
            tower = self.audio_encoder.initial_state(std, args.init_seed, args.load_weights)
            audio = {f"audio_encoder.{k}": v for k, v in tower.items()}
            missing = [n for n, _ in named if n.startswith("audio_encoder.") and n not in audio]
            if missing:
                raise AudioEncoderError(
                    f"audio_encoder.path = {args.audio.path!r}: its weights lack {missing[:4]} "
                    f"({len(missing)} tensors); is config.json from the same checkpoint?"
                )
        start = {}
        if args.init_from:
            base = {n for n, _ in named if not is_lora_param(n)}  # adapters always start fresh
            start = load_starting_point(args, base, args.codec_hash)
        reader = self.family.weights(args.hf_assets_path) if args.load_weights else None
        # our parameter -> (its tensor in the backbone checkpoint, rows of ours it fills)
        text = (
            {
                name: (key, rows)
                for key, (name, rows) in text_tensor_map(
                    args, [n for n, _ in named if not is_lora_param(n)]
                ).items()
            }
            if reader
            else {}
        )
        with torch.no_grad():
            for name, param in named:
                full = audio.get(name)
                if full is None:
                    full = _random_init(name, param, std, args.init_seed)
                if name in text:
                    _load_pretrained(
                        full, reader, *text[name], self.family, name, args.backbone_config
                    )
                if name in start:
                    if tuple(start[name].shape) != tuple(full.shape):
                        raise ValueError(
                            f"speechlm.init_from: {name} has shape "
                            f"{tuple(start[name].shape)}, the model {tuple(full.shape)}"
                        )
                    full = start[name].float()
                _assign(param, full)


def _random_init(name: str, param: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    shape = param.shape
    if is_lora_param(name):
        return lora_init(name, shape, gen)
    if name == "head.stream_emb.weight":
        return torch.zeros(shape)
    if len(shape) == 1:
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def _load_pretrained(
    full: torch.Tensor, reader, key: str, rows: slice | None, family, name: str, config: dict
) -> None:
    """Copy checkpoint tensor ``key`` into parameter ``name``'s initial value (its text rows
    only for the embedding and head). A head missing from a tied checkpoint starts as the
    embedding."""
    if key not in reader and key == family.head_key and family.embed_key in reader:
        key = family.embed_key
    if key not in reader:
        raise KeyError(
            f"pretrained backbone {reader.directory} has no tensor {key!r} (needed for {name}); "
            "is config.json from the same checkpoint as the safetensors?"
        )
    src = family.from_checkpoint(name, reader.get(key).float(), config)
    target = full if rows is None else full[rows]
    if tuple(src.shape) != tuple(target.shape):
        raise ValueError(
            f"{key}: checkpoint shape {tuple(src.shape)} != model {tuple(target.shape)}"
        )
    target.copy_(src)


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        shard = distribute_tensor(
            full.to(param.device_mesh.device_type, param.dtype),
            param.device_mesh,
            param.placements,
            src_data_rank=None,
        )
        param.copy_(shard)
    else:
        param.copy_(full.to(param.device, param.dtype))


def build_model(args, device: str = "cpu"):
    """A SpeechLM with ``args`` on ``device``, deterministic init (weights to be loaded); with
    LoRA (``args.lora``, from a run's record) the same adapter layers as its training."""
    with torch.device("meta"):
        model = SpeechLM(args)
    if args.lora:
        apply_lora(model, args.lora)
    model.to_empty(device=device)
    model.init_weights()
    return model


def check_keys(model, state: dict, where: str, allow_missing=(), allow_unexpected=()) -> None:
    """Missing and unexpected parameter names are an error (naming them) unless a prefix in
    ``allow_missing`` / ``allow_unexpected`` covers them."""
    expected = {canonical_name(n) for n, _ in model.named_parameters()}
    missing = sorted(k for k in expected - set(state) if not k.startswith(tuple(allow_missing)))
    unexpected = sorted(
        k for k in set(state) - expected if not k.startswith(tuple(allow_unexpected))
    )
    if missing or unexpected:
        raise PretrainedError(
            f"{where}: missing {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)}), "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
            f"({len(unexpected)}); is it a checkpoint of this model?"
        )
    params = dict(model.named_parameters())
    for name, value in state.items():
        if name in params and tuple(value.shape) != tuple(params[name].shape):
            raise PretrainedError(
                f"{where}: {name} has shape {tuple(value.shape)}, the model "
                f"{tuple(params[name].shape)}"
            )
