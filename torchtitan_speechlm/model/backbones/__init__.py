"""Backbones: the decoder families a SpeechLM can run on, behind one small interface.

The SpeechLM owns the multi-stream embedding and the loss head; the backbone is the decoder in
between (``inputs_embeds`` -> hidden states). A family says how its config is read from a
checkpoint folder, how the module is built and run, and where its pretrained tensors are. The
module must expose its decoder blocks as ``.layers`` (FSDP units, activation checkpointing and
per-layer compile act on them) and be built on the meta device without reading any file.

``hf`` (``hf_backbone.py``) runs transformers' own decoder stacks. Register another family with
``register_backbone`` and a spec over it with ``spec.register_speechlm_spec`` (docs/extending.md).
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan_speechlm.utils.registry import Registry


class Backbone:
    """Base class of a decoder family; subclass it and ``register_backbone(name, instance)``."""

    name = ""
    tensor_parallel = (
        False  # its module takes torchtitan's llama3 TP plan (distributed/parallelize.py)
    )
    # its module runs a subset of ``.layers`` (a ModuleDict, others deleted) and ``norm = None``
    # as a pipeline stage (distributed/pipeline.py)
    pipeline_parallel = False
    # its MoE layers are torchtitan's (``layers[i].moe_enabled``, ``.moe.experts``: what
    # torchtitan's ``apply_moe_ep_tp`` shards over an expert-parallel mesh)
    expert_parallel = False
    embed_key: str | None = None  # checkpoint tensor of the text embedding (None: no weights)
    head_key: str | None = None  # checkpoint tensor of the text output head (tied: embed_key)

    # ---- config ----------------------------------------------------------------------------
    def read_config(self, path: str) -> dict:
        """The decoder's config from a checkpoint folder (a JSON-able dict, stored in the model
        args and the run's checkpoints). Raise FileNotFoundError naming the folder if absent."""
        raise NotImplementedError

    def text_vocab_size(self, config: dict) -> int:
        return int(config["vocab_size"])

    def hidden_size(self, config: dict) -> int:
        return int(config["hidden_size"])

    def num_layers(self, config: dict) -> int:
        return int(config["num_hidden_layers"])

    def tie_word_embeddings(self, config: dict) -> bool:
        return bool(config.get("tie_word_embeddings", False))

    def init_std(self, config: dict) -> float:
        return float(config.get("initializer_range", 0.02))

    def stored_dtype(self, config: dict) -> str | None:
        """The dtype the checkpoint's weights are stored in (``dtype``, or transformers 4's
        ``torch_dtype``), e.g. ``"bfloat16"`` for every released Qwen3/Llama. It never decides
        the parameters' dtype: that is the run's ``training.dtype`` (float32 master weights by
        default, torchtitan's rule), with bf16 compute from FSDP's mixed precision."""
        value = config.get("dtype") or config.get("torch_dtype")
        return str(value).replace("torch.", "") if value else None

    def moe(self, config: dict) -> tuple[int, int] | None:
        """(experts, experts per token) of a mixture-of-experts decoder, else None."""
        return None

    def expert_load(self, module: nn.Module) -> torch.Tensor | None:
        """Tokens routed to each expert by the last forward, [MoE layers, experts] (padding
        frames included), or None (dense, or a family that does not count them)."""
        return None

    # ---- module ----------------------------------------------------------------------------
    def build(self, config: dict, attn_implementation: str) -> nn.Module:
        """The decoder module (``.layers`` = its blocks), without a token embedding."""
        raise NotImplementedError

    def run(
        self,
        module: nn.Module,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        real: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states [B, T, D], and the MoE load-balance aux loss over the ``real``
        (non-padding) frames, per frame, or None."""
        raise NotImplementedError

    def decode(
        self,
        module: nn.Module,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache,
    ) -> tuple[torch.Tensor, object]:
        """One generation step with a KV cache: hidden states of the new positions and the
        updated cache (``None`` on the first call). ``attention_mask`` [B, past + new] is 0 on
        left padding. A family without a cache raises NotImplementedError; generation then
        recomputes each sequence in full with ``run`` (slower, same tokens)."""
        raise NotImplementedError

    def select_rows(self, cache, index: torch.Tensor):
        """The cache of the batch rows ``index`` only, in that order (e.g. finished rows
        dropped from a batch); the given cache may be changed in place: use the one returned.
        The caller selects the same rows of its attention mask."""
        raise NotImplementedError

    def can_join(self, cache) -> bool:
        """Whether ``join_rows`` can join rows to this cache (asked before any row is taken
        to join it). False by default."""
        return False

    def join_rows(self, cache, other):
        """One cache of ``cache``'s rows and then ``other``'s (rows prefilled apart, joining a
        batch in progress), the shorter one left-padded to the longer one's length; the given
        caches may be changed or reused: use the one returned. The caller joins the attention
        masks the same way (``generation/incremental.py``). NotImplementedError (the default):
        the family cannot, and a batch then runs only the rows it started with."""
        raise NotImplementedError

    def drop_first_slots(self, cache, n: int):
        """The cache without its first ``n`` slots, which are left padding in every row (the
        caller drops the same columns of its attention mask): a continuous batch's rows that
        joined late are padded back to its first row's start, and once the rows before them
        have left, that padding is dropped. Where ``can_join`` is True."""
        raise NotImplementedError

    def compile_decode(self, module: nn.Module, on: bool, mode: str = "default") -> bool:
        """Run ``decode``'s one-frame steps under ``torch.compile`` (``on``) or eagerly; True
        when they are now compiled. False by default: a family whose cache changes shape every
        step (transformers' ``DynamicCache``) would compile every step again."""
        return False

    def reset_buffers(self, module: nn.Module, device: torch.device) -> None:
        """Recompute non-persistent buffers (e.g. RoPE frequencies) after meta init."""

    # ---- pretrained weights ----------------------------------------------------------------
    def weights(self, path: str):
        """A reader of the folder's tensors (``name in reader``, ``reader.get(name)``), or None
        when the folder has no weights (random init)."""
        return None

    def checkpoint_key(self, name: str) -> str | None:
        """The checkpoint tensor of our decoder parameter ``name`` (``backbone.<...>``). A key
        with ``{}`` (``STACKED``) names one tensor per index of the parameter's first dimension
        (e.g. per-expert tensors stacked into one [experts, ...] parameter): see
        ``stacked_keys``."""
        return None

    def from_checkpoint(self, name: str, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        """A checkpoint tensor in our parameter ``name``'s layout (identity unless the layouts
        differ, e.g. a permuted projection)."""
        return tensor

    def to_checkpoint(self, name: str, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        """Inverse of ``from_checkpoint``."""
        return tensor


def rope_of(config: dict) -> dict:
    """A config's RoPE settings as one dict (``rope_type``, ``rope_theta`` and the scaling's
    keys), whichever convention wrote it: transformers 5's ``rope_parameters`` (what
    ``to_dict()`` of any loaded config gives, also for a transformers 4 checkpoint) or
    transformers 4's top-level ``rope_theta`` + ``rope_scaling`` (as Llama-3 checkpoints ship).
    Families that build their own blocks read RoPE here: reading only the old keys from a
    transformers 5 dict silently gives theta 10,000 and no scaling."""
    rope = dict(config.get("rope_scaling") or {})
    rope.update(config.get("rope_parameters") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", float(config.get("rope_theta") or 10000.0))
    return rope


STACKED = "{}"


def stacked_keys(key: str, n: int) -> list[str]:
    """The checkpoint tensors behind ``key``: ``key`` itself, or for a stacked key (with
    ``{}``) the ``n`` tensors ``key.format(0)`` ... ``key.format(n - 1)``, in order."""
    return [key.format(i) for i in range(n)] if STACKED in key else [key]


def split_stacked(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """{checkpoint name: tensor}: a stacked key's tensor unbound along its first dimension."""
    if STACKED not in key:
        return {key: tensor}
    return dict(zip(stacked_keys(key, tensor.shape[0]), tensor.unbind(0), strict=True))


BACKBONES: Registry[Backbone] = Registry("backbone")


def register_backbone(name: str, backbone: Backbone) -> Backbone:
    backbone.name = name
    return BACKBONES.register(name, backbone)


def get_backbone(name: str) -> Backbone:
    return BACKBONES.get(name, "backbone")
