"""The ``qwen3`` backbone: torchtitan's own qwen3 ``TransformerBlock``s as the SpeechLM decoder,
dense (Qwen3) and mixture-of-experts (Qwen3-MoE: torchtitan's ``MoE``, token-choice top-k
router and ``GroupedExperts``, the modules torchtitan's expert parallelism shards).

It reads a local HF Qwen3 / Qwen3-MoE folder (config.json, optional safetensors) and reproduces
transformers' model exactly (``qwen3_args``; what torchtitan's qwen3 cannot run is refused,
naming the key): the router is softmax -> top-k -> renormalised when ``norm_topk_prob``, the
expert outputs weighted after the experts (``score_before_experts = False``), no shared experts
and no expert bias (``load_balance_coeff = None``). Which layers are MoE follows transformers
(``decoder_sparse_step``, ``mlp_only_layers``). Weight names: ``qwen3_weights.py``.

Packed rows are attended within their documents exactly like the native backbone
(``DocumentSDPA`` with SDPA, a block-causal BlockMask with ``flex``), each rotated by its own
positions. ``run`` returns transformers' load-balance auxiliary loss of Qwen3-MoE
(``load_balancing_loss_func``: E x sum_e f_e P_e, all MoE layers' real frames pooled), from the
router logits each MoE layer's gate produced in this forward; ``expert_load`` the tokens each
expert received.

Experts run torchtitan's for-loop path on CPU (exact in fp32) and its grouped GEMM on CUDA
(``torch._grouped_mm``, which torchtitan runs in bf16 whatever the parameters' dtype).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from torchtitan_speechlm.model.backbones import Backbone, kv_cache, register_backbone, rope_of
from torchtitan_speechlm.model.backbones.hf import PretrainedWeights, load_hf_config
from torchtitan_speechlm.model.backbones.native import (
    DocumentsInFlight,
    document_block_mask,
    use_document_attention,
)
from torchtitan_speechlm.model.backbones.qwen3_weights import hf_key
from torchtitan_speechlm.utils.upstream import (
    MoEArgs,
    Qwen3Block,
    Qwen3ModelArgs,
    precompute_rope_cache,
    qwen3_apply_rotary_emb,
)

MODEL_TYPES = ("qwen3", "qwen3_moe")


def _refuse(key: str, value, why: str) -> ValueError:
    return ValueError(f"qwen3 backbone: config.json {key} = {value!r}: {why}; use the hf backbone")


def num_experts(config: dict) -> int:
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map)
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def moe_layer_ids(config: dict) -> list[int]:
    """The MoE layers, transformers' rule: every ``decoder_sparse_step``-th layer (1-based)
    that ``mlp_only_layers`` does not list."""
    if config.get("model_type") != "qwen3_moe" or not num_experts(config):
        return []
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    n = int(config["num_hidden_layers"])
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def _rope_theta(config: dict) -> float:
    rope = rope_of(config)
    if rope["rope_type"] != "default":
        raise _refuse(
            "rope_parameters.rope_type", rope["rope_type"], "only unscaled RoPE is supported"
        )
    return float(rope["rope_theta"])


def qwen3_args(config: dict, attn_implementation: str = "sdpa") -> Qwen3ModelArgs:
    """torchtitan's qwen3 args reproducing an HF Qwen3 / Qwen3-MoE config exactly (the MoE
    settings apply to the layers ``moe_layer_ids`` names; ``moe_enabled`` is set per layer)."""
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise _refuse("model_type", kind, f"the qwen3 backbone runs {MODEL_TYPES}")
    if config.get("use_sliding_window") or any(
        t != "full_attention" for t in config.get("layer_types") or []
    ):
        raise _refuse("use_sliding_window", True, "sliding-window attention is not supported")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise _refuse(key, config[key], "biases are not supported")
    if float(config.get("attention_dropout") or 0.0):
        raise _refuse("attention_dropout", config["attention_dropout"], "must be 0")
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", config["hidden_act"], "torchtitan's qwen3 MLP is SiLU")
    if config.get("shared_expert_intermediate_size"):
        raise _refuse(
            "shared_expert_intermediate_size",
            config["shared_expert_intermediate_size"],
            "Qwen3-MoE has no shared experts",
        )
    dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    experts = num_experts(config)
    moe = MoEArgs(
        num_experts=max(experts, 1),
        num_shared_experts=0,
        score_func="softmax",
        route_norm=bool(config.get("norm_topk_prob", False)),
        route_scale=1.0,
        score_before_experts=False,
        top_k=int(config.get("num_experts_per_tok") or 1),
        use_grouped_mm=False,  # the decoder picks per device (``_use_grouped_mm``)
        load_balance_coeff=None,  # no expert bias: transformers' router has none
    )
    return Qwen3ModelArgs(
        dim=dim,
        n_layers=int(config["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=int(config.get("num_key_value_heads") or heads),
        vocab_size=int(config["vocab_size"]),
        head_dim=int(config.get("head_dim") or dim // heads),
        hidden_dim=int(config["intermediate_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config),
        qk_norm=True,
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        attn_type="flex" if attn_implementation in ("flex", "flex_attention") else "sdpa",
        enable_weight_tying=bool(config.get("tie_word_embeddings", False)),
        moe_enabled=bool(moe_layer_ids(config)),
        moe_inter_dim=int(config.get("moe_intermediate_size") or 0),
        moe_args=moe,
    )


class Qwen3Decoder(nn.Module):
    """torchtitan's qwen3 blocks (``layers["0".."n-1"]``, MoE where ``moe_layers`` says) and the
    final norm; no embedding, no output. Each MoE layer's router gate leaves its logits, and the
    router its token counts, in ``router_logits`` / ``expert_counts`` (layer -> the last
    forward's; a recomputation under activation checkpointing overwrites them with the same)."""

    def __init__(self, args: Qwen3ModelArgs, moe_layers: list[int]):
        super().__init__()
        self.args = args
        self.moe_layers = list(moe_layers)
        self.layers = nn.ModuleDict(
            {
                str(i): Qwen3Block(i, dataclasses.replace(args, moe_enabled=i in self.moe_layers))
                for i in range(args.n_layers)
            }
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.register_buffer("rope_cache", self._rope(), persistent=False)
        self.documents = DocumentsInFlight()
        self.router_logits: dict[int, torch.Tensor] = {}
        self.expert_counts: dict[int, torch.Tensor] = {}
        self._grouped_mm: bool | None = None
        if args.attn_type == "sdpa":
            use_document_attention(self.layers.values(), self.documents)
        for i, layer in self.layers.items():
            if layer.moe_enabled:
                layer.moe.router.gate.register_forward_hook(self._keep(self.router_logits, i))
                layer.moe.router.register_forward_hook(self._keep(self.expert_counts, i, 2))

    @staticmethod
    def _keep(store: dict, layer: str, index: int | None = None):
        def hook(module, args, output):
            store[int(layer)] = output if index is None else output[index]

        return hook

    def _rope(self) -> torch.Tensor:
        a = self.args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta)

    def _use_grouped_mm(self, on: bool) -> None:
        """torchtitan's grouped GEMM for the experts on CUDA, its exact for-loop elsewhere
        (``torch._grouped_mm`` needs a GPU; torchtitan runs it in bf16)."""
        if self._grouped_mm is not on:
            for i in self.moe_layers:
                self.layers[str(i)].moe.experts.use_grouped_mm = on
            self._grouped_mm = on

    def forward(self, h: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, D] -> [B, T, D]; documents (positions restarting at 0) kept apart and rotated
        by their own positions; without ``position_ids`` each row is one causal sequence."""
        t = h.shape[1]
        self._use_grouped_mm(h.device.type == "cuda")
        self.router_logits.clear()
        self.expert_counts.clear()
        masks = None
        if self.args.attn_type == "flex":
            masks = document_block_mask(position_ids, t, t)
        elif position_ids is not None:
            self.documents.add(position_ids)  # grouped here, outside the compiled layers
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, masks, position_ids)
        return self.norm(h)


def load_balance_loss(
    logits: list[torch.Tensor], experts: int, top_k: int, real: torch.Tensor
) -> torch.Tensor:
    """transformers' Qwen3-MoE ``load_balancing_loss_func`` with an attention mask: E x
    sum_e f_e P_e, f_e the share of real frames routed to expert e (top-k slots summed), P_e
    its mean router probability over them, every MoE layer's frames pooled. 0 without a real
    frame (transformers: NaN)."""
    mask = real.reshape(-1).float()
    routed = torch.zeros(experts, device=mask.device)
    prob = torch.zeros(experts, device=mask.device)
    for layer in logits:
        p = torch.softmax(layer.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        routed = routed.scatter_add(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        prob = prob + (p * mask[:, None]).sum(0)
    frames = (mask.sum() * len(logits)).clamp(min=1.0)
    return experts * torch.sum((routed / frames) * (prob / frames))


class Qwen3Backbone(kv_cache.StaticCacheDecoding, Backbone):
    embed_key, head_key = "model.embed_tokens.weight", "lm_head.weight"
    tensor_parallel = False  # TODO: torchtitan's qwen3 TP plan (apply_non_moe_tp)
    expert_parallel = True

    def read_config(self, path: str) -> dict:
        config = load_hf_config(path).to_dict()
        qwen3_args(config)  # refuse what torchtitan's qwen3 cannot reproduce, early
        return config

    def moe(self, config: dict) -> tuple[int, int] | None:
        if not moe_layer_ids(config):
            return None
        return num_experts(config), int(config["num_experts_per_tok"])

    def build(self, config: dict, attn_implementation: str) -> nn.Module:
        return Qwen3Decoder(qwen3_args(config, attn_implementation), moe_layer_ids(config))

    def run(self, module, inputs_embeds, position_ids, real):
        hidden = module(inputs_embeds, position_ids)
        if not module.moe_layers:
            return hidden, None
        moe = module.args.moe_args
        logits = [module.router_logits[i] for i in module.moe_layers]
        return hidden, load_balance_loss(logits, moe.num_experts, moe.top_k, real)

    def decode(self, module, inputs_embeds, position_ids, attention_mask, cache):
        """The static KV cache of ``kv_cache.py``, MoE layers included (token-choice routing
        is per frame: a frame's experts do not depend on the others in the batch)."""
        module._use_grouped_mm(inputs_embeds.device.type == "cuda")
        module.router_logits.clear()
        module.expert_counts.clear()
        return super().decode(module, inputs_embeds, position_ids, attention_mask, cache)

    def rotary(self, module):
        return qwen3_apply_rotary_emb, module.rope_cache

    def expert_load(self, module) -> torch.Tensor | None:
        if not module.moe_layers:
            return None
        experts = module.args.moe_args.num_experts
        zero = torch.zeros(experts, device=module.rope_cache.device)
        counts = [module.expert_counts.get(i, zero) for i in module.moe_layers]
        return torch.stack([c.float() for c in counts])

    def reset_buffers(self, module, device) -> None:
        module.rope_cache = module._rope().to(device)
        for i in module.moe_layers:  # torchtitan's usage counter (its init_weights zeroes it)
            moe = module.layers[str(i)].moe
            moe.tokens_per_expert = torch.zeros(moe.experts.num_experts, device=device)

    def weights(self, path: str):
        reader = PretrainedWeights(path)
        return reader if reader else None

    def checkpoint_key(self, name: str) -> str | None:
        return hf_key(name)


register_backbone("qwen3", Qwen3Backbone())
