"""HF names <-> ours: the one place the backbone checkpoint's tensor names meet the SpeechLM's.

A SpeechLM holds a text LM inside: the backbone's decoder (the same tensors under ``backbone.``)
and the text rows of the embedding and the head (rows ``[text_offset, text_offset +
text_size)`` of our extended vocabulary). ``text_tensors`` names that part in the backbone
checkpoint's own names; the pretrained load at init (``SpeechLM.init_weights``), torchtitan's
``checkpoint.initial_load_in_hf`` / ``last_save_in_hf`` (through ``SpeechLMStateDictAdapter``) and
``torchtitan export`` all use it. The speech-only tensors (codebook rows, the per-stream offsets)
have no HF name: they live only in our checkpoints and exports.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan_speechlm.utils.upstream import StateDictAdapter

EMBED, HEAD = "tok_embeddings.weight", "head.output.weight"


def text_tensor_map(args, names) -> dict[str, tuple[str, slice | None]]:
    """{checkpoint name: (our parameter, rows of it or None)} for the text LM inside a SpeechLM
    with ``args``, among our parameter ``names``."""
    family, layout = args.family, args.layout
    rows = slice(layout.text_offset, layout.text_offset + layout.text_size)
    out: dict[str, tuple[str, slice | None]] = {}
    for name in names:
        if name == EMBED and family.embed_key:
            out[family.embed_key] = (name, rows)
        elif name == HEAD and family.head_key:
            out[family.head_key] = (name, rows)
        else:
            key = family.checkpoint_key(name)
            if key is not None:
                out[key] = (name, None)
    return out


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this rank (all-gathered if sharded)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def like(template: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``template`` (sharded the same way if it is a DTensor)."""
    if isinstance(template, DTensor):
        return distribute_tensor(
            full.to(template.dtype), template.device_mesh, template.placements, src_data_rank=None
        )
    return full.to(template.device, template.dtype)


class SpeechLMStateDictAdapter(StateDictAdapter):
    """torchtitan's StateDictAdapter for a SpeechLM: ``to_hf`` gives the text LM inside it under
    the backbone checkpoint's names (what ``last_save_in_hf`` writes, what transformers loads);
    ``from_hf`` puts such tensors back, the text rows into the extended vocabulary, keeping the
    speech rows and every other tensor as they are."""

    def __init__(self, model_args, hf_assets_path: str | None):
        super().__init__(model_args, hf_assets_path)
        self.model_args = model_args
        self._native: dict[str, Any] = {}

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.model_args.family.moe(self.model_args.backbone_config):
            raise NotImplementedError(
                "checkpoint.initial_load_in_hf / last_save_in_hf: MoE checkpoints store experts "
                "one by one while transformers' modules fuse them; load pretrained MoE weights "
                'with speechlm.init = "pretrained" and write HF folders with `torchtitan export`'
            )
        self._native = state_dict  # from_hf builds on the current values
        family, config = self.model_args.family, self.model_args.backbone_config
        hf = {}
        for key, (name, rows) in text_tensor_map(self.model_args, state_dict).items():
            value = state_dict[name]
            value = value if rows is None else full_value(value)[rows].clone()
            hf[key] = family.to_checkpoint(name, value, config)
        return hf

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {}
        mapping = text_tensor_map(self.model_args, self._native or hf_state_dict)
        for key, (name, rows) in mapping.items():
            if key not in hf_state_dict:
                continue
            value = self.model_args.family.from_checkpoint(
                name, hf_state_dict[key], self.model_args.backbone_config
            )
            if rows is None:
                out[name] = value
                continue
            current = self._native[name]
            full = full_value(current).clone()
            full[rows] = full_value(value).to(full.dtype)
            out[name] = like(current, full)
        return out
