"""SpeechLMModelArgs: everything the model needs, resolved from the job config before building."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torchtitan.protocols import BaseModelArgs

from torchtitan_speechlm.model.vocab import VocabLayout


@dataclass
class SpeechLMModelArgs(BaseModelArgs):
    backbone: str = ""
    hf_config: dict = field(default_factory=dict)
    vocab: dict = field(default_factory=dict)
    pattern: str = "delay"
    tie_embeddings: bool = False
    load_weights: bool = True
    attn_implementation: str = "sdpa"
    init_seed: int = 0
    text_weight: float = 1.0
    audio_weight: float = 1.0
    stream_weights: list[float] = field(default_factory=list)
    z_loss_weight: float = 0.0
    load_balance_weight: float = 0.0
    loss_chunk_size: int = 4096

    # ---- derived ---------------------------------------------------------------------------
    @property
    def layout(self) -> VocabLayout:
        return VocabLayout.from_dict(self.vocab)

    def build_hf_config(self):
        from transformers import AutoConfig

        d = dict(self.hf_config)
        return AutoConfig.for_model(d.pop("model_type"), **d)

    # ---- torchtitan protocol ---------------------------------------------------------------
    def update_from_config(self, job_config, **kwargs) -> None:
        """Fill in from [speechlm] and the datasets' metadata (see config.resolve_model_args)."""
        from torchtitan_speechlm.config import resolve_model_args

        resolve_model_args(self, job_config)

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameters, and training FLOPs per frame if every frame carries loss (forward +
        backward = 3x forward); torchtitan uses it as MFU's numerator.

        Counts the decoder matmuls (6 x non-embedding, non-head params), attention scores
        (12 x layers x hidden x seq_len), and the head as it really runs: each stream's logits
        over its own vocabulary slice only (see ``head_flops_per_loss_frame``).
        """
        nparams = sum(p.numel() for p in model.parameters())
        embed = model.tok_embeddings.weight.numel()
        head = 0 if self.tie_embeddings else model.head.output.weight.numel()
        dense = nparams - embed - head - model.head.stream_emb.weight.numel()
        cfg = self.hf_config
        hidden = cfg["hidden_size"]
        layers = cfg["num_hidden_layers"]
        if cfg.get("num_experts") and cfg.get("num_experts_per_tok"):
            # MoE: only the routed experts' share of expert params is active per token.
            expert = sum(
                p.numel() for n, p in model.named_parameters() if ".experts." in n
            )
            dense -= expert - expert * cfg["num_experts_per_tok"] // cfg["num_experts"]
        flops = 6 * dense + self.head_flops_per_loss_frame() + 12 * layers * hidden * seq_len
        return nparams, flops

    def head_flops_per_loss_frame(self) -> int:
        """Training FLOPs of the output head for one frame that carries loss: it runs on those
        frames only, so the FLOPs of a step are (the above - this) x frames + this x loss
        frames (the metrics processor scales MFU by the interval's loss-frame ratio)."""
        layout = self.layout
        head_cols = sum(b - a for a, b in map(layout.stream_range, range(layout.num_streams)))
        return 6 * int(self.hf_config["hidden_size"]) * head_cols
