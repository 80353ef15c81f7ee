"""SpeechLM: a decoder (a registered backbone, transformers' by default) over summed multi-stream
embeddings, with a loss head; the module torchtitan builds (``TrainSpec.model_cls``).

embeddings (model/embedding.py) -> backbone (model/backbones/) -> head (model/head.py): the
input embedding is the sum of the N token streams' embeddings, the head one shared output
matrix plus a per-stream offset, each stream's logits over its own vocabulary slice, and the
loss computed inside ``forward`` (so FSDP2 always gathers and reduces the head). ``forward``
returns torchtitan's contract: a loss SUM plus raw statistic sums (``SpeechLMOutput``).

The initial weights (model/initialisation.py) are deterministic and world-size-invariant, then
loaded where they exist. Parameter names (``tok_embeddings.weight``, ``backbone.<...>``,
``head.output.weight``, ``head.stream_emb.weight``, ``audio_encoder.<...>``) are stable DCP and
export keys; ``canonical_name`` strips the wrappers' prefixes from them.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.audio.tower import AudioTower
from torchtitan_speechlm.model.embedding import StreamEmbedding
from torchtitan_speechlm.model.head import SpeechLMHead, SpeechLMOutput
from torchtitan_speechlm.model.initialisation import audio_tower_state, initialise_parameters
from torchtitan_speechlm.model.lora import apply_lora, base_name
from torchtitan_speechlm.model.pipeline_pairs import microbatch_pairs
from torchtitan_speechlm.model.preference import head_preference
from torchtitan_speechlm.model.pretrained import (
    PretrainedError,
    args_from_record,
    read_export_config,
    read_safetensors,
)
from torchtitan_speechlm.utils.upstream import ModelProtocol, logger

_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """Strip activation-checkpoint / compile wrapper prefixes from a parameter name."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


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
        self.stage_outputs: deque = deque()  # a last pipeline stage's (stage_forward)
        self.reference_logps: list | None = None  # a last stage's, in DPO's reference pass

    @classmethod
    def from_pretrained(cls, path: str, device: str = "cpu", dtype: torch.dtype | None = None):
        """The SpeechLM of a folder written by ``torchtitan export`` (eval mode)."""
        cfg = read_export_config(path)
        model = build_model(args_from_record(cfg["model_args"], path), device)
        state = read_safetensors(path)
        check_keys(model, state, path)
        model.load_state_dict(state, strict=False)  # checked above; buffers are not exported
        if dtype is not None:
            model.to(dtype)  # casts every buffer too: RoPE tables are recomputed in their own
            model.family.reset_buffers(model.backbone, torch.device(device))
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
        pref_doc: torch.Tensor | None = None,
        pref_pairs: torch.Tensor | None = None,
        pref_ref: torch.Tensor | None = None,
        pref_logps_only: bool = False,
        pref_ref_frames: torch.Tensor | None = None,
        **unused: torch.Tensor,
    ) -> SpeechLMOutput | list[torch.Tensor] | torch.Tensor:
        """Per-stream logits (no ``targets``), or the loss sum and statistics; a preference
        batch (``pref_doc``, ``pref_pairs``, ``pref_ref``: data/collation.py) takes the
        preference loss (model/preference.py), or with ``pref_logps_only`` returns its pairs'
        sequence log-probs [P, 2] (the reference pass, trainer/preference_reference.py). A
        pipeline stage takes ``pref_doc`` and ``pref_ref_frames`` (data/pairs.py) instead."""
        if self.is_pipeline_stage:
            return self.stage_forward(
                inputs, targets, loss_weights, position_ids, pref_doc, pref_ref_frames
            )
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
        pref = None
        if pref_doc is not None:
            pref = {"doc": pref_doc, "pairs": pref_pairs, "ref": pref_ref,
                    "logps_only": pref_logps_only}  # fmt: skip
        if pref_logps_only:
            return self.head(h, targets, loss_weights, tied, pref=self._preference(pref))[0]
        out = self._loss(h, aux, targets, loss_weights, tied, pref)
        load = self.family.expert_load(self.backbone)
        if load is not None:  # tokens routed to each expert, all MoE layers (stats.py: shares)
            out.stats["expert_tokens"] = load.detach().float().sum(0)
        if data_stats is not None:
            out.stats["data_stats"] = data_stats.detach().float().sum(0)
        if self.audio_encoder is not None:  # clips the tower ran on (MFU counts them)
            clips = 0 if audio_wave is None else audio_wave.shape[0]
            out.stats["data/audio_clips"] = out.loss_sum.new_tensor(float(clips)).float()
        return out

    def _preference(self, pref: dict | None) -> dict | None:
        """A preference batch's tensors with the run's loss settings; refused without them."""
        if pref is None:
            return None
        settings = self.args.preference_loss
        if settings is None:
            raise ValueError(
                "the batch holds preference pairs (a *_pref task) but speechlm.preference_loss "
                'is not set: set it to "dpo" or "simpo" (docs/preference.md)'
            )
        return dict(pref, settings=settings, fn=head_preference)

    def _loss(self, h, aux, targets, loss_weights, tied, pref=None) -> SpeechLMOutput:
        """The head's loss sum and statistics, and the MoE load-balance term (``aux``). A
        preference batch's loss is summed over pairs, so its normaliser ``count`` is the pairs
        (torchtitan divides by the labels it counts, one per pair: data/collation.py)."""
        loss, stats = self.head(h, targets, loss_weights, tied, pref=self._preference(pref))
        if pref is not None:
            count = stats["count_pairs"]
        else:
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
        return SpeechLMOutput(loss, stats)

    # ---- pipeline parallelism (distributed/pipeline.py) --------------------------------------
    @property
    def is_pipeline_stage(self) -> bool:
        """A pipeline stage holds some of the model: no embeddings (it receives hidden states)
        or no head (it sends them on)."""
        return self.tok_embeddings is None or self.head is None

    def stage_forward(
        self, inputs, targets, loss_weights, position_ids, pref_doc=None, pref_ref_frames=None
    ) -> torch.Tensor:
        """One pipeline stage: token frames (the first) or hidden states (the others) -> hidden
        states (all but the last), or the last stage's loss (a
        [1] tensor, the loss sum, whose statistics ``take_stage_output`` hands the schedule's
        loss function: torch's schedules exchange fixed shapes, a statistics vector has none).
        A preference microbatch finds its pairs from its rows (``microbatch_pairs``); in the
        reference pass (``reference_logps`` a list) the last stage appends (its pairs'
        micro-batch numbers, their log-probs [Q, 2]) there and returns a zero loss."""
        h = inputs if self.tok_embeddings is None else self.tok_embeddings(inputs)
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).expand(h.shape[0], -1)
        h, aux = self.family.run(self.backbone, h, position_ids, None)
        if self.head is None:
            return h
        pref = None
        if pref_doc is not None:
            doc, pairs, ref, ids = microbatch_pairs(pref_doc, pref_ref_frames)
            pref = {"doc": doc, "pairs": pairs, "ref": ref}
        if self.reference_logps is not None:
            pref = dict(self._preference(pref), logps_only=True)
            logps = self.head(h, targets, loss_weights, None, pref=pref)[0]
            self.reference_logps.append((ids, logps.float()))
            loss = h.new_zeros(1, dtype=torch.float32)
            self.stage_outputs.append((loss, None))
            return loss
        out = self._loss(h, aux, targets, loss_weights, None, pref)
        loss = out.loss_sum.reshape(1)
        self.stage_outputs.append((loss, out))
        return loss

    def take_stage_output(self, loss: torch.Tensor) -> SpeechLMOutput | None:
        """The statistics of the last stage's forward that returned ``loss`` (torch's
        schedules compute each microbatch's loss right after its forward, in order)."""
        if not self.stage_outputs or self.stage_outputs[0][0] is not loss:
            raise RuntimeError(
                "pipeline schedule: a loss was computed for an output this stage did not just "
                "return; the schedule must compute each microbatch's loss after its forward"
            )
        return self.stage_outputs.popleft()[1]

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

    def select_cache_rows(self, cache, index: torch.Tensor):
        """``decode_step``'s cache of the batch rows ``index`` only (finished rows dropped);
        the given cache may be changed in place: use the one returned. Raises
        NotImplementedError for a backbone without a cache."""
        return self.family.select_rows(cache, index)

    def can_join_cache_rows(self, cache) -> bool:
        """Whether ``join_cache_rows`` can add rows to ``cache`` (this backbone's, filled)."""
        return self.family.can_join(cache)

    def join_cache_rows(self, cache, other):
        """``decode_step``'s caches of two batches as one: ``cache``'s rows, then ``other``'s,
        left-padded to the same length (requests joining a batch in progress); use the cache
        returned. Raises NotImplementedError where ``can_join_cache_rows`` is False."""
        return self.family.join_rows(cache, other)

    def drop_first_cache_slots(self, cache, n: int):
        """``cache`` without its first ``n`` slots, left padding in every row (where
        ``can_join_cache_rows``); use the cache returned."""
        return self.family.drop_first_slots(cache, n)

    def compile_decode(self, on: bool, mode: str = "default") -> bool:
        """``decode_step``'s one-frame steps under ``torch.compile`` (``on``) or eager; True when
        they are now compiled (False where the backbone has nothing to compile)."""
        return self.family.compile_decode(self.backbone, on, mode)

    def logits(self, inputs: torch.Tensor, position_ids: torch.Tensor | None = None, **audio):
        """Per-stream fp32 logits for every position (inference helper)."""
        return self.forward(inputs, position_ids=position_ids, **audio)

    # ---- initialisation --------------------------------------------------------------------
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Deterministic, world-size-invariant init, then pretrained weights where they exist.

        Every parameter's full value is computed on CPU from (init_seed, parameter name) and then
        sharded like the parameter, so 1 process and N processes start from identical weights
        (model/initialisation.py).
        """
        args = self.args
        device = buffer_device or next(self.parameters()).device  # a stage may lack embeddings
        self.family.reset_buffers(self.backbone, device)
        std = args.init_std or self.family.init_std(args.backbone_config)
        # a LoRA-wrapped layer's base weight initialises (and loads) as the plain layer's
        named = [(base_name(canonical_name(n)), p) for n, p in self.named_parameters()]
        audio = {}
        if self.audio_encoder is not None:
            audio = audio_tower_state(self.audio_encoder, args, [n for n, _ in named], std, device)
        line = initialise_parameters(named, args, self.family, std, audio)
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info(line)


def build_model(args: SpeechLMModelArgs, device: str = "cpu") -> SpeechLM:
    """A SpeechLM with ``args`` on ``device``, deterministic init (weights to be loaded); with
    LoRA (``args.lora``, from a run's record) the same adapter layers as its training."""
    with torch.device("meta"):
        model = SpeechLM(args)
    if args.lora:
        apply_lora(model, args.lora)
    model.to_empty(device=device)
    model.init_weights()
    return model


def check_keys(
    model: nn.Module,
    state: dict,
    where: str,
    allow_missing: tuple[str, ...] = (),
    allow_unexpected: tuple[str, ...] = (),
) -> None:
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
