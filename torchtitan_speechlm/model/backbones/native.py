"""The ``native`` backbone: torchtitan's own llama3 ``TransformerBlock``s as the SpeechLM decoder,
so torchtitan's own tensor-parallel plan (``apply_tp``, with sequence parallelism) shards it.

It reads a local HF Llama folder (config.json, optional safetensors) like ``hf`` does and loads
the same weights; torchtitan's rotary embedding pairs dimensions differently from transformers',
so q/k projections are permuted on the way in and out (the same permutation as torchtitan's
``Llama3StateDictAdapter``). Packed rows stay document-masked and take each sample's own
positions for RoPE (torchtitan's ``positions`` argument): with SDPA (default; CPU and GPU) each
layer's attention runs on the row's documents grouped by length (``DocumentSDPA``, the same code
as the hf backbone's ``sdpa_documents``, no mask tensor); with ``speechlm.attn_implementation =
"flex"`` (GPU: torch's flex attention has no CPU backward) torchtitan's flex path runs the rows
under a block-causal BlockMask built from the per-sample positions. With sequence parallelism
the rows are split across the tensor-parallel ranks (a padded tail is a document of its own) and
gathered back after the norm.
"""

from __future__ import annotations

import re
from collections import deque

import torch
from torch import nn

from torchtitan_speechlm.model.backbones import Backbone, kv_cache, register_backbone, rope_of
from torchtitan_speechlm.model.backbones.hf import PretrainedWeights, load_hf_config
from torchtitan_speechlm.model.documents import Documents
from torchtitan_speechlm.utils import upstream
from torchtitan_speechlm.utils.upstream import (
    Llama3Block,
    RoPEScalingArgs,
    ScaledDotProductAttentionWrapper,
    TransformerModelArgs,
    llama3_apply_rotary_emb,
    precompute_freqs_cis,
)

# our name inside the decoder -> the HF Llama checkpoint name ({} = layer)
HF_NAMES = {
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
}


