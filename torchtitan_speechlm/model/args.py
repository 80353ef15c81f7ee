"""SpeechLMModelArgs: everything the model needs; every field is read by the model.

Built from a job config by the run plan (``from_config``: trainer/plan.py), from a run record
or an export (``pretrained.args_from_record``), or by hand."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch import nn

from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.model import families  # noqa: F401  (the built-in families register)
from torchtitan_speechlm.model.audio.tower import AudioEncoderArgs, training_flops_per_clip
from torchtitan_speechlm.model.backbones import Backbone, get_backbone
from torchtitan_speechlm.model.lora import LoraSettings
from torchtitan_speechlm.model.patterns import get_pattern
from torchtitan_speechlm.model.preference_settings import PreferenceLoss
from torchtitan_speechlm.model.vocab import VocabLayout
from torchtitan_speechlm.utils.upstream import BaseModelArgs


@dataclass
class SpeechLMModelArgs(BaseModelArgs):
    backbone: str = "hf"
    """The decoder family (a registered Backbone); fixed by the TrainSpec's flavor."""
    hf_assets_path: str = ""
    """The backbone's checkpoint folder (model.hf_assets_path): its config and weights."""
    backbone_config: dict = field(default_factory=dict)
    vocab: dict = field(default_factory=dict)
    pattern: str = "delay"
    chat_template: str = "ours"
    """How a turn ends before the next (data/template_pieces.py: ``turn_end``); read by the
    templates of training data and generation prompts."""
    tie_embeddings: bool = False
    load_weights: bool = True
    attn_implementation: str = "sdpa_documents"
    init_seed: int = 0
    init_std: float = 0.0
    init_from: str = ""
    init_from_map: list[str] = field(default_factory=list)
    init_from_allow_missing: list[str] = field(default_factory=list)
    init_from_allow_unexpected: list[str] = field(default_factory=list)
    weight_decay_exclude: list[str] = field(default_factory=list)
    """Read by the optimizer builder (components/optim.py) from the model it optimises."""
    freeze: list[str] = field(default_factory=list)
    """``speechlm.freeze``: parameter-name prefixes the parallelize and pipelining functions
    freeze (distributed/parallelize.py ``apply_freeze``), read from the model they are given."""
    z_loss_weight: float = 0.0
    load_balance_weight: float = 0.0
    loss_chunk_size: int = 4096
    loss_chunk_mb: float = 256.0
    lora: LoraSettings | None = None
    """LoRA's settings (model/lora.py ``LoraSettings``) when the run converts the model with it;
    None: none (a record's dict is read into the type: ``__post_init__``)."""
    audio_encoder: dict = field(default_factory=dict)
    """The continuous audio input (``AudioEncoderArgs.to_dict()``); empty: none."""
    preference: dict = field(default_factory=dict)
    """The preference loss's settings (``model/preference.py: PreferenceLoss`` as a dict:
    kind, beta, gamma, label_smoothing); empty: none (the CE loss)."""
    prompt_seconds: float = 0.0
    """The speaker-prompt budget of the prompted task it was trained with (``tts_prompt``,
    ``speechlm.prompt_seconds``); 0: trained without one, so generation refuses a prompt."""

    @classmethod
    def from_config(
        cls,
        speechlm,
        *,
        backbone: str,
        hf_assets_path: str,
        backbone_config: dict,
        layout: VocabLayout,
        lora: LoraSettings | None,
        audio_encoder: dict,
        prompt_seconds: float = 0.0,
    ) -> SpeechLMModelArgs:
        """The model args of a run: ``[speechlm]``'s model keys (read here, each by name) and
        what the run plan resolved (backbone, vocabulary, LoRA, audio encoder). The codec is the
        run's (its record and checkpoints' identity), not the model's."""
        for key in ("z_loss_weight", "load_balance_weight"):
            if getattr(speechlm, key) < 0:
                raise ConfigError(f"speechlm.{key} must be >= 0")
        tie = speechlm.tie_embeddings
        return cls(
            backbone=backbone,
            hf_assets_path=hf_assets_path,
            backbone_config=backbone_config,
            vocab=layout.to_dict(),
            pattern=speechlm.pattern,
            chat_template=speechlm.chat_template,
            tie_embeddings=(
                get_backbone(backbone).tie_word_embeddings(backbone_config)
                if tie == "auto"
                else tie == "true"
            ),
            load_weights=speechlm.init == "pretrained",
            attn_implementation=speechlm.attn_implementation,
            init_seed=speechlm.init_seed,
            init_std=speechlm.init_std,
            init_from=speechlm.init_from,
            init_from_map=list(speechlm.init_from_map),
            init_from_allow_missing=list(speechlm.init_from_allow_missing),
            init_from_allow_unexpected=list(speechlm.init_from_allow_unexpected),
            weight_decay_exclude=list(speechlm.weight_decay_exclude),
            freeze=list(speechlm.freeze),
            z_loss_weight=speechlm.z_loss_weight,
            load_balance_weight=speechlm.load_balance_weight,
            loss_chunk_size=speechlm.loss_chunk_size,
            loss_chunk_mb=speechlm.loss_chunk_mb,
            lora=lora,
            audio_encoder=audio_encoder,
            prompt_seconds=float(prompt_seconds),
            preference=preference_settings(speechlm),
        )

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # a run record's or export's form
            self.lora = LoraSettings.from_dict(self.lora)

    @property
    def preference_loss(self) -> PreferenceLoss | None:
        """The preference loss's settings (``PreferenceLoss``), None without one."""
        return PreferenceLoss(**self.preference) if self.preference else None

    # ---- derived ---------------------------------------------------------------------------
    @property
    def layout(self) -> VocabLayout:
        return VocabLayout.from_dict(self.vocab)

    @property
    def family(self) -> Backbone:
        return get_backbone(self.backbone)

    @property
    def audio(self) -> AudioEncoderArgs | None:
        return AudioEncoderArgs(**self.audio_encoder) if self.audio_encoder else None

    @property
    def hidden_size(self) -> int:
        return self.family.hidden_size(self.backbone_config)

    # ---- torchtitan protocol ---------------------------------------------------------------
    def update_from_config(self, job_config, **kwargs) -> None:
        """torchtitan's protocol. A run's args are complete when torchtitan's Trainer calls
        this (``from_config``, by the run plan): nothing is left to fill."""

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameters, and training FLOPs per frame if every frame carries loss (forward +
        backward = 3x forward); torchtitan uses it as MFU's numerator.

        Counts the decoder matmuls (6 x non-embedding, non-head params), attention scores
        (12 x layers x hidden x seq_len), and the head as it really runs: each stream's logits
        over its own vocabulary slice only (see ``head_flops_per_loss_frame``).

        The audio tower is left out here: it runs per clip, not per frame; the metrics
        processor adds ``audio_flops_per_clip`` x the interval's clips / frames.
        """
        nparams = sum(p.numel() for p in model.parameters())
        embed = model.tok_embeddings.weight.numel()
        head = 0 if self.tie_embeddings else model.head.output.weight.numel()
        dense = nparams - embed - head - model.head.stream_emb.weight.numel()
        if model.audio_encoder is not None:  # runs per clip: see audio_flops_per_clip
            dense -= sum(p.numel() for p in model.audio_encoder.parameters())
        moe = self.family.moe(self.backbone_config)
        if moe:
            # MoE: only the routed experts' share of expert params is active per token.
            expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
            dense -= expert - expert * moe[1] // moe[0]
        layers = self.family.num_layers(self.backbone_config)
        flops = (
            6 * dense + self.head_flops_per_loss_frame() + 12 * layers * self.hidden_size * seq_len
        )
        return nparams, flops

    def head_flops_per_loss_frame(self) -> int:
        """Training FLOPs of the output head for one frame that carries loss: it runs on those
        frames only, so the FLOPs of a step are (the above - this) x frames + this x loss
        frames (the metrics processor scales MFU by the interval's loss-frame ratio)."""
        layout, pattern = self.layout, get_pattern(self.pattern)
        head_cols = sum(
            b - a
            for a, b in (pattern.prediction_range(layout, k) for k in range(layout.num_streams))
        )
        return 6 * self.hidden_size * head_cols

    def audio_flops_per_clip(self) -> int:
        """Training FLOPs of one clip through the audio tower (``training_flops_per_clip``:
        counted on a meta-device tower, backward only where it trains); 0 without one. MFU
        adds it x the interval's clips (``data/audio_clips``) / frames."""
        audio = self.audio
        return training_flops_per_clip(audio, self.hidden_size) if audio else 0


def preference_settings(speechlm) -> dict:
    """``[speechlm]``'s preference keys as ``PreferenceLoss``'s dict (checked: a bad value is
    a ConfigError naming its key); empty when ``preference_loss`` is unset."""
    if not speechlm.preference_loss:
        return {}
    try:
        loss = PreferenceLoss(
            kind=speechlm.preference_loss,
            beta=speechlm.preference_beta,
            gamma=speechlm.simpo_gamma,
            label_smoothing=speechlm.preference_label_smoothing,
            nll_weight=speechlm.preference_nll_weight,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return dataclasses.asdict(loss)


def describe_model_args(args: dict) -> str:
    """A SpeechLM's model arguments (``SpeechLMModelArgs`` as a dict) in one line: the line a
    training log shows where torchtitan dumps them all (utils/compat.py fix 14: the whole dump
    goes to DEBUG; every argument is also in the run's ``speechlm_run.json``)."""
    try:
        cfg, vocab = args.get("backbone_config") or {}, args["vocab"]
        parts = [
            f"backbone {args['backbone']} ({cfg.get('model_type', '?')}, "
            f"{cfg.get('num_hidden_layers', '?')} layers, hidden {cfg.get('hidden_size', '?')})",
            f"vocabulary {vocab['size']} ({vocab['text_size']} text, {len(vocab['specials'])} "
            f"specials, {vocab['num_streams']} streams x {vocab['codebook_size']} codes)",
            f"pattern {args['pattern']}",
        ]
        if args.get("tie_embeddings"):
            parts.append("embedding and head tied")
    except (KeyError, TypeError, AttributeError):
        return f"{len(args)} model arguments"
    extras = {
        "LoRA rank": (args.get("lora") or {}).get("rank"),
        "audio encoder": (args.get("audio_encoder") or {}).get("path"),
        "preference loss": (args.get("preference") or {}).get("kind"),
        "init_from": args.get("init_from"),
    }
    line = ", ".join(parts + [f"{k} {v}" for k, v in extras.items() if v])
    return f"{line} (every argument: at DEBUG level, and in the dump folder's speechlm_run.json)"
