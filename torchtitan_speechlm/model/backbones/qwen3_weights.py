"""The ``qwen3`` backbone's parameter names <-> HF Qwen3 / Qwen3-MoE checkpoint names.

The same table as torchtitan's ``Qwen3StateDictAdapter``, under the SpeechLM's ``backbone.``
prefix. Layouts need no conversion: torchtitan's qwen3 rotates q/k by halves like transformers
(``rotate_half``), so q/k rows stay in HF order (unlike llama3's interleaved pairs, see the
native backbone), and a stacked expert weight ``moe.experts.w1`` [E, hidden, dim] is the HF
per-expert ``gate_proj.weight`` [hidden, dim] of experts 0..E-1 stacked along dim 0 (w3:
``up_proj``, w2: ``down_proj`` [dim, hidden]); its key carries ``{}`` for the expert
(``backbones.stacked_keys``).
"""

from __future__ import annotations

import re

from torchtitan_speechlm.model.backbones import STACKED

LAYER = "model.layers.{layer}."
# our name inside the decoder, layer index as {layer} -> the HF name
HF_NAMES = {
    "layers.{layer}.attention.wq.weight": LAYER + "self_attn.q_proj.weight",
    "layers.{layer}.attention.wk.weight": LAYER + "self_attn.k_proj.weight",
    "layers.{layer}.attention.wv.weight": LAYER + "self_attn.v_proj.weight",
    "layers.{layer}.attention.wo.weight": LAYER + "self_attn.o_proj.weight",
    "layers.{layer}.attention.q_norm.weight": LAYER + "self_attn.q_norm.weight",
    "layers.{layer}.attention.k_norm.weight": LAYER + "self_attn.k_norm.weight",
    "layers.{layer}.attention_norm.weight": LAYER + "input_layernorm.weight",
    "layers.{layer}.ffn_norm.weight": LAYER + "post_attention_layernorm.weight",
    # dense MLP layers
    "layers.{layer}.feed_forward.w1.weight": LAYER + "mlp.gate_proj.weight",
    "layers.{layer}.feed_forward.w3.weight": LAYER + "mlp.up_proj.weight",
    "layers.{layer}.feed_forward.w2.weight": LAYER + "mlp.down_proj.weight",
    # MoE layers: the router, and each expert's MLP stacked into one parameter
    "layers.{layer}.moe.router.gate.weight": LAYER + "mlp.gate.weight",
    "layers.{layer}.moe.experts.w1": LAYER + f"mlp.experts.{STACKED}.gate_proj.weight",
    "layers.{layer}.moe.experts.w3": LAYER + f"mlp.experts.{STACKED}.up_proj.weight",
    "layers.{layer}.moe.experts.w2": LAYER + f"mlp.experts.{STACKED}.down_proj.weight",
    "norm.weight": "model.norm.weight",
}
_LAYER_INDEX = re.compile(r"^layers\.(\d+)\.")


def hf_key(name: str) -> str | None:
    """The HF checkpoint key of our parameter ``name`` (``backbone.<...>``), ``{}`` standing
    for the expert of a stacked expert weight; None for anything else."""
    if not name.startswith("backbone."):
        return None
    local = name[len("backbone.") :]
    match = _LAYER_INDEX.match(local)
    if match is None:
        return HF_NAMES.get(local)
    key = HF_NAMES.get(_LAYER_INDEX.sub("layers.{layer}.", local, count=1))
    # format only the layer: a stacked key keeps its {} for the expert
    return key.replace("{layer}", match.group(1)) if key else None