def transformer_args(config: dict, attn_implementation: str = "sdpa") -> TransformerModelArgs:
    """torchtitan's llama3 args reproducing an HF Llama config exactly."""
    if config.get("model_type") != "llama":
        raise ValueError(
            f"the native backbone runs Llama configs (model_type 'llama'), not "
            f"{config.get('model_type')!r}; use the hf backbone for it"
        )
    dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if config.get("head_dim") not in (None, dim // heads):
        raise ValueError(f"native backbone: head_dim {config['head_dim']} != hidden/heads")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("native backbone: attention or MLP biases are not supported")
    scaling = rope_of(config)
    if scaling["rope_type"] not in ("default", "llama3"):
        raise ValueError(f"native backbone: RoPE {scaling} is not supported (default, llama3)")
    rope = (
        RoPEScalingArgs(
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        )
        if scaling["rope_type"] == "llama3"
        else RoPEScalingArgs(scaling_factor=1.0)
    )  # 1.0: no scaling
    base = int(2 * 4 * dim / 3)  # what FeedForward derives from dim before the multiplier
    return TransformerModelArgs(
        dim=dim,
        n_layers=int(config["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=int(config.get("num_key_value_heads") or heads),
        vocab_size=int(config["vocab_size"]),
        multiple_of=1,
        ffn_dim_multiplier=(int(config["intermediate_size"]) + 0.5) / base,
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=float(scaling["rope_theta"]),
        rope_scaling_args=rope,
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        depth_init=True,
        attn_type="flex" if attn_implementation in ("flex", "flex_attention") else "sdpa",
    )


class DocumentsInFlight:
    """The documents of the forwards in flight, by their ``positions`` tensor (a few: a
    pipeline's micro-batches), grouped by the decoder's forward outside the compiled layers, and
    the ones the next attention call of a layer attends within (``current``)."""

    def __init__(self, keep: int = 8):
        self.recent: deque = deque(maxlen=keep)  # (positions, their Documents)
        self.current: Documents | None = None

    def add(self, positions: torch.Tensor) -> None:
        """The decoder's forward, once per micro-batch (one host sync)."""
        self.of(positions)

    def of(self, positions: torch.Tensor) -> Documents:
        for seen, docs in self.recent:
            if seen is positions:
                return docs
        docs = Documents(positions)  # a caller that did not ``add`` them: computed here
        self.recent.append((positions, docs))
        return docs

    @torch.compiler.disable
    def select(self, attention: nn.Module, args: tuple) -> None:
        """Forward pre-hook of each layer's attention: the documents of the ``positions`` it
        is given (torchtitan's ``Attention.forward(x, freqs_cis, masks, positions)``). Read per
        call, not per decoder forward: activation checkpointing recomputes a layer in backward
        after the forwards of other microbatches (a pipeline's 1F1B), with that layer's own
        positions. Not traced: dynamo would guard on the tensor's identity."""
        positions = args[3] if len(args) > 3 else None
        self.current = None if positions is None else self.of(positions)


class DocumentSDPA(ScaledDotProductAttentionWrapper):
    """torchtitan's SDPA wrapper, attending within the documents that the layer's pre-hook
    selected for this call (``DocumentsInFlight.select``). Not traced by dynamo: the groups'
    shapes vary per micro-batch, so a compiled layer is split into graphs of the row's fixed
    shape around this call."""

    def __init__(self, documents: DocumentsInFlight):
        super().__init__()
        self.documents = documents

    @torch.compiler.disable
    def forward(self, q, k, v, *, scale=None, enable_gqa=False, is_causal=True):
        docs = self.documents.current
        if docs is None or not is_causal:
            return super().forward(q, k, v, scale=scale, enable_gqa=enable_gqa, is_causal=is_causal)
        b, h, t, d = q.shape
        return docs.attend(q, k, v, scale=scale).view(b, t, h, d).transpose(1, 2)


def use_document_attention(layers, documents: DocumentsInFlight) -> None:
    """Each torchtitan block's SDPA attends within the documents ``documents`` selects."""
    for layer in layers:
        layer.attention.inner_attention = DocumentSDPA(documents)
        layer.attention.register_forward_pre_hook(documents.select)


class NativeDecoder(nn.Module):
    """torchtitan's llama3 blocks + final norm (its ``layers`` / ``norm`` names, so torchtitan's
    ``apply_tp`` applies to this module as it is)."""

    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleDict({str(i): Llama3Block(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.register_buffer("freqs_cis", self._freqs(), persistent=False)
        self.tp_mesh = None  # set by the parallelize function with sequence parallelism
        self.documents = DocumentsInFlight()
        if args.attn_type == "sdpa":
            use_document_attention(self.layers.values(), self.documents)

    def _freqs(self) -> torch.Tensor:
        a = self.args
        return precompute_freqs_cis(
            a.dim // a.n_heads, a.max_seq_len, a.rope_theta, a.rope_scaling_args
        )

    def forward(self, h: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, D] -> [B, T, D]. Documents (positions restarting at 0) are kept apart by
        ``DocumentSDPA`` or by flex's block-causal BlockMask, and rotated by their own
        positions; without ``position_ids`` each row is one causal sequence."""
        t = h.shape[1]
        h = self._split(h)
        padded = h.shape[1] * self._tp_size()
        masks = positions = None
        if position_ids is not None:
            positions = torch.cat(  # a padded tail (sequence parallelism): its own document
                [position_ids, torch.arange(padded - t, device=h.device).expand(h.shape[0], -1)],
                dim=1,
            )
        if self.args.attn_type == "flex":
            masks = document_block_mask(position_ids, t, padded)
        elif positions is not None:
            self.documents.add(positions)  # grouped here, outside the compiled layers
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, attention_masks=masks, positions=positions)
        if self.norm is not None:  # None: a pipeline stage before the last
            h = self.norm(h)
        return self._gather(h)[:, :t]

    def _tp_size(self) -> int:
        return 1 if self.tp_mesh is None else self.tp_mesh.size()

    def _split(self, h: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is None:
            return h
        from torch.distributed.tensor import DTensor, Replicate, Shard

        n = self.tp_mesh.size()
        pad = (-h.shape[1]) % n  # sequence parallelism: a length the ranks divide
        if pad:
            h = torch.nn.functional.pad(h, (0, 0, 0, pad))
        return (
            DTensor.from_local(h, self.tp_mesh, [Replicate()], run_check=False)
            .redistribute(self.tp_mesh, [Shard(1)])
            .to_local()
        )

    def _gather(self, h) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if self.tp_mesh is not None and not isinstance(h, DTensor):
            # a pipeline stage without the norm: its last block's output, split over the
            # sequence (sequence parallelism)
            h = DTensor.from_local(h, self.tp_mesh, [Shard(1)], run_check=False)
        if isinstance(h, DTensor):
            h = h.redistribute(h.device_mesh, [Replicate()]).to_local()
        return h


def document_block_mask(position_ids: torch.Tensor | None, t: int, padded: int):
    """torchtitan's flex BlockMask: causal, and within one document (a run of positions from
    0) of each row; a padded tail (sequence parallelism) is a document of its own."""
    from torch.nn.attention.flex_attention import and_masks

    if position_ids is None:
        return upstream.create_attention_mask(
            upstream.get_causal_mask_mod(), 1, None, padded, padded
        )
    doc = (position_ids == 0).cumsum(-1)
    doc = torch.nn.functional.pad(doc, (0, padded - t), value=int(doc.max()) + 1)

    def same_document(b, h, q, kv):
        return doc[b, q] == doc[b, kv]

    return upstream.create_attention_mask(
        and_masks(upstream.get_causal_mask_mod(), same_document), doc.shape[0], None, padded, padded
    )


class NativeLlamaBackbone(kv_cache.StaticCacheDecoding, Backbone):
    embed_key, head_key = "model.embed_tokens.weight", "lm_head.weight"
    tensor_parallel = True
    pipeline_parallel = True

    def read_config(self, path: str) -> dict:
        config = load_hf_config(path).to_dict()
        transformer_args(config)  # refuse what the native blocks cannot reproduce, early
        return config

    def build(self, config: dict, attn_implementation: str) -> nn.Module:
        return NativeDecoder(transformer_args(config, attn_implementation))

    def run(self, module, inputs_embeds, position_ids, real):
        return module(inputs_embeds, position_ids), None

    def rotary(self, module):
        """(decode: the static KV cache of ``kv_cache.py``, refused under tensor parallelism)"""
        return llama3_apply_rotary_emb, module.freqs_cis

    def reset_buffers(self, module, device) -> None:
        module.freqs_cis = module._freqs().to(device)

    def weights(self, path: str):
        reader = PretrainedWeights(path)
        return reader if reader else None

    def checkpoint_key(self, name: str) -> str | None:
        if not name.startswith("backbone."):
            return None
        local = name[len("backbone.") :]
        abstract = re.sub(r"\.(\d+)\.", ".{}.", local, count=1)
        layer = re.search(r"\.(\d+)\.", local)
        key = HF_NAMES.get(abstract)
        return key.format(layer.group(1)) if key and layer else key

    def from_checkpoint(self, name: str, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        """HF's rotate-half q/k layout -> torchtitan's interleaved pairs."""
        return _permute(name, tensor, config, inverse=False)

    def to_checkpoint(self, name: str, tensor: torch.Tensor, config: dict) -> torch.Tensor:
        return _permute(name, tensor, config, inverse=True)


def _permute(name: str, w: torch.Tensor, config: dict, inverse: bool) -> torch.Tensor:
    if not name.endswith(("attention.wq.weight", "attention.wk.weight")):
        return w
    heads = int(config["num_attention_heads"])
    if name.endswith("wk.weight"):
        heads = int(config.get("num_key_value_heads") or heads)
    rows, cols = w.shape
    if inverse:  # torchtitan -> HF (Llama3StateDictAdapter._reverse_permute)
        return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


register_backbone("native", NativeLlamaBackbone())
